"""A usage error is reported before anything else is tried (issue 24): a bad argument is exit 2 in click's
form even on a node where NVML cannot be used and a command would otherwise fail there first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cdi", "generate", "--kind", "bad_kind"], "cdi generate: Invalid value for '--kind': CDI kind "
         "'bad_kind' must be vendor/class, e.g. nvidia.com/gpu"),
        (["cdi", "generate", "--kind", "nvidia.com/-gpu"],
         "cdi generate: Invalid value for '--kind': CDI class"),
        (["cdi", "generate", "--output", "spec.yaml"],
         "cdi generate: Invalid value for '--output': 'spec.yaml' is not an absolute path"),
        (["cdi", "generate", "--driver-root", "driver"],
         "cdi generate: Invalid value for '--driver-root': 'driver' is not an absolute path"),
        (["cdi", "check", "--kind", "bad_kind"], "cdi check: Invalid value for '--kind'"),
        (["cdi", "install", "--dev-root", "dev"], "cdi install: Invalid value for '--dev-root'"),
        (["cdi", "uninstall", "--kind", "bad_kind"], "cdi uninstall: Invalid value for '--kind'"),
    ],
)  # fmt: skip
def test_a_bad_argument_is_said_before_nvml_is_tried(
    args: list[str],
    message: str,
    tmp_path: Path,
    fake_nvml: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_nvml(profile="no-driver")  # what the command would otherwise fail on first (exit 7)
    runner = ScriptedRunner()
    assert main(args, host=Host(root=tmp_path, runner=runner, euid=0)) == ExitCode.USAGE
    first, fix = capsys.readouterr().err.splitlines()
    assert first.startswith(f"gpunode: error: {message}")
    assert fix == f"  fix: see `gpunode {' '.join(args[:2])} --help`"
    assert runner.calls == [] and list(tmp_path.iterdir()) == []  # nothing run, nothing written
