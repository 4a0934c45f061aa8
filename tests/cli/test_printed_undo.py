"""The `undo with:` line configure-runtime prints is run as printed, and must undo everything (issue 14).

After a drop-in, with an import glob already in the main file, with --config for CRI-O or docker: the
printed command puts every file back byte for byte, removes what gpunode created, and leaves no record.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import records

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CONTAINERD_1_7 = "containerd github.com/containerd/containerd 1.7.24~ds1 1.7.24~ds1-6+deb13u1\n"
MAIN = "/etc/containerd/config.toml"
DROP_IN = "/etc/containerd/conf.d/99-nvidia.toml"
SYSTEMD_ONLY = (
    "version = 2\n"
    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
    "SystemdCgroup = true\n"
)


def node(root: Path) -> Host:
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], CONTAINERD_1_7)
    return Host(root=root, runner=runner)


def put(root: Path, host_path: str, text: str) -> None:
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the node except gpunode's own state."""
    return {
        "/" + str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not str(p.relative_to(root)).startswith("var/lib/gpunode")
    }


def directories(root: Path) -> set[str]:
    found = {"/" + str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()}
    return {d for d in found if not d.startswith("/var")}  # gpunode's own state lives in /var/lib/gpunode


def configure_then_run_the_printed_undo(
    root: Path, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[dict[str, bytes], dict[str, bytes], dict[str, bytes]]:
    before = snapshot(root)
    dirs_before = directories(root)
    assert main(["configure-runtime", *args, "--no-restart"], host=node(root)) == ExitCode.OK
    out = capsys.readouterr().out
    configured = snapshot(root)
    assert configured != before
    (undo,) = [
        line.removeprefix("undo with: ") for line in out.splitlines() if line.startswith("undo with: ")
    ]
    argv = shlex.split(undo)
    assert argv[0] == "gpunode"
    assert main([*argv[1:], "--no-restart"], host=node(root)) == ExitCode.OK, capsys.readouterr().err
    after = snapshot(root)
    assert not (root / records.RECORDS.lstrip("/")).exists()
    assert not [p for p in (root / "var/lib/gpunode/backups").rglob("*") if p.is_file()]
    assert directories(root) == dirs_before, "a directory gpunode created is left behind"
    return before, configured, after


def test_undo_after_a_drop_in_removes_the_drop_in_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    put(tmp_path, MAIN, SYSTEMD_ONLY)
    before, configured, after = configure_then_run_the_printed_undo(
        tmp_path, capsys, "containerd", "--set-as-default", "--drop-in", DROP_IN, "--config", MAIN
    )
    assert DROP_IN in configured
    assert after == before


def test_undo_when_the_main_file_already_imports_a_glob(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main_text = 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n' + SYSTEMD_ONLY.split("\n", 1)[1]
    put(tmp_path, MAIN, main_text)
    before, configured, after = configure_then_run_the_printed_undo(
        tmp_path, capsys, "containerd", "--set-as-default", "--drop-in", DROP_IN
    )
    assert configured[MAIN] == before[MAIN]  # only the drop-in was written
    assert after == before


def test_undo_of_crio_with_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    put(tmp_path, "/etc/crio/crio.conf", (FIXTURES / "crio/crio.conf").read_text())
    before, configured, after = configure_then_run_the_printed_undo(
        tmp_path, capsys, "crio", "--set-as-default", "--config", "/etc/crio/crio.conf"
    )
    assert "/etc/crio/crio.conf.d/99-nvidia.toml" in configured
    assert after == before


def test_undo_of_docker_with_config_elsewhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    put(tmp_path, "/srv/docker/daemon.json", '{"log-driver": "journald"}\n')
    before, _, after = configure_then_run_the_printed_undo(
        tmp_path, capsys, "docker", "--set-as-default", "--config", "/srv/docker/daemon.json"
    )
    assert after == before


def test_revert_takes_every_file_of_the_runtime_whatever_file_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    put(tmp_path, MAIN, SYSTEMD_ONLY)
    before = snapshot(tmp_path)
    host = node(tmp_path)
    args = ["configure-runtime", "containerd", "--set-as-default", "--drop-in", DROP_IN, "--no-restart"]
    assert main(args, host=host) == ExitCode.OK
    for given in (["--config", MAIN], ["--drop-in", DROP_IN], []):
        capsys.readouterr()
        code = main(["configure-runtime", "containerd", "--revert", "--no-restart", *given], host=host)
        assert code == ExitCode.OK, capsys.readouterr().err
        assert snapshot(tmp_path) == before
        assert main(args, host=host) == ExitCode.OK


def test_a_missing_drop_in_directory_is_planned_created_and_reverted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dry run and the run agree: the directory is created with mode 0755 (as nvidia-ctk does), and the
    revert removes it again while it is empty."""
    put(tmp_path, MAIN, SYSTEMD_ONLY)
    args = ["configure-runtime", "containerd", "--drop-in", DROP_IN, "--config", MAIN, "--no-restart"]
    assert main([*args, "--dry-run"], host=node(tmp_path)) == ExitCode.OK
    assert "will create directory /etc/containerd/conf.d (mode 0755)" in capsys.readouterr().out
    assert not (tmp_path / "etc/containerd/conf.d").exists()
    assert main(args, host=node(tmp_path)) == ExitCode.OK
    assert (tmp_path / "etc/containerd/conf.d").stat().st_mode & 0o777 == 0o755
    assert main(["configure-runtime", "containerd", "--revert", "--no-restart"], host=node(tmp_path)) == 0
    assert not (tmp_path / "etc/containerd/conf.d").exists()


def test_a_config_in_a_missing_directory_is_refused_in_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for extra in (["--dry-run"], []):
        code = main(
            ["configure-runtime", "docker", "--config", "/srv/nowhere/daemon.json", *extra],
            host=node(tmp_path),
        )
        assert code == ExitCode.NOT_FOUND
        err = capsys.readouterr().err
        assert "directory /srv/nowhere does not exist" in err and "mkdir -p /srv/nowhere" in err
        assert "put back" not in err
