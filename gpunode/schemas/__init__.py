"""JSON Schemas of the `--json` documents, one file per command (gpunode.<command>/v1), shipped with the
package so that automation can validate what it reads. tests/cli/test_json_contract.py validates every
command's real output against them."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def load(command: str) -> dict[str, Any]:
    text = resources.files(__name__).joinpath(f"{command}.v1.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema
