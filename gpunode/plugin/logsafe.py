"""Request content made safe for a log line or an error message: escaped, and bounded in size.

What kubelet (or anyone who can reach the socket) sends is not trusted text: an ID with a newline would
forge a log line, one of a megabyte would fill the journal. Everything from a request goes through
`shown()` / `shown_ids()` before it is logged or echoed in an error.
"""

from __future__ import annotations

from collections.abc import Sequence

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
