"""A fake kubelet for device plugin tests and benchmarks: the v1beta1 device manager, as a plugin sees it.

It serves `v1beta1.Registration` on `<socket_dir>/kubelet.sock` and behaves like kubelet's device manager
(shared/specs/deviceplugin-v1beta1.md):

- Register is validated like kubelet does (version, extended resource name, endpoint); a refusal is a gRPC
  error with code UNKNOWN and kubelet's wording, because kubelet returns a plain Go error.
- While Register is still in flight it dials the plugin back and calls GetDevicePluginOptions; if that
  fails, Register fails. A plugin that registers before its own server serves fails here, as with kubelet.
- Then it opens ListAndWatch, keeps it open and records every message. A stream that ends while the
  kubelet lives is recorded as a `StreamEnd` the plugin caused, and kubelet's view of the resource turns
  all-unhealthy (`node_devices`, `allocatable`).
- Registering a resource again replaces its endpoint and closes the old stream.
- `restart()` is a kubelet restart: the server goes away, every socket in the directory is deleted (never
  `kubelet_internal_checkpoint`), and a new `kubelet.sock` (a new inode) is served.
- `allocate`, `get_preferred_allocation`, `pre_start_container` and `options` call the plugin the way
  kubelet does, over the channel opened at registration; grpc.RpcError propagates so tests can check codes.

Everything is stamped with time.monotonic(), so a benchmark can measure e.g. restart → registered again.
grpc has no type stubs, so it is imported by name and typed Any (as in tests/integration/cri/client.py).
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, NoReturn, TypeVar

from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.api import deviceplugin_pb2_grpc as pb_grpc
from tests.integration.kubeletcommon import rpc_error_text, wait_until

grpc: Any = importlib.import_module("grpc")
# The generated service module is untyped; going through Any keeps mypy --strict quiet about its calls.
_services: Any = pb_grpc

VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL; gRPC refuses longer paths with only
# "Failed to bind to address", so the fake checks first and says why.
MAX_UNIX_PATH = 107
# What kubelet writes when no pod holds a device; the content only matters in that it must never change.
CHECKPOINT_CONTENT = b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":0}'

# Stream-end reasons. The first two are the plugin's doing (kubelet marks the devices unhealthy); the
# others are kubelet closing the stream itself.
RETURNED = "returned"  # the plugin's ListAndWatch returned (status OK)
FAILED = "failed"  # an error status, or the connection dropped (the plugin died or stopped serving)
REPLACED = "replaced"  # the resource registered again; kubelet dropped the old endpoint
KUBELET_STOPPED = "kubelet-stopped"  # stop() or restart()

_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_T = TypeVar("_T")
_POLL = 0.05  # how often blocking waits inside Register look at the stop flag


def is_valid_extended_resource_name(name: str) -> bool:
    """kubelet's check on RegisterRequest.resource_name (v1helper.IsExtendedResourceName).

    Not a native resource (it has a slash and no `kubernetes.io/` anywhere, so `foo.kubernetes.io/x` is
    native too), no `requests.` prefix (quota's convention), and `requests.<name>` must be a qualified
    name: a DNS-1123 subdomain of at most 253 characters, a slash, and a name part of at most 63 characters.
    """
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    parts = f"requests.{name}".split("/")
    if len(parts) != 2:
        return False
    prefix, part = parts
    if len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
        return False
    return 0 < len(part) <= 63 and _QUALIFIED_NAME.fullmatch(part) is not None


class DeviceInfo(NamedTuple):
    """One device of a ListAndWatch message; compares equal to a plain (id, health, numa_nodes) tuple."""

    id: str
    health: str
    numa_nodes: tuple[int, ...]


@dataclass(frozen=True)
class Registration:
    """An accepted Register call."""

    time: float  # monotonic, when kubelet accepted it (GetDevicePluginOptions had answered)
    resource_name: str
    endpoint: str  # the socket file name the plugin gave
    version: str
    request_options: pb.DevicePluginOptions  # what the RegisterRequest said
    options: pb.DevicePluginOptions  # what GetDevicePluginOptions answered: what kubelet goes by
    kubelet_generation: int  # 0 for the first server, +1 per restart()


@dataclass(frozen=True)
class Rejection:
    """A refused Register call, with the message the plugin got."""

    time: float
    resource_name: str
    endpoint: str
    version: str
    message: str


@dataclass(frozen=True)
class DeviceUpdate:
    """One ListAndWatch message: the whole device list of the resource at that moment."""

    time: float
    resource_name: str
    endpoint: str
    devices: tuple[DeviceInfo, ...]


@dataclass(frozen=True)
class StreamEnd:
    """A ListAndWatch stream that ended, and why."""

    time: float
    resource_name: str
    endpoint: str
    reason: str  # RETURNED, FAILED, REPLACED or KUBELET_STOPPED
    code: str  # the gRPC status code name ("OK" when the plugin's handler returned)
    details: str

    @property
    def by_plugin(self) -> bool:
        """Whether the plugin ended it (a plugin must never do that while it lives)."""
        return self.reason in (RETURNED, FAILED)


@dataclass
class _Endpoint:
    """kubelet's connection to one registered plugin: the channel, the stub and the ListAndWatch reader."""

    registration: Registration
    channel: Any
    stub: Any
    call: Any = None  # the ListAndWatch call once opened; cancel() ends it
    close_reason: str | None = None  # set when kubelet closes the stream itself
    ended: bool = False
    devices: tuple[DeviceInfo, ...] | None = None  # the latest list on this stream
    thread: threading.Thread | None = None
    messages: int = 0  # ListAndWatch messages received on this stream


class FakeKubelet:
    """A kubelet device manager on `<socket_dir>/kubelet.sock`; see the module docstring."""

    def __init__(
        self,
        socket_dir: Path,
        *,
        workers: int = 16,
        dial_timeout: float = 10.0,
        options_timeout: float = 10.0,
        rpc_timeout: float = 30.0,
    ) -> None:
        """dial_timeout is kubelet's (10 s, grpc.WithBlock). kubelet gives GetDevicePluginOptions no timeout
        at all; options_timeout bounds it so that a plugin that would hang kubelet fails the test instead.
        rpc_timeout bounds the client helpers (kubelet's Allocate has none, which would hang a test).
        """
        self.socket_dir = Path(socket_dir).absolute()
        self.kubelet_socket = self.socket_dir / KUBELET_SOCKET
        self.checkpoint = self.socket_dir / CHECKPOINT
        if len(os.fsencode(self.kubelet_socket)) > MAX_UNIX_PATH:
            raise ValueError(
                f"{self.kubelet_socket} is longer than a unix socket path may be ({MAX_UNIX_PATH} bytes); "
                "use a shorter directory, e.g. tempfile.mkdtemp(dir='/tmp')"
            )
        self.workers = workers
        self.dial_timeout = dial_timeout
        self.options_timeout = options_timeout
        self.rpc_timeout = rpc_timeout

        self._cond = threading.Condition()
        self._server: Any = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._stopping = threading.Event()  # wakes Register calls blocked in the dial-back
        self._generation = -1
        self._pending_channels: set[Any] = set()  # channels of Register calls waiting for options
        self._endpoints: dict[str, _Endpoint] = {}
        self._registrations: list[Registration] = []
        self._rejections: list[Rejection] = []
        self._updates: list[DeviceUpdate] = []
        self._stream_ends: list[StreamEnd] = []
        self._violations: list[str] = []
        self._starts: list[float] = []
        self._socket_inodes: list[int] = []
        self._checkpoint_stat: tuple[int, int, bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> FakeKubelet:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def generation(self) -> int:
        """0 for the first server, +1 for each restart() (-1 before start)."""
        return self._generation

    def start(self) -> float:
        """Serve kubelet.sock (creating the directory and the checkpoint if missing); return when serving."""
        if self._server is not None:
            raise RuntimeError("the fake kubelet is already running")
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        if not self.checkpoint.exists():
            self.checkpoint.write_bytes(CHECKPOINT_CONTENT)
        if self._checkpoint_stat is None:
            self._checkpoint_stat = _file_state(self.checkpoint)
        self._stopping.clear()
        self._generation += 1
        self._executor = futures.ThreadPoolExecutor(
            max_workers=self.workers, thread_name_prefix=f"fake-kubelet-{self._generation}"
        )
        server = grpc.server(self._executor)
        _services.add_RegistrationServicer_to_server(_RegistrationServicer(self, self._generation), server)
        # gRPC unlinks a stale socket at this path before binding, as kubelet does.
        if server.add_insecure_port(f"unix:{self.kubelet_socket}") == 0:
            raise RuntimeError(f"could not bind {self.kubelet_socket}")
        server.start()
        self._server = server
        started = time.monotonic()
        with self._cond:
            self._starts.append(started)
            self._socket_inodes.append(self.kubelet_socket.stat().st_ino)
            self._cond.notify_all()
        return started

    def stop(self) -> None:
        """Stop serving and drop every plugin connection, like a kubelet that exits.

        kubelet.sock goes away (gRPC unlinks it on shutdown, and the fake makes sure); plugin sockets are the
        plugins' business and are left alone; the checkpoint stays.
        """
        server, executor = self._server, self._executor
        if server is None:
            return
        self._stopping.set()
        with self._cond:
            self._server = None
            self._executor = None
            endpoints = list(self._endpoints.values())
            self._endpoints.clear()
            pending = list(self._pending_channels)
        # No grace: a dying kubelet does not finish its Register calls either.
        server.stop(None).wait(self.rpc_timeout)
        for channel in pending:
            channel.close()
        for endpoint in endpoints:
            self._close(endpoint, KUBELET_STOPPED)
        if executor is not None:
            executor.shutdown(wait=True)
        for endpoint in endpoints:
            if endpoint.thread is not None:
                endpoint.thread.join(self.rpc_timeout)
        if self._socket_inodes and _inode(self.kubelet_socket) == self._socket_inodes[-1]:
            self.kubelet_socket.unlink()
        with self._cond:
            self._cond.notify_all()

    def restart(self, *, new_inode: bool = True) -> float:
        """A kubelet restart; returns the monotonic time the new kubelet.sock started serving.

        Like the new kubelet's CleanupPluginDirectory, it deletes every socket in the directory (stat follows
        symlinks, so a link to a socket goes too) and leaves the checkpoint, other files and directories
        alone. (Older kubelets deleted every file but directories; current ones delete only sockets.)

        ext4 hands a freed inode number straight to the next file created, so a new kubelet.sock made right
        after the old one was deleted gets the old number back. new_inode (the default) keeps the old inode
        allocated with an O_PATH descriptor until the new socket exists, so the number changes as the spec
        says; new_inode=False lets the number come back, which can happen on a real node too, for tests of a
        plugin that must notice a restart by more than the inode.
        """
        pin = os.open(self.kubelet_socket, os.O_PATH) if new_inode and self.running else None
        try:
            self.stop()
            for entry in os.scandir(self.socket_dir):
                if entry.name != CHECKPOINT and _is_socket(Path(entry.path)):
                    Path(entry.path).unlink(missing_ok=True)
            return self.start()
        finally:
            if pin is not None:
                os.close(pin)

    # -- what kubelet saw ------------------------------------------------------------------------------------

    @property
    def starts(self) -> list[float]:
        """When each server started serving: [first start, after restart 1, ...]."""
        with self._cond:
            return list(self._starts)

    @property
    def socket_inodes(self) -> list[int]:
        """kubelet.sock's inode for each server, in order."""
        with self._cond:
            return list(self._socket_inodes)

    def registrations(self, resource: str | None = None) -> list[Registration]:
        with self._cond:
            return [r for r in self._registrations if resource is None or r.resource_name == resource]

    def rejections(self) -> list[Rejection]:
        with self._cond:
            return list(self._rejections)

    def updates(self, resource: str | None = None) -> list[DeviceUpdate]:
        """Every ListAndWatch message received, oldest first."""
        with self._cond:
            return [u for u in self._updates if resource is None or u.resource_name == resource]

    def stream_ends(self, resource: str | None = None, *, by_plugin_only: bool = False) -> list[StreamEnd]:
        with self._cond:
            return [
                e
                for e in self._stream_ends
                if (resource is None or e.resource_name == resource) and (e.by_plugin or not by_plugin_only)
            ]

    @property
    def violations(self) -> list[str]:
        """Protocol breaches in ListAndWatch messages (bad health strings, duplicate or over-long IDs)."""
        with self._cond:
            return list(self._violations)

    def registered(self, resource: str) -> Registration | None:
        """The registration kubelet currently uses for the resource (None before, and after a restart)."""
        with self._cond:
            endpoint = self._endpoints.get(resource)
            return endpoint.registration if endpoint is not None else None

    def latest_devices(self, resource: str) -> list[DeviceInfo] | None:
        """The last list the plugin sent on the stream of the current registration (even if that stream has
        ended since), or None: not registered (e.g. since a restart), or no message yet on the new stream.

        Lists from earlier registrations do not count, so that waiting after a restart or re-registration
        cannot be satisfied by what the previous stream said; updates() keeps the whole history.
        """
        with self._cond:
            return self._latest(resource)

    def node_devices(self, resource: str) -> list[DeviceInfo]:
        """kubelet's view: the current stream's list, all Unhealthy once that stream ended; [] if none."""
        with self._cond:
            endpoint = self._endpoints.get(resource)
            if endpoint is None or endpoint.devices is None:
                return []
            if endpoint.ended:
                return [d._replace(health=UNHEALTHY) for d in endpoint.devices]
            return list(endpoint.devices)

    def allocatable(self, resource: str) -> int:
        """What the node would advertise as allocatable: kubelet counts only "Healthy" as healthy."""
        return sum(d.health == HEALTHY for d in self.node_devices(resource))

    def checkpoint_intact(self) -> bool:
        """Whether the checkpoint file is the one created at start, unchanged (inode, mtime, content)."""
        return self._checkpoint_stat is not None and _file_state(self.checkpoint) == self._checkpoint_stat

    # -- waiting ---------------------------------------------------------------------------------------------

    def wait_registered(
        self, resource: str, count: int = 1, timeout: float = 30.0, *, after: float | None = None
    ) -> Registration:
        """The count-th accepted registration of the resource (only those later than `after`, if given)."""

        def found() -> Registration | None:
            seen = [
                r
                for r in self._registrations
                if r.resource_name == resource and (after is None or r.time > after)
            ]
            return seen[count - 1] if len(seen) >= count else None

        return self._wait(found, timeout, f"registration #{count} of {resource}")

    def wait_for_devices(
        self,
        resource: str,
        predicate: Callable[[list[DeviceInfo]], bool] = lambda devices: True,
        timeout: float = 30.0,
    ) -> list[DeviceInfo]:
        """Wait until latest_devices(resource) exists and satisfies predicate; return it."""

        def found() -> list[DeviceInfo] | None:
            devices = self._latest(resource)
            return devices if devices is not None and predicate(devices) else None

        return self._wait(found, timeout, f"a device list of {resource} that satisfies the predicate")

    def wait_for_update(
        self,
        resource: str,
        predicate: Callable[[list[DeviceInfo]], bool] = lambda devices: True,
        timeout: float = 30.0,
        *,
        after: float | None = None,
    ) -> DeviceUpdate:
        """The first message (later than `after`, if given) whose list satisfies predicate: for benchmarks
        that need the moment kubelet learned of a change, even if a later message changed it again."""

        def found() -> DeviceUpdate | None:
            for update in self._updates:
                later = after is None or update.time > after
                if update.resource_name == resource and later and predicate(list(update.devices)):
                    return update
            return None

        return self._wait(
            found, timeout, f"a ListAndWatch message of {resource} that satisfies the predicate"
        )

    def wait_stream_ended(
        self, resource: str, timeout: float = 30.0, *, after: float | None = None
    ) -> StreamEnd:
        """The first recorded end of a ListAndWatch stream of the resource (later than `after`, if given)."""

        def found() -> StreamEnd | None:
            for end in self._stream_ends:
                if end.resource_name == resource and (after is None or end.time > after):
                    return end
            return None

        return self._wait(found, timeout, f"the end of a ListAndWatch stream of {resource}")

    def _wait(self, found: Callable[[], _T | None], timeout: float, what: str) -> _T:
        def gave_up() -> str:
            return f"fake kubelet: waited {timeout} s for {what}; {self._summary()}"

        return wait_until(self._cond, found, timeout, gave_up)

    def _summary(self) -> str:
        registered = [(r.resource_name, r.endpoint) for r in self._registrations]
        refused = [(r.resource_name, r.message) for r in self._rejections]
        return f"registrations {registered}, rejections {refused}, {len(self._updates)} messages"

    def _latest(self, resource: str) -> list[DeviceInfo] | None:
        endpoint = self._endpoints.get(resource)
        return None if endpoint is None or endpoint.devices is None else list(endpoint.devices)

    # -- calling the plugin, as kubelet does -----------------------------------------------------------------

    def options(self, resource: str, *, timeout: float | None = None) -> pb.DevicePluginOptions:
        response: pb.DevicePluginOptions = self._stub(resource).GetDevicePluginOptions(
            pb.Empty(), timeout=timeout or self.rpc_timeout
        )
        return response

    def allocate(
        self, resource: str, containers: Sequence[Sequence[str]], *, timeout: float | None = None
    ) -> pb.AllocateResponse:
        """Allocate with one ContainerAllocateRequest per entry (kubelet sends one container per call)."""
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids)) for ids in containers]
        )
        response: pb.AllocateResponse = self._stub(resource).Allocate(
            request, timeout=timeout or self.rpc_timeout
        )
        return response

    def get_preferred_allocation(
        self,
        resource: str,
        available: Iterable[str],
        must_include: Iterable[str] = (),
        size: int = 1,
        *,
        timeout: float | None = None,
        check_options: bool = True,
    ) -> pb.PreferredAllocationResponse:
        """kubelet calls it only when the plugin's options advertise it; so does this unless told not to."""
        if check_options:
            self._require_option(resource, "get_preferred_allocation_available")
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        response: pb.PreferredAllocationResponse = self._stub(resource).GetPreferredAllocation(
            request, timeout=timeout or self.rpc_timeout
        )
        return response

    def pre_start_container(
        self, resource: str, ids: Iterable[str], *, timeout: float = 30.0, check_options: bool = True
    ) -> pb.PreStartContainerResponse:
        """kubelet calls it only when pre_start_required is set, and gives it 30 s."""
        if check_options:
            self._require_option(resource, "pre_start_required")
        response: pb.PreStartContainerResponse = self._stub(resource).PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=list(ids)), timeout=timeout
        )
        return response

    def _endpoint(self, resource: str) -> _Endpoint:
        with self._cond:
            endpoint = self._endpoints.get(resource)
        if endpoint is None:
            raise LookupError(f"fake kubelet: {resource} is not registered")
        return endpoint

    def _stub(self, resource: str) -> Any:
        return self._endpoint(resource).stub

    def _require_option(self, resource: str, option: str) -> None:
        options = self._endpoint(resource).registration.options
        if not getattr(options, option):
            raise LookupError(
                f"fake kubelet: {resource}'s plugin did not set {option}; kubelet would not call"
            )

    # -- Register, as kubelet's device manager does it -------------------------------------------------------

    def _register(self, request: pb.RegisterRequest, context: Any, generation: int) -> pb.Empty:
        resource, endpoint_name = request.resource_name, request.endpoint

        def refuse(message: str) -> NoReturn:
            with self._cond:
                self._rejections.append(
                    Rejection(time.monotonic(), resource, endpoint_name, request.version, message)
                )
                self._cond.notify_all()
            # kubelet returns a plain Go error, which reaches the plugin as UNKNOWN.
            context.abort(grpc.StatusCode.UNKNOWN, message)
            raise AssertionError("context.abort returned")

        if request.version != VERSION:
            refuse(
                f"requested API version {request.version!r} is not supported by kubelet. "
                f"Supported versions are [{VERSION!r}]"
            )
        if not is_valid_extended_resource_name(resource):
            refuse(f"the ResourceName {resource!r} is invalid")
        problem = self._endpoint_problem(endpoint_name)
        if problem:
            refuse(problem)

        path = self.socket_dir / endpoint_name
        failure = self._dial(path)
        if failure is not None:
            refuse(failure)
        channel = grpc.insecure_channel(f"unix:{path}", options=[("grpc.default_authority", "localhost")])
        with self._cond:
            self._pending_channels.add(channel)
        try:
            stub = _services.DevicePluginStub(channel)
            options, failure = self._get_options(stub)
        finally:
            with self._cond:
                self._pending_channels.discard(channel)
        if failure is not None or options is None:
            channel.close()
            refuse(failure or "no options")

        registration = Registration(
            time=time.monotonic(),
            resource_name=resource,
            endpoint=endpoint_name,
            version=request.version,
            request_options=_copy(request.options),
            options=_copy(options),
            kubelet_generation=generation,
        )
        endpoint = _Endpoint(registration=registration, channel=channel, stub=stub)
        with self._cond:
            # Checked under the lock that stop() takes, so that no endpoint slips in after stop() dropped all.
            current = not self._stopping.is_set() and generation == self._generation
            old = self._endpoints.get(resource) if current else None
            if current:
                self._endpoints[resource] = endpoint
                self._registrations.append(registration)
                self._cond.notify_all()
        if not current:
            channel.close()
            refuse("kubelet is shutting down")
        if old is not None:
            self._close(old, REPLACED)
        endpoint.thread = threading.Thread(
            target=self._watch, args=(endpoint,), name=f"fake-kubelet-watch-{resource}", daemon=True
        )
        endpoint.thread.start()
        return pb.Empty()

    def _endpoint_problem(self, name: str) -> str | None:
        if not name or "/" in name or name in (".", ".."):
            return f"endpoint {name!r} must be a socket file name in {self.socket_dir}"
        path = self.socket_dir / name
        if len(os.fsencode(path)) > MAX_UNIX_PATH:
            return f"endpoint {path} is longer than a unix socket path may be ({MAX_UNIX_PATH} bytes)"
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return f"endpoint {path} does not exist"
        if not stat.S_ISSOCK(mode):
            return f"endpoint {path} is not a socket"
        return None

    def _dial(self, path: Path) -> str | None:
        """kubelet's grpc.DialContext(WithBlock, 10 s): retry until the socket accepts; None when it does.

        A plain connect rather than grpc.channel_ready_future: that future leaves a connectivity-polling
        thread on the channel, and closing such a channel blocks for up to 0.2 s (every stop() and restart()).
        """
        deadline = time.monotonic() + self.dial_timeout
        while True:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                return None
            except OSError as err:
                error = err
            finally:
                probe.close()
            if time.monotonic() >= deadline or self._stopping.wait(_POLL):
                return f"failed to dial device plugin: {path}: {error.strerror or error}"

    def _get_options(self, stub: Any) -> tuple[pb.DevicePluginOptions | None, str | None]:
        # wait_for_ready: kubelet's channel is already connected when it asks, this one connects now; a
        # hiccup in that connect must not fail a Register that kubelet would have accepted.
        call = stub.GetDevicePluginOptions.future(
            pb.Empty(), timeout=self.options_timeout, wait_for_ready=True
        )
        while not self._stopping.is_set():
            try:
                options: pb.DevicePluginOptions = call.result(timeout=_POLL)
                return options, None
            except grpc.FutureTimeoutError:
                continue
            except grpc.RpcError as err:
                return None, f"failed to get device plugin options: {rpc_error_text(err)}"
        call.cancel()
        return None, "failed to get device plugin options: kubelet is shutting down"

    # -- ListAndWatch ----------------------------------------------------------------------------------------

    def _watch(self, endpoint: _Endpoint) -> None:
        """Keep the endpoint's ListAndWatch open (no deadline: it lives as long as the plugin)."""
        resource = endpoint.registration.resource_name
        reason, code, details = RETURNED, "OK", ""
        try:
            call = endpoint.stub.ListAndWatch(pb.Empty())
            with self._cond:
                endpoint.call = call
                closing = endpoint.close_reason is not None
            if closing:  # kubelet dropped the endpoint before the stream opened
                call.cancel()
            for response in call:
                self._received(endpoint, response)
        except grpc.RpcError as err:
            reason, code, details = FAILED, err.code().name, err.details() or ""
        except ValueError as err:  # gRPC's "Cannot invoke RPC on closed channel!": closed before it opened
            reason, code, details = FAILED, "CANCELLED", str(err)
        with self._cond:
            endpoint.ended = True
            self._stream_ends.append(
                StreamEnd(
                    time=time.monotonic(),
                    resource_name=resource,
                    endpoint=endpoint.registration.endpoint,
                    reason=endpoint.close_reason or reason,
                    code=code,
                    details=details,
                )
            )
            self._cond.notify_all()

    def _received(self, endpoint: _Endpoint, response: pb.ListAndWatchResponse) -> None:
        now = time.monotonic()
        devices = tuple(
            DeviceInfo(d.ID, d.health, tuple(int(n.ID) for n in d.topology.nodes)) for d in response.devices
        )
        problems = _check_devices(devices)
        registration = endpoint.registration
        with self._cond:
            if endpoint.close_reason is not None:
                return  # kubelet already dropped this endpoint; it would not look at the message
            endpoint.devices = devices
            endpoint.messages += 1
            self._updates.append(
                DeviceUpdate(now, registration.resource_name, registration.endpoint, devices)
            )
            self._violations.extend(f"{registration.resource_name}: {p}" for p in problems)
            self._cond.notify_all()

    def _close(self, endpoint: _Endpoint, reason: str) -> None:
        with self._cond:
            if endpoint.close_reason is None:
                endpoint.close_reason = reason
            call = endpoint.call
        if call is not None:
            call.cancel()
        endpoint.channel.close()


class _RegistrationServicer(pb_grpc.RegistrationServicer):
    """Binds Register calls to the server generation that received them, so a call that is still in
    flight when restart() replaces the server cannot register against the new kubelet."""

    def __init__(self, kubelet: FakeKubelet, generation: int) -> None:
        self._kubelet = kubelet
        self._generation = generation

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        return self._kubelet._register(request, context, self._generation)


def _check_devices(devices: tuple[DeviceInfo, ...]) -> list[str]:
    problems = []
    seen: set[str] = set()
    for device in devices:
        if not device.id or len(device.id) > 63:
            problems.append(f"device ID {device.id!r} is empty or longer than 63 characters")
        if device.id in seen:
            problems.append(f"device ID {device.id!r} is listed twice")
        seen.add(device.id)
        if device.health not in (HEALTHY, UNHEALTHY):
            problems.append(f"device {device.id!r} has health {device.health!r}")
    return problems


def _copy(options: pb.DevicePluginOptions) -> pb.DevicePluginOptions:
    copy = pb.DevicePluginOptions()
    copy.CopyFrom(options)
    return copy


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:  # gone, or a dangling link: kubelet skips what it cannot stat
        return False


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except FileNotFoundError:
        return None


def _file_state(path: Path) -> tuple[int, int, bytes]:
    info = path.stat()
    return info.st_ino, info.st_mtime_ns, path.read_bytes()
