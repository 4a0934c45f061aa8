"""Under `--root DIR` nothing that acts runs on this machine: `plugin install|uninstall` and `cdi
install|uninstall` write their units into DIR, enable them by the links `systemctl enable` would make there
(and remove those links again), and print what is left to run on the system in DIR.

A stand-in `systemctl` first on PATH records every call: under --root there must be none (not even `show`:
this machine's systemd knows nothing of DIR's units). The links are compared with the real `systemctl
--root=DIR enable` run on a copy of the units (it acts on that directory only).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpunode import schemas
from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from gpunode.systemd.service import gpunode_executable

UNIT = "gpunode-device-plugin.service"
UNITS = "/etc/systemd/system"


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `systemctl` (and `journalctl`) first on PATH that appends each call to the returned file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in ("systemctl", "journalctl"):
        program = bin_dir / name
        program.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return log


def with_gpunode(root: Path) -> None:
    """gpunode installed in the root at the path the units name (install refuses a unit naming nothing)."""
    program = root / gpunode_executable().lstrip("/")
    if not program.exists():
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)


def run(
    root: Path, capsys: pytest.CaptureFixture[str], *argv: str, installed: bool = True
) -> tuple[int, str]:
    # The Host `--root DIR` makes (this machine's programs as the runner), as root.
    if installed:
        with_gpunode(root)
    code = main(list(argv), host=Host(root=root, euid=0))
    out, err = capsys.readouterr()
    return code, out + err


def run_json(root: Path, capsys: pytest.CaptureFixture[str], command: str, *argv: str) -> dict[str, Any]:
    code, out = run(root, capsys, *argv, "--json")
    doc = json.loads(out)
    jsonschema.validate(doc, schemas.load(command))
    assert code == ExitCode.OK, out
    assert isinstance(doc, dict)
    return doc


def links_in(root: Path) -> dict[str, str]:
    """Every symbolic link under DIR/etc/systemd/system, with its target."""
    base = root / UNITS.lstrip("/")
    return {"/" + str(p.relative_to(root)): os.readlink(p) for p in sorted(base.rglob("*")) if p.is_symlink()}


def test_plugin_install_under_root_runs_nothing_here_and_enables_by_links(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "image"
    root.mkdir()
    plan = run_json(root, capsys, "plugin-install", "plugin", "install", "--dry-run")
    assert not plan["changed"] and plan["commands"] == [] and not (root / "etc").exists()
    assert plan["links"] == [
        {"path": f"{UNITS}/multi-user.target.wants/{UNIT}", "target": f"{UNITS}/{UNIT}", "action": "create"}
    ]
    assert plan["next_steps"] == [["systemctl", "daemon-reload"], ["systemctl", "start", UNIT]]

    done = run_json(root, capsys, "plugin-install", "plugin", "install", "--doctor-metrics", "/var/lib/nx")
    assert not calls.exists(), calls.read_text()  # no systemctl at all on this machine
    assert done["changed"] and "state" not in done and done["commands"] == []
    assert (root / UNITS.lstrip("/") / UNIT).is_file()
    assert links_in(root) == {
        f"{UNITS}/multi-user.target.wants/{UNIT}": f"{UNITS}/{UNIT}",
        f"{UNITS}/timers.target.wants/gpunode-doctor-metrics.timer": f"{UNITS}/gpunode-doctor-metrics.timer",
    }
    assert ["systemctl", "start", "gpunode-doctor-metrics.timer"] in done["next_steps"]
    record = json.loads((root / "var/lib/gpunode/plugin-service.json").read_text())
    assert f"{UNITS}/{UNIT}" in record

    again = run_json(root, capsys, "plugin-install", "plugin", "install", "--doctor-metrics", "/var/lib/nx")
    assert not again["changed"] and again["next_steps"] == []
    assert {link["action"] for link in again["links"]} == {"unchanged"}
    assert not calls.exists()

    # Someone else's link in the same directory is not gpunode's to remove.
    (root / UNITS.lstrip("/") / "multi-user.target.wants/other.service").symlink_to(f"{UNITS}/other.service")
    code, out = run(root, capsys, "plugin", "uninstall")
    assert code == ExitCode.OK, out
    assert f"removed {UNITS}/multi-user.target.wants/{UNIT} -> {UNITS}/{UNIT}" in out
    assert f"on the system in {root}" in out and "systemctl stop" in out and "systemctl daemon-reload" in out
    assert not calls.exists(), calls.read_text()
    assert links_in(root) == {f"{UNITS}/multi-user.target.wants/other.service": f"{UNITS}/other.service"}
    assert not (root / UNITS.lstrip("/") / UNIT).exists()
    assert not (root / "var/lib/gpunode/plugin-service.json").exists()


def test_plugin_install_under_root_prints_the_next_steps(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(tmp_path, capsys, "plugin", "install", "--dry-run")
    assert code == ExitCode.OK, out
    assert f"would link {UNITS}/multi-user.target.wants/{UNIT} -> {UNITS}/{UNIT}" in out
    assert f"systemctl daemon-reload && systemctl start {UNIT}" in out
    assert "would run:" not in out and not calls.exists()
    code, out = run(tmp_path, capsys, "plugin", "install", "--no-start")
    assert code == ExitCode.OK, out
    assert f"linked {UNITS}/multi-user.target.wants/{UNIT}" in out and "ran " not in out
    assert "systemctl daemon-reload" in out and "systemctl start" not in out
    assert not calls.exists()


def test_cdi_install_and_uninstall_under_root_run_nothing_here(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = run_json(tmp_path, capsys, "cdi-install", "cdi", "install", "--dry-run")
    assert not plan["changed"] and plan["commands"] == [] and not (tmp_path / "etc").exists()
    assert [link["action"] for link in plan["links"]] == ["create", "create"]
    done = run_json(tmp_path, capsys, "cdi-install", "cdi", "install")
    assert done["changed"] and done["commands"] == []
    assert done["next_steps"] == [
        ["systemctl", "daemon-reload"],
        ["systemctl", "start", "gpunode-cdi.path"],
        ["systemctl", "start", "gpunode-cdi.service"],
    ]
    assert links_in(tmp_path) == {
        f"{UNITS}/multi-user.target.wants/gpunode-cdi.service": f"{UNITS}/gpunode-cdi.service",
        f"{UNITS}/multi-user.target.wants/gpunode-cdi.path": f"{UNITS}/gpunode-cdi.path",
    }
    again = run_json(tmp_path, capsys, "cdi-install", "cdi", "install")
    assert not again["changed"]
    gone = run_json(tmp_path, capsys, "cdi-uninstall", "cdi", "uninstall")
    assert gone["changed"] and gone["commands"] == [] and links_in(tmp_path) == {}
    assert gone["next_steps"][0] == ["systemctl", "stop", "gpunode-cdi.service", "gpunode-cdi.path"]
    assert not (tmp_path / UNITS.lstrip("/") / "gpunode-cdi.path").exists()
    assert not calls.exists(), calls.read_text()


def test_the_links_are_the_ones_systemctl_enable_makes(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = "/usr/bin/systemctl"
    if not os.access(real, os.X_OK):
        if os.environ.get("CI"):
            pytest.fail("systemctl (Debian package systemd) is missing, and CI must compare the links")
        pytest.skip("no systemctl here")
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    assert run(ours, capsys, "plugin", "install", "--doctor-metrics", "/var/lib/nx")[0] == ExitCode.OK
    assert run(ours, capsys, "cdi", "install")[0] == ExitCode.OK
    units = ours / UNITS.lstrip("/")
    (theirs / UNITS.lstrip("/")).mkdir(parents=True)
    for unit in units.iterdir():
        if unit.is_file():
            shutil.copy(unit, theirs / UNITS.lstrip("/") / unit.name)
    names = [UNIT, "gpunode-doctor-metrics.timer", "gpunode-cdi.service", "gpunode-cdi.path"]
    # The real systemctl, on a directory of its own: --root acts there and nowhere else.
    enabled = subprocess.run(
        [real, f"--root={theirs}", "enable", *names], capture_output=True, text=True, check=False, timeout=60
    )
    assert enabled.returncode == 0, enabled.stderr
    assert links_in(ours) == links_in(theirs)
    assert not calls.exists()


@pytest.mark.parametrize(
    "command", [("plugin", "install"), ("cdi", "install"), ("cdi", "install", "--dry-run")]
)
def test_install_refuses_a_unit_naming_a_program_the_root_lacks(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str], command: tuple[str, ...]
) -> None:
    # ExecStart= names this machine's gpunode; in a root without it the unit fails with 203/EXEC.
    code, out = run(tmp_path, capsys, *command, installed=False)
    assert code == ExitCode.NOT_FOUND, out
    assert f"ExecStart={gpunode_executable()}" in out and "install gpunode inside" in out
    assert not (tmp_path / "etc").exists() and not calls.exists()
    program = tmp_path / gpunode_executable().lstrip("/")
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")  # there, but not executable
    code, out = run(tmp_path, capsys, *command, installed=False)
    assert code == ExitCode.NOT_FOUND and not (tmp_path / "etc").exists(), out
