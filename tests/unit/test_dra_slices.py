"""ResourceSlices built from what discovery reads through the real pynvml from the fake library: valid under
the test API server's rules (tests/kubeapi/dra.py, kube-apiserver 1.36's validation), named and attributed
as NVIDIA's DRA driver publishes them (shared/specs/dra-nvidia-compat.md), split within the API's limits."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpunode.dra.slices import (
    SliceSettings,
    Trouble,
    build_slices,
    left_out,
    nvlink_domains,
    quantity,
    semver,
)
from gpunode.errors import ConfigError
from gpunode.host import Host
from gpunode.nvml import discover
from gpunode.nvml.model import Gpu, GpuPair, Inventory, MigAttributes, MigDevice, MigMode, MigPlacement
from tests import fakenvml
from tests.kubeapi.apiserver import _Answer
from tests.kubeapi.dra import SLICES, _checked_object, _validate

NODE = "gpu-node-1"
SETTINGS = SliceSettings(node_name=NODE)
PROFILES = ("dgx-a100", "pcie-4", "pairs-4", "mig", "h100", "old-driver")
SINCE = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def assert_valid(obj: dict[str, Any]) -> None:
    """The slice as kube-apiserver would take it on create, or the test fails with its 422 Status."""
    try:
        _validate(SLICES, _checked_object(SLICES, obj), None)
    except _Answer as answer:
        pytest.fail(f"the API server refuses the slice: {json.dumps(answer.body)}")


def devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found = [d for s in slices for d in s["spec"]["devices"]]
    named = {d["name"]: d for d in found}
    assert len(named) == len(found), "device names repeat across the pool"
    return named


def read(fake_nvml: Callable[..., None], tmp_path: Path, profile: str | None = None, **kw: Any) -> Inventory:
    fake_nvml(profile, **kw)
    # An empty root: no /sys, so NUMA nodes come from NVML and no PCIe root is known.
    return discover(Host(root=tmp_path))


EXPECTED_NAMES = {
    "dgx-a100": [f"gpu-{i}" for i in range(8)],
    "pcie-4": [f"gpu-{i}" for i in range(4)],
    "pairs-4": [f"gpu-{i}" for i in range(4)],
    "mig": ["gpu-0-mig-1g5gb-19-0", "gpu-0-mig-1g5gb-19-1", "gpu-0-mig-2g10gb-14-2", "gpu-1"],
    "h100": ["gpu-0"],
    "old-driver": [f"gpu-{i}" for i in range(4)],
}


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_gives_valid_slices_named_as_nvidias(
    profile: str, fake_nvml: Callable[..., None], tmp_path: Path
) -> None:
    inv = read(fake_nvml, tmp_path, profile)
    slices = build_slices(inv, {}, SETTINGS, generation=3)
    assert len(slices) == 1
    for s in slices:
        assert_valid(s)
        assert s["spec"]["nodeName"] == NODE
        assert s["spec"]["driver"] == "gpu.nvidia.com"
        assert s["spec"]["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert list(devices(slices)) == EXPECTED_NAMES[profile]
    # The same inputs give the same objects: an unchanged node republishes nothing new.
    assert build_slices(inv, {}, SETTINGS, generation=3) == slices


def test_full_gpu_attributes_are_nvidias(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    inv = read(fake_nvml, tmp_path, "dgx-a100")
    gpu0 = devices(build_slices(inv, {}, SETTINGS, 0))["gpu-0"]
    domain = gpu0["attributes"].pop("nvlinkDomain")["string"]
    assert gpu0 == {
        "name": "gpu-0",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": inv.gpus[0].uuid},
            "productName": {"string": "NVIDIA A100-SXM4-80GB"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Ampere"},
            "cudaComputeCapability": {"version": "8.0.0"},
            "driverVersion": {"version": "550.54.15"},
            "cudaDriverVersion": {"version": "12.4.0"},
            "resource.kubernetes.io/pciBusID": {"string": "0000:07:00.0"},
            "resource.kubernetes.io/numaNode": {"int": 0},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }
    assert domain.startswith("nvlink-")
    # Brand and architecture as NVIDIA spells them for another model.
    l4 = devices(build_slices(read(fake_nvml, tmp_path, "pcie-4"), {}, SETTINGS, 0))["gpu-2"]["attributes"]
    assert l4["architecture"] == {"string": "Ada Lovelace"}
    assert l4["resource.kubernetes.io/numaNode"] == {"int": 1}
    a6000 = devices(build_slices(read(fake_nvml, tmp_path, "pairs-4"), {}, SETTINGS, 0))["gpu-0"]
    assert a6000["attributes"]["brand"] == {"string": "NvidiaRTX"}


def test_mig_devices_carry_profile_parent_and_capacity(
    fake_nvml: Callable[..., None], tmp_path: Path
) -> None:
    inv = read(fake_nvml, tmp_path, "mig")
    found = devices(build_slices(inv, {}, SETTINGS, 0))
    mig = found["gpu-0-mig-2g10gb-14-2"]
    parent = inv.gpus[0]
    assert mig["attributes"]["type"] == {"string": "mig"}
    assert mig["attributes"]["uuid"] == {"string": parent.mig_devices[2].uuid}
    assert mig["attributes"]["parentUUID"] == {"string": parent.uuid}
    assert mig["attributes"]["profile"] == {"string": "2g.10gb"}
    assert mig["attributes"]["productName"] == {"string": "NVIDIA A100-SXM4-40GB"}
    assert mig["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:07:00.0"}
    assert "nvlinkDomain" not in mig["attributes"]
    assert mig["capacity"] == {
        "multiprocessors": {"value": "28"},
        "copyEngines": {"value": "2"},
        "decoders": {"value": "1"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "0"},
        "ofaEngines": {"value": "0"},
        "memory": {"value": "9984Mi"},
        "memorySlice2": {"value": "1"},
        "memorySlice3": {"value": "1"},
    }
    # MIG on: GPU 0 itself is not offered; GPU 1 (MIG off) is, whole.
    assert "gpu-0" not in found
    assert found["gpu-1"]["attributes"]["type"] == {"string": "gpu"}


def test_mig_created_at_run_time_gets_the_first_free_placement(
    fake_nvml: Callable[..., None], tmp_path: Path
) -> None:
    control = tmp_path / "control"
    control.write_text("mig-create 0 3g.20gb 2\n")
    root = tmp_path / "root"
    root.mkdir()
    inv = read(fake_nvml, root, "mig", control=control)
    # 1g at 0 and 1, 2g at 2-3: a 3g.20gb (4 memory slices) fits only at 4.
    assert "gpu-0-mig-3g20gb-9-4" in devices(build_slices(inv, {}, SETTINGS, 0))


def test_an_unanswered_property_leaves_only_that_attribute_out(
    fake_nvml: Callable[..., None], tmp_path: Path
) -> None:
    config = tmp_path / "machine.ini"
    config.write_text(
        "[system]\ndriver_version = 535.104.05\ncuda_version = 12020\n"
        "unsupported = nvmlDeviceGetBrand, nvmlDeviceGetMemoryInfo, nvmlDeviceGetNumaNodeId\n"
        "[gpu]\nname = NVIDIA L4\narchitecture = 8\ncc = 8.9\n"
        "[gpu]\nname = NVIDIA L4\narchitecture = 8\ncc = 8.9\n"
        "unsupported = nvmlDeviceGetCudaComputeCapability\n"
    )
    root = tmp_path / "root"
    root.mkdir()
    inv = read(fake_nvml, root, config=config)
    slices = build_slices(inv, {}, SETTINGS, 0)
    for s in slices:
        assert_valid(s)
    found = devices(slices)
    assert list(found) == ["gpu-0", "gpu-1"]
    for device in found.values():
        attributes = device["attributes"]
        assert "brand" not in attributes
        assert "resource.kubernetes.io/numaNode" not in attributes
        assert "capacity" not in device
        assert attributes["productName"] == {"string": "NVIDIA L4"}
        # The API takes no leading zero in a version: NVIDIA's "05" patch level is written 5.
        assert attributes["driverVersion"] == {"version": "535.104.5"}
    assert found["gpu-0"]["attributes"]["cudaComputeCapability"] == {"version": "8.9.0"}
    assert "cudaComputeCapability" not in found["gpu-1"]["attributes"]


def test_pcie_root_comes_from_sysfs_under_the_root(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    device = tmp_path / "sys/devices/pci0000:06/0000:06:01.0/0000:07:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("0\n")
    links = tmp_path / "sys/bus/pci/devices"
    links.mkdir(parents=True)
    os.symlink("../../../devices/pci0000:06/0000:06:01.0/0000:07:00.0", links / "0000:07:00.0")
    fake_nvml("dgx-a100")
    inv = discover(Host(root=tmp_path))
    found = devices(build_slices(inv, {}, SETTINGS, 0))
    assert found["gpu-0"]["attributes"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:06"}
    # GPU 1's bus (0F) has no sysfs entry here: no pcieRoot, nothing else lost.
    assert "resource.kubernetes.io/pcieRoot" not in found["gpu-1"]["attributes"]
    assert found["gpu-1"]["attributes"]["uuid"] == {"string": inv.gpus[1].uuid}


def gpu(index: int, *, mig: bool = False, uuid: str | None = None) -> Gpu:
    migs = tuple(
        MigDevice(
            parent_index=index,
            index=slot,
            uuid=f"MIG-{index:04d}-{slot}",
            name="NVIDIA A100-SXM4-40GB MIG 1g.5gb",
            profile="1g.5gb",
            memory_total=4864 * 2**20,
            gpu_instance_id=7 + slot,
            compute_instance_id=0,
            placement=MigPlacement(profile_id=19, start=slot, size=1),
            attributes=MigAttributes(14, 1, 0, 0, 0, 0, 1, 1, 4864),
        )
        for slot in range(7 if mig else 0)
    )
    return Gpu(
        index=index,
        uuid=uuid or f"GPU-{index:08d}",
        name="NVIDIA A100-SXM4-40GB",
        memory_total=40960 * 2**20,
        pci_bus_id=f"00000000:{index // 32:02X}:{index % 32:02X}.0",
        minor=index,
        numa_node=index % 2,
        compute_capability=(8, 0),
        architecture="Ampere",
        mig_capable=True,
        mig_mode=MigMode(current=mig, pending=mig),
        mig_devices=migs,
        brand=14,
    )


def inventory(gpus: list[Gpu], pairs: tuple[GpuPair, ...] = ()) -> Inventory:
    return Inventory(
        driver_version="550.54.15",
        cuda_driver_version=(12, 4),
        nvml_version=None,
        gpus=tuple(gpus),
        pairs=pairs,
    )


def test_200_gpus_are_split_into_slices_of_128() -> None:
    inv = inventory([gpu(i) for i in range(200)])
    slices = build_slices(inv, {}, SETTINGS, generation=7)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 72]
    for s in slices:
        assert_valid(s)
        assert s["spec"]["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 2}
    assert len({s["metadata"]["name"] for s in slices}) == 2
    assert list(devices(slices)) == [f"gpu-{i}" for i in range(200)]


def test_200_mig_devices_with_a_taint_are_split_into_slices_of_64() -> None:
    inv = inventory([gpu(i, mig=True) for i in range(29)])  # 203 MIG devices
    health = {"GPU-00000005": [Trouble("xid", SINCE, 79)]}
    slices = build_slices(inv, health, SETTINGS, generation=0)
    assert [len(s["spec"]["devices"]) for s in slices] == [64, 64, 64, 11]
    for s in slices:
        assert_valid(s)
        assert s["spec"]["pool"]["resourceSliceCount"] == 4
    found = devices(slices)
    assert len(found) == 203
    assert "gpu-28-mig-1g5gb-19-6" in found
    # Without the taint, 128 fit in a slice again.
    assert [len(s["spec"]["devices"]) for s in build_slices(inv, {}, SETTINGS, 0)] == [128, 75]


def test_taints_per_health_state() -> None:
    inv = inventory([gpu(0), gpu(1), gpu(2), gpu(3), gpu(4, mig=True)])
    health = {
        "GPU-00000000": [Trouble("xid", SINCE, 48), Trouble("xid", SINCE + 5, 79)],
        "GPU-00000001": [Trouble("xid", SINCE, 13)],  # an application error: noted, not avoided
        "GPU-00000002": [Trouble("lost", SINCE)],
        "GPU-00000003": [Trouble("unmonitored", SINCE)],
        "GPU-00000004": [Trouble("xid", SINCE, 94)],
        "MIG-0004-3": [Trouble("unmonitored", SINCE)],
    }
    slices = build_slices(inv, health, SETTINGS, 0)
    for s in slices:
        assert_valid(s)
    found = devices(slices)
    stamp = "2026-01-01T00:00:00Z"
    assert found["gpu-0"]["taints"] == [
        {
            "key": "gpu.nvidia.com/xid",
            "value": "79",
            "effect": "NoSchedule",
            "timeAdded": "2026-01-01T00:00:05Z",
        }
    ]
    assert found["gpu-1"]["taints"] == [
        {"key": "gpu.nvidia.com/xid", "value": "13", "effect": "None", "timeAdded": stamp}
    ]
    assert found["gpu-2"]["taints"] == [
        {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule", "timeAdded": stamp}
    ]
    assert found["gpu-3"]["taints"] == [
        {"key": "gpu.nvidia.com/unmonitored", "effect": "None", "timeAdded": stamp}
    ]
    # A GPU's Xid taints every MIG device on it; a MIG device's own state only that one.
    xid94 = {"key": "gpu.nvidia.com/xid", "value": "94", "effect": "NoSchedule", "timeAdded": stamp}
    assert all(found[f"gpu-4-mig-1g5gb-19-{s}"]["taints"][0] == xid94 for s in range(7))
    assert len(found["gpu-4-mig-1g5gb-19-3"]["taints"]) == 2
    assert len(found["gpu-4-mig-1g5gb-19-2"]["taints"]) == 1
    # The operator asks for eviction of a lost GPU's pods.
    evicting = replace(SETTINGS, lost_effect="NoExecute")
    assert devices(build_slices(inv, health, evicting, 0))["gpu-2"]["taints"][0]["effect"] == "NoExecute"
    # Healthy again: no taint at all.
    assert all("taints" not in d for d in devices(build_slices(inv, {}, SETTINGS, 0)).values())


def test_taint_time_stays_while_the_state_lasts() -> None:
    inv = inventory([gpu(0)])
    health = {"GPU-00000000": [Trouble("lost", SINCE + 0.9)]}
    first = build_slices(inv, health, SETTINGS, 0)
    assert first == build_slices(inv, health, SETTINGS, 0)
    assert devices(first)["gpu-0"]["taints"][0]["timeAdded"] == "2026-01-01T00:00:00Z"


@pytest.mark.parametrize(
    ("profile", "groups"),
    [("dgx-a100", [[0, 1, 2, 3, 4, 5, 6, 7]]), ("pairs-4", [[0, 1], [2, 3]]), ("pcie-4", []), ("h100", [])],
)
def test_nvlink_domains(
    profile: str, groups: list[list[int]], fake_nvml: Callable[..., None], tmp_path: Path
) -> None:
    inv = read(fake_nvml, tmp_path, profile)
    found = devices(build_slices(inv, {}, SETTINGS, 0))
    domains = {name: d["attributes"].get("nvlinkDomain", {}).get("string") for name, d in found.items()}
    expected_members = {f"gpu-{i}" for group in groups for i in group}
    assert {n for n, d in domains.items() if d is not None} == expected_members
    names = [{domains[f"gpu-{i}"] for i in group} for group in groups]
    assert all(len(n) == 1 for n in names)
    assert len({next(iter(n)) for n in names}) == len(groups)
    # The same GPUs on the next start: the same domains.
    assert nvlink_domains(read(fake_nvml, tmp_path, profile)) == nvlink_domains(inv)


def test_nvlink_domain_from_the_nvswitch_fabric(fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    cluster = "6b1c6a3e-1f0e-4d2b-9a77-0c5d2e8f4a11"
    h100 = "[gpu]\nname = NVIDIA H100 80GB HBM3\narchitecture = 9\ncc = 9.0\n"
    config = tmp_path / "machine.ini"
    config.write_text(
        "[system]\ndriver_version = 560.35.03\ncuda_version = 12060\n"
        + "".join(
            f"{h100}fabric_state = 3\nfabric_clique = {clique}\nfabric_cluster_uuid = {cluster}\n"
            for clique in (1, 1, 2)
        )
        + f"{h100}fabric_state = 2\nfabric_clique = 2\nfabric_cluster_uuid = {cluster}\n"  # still registering
    )
    root = tmp_path / "root"
    root.mkdir()
    inv = read(fake_nvml, root, config=config)
    slices = build_slices(inv, {}, SETTINGS, 0)
    for s in slices:
        assert_valid(s)
    found = devices(slices)
    assert [found[f"gpu-{i}"]["attributes"].get("nvlinkDomain") for i in range(4)] == [
        {"string": f"{cluster}.1"},
        {"string": f"{cluster}.1"},
        {"string": f"{cluster}.2"},
        None,
    ]


def test_a_device_without_a_name_is_left_out_and_said_so() -> None:
    nameless = replace(gpu(1), minor=None)
    lost = Gpu(index=2, uuid=None, lost=True)
    unplaced = gpu(3, mig=True)
    unplaced = replace(unplaced, mig_devices=(replace(unplaced.mig_devices[0], placement=None),))
    inv = inventory([gpu(0), nameless, lost, unplaced])
    assert list(devices(build_slices(inv, {}, SETTINGS, 0))) == ["gpu-0"]
    assert left_out(inv) == [
        "GPU 1: left out, NVML did not say its minor number",
        "GPU 2: left out, NVML did not say its minor number",
        "GPU 3 MIG device 0: left out, NVML did not say its MIG profile or GPU instance placement",
    ]


def test_a_node_without_gpus_still_has_its_pool() -> None:
    slices = build_slices(inventory([]), {}, SETTINGS, 2)
    assert len(slices) == 1
    assert_valid(slices[0])
    assert slices[0]["spec"]["devices"] == []


def test_a_long_node_name_gives_valid_slice_names() -> None:
    node = ".".join(["a" * 62] * 4)[:253].rstrip(".")
    slices = build_slices(inventory([gpu(0)]), {}, SliceSettings(node_name=node, node_uid="u-1"), 0)
    assert_valid(slices[0])
    assert slices[0]["metadata"]["ownerReferences"][0]["kind"] == "Node"


@pytest.mark.parametrize(
    "settings",
    [
        {"node_name": "Bad_Node"},
        {"node_name": "n", "driver": "gpu/nvidia"},
        {"node_name": "n", "lost_effect": "Evict"},
    ],
)
def test_bad_settings_are_a_config_error(settings: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        SliceSettings(**settings)
    assert info.value.fix


def test_quantities_and_versions() -> None:
    assert quantity(40 * 2**30) == "40Gi"
    assert quantity(23034 * 2**20) == "23034Mi"
    assert quantity(1000) == "1000"
    assert semver("535.104.05") == "535.104.5"
    assert semver("470.82") == "470.82.0"
    assert semver("not a version") is None


def test_fake_library_serves_the_new_calls(fake_nvml: Callable[..., None]) -> None:
    # The GPU instance placement and fabric calls exist in the fake with NVML's error codes.
    fake_nvml("dgx-a100")
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError) as info:
            pynvml.nvmlDeviceGetGpuInstanceById(handle, 1)
        assert info.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED  # MIG is off
        assert pynvml.nvmlDeviceGetBrand(handle) == pynvml.NVML_BRAND_NVIDIA
    finally:
        pynvml.nvmlShutdown()
    assert fakenvml.last_error() == ""
