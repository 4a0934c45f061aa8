"""Every runtime dependency pyproject.toml declares is imported by gpunode (none left unused, issue 15)."""

from __future__ import annotations

import re
from pathlib import Path

from tests import tomlread

REPO = Path(__file__).resolve().parents[1]
# The module each distribution provides, where the names differ.
MODULES = {"grpcio": "grpc", "protobuf": "google.protobuf", "nvidia-ml-py": "pynvml", "PyYAML": "yaml"}


def test_every_declared_dependency_is_imported() -> None:
    project = tomlread.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0] for spec in project["dependencies"]]
    sources = "\n".join(p.read_text() for p in (REPO / "gpunode").rglob("*.py"))
    unused = []
    for name in names:
        module = MODULES.get(name, name.replace("-", "_"))
        pattern = rf"^\s*(?:import {re.escape(module)}\b|from {re.escape(module)}(?:\.\w+)* import )"
        if not re.search(pattern, sources, re.MULTILINE):
            unused.append(f"{name} (module {module})")
    assert not unused, f"declared but never imported: {', '.join(unused)}"
