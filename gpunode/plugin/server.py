"""The gRPC side: one DevicePlugin server per resource, on its own unix socket.

Each ListAndWatch stream holds one worker thread for its whole life, and kubelet calls back
GetDevicePluginOptions while Register is in flight, so the pool is sized for streams + call-backs +
concurrent Allocates (WORKERS) and never starves.

Nothing a client sends can starve kubelet or make the plugin do unbounded work:
- at most MAX_STREAMS ListAndWatch streams at once per server (kubelet holds one, two for a moment while
  it re-registers); a stream beyond that is refused with RESOURCE_EXHAUSTED, so idle watchers can never
  take the workers kubelet's Allocate needs (WORKERS - MAX_STREAMS are always left for unary calls);
- requests are at most MAX_REQUEST_BYTES (kubelet's own 4 MiB), and at most MAX_CONCURRENT_RPCS are
  queued or running; validation and GetPreferredAllocation are O(n) in the IDs named;
- a call whose caller's deadline passed (or that was cancelled) while it waited for a worker is dropped
  before any work, and so are the remaining containers of a multi-container call;
- request content reaches a log line or an error only escaped and bounded (logsafe).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from gpunode.plugin.allocate import AllocateSettings, ContainerAllocation, Refused, allocate
from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.api import deviceplugin_pb2_grpc
from gpunode.plugin.devices import DeviceHealth, DeviceRegistry
from gpunode.plugin.logsafe import log_line, shown_ids
from gpunode.plugin.preferred import Topology, preferred_allocation

log = logging.getLogger("gpunode.plugin")
# The generated service module is untyped; through Any, mypy --strict accepts its calls.
pb_grpc: Any = deviceplugin_pb2_grpc

WORKERS = 16
MAX_STREAMS = 4  # ListAndWatch streams per server; WORKERS - MAX_STREAMS workers stay for unary calls
MAX_CONCURRENT_RPCS = 256  # running + queued calls; beyond, gRPC answers RESOURCE_EXHAUSTED at once
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # kubelet's own gRPC message limit; nothing kubelet sends is larger
REFUSAL_LOG_INTERVAL = 10.0  # seconds between two log lines about refused calls of one kind
MAX_SEARCHED_CONTAINERS = 8  # containers of one GetPreferredAllocation that get the topology search


class _Throttled:
    """Logs a refusal at most once per interval per kind, with how many were not logged in between: a
    client hammering the socket must not fill the journal either."""

    def __init__(self, interval: float = REFUSAL_LOG_INTERVAL) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return
            self._last[kind] = now
            quiet = self._quiet.pop(kind, 0)
        if quiet:
            message += f" ({quiet} more like it not logged in the last {self._interval:g}s)"
        log.warning(message, *args)


@dataclass(frozen=True)
class ServeSettings:
    pre_start_required: bool
    allocate: AllocateSettings
    placement: str = "spread"


def device_message(state: DeviceHealth) -> pb.Device:
    numa = state.device.numa_node
    return pb.Device(
        ID=state.device.id,
        health="Healthy" if state.healthy else "Unhealthy",
        topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa)]) if numa is not None else None,
    )


class DevicePluginService(deviceplugin_pb2_grpc.DevicePluginServicer):
    def __init__(
        self, resource_name: str, registry: DeviceRegistry, topology: Topology, settings: ServeSettings
    ) -> None:
        self.resource_name = resource_name
        self.registry = registry
        self.current = (topology, settings)  # swapped whole by update(): a call reads one consistent pair
        self.stopping = threading.Event()
        self._streams = 0
        self._streams_lock = threading.Lock()
        # The open streams' end events, oldest first, and whether kubelet's next stream is due (set right
        # before each Register: kubelet opens ListAndWatch as its answer to it).
        self._open: list[threading.Event] = []
        self._kubelet_due = False
        self._refusals = _Throttled()

    def expect_kubelet(self) -> None:
        """The next ListAndWatch is kubelet's (it follows our Register): it is admitted even when other
        clients hold every slot, and the oldest of theirs is ended to make room — idle watchers on the socket
        can take slots, never kubelet's stream."""
        with self._streams_lock:
            self._kubelet_due = True

    def update(self, topology: Topology, settings: ServeSettings) -> None:
        """New settings after a reload (one reference assignment: calls in flight keep the old pair)."""
        self.current = (topology, settings)

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=self.current[1].pre_start_required, get_preferred_allocation_available=True
        )

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        ended = threading.Event()
        evicted: threading.Event | None = None
        with self._streams_lock:
            admitted = self._streams < MAX_STREAMS or (self._kubelet_due and bool(self._open))
            if admitted:
                if self._streams >= MAX_STREAMS:
                    evicted = self._open.pop(0)
                    self._streams -= 1
                self._kubelet_due = False
                self._streams += 1
                self._open.append(ended)
        if evicted is not None:
            evicted.set()
            self.registry.wake()  # the evicted stream's wait returns, and its call ends
            log.warning(
                "%s: ended the oldest ListAndWatch stream to admit kubelet's (another client holds streams "
                "on the plugin's socket)",
                self.resource_name,
            )
        if not admitted:
            self._refusals.warning(
                "streams",
                "%s: refused a ListAndWatch stream: %d are open already (kubelet needs one); another "
                "client is holding streams on the plugin's socket",
                self.resource_name,
                MAX_STREAMS,
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_STREAMS} ListAndWatch streams of {self.resource_name} are open already",
            )
        try:
            yield from self._watch(context, ended)
        finally:
            with self._streams_lock:
                if ended in self._open:  # an evicted stream was counted out when it was evicted
                    self._open.remove(ended)
                    self._streams -= 1

    def _watch(
        self, context: grpc.ServicerContext, ended: threading.Event
    ) -> Iterator[pb.ListAndWatchResponse]:
        def on_end() -> None:
            ended.set()
            self.registry.wake()

        if not context.add_callback(on_end):
            return  # the call ended before it got here: nobody is listening
        seen = -2
        log.debug("%s: kubelet opened ListAndWatch", self.resource_name)
        while not self.stopping.is_set() and not ended.is_set():
            version, states = self.registry.snapshot(self.resource_name)
            if version != seen:
                seen = version
                yield pb.ListAndWatchResponse(devices=[device_message(s) for s in states])
            # Returns on a change, on the stream's end (cancel) or when this server stops: a stop must not
            # wait for gRPC's grace period to cancel the stream.
            if not self.registry.wait_for_change(
                self.resource_name, seen, lambda: ended.is_set() or self.stopping.is_set()
            ):
                # Stopped while kubelet still listens: a change it has not been sent goes out first. A
                # resource that is gone (its last MIG instance destroyed) or left with no device sends its
                # empty list, so kubelet shows 0 at once rather than the last list as unhealthy for its
                # grace period. (A plugin that stops changes nothing first: nothing more is sent.)
                if not ended.is_set():
                    version, states = self.registry.snapshot(self.resource_name)
                    if version != seen:
                        yield pb.ListAndWatchResponse(devices=[device_message(s) for s in states])
                break
        log.debug("%s: ListAndWatch stream closed", self.resource_name)

    @property
    def streams(self) -> int:
        """ListAndWatch streams open now."""
        with self._streams_lock:
            return self._streams

    def _drop_if_expired(self, context: grpc.ServicerContext, call: str) -> None:
        """Abort a call nobody waits for any more (deadline passed, or cancelled) before doing its work."""
        remaining = context.time_remaining()
        if context.is_active() and (remaining is None or remaining > 0):
            return
        self._refusals.warning(
            "expired",
            "%s: %s dropped: its caller's deadline passed (or it was cancelled) before it was served",
            self.resource_name,
            call,
        )
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{call}: the caller's deadline has passed")

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        topology, settings = self.current
        resource = self.registry.resource(self.resource_name)
        by_id = resource.by_id() if resource is not None else {}
        answers = []
        for n, req in enumerate(request.container_requests):
            self._drop_if_expired(context, "GetPreferredAllocation")
            size = int(req.allocation_size)
            available = list(req.available_deviceIDs)
            must = list(req.must_include_deviceIDs)
            if n >= MAX_SEARCHED_CONTAINERS:
                # kubelet sends one container per call and reads only the first answer: a request with
                # thousands gets the plain choice for the rest, not thousands of searches.
                chosen = _plain_choice(must, available, size)
            else:
                try:
                    chosen = preferred_allocation(
                        topology, by_id, available, must, size, placement=settings.placement
                    )
                except Exception:  # an error here fails the pod's admission: answer something, always
                    log.exception(
                        "%s: preferred allocation failed; answering a plain choice", self.resource_name
                    )
                    chosen = _plain_choice(must, available, size)
            answers.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=answers)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        self._drop_if_expired(context, "Allocate")
        # The resource and its devices' health in one look (one lock), not a lock per device.
        resource, health = self.registry.allocation_view(self.resource_name)
        if resource is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.resource_name} is no longer served")
            raise AssertionError("abort raises")  # for the type checker: context.abort never returns
        containers = [list(c.devices_ids) for c in request.container_requests]
        try:
            answers = allocate(resource, containers, health, self.current[1].allocate)
        except Refused as refused:
            # Bounded and escaped: the request is the caller's text, of any size (logsafe).
            self._refusals.warning(
                "allocate",
                "%s: Allocate of %d container(s), %d ID(s) (%s) refused: %s",
                self.resource_name,
                len(containers),
                sum(len(c) for c in containers),
                shown_ids([i for c in containers for i in c]),
                refused.message,
            )
            context.abort(getattr(grpc.StatusCode, refused.code), refused.message)
        # Every ID is a served device here (checked above), so they are known, short and printable.
        # Formatted here and handed to the log thread as it is (log_line): no LogRecord on this thread.
        log_line(log, logging.INFO, f"{self.resource_name}: allocated {'; '.join(map(','.join, containers))}")
        return pb.AllocateResponse(container_responses=[_container_response(a) for a in answers])

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        # Nothing to prepare: GPUs need no per-container set-up. kubelet only calls this when the
        # pre-start-required option asks it to (e.g. to observe container starts in the logs).
        log.info("%s: PreStartContainer for %s", self.resource_name, shown_ids(list(request.devices_ids)))
        return pb.PreStartContainerResponse()


class ResourceServer:
    """A gRPC server for one resource on `<socket dir>/<socket name>`."""

    def __init__(self, socket_path: str, service: DevicePluginService) -> None:
        self.socket_path = socket_path
        self.service = service
        self.inode: int | None = None
        self._server: grpc.Server | None = None

    def start(self, ready_timeout: float = 10.0) -> None:
        """Serve, then prove the socket accepts connections before anyone is told about it."""
        _remove_stale_socket(self.socket_path)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="dp-grpc"),
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ],
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        pb_grpc.add_DevicePluginServicer_to_server(self.service, server)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        server.start()
        self._server = server
        self.inode = os.stat(self.socket_path).st_ino
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(ready_timeout)
            probe.connect(self.socket_path)

    def socket_is_ours(self) -> bool:
        try:
            return os.stat(self.socket_path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def stop(self, grace: float = 0.5, *, remove_socket: bool = True) -> None:
        self.service.stopping.set()
        self.service.registry.wake()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 2.0)
            self._server = None
        # Only our own socket: after a kubelet restart the path may already be someone else's.
        if remove_socket and self.socket_is_ours():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)


def _container_response(a: ContainerAllocation) -> pb.ContainerAllocateResponse:
    # Only the fields the strategies filled: each one given to the constructor costs a conversion even when
    # empty, and an empty field is not sent anyway. The maps are filled key by key after: given to the
    # constructor (or to update()), a map goes through collections.abc's Python update (~3 µs more).
    fields: dict[str, Any] = {}
    if a.mounts:
        fields["mounts"] = [pb.Mount(container_path=c, host_path=h, read_only=ro) for c, h, ro in a.mounts]
    if a.devices:
        fields["devices"] = [
            pb.DeviceSpec(container_path=c, host_path=h, permissions=p) for c, h, p in a.devices
        ]
    if a.cdi_devices:
        fields["cdi_devices"] = [pb.CDIDevice(name=n) for n in a.cdi_devices]
    response = pb.ContainerAllocateResponse(**fields)
    if a.envs:
        envs = response.envs
        for key, value in a.envs.items():
            envs[key] = value
    if a.annotations:
        annotations = response.annotations
        for key, value in a.annotations.items():
            annotations[key] = value
    return response


def _plain_choice(must: list[str], available: list[str], size: int) -> list[str]:
    """must_include, then `available` in order, up to size: a valid answer without the search (O(n))."""
    return list(dict.fromkeys(must + available))[: max(size, len(must))]


def _remove_stale_socket(path: str) -> None:
    # A socket file left by a killed run of ours blocks bind(); it is only ever our own name.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
