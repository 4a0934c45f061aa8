"""TOML parsed for editing (tomlkit, which keeps comments, order and layout), with gpunode's errors.

A syntax error names the file, line and column; a valid file tomlkit cannot parse is refused as an editor
limit (UneditableToml), never blamed as invalid. The editors (gpunode.runtimes.edits) parse with it, and
the read-only reader (gpunode.runtimes.tomlread) falls back to it for the error a file gets: kept apart
from both so that neither imports the other for it.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import tomlkit
from tomlkit.exceptions import ParseError, TOMLKitError

from gpunode.errors import ConfigError, UneditableToml


def parse_toml_document(text: str, path: str) -> tomlkit.TOMLDocument:
    """Parse TOML keeping its formatting, for editing; syntax errors name the file, line and column.

    tomlkit refuses some valid layouts (a table's sub-tables split around another table after an indented
    header: its OutOfOrderTableProxy fails). Such a file is judged by tomllib and refused as an editor
    limit (UneditableToml), never blamed as invalid: the runtime reads it every day."""
    try:
        return tomlkit.parse(text)
    except ParseError as exc:
        reason = re.sub(r"\s*at line \d+ col \d+\s*$", "", str(exc))
        if valid_toml(text):
            raise _layout_error(path, reason) from None
        raise ConfigError(
            f"{path} is not valid TOML: {reason} (line {exc.line}, column {exc.col + 1})",
            f"correct line {exc.line} of {path}",
        ) from None
    except TOMLKitError as exc:
        if valid_toml(text):
            raise _layout_error(path, str(exc)) from None
        raise ConfigError(f"{path} is not valid TOML: {exc}", f"correct {path}") from None


def _tomllib() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the backport, on Python 3.10 only
        import tomli as tomllib
    return tomllib


def valid_toml(text: str) -> bool:
    """Whether TOML's reference reader (tomllib) accepts the text."""
    tomllib = _tomllib()
    try:
        tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        # ValueError: an integer of over 4,300 digits (int()'s limit), which no runtime reads either (fuzzing
        # found it: exit 70 for `x = 999...`); RecursionError: arrays nested thousands deep.
        return False
    return True


def _layout_error(path: str, reason: str) -> UneditableToml:
    # tomlkit's line is where it gave up, not the table to move: no line is named.
    return UneditableToml(
        f"{path} is valid TOML, but gpunode's TOML editor (tomlkit) cannot edit its layout ({reason}); "
        "nothing was changed",
        f"in {path}, keep each table's sub-tables together after it and start every [table] header at the "
        "beginning of its line (the file means the same to its reader), then run again; or make the change "
        "by hand",
    )
