"""`gpunode dra install|uninstall|status`: the DRA driver's systemd service, on the device plugin's
machinery (gpunode/systemd/service.py, spec DRA), with its guarantees: a record with digests, --dry-run
showing every file and command, --json with a schema and a truthful `changed`, --root offline, the wait
for the unit to turn active, uninstall removing only what matches the record, one side per node.

systemctl is a fake that records its calls and keeps each unit's state; no real time passes in the wait.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpunode import schemas
from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import CommandResult, Host
from gpunode.systemd import service
from tests.scriptedrunner import FakeRunner

EXE = "/usr/local/bin/gpunode"
DRA_UNIT = "gpunode-dra-driver.service"
DRA_FILE = f"etc/systemd/system/{DRA_UNIT}"
PLUGIN_FILE = "etc/systemd/system/gpunode-device-plugin.service"
RECORD = "var/lib/gpunode/dra-service.json"


class Systemctl(FakeRunner):
    """systemctl that keeps each unit's state: `start` makes it activating, active after `polls` polls
    of `show` (Type=notify: READY=1 once the driver serves and is registered)."""

    def __init__(self, polls: int = 2, units: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.polls = polls
        self.units: dict[str, dict[str, Any]] = units or {}

    def unit(self, name: str) -> dict[str, Any]:
        return self.units.setdefault(name, {"active": "inactive", "enabled": False, "shows": 0})

    def answer(self, key: tuple[str, ...]) -> CommandResult:
        if key[0] == "journalctl":
            return CommandResult(key, 0, "", "")
        verb = key[1]
        if verb == "daemon-reload":
            return CommandResult(key, 0, "", "")
        name = key[-1] if verb != "show" else key[2]
        unit = self.unit(name)
        if verb == "show":
            if unit["active"] == "activating":
                unit["shows"] += 1
                if unit["shows"] > self.polls:
                    unit["active"] = "active"
            text = (
                f"LoadState=loaded\nActiveState={unit['active']}\nSubState=running\n"
                f"UnitFileState={'enabled' if unit['enabled'] else 'disabled'}\nStatusText=\nMainPID=0\n"
                "NRestarts=0\nResult=success\n"
            )
            return CommandResult(key, 0, text, "")
        if verb == "enable":
            unit["enabled"] = True
        elif verb == "start":
            unit["active"] = "activating"
        elif verb == "disable":
            unit["enabled"], unit["active"] = False, "inactive"
        else:
            raise AssertionError(f"unexpected systemctl call {key}")
        return CommandResult(key, 0, "", "")


@pytest.fixture(autouse=True)
def no_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(service, "monotonic", lambda: clock[0])
    monkeypatch.setattr(service, "pause", sleep)
    monkeypatch.setattr(service, "gpunode_executable", lambda: EXE)


def gpunode(
    root: Path, capsys: pytest.CaptureFixture[str], systemctl: FakeRunner | None, *argv: str
) -> tuple[int, str]:
    host = Host(root=root, runner=systemctl, env={}, euid=0) if systemctl else Host(root=root, euid=0)
    code = main(list(argv), host=host)
    out, err = capsys.readouterr()
    return code, out + err


def document(root: Path, capsys: pytest.CaptureFixture[str], systemctl: FakeRunner | None, *argv: str) -> Any:
    host = Host(root=root, runner=systemctl, env={}, euid=0) if systemctl else Host(root=root, euid=0)
    code = main([*argv, "--json"], host=host)
    doc = json.loads(capsys.readouterr().out)  # stdout is the one document; an error also goes to stderr
    jsonschema.validate(doc, schemas.load("-".join(argv[:2])))
    return code, doc


def test_install_writes_the_unit_records_it_enables_starts_and_waits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    systemctl = Systemctl(polls=3)
    code, doc = document(tmp_path, capsys, systemctl, "dra", "install")
    assert code == ExitCode.OK, doc
    assert doc["changed"] is True and doc["waited_for"] == f"{DRA_UNIT} to register with kubelet"
    assert doc["waited_s"] == 1.5  # three pauses of 0.5 s before the unit turned active
    unit = (tmp_path / DRA_FILE).read_text()
    assert f"ExecStart={EXE} dra run\n" in unit and "Type=notify" in unit
    assert "EnvironmentFile=-/etc/default/gpunode-dra-driver" in unit
    assert os.stat(tmp_path / DRA_FILE).st_mode & 0o777 == 0o644
    record = json.loads((tmp_path / RECORD).read_text())
    assert list(record) == [f"/{DRA_FILE}"]
    assert ("systemctl", "enable", DRA_UNIT) in systemctl.calls
    assert ("systemctl", "start", "--no-block", DRA_UNIT) in systemctl.calls
    assert doc["state"]["service"]["unit"] == DRA_UNIT
    # A second run changes nothing and says so.
    code, again = document(tmp_path, capsys, systemctl, "dra", "install")
    assert code == ExitCode.OK and again["changed"] is False


def test_dry_run_shows_every_file_and_command_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    systemctl = Systemctl()
    code, out = gpunode(tmp_path, capsys, systemctl, "dra", "install", "--dry-run")
    assert code == ExitCode.OK, out
    assert f"would create /{DRA_FILE}:" in out and f"ExecStart={EXE} dra run" in out
    assert f"would run: systemctl enable {DRA_UNIT}" in out
    assert f"would run: systemctl start --no-block {DRA_UNIT}" in out
    assert not (tmp_path / "etc").exists() and not (tmp_path / "var").exists()
    assert all(call[1] == "show" for call in systemctl.calls)  # only asked, nothing acted on


def test_uninstall_removes_what_install_wrote_and_keeps_an_edited_unit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    systemctl = Systemctl()
    assert gpunode(tmp_path, capsys, systemctl, "dra", "install")[0] == ExitCode.OK
    (tmp_path / DRA_FILE).write_text((tmp_path / DRA_FILE).read_text() + "# the operator's line\n")
    code, doc = document(tmp_path, capsys, systemctl, "dra", "uninstall")
    assert code == ExitCode.OK and doc["changed"] is True
    assert (tmp_path / DRA_FILE).read_text().endswith("# the operator's line\n")  # not gpunode's: kept
    assert doc["remove"] == [] and any("changed after gpunode wrote it" in n for n in doc["notes"])
    assert ("systemctl", "disable", "--now", DRA_UNIT) in systemctl.calls
    assert not (tmp_path / RECORD).exists()


def test_uninstall_removes_an_unchanged_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    systemctl = Systemctl()
    assert gpunode(tmp_path, capsys, systemctl, "dra", "install")[0] == ExitCode.OK
    code, out = gpunode(tmp_path, capsys, systemctl, "dra", "uninstall")
    assert code == ExitCode.OK, out
    assert f"removed /{DRA_FILE}" in out and not (tmp_path / DRA_FILE).exists()
    # The plugin's unit and record are not the DRA service's business.
    assert not (tmp_path / PLUGIN_FILE).exists()


def test_a_unit_written_by_hand_is_not_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / DRA_FILE).parent.mkdir(parents=True)
    (tmp_path / DRA_FILE).write_text("[Service]\nExecStart=/opt/mine\n")
    code, doc = document(tmp_path, capsys, Systemctl(), "dra", "uninstall")
    assert code == ExitCode.OK and doc["changed"] is False
    assert (tmp_path / DRA_FILE).read_text() == "[Service]\nExecStart=/opt/mine\n"


def test_dra_install_is_refused_while_the_plugin_service_is_enabled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    systemctl = Systemctl()
    assert gpunode(tmp_path, capsys, systemctl, "plugin", "install", "--no-start")[0] == ExitCode.OK
    code, doc = document(tmp_path, capsys, systemctl, "dra", "install")
    assert code == ExitCode.ERROR and doc["changed"] is False
    assert "gpunode-device-plugin.service is installed and enabled" in doc["error"]["message"]
    assert "plugin uninstall" in doc["error"]["fix"]
    assert not (tmp_path / DRA_FILE).exists()
    # Once the plugin is uninstalled, the DRA driver goes in.
    assert gpunode(tmp_path, capsys, systemctl, "plugin", "uninstall")[0] == ExitCode.OK
    assert gpunode(tmp_path, capsys, systemctl, "dra", "install")[0] == ExitCode.OK


def test_plugin_install_is_refused_while_the_dra_service_is_enabled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    systemctl = Systemctl()
    assert gpunode(tmp_path, capsys, systemctl, "dra", "install", "--no-start")[0] == ExitCode.OK
    code, out = gpunode(tmp_path, capsys, systemctl, "plugin", "install")
    assert code == ExitCode.ERROR, out
    assert f"{DRA_UNIT} is installed and enabled" in out and "dra uninstall" in out
    assert not (tmp_path / PLUGIN_FILE).exists()


def with_gpunode(root: Path) -> None:
    program = root / EXE.lstrip("/")
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)


def test_root_offline_enables_by_links_and_prints_the_next_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_gpunode(tmp_path)
    code, out = gpunode(tmp_path, capsys, None, "dra", "install")
    assert code == ExitCode.OK, out
    link = tmp_path / f"etc/systemd/system/multi-user.target.wants/{DRA_UNIT}"
    assert os.readlink(link) == f"/etc/systemd/system/{DRA_UNIT}"
    assert f"systemctl start {DRA_UNIT}" in out  # left for the system in the root
    # The plugin is then refused there too (the link says the DRA service is enabled).
    code, out = gpunode(tmp_path, capsys, None, "plugin", "install")
    assert code == ExitCode.ERROR and f"{DRA_UNIT} is installed and enabled" in out
    code, doc = document(tmp_path, capsys, None, "dra", "uninstall")
    assert code == ExitCode.OK and doc["changed"] is True
    assert not os.path.lexists(link) and not (tmp_path / DRA_FILE).exists()


def test_root_offline_refuses_a_unit_naming_a_program_the_root_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = gpunode(tmp_path, capsys, None, "dra", "install")
    assert code == ExitCode.NOT_FOUND and "dra install would write ExecStart" in out
    assert not (tmp_path / DRA_FILE).exists()


def status_file(root: Path, pid: int, state: str = "serving") -> None:
    path = root / "run/gpunode/dra.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "pid": pid,
        "state": state,
        "driver": "gpu.nvidia.com",
        "node": "gpu-7",
        "dra_socket": "/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock",
        "registration_socket": "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock",
        "simulated": True,
        "devices": {
            "gpu-0": {"uuid": "GPU-0", "healthy": True, "reason": None},
            "gpu-1": {"uuid": "GPU-1", "healthy": False, "reason": "Xid 79"},
        },
        "slices": {"generation": 3, "error": None},
    }
    path.write_text(json.dumps(doc))


def test_status_reads_the_drivers_status_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status_file(tmp_path, os.getpid())
    systemctl = Systemctl(units={DRA_UNIT: {"active": "active", "enabled": True, "shows": 0}})
    code, out = gpunode(tmp_path, capsys, systemctl, "dra", "status")
    assert code == ExitCode.OK, out
    assert "driver: gpu.nvidia.com on node gpu-7" in out and "devices: 1/2 healthy" in out
    assert "gpu-1 (GPU-1): Xid 79" in out and "slices: generation 3" in out
    code, doc = document(tmp_path, capsys, systemctl, "dra", "status")
    assert code == ExitCode.OK and doc["ready"] is True
    assert doc["driver"]["node"] == "gpu-7" and doc["service"]["unit"] == DRA_UNIT


def test_status_is_not_ready_when_the_service_is_not_active(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status_file(tmp_path, os.getpid())  # a file left behind by a driver the service no longer runs
    systemctl = Systemctl(units={DRA_UNIT: {"active": "failed", "enabled": True, "shows": 0}})
    code, doc = document(tmp_path, capsys, systemctl, "dra", "status")
    assert code == ExitCode.UNHEALTHY and doc["ready"] is False


def test_status_without_a_file_says_where_it_looked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = gpunode(tmp_path, capsys, Systemctl(), "dra", "status")
    assert code == ExitCode.UNHEALTHY
    assert "/run/gpunode/dra.json (default)" in out
