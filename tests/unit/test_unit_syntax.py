"""Values put into systemd units (gpunode/systemd/unitsyntax.py): what cannot be written is refused as a
usage error naming its option, before any file is written; what can is escaped by systemd's rules (the
real systemd reads them back in tests/integration/test_unit_escaping.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode, UsageError
from gpunode.host import Host, ScriptedRunner
from gpunode.systemd import unitsyntax

INJECTION = "/drv\n[Unit]\nWants=poweroff.target"


@pytest.mark.parametrize("value", ["/a\nb", "/a\0b", "/a\rb", "/a\x7fb", "/a\udcffb", "/a\tb"])
def test_control_characters_and_undecodable_bytes_are_refused_naming_the_option(value: str) -> None:
    with pytest.raises(UsageError) as err:
        unitsyntax.check_value("--driver-root", value)
    assert err.value.message.startswith("--driver-root ") and err.value.fix
    assert err.value.exit_code == ExitCode.USAGE
    with pytest.raises(UsageError):
        unitsyntax.exec_start("/usr/bin/gpunode", ["cdi", value])
    with pytest.raises(UsageError, match="--driver-root"):
        unitsyntax.path_setting("--driver-root", value)


@pytest.mark.parametrize(
    ("word", "written"),
    [
        ("plain/path-1.yaml", "plain/path-1.yaml"),
        ("", '""'),
        ("%n", "%%n"),
        ("$HOME", "$$HOME"),
        ("a b", '"a b"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("a\\b", '"a\\\\b"'),
        ("it's", '"it\'s"'),
        (";", '";"'),
        ("100% $x\\", '"100%% $$x\\\\"'),
    ],
)
def test_exec_start_arguments_are_quoted_and_escaped_for_systemd(word: str, written: str) -> None:
    assert unitsyntax.exec_start("/usr/bin/gpunode", [word]) == f"/usr/bin/gpunode {written}"


def test_path_settings_are_absolute_and_normalised() -> None:
    assert unitsyntax.path_setting("--x", "//drv//100%/lib/") == "/drv/100%%/lib"
    for bad in ("drv", "/drv/../etc", "/drv/./x", " /drv", "/drv "):
        with pytest.raises(UsageError, match="--x"):
            unitsyntax.path_setting("--x", bad)


def test_cdi_install_refuses_a_driver_root_that_would_inject_a_dependency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = ScriptedRunner()
    code = main(
        ["cdi", "install", "--driver-root", INJECTION], host=Host(root=tmp_path, runner=runner, env={})
    )
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE, err
    assert "--driver-root" in err and "fix:" in err and "Traceback" not in err
    assert not (tmp_path / "etc").exists()  # refused before anything was written
    assert runner.calls == []


@pytest.mark.parametrize("option", ["--dev-root", "--output"])
def test_cdi_install_refuses_control_characters_in_any_path_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    code = main(
        ["cdi", "install", option, "/x\n[Unit]"], host=Host(root=tmp_path, runner=ScriptedRunner(), env={})
    )
    assert code == ExitCode.USAGE and option in capsys.readouterr().err
    assert not (tmp_path / "etc").exists()


@pytest.mark.parametrize(
    ("option", "value", "suggested"),
    [
        ("--driver-root", "/a/../etc", "/etc"),
        ("--dev-root", "/a/./b/", "/a/b"),
        ("--driver-root", "//x/..", "/"),
    ],
)
def test_cdi_install_names_the_option_value_and_a_normalised_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, suggested: str
) -> None:
    # It named a path derived from the value (/a/../etc/etc/ld.so.cache) and suggested //etc/etc/ld.so.cache.
    code = main(["cdi", "install", option, value], host=Host(root=tmp_path, runner=ScriptedRunner(), env={}))
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE, err
    assert f"{option} {value.rstrip('/')!r} is not an absolute path without '.' or '..'" in err
    assert f"fix: give {option} as an absolute path, e.g. {suggested}\n" in err
    assert "ld.so.cache" not in err and not (tmp_path / "etc").exists()


def test_plugin_install_refuses_a_doctor_metrics_directory_with_a_newline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = ScriptedRunner()
    host = Host(root=tmp_path, runner=runner, env={}, euid=0)
    code = main(["plugin", "install", "--doctor-metrics", "/m\nExecStartPre=/bin/false"], host=host)
    assert code == ExitCode.USAGE and "--doctor-metrics" in capsys.readouterr().err
    assert [c for c in runner.calls if c[:2] != ("systemctl", "show")] == []
    assert not (tmp_path / "etc").exists()
