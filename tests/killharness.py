"""A real kill for the crash-safety tests: the gpunode CLI in a child process, SIGKILLed at the Nth call of
one step of its write sequence (tests/unit/test_crash_safety.py for configure, test_file_safety.py for
revert).

"write" kills inside the file object's write, after half the data reached the temp file (gpunode writes
through Python file objects, which never call os.write); "unlink" is pathlib's; any other step is the os
function of that name (fsync, rename, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20 1.6.20~ds1-1\n"

CHILD = r"""
import os, signal, sys

step, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
calls = 0


def hit():
    global calls
    calls += 1
    return calls == n


if step == "write":
    real_fdopen = os.fdopen

    class Dying:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            if hit():
                self.fh.write(data[: len(data) // 2])
                self.fh.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

    os.fdopen = lambda *a, **k: Dying(real_fdopen(*a, **k))
elif step != "none":
    import pathlib

    holder, name = (pathlib.Path, "unlink") if step == "unlink" else (os, step)
    real = getattr(holder, name)

    def wrapped(*args, **kwargs):
        if hit():
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(holder, name, wrapped)
"""
CLI_TAIL = """
from gpunode.cli.main import main

sys.exit(main(argv))
"""


@contextmanager
def fake_containerd_env() -> Iterator[dict[str, str]]:
    """An environment whose PATH answers `containerd --version` as containerd 1.6, on any machine."""
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "containerd"
        program.write_text(f"#!/bin/sh\nprintf '%s' '{CONTAINERD_1_6}'\n")
        program.chmod(0o755)
        yield {**os.environ, "PATH": f"{tmp}:{os.environ.get('PATH', '')}"}


def gpunode_process(
    root: Path, env: Mapping[str, str], *args: str, kill: tuple[str, int] | None = None
) -> int:
    """Run `gpunode --root ROOT ARGS` in a child; its exit status (-SIGKILL when the kill came)."""
    step, n = kill or ("none", 0)
    argv = [sys.executable, "-c", CHILD + CLI_TAIL, step, str(n), "--root", str(root), *args]
    return subprocess.run(
        argv, cwd=REPO, env=dict(env), capture_output=True, check=False, timeout=120
    ).returncode


# A test's own module instead of the CLI: its `child(argv)` runs under the same kill (the DRA Preparer, which
# has no command of its own).
MODULE_TAIL = """
import importlib

sys.exit(importlib.import_module(argv[0]).child(argv[1:]))
"""


def module_process(
    module: str, env: Mapping[str, str], *args: str, kill: tuple[str, int] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `module.child(ARGS)` in a child, killed as gpunode_process's is; its whole outcome."""
    step, n = kill or ("none", 0)
    argv = [sys.executable, "-c", CHILD + MODULE_TAIL, step, str(n), module, *args]
    return subprocess.run(
        argv, cwd=REPO, env=dict(env), capture_output=True, text=True, check=False, timeout=120
    )
