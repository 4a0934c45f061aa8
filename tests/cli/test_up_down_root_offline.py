"""`gpunode up` and `gpunode down` under `--root DIR` run nothing on this machine: the plugin step writes
the unit into DIR and enables it by its links, never asks this machine's systemd for the state of DIR's
unit (`systemctl show` here would report this machine's service as DIR's), and prints what is left to
run on the system in DIR. A stand-in `systemctl` first on PATH records every call: there must be none."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpunode import down, up
from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from tests.cli.test_root_offline import with_gpunode

UNIT = "gpunode-device-plugin.service"
UNITS = "/etc/systemd/system"


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `systemctl` first on PATH that appends each call to the returned file and answers `show` as
    this machine's systemd would for a running plugin (what up used to report as DIR's state)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in ("systemctl", "journalctl"):
        program = bin_dir / name
        program.write_text(
            f'#!/bin/sh\necho "{name} $*" >> "{log}"\n'
            'if [ "$1" = show ]; then echo ActiveState=active; echo UnitFileState=enabled; fi\n'
        )
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return log


def called(log: Path) -> str:
    return log.read_text() if log.exists() else ""


def test_up_plugin_step_under_root_installs_into_the_root_and_asks_nothing_here(
    tmp_path: Path, calls: Path
) -> None:
    root = tmp_path / "image"
    root.mkdir()
    with_gpunode(root)  # the unit's ExecStart= names a program the image has
    host = Host(root=root, euid=0)
    step = up.replan(host, up.UpOptions(), lambda h: pytest.fail("no discovery"), "plugin")
    assert called(calls) == ""
    assert step.needed and "nothing is started on this machine" in step.summary
    assert f"link {UNITS}/multi-user.target.wants/{UNIT} -> {UNITS}/{UNIT}" in step.details
    assert f"on the system in {root}, run: systemctl start {UNIT}" in step.details
    assert step.apply is not None
    said = step.apply()
    assert called(calls) == ""
    assert f"on the system in {root}, run: systemctl daemon-reload && systemctl start {UNIT}" in said
    assert (root / UNITS.lstrip("/") / UNIT).is_file()
    assert (root / UNITS.lstrip("/") / "multi-user.target.wants" / UNIT).is_symlink()

    again = up.replan(host, up.UpOptions(), lambda h: pytest.fail("no discovery"), "plugin")
    assert not again.needed and "its state not asked: --root" in again.summary
    assert called(calls) == ""

    gone = down.plan_down(host, down.DownOptions())[0]
    assert gone.name == "plugin" and gone.needed, gone
    assert f"unlink {UNITS}/multi-user.target.wants/{UNIT}" in gone.details
    assert gone.apply is not None
    gone.apply()
    assert called(calls) == ""
    assert not (root / UNITS.lstrip("/") / UNIT).exists()
    assert not (root / UNITS.lstrip("/") / "multi-user.target.wants" / UNIT).is_symlink()


def test_down_dry_run_under_root_runs_nothing_here(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "image"
    root.mkdir()
    with_gpunode(root)  # the unit's ExecStart= names a program the image has
    host = Host(root=root, euid=0)
    assert main(["plugin", "install", "--no-start"], host=host) == ExitCode.OK
    capsys.readouterr()
    code = main(["down", "--dry-run"], host=host)
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, out + err
    assert f"unlink {UNITS}/multi-user.target.wants/{UNIT}" in out
    assert called(calls) == ""
