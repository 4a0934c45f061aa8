"""`doctor --root DIR` runs no program, neither this machine's nor DIR's own (an image being inspected may
be untrusted: its binaries would run as root here); versions come from DIR's package database
(var/lib/dpkg/status), else are unknown, and doctor says where it looked (issue 23, gpunode.runtimes.probe).

Programs of the same names first on PATH log every call as "here"; the programs in DIR log as "root":
there must be no call at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpunode.cli.main import main
from gpunode.host import Host

NAMES = ("nvidia-ctk", "nvidia-container-runtime", "dockerd", "containerd", "crio", "systemctl")
BOM = "\ufeff"


def script(log: Path, who: str, version: str, code: int = 0) -> str:
    return f'#!/bin/sh\necho "{who} $(basename "$0") $*" >> "{log}"\necho "{version}"\nexit {code}\n'


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This machine's programs, first on PATH: each call is logged as "here"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    for name in NAMES:
        program = bin_dir / name
        program.write_text(script(calls, "here", f"{name} version 9.9.9, Docker version 9.9.9"))
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return calls


def in_root(root: Path, log: Path, name: str, version: str, code: int = 0) -> None:
    program = root / "usr/bin" / name
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text(script(log, "root", version, code))
    program.chmod(0o755)


def dpkg(root: Path, **packages: str) -> None:
    """DIR's dpkg database, with these packages installed (name=version)."""
    status = root / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True, exist_ok=True)
    stanzas = ["Package: base-files\nStatus: install ok installed\nVersion: 12.4\n"]
    stanzas += [
        f"Package: {name}\nStatus: install ok installed\nArchitecture: amd64\nVersion: {version}\n"
        "Description: x\n a continuation line: Version: 0.0.1\n"
        for name, version in packages.items()
    ]
    status.write_text("\n".join(stanzas))


def doctor(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, Any]]:
    main(["doctor", "--json"], host=Host(root=root, euid=0))
    doc = json.loads(capsys.readouterr().out)
    return {check["id"]: check for check in doc["checks"]}


def test_toolkit_versions_come_from_the_roots_package_database(
    tmp_path: Path, log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "image"
    in_root(root, log, "nvidia-ctk", "NVIDIA Container Toolkit CLI version 6.6.6")
    in_root(root, log, "nvidia-container-runtime", "NVIDIA Container Runtime version 6.6.6")
    dpkg(root, **{"nvidia-container-toolkit": "1.17.3-1"})
    toolkit = doctor(root, capsys)["toolkit"]
    assert toolkit["summary"] == (
        "nvidia-container-toolkit installed: nvidia-ctk 1.17.3, nvidia-container-runtime 1.17.3"
    )
    assert f"nvidia-ctk 1.17.3-1 per /var/lib/dpkg/status in {root}" in toolkit["detail"]
    assert "gpunode runs no program of the image" in toolkit["detail"]
    assert not log.exists(), log.read_text()  # neither this machine's programs nor the image's


def test_without_a_package_database_the_versions_are_unknown_and_nothing_runs(
    tmp_path: Path, log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "image"
    in_root(root, log, "nvidia-ctk", "NVIDIA Container Toolkit CLI version 1.17.3")
    in_root(root, log, "nvidia-container-runtime", "NVIDIA Container Runtime version 1.17.3")
    toolkit = doctor(root, capsys)["toolkit"]
    assert (
        f"/usr/bin/nvidia-ctk in {root}: version unknown (--root: gpunode runs no program of the image)"
        in (toolkit["detail"])
    )
    assert not log.exists(), log.read_text()


DOCKERD_ANSWERS = {
    # case: (the root's dpkg version of docker, doctor's status, the version doctor names)
    "28": ({"docker-ce": "5:28.0.1-1~debian.12~bookworm"}, "ok", "28.0"),
    "20.10": ({"docker.io": "20.10.24+dfsg1-1+b3"}, "fail", "20.10"),
    "unknown": ({}, "fail", "no version (unknown: judged as refusing)"),
}


@pytest.mark.parametrize("case", DOCKERD_ANSWERS)
def test_docker_is_judged_by_the_roots_package_database_and_says_where(
    tmp_path: Path, log: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    packages, status, said = DOCKERD_ANSWERS[case]
    root = tmp_path / "image"
    in_root(root, log, "dockerd", "Docker version 28.0.1, build x")  # never run, whatever it would say
    dpkg(root, **packages)
    daemon = root / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    runtimes = '{"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}, "default-runtime": "nvidia"}'
    daemon.write_text(BOM + runtimes)
    checks = doctor(root, capsys)
    check = checks["runtime.docker"]
    # The runtimes the root lacks are looked for there only (this machine has them all), and it says so.
    assert checks["runtime.crio"]["summary"] == f"crio is not installed (no crio in {root})"
    assert check["status"] == status, check
    assert (
        "dockerd's version under --root (no program run, this machine's or the image's): " in check["detail"]
    )
    assert f": {said}" in check["detail"]
    if packages:
        assert f"per /var/lib/dpkg/status in {root}" in check["detail"]
    else:
        assert f"/usr/bin/dockerd in {root}: version unknown" in check["detail"]
    assert not log.exists(), log.read_text()
