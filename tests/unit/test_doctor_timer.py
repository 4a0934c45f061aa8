"""`gpunode plugin install --doctor-metrics DIR` (issue 18): the oneshot service and timer that keep
doctor's textfile metrics fresh, rendered like the plugin's unit, checked by systemd-analyze, installed,
enabled, recorded, and removed again by uninstall."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpunode.errors import UsageError
from gpunode.host import CommandResult, Host
from gpunode.systemd import service
from tests.scriptedrunner import FakeRunner

GPUNODE = "/usr/local/bin/gpunode"
TEXTFILES = "/var/lib/node_exporter/textfile_collector"
TIMER_PATH = f"/etc/systemd/system/{service.DOCTOR_TIMER}"
DOCTOR_PATH = f"/etc/systemd/system/{service.DOCTOR_SERVICE}"


class Systemctl(FakeRunner):
    """Records every systemctl call; `show` answers an installed, running plugin unit."""

    def answer(self, key: tuple[str, ...]) -> CommandResult:
        if key[:2] == ("systemctl", "show"):
            text = "LoadState=loaded\nActiveState=active\nSubState=running\nUnitFileState=enabled\n"
            return CommandResult(key, 0, text, "")
        return CommandResult(key, 0, "", "")


def test_units_render_and_pass_systemd_analyze(tmp_path: Path) -> None:
    executable = shutil.which("gpunode") or str(Path(__file__).resolve().parents[2] / ".venv/bin/gpunode")
    unit, timer = service.render_doctor_units(executable, TEXTFILES + "/")
    assert f"ExecStart={executable} doctor --prometheus {TEXTFILES}/gpunode_doctor.prom\n" in unit
    assert "\nType=oneshot\n" in unit and "\nSuccessExitStatus=1\n" in unit
    assert "\nOnUnitActiveSec=5min\n" in timer and "\nWantedBy=timers.target\n" in timer
    if shutil.which("systemd-analyze") is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze (Debian package systemd) is missing, and CI must check the units")
        pytest.skip("no systemd-analyze here")
    (tmp_path / service.DOCTOR_SERVICE).write_text(unit)
    (tmp_path / service.DOCTOR_TIMER).write_text(timer)
    for name in (service.DOCTOR_SERVICE, service.DOCTOR_TIMER):
        proc = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(tmp_path / name)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert (proc.returncode, proc.stderr) == (0, ""), name


@pytest.mark.parametrize("directory", ["relative/dir", "/a/../b", "/with\nnewline", "/nul\0", "/end "])
def test_a_directory_systemd_cannot_name_is_refused(directory: str) -> None:
    with pytest.raises(UsageError, match="--doctor-metrics"):
        service.render_doctor_units(GPUNODE, directory)


def test_a_directory_with_spaces_and_specifier_characters_is_escaped_not_refused() -> None:
    unit, _ = service.render_doctor_units(GPUNODE, "//srv/node exporter/100%/$x/")
    expected = f'ExecStart={GPUNODE} doctor --prometheus "/srv/node exporter/100%%/$$x/gpunode_doctor.prom"\n'
    assert expected in unit  # systemd's reading of it: tests/integration/test_unit_escaping.py


def test_install_enables_the_timer_and_uninstall_removes_it(tmp_path: Path) -> None:
    systemctl = Systemctl()
    host = Host(root=tmp_path, runner=systemctl, env={}, euid=0)
    plan = service.plan_install(
        host, config_file=None, start=False, executable=GPUNODE, doctor_metrics=TEXTFILES
    )
    assert [f.path for f in plan.files if f.changed] == [service.UNIT_PATH, DOCTOR_PATH, TIMER_PATH]
    assert plan.commands[0] == ("systemctl", "daemon-reload")
    assert ("systemctl", "enable", "--now", service.DOCTOR_TIMER) in plan.commands
    service.apply_install(host, plan)
    record = json.loads((tmp_path / service.RECORD_PATH.lstrip("/")).read_text())
    assert {DOCTOR_PATH, TIMER_PATH} <= set(record)
    assert "doctor --prometheus" in (tmp_path / DOCTOR_PATH.lstrip("/")).read_text()
    again = service.plan_install(
        host, config_file=None, start=False, executable=GPUNODE, doctor_metrics=TEXTFILES
    )
    assert not any(f.changed for f in again.files)
    assert ("systemctl", "enable", "--now", service.DOCTOR_TIMER) not in again.commands

    removal = service.plan_uninstall(host)
    assert ("systemctl", "disable", "--now", service.DOCTOR_TIMER) in removal.commands
    assert set(removal.remove) >= {DOCTOR_PATH, TIMER_PATH}
    service.apply_uninstall(host, removal)
    assert not (tmp_path / TIMER_PATH.lstrip("/")).exists()
    assert not (tmp_path / DOCTOR_PATH.lstrip("/")).exists()
    assert systemctl.calls[-1] == ("systemctl", "daemon-reload")
