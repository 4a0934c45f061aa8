"""The Containerfile's image, and the plugin in it registering with a kubelet through a mounted directory.

With podman or buildah on the PATH the image is built from the Containerfile and its entry point run with
`--help`. Without one (this test bed: no container build tool, and no registry to pull the base image
from), the Containerfile itself is carried out in an image-like root: a fresh overlay of this machine's /
(tests/integration/overlayroot.py) stands in for the slim Python base, the build context is copied in as
the COPY says (honouring .containerignore), its RUN lines run there under systemd-nspawn (pip from PyPI,
as in a real build), /src is removed as the final stage leaves it out, and the ENTRYPOINT runs with the
Containerfile's ENV. Any instruction this stand-in does not know fails the test, so the two cannot drift.

Then the plugin runs in that root as the DaemonSet runs it: the environment and mounts are read from
`gpunode plugin manifest`'s DaemonSet (kubelet's device-plugins directory -> the fake kubelet's directory,
the driver root -> a directory holding the fake libnvidia-ml.so.1, the ConfigMap's plugin.toml, the status
emptyDir); it registers with the fake kubelet on the host, serves Allocate, and the liveness probe's own
command exits 0 while it is registered and 1 once it is gone.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.cli.main import main
from gpunode.host import Host
from tests import fakenvml
from tests.integration import nspawn, overlayroot
from tests.integration.kubelet import FakeKubelet
from tests.integration.pluginproc import short_tempdir

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "Containerfile"
IGNORE = REPO / ".containerignore"
GPU = "nvidia.com/gpu"
# pip installs gpunode and its dependencies from PyPI; on the shared 2-core machines that can be slow.
INSTALL_TIMEOUT = 600.0


@dataclass
class Containerfile:
    """What the build does, per stage: the instructions this test carries out, in order."""

    stages: list[list[tuple[str, str]]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)


def parse_containerfile(text: str) -> Containerfile:
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    parsed = Containerfile()
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            parsed.stages.append([])
        elif instruction in ("COPY", "RUN"):
            parsed.stages[-1].append((instruction, rest.strip()))
        elif instruction == "ENV":
            for word in shlex.split(rest):
                name, _, value = word.partition("=")
                parsed.env[name] = value
        elif instruction == "ENTRYPOINT":
            parsed.entrypoint = json.loads(rest)
        else:
            raise AssertionError(f"the Containerfile's {instruction} is not carried out by this test: add it")
    return parsed


def ignored(relative: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatch(relative, p)
        or fnmatch.fnmatch(relative, p.removeprefix("**/"))
        or fnmatch.fnmatch(Path(relative).name, p.removeprefix("**/"))
        for p in patterns
    )


def copy_context(destination: Path) -> None:
    patterns = [
        line.strip() for line in IGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    for directory, subdirs, files in os.walk(REPO):
        rel_dir = os.path.relpath(directory, REPO)
        subdirs[:] = [d for d in subdirs if not ignored(os.path.normpath(os.path.join(rel_dir, d)), patterns)]
        for name in [d for d in subdirs if os.path.islink(os.path.join(directory, d))]:
            # A link to a directory (templates -> gpunode/templates) is copied as the link, as COPY does.
            subdirs.remove(name)
            target = destination / rel_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.readlink(os.path.join(directory, name)))
        for name in files:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if ignored(rel, patterns):
                continue
            target = destination / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(directory, name), target, follow_symlinks=False)


def build_tool() -> str | None:
    for tool in ("podman", "buildah"):
        if shutil.which(tool):
            return tool
    return None


@pytest.fixture(scope="module")
def image_root() -> Iterator[tuple[overlayroot.OverlayRoot, Containerfile]]:
    """The Containerfile carried out in a fresh overlay root (see the module's docstring)."""
    missing = nspawn.missing_prerequisites() + overlayroot.missing_prerequisites()
    if missing:
        if os.environ.get("CI"):
            pytest.fail("; ".join(missing) + ", and CI must run the image test")
        pytest.skip("; ".join(missing) + " (CI fails instead of skipping)")
    spec = parse_containerfile(CONTAINERFILE.read_text())
    with overlayroot.overlay_root(name_prefix="gpunode-img") as root:
        # Whatever this machine has at the image's paths is not in a slim base image (a whiteout in the
        # overlay's upper layer: the host's own files are not touched).
        for path in ("/opt/gpunode", "/src"):
            if root.path(path).exists():
                shutil.rmtree(root.path(path))
        for stage in spec.stages:
            for instruction, argument in stage:
                if instruction == "COPY" and argument.startswith("--from="):
                    continue  # the stages share this one root: the build stage's files are already here
                if instruction == "COPY":
                    source, destination = argument.split()
                    assert source == ".", f"COPY {argument}: only the build context is carried out"
                    copy_context(root.path(destination))
                    context = root.path(destination)
                    assert (context / "pyproject.toml").is_file() and (context / "templates").is_symlink()
                    assert not (context / ".venv").exists() and not (context / ".git").exists()
                elif instruction == "RUN":
                    result = root.run(["sh", "-c", argument], timeout=INSTALL_TIMEOUT)
                    assert result.returncode == 0, f"RUN {argument}:\n{result.stdout}\n{result.stderr}"
        # The final stage copies /opt/gpunode alone: nothing may depend on the source tree.
        shutil.rmtree(root.path("/src"))
        yield root, spec


def test_image_entry_point_runs(image_root: tuple[overlayroot.OverlayRoot, Containerfile]) -> None:
    root, spec = image_root
    assert spec.entrypoint == ["gpunode", "plugin", "run"]
    result = root.run([*spec.entrypoint, "--help"], env=spec.env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Usage: gpunode plugin run" in result.stdout
    # gpunode in the image is the image's own, not this checkout's.
    where = root.run(["sh", "-c", "command -v gpunode"], env=spec.env)
    assert where.stdout.strip() == "/opt/gpunode/bin/gpunode", where
    tool = build_tool()
    if tool is not None:
        # Where a build tool exists, the image itself is built too (not on this test bed: none is there).
        tag = "localhost/gpunode-device-plugin:test"
        verb = "bud" if tool == "buildah" else "build"
        argv = [tool, verb, "-f", str(CONTAINERFILE), "-t", tag, str(REPO)]
        built = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, check=False)
        assert built.returncode == 0, built.stdout + built.stderr
        if tool == "podman":
            helped = subprocess.run(
                ["podman", "run", "--rm", tag, "--help"],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert helped.returncode == 0 and "Usage: gpunode plugin run" in helped.stdout, helped


def daemonset_form(config_text: str) -> tuple[dict[str, str], dict[str, str], str]:
    """(container env, volume mount path by volume name, the ConfigMap's plugin.toml) from the manifest
    `gpunode plugin manifest` prints for a node with this config."""
    with short_tempdir("dsm-") as node:
        (node / "plugin.toml").write_text(config_text)
        out_path = node / "out.yaml"
        import contextlib
        import io

        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = main(["plugin", "manifest", "--config", "/plugin.toml"], host=Host(root=node, env={}))
        assert code == 0
        out_path.write_text(buffer.getvalue())
        objects: list[dict[str, Any]] = [d for d in yaml.safe_load_all(out_path.read_text()) if d]
    daemonset = next(o for o in objects if o["kind"] == "DaemonSet")
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    # Values only: GPUNODE_NODE_NAME comes from the downward API, which this stand-in has not.
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    probe = container["livenessProbe"]["exec"]["command"]
    assert probe == ["gpunode", "plugin", "status", "--status-file", env["GPUNODE_PLUGIN_STATUS_FILE"]]
    return env, mounts, configmap["data"]["plugin.toml"]


# Runs in the container: the entry point in the background, the liveness probe's command until it passes,
# then wait for the host's word, stop the plugin as kubelet does (SIGTERM) and run the probe once more.
SCRIPT = """
"$@" & pid=$!
n=0
until gpunode plugin status --status-file "$GPUNODE_PLUGIN_STATUS_FILE" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { wait "$pid"; echo "plugin exited $? before registering"; exit 90; }
    n=$((n + 1)); [ "$n" -lt 1500 ] || { kill "$pid"; exit 91; }
    sleep 0.2
done
echo "probe: live"
while [ ! -e "$STOP" ]; do sleep 0.1; done
kill -TERM "$pid"; wait "$pid"; echo "plugin exited $?"
gpunode plugin status --status-file "$GPUNODE_PLUGIN_STATUS_FILE" >/dev/null; echo "probe after exit: $?"
"""


def test_plugin_in_the_image_registers_through_the_mounted_socket_dir(
    image_root: tuple[overlayroot.OverlayRoot, Containerfile],
) -> None:
    root, spec = image_root
    env, mounts, plugin_toml = daemonset_form("[time-slicing]\nreplicas = 2\n")
    with short_tempdir("dsi-") as base:
        socket_dir = base / "device-plugins"
        driver_root = base / "driver"
        library_dir = driver_root / "usr/lib"
        library_dir.mkdir(parents=True)
        shutil.copy2(fakenvml.build() / fakenvml.LIBNAME, library_dir / fakenvml.LIBNAME)
        config_dir, status_dir = base / "config", base / "status"
        config_dir.mkdir()
        status_dir.mkdir()
        (config_dir / "plugin.toml").write_text(plugin_toml)
        binds = [
            nspawn.Bind(socket_dir, mounts["device-plugins"], read_only=False),
            nspawn.Bind(driver_root, mounts["driver-root"]),
            nspawn.Bind(config_dir, mounts["config"]),
            nspawn.Bind(status_dir, mounts["status"], read_only=False),
        ]
        stop = Path(mounts["status"]) / "stop-now"
        run_env = {**spec.env, **env, "FAKE_NVML_PROFILE": "pcie-4", "STOP": str(stop)}
        outcome: dict[str, subprocess.CompletedProcess[str] | BaseException] = {}

        def container() -> None:
            try:
                outcome["run"] = root.run(
                    ["sh", "-c", SCRIPT, "sh", *spec.entrypoint], env=run_env, binds=binds, timeout=600
                )
            except BaseException as err:  # reported by the test thread below
                outcome["run"] = err

        with FakeKubelet(socket_dir) as kubelet:
            thread = threading.Thread(target=container, daemon=True)
            thread.start()
            try:
                registration = kubelet.wait_registered(GPU, timeout=300)
                assert registration.endpoint == "gpunode-nvidia.com-gpu.sock"
                # pcie-4 has 4 GPUs; the ConfigMap's replicas = 2 makes 8 devices.
                devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 8, timeout=120)
                answer = kubelet.allocate(GPU, [[devices[0].id]])
                [response] = answer.container_responses
                assert response.envs["NVIDIA_VISIBLE_DEVICES"] == devices[0].id.split("::")[0]
                # A kubelet restart is seen through the mount (inotify on the bound directory): served and
                # registered again, as on the host.
                restarted = kubelet.restart()
                kubelet.wait_registered(GPU, after=restarted, timeout=120)
                kubelet.wait_for_devices(GPU, lambda d: len(d) == 8, timeout=120)
            finally:
                (status_dir / stop.name).touch()
                thread.join(timeout=600)
            assert kubelet.violations == []
        result = outcome["run"]
        if isinstance(result, BaseException):
            raise result
        assert "probe: live" in result.stdout, result.stdout + result.stderr
        assert "plugin exited 0" in result.stdout, result.stdout + result.stderr
        assert "probe after exit: 1" in result.stdout, result.stdout + result.stderr
        # The plugin loaded NVML from the mounted driver root, as the DaemonSet tells it to.
        assert "NVML loaded from /driver-root/usr/lib/libnvidia-ml.so.1" in result.stderr, result.stderr
