"""MPS sharing: a CUDA MPS control daemon per MPS-shared resource, started, watched and stopped by the plugin.

NVIDIA's plugin needs a second DaemonSet for the daemons and says ready before they are. Here:

- `daemon_specs` says which daemons the served resources need: one per resource whose replicas share
  through MPS, limited to that resource's GPUs (CUDA_VISIBLE_DEVICES), with the default active-thread
  percentage and pinned device-memory limit per client derived from the replica count (100 / replicas,
  the GPU's memory / replicas) unless the config sets them.
- `MpsDaemon` runs one: `nvidia-cuda-mps-control -d` with its pipe, log and shm directories under
  `<mps-root>/<resource>/`, in a mount namespace whose /dev/shm is that shm directory (mpslaunch), then
  sets the defaults through the control program as MPS documents it.
- `MpsSupervisor` keeps them so on a thread of its own: a daemon's exit is seen at once (a pidfd, no
  polling), and a live one is asked a question every CHECK_INTERVAL (a hung one). While a daemon is not
  answering, every device of its resource is unhealthy (`on_state(resource, reason)`); it is started again
  with backoff, and its devices are healthy once it answers.

The daemons live as long as the plugin: its stop ends them (under systemd its cgroup would anyway), so a
plugin restart ends the MPS servers that running pods use; a reload (SIGHUP) keeps every daemon whose
settings did not change. Daemons an earlier run left behind (that run was killed) are found by their
record and control socket: adopted when started with the same settings, else replaced, and stopped when
their resource is no longer shared through MPS.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from gpunode.errors import CommandFailed, GpunodeError
from gpunode.host import Host
from gpunode.nvml.model import Inventory
from gpunode.plugin.allocate import MpsMounts
from gpunode.plugin.devices import Resource

log = logging.getLogger("gpunode.plugin")

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
CONTAINER_ROOT = "/mps"  # where pods see the pipe directories (NVIDIA's plugin uses the same)
RECORD = ".gpunode-mps.json"  # in <root>/<resource>/: what the daemon there was started with
CONTROL_SOCKET = "control"  # the daemon's socket in the pipe directory
PID_FILE = "nvidia-cuda-mps-control.pid"  # the daemon's own pid file in the pipe directory (MPS docs)
STARTING = "its MPS control daemon is starting"
# The plugin's own systemd variables, blanked for the daemons it starts.
SERVICE_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC", "LISTEN_FDS", "LISTEN_PID")
READY_TIMEOUT = 30.0  # a started daemon must answer on its socket within this
COMMAND_TIMEOUT = 5.0
STOP_TIMEOUT = 6.0  # quit, then SIGTERM, then SIGKILL: all within this, however many daemons
TEARDOWN_TIMEOUT = 8.0  # the plugin's stop; systemd's TimeoutStopSec is 15 s for the whole plugin
RESTART_FIRST = 0.5
RESTART_MAX = 30.0
CHECK_INTERVAL = 30.0  # how often a live daemon is asked a question (a hung daemon answers nothing)
MIB = 1024 * 1024


class MpsError(GpunodeError):
    """An MPS control daemon could not be started, configured or reached."""


@dataclass(frozen=True)
class DaemonSpec:
    """One control daemon: its resource, directories, GPUs and the per-client defaults it sets."""

    resource: str
    root: str  # host path <mps-root>/<resource>
    gpu_uuids: tuple[str, ...]  # CUDA_VISIBLE_DEVICES, in this order: device ordinals 0..n-1
    replicas: int
    active_thread_percentage: int
    pinned_limits_mib: tuple[int, ...]  # per GPU, by ordinal; 0: no limit (the GPU's memory unknown)

    @property
    def pipe_dir(self) -> str:
        return posixpath.join(self.root, "pipe")

    @property
    def log_dir(self) -> str:
        return posixpath.join(self.root, "log")

    @property
    def shm_dir(self) -> str:
        return posixpath.join(self.root, "shm")

    def mounts(self) -> MpsMounts:
        return MpsMounts(
            pipe_dir=self.pipe_dir,
            shm_dir=self.shm_dir,
            container_pipe_dir=posixpath.join(CONTAINER_ROOT, self.resource, "pipe"),
            active_thread_percentage=self.active_thread_percentage,
        )

    def record(self) -> dict[str, object]:
        data = asdict(self)
        data["gpu_uuids"] = list(self.gpu_uuids)
        data["pinned_limits_mib"] = list(self.pinned_limits_mib)
        return data

    def commands(self) -> list[str]:
        """The control commands that set this daemon's per-client defaults (MPS's own syntax)."""
        out = [f"set_default_active_thread_percentage {self.active_thread_percentage}"]
        out += [
            f"set_default_device_pinned_mem_limit {ordinal} {limit}M"
            for ordinal, limit in enumerate(self.pinned_limits_mib)
            if limit > 0
        ]
        return out


def daemon_specs(
    resources: Iterable[Resource],
    inventory: Inventory,
    *,
    root: str,
    active_thread_percentage: int = 0,
    pinned_memory_limit_mib: int = 0,
) -> tuple[DaemonSpec, ...]:
    """A daemon for each resource whose replicas share through MPS."""
    memory = {g.uuid: g.memory_total for g in inventory.gpus if g.uuid}
    specs = []
    for resource in resources:
        # Only the replicas: GPUs an entry's `devices` does not select stay in the resource unshared.
        uuids = tuple(dict.fromkeys(d.gpu_uuid for d in resource.devices if d.replica is not None))
        if resource.sharing != "mps" or not uuids:
            continue
        replicas = max(resource.replicas, 1)
        percentage = active_thread_percentage or max(1, 100 // replicas)
        limits = tuple(pinned_memory_limit_mib or ((memory.get(u) or 0) // replicas // MIB) for u in uuids)
        specs.append(
            DaemonSpec(
                resource.name,
                posixpath.join(root, resource.name),
                uuids,
                replicas,
                percentage,
                limits,
            )
        )
    return tuple(specs)


def find_control_program(host: Host) -> str | None:
    """nvidia-cuda-mps-control on the host's PATH (the driver installs it in /usr/bin).

    Not a copy under another driver root (a driver container's /run/nvidia/driver): run on the host, outside
    that root, the control daemon would answer while the nvidia-cuda-mps-server it starts for each client
    finds neither itself nor the driver's libraries there, so the replicas would be Healthy and unusable
    (NVIDIA's own daemon runs it chrooted into the driver root for this reason)."""
    found = host.which(CONTROL_PROGRAM)
    return str(host.path(found)) if found is not None else None


def _is_control_program(pid: int) -> bool:
    """Whether `pid` runs the control program (its name, as /proc keeps it: the first 15 characters)."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip() == CONTROL_PROGRAM[:15]
    except OSError:
        return False


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = text.rpartition(")")[2].split()
    return _pid(fields[1]) if len(fields) > 1 else None


def _pid(text: str) -> int | None:
    """A PID written as text; None for anything else: isdigit() also takes digits int() refuses ('²'),
    and int() raises past 4,300 digits (a pid file is anyone's to write garbage into)."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 10 else None


def _peer_pid(path: str) -> int | None:
    """The PID of the process listening on a unix socket (SO_PEERCRED), or None if nothing answers there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(path)
        except OSError:
            return None
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _, _ = struct.unpack("3i", creds)
    return pid if pid > 0 else None


class MpsDaemon:
    """One control daemon, by its spec. Once it runs (started here, or adopted) it is held by a pidfd:
    exits are seen without polling, and signals never reach a process that reused its PID."""

    def __init__(self, host: Host, spec: DaemonSpec, program: str) -> None:
        self.host = host
        self.spec = spec
        self.program = program
        self.pid: int | None = None
        self.pidfd: int | None = None

    def env(self) -> dict[str, str]:
        # Host paths: the daemon and the control program run on the host.
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.host.path(self.spec.pipe_dir)),
            "CUDA_MPS_LOG_DIRECTORY": str(self.host.path(self.spec.log_dir)),
            "CUDA_VISIBLE_DEVICES": ",".join(self.spec.gpu_uuids),
        }

    @property
    def socket_path(self) -> str:
        return str(self.host.path(posixpath.join(self.spec.pipe_dir, CONTROL_SOCKET)))

    def running_pid(self) -> int | None:
        """The daemon answering in the pipe directory: the socket's owner (SO_PEERCRED) while it runs the
        control program, or the process its pid file names where that runs it and the owner is its parent
        or gone; None if nothing answers (or nothing that is the control program)."""
        owner = _peer_pid(self.socket_path)
        if owner is None:
            return None
        text = self.host.read_text_if_exists(posixpath.join(self.spec.pipe_dir, PID_FILE)) or ""
        recorded = _pid(text)
        owner_runs_it = _alive(owner) and _is_control_program(owner)
        if (
            recorded is not None
            and recorded != owner
            and _alive(recorded)
            and _is_control_program(recorded)
            and (not owner_runs_it or _parent_of(recorded) == owner)
        ):
            # The real daemon may bind before it forks: the socket's owner (the process that listened) is
            # then its parent, exiting or gone, and its PID may be reused. Only then is the pid file
            # believed, and only for a process that runs the control program: a file a killed daemon left
            # may name a PID reused since, and neither that nor a stranger is ever held or signalled.
            return recorded
        return owner if owner_runs_it else None

    def recorded(self) -> dict[str, object] | None:
        text = self.host.read_text_if_exists(posixpath.join(self.spec.root, RECORD))
        try:
            data = json.loads(text) if text else None
        except (ValueError, RecursionError):  # not JSON, or JSON nested thousands deep
            return None
        return data if isinstance(data, dict) else None

    def _attach(self, pid: int) -> None:
        self.close()
        self.pidfd = os.pidfd_open(pid)
        self.pid = pid

    def adopt(self) -> bool:
        """Take over a daemon an earlier run started with this spec and configured (its record names it);
        False if there is none."""
        pid = self.running_pid()
        record = self.recorded()
        if pid is None or record is None or record.get("pid") != pid:
            return False
        if {k: v for k, v in record.items() if k != "pid"} != self.spec.record():
            return False
        try:
            self._attach(pid)
        except OSError:
            return False
        return True

    def start(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Start the daemon and set its defaults; MpsError naming what failed. A daemon that started but
        could not be configured is stopped again: none is left running without its limits."""
        spec = self.spec
        # The record says "started and configured": gone until both are done again, so a failed start
        # can never be adopted by a later try.
        self.host.remove_file(posixpath.join(spec.root, RECORD))
        for directory in (spec.pipe_dir, spec.log_dir):
            self.host.make_dirs(directory, mode=0o755)
        self.host.make_dirs(spec.shm_dir, mode=0o755)
        # Any user's MPS client creates its segments there, as in /dev/shm (sticky: not each other's).
        self.host.set_mode(spec.shm_dir, 0o1777)
        if _peer_pid(self.socket_path) is None:
            # No daemon answers here: a pid file is a dead one's, and its PID may be reused by now.
            self.host.remove_file(posixpath.join(spec.pipe_dir, PID_FILE))
        output = posixpath.join(spec.log_dir, "gpunode-start.log")
        argv = [
            sys.executable,
            "-m",
            "gpunode.plugin.mpslaunch",
            str(self.host.path(spec.shm_dir)),
            str(self.host.path(output)),
            self.program,
            "-d",
        ]
        # The plugin's systemd variables are the plugin's: a daemon that inherited them could notify
        # systemd as if it were the service.
        env = {**self.env(), **dict.fromkeys(SERVICE_VARIABLES, "")}
        try:
            result = self.host.run(argv, env=env, timeout=COMMAND_TIMEOUT)
        except CommandFailed as exc:
            raise MpsError(f"{spec.resource}: cannot start the MPS control daemon: {exc.message}") from None
        if not result.ok:
            said = (result.stderr.strip() or (self.host.read_text_if_exists(output) or "").strip())[-500:]
            raise MpsError(
                f"{spec.resource}: `{self.program} -d` exited with status {result.returncode}"
                + (f": {said}" if said else ""),
                f"see {spec.log_dir}/control.log",
            )
        try:
            self._wait_ready(cancelled)
            for command in spec.commands():
                self.command(command)
            record = {**spec.record(), "pid": self.pid}
            self.host.write_file(
                posixpath.join(spec.root, RECORD), json.dumps(record, indent=2) + "\n", mode=0o644
            )
        except (MpsError, OSError, GpunodeError):
            stop_daemons([self], STOP_TIMEOUT)
            raise

    def _wait_ready(self, cancelled: Callable[[], bool]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            pid = self.running_pid()
            if pid is not None:
                try:
                    self._attach(pid)
                    return
                except ProcessLookupError:
                    pass  # gone between the answer and the pidfd: look again
            if cancelled():
                raise MpsError(f"{self.spec.resource}: start of the MPS control daemon cancelled")
            if time.monotonic() > deadline:
                raise MpsError(
                    f"{self.spec.resource}: the MPS control daemon did not answer on {self.socket_path} "
                    f"within {READY_TIMEOUT:g} s",
                    f"see {self.spec.log_dir}/control.log",
                )
            time.sleep(0.02)

    def command(self, line: str, timeout: float = COMMAND_TIMEOUT) -> str:
        """Send one command through the control program (as MPS documents: on its stdin); its answer."""
        try:
            result = self.host.run([self.program], env=self.env(), input=line + "\n", timeout=timeout)
        except CommandFailed as exc:
            raise MpsError(f"{self.spec.resource}: MPS control `{line}`: {exc.message}") from None
        if not result.ok:
            said = (result.stdout + result.stderr).strip()[-300:]
            raise MpsError(
                f"{self.spec.resource}: MPS control `{line}` failed (status {result.returncode})"
                + (f": {said}" if said else "")
            )
        return result.stdout.strip()

    def check(self) -> str | None:
        """None if the daemon answers a question; else why not."""
        try:
            self.command("get_default_active_thread_percentage")
        except MpsError as exc:
            return exc.message
        return None

    def exited(self, timeout: float = 0.0) -> bool:
        """True once the held daemon has exited (a zombie counts), or when none is held."""
        if self.pidfd is None:
            return True
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(max(0.0, timeout) * 1000))

    def signal(self, sig: int) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, sig)

    def close(self) -> None:
        _close(self.pidfd)
        self.pidfd = None
        self.pid = None

    def stop(self) -> None:
        stop_daemons([self], STOP_TIMEOUT)


def stop_daemons(daemons: Iterable[MpsDaemon], timeout: float) -> None:
    """Stop daemons together within `timeout`: all are asked to quit first, then waited for at once, then
    what is left gets SIGTERM, then SIGKILL (through their pidfds). Each ends unheld."""
    daemons = list(daemons)
    deadline = time.monotonic() + timeout
    for daemon in daemons:
        if daemon.pidfd is None:
            pid = daemon.running_pid()  # found, not held: started by an earlier run, or not yet attached
            if pid is not None:
                with contextlib.suppress(OSError):
                    daemon._attach(pid)
        if daemon.pidfd is None:
            continue
        try:
            daemon.command("quit", timeout=max(0.5, min(2.0, deadline - time.monotonic())))
        except MpsError as exc:
            log.warning("%s; ending the MPS control daemon (pid %s) by signal", exc.message, daemon.pid)
    # Leave a third of the time for the signals.
    _wait_all(daemons, deadline - timeout / 3)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = [d for d in daemons if not d.exited()]
        if not left:
            break
        for daemon in left:
            log.warning(
                "%s: MPS control daemon (pid %s) still running; sending %s",
                daemon.spec.resource,
                daemon.pid,
                sig.name,
            )
            daemon.signal(sig)
        _wait_all(left, time.monotonic() + max(0.5, (deadline - time.monotonic()) / 2))
    for daemon in daemons:
        if daemon.pid is not None:
            log.info("%s: MPS control daemon (pid %d) stopped", daemon.spec.resource, daemon.pid)
        daemon.close()


def _wait_all(daemons: list[MpsDaemon], until: float) -> None:
    while any(not d.exited() for d in daemons):
        left = until - time.monotonic()
        if left <= 0:
            return
        poller = select.poll()
        for daemon in daemons:
            if daemon.pidfd is not None and not daemon.exited():
                poller.register(daemon.pidfd, select.POLLIN)
        poller.poll(left * 1000)


def _alive(pid: int) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(0)
    finally:
        os.close(fd)


@dataclass
class _Watched:
    daemon: MpsDaemon
    retry_at: float = 0.0  # when to start it (again), while it does not run
    delay: float = RESTART_FIRST
    next_check: float = 0.0


class MpsSupervisor:
    """Keeps the wanted daemons running; reports each resource's daemon state through `on_state`.

    `apply` (the plugin's event loop) says what is wanted; one thread starts, adopts, checks and stops the
    daemons. Every report goes through `_report`, which drops it when the resource is no longer wanted
    with that spec: a start that ends after a reload never marks a resource down (or up) for a spec that
    is gone."""

    def __init__(
        self,
        host: Host,
        root: str,
        on_state: Callable[[str, str | None], object],
        *,
        find_program: Callable[[], str | None],
        check_interval: float = CHECK_INTERVAL,
    ) -> None:
        """`find_program` finds nvidia-cuda-mps-control; asked again while it is missing (installed later)."""
        self.host = host
        self.root = root
        self.on_state = on_state
        self.find_program = find_program
        self.program = find_program()
        self.check_interval = check_interval
        self._wanted: dict[str, DaemonSpec] = {}
        self._reported: dict[str, str | None] = {}
        self._watched: dict[str, _Watched] = {}  # the thread's alone
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changed = True
        self._reconcile_delay = RESTART_FIRST

    def mounts(self) -> dict[str, MpsMounts]:
        with self._lock:
            return {name: spec.mounts() for name, spec in self._wanted.items()}

    def apply(self, specs: Iterable[DaemonSpec]) -> None:
        """Want exactly these daemons. Resources that get a new daemon are down until it answers."""
        wanted = {s.resource: s for s in specs}
        with self._lock:
            for name in self._wanted:
                if name not in wanted:
                    self._reported.pop(name, None)
                    self.on_state(name, None)  # no daemon of its own any more: nothing to be down for
            for name, spec in wanted.items():
                if self._wanted.get(name) != spec:
                    self._reported[name] = STARTING
                    self.on_state(name, STARTING)
            self._wanted = wanted
            self._changed = True
        if wanted and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpunode-mps", daemon=True)
            self._thread.start()
        self._wake()

    def stop(self) -> None:
        """Stop every daemon (within TEARDOWN_TIMEOUT) and the thread."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            # The thread stops the daemons itself; its waits look at the stop flag, commands time out.
            self._thread.join(TEARDOWN_TIMEOUT + COMMAND_TIMEOUT + 5)
            if self._thread.is_alive():
                log.warning("the MPS supervisor did not stop in time; its daemons may still run")
                return
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            _close(fd)

    def _wake(self) -> None:
        # Full: a wake-up is pending anyway; closed: stopped.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _still_wanted(self, name: str, spec: DaemonSpec) -> bool:
        with self._lock:
            return self._wanted.get(name) == spec

    def _report(self, name: str, spec: DaemonSpec, reason: str | None) -> None:
        with self._lock:
            if self._wanted.get(name) != spec or self._reported.get(name, "") == reason:
                return
            self._reported[name] = reason
            self.on_state(name, reason)

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if self._changed:
                        self._reconcile()
                    self._tick()
                    self._wait()
                except Exception:  # a bug must not end the supervision for the plugin's lifetime
                    log.exception("MPS supervisor error; going on in 1 s")
                    with self._lock:
                        self._changed = True  # the reconcile it may have cut short, done again
                    self._stop.wait(1.0)
        finally:
            stop_daemons([w.daemon for w in self._watched.values()], TEARDOWN_TIMEOUT)
            self._watched.clear()

    def _reconcile(self) -> None:
        with self._lock:
            wanted = dict(self._wanted)
            self._changed = False
        try:
            self._reconcile_with(wanted)
        except (OSError, GpunodeError) as exc:
            # Again on the next round: a reconcile given up once would leave the wanted daemons unstarted
            # until a restart (a stray file under the MPS root was enough). Down, with the reason, meanwhile.
            message = exc.message if isinstance(exc, GpunodeError) else str(exc)
            log.error("MPS: %s; trying again in %.1fs", message, self._reconcile_delay)
            for name, spec in wanted.items():
                if name not in self._watched:
                    self._report(name, spec, f"its MPS control daemon is not running ({message})")
            with self._lock:
                self._changed = True
            self._stop.wait(self._reconcile_delay)
            self._reconcile_delay = min(self._reconcile_delay * 2, RESTART_MAX)
            return
        self._reconcile_delay = RESTART_FIRST

    def _reconcile_with(self, wanted: dict[str, DaemonSpec]) -> None:
        gone = [n for n in self._watched if n not in wanted or self._watched[n].daemon.spec != wanted[n]]
        stop_daemons([self._watched.pop(n).daemon for n in gone], STOP_TIMEOUT)
        stale = [s for s in read_records(self.host, self.root) if s.resource not in wanted]
        if stale and self.program is not None:
            # Their records go with them; without the control program they stay, to be stopped later.
            stop_daemons([MpsDaemon(self.host, s, self.program) for s in stale], STOP_TIMEOUT)
            for spec in stale:
                self.host.remove_file(posixpath.join(spec.root, RECORD))
        for name, spec in wanted.items():
            if name not in self._watched:
                self._watched[name] = _Watched(MpsDaemon(self.host, spec, self.program or CONTROL_PROGRAM))

    def _tick(self) -> None:
        now = time.monotonic()
        for name, watched in list(self._watched.items()):
            if self._stop.is_set() or self._changed:
                return  # a reconcile (or the stop) first
            daemon = watched.daemon
            if daemon.pidfd is None and now >= watched.retry_at:
                self._bring_up(name, watched)
            elif daemon.pidfd is not None and now >= watched.next_check:
                problem = daemon.check()
                watched.next_check = time.monotonic() + self.check_interval
                if problem is not None:
                    log.error("%s: the MPS control daemon does not answer (%s); restarting it", name, problem)
                    daemon.stop()
                    self._report(name, daemon.spec, f"its MPS control daemon does not answer ({problem})")
                    watched.retry_at = time.monotonic()

    def _bring_up(self, name: str, watched: _Watched) -> None:
        daemon = watched.daemon
        spec = daemon.spec
        try:
            if self.program is None:
                self.program = self.find_program()
            if self.program is None:
                raise MpsError(
                    f"{name}: {CONTROL_PROGRAM} is not on the host's PATH",
                    "install the NVIDIA driver's utilities on the host (they ship the MPS control program); "
                    "a driver container's copy cannot run outside its root",
                )
            daemon.program = self.program
            adopted = daemon.adopt()
            if not adopted:
                if daemon.running_pid() is not None:
                    daemon.stop()  # started with other settings, or never configured: replace it
                daemon.start(lambda: self._stop.is_set() or not self._still_wanted(name, spec))
        except (MpsError, OSError, GpunodeError) as exc:
            message = exc.message if isinstance(exc, GpunodeError) else str(exc)
            fix = f" (fix: {exc.fix})" if isinstance(exc, GpunodeError) and exc.fix else ""
            log.error("%s; trying again in %.1fs%s", message, watched.delay, fix)
            self._report(name, spec, f"its MPS control daemon is not running ({message})")
            watched.retry_at = time.monotonic() + watched.delay
            watched.delay = min(watched.delay * 2, RESTART_MAX)
            return
        log.info(
            "%s: MPS control daemon %s (pid %d) for %d GPU(s), %d%% active threads and %s per client",
            name,
            "adopted" if adopted else "started",
            daemon.pid,
            len(spec.gpu_uuids),
            spec.active_thread_percentage,
            ", ".join(f"{m} MiB" if m else "no memory limit" for m in spec.pinned_limits_mib),
        )
        watched.delay = RESTART_FIRST
        watched.next_check = time.monotonic() + self.check_interval
        self._report(name, spec, None)

    def _wait(self) -> None:
        now = time.monotonic()
        due = [w.retry_at for w in self._watched.values() if w.daemon.pidfd is None]
        due += [w.next_check for w in self._watched.values() if w.daemon.pidfd is not None]
        timeout = max(0.0, min(due) - now) if due else None
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        by_fd = {}
        for name, watched in self._watched.items():
            if watched.daemon.pidfd is not None:
                poller.register(watched.daemon.pidfd, select.POLLIN)
                by_fd[watched.daemon.pidfd] = name
        for fd, _ in poller.poll(None if timeout is None else timeout * 1000):
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 64):
                        pass
                continue
            name = by_fd[fd]
            watched = self._watched[name]
            daemon = watched.daemon
            log.error("%s: the MPS control daemon (pid %s) exited; starting it again", name, daemon.pid)
            daemon.close()
            self._report(name, daemon.spec, "its MPS control daemon exited")
            watched.retry_at = time.monotonic()


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def read_records(host: Host, root: str) -> list[DaemonSpec]:
    """The daemons gpunode started under the MPS root (their records): <root>/<domain>/<name>/RECORD."""
    out: list[DaemonSpec] = []
    if not host.is_dir(root):
        return out
    for domain in sorted(host.listdir(root)):
        domain_dir = posixpath.join(root, domain)
        if not host.is_dir(domain_dir):
            continue
        for name in sorted(host.listdir(domain_dir)):
            try:
                text = host.read_text_if_exists(posixpath.join(domain_dir, name, RECORD))
            except GpunodeError as exc:
                # A file where a resource's directory would be, an unreadable record: not a daemon gpunode
                # left. Said, and skipped: the resources that are fine must still get their daemons.
                log.warning("MPS: skipping %s under %s: %s", posixpath.join(domain, name), root, exc.message)
                continue
            try:
                data = json.loads(text) if text else None
                if not isinstance(data, dict):
                    continue
                spec = DaemonSpec(
                    str(data["resource"]),
                    str(data["root"]),
                    tuple(str(u) for u in data["gpu_uuids"]),
                    int(data["replicas"]),
                    int(data["active_thread_percentage"]),
                    tuple(int(m) for m in data["pinned_limits_mib"]),
                )
            except (ValueError, TypeError, KeyError, RecursionError):  # not a record gpunode wrote
                continue
            if spec.root == posixpath.join(root, domain, name):  # a record copied elsewhere is not ours
                out.append(spec)
    return out
