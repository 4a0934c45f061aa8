"""A TOML reader independent of tomlkit (which gpunode writes with): tomllib, or tomli before Python 3.11."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - the CI machine runs 3.11
    import tomli as _toml


def loads(text: str) -> dict[str, Any]:
    data: dict[str, Any] = _toml.loads(text)
    return data


TOMLDecodeError = _toml.TOMLDecodeError
