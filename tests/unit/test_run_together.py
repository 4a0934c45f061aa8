"""Host.run_together, and doctor's containerd reading through it (issue 24, speed): `containerd --version`
and `containerd config dump` run side by side, and read-only TOML is read by tomllib.

Concurrency is shown by synchronisation, not by time: each command waits until the other has started, which
only commands running at the same time can both do (a wait that gives up fails the test, never hangs it).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from gpunode.errors import CommandFailed, ConfigError
from gpunode.host import CommandResult, Host
from gpunode.runtimes import containerd
from gpunode.runtimes.tomlread import read_toml

GIVE_UP = 20.0  # seconds a command waits for its partner before calling the run sequential


class Rendezvous:
    """A runner whose commands each wait for every other command to have started."""

    def __init__(self, answers: Mapping[str, CommandResult | Exception], parties: int) -> None:
        self.answers = answers
        self.barrier = threading.Barrier(parties)
        self.calls: list[tuple[tuple[str, ...], float]] = []

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult:
        self.calls.append((tuple(argv), timeout))
        try:
            self.barrier.wait(GIVE_UP)
        except threading.BrokenBarrierError:
            raise AssertionError(f"{argv} ran alone: the commands were not run together") from None
        for word, answer in self.answers.items():
            if word in argv:
                if isinstance(answer, Exception):
                    raise answer
                return CommandResult(tuple(argv), answer.returncode, answer.stdout, answer.stderr)
        raise AssertionError(f"unexpected command {argv}")


def ok(stdout: str, stderr: str = "", code: int = 0) -> CommandResult:
    return CommandResult((), code, stdout, stderr)


def test_run_together_runs_at_once_and_answers_in_order() -> None:
    failed = CommandFailed("`b` is not installed (not found on PATH)")
    runner = Rendezvous({"a": ok("A"), "b": failed, "c": ok("C", code=3)}, parties=3)
    answers = Host(runner=runner).run_together([(["a"], 1.0), (["b"], 2.0), (["c"], 3.0)])
    first, second, third = answers
    assert isinstance(first, CommandResult) and first.stdout == "A"
    assert second is failed  # a command that cannot run is an answer, not an exception
    assert isinstance(third, CommandResult) and third.returncode == 3
    assert sorted(runner.calls) == [(("a",), 1.0), (("b",), 2.0), (("c",), 3.0)]  # each its own timeout


def test_run_together_raises_a_runner_bug() -> None:
    runner = Rendezvous({"a": ok("A"), "b": RuntimeError("a bug in the runner")}, parties=2)
    with pytest.raises(RuntimeError, match="a bug in the runner"):
        Host(runner=runner).run_together([(["a"], 1.0), (["b"], 1.0)])


def test_run_together_of_nothing_and_of_one() -> None:
    assert Host(runner=Rendezvous({}, parties=1)).run_together([]) == []
    (only,) = Host(runner=Rendezvous({"a": ok("A")}, parties=1)).run_together([(["a"], 1.0)])
    assert isinstance(only, CommandResult) and only.stdout == "A"


DUMP = """version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "nvidia"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
  BinaryName = "/usr/bin/nvidia-container-runtime"
  SystemdCgroup = true
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = true
"""


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A containerd program on PATH (never run: the runner answers) and a config file, on the real root."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "containerd"
    program.write_text("#!/bin/sh\nexit 99\n")
    program.chmod(0o755)
    config = tmp_path / "config.toml"
    config.write_text(DUMP)
    return config, {"PATH": str(bin_dir)}


def test_doctor_asks_containerd_version_and_dump_together(node: tuple[Path, dict[str, str]]) -> None:
    config, env = node
    runner = Rendezvous(
        {"--version": ok("containerd github.com/containerd/containerd 1.7.24 abc"), "dump": ok(DUMP)}, 2
    )
    state = containerd.read_state(Host(runner=runner, env=env), str(config), effective=True)
    program = str(Path(env["PATH"]) / "containerd")
    assert sorted(runner.calls) == sorted(
        [
            ((program, "--version"), containerd.VERSION_TIMEOUT),
            ((program, "--config", str(config), "config", "dump"), containerd.DUMP_TIMEOUT),
        ]
    )
    assert state.nvidia_runtime == "nvidia" and state.nvidia_is_default and not state.problems
    assert "as containerd itself reads it (`containerd config dump`)" in state.notes


def test_a_dump_containerd_refuses_is_a_problem_and_the_version_still_counts(
    node: tuple[Path, dict[str, str]],
) -> None:
    config, env = node
    config.write_text('version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd]\n')
    refused = ok("", "containerd: invalid configuration", code=1)
    runner = Rendezvous({"--version": ok("containerd containerd.io 1.6.33 abc"), "dump": refused}, 2)
    state = containerd.read_state(Host(runner=runner, env=env), str(config), effective=True)
    # 1.6 with a version 3 file: the version answer, run beside the dump, is what judged the file.
    assert any("version 3 file but containerd 1.6 is installed" in p for p in state.problems)
    assert any("containerd itself cannot read" in p for p in state.problems)


def test_a_dump_that_cannot_run_raises_as_before(node: tuple[Path, dict[str, str]]) -> None:
    config, env = node
    stopped = CommandFailed("`containerd config dump` did not finish within 30 s and was stopped")
    runner = Rendezvous({"--version": ok("containerd 1.7.24"), "dump": stopped}, 2)
    with pytest.raises(CommandFailed, match="did not finish"):
        containerd.read_state(Host(runner=runner, env=env), str(config), effective=True)


def test_read_toml_names_line_and_column_of_invalid_toml() -> None:
    with pytest.raises(ConfigError) as caught:
        read_toml('version = 2\n[plugins\nx = "y"\n', "/etc/containerd/config.toml")
    assert "/etc/containerd/config.toml is not valid TOML" in caught.value.message
    assert "line 2" in caught.value.message


def test_read_toml_reads_a_layout_tomlkit_cannot_parse() -> None:
    # A table's sub-tables split around another table after an indented header (tomlkit's
    # OutOfOrderTableProxy): valid TOML, read as containerd reads it.
    text = "[a.b]\nx = 1\n[c]\ny = 2\n  [a.d]\n  z = 3\n"
    assert read_toml(text, "f.toml") == {"a": {"b": {"x": 1}, "d": {"z": 3}}, "c": {"y": 2}}


def test_reading_containerd_config_does_not_import_tomlkit(tmp_path: Path) -> None:
    """doctor only reads: tomlkit (the editors' parser, ~15 ms to import, ~10x tomllib's parse time on a
    stock config) must not be loaded for it."""
    config = tmp_path / "config.toml"
    config.write_text(DUMP)
    code = (
        "import sys\n"
        "from gpunode.host import Host\n"
        "from gpunode.runtimes import containerd\n"
        f"state = containerd.read_state(Host(env={{'PATH': ''}}), {str(config)!r})\n"
        "assert state.nvidia_runtime == 'nvidia', state\n"
        "print('tomlkit' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
