"""The one place errors become exit codes and messages."""

from __future__ import annotations

import pytest

from gpunode.cli import main as cli_main
from gpunode.errors import ExitCode, PermissionDenied
from gpunode.host import Host


def _raise(exc: BaseException) -> None:
    raise exc


def test_gpunode_error_prints_message_and_fix_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    import gpunode.doctor

    monkeypatch.setattr(
        gpunode.doctor,
        "run_doctor",
        lambda host, **kw: _raise(PermissionDenied("cannot read /etc/x", "run as root")),
    )
    code = cli_main.main(["doctor"], host=Host())
    err = capsys.readouterr().err
    assert code == ExitCode.PERMISSION
    assert err == "gpunode: error: cannot read /etc/x\n  fix: run as root\n"


def test_debug_adds_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpunode.doctor

    monkeypatch.setattr(
        gpunode.doctor, "run_doctor", lambda host, **kw: _raise(PermissionDenied("nope", "sudo"))
    )
    code = cli_main.main(["--debug", "doctor"], host=Host())
    err = capsys.readouterr().err
    assert code == ExitCode.PERMISSION
    assert "Traceback" in err and "gpunode: error: nope" in err


def test_a_bug_is_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpunode.doctor

    monkeypatch.setattr(gpunode.doctor, "run_doctor", lambda host, **kw: _raise(KeyError("oops")))
    code = cli_main.main(["doctor"], host=Host())
    err = capsys.readouterr().err
    assert code == ExitCode.INTERNAL
    assert "internal error: KeyError" in err and "--debug" in err and "Traceback" not in err


def test_ctrl_c(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import gpunode.doctor

    monkeypatch.setattr(gpunode.doctor, "run_doctor", lambda host, **kw: _raise(KeyboardInterrupt()))
    assert cli_main.main(["doctor"], host=Host()) == ExitCode.INTERRUPTED


def test_documented_values() -> None:
    assert (int(ExitCode.PERMISSION), int(ExitCode.INTERNAL), int(ExitCode.INTERRUPTED)) == (5, 70, 130)


def test_exit_codes_are_distinct() -> None:
    values = [int(c) for c in ExitCode]
    assert len(values) == len(set(values))


def test_the_command_modules_do_not_import_main() -> None:
    """Shared CLI state lives in cli/state.py: main imports the command modules, never the other way round."""
    from pathlib import Path

    cli = Path(cli_main.__file__).parent
    for path in sorted(cli.glob("*.py")):
        if path.name in ("main.py", "entry.py"):  # entry.py is the console script that runs main
            continue
        text = path.read_text()
        assert "gpunode.cli.main" not in text and "from gpunode.cli import main" not in text, path.name


def test_ctrl_c_at_a_prompt_is_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import click

    import gpunode.doctor

    # click.confirm turns Ctrl-C at its prompt into Abort: the same quiet 130 as a KeyboardInterrupt.
    monkeypatch.setattr(gpunode.doctor, "run_doctor", lambda host, **kw: _raise(click.exceptions.Abort()))
    assert cli_main.main(["doctor"], host=Host()) == ExitCode.INTERRUPTED
    assert capsys.readouterr().err == "gpunode: interrupted\n"


def test_a_commands_exit_status_passes_through(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpunode.doctor
    from gpunode.doctor import Finding, Report, Status

    failed = Report((Finding("driver.module", Status.FAIL, "no driver", None, "install it"),))
    monkeypatch.setattr(gpunode.doctor, "run_doctor", lambda host, **kw: failed)
    assert cli_main.main(["doctor"], host=Host()) == ExitCode.UNHEALTHY
    assert "FAIL    driver.module  no driver" in capsys.readouterr().out
