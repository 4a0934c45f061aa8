"""Signals for a process whose main thread sleeps in a queue: relayed by a thread of their own.

CPython runs a Python-level signal handler only in the main thread, and only once that thread runs
bytecode again. The kernel may hand a process-directed signal to any thread that does not block it: one
that lands on a gRPC, NVML or log thread only sets Python's flag, and the main thread, asleep in the event
queue's get(), sleeps on until something else wakes it. CI saw exactly that: a SIGHUP acted on 30 s late,
when the SIGTERM that ended the test reached the main thread.

Python's C-level handler also writes the signal's number to the wakeup fd, whichever thread it runs in.
A thread blocked reading that fd calls the signal's action at once; the Python-level handlers do nothing
(they must exist: without one the C handler is not installed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

_STOP = 0  # no signal has number 0: the byte that wakes the relay to end it


def _nothing(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the relay thread does the work."""


class SignalRelay:
    """Calls `actions[signum]` from its own thread for each signal received. Start and close it from the
    main thread (signal.set_wakeup_fd's rule); the actions must be safe to call from another thread and
    must not block (a full pipe would drop signals)."""

    def __init__(self, actions: Mapping[int, Callable[[], object]]) -> None:
        self._actions = dict(actions)
        self._read, self._write = os.pipe()  # not inherited by the processes the plugin starts
        os.set_blocking(self._write, False)  # the C handler must never block
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._relay, name="signals", daemon=True)

    def start(self) -> SignalRelay:
        # The wakeup fd before the handlers: a signal in between would otherwise meet a handler that does
        # nothing and never reach the pipe (before the handlers, the old ones still act).
        try:
            self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            os.close(self._read)
            os.close(self._write)
            raise
        for signum in self._actions:
            self._previous[signum] = signal.signal(signum, _nothing)
        self._thread.start()  # reads what arrived meanwhile, in order
        return self

    def close(self, *, restore: bool = True) -> None:
        """End the relay thread and put back the wakeup fd. `restore`: the handlers found at start too;
        without it they keep doing nothing, so a late signal cannot cut short a process that is already
        cleaning up (the default SIGTERM or SIGHUP would end it at once)."""
        signal.set_wakeup_fd(self._previous_fd)
        if restore:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
        self._closing.set()
        # A full pipe: the relay is busy reading it, and sees _closing after that read.
        with contextlib.suppress(BlockingIOError):
            os.write(self._write, bytes([_STOP]))
        self._thread.join(timeout=5)
        os.close(self._read)
        os.close(self._write)

    def __enter__(self) -> SignalRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _relay(self) -> None:
        while not self._closing.is_set():
            data = os.read(self._read, 4096)
            if not data:
                return
            for signum in data:
                if signum == _STOP:
                    return
                action = self._actions.get(signum)
                if action is not None:
                    action()
