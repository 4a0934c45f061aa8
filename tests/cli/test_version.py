"""`gpunode --version` and `gpunode version [--json]`: the version and the commit or build it was made from
(issue 24); git is asked only for these, never on an ordinary start."""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
from pathlib import Path

import jsonschema
import pytest

from gpunode import __version__, buildinfo, schemas
from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner

CHECKOUT = Path(__file__).resolve().parents[2]
GIT = ("git", "-C", str(CHECKOUT), "describe", "--always", "--dirty", "--abbrev=12")


def checkout_host(tmp_path: Path, commit: str | None = "0123456789ab-dirty") -> tuple[Host, ScriptedRunner]:
    runner = ScriptedRunner()
    if commit is not None:
        runner.answer(list(GIT), commit + "\n")
    return Host(root=tmp_path, runner=runner), runner


@pytest.fixture(autouse=True)
def no_stamp(monkeypatch: pytest.MonkeyPatch) -> None:
    # As in a checkout: no gpunode/_build.py (install.sh writes it into an installed package only).
    monkeypatch.setitem(sys.modules, "gpunode._build", None)


def test_version_names_the_commit_of_the_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (CHECKOUT / ".git").exists()
    host, runner = checkout_host(tmp_path)
    assert main(["--version"], host=host) == ExitCode.OK
    assert capsys.readouterr().out == f"gpunode {__version__} (commit 0123456789ab-dirty)\n"
    assert runner.calls == [GIT]


def test_no_git_is_run_on_an_ordinary_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, runner = checkout_host(tmp_path)
    assert main(["completion", "bash"], host=host) == ExitCode.OK
    assert runner.calls == []


def test_without_git_the_version_still_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, _ = checkout_host(tmp_path, commit=None)  # `git` not installed: the runner refuses it
    assert main(["--version"], host=host) == ExitCode.OK
    assert capsys.readouterr().out == f"gpunode {__version__} (commit unknown)\n"
    assert buildinfo.build(host, checkout=tmp_path) == buildinfo.Build(__version__, None, "unknown")


def test_an_installed_package_names_its_build_stamp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = buildinfo.write_stamp(tmp_path, "v0.1.0-3-gabcdef012345")
    assert [p.name for p in tmp_path.iterdir()] == ["_build.py"]  # no temp file left
    spec = importlib.util.spec_from_file_location("gpunode._build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "gpunode._build", module)
    host, runner = checkout_host(tmp_path)
    assert main(["--version"], host=host) == ExitCode.OK
    assert capsys.readouterr().out == f"gpunode {__version__} (build v0.1.0-3-gabcdef012345)\n"
    assert runner.calls == []  # the stamp wins: no git


def test_version_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, _ = checkout_host(tmp_path)
    assert main(["version", "--json"], host=host) == ExitCode.OK
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, schemas.load("version"))
    assert doc["schema"] == "gpunode.version/v1" and doc["changed"] is False and doc["error"] is None
    assert (doc["version"], doc["commit"], doc["commit_source"]) == (__version__, "0123456789ab-dirty", "git")
    assert doc["python"] == platform.python_version()
    assert doc["pynvml"] == buildinfo.package_version("nvidia-ml-py") is not None
    assert doc["grpcio"] == buildinfo.package_version("grpcio") is not None


def test_version_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, _ = checkout_host(tmp_path)
    assert main(["version"], host=host) == ExitCode.OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"gpunode {__version__} (commit 0123456789ab-dirty)"
    assert f"python {platform.python_version()}" in lines
    assert f"pynvml {buildinfo.package_version('nvidia-ml-py')}" in lines
