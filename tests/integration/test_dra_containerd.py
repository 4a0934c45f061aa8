"""The CDI IDs gpunode's DRA Prepare returns, used as kubelet uses them: a real containerd 1.7 with CDI on,
through the CRI's `ContainerConfig.CDI_devices` (field 17; shared/specs/dra-kubelet-plugin.md section 2).

The node: the fake NVML library's `pcie-4` machine (4 GPUs, minors 0-3), its device nodes made with mknod
in a private driver root, stand-in driver libraries of 550.54.15 listed in a real-format ld.so.cache, and a
stand-in hook program. A ResourceClaim for two of its GPUs is allocated in the test API server and reserved
for a pod bound to the node; gpunode's Preparer (gpunode/dra/prepare.py) reads it with the node's
certificate and writes the claim's CDI spec into the node's /var/run/cdi (under a temp root), the one spec
directory containerd reads (`enable_cdi = true`, `cdi_spec_dirs`). A container created with exactly the
IDs Prepare answered must run with those two GPUs' device nodes (not the others), the control nodes, the
driver's libraries mounted read-only and NVIDIA_VISIBLE_DEVICES=void: checked in the OCI spec containerd
generated and in the running container itself (its /dev, mounts and environment, through /proc/<pid>).
Before Prepare, and again after Unprepare (the spec gone, the checkpoint empty), a container with those IDs
is refused by containerd's CDI resolution.

The driver files are read from the real root with `--driver-root`-style roots (as `gpunode dra run
--driver-root` reads them), so the spec's host paths are the real paths containerd and runc use; the
Preparer's own files (checkpoint, claim specs) live under the temp root.

Needs the test bed's containerd 1.7, its ctr and runc (tests/testbed.py), gcc (with static glibc) and
grpcio-tools; in CI (CI set) a missing one is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpunode.cdi.hostfacts import HostFacts, Roots, read_host_facts
from gpunode.dra import claimcdi
from gpunode.dra.prepare import ClaimRef, Preparer, inventory_devices
from gpunode.host import Host
from gpunode.nvml import discover
from tests import cdinode, draprepare, testbed
from tests.draprepare import DRIVER, NODE
from tests.integration.cri import client, daemon, oci
from tests.integration.cri.daemon import Containerd
from tests.integration.test_cdi_containerd import containerd_config, hook_program
from tests.integration.test_containerd_daemon import (
    CRI,
    PAUSE_IMAGE,
    missing,
    pod_sandbox_config,
    require_program,
    table,
    write,
)
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.pki import Pki

VERSION = "550.54.15"
NAMESPACE = "ml"
CLAIMED = (1, 2)  # the GPU minors the claim is allocated; 0 and 3 must stay out of the container


@pytest.fixture(scope="module")
def cri_api(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    if importlib.util.find_spec("grpc_tools") is None:
        missing("grpcio-tools is not installed")
    return client.compile_runtime_api(tmp_path_factory.mktemp("cri-api"))


@pytest.fixture(scope="module")
def pause(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_program("gcc")
    workdir = tmp_path_factory.mktemp("pause-image")
    return oci.write_image_archive(oci.build_pause(workdir), PAUSE_IMAGE, workdir / "pause.tar")


@pytest.fixture
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, dict[str, str]]]:
    """The test API server, and node n1's kubelet certificate (the Node authorizer lets it GET the claims
    of its pods)."""
    pki = Pki.create(tmp_path_factory.mktemp("pki"))
    cert = pki.client(f"system:node:{NODE}", ["system:nodes"])
    with ApiServer(pki, tokens={}, allow=[]) as server:
        server.add_node(NODE)
        yield (
            server,
            {"url": server.url, "ca": str(pki.ca.cert), "cert": str(cert.cert), "key": str(cert.key)},
        )


@pytest.fixture
def containerd_17(tmp_path: Path) -> Iterator[Callable[[Path], Containerd]]:
    binary = testbed.binary("containerd-1.7", "containerd")
    testbed.binary("containerd-1.7", "ctr")
    testbed.binary("runc")
    started: list[Containerd] = []

    def start(config: Path) -> Containerd:
        started.append(daemon.start_containerd(config, tmp_path / f"d{len(started)}", binary=binary))
        return started[-1]

    yield start
    for one in started:
        daemon.stop_containerd(one)
        assert not daemon.mounts_under(one.base), f"mounts left under {one.base}"


@dataclass(frozen=True)
class GpuNode:
    work: Path  # the test's own directory (containerd's config and paths under it)
    driver_root: Path  # the driver's files and device nodes, as --driver-root names them
    hook: Path  # the stand-in nvidia-ctk the spec's createContainer hook runs
    root: Path  # the node's root for the Preparer: its checkpoint and /var/run/cdi

    @property
    def spec_dir(self) -> Path:
        return self.root / claimcdi.DIRECTORY.lstrip("/")


@pytest.fixture
def gpu_node(tmp_path: Path, fake_nvml: Callable[..., None]) -> GpuNode:
    """The fake NVML's pcie-4 machine in this process, its driver files, and an empty /var/run/cdi."""
    fake_nvml(profile="pcie-4")
    node = GpuNode(tmp_path, tmp_path / "drv", hook_program(tmp_path), tmp_path / "node")
    cdinode.make_driver(node.driver_root, VERSION, gpus=range(4), hook=False)
    node.spec_dir.mkdir(parents=True)
    return node


def node_preparer(root: Path, creds: dict[str, str], driver_root: Path, hook: Path) -> Preparer:
    """gpunode's Preparer for this node: the fake NVML's inventory (in this process), the driver files read
    from `driver_root` on the real root, its checkpoint and claim specs under `root`."""
    inventory = discover()
    facts: HostFacts = read_host_facts(
        Host("/"), inventory, Roots(str(driver_root), str(driver_root)), hook_program=str(hook)
    )
    kube = draprepare.client(creds)
    return Preparer(
        Host(root),
        DRIVER,
        NODE,
        devices=lambda: inventory_devices(inventory),
        inventory=lambda: inventory,
        facts=lambda: facts,
        kube=lambda: kube,
    )


def create_container(cri: client.RuntimeService, sandbox: str, sandbox_config: Any, ids: list[str]) -> str:
    """CreateContainer as kubelet sends it for a container using the claim: the IDs in CDI_devices only
    (never in annotations)."""
    api = cri.api
    request = api.CreateContainerRequest(
        pod_sandbox_id=sandbox,
        config=api.ContainerConfig(
            metadata=api.ContainerMetadata(name=f"c-{uuid.uuid4().hex[:8]}"),
            image=api.ImageSpec(image=PAUSE_IMAGE),
            CDI_devices=[api.CDIDevice(name=i) for i in ids],
        ),
        sandbox_config=sandbox_config,
    )
    return str(cri.call("CreateContainer", request).container_id)


def refused(cri: client.RuntimeService, sandbox: str, sandbox_config: Any, ids: list[str]) -> str:
    """The error containerd answers a CreateContainer with `ids` (the test fails if it creates it)."""
    grpc = __import__("grpc")
    with pytest.raises(grpc.RpcError) as err:
        create_container(cri, sandbox, sandbox_config, ids)
    return str(err.value.details() or "")


def task_pid(ctd: Containerd, container: str) -> int:
    """The PID of a started container's process, from `ctr tasks ls` (TASK PID STATUS)."""
    listing = daemon.ctr(ctd.socket, "tasks", "ls", namespace="k8s.io", program=ctd.ctr)
    for line in listing.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == container:
            assert fields[2] == "RUNNING", listing
            return int(fields[1])
    raise AssertionError(f"no task for {container}:\n{listing}")


def oci_spec(ctd: Containerd, container: str) -> dict[str, Any]:
    """The OCI spec containerd generated for the container: the bundle's config.json (the v2 shim keeps
    the bundle under the state directory while the task exists)."""
    path = ctd.base / "state" / "io.containerd.runtime.v2.task" / "k8s.io" / container / "config.json"
    spec: dict[str, Any] = json.loads(path.read_text())
    return spec


def nvidia_nodes_seen(pid: int) -> dict[str, tuple[int, int]]:
    """The /dev/nvidia* character devices in the container's own /dev: path -> (major, minor)."""
    dev = Path(f"/proc/{pid}/root/dev")
    seen: dict[str, tuple[int, int]] = {}
    for entry in dev.iterdir():
        if entry.name.startswith("nvidia"):
            info = entry.lstat()
            assert stat.S_ISCHR(info.st_mode), f"{entry.name} in the container is not a character device"
            seen[f"/dev/{entry.name}"] = (os.major(info.st_rdev), os.minor(info.st_rdev))
    return seen


def mount_options(pid: int, path: str) -> set[str]:
    """The per-mount options of `path` in the container's mount namespace (/proc/<pid>/mountinfo)."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == path:
            return set(fields[5].split(","))
    raise AssertionError(f"{path} is not a mount point in the container")


def test_containerd_17_runs_a_container_with_the_cdi_ids_prepare_returned(
    cri_api: ModuleType,
    pause: Path,
    containerd_17: Callable[[Path], Containerd],
    gpu_node: GpuNode,
    kube: tuple[ApiServer, dict[str, str]],
) -> None:
    server, creds = kube
    root, spec_dir, driver_root, hook = gpu_node.root, gpu_node.spec_dir, gpu_node.driver_root, gpu_node.hook
    doc = containerd_config(gpu_node.work, spec_dir)
    table(table(doc, "plugins"), CRI)["enable_cdi"] = True
    ctd = containerd_17(write(doc, gpu_node.work / "containerd.toml"))
    effective = client.cri_status(cri_api, ctd.socket)
    assert effective["enableCDI"] is True and effective["cdiSpecDirs"] == [str(spec_dir)]
    daemon.ctr(ctd.socket, "images", "import", str(pause), namespace="k8s.io", program=ctd.ctr)

    made = server.dra.allocate_claim(
        NAMESPACE, "train", node=NODE, driver=DRIVER, devices=tuple(f"gpu-{m}" for m in CLAIMED)
    )
    ref = ClaimRef(NAMESPACE, made["metadata"]["uid"], "train")
    preparer = node_preparer(root, creds, driver_root, hook)
    expected_ids = [claimcdi.device_id(ref.uid, f"gpu-{m}") for m in CLAIMED]

    with client.RuntimeService(cri_api, ctd.socket) as cri:
        cri.wait_ready()
        sandbox_config = pod_sandbox_config(cri_api, ctd.cgroup_parent)
        sandbox = cri.run_pod_sandbox(sandbox_config)
        try:
            # Before Prepare no spec defines the claim's IDs: containerd refuses them.
            before = refused(cri, sandbox, sandbox_config, expected_ids)
            assert "unresolvable CDI devices" in before, before

            answer = preparer.prepare([ref])[ref.uid].response()
            assert "error" not in answer, answer
            ids = [i for d in answer["devices"] for i in d["cdi_device_ids"]]
            assert ids == expected_ids
            spec_file = root / claimcdi.spec_path(ref.uid).lstrip("/")
            assert spec_file.parent == spec_dir and spec_file.exists()

            container = create_container(cri, sandbox, sandbox_config, ids)
            cri.call("StartContainer", cri_api.StartContainerRequest(container_id=container))
            pid = task_pid(ctd, container)

            # What containerd generated from the claim's spec.
            spec = oci_spec(ctd, container)
            in_spec = {
                d["path"]: (d["major"], d["minor"])
                for d in spec["linux"]["devices"]
                if d["path"].startswith("/dev/nvidia")
            }
            control = {
                "/dev/nvidiactl": (cdinode.NVIDIA_MAJOR, 255),
                "/dev/nvidia-uvm": (cdinode.UVM_MAJOR, 0),
                "/dev/nvidia-uvm-tools": (cdinode.UVM_MAJOR, 1),
            }
            claimed = {f"/dev/nvidia{m}": (cdinode.NVIDIA_MAJOR, m) for m in CLAIMED}
            assert in_spec == claimed | control
            allowed = {
                (r.get("type"), r.get("major"), r.get("minor"))
                for r in spec["linux"]["resources"]["devices"]
                if r.get("allow")
            }
            assert {("c", cdinode.NVIDIA_MAJOR, m) for m in CLAIMED} <= allowed
            assert not {("c", cdinode.NVIDIA_MAJOR, m) for m in (0, 3)} & allowed
            assert "NVIDIA_VISIBLE_DEVICES=void" in spec["process"]["env"]
            (hook_entry,) = spec["hooks"]["createContainer"]
            assert hook_entry["path"] == str(hook)

            # What the running container sees: its /dev, its mounts, its environment.
            assert nvidia_nodes_seen(pid) == claimed | control
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"NVIDIA_VISIBLE_DEVICES=void" in environ
            for _, file_pattern in cdinode.LIBRARIES:
                library = f"{cdinode.LIB_DIR}/{file_pattern.format(v=VERSION)}"
                seen = Path(f"/proc/{pid}/root{library}")
                assert seen.read_bytes() == (driver_root / library.lstrip("/")).read_bytes()
                assert "ro" in mount_options(pid, library)

            # Kubelet unprepares after the pod's containers stopped.
            cri.call("StopContainer", cri_api.StopContainerRequest(container_id=container, timeout=10))
            cri.call("RemoveContainer", cri_api.RemoveContainerRequest(container_id=container))
            assert preparer.unprepare([ref])[ref.uid].response() == {}
            assert not spec_file.exists()
            assert sorted(os.listdir(spec_dir)) == []
            assert preparer.prepared() == {}

            # The IDs no longer resolve: a new container with them is not created.
            after = refused(cri, sandbox, sandbox_config, ids)
            assert "unresolvable CDI devices" in after, after
            assert all(i in after for i in ids), after
        except Exception as exc:
            raise AssertionError(f"{exc}\ncontainerd log:\n{ctd.log_text()[-4000:]}") from exc
        finally:
            cri.stop_pod_sandbox(sandbox)
            cri.remove_pod_sandbox(sandbox)
