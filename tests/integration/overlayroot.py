"""A throw-away, writable copy of this machine's root in which real apt and dpkg can run, for tests.

An overlayfs with the host's / as its read-only lower layer and a private tmpfs as its upper layer: inside,
the whole OS is there (apt, dpkg, python, /var/lib/dpkg), and everything written lands in the tmpfs, which
is gone after the test. Commands run in it with `systemd-nspawn --pipe` (no --boot: a plain chroot-like
container with its own mount and PID namespaces), sharing the host's network so that a server on the
host's 127.0.0.1 is reachable.

overlayfs does not descend into mounts under the lower layer, and nspawn mounts a fresh tmpfs at /tmp, so
this checkout and the venv are bind-mounted in at the same paths (nspawn.checkout_binds()).

Usage::

    with overlayroot.overlay_root(binds=nspawn.checkout_binds()) as root:
        root.run(["apt-get", "update"], check=True)
        root.path("/etc/apt/sources.list.d/x.list").read_text()

Needs root, mount/umount, overlayfs and systemd-nspawn (Debian: systemd-container).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.integration import nspawn

# apt-get install of a few small packages takes seconds; the shared 2-core test machines are slow.
RUN_TIMEOUT = 300.0
STOP_TIMEOUT = 30.0
MOUNT_TIMEOUT = 60.0
# What programs inside see: a clean environment, not the test process's (CI, PYTEST_*, VIRTUAL_ENV ...).
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# sh: move into the N cgroups given as the first arguments (N first), then become the rest of the command
# line; nspawn, which it becomes, then starts in them. Paths are arguments, never spliced into the script.
_ENTER_CGROUPS = """
n=$1; shift
while [ "$n" -gt 0 ]; do
    echo $$ > "$1/cgroup.procs" || exit 125
    n=$((n - 1)); shift
done
exec "$@"
"""
# Printed by nspawn on every exit when it runs without a machined; nothing is wrong.
NSPAWN_NOISE = "Attempted to remove disk file system under"


def missing_prerequisites() -> list[str]:
    """What this host lacks for an overlay root (beyond nspawn.missing_prerequisites()); empty when none."""
    missing = [f"{p} is not installed" for p in ("mount", "umount") if shutil.which(p) is None]
    if not _has_overlayfs():
        missing.append("the kernel has no overlayfs")
    return missing


def _has_overlayfs() -> bool:
    with contextlib.suppress(OSError):
        if any(
            line.split()[-1:] == ["overlay"] for line in Path("/proc/filesystems").read_text().splitlines()
        ):
            return True
    # Built as a module that is not loaded yet: mount loads it on demand.
    with contextlib.suppress(OSError):
        return "/overlay.ko" in Path(f"/lib/modules/{os.uname().release}/modules.dep").read_text()
    return False


@dataclass
class OverlayRoot:
    merged: Path  # the host's view of the root inside
    upper: Path  # where everything written inside ends up
    binds: Sequence[nspawn.Bind]
    name_prefix: str

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = RUN_TIMEOUT,
        check: bool = False,
        input: str | None = None,
        env: dict[str, str] | None = None,
        binds: Sequence[nspawn.Bind] = (),
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside (as root, cwd /), with ENV plus env, and the root's binds plus binds.

        nspawn's own harmless exit notice is taken out of stderr. On timeout nspawn is stopped (it kills
        everything inside) and TimeoutExpired is raised.
        """
        name = f"{self.name_prefix}-{uuid.uuid4().hex[:8]}"
        argv_nspawn = [
            "systemd-nspawn",
            "--quiet",
            f"--directory={self.merged}",
            # No machined/systemd to register with on a test machine or in a CI container.
            "--register=no",
            "--keep-unit",
            "--link-journal=no",
            f"--machine={name}",
            "--pipe",
            *(f"--setenv={k}={v}" for k, v in {**ENV, **(env or {})}.items()),
            *(b.option() for b in (*self.binds, *binds)),
            "--",
            *argv,
        ]
        # With --keep-unit nspawn splits its cgroup into payload/ and supervisor/ and leaves them behind;
        # a cgroup of its own per run keeps that out of the test process's cgroup and is removed after.
        cgroups = nspawn._own_cgroups(name)
        process = subprocess.Popen(
            ["sh", "-c", _ENTER_CGROUPS, "sh", str(len(cgroups)), *map(str, cgroups), *argv_nspawn],
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": ENV["PATH"], "LANG": "C.UTF-8"},
        )
        try:
            try:
                stdout, stderr = process.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(process)
                raise
        finally:
            if process.poll() is None:
                _stop(process)
            nspawn._remove_cgroups(cgroups)
        stderr = "".join(line for line in stderr.splitlines(keepends=True) if NSPAWN_NOISE not in line)
        result = subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)
        if check:
            result.check_returncode()
        return result

    def path(self, inside: str) -> Path:
        """The host's view of a path inside (binds excluded: they are only mounted while a command runs)."""
        return self.merged / inside.lstrip("/")

    def written(self, inside: str) -> Path:
        """The upper layer's copy of a path: it exists only if something inside wrote or deleted it."""
        return self.upper / inside.lstrip("/")


def _stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM to nspawn, which then kills the container's processes (SIGKILL without --boot); SIGKILL to
    nspawn itself if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT)
    # Drain and close the pipes (communicate() was interrupted).
    with contextlib.suppress(Exception):
        process.communicate(timeout=STOP_TIMEOUT)


@contextlib.contextmanager
def overlay_root(
    binds: Sequence[nspawn.Bind] = (), *, name_prefix: str = "gpunode-ovl"
) -> Iterator[OverlayRoot]:
    """A fresh overlay root; unmounted and removed on the way out, also when the block fails."""
    top = Path(tempfile.mkdtemp(prefix="gpunode-ovl-", dir="/tmp"))
    layers = top / "layers"  # the tmpfs: upper and work dirs must be on the same file system
    merged = top / "merged"
    layers.mkdir()
    merged.mkdir()
    mounted: list[Path] = []
    try:
        _mount(["-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(layers)])
        mounted.append(layers)
        upper = layers / "upper"
        # The upper dir's mode becomes that of / inside; apt's _apt sandbox must be able to traverse it.
        upper.mkdir()
        upper.chmod(0o755)
        (layers / "work").mkdir()
        options = f"lowerdir=/,upperdir={upper},workdir={layers / 'work'}"
        _mount(["-t", "overlay", "overlay", "-o", options, str(merged)])
        mounted.append(merged)
        yield OverlayRoot(merged=merged, upper=upper, binds=list(binds), name_prefix=name_prefix)
    finally:
        problems = [problem for path in reversed(mounted) if (problem := _unmount(path))]
        # rmtree must never run into a mount that is still there: through the overlay it would reach the
        # host's own files.
        if not any(os.path.ismount(p) for p in (merged, layers)):
            shutil.rmtree(top, ignore_errors=True)
        if problems:
            raise RuntimeError("could not unmount the overlay root: " + "; ".join(problems))


def _mount(args: Sequence[str]) -> None:
    result = subprocess.run(
        ["mount", *args], capture_output=True, text=True, timeout=MOUNT_TIMEOUT, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"mount {' '.join(args)} exited with {result.returncode}: {result.stderr.strip()}")


def _unmount(path: Path) -> str | None:
    """Unmount path, lazily if it is busy; None on success, else what went wrong."""
    if not os.path.ismount(path):
        return None
    result = subprocess.run(
        ["umount", str(path)], capture_output=True, text=True, timeout=MOUNT_TIMEOUT, check=False
    )
    if result.returncode == 0:
        return None
    # Busy (a process still holding a file in it): detach it now, the kernel frees it when that ends.
    lazy = subprocess.run(
        ["umount", "--lazy", str(path)], capture_output=True, text=True, timeout=MOUNT_TIMEOUT, check=False
    )
    if lazy.returncode == 0:
        return None
    return f"{path}: {result.stderr.strip()} / lazy: {lazy.stderr.strip()}"
