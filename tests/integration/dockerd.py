"""Run a real dockerd on a daemon.json, fully private, for the integration tests.

Every program here comes from the test bed (tests/testbed.py: Debian packages unpacked into .testbed/,
never installed), never from the host: the dockerd is bookworm's docker.io (20.10) unless a test names
another binary, such as the test bed's dockerd 26 and 28 (`testbed.binary("dockerd-28")`). Those ship
without a client; every version is asked through bookworm's `docker` (20.10), which negotiates the API
version with the daemon. The private containerd is bookworm's 1.6, and the daemons run with a PATH on which
the test bed's runc, containerd shim, docker-init and docker-proxy come first.

Everything the daemon writes lives under one short temp dir (unix socket paths are limited to 108 bytes):
its data and exec roots, its socket, its pid file, its log and a containerd of its own. dockerd is always
handed that containerd with --containerd, because without the flag dockerd 20.10 attaches to
/run/containerd/containerd.sock whenever that socket exists (the system's containerd, or another test's)
and only supervises a private one when it does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import testbed

# The machine is shared and noisy: dockerd is usually ready in about a second, but give it room.
READY_TIMEOUT = 30.0
# A daemon.json dockerd dislikes makes it exit in ~0.2 s; ten seconds means "it did not refuse".
REFUSE_TIMEOUT = 10.0
STOP_TIMEOUT = 15.0
POLL = 0.05

# dockerd runs in a mount namespace of its own (unshare and sh exec, so the PID stays dockerd's) where /run
# and /etc/docker are empty tmpfs: dockerd 20.10 writes its identity key to /etc/docker/key.json (its
# --deprecated-key-path is no flag, only a daemon.json key, and the file under test must stay as it is) and
# creates /run/docker/plugins. The namespace also takes its data-root bind mount away with it. Where the
# host has no /etc/docker (no docker.io installed: the test bed's dockerd is not), the mount point is made
# in an overlay of /etc whose upper layer lives in the private /run: nothing is created on the host.
PRIVATE_MOUNTS_FAILED = 97
PRIVATE_MOUNTS = (
    "unshare",
    "--mount",
    "--propagation=private",
    "--",
    "sh",
    "-c",
    "mount -t tmpfs -o mode=0755 gpunode-test /run"
    " && { [ -d /etc/docker ] || { mkdir /run/.etc-upper /run/.etc-work"
    " && mount -t overlay -o lowerdir=/etc,upperdir=/run/.etc-upper,workdir=/run/.etc-work gpunode-test /etc"
    " && mkdir /etc/docker; }; }"
    " && mount -t tmpfs -o mode=0700 gpunode-test /etc/docker"
    f' || exit {PRIVATE_MOUNTS_FAILED}; exec "$0" "$@"',
)


# Where the test bed unpacks them (require_docker() checks they are there). The client is the one that ships
# with the daemon, so that a client/daemon API mismatch can never be what a test sees.
DOCKERD = str(testbed.location("dockerd-20.10", "dockerd"))
DOCKER = str(testbed.location("dockerd-20.10", "docker"))
CONTAINERD = str(testbed.location("containerd-1.6", "containerd"))
# What the daemons find by name: runc (containerd's shim and dockerd), the shim, docker-init, docker-proxy.
HELPERS = ("dockerd-20.10", "containerd-1.6", "runc")


def require_docker(*, dockerd: bool = True) -> None:
    """Skip without the test bed's dockerd, docker, containerd and runc, except in CI, where the checks must
    not stop running (testbed.binary fails there).

    dockerd=False: the test brings its own dockerd binary (the test bed's 26 or 28); the 20.10 tree is still
    needed for the client.
    """
    testbed.binary("dockerd-20.10", "docker")
    if dockerd:
        testbed.binary("dockerd-20.10", "dockerd")
    testbed.bin_dirs(*HELPERS)


class DockerdExited(Exception):
    """dockerd stopped on its own before it served its API (a refused daemon.json, usually)."""

    def __init__(self, returncode: int, message: str, log: str) -> None:
        super().__init__(f"dockerd exited with {returncode}: {message}")
        self.returncode = returncode
        self.message = message
        self.log = log


class DockerdStarted(AssertionError):
    """dockerd served its API on a daemon.json it was expected to refuse."""


@dataclass
class Dockerd:
    """A dockerd (and the containerd it uses) running on private paths under `root`."""

    root: Path
    config: Path
    binary: str | None = None  # the dockerd to run; None: the system's (20.10)
    process: subprocess.Popen[bytes] | None = None
    containerd: subprocess.Popen[bytes] | None = None
    children: set[tuple[int, int]] = field(default_factory=set)  # (pid, start time)

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def log_path(self) -> Path:
        return self.root / "dockerd.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def docker(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [DOCKER, "-H", f"unix://{self.socket}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_client_env(self.root),
            check=False,
        )

    def runtimes(self) -> tuple[dict[str, Any], str]:
        """What the running daemon reports: its runtimes by name, and its default runtime."""
        result = self.docker("info", "--format", "{{json .Runtimes}} {{.DefaultRuntime}}")
        assert result.returncode == 0, f"docker info failed: {result.stderr}\n{self.log()[-3000:]}"
        runtimes, _, default = result.stdout.strip().rpartition(" ")
        return json.loads(runtimes), default

    def reload(self, timeout: float = READY_TIMEOUT) -> str:
        """SIGHUP, then wait for dockerd to say how the reload went; returns what it logged about it.

        dockerd reloads asynchronously and keeps running whatever happens, so its log is the only place a
        reload's outcome shows.
        """
        assert self.process is not None
        offset = len(self.log())
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tail = self.log()[offset:]
            for line in tail.splitlines():
                # A refused file is logged at error level ("file configuration validation failed: ...").
                if "Reloaded configuration" in line or "level=error" in line:
                    return line
            time.sleep(POLL)
        raise AssertionError(f"dockerd did not log a reload within {timeout} s:\n{self.log()[offset:]}")

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self, timeout: float = READY_TIMEOUT) -> None:
        """Start containerd, then dockerd; return once dockerd answers `docker info`.

        Raises DockerdExited if dockerd stops on its own first.
        """
        program = self.binary or DOCKERD
        self._start_containerd(timeout)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [*PRIVATE_MOUNTS, program, *self.flags()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_daemon_env(program),
                # Its own session: a Ctrl-C meant for pytest must not reach it before teardown does.
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            returncode = self.process.poll()
            if returncode == PRIVATE_MOUNTS_FAILED:
                raise AssertionError(f"cannot give dockerd a private /run and /etc/docker:\n{self.log()}")
            if returncode is not None:
                log_text = self.log()
                raise DockerdExited(returncode, _last_message(log_text), log_text)
            self.children |= _children(self.process.pid)
            # Only ask the client once the socket is there: each `docker info` costs a process.
            if (
                self.socket.exists()
                and self.docker("info", "--format", "{{.ID}}", timeout=10).returncode == 0
            ):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"dockerd not ready within {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(POLL)

    def flags(self) -> list[str]:
        r = self.root
        return [
            f"--config-file={self.config}",
            f"--data-root={r / 'data'}",
            f"--exec-root={r / 'exec'}",
            f"--pidfile={r / 'docker.pid'}",
            f"--host=unix://{self.socket}",
            f"--containerd={r / 'containerd.sock'}",
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-masq=false",
        ]

    def _start_containerd(self, timeout: float) -> None:
        r = self.root
        config = r / "containerd.toml"
        # The CRI plugin is what dockerd's own supervised containerd disables too: dockerd does not use it,
        # and it would probe CNI and the network. opt and runc roots default to /opt and /run on the host.
        config.write_text(
            "version = 2\n"
            f'root = "{r / "containerd-root"}"\n'
            f'state = "{r / "containerd-state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            "[grpc]\n"
            f'  address = "{r / "containerd.sock"}"\n'
            '[plugins."io.containerd.internal.v1.opt"]\n'
            f'  path = "{r / "containerd-opt"}"\n'
            '[plugins."io.containerd.runtime.v1.linux"]\n'
            f'  runtime_root = "{r / "runc"}"\n'
        )
        with (r / "containerd.log").open("ab") as log:
            self.containerd = subprocess.Popen(
                [CONTAINERD, "--config", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_daemon_env(CONTAINERD),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not (r / "containerd.sock").exists():
            if self.containerd.poll() is not None or time.monotonic() > deadline:
                text = (r / "containerd.log").read_text(errors="replace")
                raise AssertionError(f"the private containerd did not start:\n{text[-3000:]}")
            time.sleep(POLL / 5)

    def stop(self) -> None:
        """Stop dockerd, anything it started, and its containerd; unmount whatever is left under root."""
        if self.process is not None:
            self.children |= _children(self.process.pid)
            _terminate(self.process)
        for child in sorted(self.children):
            _kill(*child)
        self.children.clear()
        if self.containerd is not None:
            _terminate(self.containerd)
        _unmount_under(self.root)


@contextlib.contextmanager
def short_tempdir() -> Iterator[Path]:
    # pytest's tmp_path is too long for the unix sockets dockerd and containerd create under it.
    root = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    try:
        yield root
    finally:
        _unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def running_dockerd(
    config: Path, timeout: float = READY_TIMEOUT, binary: str | os.PathLike[str] | None = None
) -> Iterator[Dockerd]:
    """A dockerd serving on `config` for the duration of the block; stopped and cleaned up after it.

    `binary`: the dockerd to run (default: the system's).
    """
    with short_tempdir() as root:
        daemon = Dockerd(root=root, config=config, binary=_program(binary))
        try:
            daemon.start(timeout)
            yield daemon
        finally:
            daemon.stop()


def dockerd_refuses(
    config: Path, timeout: float = REFUSE_TIMEOUT, binary: str | os.PathLike[str] | None = None
) -> tuple[int, str]:
    """Start dockerd on `config` expecting it to exit with an error; return its exit code and message.

    Raises DockerdStarted if dockerd starts instead: a test can never mistake "started" for "refused".
    """
    with short_tempdir() as root:
        daemon = Dockerd(root=root, config=config, binary=_program(binary))
        try:
            daemon.start(timeout)
        except DockerdExited as exited:
            return exited.returncode, exited.message
        finally:
            daemon.stop()
    text = config.read_text(errors="replace")
    raise DockerdStarted(f"dockerd started with {config} instead of refusing it:\n{text}")


def validate(binary: str | os.PathLike[str], config: Path, timeout: float = 60) -> tuple[int, str]:
    """`dockerd --validate --config-file config` (dockerd 23 and later): its exit code and what it said.

    It checks the file as dockerd loads it at start (JSON, keys, flag conflicts) but not what dockerd
    checks later while starting (a runtime with both path and runtimeType passes it): a test that wants
    to know whether dockerd runs on a file starts one.
    """
    result = subprocess.run(
        [os.fspath(binary), "--validate", "--config-file", str(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_daemon_env(binary),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return result.returncode, (result.stdout + result.stderr).strip()


def version(binary: str | os.PathLike[str]) -> str:
    """What `dockerd --version` says, e.g. "Docker version 28.5.2+dfsg4, build 3ef3c07"."""
    result = subprocess.run(
        [os.fspath(binary), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout.strip()


def record_installed(root: Path, binary: str | os.PathLike[str]) -> None:
    """R's dpkg database says docker.io of this dockerd's version is installed. Under --root gpunode runs no
    program of R (gpunode.runtimes.probe): the package database is how it learns which dockerd will read
    the file, as on an image."""
    found = re.search(r"version ([0-9]+\.[0-9]+\.[0-9]+)", version(binary))
    assert found is not None, version(binary)
    status = root / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True, exist_ok=True)
    status.write_text(f"Package: docker.io\nStatus: install ok installed\nVersion: {found.group(1)}-1\n")


# -- helpers ----------------------------------------------------------------------------------------


def _program(binary: str | os.PathLike[str] | None) -> str | None:
    return None if binary is None else os.fspath(binary)


def _last_message(log: str) -> str:
    """The error dockerd gave up with: the last line of its output, unwrapped from logrus' key=value form."""
    lines = [line for line in log.splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    marker = 'msg="'
    if marker in last:
        body = last.split(marker, 1)[1]
        return body.rsplit('"', 1)[0].replace('\\"', '"')
    return last


def _daemon_env(program: str | os.PathLike[str] | None = None) -> dict[str, str]:
    # DOCKER_* and XDG variables change where dockerd looks for its config and sockets. PATH: the program's
    # own directory, then the test bed's helpers, then the caller's PATH (mount, modprobe, ...).
    keep = ("LANG", "LC_ALL", "TZ")
    env = {k: v for k, v in os.environ.items() if k in keep}
    path = testbed.path_with(*HELPERS)
    if program is not None:
        path = f"{Path(program).parent}{os.pathsep}{path}"
    return {**env, "PATH": path}


def _client_env(root: Path) -> dict[str, str]:
    # A private DOCKER_CONFIG keeps the user's contexts and credential helpers out of the picture.
    return {**_daemon_env(), "DOCKER_CONFIG": str(root / "client")}


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may contain spaces and parentheses: split after the last one.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0], int(fields[19])


def _children(pid: int) -> set[tuple[int, int]]:
    """(pid, start time) of the processes whose parent is pid: dockerd starts a containerd of its own
    when it is not given one, and that one outlives a killed dockerd."""
    found: set[tuple[int, int]] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] == pid:
                found.add((int(entry.name), stat[2]))
    return found


def _terminate(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT)


def _alive(pid: int, start: int) -> bool:
    # The start time tells a reused PID from ours; a zombie is dead (its new parent may never reap it).
    stat = _stat(pid)
    return stat is not None and stat[2] == start and stat[1] != "Z"


def _kill(pid: int, start: int) -> None:
    """SIGTERM, then SIGKILL, a process that is not our child (so it cannot be waited for)."""
    deadline = time.monotonic() + STOP_TIMEOUT
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _alive(pid, start):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        while _alive(pid, start) and time.monotonic() < deadline:
            time.sleep(POLL)


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below root, deepest first (/proc/self/mountinfo, octal escapes undone)."""
    prefix = str(root)
    points: list[str] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def _unmount_under(root: Path) -> None:
    # dockerd bind-mounts its data root onto itself and unmounts it on a clean stop; a killed one leaves it.
    for point in mounts_under(root):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False, timeout=30)
