"""apply() when the change fails half-way: whatever the failure, the files go back.

The programs here are real ones (small scripts on PATH standing in for systemctl, docker, journalctl and
containerd), so that their output goes through the real runner's decoding, as on a node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from gpunode.errors import CommandFailed, ExitCode
from gpunode.host import CommandResult, Host, ScriptedRunner, SubprocessRunner
from gpunode.runtimes import records, service
from gpunode.runtimes.configure import apply, plan_configure, verify_effective
from gpunode.runtimes.plan import ConfigureOptions, FileChange, RuntimePlan

DAEMON_JSON = "/etc/docker/daemon.json"


class NodeRunner:
    """Runs real programs as the programs of the node under the Host's root (the fakes on PATH), as a
    ScriptedRunner answers for one: the restart and its checks are the node's, not this machine's."""

    def __init__(self) -> None:
        self.real = SubprocessRunner()

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult:
        return self.real.run(argv, timeout=timeout, env=env, input=input)


def program(directory: Path, name: str, script: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def put(root: Path, host_path: str, text: str) -> Path:
    target = root / host_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of fake programs first on PATH (the runner finds programs on this process's PATH)."""
    directory = tmp_path / "bin"
    directory.mkdir()
    monkeypatch.setenv("PATH", f"{directory}:/usr/bin:/bin")
    return directory


def test_a_journal_that_is_not_utf8_still_gets_the_old_file_back(tmp_path: Path, bin_dir: Path) -> None:
    calls = tmp_path / "systemctl.calls"
    program(bin_dir, "systemctl", f'echo "$*" >> {calls}\n')
    program(bin_dir, "docker", "echo 'Cannot connect to the Docker daemon' >&2; exit 1\n")
    # dockerd logged a byte that is not UTF-8 (a Latin-1 file name in its own message).
    program(bin_dir, "journalctl", "printf 'unable to configure the Docker daemon: caf\\351\\377\\n'\n")
    root = tmp_path / "root"
    path = put(root, DAEMON_JSON, '{"debug": true}\n')
    host = Host(root=root, runner=NodeRunner())
    plan = plan_configure(host, "docker", ConfigureOptions(set_as_default=True))
    with pytest.raises(CommandFailed) as caught:
        apply(host, plan, restart=True, ready_timeout=0)
    message = caught.value.message
    assert caught.value.exit_code == ExitCode.COMMAND_FAILED
    assert "docker did not come back" in message
    assert "unable to configure the Docker daemon: caf\ufffd\ufffd" in message  # its words, bytes replaced
    assert f"put back the previous content of {DAEMON_JSON}" in message
    assert path.read_text() == '{"debug": true}\n'
    assert records.load(host).files == {}
    # Restarted on the new file, then again on the old one.
    assert calls.read_text().splitlines() == ["restart docker.service", "restart docker.service"]


def test_a_config_dump_that_is_not_utf8_is_read(tmp_path: Path, bin_dir: Path) -> None:
    # containerd prints a path from the file as it is: here a byte that is not UTF-8 in a string.
    dump = (
        "version = 2\\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd]\\n'
        '  default_runtime_name = "runc"\\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\\n'
        '  runtime_type = "io.containerd.runc.v2"\\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\\n'
        '  BinaryName = "/opt/caf\\351/nvidia-container-runtime"\\n'
    )
    program(bin_dir, "containerd", f"printf '{dump}'\n")
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    # Host() on the real root: containerd is asked only there. It only reads (config dump of a temp file).
    host = Host(env={"PATH": str(bin_dir)})
    plan = RuntimePlan(
        runtime="containerd",
        changes=(FileChange(str(config), "version = 2\n", "version = 2\n# changed\n"),),
        flavour="containerd",
        expect=("nvidia", False),
    )
    assert verify_effective(host, plan) == "containerd's own dump shows the 'nvidia' runtime"


def _docker_node(tmp_path: Path) -> tuple[Host, ScriptedRunner, Path]:
    runner = ScriptedRunner()
    runner.answer(["systemctl", "restart", "docker.service"])
    runner.answer(["docker"], '{"nvidia":{},"runc":{}}\tnvidia\n')
    path = put(tmp_path, DAEMON_JSON, '{"debug": true}\n')
    return Host(root=tmp_path, runner=runner), runner, path


def test_a_bug_after_the_write_puts_the_files_back_and_exits_8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, runner, path = _docker_node(tmp_path)
    plan = plan_configure(host, "docker", ConfigureOptions(set_as_default=True))

    def bug(*_: object, **__: object) -> str:
        raise TypeError("an exception gpunode did not foresee")

    monkeypatch.setattr(service, "wait_until_ready", bug)
    with pytest.raises(CommandFailed) as caught:
        apply(host, plan, restart=True)
    assert caught.value.exit_code == ExitCode.COMMAND_FAILED
    message = caught.value.message
    assert "configuring docker failed (TypeError: an exception gpunode did not foresee)" in message
    assert f"put back the previous content of {DAEMON_JSON}" in caught.value.message
    assert caught.value.fix is not None and "--debug" in caught.value.fix
    assert not caught.value.changed
    assert path.read_text() == '{"debug": true}\n'
    assert records.load(host).files == {}
    # It failed while the runtime restarted on the new file: restarted again on the old one.
    assert runner.calls.count(("systemctl", "restart", "docker.service")) == 2


def test_ctrl_c_during_the_restart_puts_the_files_back_and_is_still_an_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, _, path = _docker_node(tmp_path)
    plan = plan_configure(host, "docker", ConfigureOptions(set_as_default=True))

    def interrupted(*_: object, **__: object) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(service, "wait_until_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        apply(host, plan, restart=True)
    assert path.read_text() == '{"debug": true}\n'
    assert records.load(host).files == {}
    assert not (tmp_path / "var/lib/gpunode/backups/etc/docker/daemon.json").exists()
