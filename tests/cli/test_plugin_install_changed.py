"""`plugin install --json` that fails after it wrote files says so: `changed` is true in its error document
(docs/json.md: true only when something on the host changed), false when it failed before writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import CommandResult, Host
from tests.scriptedrunner import FakeRunner

UNIT_FILE = "etc/systemd/system/gpunode-device-plugin.service"


class EnableFails(FakeRunner):
    """systemctl that knows no unit and refuses `enable` (a broken systemd, a unit it will not load)."""

    def answer(self, key: tuple[str, ...]) -> CommandResult:
        if key[:2] == ("systemctl", "show"):
            return CommandResult(key, 0, "LoadState=not-found\nActiveState=inactive\n", "")
        if key[:2] == ("systemctl", "enable"):
            return CommandResult(key, 1, "", "Failed to enable unit: Unit file is masked.")
        return CommandResult(key, 0, "", "")


def install_json(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, object]]:
    code = main(
        ["plugin", "install", "--json", *args], host=Host(root=root, runner=EnableFails(), env={}, euid=0)
    )
    doc = json.loads(capsys.readouterr().out)
    assert isinstance(doc, dict)
    return code, doc


def test_a_failure_after_the_unit_was_written_reports_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = install_json(tmp_path, capsys)
    assert code == ExitCode.COMMAND_FAILED and doc["error"] is not None
    assert (tmp_path / UNIT_FILE).is_file()  # written, and left for a re-run or uninstall
    assert doc["changed"] is True


def test_a_failure_before_anything_was_written_reports_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = install_json(tmp_path, capsys, "--config", "/no/such/plugin.toml")
    assert code == ExitCode.NOT_FOUND and doc["changed"] is False
    assert not (tmp_path / UNIT_FILE).exists()
