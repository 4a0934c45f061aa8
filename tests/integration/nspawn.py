"""Boot a real systemd in a throw-away container (systemd-nspawn) and drive it from outside, for tests.

The container is the host's own OS: `systemd-nspawn -D / --volatile=yes` gives it a fresh tmpfs root with
only the host's /usr mounted in (read-only), so /etc, /var and /run start empty and everything written
there disappears with the container. systemd boots in about a second. Programs run inside with
`nsenter -a` into the namespaces of the container's PID 1, so nothing but the host's /usr is visible to
them: Python code must use /usr/bin/python3 (or a venv made from it) and its files must be bind-mounted
in, at the same path when a venv or an editable install refers to them by absolute path. The same goes for
a daemon the container runs: the tests never rely on one installed in the host's /usr, they bind-mount the
test bed's (tests/testbed.py, under the checkout), write its unit into the container's /etc and put its
directory on `box.env["PATH"]`, the PATH of everything `box.run` starts.

Usage::

    with nspawn.boot(tmp_path, binds=[nspawn.Bind(REPO, str(REPO))]) as box:
        box.path("/etc/systemd/system/containerd.service").write_text(unit)
        box.run(["systemctl", "start", "containerd"], check=True)
        box.path("/etc/containerd/config.toml").read_bytes()

`missing_prerequisites()` says what this host lacks; callers decide whether that skips or fails.
Needs root, systemd-nspawn (Debian: systemd-container), nsenter (util-linux) and systemd itself.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMD = "/usr/lib/systemd/systemd"
REPO = Path(__file__).resolve().parents[2]
# Boot is ~1 s on a quiet machine; the shared 2-core test machines are anything but quiet.
BOOT_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
RUN_TIMEOUT = 120.0
POLL = 0.05
# What programs inside see instead of the test process's environment (CI, PYTEST_*, VIRTUAL_ENV ...).
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
    "SYSTEMD_COLORS": "0",
    "SYSTEMD_PAGER": "",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class BootFailed(RuntimeError):
    """The container did not come up; the message carries the end of its console output."""


@dataclass(frozen=True)
class Bind:
    """A host path mounted into the container (nspawn's --bind / --bind-ro)."""

    source: Path
    target: str
    read_only: bool = True

    def option(self) -> str:
        # nspawn splits the value at ':'; such paths would silently mean something else.
        if ":" in str(self.source) or ":" in self.target:
            raise ValueError(f"a bind path may not contain ':': {self.source} -> {self.target}")
        return f"--bind{'-ro' if self.read_only else ''}={self.source}:{self.target}"


@dataclass
class Container:
    """A booted container: its machine name, the nspawn process and the container's PID 1 (systemd)."""

    name: str
    process: subprocess.Popen[bytes]
    leader: int
    console: Path
    state: str = ""  # what `systemctl is-system-running` said once boot was done: running or degraded
    cgroups: list[Path] = field(default_factory=list)  # made for this container; removed after it
    env: dict[str, str] = field(default_factory=lambda: dict(ENV))  # what run() gives the programs

    def run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        timeout: float = RUN_TIMEOUT,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside the container (all its namespaces, its root and /), with a clean environment."""
        return subprocess.run(
            [_nsenter(), "-t", str(self.leader), "-a", "--", *argv],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env=self.env,
        )

    def systemctl(self, *args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", *args], timeout=timeout)

    def unit_properties(self, unit: str, *names: str) -> dict[str, str]:
        """`systemctl show UNIT -p ...` as a dict (InvocationID and MainPID change on every real start)."""
        result = self.run(["systemctl", "show", unit, *(f"--property={n}" for n in names)], check=True)
        return dict(line.partition("=")[::2] for line in result.stdout.splitlines() if "=" in line)

    def journal(self, unit: str, lines: int = 50) -> str:
        result = self.run(["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"])
        return result.stdout

    def path(self, container_path: str) -> Path:
        """The host's view of a path inside the container (through /proc/PID/root), for direct reads and
        writes: byte-exact, and no process needed."""
        return Path(f"/proc/{self.leader}/root") / container_path.lstrip("/")

    def console_tail(self, chars: int = 4000) -> str:
        try:
            text = self.console.read_text(errors="replace")
        except OSError:
            return ""
        return _ANSI.sub("", text)[-chars:]


def missing_prerequisites() -> list[str]:
    """What this host lacks to boot a container; empty when it can."""
    missing = [f"{p} is not installed" for p in ("systemd-nspawn", "nsenter") if shutil.which(p) is None]
    if not os.access(SYSTEMD, os.X_OK):
        missing.append(f"{SYSTEMD} is not installed")
    if os.geteuid() != 0:
        missing.append("systemd-nspawn needs root")
    return missing


def checkout_binds(lacking: Sequence[str] = ()) -> list[Bind]:
    """Binds that let the container run this checkout's gpunode from its venv, at the same paths.

    `lacking` adds what the caller's own test needs and does not have. Anything missing fails the test
    under CI (the test bed must have it) and skips it elsewhere.
    """
    import pytest  # test-only module: pytest is there whenever this runs

    gpunode = Path(sys.executable).parent / "gpunode"
    problems = missing_prerequisites() + list(lacking)
    if not os.access(gpunode, os.X_OK):
        problems.append(f"{gpunode} is not installed")
    if not os.path.realpath(sys.executable).startswith("/usr/"):
        problems.append(f"the venv's python ({os.path.realpath(sys.executable)}) is not from the host's /usr")
    if problems:
        what = "; ".join(problems)
        if os.environ.get("CI"):
            pytest.fail(f"{what}, and CI must run the real-systemd tests (see the test-bed packages)")
        pytest.skip(f"{what} (CI fails instead of skipping)")
    binds = [Bind(REPO, str(REPO))]
    if not Path(sys.prefix).resolve().is_relative_to(REPO):
        binds.append(Bind(Path(sys.prefix), sys.prefix))
    return binds


@contextlib.contextmanager
def boot(
    workdir: Path,
    *,
    binds: Sequence[Bind] = (),
    name_prefix: str = "gpunode-test",
    timeout: float = BOOT_TIMEOUT,
) -> Iterator[Container]:
    """Boot a container, wait until systemd has finished starting up, and stop it on the way out.

    workdir holds the console log and the preset file; it must outlive the container. Every unit is
    disabled, so only what systemd itself needs runs until a test starts something.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    # A volatile /etc is a first boot every time, and presets then enable (and start) every installed
    # service: the host's containerd, dockerd, ssh ...
    preset = workdir / "00-disable-all.preset"
    preset.write_text("disable *\n")
    console = workdir / "console.log"
    name = f"{name_prefix}-{uuid.uuid4().hex[:8]}"
    argv = [
        "systemd-nspawn",
        "--quiet",
        "--directory=/",
        "--volatile=yes",
        "--private-network",
        # Without a host systemd/machined to register with (a test machine, a CI container) nspawn
        # refuses to start unless told not to register and to stay in the caller's cgroup.
        "--register=no",
        "--keep-unit",
        f"--machine={name}",
        "--console=read-only",
        Bind(preset, "/etc/systemd/system-preset/00-disable-all.preset").option(),
        *(b.option() for b in binds),
        "--boot",
        # systemd reads its "kernel command line" from its own arguments in a container; the first-boot
        # wizard would otherwise wait for a key press on the console forever.
        "systemd.firstboot=no",
    ]
    cgroups = _own_cgroups(name)
    # The shell moves itself (and so nspawn, which it becomes) into the cgroups made for this container.
    enter = "".join(f'echo $$ > "{c}/cgroup.procs" && ' for c in cgroups)
    with console.open("wb") as log:
        process = subprocess.Popen(
            ["sh", "-c", f'{enter}exec "$@"', "sh", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    box = Container(name=name, process=process, leader=0, console=console, cgroups=cgroups)
    try:
        deadline = time.monotonic() + timeout
        box.leader = _wait_for_leader(box, deadline)
        box.state = _wait_until_booted(box, deadline)
        yield box
    finally:
        _stop(box)


def _nsenter() -> str:
    return shutil.which("nsenter") or "nsenter"


def _wait_for_leader(box: Container, deadline: float) -> int:
    """The container's PID 1 as the host sees it: nspawn's child, once it has become systemd (before
    the exec it is still a copy of nspawn, in namespaces that are not set up yet)."""
    while True:
        for pid in _children(box.process.pid):
            with contextlib.suppress(OSError):
                if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "systemd":
                    return pid
        _check_alive(box, deadline, "systemd did not start")
        time.sleep(POLL)


def _wait_until_booted(box: Container, deadline: float) -> str:
    while True:
        remaining = deadline - time.monotonic()
        try:
            # --wait blocks until start-up is over; before PID 1 listens it fails at once, hence the loop.
            result = box.systemctl("is-system-running", "--wait", timeout=max(remaining, 1.0))
        except subprocess.TimeoutExpired:
            result = None
        state = result.stdout.strip() if result is not None else "no answer"
        if state in ("running", "degraded"):
            return state
        jobs = box.systemctl("list-jobs", "--no-pager", timeout=10).stdout if result is not None else ""
        _check_alive(box, deadline, f"systemd did not finish booting (last state: {state})\n{jobs}")
        time.sleep(POLL)


def _check_alive(box: Container, deadline: float, why: str) -> None:
    if box.process.poll() is not None:
        raise BootFailed(f"systemd-nspawn exited with {box.process.returncode}:\n{box.console_tail()}")
    if time.monotonic() >= deadline:
        raise BootFailed(f"{why}\nconsole:\n{box.console_tail()}")


def _children(parent: int) -> list[int]:
    # /proc/PID/task/TID/children only lists the children of one thread; the ppid field sees them all.
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may contain spaces and parentheses; the fields after it do not.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[1] == str(parent):
            found.append(int(entry.name))
    return found


def _stop(box: Container) -> None:
    """SIGTERM makes nspawn shut the container down cleanly (systemd's own poweroff); SIGKILL if that
    hangs. Everything the container mounted lives in its own mount namespace and goes with it."""
    pid_ns = _pid_namespace(box.leader) if box.leader else None
    if box.process.poll() is None:
        box.process.send_signal(signal.SIGTERM)
        try:
            box.process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            box.process.kill()
            box.process.wait(timeout=STOP_TIMEOUT)
    # nspawn's child dies with nspawn (parent-death signal), but make sure: killing a PID namespace's
    # init kills everything in it. The namespace check keeps a recycled PID from being hit.
    if pid_ns is not None and _pid_namespace(box.leader) == pid_ns:
        with contextlib.suppress(ProcessLookupError):
            os.kill(box.leader, signal.SIGKILL)
        deadline = time.monotonic() + STOP_TIMEOUT
        while _pid_namespace(box.leader) == pid_ns and time.monotonic() < deadline:
            time.sleep(POLL)
    _remove_cgroups(box.cgroups)


def _own_cgroups(name: str) -> list[Path]:
    """A fresh cgroup for the container in the hierarchies systemd uses (cgroup v2, and v1's
    name=systemd on a hybrid host), under the caller's own cgroup.

    With --keep-unit nspawn splits its current cgroup into "payload" (the container's systemd) and
    "supervisor" (itself) and leaves both behind: two containers started from one process would share one
    systemd cgroup tree, and every run would leave empty cgroups. Best effort: where the caller's cgroup
    is not visible or not writable, nspawn gets the current one as before.
    """
    made: list[Path] = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            mount = Path("/sys/fs/cgroup")
            if not (mount / "cgroup.controllers").exists():
                mount = mount / "unified"
        elif controllers == "name=systemd":
            mount = Path("/sys/fs/cgroup/systemd")
        else:
            continue
        parent = mount / path.lstrip("/")
        if not (parent / "cgroup.procs").exists():
            continue
        try:
            (parent / name).mkdir()
        except OSError:
            continue
        made.append(parent / name)
    return made


def _remove_cgroups(cgroups: list[Path]) -> None:
    # Deepest first; rmdir of a cgroup that still has processes fails, which is the right outcome.
    for top in cgroups:
        for dirpath, _, _ in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
