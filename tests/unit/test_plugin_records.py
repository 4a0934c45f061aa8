"""The plugin service's record tells the truth (issue 23): `down` undoes what `plugin install` recorded and
nothing else, and an install that failed after writing says `changed: true`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.down import DownOptions, plan_down
from gpunode.errors import CommandFailed, ExitCode, GpunodeError
from gpunode.host import CommandResult, Host
from gpunode.systemd import service
from gpunode.up import Step
from tests.unit.test_service_plan import GPUNODE, FakeSystemctl

UNIT = service.UNIT


class FailingEnable(FakeSystemctl):
    """systemd that refuses to enable the unit (a masked unit, a read-only /etc/systemd)."""

    def answer(self, key: tuple[str, ...]) -> CommandResult:
        if key[:2] == ("systemctl", "enable"):
            return CommandResult(key, 1, "", "Failed to enable unit: Unit file is masked.")
        return super().answer(key)


def node(tmp_path: Path, systemctl: FakeSystemctl) -> Host:
    return Host(root=tmp_path, runner=systemctl, env={}, euid=0)


def installed(tmp_path: Path, systemctl: FakeSystemctl) -> Host:
    host = node(tmp_path, systemctl)
    plan = service.plan_install(host, config_file=None, start=True, executable=GPUNODE)
    service.apply_install(host, plan, sleep=lambda _: None)
    return host


# -- 5. an install that wrote files and then failed ------------------------------------------------------


def test_an_install_that_failed_after_writing_says_it_changed_the_host(tmp_path: Path) -> None:
    host = node(tmp_path, FailingEnable())
    plan = service.plan_install(host, config_file=None, start=True, executable=GPUNODE)
    with pytest.raises(CommandFailed) as err:
        service.apply_install(host, plan, sleep=lambda _: None)
    assert (tmp_path / service.UNIT_PATH.lstrip("/")).exists()  # written, and not rolled back
    assert err.value.changed


def test_an_install_that_failed_before_writing_changed_nothing(tmp_path: Path) -> None:
    host = node(tmp_path, FakeSystemctl())
    plan = service.plan_install(host, config_file=None, start=True, executable=GPUNODE)
    (tmp_path / "etc/systemd").mkdir(parents=True)
    (tmp_path / "etc/systemd/system").write_text("not a directory\n")  # the unit cannot be written
    with pytest.raises(GpunodeError) as err:
        service.apply_install(host, plan, sleep=lambda _: None)
    assert not err.value.changed


def test_json_error_document_of_a_failed_install_is_changed_true(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = node(tmp_path, FailingEnable())
    assert main(["plugin", "install", "--json"], host=host) == ExitCode.COMMAND_FAILED
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"] is not None and "masked" in doc["error"]["message"]
    assert doc["changed"] is True


# -- 4. down undoes the plugin service's record and nothing else -------------------------------------------


def plugin_step(host: Host) -> Step:
    return next(s for s in plan_down(host, DownOptions()) if s.name == "plugin")


def test_a_running_unit_gpunode_has_no_record_of_is_left_running(tmp_path: Path) -> None:
    systemctl = FakeSystemctl()
    systemctl.enabled, systemctl.active = True, "active"  # installed by hand, or by another tool
    unit = tmp_path / service.UNIT_PATH.lstrip("/")
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/opt/other/plugin\n")
    host = node(tmp_path, systemctl)

    plan = service.plan_uninstall(host)
    assert plan.commands == () and plan.remove == ()
    assert any("no record of installing it" in n for n in plan.notes)
    step = plugin_step(host)
    assert not step.needed and step.apply is None
    assert not any(d.startswith("run:") for d in step.details)
    assert any("no record" in d for d in step.details)  # said, in the plan (and so in --json)
    service.apply_uninstall(host, plan)
    assert systemctl.active == "active" and systemctl.enabled and unit.exists()
    assert not any(c[1] == "disable" for c in systemctl.calls)


def test_down_reports_a_unit_file_it_kept_as_kept_not_removed(tmp_path: Path) -> None:
    systemctl = FakeSystemctl()
    host = installed(tmp_path, systemctl)
    unit = tmp_path / service.UNIT_PATH.lstrip("/")
    edited = unit.read_text() + "# the operator's own line\n"
    unit.write_text(edited)

    step = plugin_step(host)
    assert step.needed and step.apply is not None
    assert "remove" not in step.summary and "keep" in step.summary
    assert f"keep {service.UNIT_PATH} (changed since gpunode wrote it)" in step.details
    assert not any(d == f"remove {service.UNIT_PATH}" for d in step.details)
    result = step.apply()
    assert "removed" not in result and f"kept {service.UNIT_PATH}" in result
    assert unit.read_text() == edited
    assert systemctl.active == "inactive" and not systemctl.enabled  # gpunode's enable is undone


def test_down_reports_what_it_removed(tmp_path: Path) -> None:
    host = installed(tmp_path, FakeSystemctl())
    step = plugin_step(host)
    assert step.summary == f"stop, disable and remove {UNIT}"
    assert step.apply is not None
    assert step.apply() == f"{UNIT}: stopped and disabled; removed {service.UNIT_PATH}"
    assert not (tmp_path / service.UNIT_PATH.lstrip("/")).exists()
