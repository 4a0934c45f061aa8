"""`gpunode configure-runtime` end to end through the CLI: output, exit codes, dry run, revert."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner

CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"
DEFAULT_V2 = (Path(__file__).resolve().parent.parent / "fixtures/containerd/default-v2.toml").read_text()


def node(tmp_path: Path) -> tuple[Host, ScriptedRunner]:
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], CONTAINERD_1_6)
    return Host(root=tmp_path, runner=runner), runner


def put(root: Path, host_path: str, text: str) -> Path:
    target = root / host_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def run(host: Host, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["configure-runtime", *args], host=host)
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_the_diff_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", DEFAULT_V2)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    host, _ = node(tmp_path)
    code, out, _ = run(host, capsys, "containerd", "--set-as-default", "--dry-run")
    assert code == ExitCode.OK
    assert "--- a/etc/containerd/config.toml\n+++ b/etc/containerd/config.toml\n" in out
    assert '-      default_runtime_name = "runc"\n+      default_runtime_name = "nvidia"\n' in out
    assert "dry run: 1 file(s) would change; nothing was changed" in out
    assert path.read_text() == DEFAULT_V2 and path.stat().st_mtime_ns == 1_000_000_000
    assert not (tmp_path / "var").exists()  # no backup, record or lock either


def test_configure_then_already_configured_then_revert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = put(tmp_path, "/etc/docker/daemon.json", '{\n  "log-driver": "journald"\n}\n')
    host, runner = node(tmp_path)
    code, out, _ = run(host, capsys, "docker", "--set-as-default")
    assert code == ExitCode.OK
    assert "wrote /etc/docker/daemon.json" in out
    assert "the original is kept in /var/lib/gpunode/backups/etc/docker/daemon.json" in out
    # Under --root the host's own docker is not the one configured: no restart unless asked.
    assert "restart docker for the change to take effect" in out
    assert f"undo with: gpunode --root {tmp_path} configure-runtime docker --revert\n" in out
    assert not any(call[0] == "systemctl" for call in runner.calls)

    code, out, _ = run(host, capsys, "docker", "--set-as-default")
    assert code == ExitCode.OK
    assert "docker is already configured: nothing to change (/etc/docker/daemon.json untouched)" in out

    code, out, _ = run(host, capsys, "docker", "--revert")
    assert code == ExitCode.OK
    assert "restored /etc/docker/daemon.json" in out
    assert path.read_text() == '{\n  "log-driver": "journald"\n}\n'


def test_bad_config_exit_code_message_and_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", 'version = 2\n[plugins."io.containerd.grpc.v1.cri"\n')
    host, _ = node(tmp_path)
    code, out, err = run(host, capsys, "containerd")
    assert code == ExitCode.CONFIG
    assert err.startswith("gpunode: error: /etc/containerd/config.toml is not valid TOML")
    assert "(line 2, column" in err and "fix: correct line 2 of /etc/containerd/config.toml" in err
    assert "Traceback" not in err and out == ""
    assert path.read_text() == 'version = 2\n[plugins."io.containerd.grpc.v1.cri"\n'


def test_revert_with_nothing_recorded_is_not_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, _ = node(tmp_path)
    code, _, err = run(host, capsys, "crio", "--revert")
    assert code == ExitCode.NOT_FOUND
    assert "no record of changing crio's configuration" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["podman"], "unknown runtime 'podman'"),
        (["containerd", "--drop-in", "/a.toml", "--in-place"], "cannot be used together"),
        (["docker", "--runtime-name", "bad name"], "invalid runtime name"),
        (["docker", "--revert", "--set-as-default"], "--revert undoes"),
        (["docker", "--drop-in", "/etc/docker/x.json"], "no drop-in directory"),
    ],
)
def test_usage_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    host, _ = node(tmp_path)
    code, _, err = run(host, capsys, *args)
    assert code == ExitCode.USAGE
    assert message in err


def test_runtime_is_chosen_from_kubelet_and_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    put(
        tmp_path,
        "/var/lib/kubelet/config.yaml",
        "containerRuntimeEndpoint: unix:///run/containerd/containerd.sock\n",
    )
    put(tmp_path, "/etc/containerd/config.toml", DEFAULT_V2)
    host, _ = node(tmp_path)
    code, out, _ = run(host, capsys, "--dry-run")
    assert code == ExitCode.OK
    assert out.startswith(
        "kubelet uses containerd (its container-runtime endpoint): configuring containerd\n"
    )


def test_explicit_restart_failure_rolls_back_and_exits_8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = put(tmp_path, "/etc/docker/daemon.json", "{}\n")
    host, runner = node(tmp_path)
    runner.answer(
        ["systemctl", "restart", "docker.service"], returncode=1, stderr="Job for docker.service failed."
    )
    runner.answer(["journalctl"], "failed to start daemon: runtime name 'nvidia' is reserved\n")
    code, _, err = run(host, capsys, "docker", "--restart", "--yes")
    assert code == ExitCode.COMMAND_FAILED
    assert "runtime name 'nvidia' is reserved" in err
    assert "gpunode put back the previous content of /etc/docker/daemon.json" in err
    assert path.read_text() == "{}\n"
    assert not (tmp_path / "var/lib/gpunode/runtime-changes.json").exists()  # nothing left to revert


# -- restarts are shown in the plan, and asked for ------------------------------------------------------


@pytest.mark.parametrize(
    ("daemon_json", "said"),
    [
        ("{}\n", "restarting docker.service STOPS every running container on this node (live-restore is off"),
        ('{"live-restore": true}\n', "containers keep running (live-restore is on)"),
    ],
    ids=["live-restore-off", "live-restore-on"],
)
def test_dry_run_lists_the_restart_and_what_it_does_to_containers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], daemon_json: str, said: str
) -> None:
    put(tmp_path, "/etc/docker/daemon.json", daemon_json)
    host, runner = node(tmp_path)
    code, out, _ = run(host, capsys, "docker", "--restart", "--dry-run")
    assert code == ExitCode.OK
    assert "would run: systemctl restart docker.service" in out
    assert "then wait until docker answers: docker -H unix:///var/run/docker.sock info --format" in out
    assert said in out
    assert not any(call[0] in ("systemctl", "docker") for call in runner.calls)


def test_a_restart_is_asked_for_declined_exits_1_and_no_terminal_needs_yes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    path = put(tmp_path, "/etc/containerd/config.toml", DEFAULT_V2)
    host, runner = node(tmp_path)
    code, out, err = run(host, capsys, "containerd", "--restart")
    assert code == ExitCode.USAGE and "add --yes" in err
    assert "will run: systemctl restart containerd.service" in out
    assert "kubelet cannot start or stop pods until containerd is back" in out

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    code, out, _ = run(host, capsys, "containerd", "--restart")
    assert code == ExitCode.DECLINED
    assert "Go ahead?" in out and "nothing was changed" in out
    assert path.read_text() == DEFAULT_V2
    assert not (tmp_path / "var/lib/gpunode/runtime-changes.json").exists()
    assert not any(call[0] == "systemctl" for call in runner.calls)
