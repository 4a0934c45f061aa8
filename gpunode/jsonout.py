"""The `--json` contract: one document on stdout per run, the same envelope for every command.

Every document has `schema` ("gpunode.<command>/v<N>", bumped on any incompatible change), `changed` (true
only when something on the host changed), `dry_run`, and `error` (null, or the message, the fix and the
exit code when the command failed). The rest is the command's own: the plan with --dry-run, the result
otherwise. The README documents each schema; tests validate every one (tests/cli/test_json_contract.py).

A failing command still prints its document: the error handler in gpunode/cli/main.py asks `fail()` here,
which prints one only when the command asked for JSON (`request()`), so automation reads one document
whatever happened, and the human message still goes to stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from gpunode.errors import GpunodeError

VERSION = 1

_requested: list[tuple[str, dict[str, Any]]] = []  # (schema, fields known so far) of the running command


def schema(command: str) -> str:
    return f"gpunode.{command}/v{VERSION}"


def request(command: str, **known: Any) -> None:
    """The command will answer in JSON; `known` goes into its error document too (e.g. dry_run)."""
    _requested[:] = [(schema(command), dict(known))]


def update(**fields: Any) -> None:
    """More of what the error document would carry (e.g. the steps done before a failure)."""
    if _requested:
        _requested[0][1].update(fields)


def requested() -> bool:
    return bool(_requested)


def reset() -> None:
    _requested.clear()


def document(command: str, *, changed: bool, dry_run: bool = False, **fields: Any) -> dict[str, Any]:
    return {"schema": schema(command), "changed": changed, "dry_run": dry_run, **fields, "error": None}


def emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    _requested.clear()  # answered: an error after this (a closed pipe) must not print a second document


def fail(err: GpunodeError) -> None:
    """Print the error document of the running command, if it asked for JSON."""
    if not _requested:
        return
    name, known = _requested[0]
    doc = {
        "schema": name,
        "changed": bool(getattr(err, "changed", False)),
        "dry_run": bool(known.pop("dry_run", False)),
        **known,
        "error": {"message": err.message, "fix": err.fix, "exit_code": int(err.exit_code)},
    }
    emit(doc)
