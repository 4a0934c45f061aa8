"""A fake kubelet DRA side for DRA driver tests and benchmarks: kubelet 1.36 as a DRA plugin sees it.

It behaves as shared/specs/dra-kubelet-plugin.md says kubelet does:

- **Plugin watcher**: `<registry_dir>` (kubelet's `plugins_registry`) and its subdirectories are watched with
  inotify, as kubelet's fsnotify does; sockets already there at start() are found. Only unix sockets count;
  names starting with `.` are ignored.
- **Registration**, per socket, in its own thread: dial (10 s) → GetInfo (1 s deadline) → validate (type
  `DRAPlugin`, a driver name, an absolute endpoint or empty for the registration socket itself, the first
  entry of supported_versions kubelet knows wins, none known → rejected) → register (connect to the endpoint,
  open the health stream) → NotifyRegistrationStatus(true) (5 s; an error undoes the registration). A
  validation failure is told to the plugin with Notify(false, reason). Every failure is recorded as a
  `Rejection` and retried with a backoff of 0.5 s doubling to ~2 min, until the socket goes away.
- **Socket removed** → the instance is deregistered (channel closed, health stream ended); re-created → it
  registers again. restart() keeps the sockets (kubelet never deletes plugins_registry sockets) and
  registers them again, as a restarted kubelet does.
- **Connections**: kubelet watches each endpoint's channel. A drop does not deregister; but when no instance
  of a driver is registered and connected for `wipe_delay` (30 s, kubelet's defaultWipingDelay), the
  driver's slices of the node are wiped: `wipe_slices(node_name, driver)`. At start() the node's slices
  are all wiped (`wipe_slices(node_name, None)`, retried until it does not raise) when
  `wipe_slices_at_start`. The callable is where a test wires its API server's DeleteCollection.
- **prepare(driver, claims)** / **unprepare(driver, claims)** call the newest connected instance with the
  negotiated version and a 45 s deadline, and apply kubelet's error rules: a gRPC error, a claim's
  non-empty `error`, a result for a claim not asked for, or a claim left out fails the whole call
  (`DraCallError`, with kubelet's wording). The claim GETs kubelet does first are the caller's business.
- **Health**: after registration kubelet opens `v1alpha1.DRAResourceHealth/NodeWatchResources` on the
  endpoint (whatever supported_versions says), records every message (messages cut at 1024 bytes, as
  kubelet does), and on an error or the end of the stream forgets the driver's health and opens it again
  every 5 s (`health_retry`).

Everything is stamped with time.monotonic(); wait_* helpers wait on a condition variable, never by sleeping.
grpc has no type stubs, so it is imported by name and typed Any (as in tests/integration/kubelet.py).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from gpunode.dra.api import dra_health_v1alpha1_pb2 as health_pb
from gpunode.dra.api import dra_health_v1alpha1_pb2_grpc as health_grpc
from gpunode.dra.api import dra_v1_pb2 as v1_pb
from gpunode.dra.api import dra_v1_pb2_grpc as v1_grpc
from gpunode.dra.api import dra_v1beta1_pb2 as v1beta1_pb
from gpunode.dra.api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from gpunode.dra.api import pluginregistration_pb2 as reg_pb
from gpunode.dra.api import pluginregistration_pb2_grpc as reg_grpc
from tests.integration.kubeletcommon import rpc_error_text, wait_until

grpc: Any = importlib.import_module("grpc")
# The generated service modules are untyped; going through Any keeps mypy --strict quiet about their calls.
_reg: Any = reg_grpc
_health: Any = health_grpc
_STUBS: dict[str, Any] = {
    "v1.DRAPlugin": v1_grpc.DRAPluginStub,
    "v1beta1.DRAPlugin": v1beta1_grpc.DRAPluginStub,
}
_PB: dict[str, Any] = {"v1.DRAPlugin": v1_pb, "v1beta1.DRAPlugin": v1beta1_pb}

PLUGIN_TYPE = "DRAPlugin"
# The DRA services kubelet 1.36 knows, by the names plugins put in supported_versions.
KNOWN_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_MESSAGE_LIMIT = 1024  # kubelet cuts longer health messages
MAX_UNIX_PATH = 107  # sockaddr_un.sun_path, less the NUL
_T = TypeVar("_T")

# inotify, through libc (as gpunode's own watcher does; no extra dependency).
_IN_CREATE, _IN_DELETE, _IN_MOVED_FROM, _IN_MOVED_TO = 0x100, 0x200, 0x40, 0x80
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_IGNORED, _IN_ISDIR = 0x400, 0x800, 0x8000, 0x40000000
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_WATCH_MASK = _IN_CREATE | _IN_DELETE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_DELETE_SELF | _IN_MOVE_SELF
_EVENT = struct.Struct("iIII")


class Claim(NamedTuple):
    """A claim as kubelet names it in Prepare and Unprepare."""

    namespace: str
    uid: str
    name: str


class PreparedDevice(NamedTuple):
    """One device of a prepared claim; share_id is None when absent (always with v1beta1)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None


class DeviceHealth(NamedTuple):
    pool_name: str
    device_name: str
    health: str  # "UNKNOWN", "HEALTHY" or "UNHEALTHY"
    last_updated_time: int
    health_check_timeout_seconds: int
    message: str  # as kubelet keeps it: at most HEALTH_MESSAGE_LIMIT bytes


@dataclass(frozen=True)
class Registration:
    """An instance kubelet registered (Notify(true) answered)."""

    time: float
    socket: Path  # the registration socket in plugins_registry
    driver: str
    endpoint: str  # the DRA socket kubelet dials (the registration socket when PluginInfo left it empty)
    version: str  # the service kubelet chose: the first known entry of supported_versions
    supported_versions: tuple[str, ...]
    generation: int  # 0 for the first start(), +1 per restart()


@dataclass(frozen=True)
class Rejection:
    """A failed registration attempt; `stage` is dial, getinfo, validate or notify."""

    time: float
    socket: Path
    stage: str
    message: str
    notified: bool  # whether kubelet told the plugin with Notify(false, message)
    driver: str = ""  # from GetInfo, when it answered


@dataclass(frozen=True)
class Deregistration:
    time: float
    socket: Path
    driver: str
    endpoint: str
    reason: str  # "socket-removed", "notify-failed" or "kubelet-stopped"


@dataclass(frozen=True)
class Call:
    """One NodePrepareResources / NodeUnprepareResources call and what kubelet made of it."""

    start: float
    end: float
    method: str  # "NodePrepareResources" or "NodeUnprepareResources"
    driver: str
    endpoint: str
    version: str
    claims: tuple[Claim, ...]
    error: str | None  # kubelet's error for the whole call, None when it succeeded
    prepared: dict[str, tuple[PreparedDevice, ...]] = field(default_factory=dict)  # Prepare's result


@dataclass(frozen=True)
class HealthUpdate:
    time: float
    driver: str
    endpoint: str
    devices: tuple[DeviceHealth, ...]


@dataclass(frozen=True)
class HealthStreamEnd:
    time: float
    driver: str
    endpoint: str
    code: str  # gRPC status code name; "OK" when the plugin's handler returned
    details: str


@dataclass(frozen=True)
class ConnectionChange:
    time: float
    driver: str
    endpoint: str
    connected: bool


@dataclass(frozen=True)
class Wipe:
    """A call of wipe_slices: driver None is the start-up wipe of all the node's slices."""

    time: float
    node_name: str
    driver: str | None
    error: str | None  # what the callable raised (the start-up wipe is then retried)


class DraCallError(Exception):
    """A Prepare or Unprepare call kubelet counts as failed; the message is kubelet's."""


@dataclass
class _Instance:
    """kubelet's state for one registration socket."""

    socket: Path
    inode: int | None  # tells a re-created socket from the same one seen twice
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    registration: Registration | None = None
    channel: Any = None  # to the DRA endpoint
    connected: bool = False
    health_thread: threading.Thread | None = None


class FakeDraKubelet:
    """kubelet's DRA side over `<registry_dir>`; see the module docstring."""

    def __init__(
        self,
        registry_dir: Path,
        *,
        node_name: str = "node-1",
        wipe_slices: Callable[[str, str | None], None] | None = None,
        wipe_slices_at_start: bool = True,
        wipe_delay: float = 30.0,
        dial_timeout: float = 10.0,
        getinfo_timeout: float = 1.0,
        notify_timeout: float = 5.0,
        call_timeout: float = 45.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 122.0,
        health_retry: float = 5.0,
    ) -> None:
        """The defaults are kubelet 1.36's; tests shorten wipe_delay, backoff and health_retry."""
        self.registry_dir = Path(registry_dir).absolute()
        self.node_name = node_name
        self.wipe_slices = wipe_slices
        self.wipe_slices_at_start = wipe_slices_at_start
        self.wipe_delay = wipe_delay
        self.dial_timeout = dial_timeout
        self.getinfo_timeout = getinfo_timeout
        self.notify_timeout = notify_timeout
        self.call_timeout = call_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.health_retry = health_retry

        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._generation = -1
        self._instances: dict[Path, _Instance] = {}
        self._watch_thread: threading.Thread | None = None
        self._wiper_thread: threading.Thread | None = None
        self._start_wipe_thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        # driver → since when no registered instance of it is connected (absent: one is, or it never was)
        self._disconnected_since: dict[str, float] = {}
        self._registrations: list[Registration] = []
        self._rejections: list[Rejection] = []
        self._deregistrations: list[Deregistration] = []
        self._calls: list[Call] = []
        self._health_updates: list[HealthUpdate] = []
        self._health_ends: list[HealthStreamEnd] = []
        self._health: dict[str, dict[tuple[str, str], DeviceHealth]] = {}  # driver → kubelet's view
        self._connections: list[ConnectionChange] = []
        self._wipes: list[Wipe] = []
        self._starts: list[float] = []

    # -- lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> FakeDraKubelet:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._watch_thread is not None

    def start(self) -> float:
        """Watch the registry directory (made if missing), wipe the node's slices, register what is there."""
        if self.running:
            raise RuntimeError("the fake DRA kubelet is already running")
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._stopping.clear()
        self._generation += 1
        inotify = _Inotify()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        watches = {}
        # Watch first, then scan: a socket created in between is seen twice, which _found() tolerates.
        for directory in [self.registry_dir, *sorted(p for p in self.registry_dir.rglob("*") if p.is_dir())]:
            watches[inotify.add(directory)] = directory
        started = time.monotonic()
        with self._cond:
            self._starts.append(started)
        if self.wipe_slices_at_start:
            self._start_wipe_thread = threading.Thread(
                target=self._start_wipe, name="dra-kubelet-start-wipe", daemon=True
            )
            self._start_wipe_thread.start()
        self._wiper_thread = threading.Thread(target=self._wiper, name="dra-kubelet-wiper", daemon=True)
        self._wiper_thread.start()
        for path in sorted(self.registry_dir.rglob("*")):
            self._found(path)
        self._watch_thread = threading.Thread(
            target=self._watch, args=(inotify, watches), name="dra-kubelet-watch", daemon=True
        )
        self._watch_thread.start()
        return started

    def stop(self) -> None:
        """Stop like an exiting kubelet: every connection closed, the plugins' sockets left alone."""
        if not self.running:
            return
        self._stopping.set()
        os.write(self._wake_w, b"x")
        assert self._watch_thread is not None
        self._watch_thread.join()
        self._watch_thread = None
        os.close(self._wake_r)
        os.close(self._wake_w)
        with self._cond:
            instances = list(self._instances.values())
            self._instances.clear()
            self._cond.notify_all()
        for instance in instances:
            self._drop(instance, "kubelet-stopped")
        for thread in (self._wiper_thread, self._start_wipe_thread):
            if thread is not None:
                thread.join()
        self._wiper_thread = self._start_wipe_thread = None
        with self._cond:
            self._disconnected_since.clear()
            self._health.clear()
            self._cond.notify_all()

    def restart(self) -> float:
        """A kubelet restart: stop, then start (the start-up wipe again, every socket registered again)."""
        self.stop()
        return self.start()

    # -- what kubelet did ------------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def starts(self) -> list[float]:
        with self._cond:
            return list(self._starts)

    def registrations(self, driver: str | None = None) -> list[Registration]:
        with self._cond:
            return [r for r in self._registrations if driver is None or r.driver == driver]

    def rejections(self, socket_path: Path | None = None) -> list[Rejection]:
        with self._cond:
            return [r for r in self._rejections if socket_path is None or r.socket == socket_path]

    def deregistrations(self, driver: str | None = None) -> list[Deregistration]:
        with self._cond:
            return [d for d in self._deregistrations if driver is None or d.driver == driver]

    def calls(self, driver: str | None = None) -> list[Call]:
        with self._cond:
            return [c for c in self._calls if driver is None or c.driver == driver]

    def health_updates(self, driver: str | None = None) -> list[HealthUpdate]:
        with self._cond:
            return [u for u in self._health_updates if driver is None or u.driver == driver]

    def health_stream_ends(self, driver: str | None = None) -> list[HealthStreamEnd]:
        with self._cond:
            return [e for e in self._health_ends if driver is None or e.driver == driver]

    def health(self, driver: str) -> dict[tuple[str, str], DeviceHealth]:
        """kubelet's current view of the driver's devices, by (pool, device): empty once a stream ended."""
        with self._cond:
            return dict(self._health.get(driver, {}))

    def connections(self, driver: str | None = None) -> list[ConnectionChange]:
        with self._cond:
            return [c for c in self._connections if driver is None or c.driver == driver]

    def wipes(self) -> list[Wipe]:
        with self._cond:
            return list(self._wipes)

    def registered(self, driver: str) -> list[Registration]:
        """The driver's instances registered now, oldest first."""
        with self._cond:
            return self._registered(driver)

    def connected(self, driver: str) -> bool:
        with self._cond:
            return self._serving(driver) is not None

    # -- waiting ---------------------------------------------------------------------------------------------

    def wait_registered(
        self, driver: str, count: int = 1, timeout: float = 30.0, *, after: float | None = None
    ) -> Registration:
        """The count-th registration of the driver (only those later than `after`, if given)."""

        def found() -> Registration | None:
            seen = [
                r for r in self._registrations if r.driver == driver and (after is None or r.time > after)
            ]
            return seen[count - 1] if len(seen) >= count else None

        return self._wait(found, timeout, f"registration #{count} of {driver}")

    def wait_rejected(
        self, socket_path: Path, count: int = 1, timeout: float = 30.0, *, after: float | None = None
    ) -> Rejection:
        """The count-th failed registration attempt on the socket."""
        path = Path(socket_path).absolute()

        def found() -> Rejection | None:
            seen = [r for r in self._rejections if r.socket == path and (after is None or r.time > after)]
            return seen[count - 1] if len(seen) >= count else None

        return self._wait(found, timeout, f"rejection #{count} of {path}")

    def wait_deregistered(
        self, driver: str, timeout: float = 30.0, *, after: float | None = None
    ) -> Deregistration:
        def found() -> Deregistration | None:
            for d in self._deregistrations:
                if d.driver == driver and (after is None or d.time > after):
                    return d
            return None

        return self._wait(found, timeout, f"deregistration of {driver}")

    def wait_connected(self, driver: str, connected: bool = True, timeout: float = 30.0) -> None:
        """Until an instance of the driver is registered and connected (or, connected=False, none is)."""

        def found() -> bool | None:
            return True if (self._serving(driver) is not None) == connected else None

        self._wait(found, timeout, f"{driver} {'connected' if connected else 'disconnected'}")

    def wait_health(
        self,
        driver: str,
        predicate: Callable[[dict[tuple[str, str], DeviceHealth]], bool] = bool,
        timeout: float = 30.0,
    ) -> dict[tuple[str, str], DeviceHealth]:
        """Until kubelet's view of the driver's health satisfies predicate (by default: holds a device)."""

        def found() -> dict[tuple[str, str], DeviceHealth] | None:
            health = dict(self._health.get(driver, {}))
            return health if predicate(health) else None

        return self._wait(found, timeout, f"health of {driver} that satisfies the predicate")

    def wait_health_stream_ended(
        self, driver: str, timeout: float = 30.0, *, after: float | None = None
    ) -> HealthStreamEnd:
        def found() -> HealthStreamEnd | None:
            for e in self._health_ends:
                if e.driver == driver and (after is None or e.time > after):
                    return e
            return None

        return self._wait(found, timeout, f"the end of a health stream of {driver}")

    def wait_wiped(
        self, driver: str | None, timeout: float = 30.0, *, after: float | None = None, succeeded: bool = True
    ) -> Wipe:
        """The first wipe of the driver's slices (None: the start-up wipe), by default a successful one."""

        def found() -> Wipe | None:
            for w in self._wipes:
                if (
                    w.driver == driver
                    and (after is None or w.time > after)
                    and (w.error is None or not succeeded)
                ):
                    return w
            return None

        return self._wait(found, timeout, f"a wipe of {driver or 'all'} slices of {self.node_name}")

    def _wait(self, found: Callable[[], _T | None], timeout: float, what: str) -> _T:
        def gave_up() -> str:
            return f"fake DRA kubelet: waited {timeout} s for {what}; {self._summary()}"

        return wait_until(self._cond, found, timeout, gave_up)

    def _summary(self) -> str:
        registered = [(r.driver, r.endpoint, r.version) for r in self._registrations]
        refused = [(str(r.socket), r.stage, r.message) for r in self._rejections[-5:]]
        return (
            f"registrations {registered}, last rejections {refused}, {len(self._calls)} calls, "
            f"{len(self._health_updates)} health messages, wipes {[(w.driver, w.error) for w in self._wipes]}"
        )

    # -- Prepare / Unprepare ---------------------------------------------------------------------------------

    def prepare(self, driver: str, claims: Sequence[Claim]) -> dict[str, tuple[PreparedDevice, ...]]:
        """NodePrepareResources as kubelet calls it; the devices per claim UID, or DraCallError."""
        call = self._call("NodePrepareResources", driver, claims)
        if call.error is not None:
            raise DraCallError(call.error)
        return call.prepared

    def unprepare(self, driver: str, claims: Sequence[Claim]) -> None:
        """NodeUnprepareResources as kubelet calls it; DraCallError when kubelet would count it failed."""
        call = self._call("NodeUnprepareResources", driver, claims)
        if call.error is not None:
            raise DraCallError(call.error)

    def _call(self, method: str, driver: str, claims: Sequence[Claim]) -> Call:
        claims = tuple(Claim(*c) for c in claims)
        # No lock: kubelet's calls for different pods overlap, and serialising them is the driver's job.
        start = time.monotonic()
        with self._cond:
            instance = self._serving(driver) or self._newest(driver)
        if instance is None or instance.registration is None:
            # kubelet: the claim's driver must be registered, else it fails without a call.
            missing = f"plugin name {driver} not found in the list of registered DRA plugins"
            return self._record_call(Call(start, time.monotonic(), method, driver, "", "", claims, missing))
        registration = instance.registration
        pb = _PB[registration.version]
        stub = _STUBS[registration.version](instance.channel)
        request_type = (
            pb.NodePrepareResourcesRequest
            if method == "NodePrepareResources"
            else pb.NodeUnprepareResourcesRequest
        )
        request = request_type(
            claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        prepared: dict[str, tuple[PreparedDevice, ...]] = {}
        error: str | None = None
        try:
            response = getattr(stub, method)(request, timeout=self.call_timeout)
        except grpc.RpcError as err:
            error = f"{method} failed: {rpc_error_text(err)}"
        else:
            error = _check_response(method, claims, response)
            if error is None and method == "NodePrepareResources":
                prepared = {
                    uid: tuple(_device(d) for d in result.devices) for uid, result in response.claims.items()
                }
        call = Call(
            start,
            time.monotonic(),
            method,
            driver,
            registration.endpoint,
            registration.version,
            claims,
            error,
            prepared,
        )
        return self._record_call(call)

    def _record_call(self, call: Call) -> Call:
        with self._cond:
            self._calls.append(call)
            self._cond.notify_all()
        return call

    # -- the plugin watcher ----------------------------------------------------------------------------------

    def _watch(self, inotify: _Inotify, watches: dict[int, Path]) -> None:
        poller = select.poll()
        poller.register(inotify.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self._stopping.is_set():
                poller.poll()
                if self._stopping.is_set():
                    return
                for wd, mask, name in inotify.read():
                    directory = watches.get(wd)
                    if directory is None:
                        continue
                    if mask & (_IN_DELETE_SELF | _IN_MOVE_SELF | _IN_IGNORED):
                        watches.pop(wd, None)
                        continue
                    path = directory / name
                    if mask & (_IN_CREATE | _IN_MOVED_TO):
                        if mask & _IN_ISDIR:
                            # fsnotify watches subdirectories too: watch it, then look at what is in it.
                            try:
                                watches[inotify.add(path)] = path
                            except OSError:
                                continue  # gone again already
                            for inner in sorted(path.rglob("*")):
                                if inner.is_dir():
                                    watches[inotify.add(inner)] = inner
                                self._found(inner)
                        else:
                            self._found(path)
                    elif mask & (_IN_DELETE | _IN_MOVED_FROM):
                        self._removed(path)
        finally:
            inotify.close()

    def _found(self, path: Path) -> None:
        """A file appeared: a unix socket not starting with '.' is a plugin to register."""
        if path.name.startswith(".") or not _is_socket(path):
            return
        with self._cond:
            old = self._instances.pop(path, None)
        inode = _inode(path)
        if old is not None:
            if old.inode == inode:
                with self._cond:
                    self._instances[path] = old  # the same socket seen twice (the scan after the watch)
                return
            self._drop(old, "socket-removed")  # replaced without a delete event (renamed over)
        instance = _Instance(socket=path, inode=inode)
        instance.thread = threading.Thread(
            target=self._register_loop,
            args=(instance,),
            name=f"dra-kubelet-register-{path.name}",
            daemon=True,
        )
        with self._cond:
            self._instances[path] = instance
        instance.thread.start()

    def _removed(self, path: Path) -> None:
        with self._cond:
            instance = self._instances.pop(path, None)
        if instance is not None:
            self._drop(instance, "socket-removed")

    # -- registration ----------------------------------------------------------------------------------------

    def _register_loop(self, instance: _Instance) -> None:
        backoff = self.backoff_initial
        while not instance.stop.is_set():
            if self._try_register(instance):
                return
            if instance.stop.wait(backoff):
                return
            backoff = min(backoff * 2, self.backoff_max)

    def _reject(
        self, instance: _Instance, stage: str, message: str, *, notified: bool, driver: str = ""
    ) -> bool:
        with self._cond:
            self._rejections.append(
                Rejection(time.monotonic(), instance.socket, stage, message, notified, driver)
            )
            self._cond.notify_all()
        return False

    def _try_register(self, instance: _Instance) -> bool:
        path = instance.socket
        problem = self._dial(path, instance.stop)
        if problem is not None:
            return self._reject(instance, "dial", problem, notified=False)
        channel = grpc.insecure_channel(f"unix:{path}")
        try:
            stub = _reg.RegistrationStub(channel)
            try:
                info = stub.GetInfo(reg_pb.InfoRequest(), timeout=self.getinfo_timeout, wait_for_ready=True)
            except grpc.RpcError as err:
                return self._reject(
                    instance,
                    "getinfo",
                    f"failed to get plugin info using RPC GetInfo at socket {path}, "
                    f"err: {rpc_error_text(err)}",
                    notified=False,
                )

            def notify(registered: bool, error: str = "") -> str | None:
                status = reg_pb.RegistrationStatus(plugin_registered=registered, error=error)
                try:
                    stub.NotifyRegistrationStatus(status, timeout=self.notify_timeout)
                except grpc.RpcError as err:
                    return rpc_error_text(err)
                return None

            problem, version, endpoint = self._validate(info, path)
            if problem is not None:
                notify(False, problem)
                return self._reject(instance, "validate", problem, notified=True, driver=info.name)
            if instance.stop.is_set():
                return True
            registration = Registration(
                time=time.monotonic(),
                socket=path,
                driver=info.name,
                endpoint=endpoint,
                version=version,
                supported_versions=tuple(info.supported_versions),
                generation=self._generation,
            )
            self._connect(instance, registration)
            failed = notify(True)
            if failed is not None:
                # An error from Notify(true) undoes the registration (and kubelet tries again).
                self._disconnect(instance, "notify-failed")
                return self._reject(
                    instance,
                    "notify",
                    f"failed to notify registration status: {failed}",
                    notified=False,
                    driver=info.name,
                )
            with self._cond:
                if instance.stop.is_set():
                    return True
                self._registrations.append(registration)
                self._cond.notify_all()
            return True
        finally:
            channel.close()

    def _validate(self, info: Any, path: Path) -> tuple[str | None, str, str]:
        """(problem, version, endpoint) as kubelet's plugin watcher and DRA plugin manager judge GetInfo."""
        if info.type != PLUGIN_TYPE:
            return f"no handler registered for plugin type: {info.type} at socket {path}", "", ""
        if not info.name:
            return "plugin name is empty", "", ""
        endpoint = info.endpoint or str(path)
        if not os.path.isabs(endpoint):
            return f"endpoint {info.endpoint!r} of plugin {info.name} is not an absolute path", "", ""
        # The first entry kubelet knows wins; unknown strings are skipped.
        version = next((v for v in info.supported_versions if v in KNOWN_VERSIONS), None)
        if version is None:
            return (
                f"none of the versions supported by plugin {info.name} ({list(info.supported_versions)}) are "
                f"supported by kubelet ({list(KNOWN_VERSIONS)})",
                "",
                "",
            )
        return None, version, endpoint

    def _dial(self, path: Path, stop: threading.Event) -> str | None:
        """kubelet's blocking dial (10 s): retry a plain connect until the socket accepts; None if it does."""
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
            if time.monotonic() >= deadline or stop.wait(0.05) or self._stopping.is_set():
                return f"failed to dial socket {path}: {error.strerror or error}"

    # -- connections and health ------------------------------------------------------------------------------

    def _connect(self, instance: _Instance, registration: Registration) -> None:
        """Open the endpoint's channel, watch its state, and open the health stream."""
        channel = grpc.insecure_channel(f"unix:{registration.endpoint}")
        with self._cond:
            instance.registration = registration
            instance.channel = channel
            self._disconnected_since.setdefault(registration.driver, time.monotonic())
            self._cond.notify_all()
        channel.subscribe(lambda state: self._state(instance, channel, state), try_to_connect=True)
        instance.health_thread = threading.Thread(
            target=self._health_loop,
            args=(instance, registration, channel),
            name="dra-kubelet-health",
            daemon=True,
        )
        instance.health_thread.start()

    def _state(self, instance: _Instance, channel: Any, state: Any) -> None:
        connected = state == grpc.ChannelConnectivity.READY
        with self._cond:
            registration = instance.registration
            if registration is None or instance.channel is not channel or instance.connected == connected:
                return
            instance.connected = connected
            now = time.monotonic()
            self._connections.append(
                ConnectionChange(now, registration.driver, registration.endpoint, connected)
            )
            self._update_disconnected(registration.driver, now)
            self._cond.notify_all()

    def _update_disconnected(self, driver: str, now: float) -> None:
        """Start (or cancel) the driver's wiping delay; call with the lock held."""
        if self._serving(driver) is not None:
            self._disconnected_since.pop(driver, None)
        else:
            self._disconnected_since.setdefault(driver, now)

    def _health_loop(self, instance: _Instance, registration: Registration, channel: Any) -> None:
        driver, endpoint = registration.driver, registration.endpoint
        stub = _health.DRAResourceHealthStub(channel)
        # The stream belongs to this registration's channel: closing the channel (deregistration) ends it.
        while not instance.stop.is_set():
            with self._cond:
                if instance.channel is not channel:
                    return
            code, details = "OK", ""
            try:
                call = stub.NodeWatchResources(health_pb.NodeWatchResourcesRequest(), wait_for_ready=True)
                for response in call:
                    devices = tuple(_health_of(d) for d in response.devices)
                    with self._cond:
                        if instance.channel is not channel:
                            break
                        self._health_updates.append(HealthUpdate(time.monotonic(), driver, endpoint, devices))
                        self._health[driver] = {(d.pool_name, d.device_name): d for d in devices}
                        self._cond.notify_all()
            except grpc.RpcError as err:
                code, details = err.code().name, err.details() or ""
            except ValueError as err:  # "Cannot invoke RPC on closed channel!": deregistered meanwhile
                code, details = "CANCELLED", str(err)
            with self._cond:
                # kubelet forgets the driver's health when the stream ends, and tries again in 5 s.
                self._health.pop(driver, None)
                self._health_ends.append(HealthStreamEnd(time.monotonic(), driver, endpoint, code, details))
                self._cond.notify_all()
            if instance.stop.wait(self.health_retry):
                return

    def _disconnect(self, instance: _Instance, reason: str) -> None:
        """Undo a registration: stop the health stream, close the channel, start the wiping delay."""
        with self._cond:
            registration, channel = instance.registration, instance.channel
            instance.registration = None
            instance.channel = None
            instance.connected = False
            if registration is not None:
                self._deregistrations.append(
                    Deregistration(
                        time.monotonic(), instance.socket, registration.driver, registration.endpoint, reason
                    )
                )
                self._update_disconnected(registration.driver, time.monotonic())
            self._cond.notify_all()
        if channel is not None:
            channel.close()  # cancels the health stream too

    def _drop(self, instance: _Instance, reason: str) -> None:
        instance.stop.set()
        self._disconnect(instance, reason)
        for thread in (instance.thread, instance.health_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join()

    # -- slice wiping ----------------------------------------------------------------------------------------

    def _wipe(self, driver: str | None) -> bool:
        error = None
        if self.wipe_slices is not None:
            try:
                self.wipe_slices(self.node_name, driver)
            except Exception as err:  # kubelet logs it and tries again; the test sees it in wipes()
                error = f"{type(err).__name__}: {err}"
        with self._cond:
            self._wipes.append(Wipe(time.monotonic(), self.node_name, driver, error))
            self._cond.notify_all()
        return error is None

    def _start_wipe(self) -> None:
        """At start-up kubelet deletes all the node's slices, retrying until done."""
        backoff = self.backoff_initial
        while not self._wipe(None):
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self.backoff_max)

    def _wiper(self) -> None:
        """Wipe a driver's slices once none of its instances has been connected for wipe_delay."""
        with self._cond:
            while not self._stopping.is_set():
                now = time.monotonic()
                due = [d for d, since in self._disconnected_since.items() if now - since >= self.wipe_delay]
                for driver in due:
                    del self._disconnected_since[driver]
                if due:
                    self._cond.release()
                    try:
                        for driver in due:
                            self._wipe(driver)
                    finally:
                        self._cond.acquire()
                    continue
                waits = [since + self.wipe_delay - now for since in self._disconnected_since.values()]
                self._cond.wait(min(waits) if waits else None)

    # -- helpers (call with the lock held) -------------------------------------------------------------------

    def _registered(self, driver: str) -> list[Registration]:
        found = [i.registration for i in self._instances.values() if i.registration is not None]
        return sorted((r for r in found if r.driver == driver), key=lambda r: r.time)

    def _newest(self, driver: str) -> _Instance | None:
        mine = [
            i
            for i in self._instances.values()
            if i.registration is not None and i.registration.driver == driver
        ]
        return max(mine, key=lambda i: i.registration.time if i.registration else 0.0, default=None)

    def _serving(self, driver: str) -> _Instance | None:
        """The newest registered instance of the driver that is connected (the one kubelet uses)."""
        mine = [
            i
            for i in self._instances.values()
            if i.registration is not None and i.registration.driver == driver and i.connected
        ]
        return max(mine, key=lambda i: i.registration.time if i.registration else 0.0, default=None)


class _Inotify:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd: int = fd

    def add(self, path: Path) -> int:
        wd = int(self._add(self.fd, os.fsencode(path), _WATCH_MASK))
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}", str(path))
        return wd

    def read(self) -> list[tuple[int, int, str]]:
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        events, offset = [], 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            offset += _EVENT.size
            name = data[offset : offset + length].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            offset += length
            events.append((wd, mask, name))
        return events

    def close(self) -> None:
        os.close(self.fd)


def _check_response(method: str, claims: tuple[Claim, ...], response: Any) -> str | None:
    """kubelet's rules for a response (pkg/kubelet/cm/dra/manager.go): the first problem, or None."""
    by_uid = {c.uid: c for c in claims}
    for uid, result in response.claims.items():
        claim = by_uid.get(uid)
        if claim is None:
            return f"{method} returned result for unknown claim UID {uid}"
        if result.error:
            return f"{method} failed for claim {claim.namespace}/{claim.name}: {result.error}"
    left_out = len(by_uid) - len(response.claims)
    if left_out:
        return f"{method} left out {left_out} claims"
    return None


def _device(device: Any) -> PreparedDevice:
    share_id = (
        device.share_id
        if "share_id" in device.DESCRIPTOR.fields_by_name and device.HasField("share_id")
        else None
    )
    return PreparedDevice(
        tuple(device.request_names),
        device.pool_name,
        device.device_name,
        tuple(device.cdi_device_ids),
        share_id,
    )


def _health_of(device: Any) -> DeviceHealth:
    message = device.message.encode()[:HEALTH_MESSAGE_LIMIT].decode("utf-8", "ignore")
    return DeviceHealth(
        device.device.pool_name,
        device.device.device_name,
        health_pb.HealthStatus.Name(device.health),
        device.last_updated_time,
        device.health_check_timeout_seconds,
        message,
    )


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except OSError:
        return False


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None
