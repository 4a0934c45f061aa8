"""`cdi install` never loses a unit it did not write, and `cdi uninstall` deletes a unit only while it is
still the bytes gpunode wrote (issue 23, review round 4): a foreign `gpunode-cdi.service` is kept in the
backups and put back; an operator's edit is kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from gpunode.systemd.service import gpunode_executable

UNITS = Path("etc/systemd/system")
FOREIGN = "[Service]\nExecStart=/usr/local/bin/my-own\n"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with gpunode installed at the path the units name (`--root` checks it is there)."""
    r = tmp_path / "r"
    program = r / gpunode_executable().lstrip("/")
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    (r / UNITS).mkdir(parents=True)
    return r


def run(root: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["--root", str(root), *argv], host=Host(root=root, euid=0))
    out, err = capsys.readouterr()
    return code, out + err


def test_a_foreign_unit_is_backed_up_and_put_back(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unit = root / UNITS / "gpunode-cdi.service"
    unit.write_text(FOREIGN)
    code, out = run(root, capsys, "cdi", "install")
    assert code == ExitCode.OK, out
    backup = root / "var/lib/gpunode/backups/etc/systemd/system/gpunode-cdi.service"
    assert backup.read_text() == FOREIGN
    assert str(backup.relative_to(root)) in out.replace("/var", "var")
    assert "cdi generate" in unit.read_text()
    code, out = run(root, capsys, "cdi", "uninstall")
    assert code == ExitCode.OK, out
    assert unit.read_text() == FOREIGN  # the original, back in place
    assert not backup.exists()  # no longer the only copy: it went only once the original was back
    assert not (root / UNITS / "gpunode-cdi.path").exists()


def test_an_edited_unit_is_kept_by_uninstall(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(root, capsys, "cdi", "install")[0] == ExitCode.OK
    unit = root / UNITS / "gpunode-cdi.service"
    edited = unit.read_text() + "Environment=MINE=1\n"
    unit.write_text(edited)
    code, out = run(root, capsys, "cdi", "uninstall")
    assert code == ExitCode.OK, out
    assert unit.read_text() == edited
    assert "changed after gpunode wrote it: left in place" in out
    assert not (root / UNITS / "gpunode-cdi.path").exists()  # the unchanged one goes
    record = json.loads((root / "var/lib/gpunode/cdi-units.json").read_text())
    assert list(record["units"]) == ["/etc/systemd/system/gpunode-cdi.service"]


def test_a_unit_naming_gpunode_without_a_record_is_not_deleted(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unit = root / UNITS / "gpunode-cdi.service"
    unit.write_text("[Service]\nExecStart=/opt/gpunode-wrapper cdi generate\n")
    code, out = run(root, capsys, "cdi", "uninstall")
    assert code == ExitCode.OK, out
    assert unit.exists() and "no record" in out
    assert os.listdir(root / UNITS) == ["gpunode-cdi.service"]
