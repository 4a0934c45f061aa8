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


def every_option() -> list[str]:
    values = {"replicas": "4", "health.recovery_quiet_period": "2.5", "socket_dir": "/tmp/dp"}
    args: list[str] = []
    for option in OPTIONS:
        if is_switch(option):
            args.append(option.flag)
        else:
            args += [option.flag, values.get(option.name, "x")]
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
        ["--resource-name", ""],
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
        (["--mig-strategy", "all"], ExitCode.CONFIG),
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
