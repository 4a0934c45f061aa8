"""`gpunode plugin run` parsed without click (gpunode/plugin/argv.py): the same settings as the click command
for every option, the click CLI for anything else, and the CLI's error format and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from gpunode.plugin import argv
from gpunode.plugin.config import OPTIONS, is_switch

REPO = Path(__file__).resolve().parents[2]


# A good value for each option that takes one (a bad flag value is refused as a usage error, both ways in).
GOOD = {
    "resource_name": "example.com/gpu",
    "mig_strategy": "mixed",
    "device_list_strategy": "envvar,cdi-cri",
    "device_id_strategy": "index",
    "driver_root": "/run/nvidia/driver",
    "socket_dir": "/tmp/dp",
    "cdi_kind": "example.com/gpu",
    "replicas": "4",
    "placement": "packed",
    "shared_resources": '[{"name": "nvidia.com/gpu", "replicas": 2}]',
    "gpu_resources": '[{"pattern": "*A100*", "name": "a100"}]',
    "mig_resources": '[{"pattern": "1g.*", "name": "mig-small"}]',
    "dev_root": "/",
    "cdi_annotation_prefix": "cdi.k8s.io/",
    "imex_channel_ids": "0",
    "mps_resources": "[]",
    "mps_root": "/run/nvidia/mps",
    "mps_active_thread_percentage": "50",
    "mps_pinned_memory_limit": "10G",
    "health.ignored_xids": "13,31",
    "health.critical_xids": "48",
    "health.recovery_quiet_period": "2.5",
    "metrics_address": "127.0.0.1:9402",
    "events_kubeconfig": "/etc/kubernetes/kubelet.conf",
    "node_name": "node-1",
}


def every_option() -> list[str]:
    args: list[str] = []
    for option in OPTIONS:
        if is_switch(option):
            args.append(option.flag)
        else:
            args += [option.flag, GOOD[option.name]]
    return args


def through_click(args: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_run_plugin(host: Host, **kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr("gpunode.plugin.runner.run_plugin", fake_run_plugin)
    assert main(["plugin", "run", *args]) == 0
    return seen


@pytest.mark.parametrize(
    "args",
    [
        [],
        every_option(),
        [f"--no-{o.flag.removeprefix('--')}" for o in OPTIONS if is_switch(o)],
        ["--config", "/etc/p.toml", "--simulate", "dgx-a100", "--status-file", "/run/s.json"],
        ["--config=/etc/p.toml", "--replicas=8", "--mig-strategy=mixed", "--ignored-xids=13,31"],
        ["--replicas", "2", "--replicas", "3", "--health-checks", "--no-health-checks"],  # the last wins
        ["--dev-root", ""],
    ],
)
def test_the_same_settings_as_the_click_command(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = argv.parse(args)
    assert parsed is not None
    clicked = through_click(args, monkeypatch)
    assert parsed.config == clicked["config_path"]
    assert parsed.simulate == clicked["simulate"]
    assert parsed.status_file == clicked["status_file"]
    assert parsed.flags == {k: v for k, v in clicked["flags"].items() if v is not None}


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["-h"],
        ["--show-config"],
        ["--json"],
        ["--replicas", "two"],
        ["--replicas", "-1"],
        ["--replicas"],
        ["--config"],
        ["--resource-name", "--mig-strategy"],
        ["--bogus"],
        ["--resource"],  # an abbreviation: click refuses it, so must this
        ["extra"],
        ["--pass-device-specs=true"],
        ["--debug"],
    ],
)
def test_anything_else_goes_to_click(args: list[str]) -> None:
    assert argv.parse(args) is None


def gpunode(*args: str) -> subprocess.CompletedProcess[str]:
    """The console script's way in (gpunode/cli/entry.py), in a fresh interpreter; says if click loaded."""
    code = (
        "import sys\n"
        f"sys.argv = ['gpunode', *{list(args)!r}]\n"
        "from gpunode.cli.entry import run\n"
        "try:\n"
        "    run()\n"
        "finally:\n"
        "    print('click loaded' if 'click' in sys.modules else 'no click')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--config", "/nonexistent/plugin.toml"], ExitCode.NOT_FOUND),
        (["--simulate", "dgx-z"], ExitCode.USAGE),
        (["--mig-strategy", "all"], ExitCode.USAGE),
    ],
)
def test_errors_read_as_the_clis(args: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    fast = gpunode("plugin", "run", *args)
    assert fast.returncode == code, fast.stderr
    assert fast.stdout.strip() == "no click"
    assert main(["plugin", "run", *args]) == code
    assert fast.stderr == capsys.readouterr().err


def test_what_it_does_not_take_still_works() -> None:
    shown = gpunode("plugin", "run", "--replicas", "two")
    assert shown.returncode == ExitCode.USAGE
    assert "plugin run: Invalid value for '--replicas': 'two' is not a valid integer" in shown.stderr
    assert shown.stdout.strip() == "click loaded"


@pytest.mark.parametrize(
    ("args", "message", "fix"),
    [
        (["--replicas", "0"], "Invalid value for '--replicas': 0 is not a whole number of at least 1",
         "give a whole number from 1 to 1024"),
        (["--mig-strategy", "bogus"], "Invalid value for '--mig-strategy': 'bogus' is not one of: none, "
         "single, mixed", "use one of: none, single, mixed"),
        (["--socket-dir", "rel"], "Invalid value for '--socket-dir': 'rel' is not an absolute path",
         "give a path that starts with /"),
        # Said before anything is read: not "the --config file does not exist" (6).
        (["--config", "/nonexistent/plugin.toml", "--replicas=2000"],
         "Invalid value for '--replicas': 2000 replicas per GPU is more than 1024", "use at most 1024"),
    ],
)  # fmt: skip
def test_a_bad_flag_value_is_a_usage_error_as_clicks(
    args: list[str], message: str, fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 with click's wording and a fix line, as every other command's bad flag; the flag named once;
    the same from the daemon's fast parser, from the click command and with --show-config."""
    fast = gpunode("plugin", "run", *args)
    assert fast.returncode == ExitCode.USAGE, fast.stderr
    assert fast.stdout.strip() == "no click"
    first, fix_line = fast.stderr.splitlines()
    assert first == f"gpunode: error: plugin run: {message}"
    assert first.count(args[-1].split("=")[0] if "=" in args[-1] else args[-2]) == 1
    assert fix_line.startswith(f"  fix: {fix}")
    assert fix_line.endswith("(see `gpunode plugin run --help`)")
    assert main(["plugin", "run", *args]) == ExitCode.USAGE
    assert capsys.readouterr().err == fast.stderr
    assert main(["plugin", "run", "--show-config", *args]) == ExitCode.USAGE
    assert capsys.readouterr().err == fast.stderr


def test_a_bad_value_from_the_environment_or_the_file_stays_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    host = Host(root=tmp_path, env={})
    monkeypatch.setenv("GPUNODE_REPLICAS", "0")
    assert main(["plugin", "run", "--show-config"], host=host) == ExitCode.CONFIG
    assert "GPUNODE_REPLICAS" in capsys.readouterr().err
    monkeypatch.delenv("GPUNODE_REPLICAS")
    (tmp_path / "p.toml").write_text('mig-strategy = "bogus"\n')
    assert main(["plugin", "run", "--show-config", "--config", "/p.toml"], host=host) == ExitCode.CONFIG
    assert "mig-strategy (file /p.toml)" in capsys.readouterr().err
