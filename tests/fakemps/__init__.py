"""The stand-in `nvidia-cuda-mps-control` (control.py), installed as a program for the plugin to find."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROGRAM = "nvidia-cuda-mps-control"


def install(bin_dir: Path) -> Path:
    """Write `<bin_dir>/nvidia-cuda-mps-control`: control.py run by this interpreter."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / PROGRAM
    source = (HERE / "control.py").read_text(encoding="utf-8")
    path.write_text(f"#!{sys.executable}\n{source}", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def env(bin_dir: Path) -> dict[str, str]:
    """PATH with the stand-in first."""
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def daemon_pids(root: Path) -> dict[str, int]:
    """Every stand-in daemon answering under an MPS root: its pipe directory -> its PID (SO_PEERCRED)."""
    import socket
    import struct

    found = {}
    for control in root.glob("**/pipe/control"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(str(control))
            except OSError:
                continue
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        found[str(control.parent)] = struct.unpack("3i", creds)[0]
    return found


def kill_all(root: Path) -> None:
    """Tests stop what they start: SIGKILL every daemon still answering under the root, by PID."""
    import contextlib
    import signal

    for pid in daemon_pids(root).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
