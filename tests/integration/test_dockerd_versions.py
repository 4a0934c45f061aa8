"""`gpunode configure-runtime docker` judged by the real dockerd 20.10, 26 and 28.

gpunode writes daemon.json for the dockerd that will read it (it asks that dockerd's `--version`): here a
temp root whose `dockerd` is the test bed's 26 or 28 (tests/testbed.py unpacks them from Debian trixie and
sid) or 20.10 (bookworm's, unpacked too). Every file gpunode writes must pass `dockerd --validate` of 26
and 28, and a dockerd must really start on it and list the runtime — `--validate` alone is not enough: it
passes a runtime that has both a path and a runtimeType, which dockerd then refuses to start on.

Needs the test bed's containerd 1.6, runc and bookworm's docker client (and docker.io's dockerd for 20.10);
all of them and the test bed's dockerd 26 and 28 are fetched by `./install.sh --dev`. In CI (the CI
variable is set) a missing one is a failure.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import testbed
from tests.integration.dockerd import (
    dockerd_refuses,
    record_installed,
    require_docker,
    running_dockerd,
    validate,
    version,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "docker"
DAEMON_JSON = "/etc/docker/daemon.json"
RUNTIME = "/usr/bin/nvidia-container-runtime"
CONFIG_ERROR = 4
BOM = b"\xef\xbb\xbf"
VALIDATORS = ("dockerd-26", "dockerd-28")


@pytest.fixture(scope="module", autouse=True)
def _client_installed() -> None:
    require_docker(dockerd=False)


def dockerd(name: str) -> Path:
    """A dockerd by version, from the test bed: "dockerd-20.10" is bookworm's docker.io."""
    return testbed.binary(name)


@dataclass
class Node:
    """A temp root that gpunode runs on, whose dockerd (the one gpunode asks `--version`) is `reader`."""

    root: Path
    bin: Path

    @property
    def config(self) -> Path:
        return self.root / DAEMON_JSON.lstrip("/")

    def install(self, reader: Path) -> None:
        # gpunode looks for dockerd under its --root and runs the one on PATH: both are `reader`.
        program = self.root / "usr/sbin/dockerd"
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text(f'#!/bin/sh\nexec {shlex.quote(str(reader))} "$@"\n')
        program.chmod(0o755)
        record_installed(self.root, reader)  # what gpunode goes by: it runs no program of the root
        self.bin.mkdir(exist_ok=True)
        (self.bin / "dockerd").unlink(missing_ok=True)
        (self.bin / "dockerd").symlink_to(reader)

    def write(self, data: bytes | None) -> None:
        if data is None:
            self.config.unlink(missing_ok=True)
        else:
            self.config.write_bytes(data)

    def gpunode(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUNODE_")}
        env["PATH"] = f"{self.bin}:{env.get('PATH', '/usr/bin:/bin')}"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpunode",
                "--root",
                str(self.root),
                "configure-runtime",
                "docker",
                "--config",
                DAEMON_JSON,
                "--no-restart",
                *args,
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=120,
            check=False,
        )
        assert "Traceback" not in result.stderr, result.stderr
        return result

    def written(self, *args: str) -> bytes:
        result = self.gpunode(*args)
        assert result.returncode == 0, f"gpunode exited {result.returncode}:\n{result.stderr}"
        return self.config.read_bytes()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    made = Node(tmp_path / "root", tmp_path / "bin")
    (made.root / "etc/docker").mkdir(parents=True)
    return made


def loads(data: bytes) -> dict[str, Any]:
    body = data.removeprefix(BOM)
    doc = json.loads(body) if body.strip() else {}
    assert isinstance(doc, dict)
    return doc


def assert_validated(config: Path) -> None:
    for name in VALIDATORS:
        returncode, said = validate(testbed.binary(name), config)
        assert returncode == 0 and "configuration OK" in said, f"{name} --validate: {said}"


# -- every file gpunode writes: --validate of 26 and 28, and a dockerd 28 that runs on it -------------

UNRELATED = {"log-driver": "json-file", "log-opts": {"max-size": "10m"}, "features": {"buildkit": True}}
# A default runtime with runtimeArgs must exist on disk (dockerd resolves it at start): runc does.
OTHER_RUNTIME = {
    "runtimes": {"runc-debug": {"path": "runc", "runtimeArgs": ["--debug"]}},
    "default-runtime": "runc-debug",
}
INPUTS: dict[str, bytes | None] = {
    "missing": None,
    "zero-bytes": b"",
    "braces": b"{}",
    "unrelated-keys": json.dumps(UNRELATED, indent=4).encode() + b"\n",
    "other-runtime-with-runtimeArgs": json.dumps(OTHER_RUNTIME, indent="\t").encode(),
    # An entry of its own with `args` (a key dockerd ignores) and an old path: it keeps its keys.
    "entry-with-args": json.dumps(
        {"runtimes": {"nvidia": {"path": "/opt/old/nvidia-container-runtime", "args": ["--debug"]}}}
    ).encode(),
    "nvidia-ctk": (FIXTURES / "nvidia-ctk.json").read_bytes(),
    "bom": (FIXTURES / "bom.json").read_bytes(),
    "bom-only": BOM,
}
VARIANTS = {"plain": (), "default-and-cdi": ("--set-as-default", "--cdi")}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(INPUTS))
def test_every_file_gpunode_writes_is_one_dockerd_26_and_28_take(node: Node, name: str, variant: str) -> None:
    original = INPUTS[name]
    args = VARIANTS[variant]
    node.install(testbed.binary("dockerd-28"))
    node.write(original)
    before = loads(original or b"")
    written = node.written("--runtime-path", RUNTIME, *args)

    doc = loads(written)
    assert written.startswith(BOM) == (original or b"").startswith(BOM), "the BOM is kept, never added"
    entry = before.get("runtimes", {}).get("nvidia")
    # A new entry is what dockerd reads, nothing more; an existing one keeps its own keys.
    assert doc["runtimes"]["nvidia"] == ({**entry, "path": RUNTIME} if entry else {"path": RUNTIME})
    for key, value in before.items():
        if key == "runtimes":
            assert {k: doc["runtimes"][k] for k in value if k != "nvidia"} == {
                k: v for k, v in value.items() if k != "nvidia"
            }
        elif key == "features":
            assert {k: doc["features"][k] for k in value} == value
        elif key != "default-runtime" or not args:
            assert doc[key] == value, key

    assert_validated(node.config)
    with running_dockerd(node.config, binary=testbed.binary("dockerd-28")) as daemon:
        runtimes, default = daemon.runtimes()
    # dockerd reads only path (and runtimeArgs): the entry's `args` does not reach it.
    assert runtimes["nvidia"] == {"path": RUNTIME}
    expected_default = "nvidia" if args else before.get("default-runtime", "runc")
    assert default == expected_default
    for other, value in before.get("runtimes", {}).items():
        if other != "nvidia":
            assert runtimes[other]["path"] == value["path"]
            assert runtimes[other].get("runtimeArgs") == value.get("runtimeArgs")


# -- a UTF-8 BOM: kept for the dockerd that reads it, refused with its fix for the one that does not ---


@pytest.mark.parametrize("reader", ["dockerd-26", "dockerd-28"])
def test_a_bom_file_is_configured_for_a_dockerd_that_reads_it(node: Node, reader: str) -> None:
    program = dockerd(reader)
    original = (FIXTURES / "bom.json").read_bytes()
    node.install(program)
    node.write(original)
    written = node.written("--runtime-path", RUNTIME, "--set-as-default")
    assert written.startswith(BOM)
    assert_validated(node.config)
    with running_dockerd(node.config, binary=program) as daemon:
        runtimes, default = daemon.runtimes()
    assert runtimes["nvidia"] == {"path": RUNTIME}
    assert default == "nvidia"

    result = node.gpunode("--revert")
    assert result.returncode == 0, result.stderr
    assert node.config.read_bytes() == original
    with running_dockerd(node.config, binary=program) as daemon:
        runtimes, default = daemon.runtimes()
    assert "nvidia" not in runtimes
    assert default == "runc"


def test_a_bom_file_is_refused_for_dockerd_20_10_which_refuses_it_too(node: Node) -> None:
    program = dockerd("dockerd-20.10")
    assert "version 20.10" in version(program)
    original = (FIXTURES / "bom.json").read_bytes()
    node.install(program)
    node.write(original)

    result = node.gpunode("--runtime-path", RUNTIME, "--set-as-default")
    assert result.returncode == CONFIG_ERROR, result.stderr
    assert "byte order mark" in result.stderr and "dockerd 20.10 refuses" in result.stderr
    assert node.config.read_bytes() == original
    returncode, message = dockerd_refuses(node.config, binary=program)
    assert returncode != 0
    assert "invalid character 'ï' looking for beginning of value" in message, message

    # The fix gpunode gives, run as given (with the path under the temp root), makes a file 20.10 takes.
    fix = result.stderr.split("sed -i ", 1)[1].split(" (or", 1)[0]
    expression, target = shlex.split(fix)
    assert target == DAEMON_JSON
    subprocess.run(["sed", "-i", expression, str(node.config)], check=True, timeout=60)
    assert node.config.read_bytes() == original.removeprefix(BOM)
    node.written("--runtime-path", RUNTIME, "--set-as-default")
    with running_dockerd(node.config, binary=program) as daemon:
        runtimes, default = daemon.runtimes()
    assert runtimes["nvidia"]["path"] == RUNTIME
    assert default == "nvidia"


# -- the facts gpunode's rules rest on, seen with the real daemons -----------------------------------


@pytest.mark.parametrize("reader", ["dockerd-20.10", "dockerd-28"])
def test_dockerd_reads_runtime_args_and_ignores_args(tmp_path: Path, reader: str) -> None:
    config = tmp_path / "daemon.json"
    config.write_text(
        json.dumps(
            {
                "runtimes": {
                    "with-args": {"path": "runc", "args": ["--debug"]},
                    "with-runtime-args": {"path": "runc", "runtimeArgs": ["--debug"]},
                }
            }
        )
    )
    with running_dockerd(config, binary=dockerd(reader)) as daemon:
        runtimes, _ = daemon.runtimes()
    assert runtimes["with-args"] == {"path": "runc"}
    assert runtimes["with-runtime-args"] == {"path": "runc", "runtimeArgs": ["--debug"]}


def test_a_shim_entry_is_refused_where_a_path_would_stop_dockerd(node: Node) -> None:
    program = testbed.binary("dockerd-28")
    original = (FIXTURES / "shim-runtime.json").read_bytes()
    node.install(program)
    node.write(original)
    result = node.gpunode("--runtime-path", RUNTIME)
    assert result.returncode == CONFIG_ERROR, result.stderr
    assert "containerd shim" in result.stderr
    assert node.config.read_bytes() == original

    # What giving it a path would have made: --validate passes it, dockerd does not start on it.
    with_path = loads(original)
    with_path["runtimes"]["nvidia"]["path"] = RUNTIME
    broken = node.root / "with-path.json"
    broken.write_text(json.dumps(with_path))
    assert_validated(broken)
    _, message = dockerd_refuses(broken, binary=program)
    assert "cannot configure both path and runtimeType" in message, message

    # Under another name gpunode adds its runtime next to the shim, and dockerd runs both.
    node.written("--runtime-path", RUNTIME, "--runtime-name", "gpu", "--set-as-default")
    assert_validated(node.config)
    with running_dockerd(node.config, binary=program) as daemon:
        runtimes, default = daemon.runtimes()
    assert runtimes["gpu"] == {"path": RUNTIME}
    assert "nvidia" in runtimes
    assert default == "gpu"
