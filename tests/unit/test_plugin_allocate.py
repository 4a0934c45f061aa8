"""Allocate: every strategy's answer, and the refusals kubelet must get for bad IDs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpunode.host import Host
from gpunode.plugin.allocate import (
    AllocateSettings,
    ContainerAllocation,
    DeviceNodes,
    Refused,
    allocate,
    read_device_nodes,
)
from gpunode.plugin.devices import DeviceRegistry, Resource, Sharing, Unit, build_resources
from gpunode.plugin.simulate import simulated_inventory


def resources(profile: str = "pcie-4", **kwargs: Any) -> tuple[Resource, ...]:
    return build_resources(simulated_inventory(profile), **kwargs)


def one(
    resource: Resource, ids: list[str], settings: AllocateSettings, registry: DeviceRegistry | None = None
) -> ContainerAllocation:
    registry = registry or DeviceRegistry([resource])
    [answer] = allocate(resource, [ids], registry.health_of, settings)
    return answer


def test_envvar_by_uuid() -> None:
    [gpu] = resources()
    ids = [gpu.devices[2].id, gpu.devices[0].id]
    answer = one(gpu, ids, AllocateSettings())
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}
    assert ids[0].startswith("GPU-")
    assert not answer.mounts and not answer.devices and not answer.cdi_devices and not answer.annotations


def test_envvar_by_index() -> None:
    [gpu] = resources(device_id_strategy="index")
    assert [d.id for d in gpu.devices] == ["0", "1", "2", "3"]
    assert one(gpu, ["3", "1"], AllocateSettings()).envs == {"NVIDIA_VISIBLE_DEVICES": "3,1"}


def test_volume_mounts() -> None:
    [gpu] = resources()
    ids = [gpu.devices[0].id, gpu.devices[1].id]
    answer = one(gpu, ids, AllocateSettings(device_list_strategy=("volume-mounts",)))
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert answer.mounts == tuple((f"/var/run/nvidia-container-devices/{i}", "/dev/null", True) for i in ids)


def test_cdi_cri_and_annotations() -> None:
    [gpu] = resources()
    ids = [gpu.devices[1].id]
    cri = one(gpu, ids, AllocateSettings(device_list_strategy=("cdi-cri",)))
    assert cri.cdi_devices == (f"nvidia.com/gpu={ids[0]}",)
    assert cri.envs == {}
    ann = one(gpu, ids, AllocateSettings(device_list_strategy=("cdi-annotations",), cdi_kind="example.com/x"))
    assert ann.annotations == {f"cdi.k8s.io/gpunode_{ids[0]}": f"example.com/x={ids[0]}"}


def test_strategies_combine() -> None:
    [gpu] = resources(device_id_strategy="index")
    answer = one(gpu, ["0"], AllocateSettings(device_list_strategy=("envvar", "cdi-cri", "cdi-annotations")))
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": "0"}
    assert answer.cdi_devices == ("nvidia.com/gpu=0",)
    assert answer.annotations == {"cdi.k8s.io/gpunode_0": "nvidia.com/gpu=0"}


def node_files(root: Path, driver_root: str = "/") -> Host:
    base = root / driver_root.lstrip("/")
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1", "nvidia2", "nvidia3"):
        (base / "dev").mkdir(parents=True, exist_ok=True)
        (base / "dev" / name).write_text("")
    return Host(root=root, env={})


@pytest.mark.parametrize("driver_root", ["/", "/run/nvidia/driver"])
def test_device_specs_only_for_nodes_that_exist(tmp_path: Path, driver_root: str) -> None:
    [gpu] = resources()
    host = node_files(tmp_path, driver_root)
    nodes = read_device_nodes(host, driver_root, [gpu])
    # nvidia-uvm-tools and nvidia-modeset do not exist on this node: not passed.
    assert nodes.control == ("/dev/nvidiactl", "/dev/nvidia-uvm")
    answer = one(gpu, [gpu.devices[2].id], AllocateSettings(pass_device_specs=True, nodes=nodes))
    prefix = "" if driver_root == "/" else driver_root
    assert answer.devices == tuple(
        (p, prefix + p, "rw") for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia2")
    )
    # Without pass-device-specs nothing is passed even though the nodes exist.
    assert one(gpu, [gpu.devices[2].id], AllocateSettings(nodes=nodes)).devices == ()


def test_mig_devices_and_their_capability_nodes(tmp_path: Path) -> None:
    by_name = {r.name: r for r in resources("mig", mig_strategy="mixed")}
    assert set(by_name) == {"nvidia.com/gpu", "nvidia.com/mig-1g.5gb", "nvidia.com/mig-2g.10gb"}
    small = by_name["nvidia.com/mig-1g.5gb"]
    device = small.devices[0]
    assert device.mig is not None and device.id.startswith("MIG-")
    caps = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig" / f"gi{device.mig.gpu_instance_id}"
    (caps / "ci0").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 66\nDeviceFileMode: 292\n")
    (caps / "ci0" / "access").write_text("DeviceFileMinor: 67\nDeviceFileMode: 292\n")
    nodes = read_device_nodes(node_files(tmp_path), "/", list(by_name.values()))
    answer = one(small, [device.id], AllocateSettings(pass_device_specs=True, nodes=nodes))
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": device.uuid}
    assert [c for c, _, _ in answer.devices] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap66",
        "/dev/nvidia-caps/nvidia-cap67",
    ]


def test_mig_by_index_names_gpu_and_slot() -> None:
    by_name = {r.name: r for r in resources("mig", mig_strategy="mixed", device_id_strategy="index")}
    assert [d.id for d in by_name["nvidia.com/mig-1g.5gb"].devices] == ["0:0", "0:1"]
    assert [d.id for d in by_name["nvidia.com/mig-2g.10gb"].devices] == ["0:2"]
    assert [d.id for d in by_name["nvidia.com/gpu"].devices] == ["1"]
    answer = one(
        by_name["nvidia.com/mig-1g.5gb"], ["0:1"], AllocateSettings(device_list_strategy=("cdi-annotations",))
    )
    assert answer.annotations == {"cdi.k8s.io/gpunode_0-1": "nvidia.com/gpu=0:1"}


def test_replicas_expose_each_gpu_once() -> None:
    [shared] = resources(sharing=Sharing(replicas=4, rename_by_default=True))
    assert shared.name == "nvidia.com/gpu.shared" and len(shared.devices) == 16
    uuid0, uuid1 = shared.devices[0].uuid, shared.devices[4].uuid
    ids = [f"{uuid0}::1", f"{uuid0}::3", f"{uuid1}::0"]
    assert one(shared, ids, AllocateSettings()).envs == {"NVIDIA_VISIBLE_DEVICES": f"{uuid0},{uuid1}"}
    with pytest.raises(Refused) as err:
        one(shared, ids, AllocateSettings(fail_requests_greater_than_one=True))
    assert err.value.code == "INVALID_ARGUMENT" and "at most 1" in err.value.message
    assert one(shared, ids[:1], AllocateSettings(fail_requests_greater_than_one=True)).envs
    # GPUs an entry leaves unshared stay whole in the resource: they may be asked for together, and only a
    # request that names a replica is limited (NVIDIA's rule).
    from gpunode.plugin.devices import SharedResource

    [partly] = resources(sharing=Sharing(resources=(SharedResource("nvidia.com/gpu", 2, devices=("0",)),)))
    whole = [d.id for d in partly.devices if d.replica is None]
    replica = next(d.id for d in partly.devices if d.replica is not None)
    limited = AllocateSettings(fail_requests_greater_than_one=True)
    assert one(partly, whole[:2], limited).envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(whole[:2])}
    with pytest.raises(Refused, match="at most 1"):
        one(partly, [whole[0], replica], limited)


def test_unknown_ids_are_refused_by_name() -> None:
    [gpu] = resources()
    with pytest.raises(Refused) as err:
        one(gpu, [gpu.devices[0].id, "GPU-nonexistent"], AllocateSettings())
    assert err.value.code == "INVALID_ARGUMENT"
    assert "'GPU-nonexistent'" in err.value.message and "nvidia.com/gpu" in err.value.message


@pytest.mark.parametrize("ids", [[], ["X", "X"]])
def test_empty_and_duplicate_requests_are_refused(ids: list[str]) -> None:
    [gpu] = resources(device_id_strategy="index")
    with pytest.raises(Refused) as err:
        one(gpu, ["0", "0"] if ids else [], AllocateSettings())
    assert err.value.code == "INVALID_ARGUMENT"


def test_unhealthy_devices_are_refused_with_the_reason() -> None:
    [shared] = resources(sharing=Sharing(replicas=2))
    registry = DeviceRegistry([shared])
    registry.mark(Unit(1), "Xid 79 (GPU has fallen off the bus)")
    bad = next(d for d in shared.devices if d.gpu_index == 1 and d.replica == 1)
    with pytest.raises(Refused) as err:
        one(shared, [bad.id], AllocateSettings(), registry)
    assert err.value.code == "FAILED_PRECONDITION"
    assert bad.id in err.value.message and "Xid 79" in err.value.message
    good = next(d for d in shared.devices if d.gpu_index == 0)
    assert one(shared, [good.id], AllocateSettings(), registry).envs


def test_several_containers_and_all_or_nothing() -> None:
    [gpu] = resources(device_id_strategy="index")
    registry = DeviceRegistry([gpu])
    answers = allocate(gpu, [["0"], ["1", "2"]], registry.health_of, AllocateSettings())
    assert [a.envs["NVIDIA_VISIBLE_DEVICES"] for a in answers] == ["0", "1,2"]
    with pytest.raises(Refused):
        allocate(gpu, [["0"], ["9"]], registry.health_of, AllocateSettings())


def test_host_paths_under_driver_root() -> None:
    assert (
        DeviceNodes(driver_root="/run/nvidia/driver").host_path("/dev/nvidia0")
        == "/run/nvidia/driver/dev/nvidia0"
    )
    assert DeviceNodes().host_path("/dev/nvidia0") == "/dev/nvidia0"


def test_health_marks_follow_their_gpu_across_a_reload() -> None:
    from dataclasses import replace

    inventory = simulated_inventory("pcie-4")
    [before] = build_resources(inventory)
    registry = DeviceRegistry([before])
    registry.mark(Unit(1), "Xid 79")
    failed_uuid = before.devices[1].uuid
    # After the reload the driver enumerates the GPUs in another order, and GPU 3 is gone.
    shuffled = tuple(replace(g, index=i) for i, g in enumerate(reversed(inventory.gpus[:3])))
    [after] = build_resources(replace(inventory, gpus=shuffled))
    registry.replace([after])
    unhealthy = {s.device.uuid for s in registry.snapshot("nvidia.com/gpu")[1] if not s.healthy}
    assert unhealthy == {failed_uuid}
    registry.mark(Unit(0), "lost")  # now GPU 0 is the old GPU 2; drop it on the next reload
    only = replace(inventory, gpus=(replace(inventory.gpus[1], index=0),))
    registry.replace([build_resources(only)[0]])
    assert registry.unhealthy_units() == {Unit(0): "Xid 79"}
