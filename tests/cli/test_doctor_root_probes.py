"""`doctor --root DIR` asks DIR's own programs their version, by their path in DIR, never this machine's
(gpunode.runtimes.probe), and says where it looked (issue 23).

Programs of the same names first on PATH log every call as "here"; the programs in DIR log as "root".
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


def doctor(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, Any]]:
    main(["doctor", "--json"], host=Host(root=root, euid=0))
    doc = json.loads(capsys.readouterr().out)
    return {check["id"]: check for check in doc["checks"]}


def test_toolkit_versions_are_the_roots_programs(
    tmp_path: Path, log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "image"
    in_root(root, log, "nvidia-ctk", "NVIDIA Container Toolkit CLI version 1.17.3")
    in_root(root, log, "nvidia-container-runtime", "NVIDIA Container Runtime version 1.17.3")
    checks = doctor(root, capsys)
    toolkit = checks["toolkit"]
    assert toolkit["summary"] == (
        "nvidia-container-toolkit installed: nvidia-ctk 1.17.3, nvidia-container-runtime 1.17.3"
    )
    assert f"/usr/bin/nvidia-ctk in {root}" in toolkit["detail"]
    assert "never this machine's" in toolkit["detail"]
    calls = log.read_text().splitlines()
    assert sorted(calls) == ["root nvidia-container-runtime --version", "root nvidia-ctk --version"]


DOCKERD_ANSWERS = {
    # case: (what the root's dockerd prints, its exit status, doctor's status, the version doctor names)
    "28": ("Docker version 28.0.1, build x", 0, "ok", "28.0"),
    "20.10": ("Docker version 20.10.24, build x", 0, "fail", "20.10"),
    "silent": ("exec format error", 1, "fail", "no version (unknown: judged as refusing)"),
}


@pytest.mark.parametrize("case", DOCKERD_ANSWERS)
def test_docker_is_judged_by_the_roots_dockerd_and_says_where(
    tmp_path: Path, log: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    answer, code, status, said = DOCKERD_ANSWERS[case]
    root = tmp_path / "image"
    in_root(root, log, "dockerd", answer, code)
    daemon = root / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    runtimes = '{"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}, "default-runtime": "nvidia"}'
    daemon.write_text(BOM + runtimes)
    checks = doctor(root, capsys)
    check = checks["runtime.docker"]
    # The runtimes the root lacks are looked for there only (this machine has them all), and it says so.
    assert checks["runtime.crio"]["summary"] == f"crio is not installed (no crio in {root})"
    assert check["status"] == status, check
    asked = (
        f"dockerd's version asked of /usr/bin/dockerd in {root} (under --root, never this machine's dockerd)"
    )
    assert f"{asked}: {said}" in check["detail"]
    assert all(line.startswith("root dockerd ") for line in log.read_text().splitlines()), log.read_text()
