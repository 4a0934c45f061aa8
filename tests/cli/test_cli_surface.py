"""The command line as operators and their automation meet it (issue 15): one error format for usage errors,
help that lists exit codes and never loses an option name, plain output off a terminal, colour control,
shell completion, and a start-up that imports neither pydantic nor (off a terminal) rich."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest

from gpunode.cli import main as cli_main
from gpunode.cli.completion import script
from gpunode.cli.doctor import render_plain
from gpunode.doctor import Finding, Report, Status
from gpunode.errors import ExitCode
from tests.conftest import Node

REPO = Path(__file__).resolve().parents[2]
GPUNODE = Path(sys.executable).parent / "gpunode"  # the console script of this virtualenv


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_main.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def every_command() -> Iterator[tuple[str, click.Command]]:
    """(path, command) for the root, every group and every command under it."""
    ctx = click.Context(cli_main.cli, info_name="gpunode")
    todo: list[tuple[str, click.Command]] = [("gpunode", cli_main.cli)]
    while todo:
        path, command = todo.pop(0)
        yield path, command
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None, f"{path} {name}"
                todo.append((f"{path} {name}", sub))


def help_text(path: str, width: int) -> str:
    """The help of `path` as click renders it for a terminal `width` columns wide."""
    names = path.split()[1:]
    root = cli_main.cli
    ctx: click.Context = root.context_class(
        root, info_name="gpunode", terminal_width=width, max_content_width=width
    )
    command: click.Command = root
    for name in names:
        assert isinstance(command, click.Group)
        sub = command.get_command(ctx, name)
        assert sub is not None
        ctx = sub.context_class(sub, info_name=name, parent=ctx)  # gpunode's, with its help formatter
        command = sub
    return command.get_help(ctx)


# -- imports: no pydantic anywhere, rich only for a terminal -------------------------------------------


def modules_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """Top-level packages imported by a fresh interpreter running `code` (stdout a pipe, not a terminal)."""
    probe = (
        f"{code}\n"
        "import sys\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env=env,
    )
    return set(result.stderr.strip().splitlines()[-1].split())


def test_importing_the_cli_imports_neither_pydantic_nor_rich_nor_typer() -> None:
    loaded = modules_after("import gpunode.cli.main")
    assert not loaded & {"pydantic", "pydantic_core", "rich", "typer"}
    assert "click" in loaded


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["doctor", "--help"],
        ["configure-runtime", "--help"],
        ["plugin", "run", "--help"],
        ["plugin", "run", "--replicas", "two"],  # a usage error
        ["doctor"],  # the whole diagnosis, its output a pipe
    ],
    ids=" ".join,
)
def test_a_run_imports_neither_pydantic_nor_rich_off_a_terminal(argv: list[str]) -> None:
    loaded = modules_after(f"from gpunode.cli.main import main\nmain({argv!r})")
    assert not loaded & {"pydantic", "pydantic_core", "rich", "typer"}


def test_configure_runtime_imports_no_pydantic(tmp_path: Path) -> None:
    config = tmp_path / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text((REPO / "tests/fixtures/containerd/default-v2.toml").read_text())
    argv = ["--root", str(tmp_path), "configure-runtime", "containerd", "--dry-run"]
    loaded = modules_after(f"from gpunode.cli.main import main\nassert main({argv!r}) == 0")
    assert not loaded & {"pydantic", "pydantic_core", "rich", "typer"}
    assert "tomlkit" in loaded  # it did the work


def test_help_lists_the_commands_without_importing_them() -> None:
    loaded = modules_after("from gpunode.cli.main import main\nmain(['--help'])")
    assert not any(m in loaded for m in ("grpc", "requests", "yaml", "tomlkit", "pynvml"))
    code = "from gpunode.cli.main import main\nmain(['--help'])\nimport sys\nprint(sorted(sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=120
    )
    for module, _, _ in cli_main.COMMANDS.values():
        assert f"'{module}'" not in result.stdout


def test_the_command_table_matches_each_commands_own_help() -> None:
    ctx = click.Context(cli_main.cli, info_name="gpunode")
    for name, (_, _, short) in cli_main.COMMANDS.items():
        command = cli_main.cli.get_command(ctx, name)
        assert command is not None
        assert command.get_short_help_str(limit=1000) == short, name


# -- usage errors: gpunode's format, exit 2 ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message", "fix"),
    [
        (["plugin", "run", "--replicas", "two"], "'two' is not a valid integer", "gpunode plugin run --help"),
        (
            ["node", "advertise", "--count", "x"],
            "'x' is not a valid integer",
            "gpunode node advertise --help",
        ),
        (["doctor", "--no-such-flag"], "No such option", "gpunode doctor --help"),
        (
            ["toolkit", "install", "--version"],
            "'--version' requires an argument",
            "gpunode toolkit install --help",
        ),
        (["--root"], "'--root' requires an argument", "gpunode --help"),
        (["docter"], "no command 'docter' (did you mean 'doctor'?)", "gpunode --help"),
        (["plugin", "rnu"], "No such command 'rnu'", "gpunode plugin --help"),
        (["doctor", "extra"], "unexpected extra argument", "gpunode doctor --help"),
        (["completion", "tcsh"], "'tcsh' is not one of 'bash', 'zsh', 'fish'", "gpunode completion --help"),
        (["completion"], "Missing argument 'SHELL'", "gpunode completion --help"),
        (["--root", "/nonexistent/root", "doctor"], "'/nonexistent/root' does not exist", "gpunode --help"),
    ],
)
def test_usage_errors_are_one_format_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str, fix: str
) -> None:
    code, out, err = run_main(capsys, *argv)
    assert code == ExitCode.USAGE
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("gpunode: error: ") and message in lines[0]
    assert lines[1] == f"  fix: see `{fix}`"


@pytest.mark.parametrize("argv", [[], ["plugin"], ["toolkit"], ["node"]])
def test_a_group_without_a_command_shows_its_help_and_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run_main(capsys, *argv)
    assert code == ExitCode.USAGE and out == ""
    assert "Commands:" in err
    path = " ".join(["gpunode", *argv])
    assert err.endswith(f"a command is needed\n  fix: run one of the commands above (`{path} --help`)\n")


def test_usage_errors_from_the_installed_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(GPUNODE), "configure-runtime", "containerd", "--restart", "maybe"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == ExitCode.USAGE
    assert result.stderr == (
        "gpunode: error: configure-runtime: Got unexpected extra argument (maybe)\n"
        "  fix: see `gpunode configure-runtime --help`\n"
    )


# -- help ------------------------------------------------------------------------------------------------


def test_every_help_lists_its_exit_statuses_and_no_bool_metavar() -> None:
    for path, _ in every_command():
        text = help_text(path, 80)
        assert "Exit status:" in text, path
        assert re.search(r"^\s+0\s", text, re.MULTILINE), path
        assert "  2    wrong usage" in text, path
        assert "<bool>" not in text.lower() and "BOOLEAN" not in text, path


@pytest.mark.parametrize("width", [30, 50, 200])
def test_option_names_are_never_truncated(width: int) -> None:
    for path, command in every_command():
        text = help_text(path, width)
        for param in command.params:
            for name in [*param.opts, *param.secondary_opts]:
                if isinstance(param, click.Option):
                    assert name in text, f"{path}: {name} at {width} columns"


def test_a_narrow_terminal_gets_each_options_text_under_its_name() -> None:
    for path, _ in every_command():
        text = help_text(path, 40)
        options = text.split("Options:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        for line in options:
            # An option's names on a line of their own (never cut), its text under them within 40 columns.
            under = line.startswith("    ") and not line.startswith("     ") and len(line) <= 40
            assert line.startswith("  -") or under, f"{path}: {line!r}"


def test_help_off_a_terminal_is_not_wrapped(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "configure-runtime", "--help")
    assert code == 0
    line = next(line for line in out.splitlines() if "--effective" in line)
    assert line.rstrip().endswith("and check the result before writing.")  # the whole help on one line
    assert all(line == line.rstrip() for line in out.splitlines())


# -- doctor's output: plain off a terminal, colour on one -------------------------------------------------


def report() -> Report:
    long_summary = "containerd, service active: no nvidia runtime configured " + "x" * 150
    return Report(
        (
            Finding("os.distribution", Status.OK, "Ubuntu 22.04.4 LTS"),
            Finding(
                "runtime.containerd",
                Status.FAIL,
                long_summary,
                "config: /etc/c.toml\nruntimes: runc",
                "fix it",
            ),
            Finding("gpu.persistence", Status.WARN, "persistence mode is off", None, "nvidia-smi -pm 1"),
            Finding("runtime.docker", Status.SKIP, "docker is not installed"),
        )
    )


def test_plain_doctor_output_is_one_finding_per_line() -> None:
    text = render_plain(report())
    lines = text.splitlines()
    assert all(line == line.rstrip() for line in lines)  # no padding at the end of a line
    assert not re.search("[\u2500-\u257f]", text)  # no box drawing
    assert [line for line in lines if "FAIL" in line] == [
        "FAIL    runtime.containerd  containerd, service active: no nvidia runtime configured " + "x" * 150
    ]
    assert lines[0] == "status  check               result"
    assert "ok      os.distribution     Ubuntu 22.04.4 LTS" in lines
    assert "runtime.containerd:\n    config: /etc/c.toml\n    runtimes: runc\n    fix: fix it" in text
    assert "gpu.persistence:\n    fix: nvidia-smi -pm 1" in text
    assert lines[-1] == "1 ok, 1 warn, 1 fail, 1 skip: node is NOT ready for GPU workloads"


def test_doctor_to_a_file_is_plain_and_grep_finds_each_failure(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("no-driver")
    code = cli_main.main(["doctor"], host=node.host())
    out = capsys.readouterr().out
    assert code == ExitCode.UNHEALTHY
    assert "\x1b[" not in out
    failed = [line for line in out.splitlines() if "FAIL" in line]
    assert failed and all(line.startswith("FAIL ") for line in failed)
    assert all(line == line.rstrip() for line in out.splitlines())


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "case",
    [
        (["doctor"], {}, True),
        (["--no-color", "doctor"], {}, False),
        (["doctor"], {"NO_COLOR": "1"}, False),
    ],
    ids=["terminal", "--no-color", "NO_COLOR"],
)
def test_a_terminal_gets_the_table_and_colour_unless_turned_off(
    node: Node,
    fake_nvml: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
    case: tuple[list[str], dict[str, str], bool],
) -> None:
    argv, env, coloured = case
    fake_nvml("no-driver")
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert cli_main.main(argv, host=node.host()) == ExitCode.UNHEALTHY
    out = terminal.getvalue()
    assert "FAIL" in out and "node is NOT ready for GPU workloads" in out
    assert bool(re.search(r"\x1b\[[0-9;]*3[1-3]m|\x1b\[[0-9;]*;3[1-3]", out)) is coloured  # red/green/yellow


# -- shell completion ------------------------------------------------------------------------------------


def completions(words: list[str]) -> list[str]:
    """What bash offers for the last of `words`, through the script `gpunode completion bash` prints."""
    source = subprocess.run(
        [str(GPUNODE), "completion", "bash"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    quoted = " ".join(f"'{w}'" for w in words)
    program = (
        f"{source}\n"
        f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}\n"
        f"_gpunode_completion '{GPUNODE}'\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
        "complete -p gpunode\n"
    )
    result = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True, timeout=120)
    lines = result.stdout.splitlines()
    assert lines[-1] == "complete -o nosort -F _gpunode_completion gpunode"
    return [line for line in lines[:-1] if line]


def test_bash_completes_commands_options_and_arguments() -> None:
    assert completions(["gpunode", "conf"]) == ["configure-runtime"]
    assert completions(["gpunode", "plugin", ""]) == [
        "run",
        "install",
        "uninstall",
        "status",
        "import-config",
        "manifest",
    ]
    assert completions(["gpunode", "configure-runtime", "c"]) == ["containerd", "crio"]
    assert completions(["gpunode", "up", "--runtime", "d"]) == ["docker"]
    assert "--dry-run" in completions(["gpunode", "configure-runtime", "--d"])
    assert completions(["gpunode", "completion", ""]) == ["bash", "zsh", "fish"]
    assert completions(["gpunode", "--no-c"]) == ["--no-color"]


def test_bash_completes_the_plugins_values() -> None:
    assert completions(["gpunode", "plugin", "run", "--mig-strategy", ""]) == ["none", "single", "mixed"]
    assert completions(["gpunode", "plugin", "run", "--mig-strategy", "m"]) == ["mixed"]
    assert completions(["gpunode", "plugin", "run", "--device-list-strategy", "cdi-"]) == [
        "cdi-cri",
        "cdi-annotations",
    ]
    # The last item of the comma-separated list, without the ones already given.
    assert completions(["gpunode", "plugin", "run", "--device-list-strategy", "envvar,"]) == [
        "envvar,volume-mounts",
        "envvar,cdi-cri",
        "envvar,cdi-annotations",
    ]
    assert completions(["gpunode", "plugin", "run", "--simulate", "p"]) == ["pcie-4", "pairs-4"]


def test_bash_script_is_valid_bash(tmp_path: Path) -> None:
    path = tmp_path / "gpunode.bash"
    path.write_text(script(cli_main.cli, "bash"))
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=60)


@pytest.mark.parametrize(
    ("shell", "marker"), [("zsh", "#compdef gpunode"), ("fish", "complete --no-files --command gpunode")]
)
def test_zsh_and_fish_scripts(tmp_path: Path, shell: str, marker: str) -> None:
    text = script(cli_main.cli, shell)
    assert marker in text and "_GPUNODE_COMPLETE" in text
    if shell == "fish":  # a command's help with a comma in it is not cut there
        assert '(string split -m 1 "," $completion)' in text
    if shutil.which(shell):  # not installed on the test machines: the text is checked above either way
        path = tmp_path / f"gpunode.{shell}"
        path.write_text(text)
        subprocess.run([shell, "-n", str(path)], check=True, timeout=60)


def test_zsh_candidates_come_from_gpunode(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the zsh and fish scripts ask: the same protocol, answered by gpunode itself.
    monkeypatch.setenv("_GPUNODE_COMPLETE", "zsh_complete")
    monkeypatch.setenv("COMP_WORDS", "gpunode configure-runtime cr")
    monkeypatch.setenv("COMP_CWORD", "2")
    code, out, _ = run_main(capsys)
    assert code == 0
    assert out.split("\n")[:3] == ["plain", "crio", "_"]


def test_the_completion_command_prints_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "completion", "bash")
    assert code == 0 and out == script(cli_main.cli, "bash")
    assert os.linesep == "\n" and out.endswith("\n")
