"""nvidia-container-toolkit under `--root DIR` (issue 23): no package manager, gpg or systemctl runs on
this machine. `toolkit install|uninstall`, `up` and `down` without --dry-run are refused at the command
line; their dry runs read DIR's files only; and the toolkit's own apply refuses too, before anything is
written, for every caller (up's and down's steps) — the packages are installed from inside DIR.

Stand-ins first on PATH log every call: there must be none.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode, UsageError
from gpunode.host import Host
from gpunode.toolkit import install as toolkit
from gpunode.toolkit.managers import PACKAGES
from tests.cli.test_toolkit_cli import KEY_FPR, OS, key_file

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PROGRAMS = ("apt-get", "apt", "dpkg", "dpkg-query", "dnf", "yum", "zypper", "rpm", "gpg", "systemctl")


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in PROGRAMS:
        program = bin_dir / name
        program.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return log


def image(tmp_path: Path, manager: str = "apt") -> Path:
    root = tmp_path / "image"
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text((FIXTURES / "os-release" / OS[manager]).read_text())
    status = root / "var/lib/dpkg/status"  # dpkg's database, with none of the toolkit's packages
    status.parent.mkdir(parents=True)
    status.write_text("Package: base-files\nStatus: install ok installed\nVersion: 12.4\n\n")
    return root


def files_in(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_toolkit_apply_refuses_under_root_before_writing_anything(tmp_path: Path, calls: Path) -> None:
    root = image(tmp_path)
    host = Host(root=root, euid=0)  # --root DIR: this machine's programs as the runner
    opts = toolkit.InstallOptions(key_file=key_file(tmp_path), key_fingerprint=KEY_FPR)
    plan = toolkit.plan_install(host, opts)
    assert plan.commands and any(f.changed for f in plan.files)  # there is something to do
    before = files_in(root)
    with pytest.raises(UsageError) as refused:
        toolkit.apply_install(host, plan)
    assert f"under --root {root}: gpunode runs no package manager on this machine" in refused.value.message
    assert f"sudo chroot {root} gpunode toolkit install" in (refused.value.fix or "")
    assert files_in(root) == before  # no repository file written, no record of a toolkit not there
    assert not calls.exists(), calls.read_text()


def test_toolkit_uninstall_apply_refuses_under_root(tmp_path: Path, calls: Path) -> None:
    root = image(tmp_path)
    (root / "var/lib/dpkg/status").write_text(
        "".join(f"Package: {name}\nStatus: install ok installed\nVersion: 1.17.8-1\n\n" for name in PACKAGES)
    )
    host = Host(root=root, euid=0)
    plan = toolkit.plan_uninstall(host)
    assert plan.commands
    with pytest.raises(UsageError, match="runs no package manager on this machine"):
        toolkit.apply_uninstall(host, plan)
    assert not calls.exists(), calls.read_text()


@pytest.mark.parametrize("argv", [["toolkit", "install"], ["toolkit", "uninstall"], ["up"], ["down"]])
def test_the_commands_under_root_run_nothing_here(
    tmp_path: Path, calls: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    root = image(tmp_path)
    keyed = ["--key-file", key_file(tmp_path), "--key-fingerprint", KEY_FPR] if argv[-1] == "install" else []
    code = main([*argv, *keyed, "--yes"], host=Host(root=root, euid=0))
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE and "works with --dry-run only" in err, err
    before = files_in(root)
    if argv[-1] == "install":
        code = main([*argv, *keyed, "--dry-run"], host=Host(root=root, euid=0))
        out = capsys.readouterr().out
        assert code == ExitCode.OK and "apt-get install" in out, out
    assert files_in(root) == before
    assert not calls.exists(), calls.read_text()


def test_a_key_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    # open() on a FIFO waits for a writer: `toolkit install --dry-run --key-file FIFO` hung. Run in a child
    # so that a regression fails this test instead of hanging the suite (the limit is a hang guard only).
    import subprocess
    import sys

    root = image(tmp_path)
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    argv = ["--root", str(root), "toolkit", "install", "--dry-run", "--key-file", str(fifo)]
    code = f"import sys; from gpunode.cli.main import main; sys.exit(main({argv!r}))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert result.returncode == 3, result.stderr  # SigningKeyError: nothing written
    assert f"cannot read key file {fifo}: " in result.stderr and "not a regular file" in result.stderr
