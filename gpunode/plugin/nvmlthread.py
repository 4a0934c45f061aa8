"""What the plugin's NVML threads (the health monitor, the MIG watcher) share: one background thread that
stops promptly, the backoff of their retries, and how they read NVML's errors and strings."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

# nvml.h values, named here so the modules read without pynvml at hand.
UNINITIALIZED = 1
TIMEOUT = 10

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 10.0


@dataclass
class Backoff:
    """Doubling delays between retries, BACKOFF_FIRST_S up to BACKOFF_MAX_S; `failures` in a row."""

    delay: float = BACKOFF_FIRST_S
    failures: int = 0

    def next(self) -> float:
        current = self.delay
        self.failures += 1
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)
        return current

    def reset(self) -> None:
        self.delay = BACKOFF_FIRST_S
        self.failures = 0


class NvmlThread:
    """One daemon thread running `_run` until `stop()`: subclasses wait in bounded slices on `_stop`, so a
    stop is noticed promptly (NVML cannot interrupt a wait)."""

    THREAD_NAME = "gpunode-nvml"
    WHAT = "the NVML thread"

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _run(self) -> None:
        raise NotImplementedError

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread (it gives its NVML reference back); True once it is gone (or never started)."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            self._log.warning("%s did not stop within %.1fs", self.WHAT, timeout)
            return False
        self._thread = None
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def nvml_code(exc: BaseException) -> int | None:
    """The NVML return code of a pynvml error; None for any other exception."""
    code = getattr(exc, "value", None)
    return code if isinstance(code, int) else None


def nvml_text(value: object) -> str:
    """A string NVML returned (bytes in older pynvml, NUL-padded)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)
