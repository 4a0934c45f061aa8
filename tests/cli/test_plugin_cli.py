"""`gpunode plugin run` wiring: help, --show-config, and the errors that stop it before it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plugin", "run", *args], host=Host(root=tmp_path, env={}))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_option_with_its_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpunode.plugin.config import OPTIONS

    monkeypatch.setenv("COLUMNS", "300")  # rich wraps help text to the terminal; keep names whole

    assert main(["plugin", "run", "--help"]) == 0
    out = capsys.readouterr().out
    for option in OPTIONS:
        assert option.flag in out, option.flag
        assert option.env in out, option.env


def test_show_config_prints_toml_with_each_origin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpunode.plugin.config import load_config
    from tests import tomlread as tomllib

    config = tmp_path / "etc/gpunode/plugin.toml"
    config.parent.mkdir(parents=True)
    config.write_text('mig-strategy = "mixed"\n[time-slicing]\nreplicas = 2\n')
    monkeypatch.setenv("GPUNODE_REPLICAS", "3")
    code, out, _ = run(tmp_path, capsys, "--show-config", "--device-id-strategy", "index")
    assert code == 0
    lines = {line.split(" = ")[0]: line for line in out.splitlines() if " = " in line}
    assert lines["mig-strategy"] == 'mig-strategy = "mixed"  # from: file /etc/gpunode/plugin.toml'
    assert lines["replicas"] == "replicas = 3  # from: env GPUNODE_REPLICAS"
    assert lines["device-id-strategy"] == 'device-id-strategy = "index"  # from: flag --device-id-strategy'
    assert lines["resource-name"] == 'resource-name = "nvidia.com/gpu"  # from: default'
    # Valid TOML that the plugin reads back, as a config file, to the very same settings.
    parsed = tomllib.loads(out)
    assert parsed["mig-strategy"] == "mixed" and parsed["time-slicing"]["replicas"] == 3
    (tmp_path / "shown.toml").write_text(out)
    shown = load_config(Host(root=tmp_path, env={}), config_path="/shown.toml", env={})
    resolved = load_config(
        Host(root=tmp_path, env={}), env={"GPUNODE_REPLICAS": "3"}, flags={"device_id_strategy": "index"}
    )
    assert shown == resolved


def test_unknown_key_in_config_is_exit_4_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUNODE_PLUGIN_CONFIG", raising=False)
    (tmp_path / "p.toml").write_text("migStrategy = 'mixed'\n")
    code, _, err = run(tmp_path, capsys, "--config", "/p.toml", "--show-config")
    assert code == ExitCode.CONFIG
    assert "unknown or unsupported key: migStrategy" in err and "Traceback" not in err


def test_unknown_simulation_profile_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(tmp_path, capsys, "--simulate", "dgx-z", "--socket-dir", str(tmp_path))
    assert code == ExitCode.USAGE
    assert "dgx-z" in err and "dgx-a100" in err


def test_a_wrong_flag_value_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A bad flag value is a usage error, as in every other command (issue 24).
    code, _, err = run(tmp_path, capsys, "--mig-strategy", "all", "--show-config")
    assert code == ExitCode.USAGE
    assert "--mig-strategy" in err and "none, single, mixed" in err
    code, _, err = run(tmp_path, capsys, "--replicas", "two")
    assert code == ExitCode.USAGE  # click refuses a non-integer itself


def test_plugin_run_does_not_load_grpc_for_help(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = "import sys; from gpunode.cli.main import main; main(['--help']); print('grpc' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.stdout.strip().endswith("False"), proc.stdout + proc.stderr


YAML_NUL = 'version: v1\nflags:\n  plugin:\n    kubeletSocket: "/x/\\x00y/kubelet.sock"\n'
# (config file name, its text, environment, flags) and what the error must name.
Setting = tuple[str | None, str, dict[str, str], tuple[str, ...]]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        # NVIDIA's kubeletSocket (issue 23): accepted, and the plugin waited for a directory never there.
        (("config.yaml", YAML_NUL, {}, ()), "flags.plugin.kubeletSocket"),
        (("plugin.toml", 'socket-dir = "/var/lib/\\u0000kubelet"\n', {}, ()), "socket-dir"),
        (("plugin.toml", 'driver-root = "/run/nvidia/\\u001bdriver"\n', {}, ()), "driver-root"),
        (("plugin.toml", 'dev-root = "/dev\\n"\n', {}, ()), "dev-root"),
        (("plugin.toml", '[mps]\nroot = "/run/\\u0085mps"\n', {}, ()), "mps.root"),
        (("plugin.toml", '[events]\nkubeconfig = "/etc/\\tkubelet.conf"\n', {}, ()), "events.kubeconfig"),
        ((None, "", {"KUBELET_SOCKET": "/var/lib/\x01kubelet/kubelet.sock"}, ()), "env KUBELET_SOCKET"),
        ((None, "", {"GPUNODE_SOCKET_DIR": "/var/lib/kubelet\n"}, ()), "env GPUNODE_SOCKET_DIR"),
        ((None, "", {"NVIDIA_DRIVER_ROOT": "/run/\x7fnvidia"}, ()), "env NVIDIA_DRIVER_ROOT"),
        # A flag's bad value is a usage error (exit 2), named as click names it (issue 24).
        ((None, "", {}, ("--socket-dir", "/var/lib/\x1bkubelet")), "'--socket-dir'"),
        ((None, "", {}, ("--mps-root", "/run/\rmps")), "'--mps-root'"),
    ],
)
def test_a_path_setting_with_a_control_character_is_refused_naming_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    setting: Setting,
    named: str,
) -> None:
    file, text, env, flags = setting
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # `plugin run` reads its process's environment
    args: list[str] = ["--show-config", *flags]
    if file is not None:
        (tmp_path / file).write_text(text)
        args += ["--config", f"/{file}"]
    code = main(["plugin", "run", *args], host=Host(root=tmp_path, env=env))
    out, err = capsys.readouterr()
    assert code == (ExitCode.USAGE if flags else ExitCode.CONFIG), (out, err)
    assert named in err
    assert "control character" in err
    assert "fix: give the path without control characters" in err
    assert "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("extra", [(), ("--json",)])
def test_show_config_refuses_an_unknown_simulate_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]
) -> None:
    # `--simulate 2 --show-config` printed the settings and exited 0: the profile was never looked at.
    code, out, err = run(tmp_path, capsys, "--simulate", "2", "--show-config", *extra)
    assert code == ExitCode.USAGE, out + err
    assert "unknown simulation profile '2' (known: dgx-a100, pcie-4" in out + err
    code, out, err = run(tmp_path, capsys, "--simulate", "pcie-4", "--show-config", *extra)
    assert code == ExitCode.OK, err
