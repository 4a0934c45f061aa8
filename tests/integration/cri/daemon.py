"""Start and stop a real containerd with private paths, and ask it about its plugins.

The programs are the test bed's (tests/testbed.py: Debian packages unpacked into .testbed/, never
installed): bookworm's containerd 1.6 and ctr unless a test names another containerd, and always the test
bed's runc. containerd execs its shim and runc by name, so it runs with a PATH on which its own directory
(where each containerd package has its containerd-shim-runc-v2 and ctr) and the test bed's runc come first.

A daemon owns one directory D: its socket (D/containerd.sock, and the ttrpc socket containerd derives from
it), D/root and D/state. Teardown stops it by PID and then removes what containerd leaves behind by design:
shims that outlive it and mounts under D.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests import testbed

MNT_DETACH = 2
# What containerd runs by name besides the programs next to it.
HELPERS = ("runc",)


@dataclass
class Containerd:
    base: Path
    config: Path
    process: subprocess.Popen[bytes]
    log: Path
    log_file: IO[bytes]
    ctr: str  # the ctr of the same package

    @property
    def socket(self) -> Path:
        return self.base / "containerd.sock"

    @property
    def cgroup_parent(self) -> str:
        """A cgroup parent for this daemon's pods; runc removes a pod's own cgroup but never its parent,
        so stop_containerd removes this one."""
        return f"/gpunode-test-{os.getpid()}-{self.process.pid}"

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def default_binary(program: str) -> str:
    """The test bed's containerd 1.6 (or its ctr): a failure under CI, a skip elsewhere when it is missing."""
    return str(testbed.binary("containerd-1.6", program))


def daemon_env(binary: str | os.PathLike[str]) -> dict[str, str]:
    """The environment containerd runs in: its own directory and the test bed's runc first on PATH."""
    path = os.pathsep.join([str(Path(binary).parent), testbed.path_with(*HELPERS)])
    return {**os.environ, "PATH": path}


def ctr(
    sock: Path,
    *args: str,
    namespace: str | None = None,
    timeout: float = 30.0,
    program: str | None = None,
) -> str:
    command = [program or default_binary("ctr"), "--address", str(sock)]
    if namespace is not None:
        command += ["--namespace", namespace]
    result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{' '.join(command + list(args))} failed:\n{result.stderr}"
    return result.stdout


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def start_containerd(
    config: Path, base: Path, timeout: float = 30.0, binary: str | os.PathLike[str] | None = None
) -> Containerd:
    """Start containerd on config with every path under base; return once its socket accepts connections.

    containerd listens only after every plugin has loaded, so an accepting socket means the plugin
    statuses are final. The timeout is generous because the machine may be shared and busy.
    `binary`: the containerd to run (default: the test bed's 1.6); its package's ctr sits next to it.
    """
    program = os.fspath(binary) if binary is not None else default_binary("containerd")
    env = daemon_env(program)
    # containerd also listens on "<address>.ttrpc"; a unix socket path has at most 107 bytes.
    ttrpc = f"{base / 'containerd.sock'}.ttrpc"
    assert len(ttrpc.encode()) < 108, f"{ttrpc} is too long for a unix socket: use a shorter base"
    base.mkdir(parents=True, exist_ok=True)
    log = base / "containerd.log"
    log_file = log.open("wb")
    process = subprocess.Popen(
        [
            program,
            "--config",
            str(config),
            "--root",
            str(base / "root"),
            "--state",
            str(base / "state"),
            "--address",
            str(base / "containerd.sock"),
            "--log-level",
            "debug",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        # Its own process group: a Ctrl-C aimed at pytest must not kill it before teardown can.
        start_new_session=True,
    )
    ctr_program = str(Path(program).parent / "ctr")
    daemon = Containerd(
        base=base, config=config, process=process, log=log, log_file=log_file, ctr=ctr_program
    )
    deadline = time.monotonic() + timeout
    while not _accepts(daemon.socket):
        if process.poll() is not None:
            log_file.close()
            raise AssertionError(f"containerd exited with {process.returncode}:\n{daemon.log_text()}")
        if time.monotonic() > deadline:
            stop_containerd(daemon)
            raise AssertionError(f"containerd not ready after {timeout} s:\n{daemon.log_text()}")
        time.sleep(0.01)
    return daemon


def plugins_status(sock: Path, program: str | None = None) -> dict[str, str]:
    """`ctr plugins ls` as {"<type>.<id>": status}: ok, skip or error."""
    statuses: dict[str, str] = {}
    lines = ctr(sock, "plugins", "ls", program=program).splitlines()
    for line in lines[1:]:
        fields = line.split()
        if len(fields) >= 4:
            statuses[f"{fields[0]}.{fields[1]}"] = fields[-1]
    return statuses


def plugin_detail(sock: Path, plugin_id: str, program: str | None = None) -> str:
    """`ctr plugins ls -d id==ID`: for a plugin in error, the reason containerd gave."""
    return ctr(sock, "plugins", "ls", "--detailed", f"id=={plugin_id}", program=program)


def _remove_tasks(daemon: Containerd) -> None:
    # A task still running when containerd stops keeps its shim and container processes alive forever;
    # a forced delete kills them while containerd can still do it cleanly.
    sock, program = daemon.socket, daemon.ctr
    for namespace in ctr(sock, "namespaces", "ls", "--quiet", program=program).split():
        for task in ctr(sock, "tasks", "ls", "--quiet", namespace=namespace, program=program).split():
            with contextlib.suppress(AssertionError):
                ctr(sock, "tasks", "rm", "--force", task, namespace=namespace, program=program)


def _processes_with_argument(argument: str) -> list[int]:
    """PIDs of processes that have argument as one whole command-line argument (our private socket)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argument.encode() in args:
            found.append(int(entry.name))
    return found


def _unescape_mountinfo(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def mounts_under(base: Path) -> list[str]:
    prefix = str(base).rstrip("/") + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape_mountinfo(line.split()[4])
        if point.startswith(prefix):
            points.append(point)
    return points


def unmount_under(base: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    # Deepest first, detached: a sandbox's shm or a rootfs overlay may still be busy for a moment.
    for point in sorted(mounts_under(base), key=len, reverse=True):
        libc.umount2(point.encode(), MNT_DETACH)


def stop_containerd(daemon: Containerd, timeout: float = 10.0) -> None:
    """Stop containerd by PID (SIGTERM, then SIGKILL), then clear the shims and mounts it leaves behind."""
    process = daemon.process
    if process.poll() is None:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            _remove_tasks(daemon)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)
    daemon.log_file.close()
    # Shims are started with `-address <our socket>` and outlive containerd by design.
    for pid in _processes_with_argument(str(daemon.socket)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    unmount_under(daemon.base)
    _remove_cgroup(daemon.cgroup_parent)


def _remove_cgroup(name: str) -> None:
    # cgroup v2 has one hierarchy at the top; v1 has one per controller below it. rmdir only removes an
    # empty cgroup, so a pod that somehow survived is left alone rather than half-destroyed.
    top = Path("/sys/fs/cgroup")
    if not top.is_dir():
        return
    candidates = [top / name.lstrip("/")]
    candidates += [h / name.lstrip("/") for h in top.iterdir() if h.is_dir()]
    for cgroup in candidates:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
