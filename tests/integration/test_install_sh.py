"""install.sh for real: into a temp prefix, twice (idempotent), then uninstalled; and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gpunode import __version__

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "install.sh"


def run(
    *args: str,
    timeout: float = 600,
    user: int | None = None,
    systemd_dir: Path | None = None,
    completion_root: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    argv = ["bash", str(INSTALL), *args]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    # A private unit directory: the host's own /etc/systemd/system never decides a test's outcome.
    env = {**os.environ, "GPUNODE_SYSTEMD_DIR": str(systemd_dir or Path("/nonexistent/systemd"))}
    # Nor do the host's shell completion directories: a root that does not exist means no completion.
    env["GPUNODE_COMPLETION_ROOT"] = str(completion_root or Path("/nonexistent/completion-root"))
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, cwd="/", env=env
    )


def test_install_reinstall_and_uninstall(tmp_path: Path) -> None:
    prefix, bindir, shells = tmp_path / "opt/gpunode", tmp_path / "bin", tmp_path / "shells"
    # An empty directory that was there before: --uninstall must leave it, empty or not.
    (shells / "usr/share/fish").mkdir(parents=True)
    first = run("--prefix", str(prefix), "--bin-dir", str(bindir), completion_root=shells)
    assert first.returncode == 0, first.stderr + first.stdout
    assert "creating a virtualenv" in first.stdout
    link = bindir / "gpunode"
    assert link.is_symlink() and os.readlink(link) == str(prefix / "bin/gpunode")
    completions = [
        shells / "usr/share/bash-completion/completions/gpunode",
        shells / "usr/local/share/zsh/site-functions/_gpunode",
        shells / "usr/share/fish/vendor_completions.d/gpunode.fish",
    ]
    for shell, path in zip(("bash", "zsh", "fish"), completions, strict=True):
        assert f"installed {shell} completion: {path}" in first.stdout
        assert path.stat().st_mode & 0o777 == 0o644 and "_GPUNODE_COMPLETE" in path.read_text(), path
    # bash's installed script, sourced as bash-completion would, completes from the installed gpunode.
    program = (
        f"source {completions[0]}\n"
        "COMP_WORDS=(gpunode configure-runtime c); COMP_CWORD=2\n"
        f"_gpunode_completion {link}\n"
        'echo "${COMPREPLY[@]}"\n'
    )
    bash = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True, timeout=120)
    assert bash.stdout == "containerd crio\n"

    version = subprocess.run([str(link), "--version"], capture_output=True, text=True, check=True, timeout=60)
    # The commit install.sh installed from, stamped into the package (not git at every start).
    commit = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    assert version.stdout == f"gpunode {__version__} (build {commit})\n"
    doctor = subprocess.run(
        [str(link), "doctor", "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert doctor.returncode in (0, 1), doctor.stderr
    assert json.loads(doctor.stdout)["schema"] == "gpunode.doctor/v1"

    second = run("--prefix", str(prefix), "--bin-dir", str(bindir), completion_root=shells)
    assert second.returncode == 0, second.stderr
    assert "reusing the virtualenv" in second.stdout
    assert all(p.is_file() for p in completions) and not list(shells.rglob(".gpunode-completion.*"))

    units = tmp_path / "systemd"
    units.mkdir()
    (units / "gpunode-device-plugin.service").write_text(
        f"[Service]\nExecStart={prefix}/bin/gpunode plugin run\n"
    )
    refused = run("--uninstall", "--prefix", str(prefix), "--bin-dir", str(bindir), systemd_dir=units)
    assert refused.returncode == 1
    assert "the gpunode device plugin service is still installed" in refused.stderr
    assert "fix: undo what gpunode did first: gpunode down --dry-run, then gpunode down" in refused.stderr
    assert link.is_symlink() and prefix.exists()

    (units / "gpunode-device-plugin.service").unlink()
    foreign = shells / "usr/share/bash-completion/completions/other"
    foreign.write_text("complete -F _other other\n")
    gone = run(
        "--uninstall",
        "--prefix",
        str(prefix),
        "--bin-dir",
        str(bindir),
        systemd_dir=units,
        completion_root=shells,
    )
    assert gone.returncode == 0, gone.stderr
    assert not link.exists() and not link.is_symlink() and not prefix.exists()
    assert not any(p.exists() for p in completions) and foreign.exists()
    # The directories install.sh made for the scripts are gone once empty; the foreign script keeps bash's,
    # and the directory that was there before stays.
    left = sorted(str(p.relative_to(shells)) for p in shells.rglob("*"))
    assert left == [
        "usr",
        "usr/share",
        "usr/share/bash-completion",
        "usr/share/bash-completion/completions",
        "usr/share/bash-completion/completions/other",
        "usr/share/fish",
    ]
    assert "removed the empty directory " + str(shells / "usr/local/share/zsh/site-functions") in gone.stdout


def test_refuses_to_replace_a_foreign_command(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "gpunode").write_text("#!/bin/sh\necho someone else's\n")
    proc = run("--prefix", str(tmp_path / "venv"), "--bin-dir", str(bindir))
    assert proc.returncode == 1
    assert "exists and is not a link made by install.sh" in proc.stderr
    assert (bindir / "gpunode").read_text().startswith("#!/bin/sh")


def test_not_root_gets_a_clear_message(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("this test switches to another user and needs root, as CI runs")
    proc = run("--prefix", "/opt/gpunode-test-not-root", user=65534)
    assert proc.returncode == 1
    assert "install.sh: error: installing /opt/gpunode-test-not-root needs root" in proc.stderr
    assert "sudo ./install.sh" in proc.stderr
    assert not Path("/opt/gpunode-test-not-root").exists()


def test_too_old_python(tmp_path: Path) -> None:
    old = tmp_path / "python3.8"
    old.write_text('#!/bin/sh\ncase "$2" in *print*) echo 3.8 ;; *) exit 1 ;; esac\n')
    old.chmod(0o755)
    proc = run("--python", str(old), "--prefix", str(tmp_path / "venv"), "--no-link")
    assert proc.returncode == 1
    assert f"gpunode needs Python >= 3.10, but {old} is 3.8" in proc.stderr
    assert "fix:" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_unknown_option() -> None:
    proc = run("--frobnicate")
    assert proc.returncode == 1 and "unknown option: --frobnicate" in proc.stderr
