"""kubectl's --request-timeout values, parsed as client-go's clientcmd.ParseTimeout parses them: a bare
integer is seconds, else a Go duration ("1m30s", "500ms", "1.5h"); 0 means no timeout. Its own module:
the CLI checks the value before anything heavy is imported."""

from __future__ import annotations

import re

from gpunode.errors import UsageError

# Go's time.ParseDuration units, in seconds.
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(rf"^(?:{_PART.pattern})+$")


def parse_request_timeout(value: str) -> float:
    """Seconds (0.0: no timeout). Raises UsageError for anything kubectl would refuse, and for a negative
    duration, which kubectl would take as no timeout without saying so."""
    text = value.strip()
    if text.isdigit():
        return float(int(text))
    if text != "0" and _DURATION.match(text):
        return sum(float(number) * _UNITS[unit] for number, unit in _PART.findall(text))
    raise UsageError(
        f"--request-timeout {value!r} is not a timeout",
        "give whole seconds or a number with a unit (e.g. 30, 10s, 2m, 1m30s); 0 means no timeout",
    )
