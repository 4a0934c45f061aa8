"""`gpunode plugin install|uninstall|status` planned and applied against a temp root and a fake systemctl.

The real systemd runs in tests/integration/test_plugin_service.py; here a small stateful stand-in answers
`systemctl` the way systemd does for this one unit, so every branch of the plan can be checked quickly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import CommandFailed, ConfigError, ExitCode, GpunodeError, PermissionDenied
from gpunode.host import CommandResult, Host
from gpunode.systemd import service
from tests.scriptedrunner import FakeRunner

UNIT = service.UNIT
GPUNODE = "/usr/local/bin/gpunode"


class FakeSystemctl(FakeRunner):
    """systemctl for one unit: enable/disable, start/stop/restart/reload, show; READY after `ready_after`."""

    def __init__(self, ready: bool = True) -> None:
        super().__init__()
        self.enabled = False
        self.active = "inactive"
        self.ready = ready

    def answer(self, key: tuple[str, ...]) -> CommandResult:
        if key[0] == "journalctl":
            return CommandResult(key, 0, "gpunode: waiting for kubelet\n", "")
        assert key[0] == "systemctl", key
        verb, args = key[1], [a for a in key[2:] if not a.startswith("-")]
        if verb == "show":
            sub = {"active": "running", "activating": "start", "inactive": "dead"}[self.active]
            text = (
                f"ActiveState={self.active}\nSubState={sub}\n"
                f"UnitFileState={'enabled' if self.enabled else 'disabled'}\nStatusText=\nMainPID=0\n"
                "NRestarts=0\nResult=success\n"
            )
            return CommandResult(key, 0, text, "")
        if verb in ("start", "restart"):
            self.active = "active" if self.ready else "activating"
        elif verb == "enable":
            self.enabled = True
            if "--now" in key:
                self.active = "active" if self.ready else "activating"
        elif verb == "disable":
            self.enabled = False
            if "--now" in key:
                self.active = "inactive"
        elif verb not in ("daemon-reload", "reload"):
            return CommandResult(key, 1, "", f"unknown verb {verb}")
        assert verb == "daemon-reload" or args == [UNIT], key
        return CommandResult(key, 0, "", "")


def node(tmp_path: Path, systemctl: FakeSystemctl | None = None, euid: int = 0) -> Host:
    return Host(root=tmp_path, runner=systemctl or FakeSystemctl(), env={}, euid=euid)


def changing(plan: service.ServicePlan) -> list[str]:
    return [f.path for f in plan.files if f.changed]


def test_unit_renders_with_the_real_executable_and_passes_systemd_analyze(tmp_path: Path) -> None:
    executable = shutil.which("gpunode") or str(Path(__file__).resolve().parents[2] / ".venv/bin/gpunode")
    text = service.render_unit(executable)
    assert f"ExecStart={executable} plugin run\n" in text
    for line in ("Type=notify", "Wants=kubelet.service", "Restart=always", "WatchdogSec=30"):
        assert f"\n{line}\n" in text
    assert "Requires=" not in text.replace("# Wants=, not Requires=", "")
    unit = tmp_path / UNIT
    unit.write_text(text)
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False
    )
    assert (proc.returncode, proc.stderr) == (0, "")


def systemd_verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    "directory",
    [
        "with space",  # one word for systemd, not two
        "pct%h%i%%",  # specifiers are expanded in the program path too: %% is a literal %
        "dollar$HOME${X}",  # ...variables are not: $ stays as it is
        "semi;colon",
    ],
)
def test_exec_start_names_exactly_the_installed_program_whatever_its_path(
    tmp_path: Path, directory: str
) -> None:
    """systemd's own parser (systemd-analyze verify) reads the rendered ExecStart= back as the very file:
    it checks the program exists and is executable, so a path it parsed differently is reported."""
    program = tmp_path / directory / "gpunode"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    unit = tmp_path / UNIT
    unit.write_text(service.render_unit(str(program)))
    assert systemd_verify(unit).stderr == ""
    # The check has teeth: the same directory without the program is reported, by its exact path.
    program.unlink()
    assert f"Command {program} is not executable" in systemd_verify(unit).stderr


@pytest.mark.parametrize(
    "path",
    [
        "/opt/gpu\nnode/bin/gpunode",
        "/opt/tab\there/gpunode",
        '/opt/"q"/gpunode',
        "/opt/b\\s/gpunode",
        "gpunode",
    ],
)
def test_a_program_path_systemd_cannot_name_is_refused_before_anything_is_written(
    tmp_path: Path, path: str
) -> None:
    with pytest.raises(GpunodeError) as err:
        service.plan_install(node(tmp_path), config_file=None, start=True, executable=path)
    assert "which a unit's ExecStart= cannot name" in err.value.message and err.value.fix
    assert not (tmp_path / "etc/systemd/system" / UNIT).exists()


def test_unit_sets_a_descriptor_limit() -> None:
    text = service.render_unit("/usr/local/bin/gpunode")
    assert "\nLimitNOFILE=65536\n" in text


def test_install_writes_enables_starts_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    systemctl = FakeSystemctl()
    host = node(tmp_path, systemctl)
    plan = service.plan_install(host, config_file=None, start=True, executable=GPUNODE)
    assert changing(plan) == [service.UNIT_PATH]
    assert plan.commands == (
        ("systemctl", "daemon-reload"),
        ("systemctl", "enable", UNIT),
        ("systemctl", "start", "--no-block", UNIT),
    )
    state = service.apply_install(host, plan, sleep=lambda _: None)
    assert state.active == "active" and state.enabled
    unit = tmp_path / service.UNIT_PATH.lstrip("/")
    assert unit.read_text() == service.render_unit(GPUNODE) and unit.stat().st_mode & 0o777 == 0o644
    record = json.loads((tmp_path / service.RECORD_PATH.lstrip("/")).read_text())
    assert set(record) == {service.UNIT_PATH}

    again = service.plan_install(host, config_file=None, start=True, executable=GPUNODE)
    assert again.changes_nothing


def test_config_is_checked_then_installed_and_a_change_reloads(tmp_path: Path) -> None:
    systemctl = FakeSystemctl()
    host = node(tmp_path, systemctl)
    (tmp_path / "p.toml").write_text("[time-slicing]\nreplicas = 2\n")
    service.apply_install(
        host,
        service.plan_install(host, config_file="/p.toml", start=True, executable=GPUNODE),
        sleep=lambda _: None,
    )
    assert (tmp_path / "etc/gpunode/plugin.toml").read_text() == "[time-slicing]\nreplicas = 2\n"
    (tmp_path / "p.toml").write_text("[time-slicing]\nreplicas = 4\n")
    plan = service.plan_install(host, config_file="/p.toml", start=True, executable=GPUNODE)
    assert changing(plan) == [service.CONFIG_PATH]
    assert plan.commands == (("systemctl", "reload", UNIT),)  # SIGHUP: the plugin re-reads it


def test_bad_config_is_refused_before_systemd_is_touched(tmp_path: Path) -> None:
    systemctl = FakeSystemctl()
    host = node(tmp_path, systemctl)
    (tmp_path / "p.toml").write_text("migStrategy = 'mixed'\n")
    with pytest.raises(ConfigError, match="migStrategy"):
        service.plan_install(host, config_file="/p.toml", start=True, executable=GPUNODE)
    assert systemctl.calls == [] and not (tmp_path / "etc").exists()


def test_not_root_is_a_clear_error_and_dry_run_needs_no_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = node(tmp_path, euid=1000)
    plan = service.plan_install(host, config_file=None, start=True, executable=GPUNODE)
    with pytest.raises(PermissionDenied, match="needs root"):
        service.apply_install(host, plan)
    assert main(["plugin", "install"], host=host) == ExitCode.PERMISSION
    assert "sudo gpunode plugin install" in capsys.readouterr().err
    assert main(["plugin", "install", "--dry-run"], host=host) == 0
    out = capsys.readouterr().out
    assert "would create /etc/systemd/system/gpunode-device-plugin.service" in out
    assert "ExecStart=" in out and "would run: systemctl enable gpunode-device-plugin.service" in out
    assert not (tmp_path / "etc").exists()


def test_a_plugin_that_never_registers_is_reported_with_its_journal(tmp_path: Path) -> None:
    host = node(tmp_path, FakeSystemctl(ready=False))
    plan = service.plan_install(host, config_file=None, start=True, executable=GPUNODE)
    with pytest.raises(CommandFailed) as err:
        service.apply_install(host, plan, timeout=0.0, sleep=lambda _: None)
    assert "did not become ready" in err.value.message and "waiting for kubelet" in err.value.message
    assert err.value.fix and "kubelet" in err.value.fix


def test_uninstall_removes_only_what_install_wrote(tmp_path: Path) -> None:
    systemctl = FakeSystemctl()
    host = node(tmp_path, systemctl)
    (tmp_path / "p.toml").write_text("[time-slicing]\nreplicas = 1\n")
    service.apply_install(
        host,
        service.plan_install(host, config_file="/p.toml", start=True, executable=GPUNODE),
        sleep=lambda _: None,
    )
    other = tmp_path / "etc/default/gpunode-device-plugin"
    other.parent.mkdir(parents=True)
    other.write_text("FAKE=1\n")
    config = tmp_path / "etc/gpunode/plugin.toml"
    config.write_text(config.read_text() + "# edited by hand\n")  # changed since install: kept
    plan = service.plan_uninstall(host)
    assert plan.remove == (service.UNIT_PATH,)
    assert plan.commands == (("systemctl", "disable", "--now", UNIT), ("systemctl", "daemon-reload"))
    assert any("plugin.toml was changed" in n for n in plan.notes)
    service.apply_uninstall(host, plan)
    assert not (tmp_path / service.UNIT_PATH.lstrip("/")).exists()
    assert config.exists() and other.exists()
    assert not (tmp_path / service.RECORD_PATH.lstrip("/")).exists()
    assert systemctl.active == "inactive" and not systemctl.enabled
    assert service.plan_uninstall(host).changes_nothing


def test_status_shows_service_and_registration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    systemctl = FakeSystemctl()
    host = node(tmp_path, systemctl)
    assert main(["plugin", "status"], host=host) == ExitCode.UNHEALTHY
    assert "plugin: no status (not running)" in capsys.readouterr().out
    systemctl.active, systemctl.enabled = "active", True
    status = tmp_path / "run/gpunode/plugin-status.json"
    status.parent.mkdir(parents=True)
    resource = {"name": "nvidia.com/gpu", "socket": "gpunode-nvidia.com-gpu.sock", "devices": 4, "healthy": 3,
                "registered": True, "refused": None}  # fmt: skip
    status.write_text(
        json.dumps({"pid": os.getpid(), "ready": True, "summary": "x", "resources": [resource]})
    )
    assert main(["plugin", "status"], host=host) == 0
    out = capsys.readouterr().out
    assert "service: active (running), enabled" in out
    assert "nvidia.com/gpu: 3/4 healthy, registered (gpunode-nvidia.com-gpu.sock)" in out
    assert "unmonitored" not in out
    # GPUs the plugin cannot watch: listed with why; the plugin is ready all the same (exit 0).
    gone = {"index": 2, "uuid": "GPU-2", "reason": "NVML refused looking it up (No Permission)"}
    status.write_text(
        json.dumps({"pid": os.getpid(), "ready": True, "summary": "x", "resources": [resource],
                    "unmonitored": [gone]})
    )  # fmt: skip
    assert main(["plugin", "status"], host=host) == 0
    assert (
        "  unmonitored: GPU 2 (GPU-2): NVML refused looking it up (No Permission)\n"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("executable", "off"),
    [
        ("/usr/local/bin/gpunode", []),
        ("/opt/gpunode/bin/gpunode", []),
        ("/root/venv/bin/gpunode", ["ProtectHome=yes"]),
        ("/home/ops/.local/bin/gpunode", ["ProtectHome=yes"]),
        ("/tmp/checkout/.venv/bin/gpunode", ["PrivateTmp=yes"]),
        ("/tmpfoo/bin/gpunode", []),
    ],
)
def test_hardening_that_would_hide_the_program_is_turned_off(
    tmp_path: Path, executable: str, off: list[str]
) -> None:
    text = service.render_unit(executable)
    for option in ("ProtectHome=yes", "PrivateTmp=yes"):
        assert (f"\n{option}\n" in text) == (option not in off), option
    plan = service.plan_install(node(tmp_path), config_file=None, start=True, executable=executable)
    assert [n.split(" ")[0] for n in plan.notes] == off


def test_a_unit_left_with_another_mode_is_rewritten_with_gpunodes(tmp_path: Path) -> None:
    """The unit is gpunode's file: a 0666 unit with the right content is planned again and written 0644."""
    import stat as stat_mod

    host = Host(root=tmp_path, euid=os.geteuid())
    unit = tmp_path / service.UNIT_PATH.lstrip("/")
    unit.parent.mkdir(parents=True)
    unit.write_text(service.render_unit("/opt/gpunode/bin/gpunode"))
    unit.chmod(0o666)
    planned = service._planned_file(host, service.UNIT_PATH, unit.read_text())
    assert planned.changed and planned.wrong_mode
    host.write_file(service.UNIT_PATH, planned.content, mode=planned.mode, exact_mode=True)
    assert stat_mod.S_IMODE(unit.stat().st_mode) == 0o644
    assert not service._planned_file(host, service.UNIT_PATH, unit.read_text()).changed
