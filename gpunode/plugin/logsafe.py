"""Request content made safe for a log line or an error message: escaped, and bounded in size.

What kubelet (or anyone who can reach the socket) sends is not trusted text: an ID with a newline would
forge a log line, one of a megabyte would fill the journal. Everything from a request goes through
`shown()` / `shown_ids()` before it is logged or echoed in an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

ID_LIMIT = 80  # characters of one ID shown; real IDs (UUIDs, "::<replica>") are under 50
IDS_LIMIT = 8  # IDs of a list shown; the rest are counted


def shown(text: str, limit: int = ID_LIMIT) -> str:
    """`text` with control and non-printable characters escaped (\\n, \\x1b, \\u2028 ...), cut at `limit`."""
    cut = text[:limit]
    # unicode_escape escapes backslashes too, so a literal "\\n" cannot pass for an escaped newline.
    plain = cut.isprintable() and "\\" not in cut
    escaped = cut if plain else cut.encode("unicode_escape").decode("ascii")
    if len(text) > limit:
        escaped += f"... ({len(text) - limit} more characters)"
    return escaped


def shown_ids(ids: Sequence[str], limit: int = IDS_LIMIT) -> str:
    """A comma-separated list of at most `limit` IDs, each shown(); how many more there were."""
    head = ",".join(shown(i) for i in ids[:limit])
    if len(ids) > limit:
        head += f" and {len(ids) - limit} more"
    return head


# -- lines handed to the log writer as they are ------------------------------------------------------------

# (created, level, logger name, message): a line for the log writer thread to make a record of.
Line = tuple[float, int, str, str]


class _Sink:
    """Where `log_line` puts its lines while `gpunode plugin run`'s log writer thread owns gpunode's log."""

    def __init__(self) -> None:
        self.put: Callable[[Line], object] | None = None
        self.root: logging.Logger | None = None  # the logger the writer's handler is the only handler of
        self.handler: logging.Handler | None = None


SINK = _Sink()


def log_line(logger: logging.Logger, level: int, message: str) -> None:
    """Log `message`, already formatted, as `logger.log(level, message)` would (no %-formatting of it).

    Allocate logs one line per call. Through logging, the caller builds a LogRecord (~5 µs, about a sixth
    of the handler, issue 24); here, while the log writer thread owns gpunode's log (its handler the only
    one, nothing propagated), the caller only queues the time, level, name and text, and the writer thread
    builds the record and formats it as for any other record. Anywhere else (tests' caplog, another
    handler added), this is plain logging. The message must already be bounded and escaped (`shown`)."""
    put, root, handler = SINK.put, SINK.root, SINK.handler
    if not logger.isEnabledFor(level):
        return
    if (
        put is not None
        and root is not None
        and logger.parent is root
        and not logger.handlers
        and not logger.filters
        and logger.propagate
        and len(root.handlers) == 1
        and root.handlers[0] is handler
        and not root.propagate
    ):
        put((time.time(), level, logger.name, message))
        return
    logger.log(level, message)
