"""`configure-runtime RUNTIME --remove`: the nvidia runtime taken out of configuration gpunode did not write
(nvidia-ctk's, a hand-written one), the default put back, and `--revert` undoing the removal (issue 14)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import containerd as ctd
from tests import testbed, tomlread

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"
# daemon.json as `nvidia-ctk runtime configure --runtime=docker --set-as-default` leaves it.
NVIDIA_CTK_DAEMON_JSON = {
    "default-runtime": "nvidia",
    "log-driver": "journald",
    "runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}},
}


def node(root: Path) -> Host:
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], CONTAINERD_1_6)
    return Host(root=root, runner=runner)


def put(root: Path, host_path: str, text: str) -> Path:
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cli(root: Path, *args: str) -> int:
    return main(["configure-runtime", *args, "--no-restart"], host=node(root))


def test_docker_remove_then_revert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    original = json.dumps(NVIDIA_CTK_DAEMON_JSON, indent=4) + "\n"
    path = put(tmp_path, "/etc/docker/daemon.json", original)
    assert cli(tmp_path, "docker", "--remove") == ExitCode.OK
    out = capsys.readouterr().out
    assert "removed runtimes.nvidia" in out and "undo with: " in out
    assert json.loads(path.read_text()) == {"log-driver": "journald"}
    assert cli(tmp_path, "docker", "--revert") == ExitCode.OK
    assert path.read_text() == original


def test_containerd_remove_puts_runc_back_as_default(tmp_path: Path) -> None:
    original = (FIXTURES / "containerd/v2-nvidia-default.toml").read_text()
    path = put(tmp_path, ctd.DEFAULT_CONFIG, original)
    assert cli(tmp_path, "containerd", "--remove") == ExitCode.OK
    doc = tomlread.loads(path.read_text())
    containerd_table = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert containerd_table["default_runtime_name"] == "runc"
    assert "nvidia" not in containerd_table["runtimes"]
    assert "# nvidia is the default so that GPU pods need no runtimeClassName" in path.read_text()
    binary = testbed.binary("containerd-1.6")
    dumped = subprocess.run(
        [binary, "--config", str(path), "config", "dump"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "nvidia" not in dumped
    assert cli(tmp_path, "containerd", "--revert") == ExitCode.OK
    assert path.read_text() == original


def test_containerd_remove_edits_the_imported_drop_in_that_defines_it(tmp_path: Path) -> None:
    main_text = (FIXTURES / "containerd/imports-main.toml").read_text()
    drop_text = (FIXTURES / "containerd/imports-99-nvidia.toml").read_text()
    main_file = put(tmp_path, ctd.DEFAULT_CONFIG, main_text)
    drop_in = put(tmp_path, "/etc/containerd/conf.d/99-nvidia.toml", drop_text)
    assert cli(tmp_path, "containerd", "--remove") == ExitCode.OK
    assert main_file.read_text() == main_text
    doc = tomlread.loads(drop_in.read_text())
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] == "runc"
    assert "nvidia" not in doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"].get("runtimes", {})
    assert cli(tmp_path, "containerd", "--revert") == ExitCode.OK
    assert drop_in.read_text() == drop_text


def test_crio_remove_takes_the_runtime_and_its_default_out_of_the_drop_in(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "crio/crio.conf.d", tmp_path / "etc/crio/crio.conf.d")
    shutil.copy(FIXTURES / "crio/crio.conf", tmp_path / "etc/crio/crio.conf")
    drop_in = tmp_path / "etc/crio/crio.conf.d/99-nvidia.toml"
    before = drop_in.read_text()
    assert "nvidia" in before
    assert cli(tmp_path, "crio", "--remove") == ExitCode.OK
    runtime = tomlread.loads(drop_in.read_text()).get("crio", {}).get("runtime", {})
    assert "nvidia" not in runtime.get("runtimes", {}) and runtime.get("default_runtime") != "nvidia"
    assert cli(tmp_path, "crio", "--revert") == ExitCode.OK
    assert drop_in.read_text() == before


def test_nothing_to_remove_is_exit_6_and_remove_excludes_revert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    put(tmp_path, "/etc/docker/daemon.json", '{"log-driver": "journald"}\n')
    assert cli(tmp_path, "docker", "--remove") == ExitCode.NOT_FOUND
    assert "defines a runtime named 'nvidia'" in capsys.readouterr().err
    assert cli(tmp_path, "docker", "--remove", "--revert") == ExitCode.USAGE


def test_a_partial_revert_keeps_a_bom_that_dockerd_reads(tmp_path: Path) -> None:
    """daemon.json with a UTF-8 BOM (dockerd 23+ reads it), edited after gpunode wrote it: the revert that
    removes only gpunode's keys keeps the BOM, as it keeps the rest of the operator's file."""
    path = put(tmp_path, "/etc/docker/daemon.json", '\ufeff{"log-driver": "journald"}\n')
    put(tmp_path, "/usr/sbin/dockerd", "#!/bin/sh\n").chmod(0o755)  # the node's dockerd, answered below
    runner = ScriptedRunner()
    runner.answer(["dockerd", "--version"], "Docker version 28.5.2+dfsg4, build 3ef3c07\n")
    host = Host(root=tmp_path, runner=runner)
    assert main(["configure-runtime", "docker", "--no-restart"], host=host) == ExitCode.OK
    edited = path.read_text().replace('"journald"', '"local"')
    path.write_text(edited)
    assert main(["configure-runtime", "docker", "--revert", "--no-restart"], host=host) == ExitCode.OK
    text = path.read_text()
    assert text.startswith("\ufeff") and json.loads(text[1:]) == {"log-driver": "local"}
