"""NVML discovery through the REAL pynvml against the fake libnvidia-ml.so.1."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.errors import DriverNotLoaded, NvmlError
from gpunode.host import Host
from gpunode.nvml import TopologyLevel, discover, sysfs_pci_address

GIB = 1024**3
REPO = Path(__file__).resolve().parents[2]


def test_dgx_a100_inventory(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("dgx-a100")
    inv = discover(Host(root=tmp_path))
    assert inv.driver_version == "550.54.15"
    assert inv.cuda_driver_version == (12, 4)
    assert len(inv.gpus) == 8
    assert len({g.uuid for g in inv.gpus}) == 8
    g0 = inv.gpus[0]
    assert g0.name == "NVIDIA A100-SXM4-80GB"
    assert g0.memory_total == 80 * GIB
    assert g0.pci_bus_id == "00000000:07:00.0"
    assert [g.minor for g in inv.gpus] == list(range(8))
    assert [g.device_path for g in inv.gpus][:2] == ["/dev/nvidia0", "/dev/nvidia1"]
    assert g0.compute_capability == (8, 0) and g0.architecture == "Ampere"
    assert g0.mig_mode is not None and not g0.mig_mode.current and g0.mig_devices == ()
    assert g0.persistence_mode is True
    assert (g0.ecc_uncorrected_volatile, g0.retired_pages_pending, g0.remapped_rows_pending) == (
        0,
        False,
        False,
    )
    # No sysfs under the temp root: NUMA comes from NVML.
    assert [g.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_dgx_a100_topology_is_nvswitch_all_to_all(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("dgx-a100")
    inv = discover(Host(root=tmp_path))
    assert len(inv.pairs) == 28
    assert all(p.nvlinks == 12 for p in inv.pairs)
    assert inv.pair(1, 0) is inv.pair(0, 1)
    levels = {(p.a, p.b): p.level for p in inv.pairs}
    assert levels[(0, 1)] is TopologyLevel.SINGLE  # same PCIe switch
    assert levels[(0, 2)] is TopologyLevel.HOSTBRIDGE
    assert levels[(0, 4)] is TopologyLevel.SYSTEM  # across sockets


def test_pairs_of_nvlink_bridges(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("pairs-4")
    inv = discover(Host(root=tmp_path))
    links = {(p.a, p.b): p.nvlinks for p in inv.pairs}
    assert links == {(0, 1): 4, (0, 2): 0, (0, 3): 0, (1, 2): 0, (1, 3): 0, (2, 3): 4}


def test_links_to_a_lost_gpu_do_not_join_its_neighbours(
    fake_nvml: Callable[..., None], tmp_path: Path
) -> None:
    # 0 <-> 1 <-> 2 by NVLink bridges, and GPU 1 is lost: 0 and 2 have no link between them.
    config = tmp_path / "nvml.conf"
    gpu = "[gpu]\nname = NVIDIA A100-SXM4-80GB\nmemory_total = 80 GiB\n"
    config.write_text(
        "[system]\n"
        + gpu + "pci_bus_id = 00000000:01:00.0\nnvlink = 00000000:02:00.0*4\n"
        + gpu + "pci_bus_id = 00000000:02:00.0\nnvlink = 00000000:01:00.0*4, 00000000:03:00.0*4\nlost = 1\n"
        + gpu + "pci_bus_id = 00000000:03:00.0\nnvlink = 00000000:02:00.0*4\n"
    )  # fmt: skip
    fake_nvml(config=config)
    inv = discover(Host(root=tmp_path))
    assert inv.gpus[1].lost
    assert {(p.a, p.b): p.nvlinks for p in inv.pairs} == {(0, 2): 0}


def test_pcie_numa_from_sysfs_wins_over_nvml(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("pcie-4")
    first = discover(Host(root=tmp_path))
    assert all(p.nvlinks == 0 for p in first.pairs)
    assert [g.numa_node for g in first.gpus] == [0, 0, 1, 1]
    # The kernel's view (sysfs, 4-digit domain) is what kubelet's topology manager uses.
    bus = first.gpus[0].pci_bus_id
    assert bus is not None
    numa = tmp_path / "sys/bus/pci/devices" / sysfs_pci_address(bus) / "numa_node"
    numa.parent.mkdir(parents=True)
    numa.write_text("3\n")
    nonuma = (
        tmp_path / "sys/bus/pci/devices" / sysfs_pci_address(first.gpus[1].pci_bus_id or "") / "numa_node"
    )
    nonuma.parent.mkdir(parents=True)
    nonuma.write_text("-1\n")  # a single-socket machine: no NUMA affinity
    second = discover(Host(root=tmp_path))
    assert [g.numa_node for g in second.gpus] == [3, None, 1, 1]


def test_sysfs_pci_address() -> None:
    assert sysfs_pci_address("00000000:07:00.0") == "0000:07:00.0"
    assert sysfs_pci_address("00000001:C4:00.0") == "0001:c4:00.0"


def test_mig_devices(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("mig")
    inv = discover(Host(root=tmp_path))
    g0, g1 = inv.gpus
    assert g0.mig_mode is not None and g0.mig_mode.current
    assert [m.profile for m in g0.mig_devices] == ["1g.5gb", "1g.5gb", "2g.10gb"]
    assert [m.gpu_instance_id for m in g0.mig_devices] == [7, 8, 3]
    assert all(m.uuid.startswith("MIG-") and m.parent_index == 0 for m in g0.mig_devices)
    assert g0.mig_devices[2].memory_total == 9984 * 1024**2
    assert g1.mig_capable and g1.mig_mode is not None and not g1.mig_mode.current and g1.mig_devices == ()


def test_inventory_is_immutable(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("h100")
    inv = discover(Host(root=tmp_path))
    assert inv.gpus[0].architecture == "Hopper" and inv.cuda_driver_version == (12, 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inv.gpus[0].name = "x"  # type: ignore[misc]


def test_no_gpu(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("no-gpu")
    inv = discover(Host(root=tmp_path))
    assert inv.gpus == () and inv.pairs == () and inv.driver_version


def test_driver_not_loaded_is_a_clear_error(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("no-driver")
    with pytest.raises(DriverNotLoaded) as info:
        discover(Host(root=tmp_path))
    assert "Driver Not Loaded" in info.value.message
    assert info.value.fix and "modprobe nvidia" in info.value.fix


def test_version_mismatch_is_a_clear_error(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("init-fail")
    with pytest.raises(NvmlError) as info:
        discover(Host(root=tmp_path))
    assert "version mismatch" in info.value.message
    assert info.value.fix and "reboot" in info.value.fix


def test_a_lost_gpu_does_not_stop_discovery(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("lost-gpu")
    inv = discover(Host(root=tmp_path))
    assert [g.lost for g in inv.gpus] == [False, False, True, False]
    assert inv.gpus[3].name == "NVIDIA L4"
    assert all(2 not in (p.a, p.b) for p in inv.pairs)


def test_gpu_lost_mid_run_via_control_file(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.write_text("lost 1\n")
    fake_nvml("pcie-4", control=control)
    inv = discover(Host(root=tmp_path))
    assert [g.lost for g in inv.gpus] == [False, True, False, False]


def test_old_driver_facts_become_unknown(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml("old-driver")
    inv = discover(Host(root=tmp_path))
    g = inv.gpus[0]
    assert g.name == "NVIDIA L4" and g.uuid
    assert g.persistence_mode is None and g.mig_mode is None and g.remapped_rows_pending is None
    assert g.numa_node is None  # no sysfs here and the driver lacks nvmlDeviceGetNumaNodeId
    joined = "\n".join(inv.unknown)
    assert "GPU 0 NUMA node: not implemented by this driver's NVML" in joined
    assert "GPU 0 persistence mode: not supported by this GPU/driver" in joined


def test_gpu_without_permission(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    config = tmp_path / "nvml.conf"
    config.write_text(
        "[system]\ndriver_version = 535.161.08\ncuda_version = 12020\n"
        "[gpu]\nname = Tesla T4\nmemory_total = 15360 MiB\n"
        "[gpu]\nname = Tesla T4\nmemory_total = 15360 MiB\nhandle_error = 4\n"
    )
    fake_nvml(config=config)
    inv = discover(Host(root=tmp_path))
    assert inv.gpus[0].usable and inv.gpus[0].name == "Tesla T4"
    assert not inv.gpus[1].usable and "permission denied" in (inv.gpus[1].error or "")


def test_library_not_found_is_a_clear_error(tmp_path: Path) -> None:
    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a real NVML library")  # only a real-GPU machine can skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NVML", "LD_LIBRARY_PATH"))}
    code = (
        "from gpunode.nvml import discover\n"
        "from gpunode.errors import NvmlLibraryNotFound\n"
        "try:\n    discover()\nexcept NvmlLibraryNotFound as e:\n    print('NOTFOUND', e.message)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "NOTFOUND libnvidia-ml.so.1 (NVML) was not found" in out.stdout
