"""A plugin started by hand with `--status-file PATH` (as in a container) and `gpunode plugin status
--status-file PATH` reading it: a real plugin process against the fake kubelet, without systemd."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.errors import ExitCode
from tests.integration.kubelet import FakeKubelet
from tests.integration.pluginproc import REPO, PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


def plugin_status(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # no GPUNODE_PLUGIN_STATUS_FILE of ours
    return subprocess.run(
        [sys.executable, "-m", "gpunode", "plugin", "status", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def wait_for_file(path: Path, timeout: float = 60.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            document = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):  # not yet, or caught between write and rename
            time.sleep(0.05)
            continue
        if isinstance(document, dict) and document.get("ready"):
            return document
        time.sleep(0.05)
    raise AssertionError(f"{path} did not say ready within {timeout} s")


def test_status_of_a_plugin_told_where_to_write(socket_dir: Path) -> None:
    status_file = socket_dir.parent / "state" / "plugin.json"
    elsewhere = socket_dir.parent / "env-status.json"
    with FakeKubelet(socket_dir) as kubelet:
        # The flag wins over the variable (which PluginProcess sets for every plugin).
        plugin = PluginProcess(
            socket_dir,
            ["--simulate", "pcie-4", "--status-file", str(status_file)],
            profile=None,
            env={"GPUNODE_PLUGIN_STATUS_FILE": str(elsewhere)},
        )
        with plugin:
            kubelet.wait_registered(GPU, timeout=60)
            document = wait_for_file(status_file)
            assert document["pid"] == plugin.pid and not elsewhere.exists()
            shown = plugin_status("--status-file", str(status_file))
            assert shown.returncode == ExitCode.OK, shown.stdout + shown.stderr
            lines = shown.stdout.splitlines()
            assert f"status file: {status_file} (flag --status-file)" in lines
            assert any(line.startswith(f"plugin: pid {plugin.pid}, ") for line in lines), shown.stdout
            assert "  nvidia.com/gpu: 4/4 healthy, registered (gpunode-nvidia.com-gpu.sock)" in lines
            as_json = json.loads(plugin_status("--status-file", str(status_file), "--json").stdout)
            assert as_json["ready"] and as_json["pid_running"] and as_json["plugin"]["pid"] == plugin.pid
    # Stopped: the plugin removed its file; status says where it looked and exits 1.
    gone = plugin_status("--status-file", str(status_file))
    assert gone.returncode == ExitCode.UNHEALTHY
    assert f"  {status_file} (flag --status-file)" in gone.stdout.splitlines()


@pytest.mark.parametrize(("given_by", "name"), [("flag", "plugin.json"), ("env", "status/plugin.json")])
def test_a_status_file_in_the_socket_directory_is_refused_at_start(
    socket_dir: Path, given_by: str, name: str
) -> None:
    """Issue 23: in it, every status write waited out a 30 s lock the plugin itself held on the socket
    directory (READY 30 s late, a SIGTERM taking 25 s); in it or below, kubelet deletes the file when it
    restarts. Refused at start, before anything is served."""
    status_file = socket_dir / name
    args = ["--simulate", "pcie-4"]
    env = {"GPUNODE_PLUGIN_STATUS_FILE": str(status_file)}
    if given_by == "flag":
        args += ["--status-file", str(status_file)]
        env = {}
    socket_dir.mkdir(parents=True)
    with PluginProcess(socket_dir, args, profile=None, env=env) as plugin:
        code = plugin.wait(timeout=120)
        log = plugin.log()
    assert code == ExitCode.USAGE, log
    source = "flag --status-file" if given_by == "flag" else "env GPUNODE_PLUGIN_STATUS_FILE"
    assert f"the status file {status_file} ({source}) is inside the socket directory {socket_dir}" in log
    assert "fix: put the status file elsewhere with --status-file or $GPUNODE_PLUGIN_STATUS_FILE" in log
    assert "Traceback" not in log
    assert not status_file.exists() and list(socket_dir.iterdir()) == []  # nothing served, nothing left


def test_a_reload_that_would_put_the_socket_directory_over_the_status_file_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same rule on SIGHUP: a new socket-dir holding the status file keeps the running config."""
    import logging

    from gpunode.host import Host
    from gpunode.plugin.config import PluginConfig, load_config
    from gpunode.plugin.lifecycle import Plugin
    from gpunode.plugin.simulate import simulated_inventory

    status_file = tmp_path / "run" / "plugin.json"
    socket_dirs = [str(tmp_path / "device-plugins"), str(tmp_path / "run")]
    host = Host(env={})

    def load() -> PluginConfig:
        return load_config(host, config_path=None, env={"GPUNODE_SOCKET_DIR": socket_dirs[0]})

    plugin = Plugin(
        host,
        load,
        lambda _config: simulated_inventory("pcie-4"),
        simulated=True,
        status_file=str(status_file),
    )
    socket_dirs.pop(0)  # the file now names the directory the status file is in
    with caplog.at_level(logging.ERROR, logger="gpunode.plugin"):
        plugin._reload()
    assert plugin.config.socket_dir == str(tmp_path / "device-plugins")
    assert "reload refused, keeping the running configuration" in caplog.text
    assert f"the status file {status_file}" in caplog.text and "is inside the socket directory" in caplog.text
