"""The repository's promises: the README's test command is what CI runs, and the layout is complete."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
    readme = (REPO / "README.md").read_text()
    assert ci in readme
    assert re.search(r"```(?:bash|sh)\n" + re.escape(ci) + r"\n```", readme), "not a command block of its own"


def test_layout() -> None:
    for path in (
        "gpunode",
        "templates",
        "tests",
        "pyproject.toml",
        "install.sh",
        "README.md",
        ".ci/run",
        "bench",
        "BENCHMARKS.md",
    ):
        assert (REPO / path).exists(), path


def test_every_exit_code_is_documented() -> None:
    from gpunode.errors import ExitCode

    readme = (REPO / "README.md").read_text()
    for code in ExitCode:
        assert re.search(rf"^\| {int(code)} \|", readme, re.MULTILINE), f"exit code {int(code)} not in README"


def test_templates_are_package_data() -> None:
    from importlib.resources import files

    assert files("gpunode.templates").joinpath("README.md").is_file()
    assert (REPO / "templates").resolve() == REPO / "gpunode/templates"
