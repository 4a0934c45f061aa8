"""TOML read only, never edited: tomllib, the standard library's reader.

tomlkit keeps a file's formatting for editing and costs for it: ~25 ms to parse containerd's 240-line
default configuration, where tomllib takes ~2 ms, and ~15 ms to import. doctor, status and the plugin's
config reader only read, so tomlkit is imported only when tomllib refuses a file: its error names the line
and column the way gpunode's editors do (gpunode.runtimes.tomldoc.parse_toml_document), and a file only
tomlkit accepts is read as tomlkit reads it, as before.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from gpunode.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the backport, on Python 3.10 only
    import tomli as tomllib


def read_toml(text: str, path: str) -> dict[str, Any]:
    """A TOML file's plain values; syntax errors raise ConfigError naming `path`, the line and column."""
    try:
        parsed: dict[str, Any] = tomllib.loads(text)
        return parsed
    except RecursionError:
        # arrays or inline tables nested thousands deep: no runtime reads that either
        raise ConfigError(f"{path} is not valid TOML: nested too deeply", f"correct {path}") from None
    except ValueError:  # TOMLDecodeError, and int()'s refusal of a 4,301-digit integer
        from gpunode.runtimes.tomldoc import parse_toml_document

        # Raises ConfigError for what tomlkit refuses too (the usual case) ...
        data: dict[str, Any] = parse_toml_document(text, path).unwrap()
        # ... and what it accepts is read as before tomllib came first.
        return data


def plain(value: Any) -> Any:
    """tomlkit items (and nested containers) as plain Python values; plain values as they are."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    unwrap = getattr(value, "unwrap", None)
    return unwrap() if callable(unwrap) else value
