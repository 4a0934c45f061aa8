"""Start nvidia-cuda-mps-control in a mount namespace of its own, with /dev/shm bound to a directory.

Usage: python -m gpunode.plugin.mpslaunch SHM_DIR OUTPUT PROGRAM [ARG...]

An MPS server and its clients share memory through /dev/shm, so the clients (containers) must see the
server's /dev/shm. Giving every MPS pod the host's /dev/shm would share all of it with them; instead the
control daemon, and every server it starts, gets SHM_DIR as its /dev/shm, and the pods get the same
directory (gpunode.plugin.allocate.MpsMounts). NVIDIA's plugin gets the same effect by running the daemon in
a container with that directory mounted.

A separate, single-threaded process, because unshare(CLONE_NEWNS) changes the calling thread only and
the plugin has many threads; and its stdout/stderr go to OUTPUT, because `nvidia-cuda-mps-control -d`
leaves a daemon behind that keeps them: a caller reading a pipe would wait for it forever.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
SHM = "/dev/shm"  # noqa: S108 (the mount point, not a temporary file)


def _fail(step: str) -> None:
    errno = ctypes.get_errno()
    sys.stderr.write(f"gpunode mpslaunch: {step}: {os.strerror(errno)}\n")
    sys.exit(1)


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.stderr.write("usage: python -m gpunode.plugin.mpslaunch SHM_DIR OUTPUT PROGRAM [ARG...]\n")
        sys.exit(2)
    shm_dir, output, program, *args = argv
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        _fail("unshare(CLONE_NEWNS) (a mount namespace for the MPS daemon needs root)")
    # Private from here on: the bind mount below must not show on the host, nor host mounts change it.
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        _fail("making / private in the new mount namespace")
    if libc.mount(os.fsencode(shm_dir), os.fsencode(SHM), None, MS_BIND, None) != 0:
        _fail(f"binding {shm_dir} on {SHM}")
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        os.execv(program, [program, *args])  # noqa: S606 (an argument list: no shell is involved)
    except OSError as exc:
        sys.stderr.write(f"gpunode mpslaunch: cannot run {program}: {exc}\n")
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
