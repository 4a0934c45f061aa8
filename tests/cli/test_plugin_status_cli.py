"""`gpunode plugin status` for a plugin systemd does not run (by hand, in a container): it reads the status
file the plugin was told to write, says which file it read, and where it looked when it found none."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner

RESOURCE = {"name": "nvidia.com/gpu", "socket": "gpunode-nvidia.com-gpu.sock", "devices": 4, "healthy": 4,
            "registered": True, "refused": None}  # fmt: skip
UNIT = "gpunode-device-plugin.service"


def write_status(root: Path, path: str, pid: int | None = None, ready: bool = True) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {"pid": os.getpid() if pid is None else pid, "ready": ready, "summary": "nvidia.com/gpu: 4/4",
                "resources": [RESOURCE], "unmonitored": []}  # fmt: skip
    target.write_text(json.dumps(document))


def no_systemd(root: Path, env: dict[str, str] | None = None) -> Host:
    # No answer for systemctl: it behaves as a program that is not installed (a container).
    return Host(root=root, runner=ScriptedRunner(), env=env or {})


def status(host: Host, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["plugin", "status", *args], host=host)
    return code, capsys.readouterr().out


def test_a_plugin_run_by_hand_is_read_from_its_status_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_status(tmp_path, "/srv/gpu/status.json")
    code, out = status(no_systemd(tmp_path), capsys, "--status-file", "/srv/gpu/status.json")
    assert code == ExitCode.OK, out
    lines = out.splitlines()
    assert lines[0] == f"service: {UNIT} is not installed (or systemd does not answer)"
    assert "status file: /srv/gpu/status.json (flag --status-file)" in lines
    assert "  nvidia.com/gpu: 4/4 healthy, registered (gpunode-nvidia.com-gpu.sock)" in lines
    # The same file named by the variable the plugin reads.
    env = {"GPUNODE_PLUGIN_STATUS_FILE": "/srv/gpu/status.json"}
    code, out = status(no_systemd(tmp_path, env), capsys)
    assert code == ExitCode.OK and "status file: /srv/gpu/status.json (env GPUNODE_PLUGIN_STATUS_FILE)" in out


def test_no_status_file_says_where_it_looked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_status(tmp_path, "/run/gpunode/plugin-status.json")  # the default: not looked at when told a path
    code, out = status(no_systemd(tmp_path), capsys, "--status-file", "/srv/missing.json")
    assert code == ExitCode.UNHEALTHY
    assert (
        "plugin: no status (not running); looked for its status file at:\n"
        "  /srv/missing.json (flag --status-file)\n" in out
    )
    assert "/run/gpunode/plugin-status.json" not in out
    (tmp_path / "run/gpunode/plugin-status.json").unlink()
    code, out = status(no_systemd(tmp_path), capsys)
    assert code == ExitCode.UNHEALTHY
    assert "  /run/gpunode/plugin-status.json (default)\n" in out


def test_the_units_setting_is_looked_at_before_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = ScriptedRunner()
    runner.answer(
        ["systemctl", "show", UNIT],
        "LoadState=loaded\nActiveState=active\nSubState=running\nUnitFileState=enabled\nMainPID=7\nNRestarts=0\n"
        'Environment="GPUNODE_PLUGIN_STATUS_FILE=/run/gp/unit.json" OTHER=1\n'
        "EnvironmentFiles=/etc/default/gpunode-device-plugin (ignore_errors=yes)\n",
    )
    host = Host(root=tmp_path, runner=runner, env={})
    code, out = status(host, capsys)
    assert code == ExitCode.UNHEALTHY
    assert "  /run/gp/unit.json (gpunode-device-plugin.service Environment=)\n" in out
    assert "  /run/gpunode/plugin-status.json (default)\n" in out
    # The EnvironmentFile wins over Environment=, as systemd applies them.
    defaults = tmp_path / "etc/default/gpunode-device-plugin"
    defaults.parent.mkdir(parents=True)
    defaults.write_text("# local settings\nGPUNODE_PLUGIN_STATUS_FILE='/run/gp/file.json'\n")
    write_status(tmp_path, "/run/gp/file.json")
    code, out = status(host, capsys)
    assert code == ExitCode.OK, out
    assert (
        "status file: /run/gp/file.json "
        "(gpunode-device-plugin.service EnvironmentFile=/etc/default/gpunode-device-plugin)" in out
    )
    assert "service: active (running), enabled, restarts 0" in out


def test_a_stale_or_broken_file_is_not_ready(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    child = subprocess.Popen(["true"])  # exited: its pid is free
    child.wait()
    write_status(tmp_path, "/srv/s.json", pid=child.pid)
    code, out = status(no_systemd(tmp_path), capsys, "--status-file", "/srv/s.json")
    assert code == ExitCode.UNHEALTHY
    assert f"plugin: pid {child.pid} (not running: the file is stale), nvidia.com/gpu: 4/4" in out
    (tmp_path / "srv/s.json").write_text("{not json")
    code, out = status(no_systemd(tmp_path), capsys, "--status-file", "/srv/s.json")
    assert code == ExitCode.UNHEALTHY and "plugin: unreadable status: /srv/s.json is not JSON" in out
    write_status(tmp_path, "/srv/s.json", ready=False)
    code, out = status(no_systemd(tmp_path), capsys, "--status-file", "/srv/s.json")
    assert code == ExitCode.UNHEALTHY and "status file: /srv/s.json (flag --status-file)" in out


def test_the_service_must_be_active_when_its_file_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The service's own file (found at the default) saying ready, while systemd has it failed: not ready.
    runner = ScriptedRunner()
    runner.answer(
        ["systemctl", "show", UNIT],
        "LoadState=loaded\nActiveState=failed\nSubState=failed\nUnitFileState=enabled\nNRestarts=3\n",
    )
    write_status(tmp_path, "/run/gpunode/plugin-status.json")
    code, out = status(Host(root=tmp_path, runner=runner, env={}), capsys)
    assert code == ExitCode.UNHEALTHY and "service: failed (failed), enabled, restarts 3" in out


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"resources": [1]}, "resources[0] is 1, not an object"),
        ({"pid": 99999999999999999999999}, "'pid' is 99999999999999999999999"),
        ({"pid": 0, "ready": True, "resources": [RESOURCE]}, "'pid' is 0 (a pid is an integer from 1 to"),
        ({"pid": 1e999}, "'pid' is inf"),
        ({"resources": [{"registered": "yes"}]}, 'resources[0].registered is "yes"'),
        ({"unmonitored": {"a": 1}}, "'unmonitored' is not a list"),
    ],
)
def test_a_status_file_of_the_wrong_shape_is_named_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], document: dict[str, object], named: str
) -> None:
    path = tmp_path / "srv/s.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(document))
    code, out = status(no_systemd(tmp_path), capsys, "--status-file", "/srv/s.json")
    assert code == ExitCode.UNHEALTHY, out
    assert "plugin: unreadable status: /srv/s.json is not a plugin status document: " in out
    assert named in out
    code = main(["plugin", "status", "--status-file", "/srv/s.json", "--json"], host=no_systemd(tmp_path))
    doc = json.loads(capsys.readouterr().out)
    assert code == ExitCode.UNHEALTHY and not doc["ready"] and named in doc["problem"]


def test_a_relative_status_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Host paths are absolute: a relative one ended in ValueError, exit 70 (the flag is refused by its click
    # type; the environment variable here).
    host = no_systemd(tmp_path, env={"GPUNODE_PLUGIN_STATUS_FILE": "rel.json"})
    code = main(["plugin", "status"], host=host)
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE, err
    assert "GPUNODE_PLUGIN_STATUS_FILE='rel.json' is not an absolute path" in err and "fix: set" in err
