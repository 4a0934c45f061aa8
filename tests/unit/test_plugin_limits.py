"""What a caller can make the plugin do is bounded: request sizes, work per request, log lines, replicas,
kubelet's message limit, and calls whose caller has given up (issue 13). Real handlers, real protobuf
messages; the gRPC context is the one stand-in, for the deadline a test cannot time."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
import pytest

from gpunode.errors import ConfigError
from gpunode.host import Host
from gpunode.plugin import preferred as preferred_module
from gpunode.plugin import server
from gpunode.plugin.allocate import AllocateSettings, Refused, allocate
from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.config import MAX_REPLICAS, load_config
from gpunode.plugin.devices import DeviceRegistry, PluginDevice, Resource, Sharing, build_resources
from gpunode.plugin.lifecycle import KUBELET_MAX_MESSAGE, check_message_sizes
from gpunode.plugin.logsafe import shown, shown_ids
from gpunode.plugin.preferred import Topology, preferred_allocation
from gpunode.plugin.server import DevicePluginService, ServeSettings
from gpunode.plugin.simulate import simulated_inventory


def dgx(replicas: int = 1) -> Resource:
    [resource] = build_resources(simulated_inventory("dgx-a100"), sharing=Sharing(replicas=replicas))
    return resource


# -- log lines and error messages --------------------------------------------------------------------


def test_request_text_is_escaped_and_bounded() -> None:
    assert shown("GPU-1\nINFO forged line") == "GPU-1\\nINFO forged line"
    assert shown("a\x1b[31mred\r") == "a\\x1b[31mred\\r"
    assert shown("line\u2028sep") == "line\\u2028sep"
    assert shown("C:\\n") == "C:\\\\n"  # a literal backslash-n cannot pass for an escaped newline
    long = shown("x" * 1_000_000)
    assert long.startswith("x" * 80) and long.endswith("(999920 more characters)") and len(long) < 120
    assert (
        shown_ids([f"id{n}" for n in range(1000)]) == ",".join(f"id{n}" for n in range(8)) + " and 992 more"
    )


def test_an_unknown_id_is_named_escaped_and_bounded_in_the_refusal() -> None:
    gpu = dgx()
    registry = DeviceRegistry([gpu])
    with pytest.raises(Refused) as refused:
        allocate(gpu, [["GPU-x\nINFO forged: allocated everything"]], registry.health_of, AllocateSettings())
    assert refused.value.code == "INVALID_ARGUMENT"
    assert "\n" not in refused.value.message
    assert "'GPU-x\\nINFO forged: allocated everything'" in refused.value.message
    with pytest.raises(Refused) as refused:
        allocate(gpu, [["y" * 4_000_000]], registry.health_of, AllocateSettings())
    assert len(refused.value.message) < 300


def test_more_ids_than_devices_is_refused_before_any_lookup() -> None:
    gpu = dgx()
    registry = DeviceRegistry([gpu])
    looked_up: list[PluginDevice] = []

    def health(device: PluginDevice) -> Any:
        looked_up.append(device)
        return registry.health_of(device)

    ids = [gpu.devices[0].id] * 50_000  # the same ID over and over: also a duplicate, in one pass
    with pytest.raises(Refused) as refused:
        allocate(gpu, [ids], health, AllocateSettings())
    assert refused.value.message == "Allocate names 50000 device IDs, but nvidia.com/gpu has only 8 devices"
    assert looked_up == []


def test_duplicates_are_found_in_one_pass_and_named_bounded() -> None:
    gpu = dgx(replicas=1024)  # 8192 devices
    registry = DeviceRegistry([gpu])
    ids = [d.id for d in gpu.devices[:4000]] * 2
    with pytest.raises(Refused) as refused:
        allocate(gpu, [ids], registry.health_of, AllocateSettings())
    assert refused.value.message.startswith("device ID ") and "and 3992 more requested more than once" in (
        refused.value.message
    )


def test_preferred_allocation_keeps_unknown_ids_out_of_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of unknown IDs used to be thousands of units in a quadratic search (seconds, hundreds of
    MB); now the search sees the known devices only and unknown ones are the filler."""
    gpu = dgx()
    topology = Topology.from_inventory(simulated_inventory("dgx-a100"))
    sizes: list[int] = []
    solve = preferred_module._solve

    def counting(problem: Any) -> list[int]:
        sizes.append(problem.n)
        return solve(problem)

    monkeypatch.setattr(preferred_module, "_solve", counting)
    known = [d.id for d in gpu.devices]
    ghosts = [f"ghost-{n}" for n in range(3000)]
    got = preferred_allocation(topology, gpu.by_id(), ghosts + known, ["ghost-must"], 5)
    assert sizes == [8]  # the 8 GPUs, nothing else
    assert got[0] == "ghost-must" and set(got[1:]) <= set(known) and len(got) == 5
    # Known devices run out: the first unknown ones fill up, without any search.
    got = preferred_allocation(topology, gpu.by_id(), ghosts + known, [], 10)
    assert sizes == [8] and got == ghosts[:2] + known


# -- replicas and kubelet's 4 MiB message limit -------------------------------------------------------


def test_replicas_are_bounded_in_the_config(tmp_path: Any) -> None:
    host = Host(root=tmp_path)
    assert load_config(host, env={}, flags={"replicas": MAX_REPLICAS}).replicas == MAX_REPLICAS
    with pytest.raises(ConfigError) as err:
        load_config(host, env={"GPUNODE_REPLICAS": "1000000000"}, flags={})
    assert "1000000000 replicas per GPU is more than 1024" in err.value.message


def test_a_device_list_over_kubelets_limit_is_refused() -> None:
    check_message_sizes((dgx(replicas=MAX_REPLICAS),))  # 8,192 devices: well under 4 MiB
    template = dgx().devices[0]
    devices = tuple(
        PluginDevice(f"{template.id}::{n}", template.id, template.uuid, 0, template.uuid, 0, 0, replica=n)
        for n in range(70_000)
    )
    big = Resource("nvidia.com/gpu", "gpunode-nvidia.com-gpu.sock", devices, replicas=70_000)
    with pytest.raises(ConfigError) as err:
        check_message_sizes((big,))
    assert err.value.message.startswith("nvidia.com/gpu: the device list of 70000 devices is a ")
    assert "over kubelet's 4 MiB limit" in err.value.message and KUBELET_MAX_MESSAGE == 4 * 1024 * 1024


# -- calls nobody waits for any more -------------------------------------------------------------------


class GoneCaller:
    """A grpc.ServicerContext whose caller's deadline has passed (the state a test cannot time)."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self.code = code
        raise RuntimeError(details)


@pytest.mark.parametrize("call", ["Allocate", "GetPreferredAllocation"])
def test_a_call_whose_deadline_passed_is_dropped_before_its_work(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = dgx()
    registry = DeviceRegistry([gpu])
    service = DevicePluginService(
        gpu.name,
        registry,
        Topology.from_inventory(simulated_inventory("dgx-a100")),
        ServeSettings(pre_start_required=False, allocate=AllocateSettings()),
    )
    worked: list[str] = []
    monkeypatch.setattr(server, "allocate", lambda *_args, **_kw: worked.append("allocate"))
    monkeypatch.setattr(server, "preferred_allocation", lambda *_args, **_kw: worked.append("preferred"))
    ids = [gpu.devices[0].id]
    request: Any = (
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        if call == "Allocate"
        else pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=1)
            ]
        )
    )
    context = GoneCaller()
    with pytest.raises(RuntimeError, match="the caller's deadline has passed"):
        getattr(service, call)(request, context)
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert worked == []


class Waiting(GoneCaller):
    """A caller still waiting, without a deadline (as kubelet calls)."""

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> Any:
        return None


def test_a_request_of_many_containers_gets_the_search_for_the_first_few_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = dgx()
    topology = Topology.from_inventory(simulated_inventory("dgx-a100"))
    service = DevicePluginService(
        gpu.name,
        DeviceRegistry([gpu]),
        topology,
        ServeSettings(pre_start_required=False, allocate=AllocateSettings()),
    )
    searched: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> list[str]:
        searched.append(1)
        return preferred_allocation(*args, **kwargs)

    monkeypatch.setattr(server, "preferred_allocation", counting)
    ids = [d.id for d in gpu.devices]
    container = pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)
    answer = service.GetPreferredAllocation(
        pb.PreferredAllocationRequest(container_requests=[container] * 5000), Waiting()
    )
    assert len(searched) == server.MAX_SEARCHED_CONTAINERS
    assert len(answer.container_responses) == 5000
    assert all(len(r.deviceIDs) == 2 and set(r.deviceIDs) <= set(ids) for r in answer.container_responses)
