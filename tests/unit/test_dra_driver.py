"""gpunode/dra/driver.py's parts without processes: the slice publisher's reconcile (generations, wipes,
obsolete slices, API errors), the health state the slices and the stream read, the health stream's resend."""

from __future__ import annotations

import copy
import threading
from typing import Any

from gpunode.dra.api import dra_v1_pb2 as v1_pb
from gpunode.dra.api import dra_v1beta1_pb2 as v1beta1_pb
from gpunode.dra.checkpoint import Device as CheckpointDevice
from gpunode.dra.driver import (
    DraDriver,
    DriverSettings,
    HealthState,
    Publisher,
    _DraService,
    _HealthService,
    trouble_of,
)
from gpunode.dra.prepare import ClaimRef, PrepareResult
from gpunode.dra.slices import SliceSettings, Trouble
from gpunode.errors import ApiError
from gpunode.host import Host
from gpunode.plugin.devices import DeviceRegistry, Unit
from gpunode.plugin.health import LOST_REASON, HealthSettings, xid_reason
from tests.draprepare import inventory

NODE = "n1"
DRIVER = "gpu.nvidia.com"


class FakeSlices:
    """The ResourceSlice calls of KubeClient over a dict, with writes counted and failures on demand."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.fail = 0
        self.version = 0
        self.cond = threading.Condition()

    def _maybe_fail(self) -> None:
        if self.fail:
            self.fail -= 1
            raise ApiError("the server is unavailable (503)", "try again")

    def list_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        self._maybe_fail()
        return [copy.deepcopy(s) for s in self.items.values()]

    def _store(self, item: Any, verb: str) -> dict[str, Any]:
        with self.cond:
            self.version += 1
            stored = copy.deepcopy(dict(item))
            stored["metadata"] = {**stored["metadata"], "resourceVersion": str(self.version), "uid": "u"}
            self.items[stored["metadata"]["name"]] = stored
            self.writes.append((verb, stored["metadata"]["name"]))
            self.cond.notify_all()
            return stored

    def create_resource_slice(self, item: Any) -> dict[str, Any]:
        self._maybe_fail()
        return self._store(item, "create")

    def update_resource_slice(self, item: Any) -> dict[str, Any]:
        self._maybe_fail()
        assert (
            self.items[item["metadata"]["name"]]["metadata"]["resourceVersion"]
            == item["metadata"]["resourceVersion"]
        )
        return self._store(item, "update")

    def delete_resource_slice(self, name: str, uid: str | None = None) -> bool:
        self._maybe_fail()
        self.items.pop(name)
        self.writes.append(("delete", name))
        return True


def generation(client: FakeSlices) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in client.items.values()}


def make(client: FakeSlices, troubles: dict[str, list[Trouble]] | None = None, gpus: int = 2) -> Publisher:
    inv = inventory(gpus)
    state = troubles if troubles is not None else {}
    return Publisher(client, SliceSettings(node_name=NODE), lambda: (inv, state), poll=0.01)


def test_publishes_then_writes_nothing_while_nothing_changes() -> None:
    client = FakeSlices()
    publisher = make(client)
    assert publisher.reconcile() == 1
    assert generation(client) == {1}
    assert publisher.reconcile() == 0
    assert client.writes == [("create", f"{NODE}-{DRIVER}-0")]


def test_wiped_slices_come_back_with_the_same_generation() -> None:
    client = FakeSlices()
    publisher = make(client)
    publisher.reconcile()
    before = copy.deepcopy(client.items)
    client.items.clear()  # kubelet's DeleteCollection
    assert publisher.reconcile() == 1
    assert {n: s["spec"] for n, s in client.items.items()} == {n: s["spec"] for n, s in before.items()}


def test_a_health_change_is_a_new_generation_and_an_update() -> None:
    client = FakeSlices()
    troubles: dict[str, list[Trouble]] = {}
    publisher = make(client, troubles)
    publisher.reconcile()
    troubles["GPU-00000001-1111-2222-3333-444444444444"] = [Trouble("xid", 1_700_000_000.0, 79)]
    assert publisher.reconcile() == 1
    assert client.writes[-1][0] == "update" and generation(client) == {2}
    tainted = {d["name"]: d.get("taints") for s in client.items.values() for d in s["spec"]["devices"]}
    assert tainted["gpu-1"] == [
        {"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule", "timeAdded": "2023-11-14T22:13:20Z"}
    ]
    assert tainted["gpu-0"] is None
    troubles.clear()  # recovered
    assert publisher.reconcile() == 1 and generation(client) == {3}
    assert all("taints" not in d for s in client.items.values() for d in s["spec"]["devices"])


def test_an_earlier_runs_pool_is_kept_when_it_holds_the_same_devices() -> None:
    client = FakeSlices()
    make(client).reconcile()
    make(client).reconcile()  # a restarted driver
    assert generation(client) == {1} and len(client.writes) == 1


def test_an_earlier_runs_different_pool_gets_a_higher_generation_and_obsolete_slices_go() -> None:
    client = FakeSlices()
    make(client, gpus=4).reconcile()
    stray = copy.deepcopy(next(iter(client.items.values())))
    stray["metadata"]["name"] = f"{NODE}-{DRIVER}-1"
    client.items[stray["metadata"]["name"]] = stray
    make(client, gpus=2).reconcile()
    assert generation(client) == {2}
    assert sorted(client.items) == [f"{NODE}-{DRIVER}-0"]
    assert ("delete", f"{NODE}-{DRIVER}-1") in client.writes


def test_api_errors_are_retried_never_fatal() -> None:
    client = FakeSlices()
    client.fail = 3
    errors: list[str | None] = []
    publisher = Publisher(
        client,
        SliceSettings(node_name=NODE),
        lambda: (inventory(1), {}),
        poll=0.01,
        on_published=lambda generation, error: errors.append(error),
    )
    publisher.start()
    try:
        with client.cond:
            assert client.cond.wait_for(lambda: client.items, timeout=60)
    finally:
        publisher.stop()
    assert len(errors) >= 4 and all(e is not None and "503" in e for e in errors[:3])
    assert errors[3] is None  # the fourth pass published
    assert generation(client) == {1}


def test_trouble_kinds_from_the_monitors_reasons() -> None:
    assert trouble_of(xid_reason(79), 5.0) == Trouble("xid", 5.0, 79)
    assert trouble_of(LOST_REASON, 5.0) == Trouble("lost", 5.0)


def test_health_state_keeps_when_a_state_began_and_forgets_it_when_it_ends() -> None:
    now = [100.0]
    registry = DeviceRegistry()
    state = HealthState(registry, clock=lambda: now[0])
    inv = inventory(2)
    uuid1 = inv.gpus[1].uuid
    assert uuid1 is not None
    registry.mark(Unit(1), xid_reason(79))
    troubles, unhealthy = state.read(inv)
    assert troubles == {uuid1: [Trouble("xid", 100.0, 79)]} and unhealthy == {uuid1: xid_reason(79)}
    now[0] = 200.0
    assert state.read(inv)[0] == {uuid1: [Trouble("xid", 100.0, 79)]}  # the same timeAdded
    registry.mark(Unit(1), None)
    assert state.read(inv) == ({}, {})
    registry.mark(Unit(1), xid_reason(79))
    assert state.read(inv)[0] == {uuid1: [Trouble("xid", 200.0, 79)]}  # a new state, a new timeAdded
    # A GPU that cannot be watched is not unhealthy: a taint of its own, nothing for Prepare or kubelet.
    registry.mark(Unit(1), None)
    registry.set_unmonitored(uuid1, 1, "no events")
    troubles, unhealthy = state.read(inv)
    assert troubles == {uuid1: [Trouble("unmonitored", 200.0)]} and unhealthy == {}


class _Context:
    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active


def test_health_stream_sends_the_full_list_again_without_a_change() -> None:
    """With nothing changing, the stream still resends every health_resend seconds (kubelet's 30 s)."""
    settings = DriverSettings(driver=DRIVER, node_name=NODE, health_resend=0.0, status_file=None)
    inv = inventory(2)
    driver = DraDriver(
        Host("/"),
        settings,
        inventory=lambda: inv,
        kube=lambda: None,
        health_settings=HealthSettings(),
    )
    driver._inventory = inv
    stream = _HealthService(driver).NodeWatchResources(None, _Context())
    first, second = next(stream), next(stream)
    for message in (first, second):
        assert [(d.device.device_name, d.health) for d in message.devices] == [("gpu-0", 1), ("gpu-1", 1)]
    driver._registry.mark(Unit(0), xid_reason(79))
    third = next(stream)
    assert [(d.device.device_name, d.health) for d in third.devices] == [("gpu-0", 2), ("gpu-1", 1)]
    assert "79" in third.devices[0].message


class _OnePreparer:
    """Answers every claim with one device carrying a share ID, or an error for claim 'bad'."""

    def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        device = CheckpointDevice(("gpu",), NODE, "gpu-0", ("k8s.gpu.nvidia.com/claim=u-gpu-0",), "share-1")
        return {
            r.uid: PrepareResult(error="claim refused") if r.name == "bad" else PrepareResult((device,))
            for r in refs
        }


def _request(pb: Any) -> Any:
    return pb.NodePrepareResourcesRequest(
        claims=[
            pb.Claim(namespace="ml", uid="u1", name="good"),
            pb.Claim(namespace="ml", uid="u2", name="bad"),
        ]
    )


def test_prepare_answers_per_claim_in_both_versions_and_v1beta1_has_no_share_id() -> None:
    preparer: Any = _OnePreparer()
    v1 = _DraService(lambda: preparer, v1_pb, True).NodePrepareResources(_request(v1_pb), None)
    assert v1.claims["u1"].devices[0].share_id == "share-1"
    assert list(v1.claims["u1"].devices[0].cdi_device_ids) == ["k8s.gpu.nvidia.com/claim=u-gpu-0"]
    assert v1.claims["u2"].error == "claim refused" and not v1.claims["u2"].devices
    beta = _DraService(lambda: preparer, v1beta1_pb, False).NodePrepareResources(_request(v1beta1_pb), None)
    assert beta.claims["u1"].devices[0].device_name == "gpu-0"
    assert list(beta.claims["u1"].devices[0].request_names) == ["gpu"]
    assert beta.claims["u2"].error == "claim refused"
