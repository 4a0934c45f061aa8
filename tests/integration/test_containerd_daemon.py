"""`gpunode configure-runtime containerd` against a real containerd 1.6 daemon.

The config under test is written by gpunode's CLI; a private containerd then starts on it and is asked, as
kubelet would, what it made of it: the CRI plugin's status (`ctr plugins ls`), its effective runtimes (a CRI
`Status` call with verbose=true, the equivalent of `crictl info`), and finally a real pod sandbox that must
be created through the configured runtime binary.

Needs the test bed's containerd 1.6, ctr and runc (tests/testbed.py: unpacked, never installed), gcc (with
static glibc) and grpcio-tools. In CI (the CI variable is set) a missing one is a failure: these checks
must not silently stop running there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tomlkit
from tomlkit.items import Table

from tests import testbed
from tests.integration.cri import client, daemon, oci
from tests.integration.cri.daemon import Containerd

CRI = "io.containerd.grpc.v1.cri"
PAUSE_IMAGE = "gpunode.test/pause:1"
CONFIG = "/etc/containerd/config.toml"  # as the node sees it; the node's files live under a temp root


def require_program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} is not installed")
    assert path is not None
    return path


def missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what}, and CI must run the real-containerd tests (see the test-bed packages)")
    pytest.skip(f"{what} (CI fails instead of skipping)")


@pytest.fixture(scope="session")
def cri_api(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    if importlib.util.find_spec("grpc_tools") is None:
        missing("grpcio-tools is not installed")
    return client.compile_runtime_api(tmp_path_factory.mktemp("cri-api"))


@pytest.fixture(scope="session")
def pause_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_program("gcc")
    workdir = tmp_path_factory.mktemp("pause-image")
    return oci.write_image_archive(oci.build_pause(workdir), PAUSE_IMAGE, workdir / "pause.tar")


@pytest.fixture
def start_containerd(tmp_path: Path) -> Iterator[Callable[[Path], Containerd]]:
    """Start containerd on a config file with private paths; every daemon is stopped at teardown."""
    testbed.binary("containerd-1.6", "containerd")
    testbed.binary("containerd-1.6", "ctr")
    testbed.binary("runc")
    started: list[Containerd] = []

    def start(config: Path) -> Containerd:
        # Short: the socket path must stay under the 108-byte unix socket limit.
        started.append(daemon.start_containerd(config, tmp_path / f"d{len(started)}"))
        return started[-1]

    yield start
    for one in started:
        daemon.stop_containerd(one)
        assert not daemon.mounts_under(one.base), f"mounts left under {one.base}"


def default_config(workdir: Path) -> tomlkit.TOMLDocument:
    """`containerd config default` (the most common real input), with the few paths that are not covered
    by containerd's --root/--state/--address flags moved under workdir, so that nothing is written outside
    it and nothing from the host (a CNI config) leaks in.

    Left as they are on purpose: the ttrpc socket (empty address: containerd puts it next to --address),
    the debug and metrics listeners (off when empty), the CRI stream server (127.0.0.1, port 0: a free
    port each time) and the CRI plugin's own directories (under --root and --state).
    """
    result = subprocess.run(
        [testbed.binary("containerd-1.6"), "config", "default"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    doc = tomlkit.parse(result.stdout)
    plugins = table(doc, "plugins")
    # The opt plugin creates its directory (default /opt/containerd) at start-up.
    table(plugins, "io.containerd.internal.v1.opt")["path"] = str(workdir / "opt")
    # The CRI plugin creates and watches the CNI config directory (default /etc/cni/net.d).
    cni = table(table(plugins, CRI), "cni")
    cni["conf_dir"] = str(workdir / "cni" / "net.d")
    cni["bin_dir"] = str(workdir / "cni" / "bin")
    # runc keeps container state in /run/containerd/runc/<namespace> unless told otherwise; gpunode copies
    # runc's options into the nvidia runtime, so this keeps the nvidia runtime's state private as well.
    runc_options(doc)["Root"] = str(workdir / "runc")
    return doc


def table(container: tomlkit.TOMLDocument | Table, key: str) -> Table:
    value = container[key]
    assert isinstance(value, Table), f"{key} is not a table"
    return value


def cri_containerd(doc: tomlkit.TOMLDocument) -> Table:
    return table(table(table(doc, "plugins"), CRI), "containerd")


def runc_options(doc: tomlkit.TOMLDocument) -> Table:
    return table(table(table(cri_containerd(doc), "runtimes"), "runc"), "options")


def write(doc: tomlkit.TOMLDocument, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomlkit.dumps(doc))
    return path


def fake_nvidia_runtime(workdir: Path) -> tuple[Path, Path]:
    """A stand-in for nvidia-container-runtime: logs its arguments, then is runc. Returns (wrapper, log)."""
    runc = testbed.binary("runc")
    log = workdir / "nvidia-container-runtime.log"
    wrapper = workdir / "bin" / "nvidia-container-runtime"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{log}"\nexec "{runc}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def gpunode_configure(node: Path, wrapper: Path, *extra: str) -> Path:
    """Run the CLI on the node under `node`; returns the local path of the config file it edited.

    --root keeps everything gpunode writes (its backups and its record of changes, normally under
    /var/lib/gpunode) inside the test's directory; the wrapper's path is written into the config as given,
    so containerd, which runs outside that root, finds the real one.
    """
    # Through `python -m gpunode` so the test needs no console script on PATH, only this interpreter.
    command = [
        sys.executable,
        "-m",
        "gpunode",
        "--root",
        str(node),
        "configure-runtime",
        "containerd",
        "--config",
        CONFIG,
        "--runtime-path",
        str(wrapper),
        "--set-as-default",
        "--no-restart",
        *extra,
    ]
    # gpunode asks `containerd --version` by name (the host's programs, even with --root): the test bed's 1.6,
    # the daemon that reads the file, comes first on PATH.
    env = {**os.environ, "PATH": testbed.path_with("containerd-1.6")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert result.returncode == 0, (
        f"gpunode exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return node_config(node)


def node_config(node: Path) -> Path:
    return node / CONFIG.lstrip("/")


def assert_cri_ok(ctd: Containerd) -> None:
    status = daemon.plugins_status(ctd.socket).get(CRI)
    assert status == "ok", (
        f"cri plugin is {status}:\n{daemon.plugin_detail(ctd.socket, 'cri')}\nlog:\n{ctd.log_text()}"
    )


@pytest.mark.parametrize("runtime_name", [None, "gpu"])
def test_gpunode_makes_nvidia_the_default_runtime_of_a_real_containerd(
    runtime_name: str | None,
    tmp_path: Path,
    cri_api: ModuleType,
    start_containerd: Callable[[Path], Containerd],
) -> None:
    wrapper, _ = fake_nvidia_runtime(tmp_path)
    doc = default_config(tmp_path)
    # The systemd-cgroup node: the option whose loss gets pods killed, so it must reach the nvidia runtime.
    runc_options(doc)["SystemdCgroup"] = True
    write(doc, node_config(tmp_path / "node"))

    extra = ("--runtime-name", runtime_name) if runtime_name else ()
    config = gpunode_configure(tmp_path / "node", wrapper, *extra)
    ctd = start_containerd(config)

    assert_cri_ok(ctd)
    name = runtime_name or "nvidia"
    effective = client.cri_status(cri_api, ctd.socket)["containerd"]
    assert effective["defaultRuntimeName"] == name
    runtimes = effective["runtimes"]
    assert set(runtimes) == {"runc", name}
    nvidia = runtimes[name]
    assert nvidia["runtimeType"] == "io.containerd.runc.v2"
    assert nvidia["options"]["BinaryName"] == str(wrapper)
    assert nvidia["options"]["SystemdCgroup"] is True
    # Everything else runc had (here its private state root) is carried over too.
    assert nvidia["options"]["Root"] == runtimes["runc"]["options"]["Root"]


def test_an_undefined_default_runtime_puts_the_cri_plugin_in_error(
    tmp_path: Path, start_containerd: Callable[[Path], Containerd]
) -> None:
    """The negative control: proves the `cri ... ok` check above can fail."""
    doc = default_config(tmp_path)
    cri_containerd(doc)["default_runtime_name"] = "nvidia"  # never defined
    ctd = start_containerd(write(doc, tmp_path / "config.toml"))

    assert daemon.plugins_status(ctd.socket)[CRI] == "error"
    assert 'default_runtime_name = "nvidia"' in daemon.plugin_detail(ctd.socket, "cri")


def test_a_pod_sandbox_runs_through_the_configured_runtime_binary(
    tmp_path: Path,
    cri_api: ModuleType,
    pause_archive: Path,
    start_containerd: Callable[[Path], Containerd],
) -> None:
    wrapper, wrapper_log = fake_nvidia_runtime(tmp_path)
    doc = default_config(tmp_path)
    cri = table(table(doc, "plugins"), CRI)
    # No registry is reachable: the sandbox image is the locally built one, imported below.
    cri["sandbox_image"] = PAUSE_IMAGE
    # The CRI plugin gives sandboxes oom_score_adj -998, which needs CAP_SYS_RESOURCE; the test machines
    # run without it, and this makes containerd clamp the value instead of failing the pod.
    cri["restrict_oom_score_adj"] = True
    # runc's SystemdCgroup stays false (the default): systemd is not PID 1 here, so runc cannot ask it for
    # a scope. gpunode copies the value, which is what the nvidia runtime must do on such a node.
    assert runc_options(doc)["SystemdCgroup"] is False
    write(doc, node_config(tmp_path / "node"))

    config = gpunode_configure(tmp_path / "node", wrapper)
    ctd = start_containerd(config)
    assert_cri_ok(ctd)
    daemon.ctr(ctd.socket, "images", "import", str(pause_archive), namespace="k8s.io")

    with client.RuntimeService(cri_api, ctd.socket) as cri_service:
        cri_service.wait_ready()
        # No runtime handler: the pod gets the default runtime, as every pod without a RuntimeClass does.
        try:
            sandbox_id = cri_service.run_pod_sandbox(pod_sandbox_config(cri_api, ctd.cgroup_parent))
        except Exception as err:
            raise AssertionError(
                f"RunPodSandbox failed: {err}\nruntime calls:\n{read(wrapper_log)}\nlog:\n{ctd.log_text()}"
            ) from err
        try:
            invocations = read(wrapper_log).splitlines()
        finally:
            cri_service.stop_pod_sandbox(sandbox_id)
            cri_service.remove_pod_sandbox(sandbox_id)

    creates = [line.split() for line in invocations if " create " in f" {line} "]
    assert creates, f"the nvidia runtime was never asked to create a container: {invocations}"
    assert "--bundle" in creates[0]
    assert creates[0][-1] == sandbox_id


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def pod_sandbox_config(api: Any, cgroup_parent: str) -> Any:
    """A sandbox in the node's network namespace: there is no CNI plugin here, and the CRI plugin only
    calls CNI for pods that get a network namespace of their own."""
    return api.PodSandboxConfig(
        metadata=api.PodSandboxMetadata(name="gpu-pod", uid=str(uuid.uuid4()), namespace="default"),
        linux=api.LinuxPodSandboxConfig(
            cgroup_parent=cgroup_parent,
            security_context=api.LinuxSandboxSecurityContext(
                namespace_options=api.NamespaceOption(network=api.NODE)
            ),
        ),
    )
