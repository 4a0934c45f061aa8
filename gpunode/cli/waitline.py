"""The progress of a long wait (`plugin install` and `up` waiting for the plugin to register: up to 120 s),
on stderr so that stdout — a `--json` document included — carries only the result.

On a terminal one live line, redrawn at each poll and cleared at the end; elsewhere (a log, CI) a plain
line every PLAIN_EVERY seconds, so the log shows the wait without a line per poll. Plain text only (no
escape sequences): a dumb terminal shows it as well.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from gpunode.systemd.service import Waiting

PLAIN_EVERY = 10.0


def describe(waiting: Waiting) -> str:
    return f"waiting for {waiting.what} ({waiting.elapsed:.0f} s of at most {waiting.timeout:.0f} s)"


def _time_first(waiting: Waiting) -> str:
    return f"waiting ({waiting.elapsed:.0f} s of at most {waiting.timeout:.0f} s) for {waiting.what}"


class WaitLine:
    """A progress callback (`service.apply_install(progress=...)`) that renders each report, and
    remembers the last one for the result (`waited_for`, `waited_s`)."""

    def __init__(
        self, stream: TextIO | None = None, *, live: bool | None = None, width: int | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = _isatty(self.stream) if live is None else live
        self.width = width
        self.last: Waiting | None = None
        self._drawn = 0  # characters of the live line on screen
        self._next_plain = PLAIN_EVERY

    def __call__(self, waiting: Waiting) -> None:
        self.last = waiting
        text = describe(waiting)
        if self.live and waiting.done:
            self.close()  # what follows (the result, an error) starts on a clean line
        elif self.live:
            # Kept within the terminal's width: a line that wraps cannot be redrawn by a carriage return
            # (each redraw would add a row). Padded over the previous text, which may have been longer.
            columns = max(1, self._columns() - 1)
            if len(text) > columns:  # the time first, so that what is cut is the end of the unit's name
                text = _time_first(waiting)[:columns]
            self._write("\r" + text.ljust(self._drawn))
            self._drawn = len(text)
        elif waiting.elapsed >= self._next_plain and not waiting.done:
            self._write(text + "\n")
            self._next_plain = (waiting.elapsed // PLAIN_EVERY + 1) * PLAIN_EVERY

    def close(self) -> None:
        """Clear the live line (the result, or the error, is printed next)."""
        if self._drawn:
            self._write("\r" + " " * self._drawn + "\r")
            self._drawn = 0

    def json(self) -> dict[str, Any]:
        """`waited_for` and `waited_s` of the result (null when there was no wait)."""
        if self.last is None:
            return {"waited_for": None, "waited_s": None}
        return {"waited_for": self.last.what, "waited_s": round(self.last.elapsed, 1)}

    def __enter__(self) -> WaitLine:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _columns(self) -> int:
        if self.width is not None:
            return self.width
        try:
            return os.get_terminal_size(self.stream.fileno()).columns  # asked each time: it may be resized
        except (OSError, ValueError, AttributeError):
            return 80

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # stderr closed or gone: the progress is lost, never the install


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False
