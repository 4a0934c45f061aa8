"""Health reaches the ListAndWatch stream at once, whatever the interleaving (issue 13).

A real gRPC server (ResourceServer) on a unix socket and a real client. Each test forces one interleaving
of a health mark (from another thread, as the health monitor does) with the stream's own steps - between
its snapshot and its wait, between a send and the next wait, while it waits - and then requires the very
next message on the stream to show the change. A lost wake-up would leave the stream silent until the
next, unrelated, change: the read would then hit the call's deadline (generous; no timing is measured).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from gpunode.plugin.allocate import AllocateSettings
from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.api import deviceplugin_pb2_grpc
from gpunode.plugin.devices import DeviceRegistry, Unit, build_resources
from gpunode.plugin.preferred import Topology
from gpunode.plugin.server import DevicePluginService, ResourceServer, ServeSettings
from gpunode.plugin.simulate import simulated_inventory
from tests.integration.pluginproc import short_tempdir

DEADLINE = 60.0
pb_grpc: Any = deviceplugin_pb2_grpc  # generated, untyped


class HookedRegistry(DeviceRegistry):
    """A registry that runs a one-shot hook at a chosen step of the stream: right after its snapshot, or
    right before its wait for a change (after the previous message was handed to gRPC)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.after_snapshot: Callable[[], None] | None = None
        self.before_wait: Callable[[], None] | None = None

    def snapshot(self, name: str) -> Any:
        result = super().snapshot(name)
        hook, self.after_snapshot = self.after_snapshot, None
        if hook is not None:
            hook()
        return result

    def wait_for_change(self, name: str, seen: int, stop: Callable[[], bool] | None = None) -> bool:
        hook, self.before_wait = self.before_wait, None
        if hook is not None:
            hook()
        return super().wait_for_change(name, seen, stop)


def mark_from_another_thread(registry: DeviceRegistry, unit: Unit, reason: str | None) -> Callable[[], None]:
    """A hook: the health monitor's mark, done (and finished) on its own thread at exactly this point."""

    def hook() -> None:
        marker = threading.Thread(target=registry.mark, args=(unit, reason), name="health-like")
        marker.start()
        marker.join()

    return hook


@contextlib.contextmanager
def serving() -> Iterator[tuple[HookedRegistry, DevicePluginService, Callable[[], Any]]]:
    """pcie-4's nvidia.com/gpu served on a private socket: its registry, its service, and a way to open a
    ListAndWatch stream (cancelled at the end)."""
    [resource] = build_resources(simulated_inventory("pcie-4"))
    registry = HookedRegistry([resource])
    service = DevicePluginService(
        resource.name,
        registry,
        Topology.from_inventory(simulated_inventory("pcie-4")),
        ServeSettings(pre_start_required=False, allocate=AllocateSettings()),
    )
    with short_tempdir() as base:
        server = ResourceServer(str(base / "dp.sock"), service)
        server.start()
        try:
            with grpc.insecure_channel(f"unix://{base / 'dp.sock'}") as channel:
                calls: list[Any] = []

                def open_stream() -> Any:
                    # Opened by the test once its hooks are in place: the server starts the stream (and may
                    # reach its first wait) as soon as the call exists.
                    calls.append(pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=DEADLINE))
                    return calls[-1]

                yield registry, service, open_stream
                for call in calls:
                    call.cancel()
        finally:
            registry.close()
            server.stop(grace=0.0)


@pytest.fixture
def served() -> Iterator[tuple[HookedRegistry, Callable[[], Any]]]:
    with serving() as (registry, _, open_stream):
        yield registry, open_stream


def health(message: pb.ListAndWatchResponse) -> list[str]:
    return [d.health for d in message.devices]


def test_a_mark_between_the_snapshot_and_the_wait_is_sent(served: tuple[HookedRegistry, Any]) -> None:
    registry, open_stream = served
    call = open_stream()
    assert health(next(call)) == ["Healthy"] * 4
    # The stream's next snapshot is taken, then GPU 2 is marked before the stream waits again.
    registry.after_snapshot = mark_from_another_thread(registry, Unit(2), "Xid 79")
    registry.mark(Unit(0), "Xid 48")  # wakes the stream: it snapshots (GPU 0), the hook marks GPU 2
    assert health(next(call)) == ["Unhealthy", "Healthy", "Healthy", "Healthy"]
    assert health(next(call)) == ["Unhealthy", "Healthy", "Unhealthy", "Healthy"]


def test_a_mark_after_a_send_and_before_the_wait_is_sent(served: tuple[HookedRegistry, Any]) -> None:
    registry, open_stream = served
    registry.before_wait = mark_from_another_thread(registry, Unit(1), "double-bit ECC error")
    call = open_stream()  # after the hook: the stream's first wait must be the hooked one
    assert health(next(call)) == ["Healthy"] * 4  # sent; the hook marks GPU 1 before the stream waits
    assert health(next(call)) == ["Healthy", "Unhealthy", "Healthy", "Healthy"]


def test_marks_while_the_stream_waits_are_each_sent(served: tuple[HookedRegistry, Any]) -> None:
    registry, open_stream = served
    call = open_stream()
    assert health(next(call)) == ["Healthy"] * 4
    for gpu in range(4):
        registry.mark(Unit(gpu), "Xid 79")
        assert health(next(call)).count("Unhealthy") == gpu + 1
    registry.mark(Unit(3), None)  # healthy again is news too
    assert health(next(call)) == ["Unhealthy", "Unhealthy", "Unhealthy", "Healthy"]


def test_a_change_that_ends_where_it_began_is_still_sent_once(served: tuple[HookedRegistry, Any]) -> None:
    registry, open_stream = served
    call = open_stream()
    assert health(next(call)) == ["Healthy"] * 4
    # Unhealthy and healthy again before the stream looks: kubelet gets the final state (a list is
    # always whole), and the stream is not left behind on a version it has not sent.
    registry.before_wait = None
    registry.after_snapshot = None
    registry.mark(Unit(0), "Xid 79")
    registry.mark(Unit(0), None)
    registry.mark(Unit(1), "Xid 79")
    messages = [health(next(call))]
    while messages[-1] != ["Healthy", "Unhealthy", "Healthy", "Healthy"]:
        messages.append(health(next(call)))
    assert len(messages) <= 3


@pytest.mark.parametrize("gone", [True, False], ids=["resource-gone", "no-device-left"])
def test_a_server_stopped_for_a_change_sends_that_change_first(gone: bool) -> None:
    """A MIG change leaves a resource with no device: the event loop replaces the registry's resources
    (waking the stream) and then stops the resource's server. Whichever the stream sees first, kubelet gets
    the empty list before the stream ends, and so shows 0 at once instead of the last list."""
    import dataclasses

    with serving() as (registry, service, open_stream):
        [resource] = registry.resources()

        def replace_then_stop() -> None:
            # Both done before the stream's wait looks: the stop is what it sees first.
            registry.replace([] if gone else [dataclasses.replace(resource, devices=())])
            service.stopping.set()

        registry.before_wait = replace_then_stop  # the stream's first wait is the hooked one
        call = open_stream()
        assert health(next(call)) == ["Healthy"] * 4
        assert health(next(call)) == []
        assert list(call) == []  # and then the stream ends
