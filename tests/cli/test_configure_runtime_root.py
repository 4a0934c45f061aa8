"""`configure-runtime` under `--root R` with the real runner: nothing that acts runs on this machine.

The programs are small scripts first on PATH that record every call, in place of this machine's own
systemctl (and of dockerd, containerd, crio, k3s for the version probes): a test fails if gpunode runs one
it must not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from gpunode.runtimes import records

DAEMON_JSON = "/etc/docker/daemon.json"


def program(directory: Path, name: str, script: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def put(root: Path, host_path: str, text: str) -> Path:
    target = root / host_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This machine's programs: a systemctl that records its calls, first on PATH."""
    directory = tmp_path / "this-machine"
    program(directory, "systemctl", f'echo "systemctl $*" >> {tmp_path / "calls"}\n')
    monkeypatch.setenv("PATH", f"{directory}:/usr/bin:/bin")
    return directory


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls"
    return log.read_text().splitlines() if log.exists() else []


def cli(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["configure-runtime", *args], host=Host(root=root))
    out, err = capsys.readouterr()
    return code, out, err


def test_restart_yes_under_root_never_restarts_this_machines_service(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    path = put(root, DAEMON_JSON, "{}\n")
    code, out, err = cli(root, capsys, "docker", "--set-as-default", "--restart", "--yes")
    assert code == ExitCode.OK, err
    assert calls(tmp_path) == []  # not restart, not is-active, not anything
    assert '"default-runtime": "nvidia"' in path.read_text()
    assert f"under --root {root} gpunode restarts nothing on this machine" in out
    assert "run `systemctl restart docker.service` there" in out
    assert "restarted docker.service" not in out and "will run: systemctl" not in out
    assert "never run from here under --root" in out
    # The record keeps the restart pending: the runtime there has not read the change.
    assert records.load(Host(root=root)).restart_pending == {"docker"}


def test_restart_under_root_is_a_next_step_in_the_dry_run_and_the_json(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    put(root, DAEMON_JSON, "{}\n")
    code, out, _ = cli(root, capsys, "docker", "--set-as-default", "--restart", "--dry-run")
    assert code == ExitCode.OK
    assert "would run: systemctl" not in out
    assert "note: under --root" in out and "systemctl restart docker.service` there" in out

    code, out, _ = cli(root, capsys, "docker", "--set-as-default", "--restart", "--yes", "--json")
    assert code == ExitCode.OK
    doc = json.loads(out)
    assert doc["changed"] is True and doc["commands"] == [] and doc["restarted"] is None
    assert doc["restart_pending"] is True
    assert any("systemctl restart docker.service` there" in m for m in doc["messages"])
    assert calls(tmp_path) == []


# -- version probes: no program runs, this machine's or R's; R's package database says ----------------------


def dpkg(root: Path, **packages: str) -> None:
    """R's dpkg database, with these packages installed (name=version)."""
    stanzas = [f"Package: {n}\nStatus: install ok installed\nVersion: {v}\n" for n, v in packages.items()]
    put(root, "/var/lib/dpkg/status", "\n".join(stanzas) or "\n")


def test_no_dockerd_version_in_root_judges_as_the_newest_and_runs_nothing(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # This machine's dockerd is an old one that would refuse the file; R's own is never run either.
    program(
        machine, "dockerd", f'echo "dockerd $*" >> {tmp_path / "calls"}; echo "Docker version 20.10.24"\n'
    )
    root = tmp_path / "root"
    program(root / "usr/bin", "dockerd", f'echo "R dockerd $*" >> {tmp_path / "calls"}\n')
    original = '\ufeff{"cdi-spec-dirs": ["/etc/cdi"]}\n'  # a BOM and a key dockerd 20.10 does not know
    path = put(root, DAEMON_JSON, original)
    code, out, err = cli(root, capsys, "docker", "--no-restart")
    assert code == ExitCode.OK, err
    assert calls(tmp_path) == []
    written = path.read_text()
    assert written.startswith('\ufeff{"cdi-spec-dirs"') and '"nvidia"' in written  # BOM and key kept
    assert "dockerd's version is unknown (--root: gpunode runs no program of the image; " in out
    assert "judged as dockerd 28" in out
    assert f"/usr/bin/dockerd in {root}: version unknown" in out


def test_dockerds_version_comes_from_the_roots_package_database(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program(machine, "dockerd", f'echo "dockerd $*" >> {tmp_path / "calls"}; echo "Docker version 28.5.2"\n')
    root = tmp_path / "root"
    program(root / "usr/bin", "dockerd", f'echo "R dockerd $*" >> {tmp_path / "calls"}\n')
    dpkg(root, **{"docker.io": "20.10.24+dfsg1-1+b3"})
    path = put(root, DAEMON_JSON, '\ufeff{"debug": true}\n')
    code, _, err = cli(root, capsys, "docker", "--no-restart")
    assert code == ExitCode.CONFIG  # R's dockerd 20.10 does not start on a BOM
    assert "which dockerd 20.10 refuses" in err
    assert calls(tmp_path) == []  # neither dockerd ran
    assert path.read_text() == '\ufeff{"debug": true}\n'


def test_unknown_keys_are_not_validated_under_root_and_it_says_so(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    program(root / "usr/bin", "dockerd", f'echo "R dockerd $*" >> {tmp_path / "calls"}; exit 1\n')
    dpkg(root, **{"docker-ce": "5:28.0.1-1~debian.12~bookworm"})
    put(root, DAEMON_JSON, '{"cdi-spec-dirs": ["/etc/cdi"]}\n')
    code, out, err = cli(root, capsys, "docker", "--no-restart")
    assert code == ExitCode.OK, err
    assert "were not checked by `dockerd --validate` (--root: gpunode runs no program of the image)" in out
    assert calls(tmp_path) == []


def test_containerds_version_comes_from_the_roots_package_database(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program(
        machine, "containerd", f'echo "here $*" >> {tmp_path / "calls"}; echo "containerd x 1.6.20 abc"\n'
    )
    root = tmp_path / "root"
    program(root / "usr/bin", "containerd", f'echo "R $*" >> {tmp_path / "calls"}\n')
    dpkg(root, **{"containerd.io": "2.1.4-1"})
    path = put(root, "/etc/containerd/config.toml", "")
    code, out, err = cli(root, capsys, "containerd", "--no-restart")
    assert code == ExitCode.OK, err
    assert path.read_text().startswith("version = 3")  # R's containerd 2.x reads version 3
    assert f"containerd 2.1.4-1 per /var/lib/dpkg/status in {root}" in out
    assert calls(tmp_path) == []


def test_without_a_package_database_containerd_is_unknown_and_nothing_runs(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    program(
        root / "usr/bin", "containerd", f'echo "R $*" >> {tmp_path / "calls"}; echo "containerd x v2.1.4"\n'
    )
    path = put(root, "/etc/containerd/config.toml", "")
    code, out, err = cli(root, capsys, "containerd", "--no-restart")
    assert code == ExitCode.OK, err
    assert path.read_text().startswith("version = 2")  # unknown: what every version reads
    assert f"/usr/bin/containerd in {root}: version unknown (--root: gpunode runs no program" in out
    assert calls(tmp_path) == []


def test_k3s_release_is_never_asked_of_the_roots_program(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    program(root / "usr/local/bin", "k3s", f'echo "R k3s $*" >> {tmp_path / "calls"}\n')
    fixture = Path(__file__).resolve().parent.parent / "fixtures/containerd/k3s/v2-k3s-v1.28.toml"
    put(root, "/var/lib/rancher/k3s/agent/etc/containerd/config.toml", fixture.read_text())
    code, _, err = cli(root, capsys, "containerd", "--no-restart")
    assert calls(tmp_path) == []
    # Unknown, the conservative choice: no base template is assumed, and a copy of k3s's generated file
    # is not edited (k3s would replace it).
    assert code == ExitCode.CONFIG and "k3s (version unknown) has no base template" in err


def test_the_roots_crio_is_never_run(
    tmp_path: Path, machine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `crio config` (CRI-O's own view) ran R's binary, by its path in R, as root on this machine.
    import socket

    root = tmp_path / "root"
    program(root / "usr/bin", "crio", f'echo "R crio $*" >> {tmp_path / "calls"}\n')
    program(root / "usr/bin", "crio-status", f'echo "R crio-status $*" >> {tmp_path / "calls"}\n')
    put(root, "/etc/crio/crio.conf", "")
    (root / "var/run/crio").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as listening:  # a running CRI-O's socket in R
        listening.bind(str(root / "var/run/crio/crio.sock"))
        code, _, err = cli(root, capsys, "crio", "--no-restart")
        assert code == ExitCode.OK, err
        code, _, err = cli(root, capsys, "crio", "--no-restart", "--effective")
        assert code == ExitCode.USAGE and "under --root gpunode runs no program" in err
        main(["doctor", "--json"], host=Host(root=root, euid=0))
        capsys.readouterr()
    assert calls(tmp_path) == []
