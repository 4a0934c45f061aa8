"""`gpunode plugin run` as a real process for tests and benchmarks: private socket dir, fake NVML, logs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from gpunode.plugin.nvidia_env import VARIABLES as NVIDIA_VARIABLES
from tests import fakenvml

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def short_tempdir(prefix: str = "dp-") -> Iterator[Path]:
    """A directory under /tmp: unix socket paths must stay under 108 bytes, pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class PluginProcess:
    """One `python -m gpunode plugin run` with its stderr in a file; stopped by PID."""

    def __init__(
        self,
        socket_dir: Path,
        args: Sequence[str] = (),
        *,
        profile: str | None = "pcie-4",
        nvml_config: Path | None = None,
        control: Path | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.socket_dir = socket_dir
        self.args = list(args)
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GPUNODE_", "DP_")) and k not in NVIDIA_VARIABLES
        }
        fake = fakenvml.env(profile, nvml_config, control) if profile or nvml_config else {}
        self.log_path = (log_dir or socket_dir.parent) / f"plugin-{os.getpid()}-{id(self)}.log"
        # Never the real /run/gpunode: several plugins run at once in tests.
        self.status_path = self.log_path.with_suffix(".status.json")
        status = {"GPUNODE_PLUGIN_STATUS_FILE": str(self.status_path)}
        self.env = {**base, **fake, "PYTHONPATH": str(REPO), **status, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PluginProcess:
        argv = [
            sys.executable,
            "-m",
            "gpunode",
            "plugin",
            "run",
            "--socket-dir",
            str(self.socket_dir),
            *self.args,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time; the exit status (None if already reaped)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
                raise
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"plugin exited {self.proc.returncode} before logging {text!r}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"plugin did not log {text!r} within {timeout} s:\n{self.log()}")
            time.sleep(0.02)

    def __enter__(self) -> PluginProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop()
        finally:
            if exc is not None:
                print(f"--- plugin log ({self.log_path}) ---\n{self.log()}")  # pytest shows it on failure
            self.log_path.unlink(missing_ok=True)
            self.status_path.unlink(missing_ok=True)
