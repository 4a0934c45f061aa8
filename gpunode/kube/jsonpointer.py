"""JSON pointers (RFC 6901) for the paths of JSON patch operations."""

from __future__ import annotations


def escape_json_pointer(token: str) -> str:
    """One reference token, escaped: "nvidia.com/gpu" → "nvidia.com~1gpu".

    "~" first: escaping "/" first would turn its "~1" into "~01".
    """
    return token.replace("~", "~0").replace("/", "~1")


def json_pointer(*tokens: str) -> str:
    """A pointer from unescaped tokens: json_pointer("status", "capacity", "nvidia.com/gpu") is
    "/status/capacity/nvidia.com~1gpu"; no tokens is "", the whole document."""
    return "".join("/" + escape_json_pointer(token) for token in tokens)
