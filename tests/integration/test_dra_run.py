"""`gpunode dra run` as a real process (real pynvml over the fake NVML) against the fake kubelet DRA side
(tests/integration/drakubelet.py) and the test API server (real TLS, a kubelet's node certificate and the
Node authorizer's rules). Waits are waits on a condition with a generous bound, never timing thresholds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from gpunode.plugin.nvidia_env import VARIABLES as NVIDIA_VARIABLES
from tests import cdinode, fakenvml
from tests.integration.drakubelet import Claim, FakeDraKubelet
from tests.integration.pluginproc import REPO, short_tempdir
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.dra import SLICES, Kind
from tests.kubeapi.pki import Pki

DRIVER = "gpu.nvidia.com"
NODE = "gpu-node-1"
WAIT = 60.0  # generous: the machine is shared
_T = TypeVar("_T")


def wait_for(found: Callable[[], _T | None], what: str, proc: DraProcess, timeout: float = WAIT) -> _T:
    deadline = time.monotonic() + timeout
    while True:
        value = found()
        if value is not None and value is not False:
            return value
        if proc.proc is not None and proc.proc.poll() is not None:
            raise AssertionError(
                f"driver exited {proc.proc.returncode} while waiting for {what}:\n{proc.log()}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s:\n{proc.log()}")
        time.sleep(0.05)  # polling a condition; the bound above is the only deadline


class DraProcess:
    """One `python -m gpunode dra run` with private directories and its output in a file."""

    def __init__(
        self,
        base: Path,
        kubeconfig: Path,
        *,
        control: Path | None = None,
        args: tuple[str, ...] = (),
        profile: str = "pcie-4",
    ) -> None:
        self.base = base
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GPUNODE_", "DP_")) and k not in NVIDIA_VARIABLES and k != "NODE_NAME"
        }
        self.status_path = base / f"status-{id(self)}.json"
        self.log_path = base / f"dra-{id(self)}.log"
        self.env = {
            **env,
            **fakenvml.env(profile, None, control),
            "PYTHONPATH": str(REPO),
            "NODE_NAME": NODE,
            "KUBECONFIG": str(kubeconfig),
            "GPUNODE_DRA_PLUGINS_DIR": str(base / "plugins"),
            "GPUNODE_DRA_REGISTRY_DIR": str(base / "registry"),
            "GPUNODE_DRA_CDI_DIR": str(base / "cdi"),
            "GPUNODE_DRA_STATUS_FILE": str(self.status_path),
            "GPUNODE_DRA_DRIVER_ROOT": str(base / "drv"),
        }
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DraProcess:
        argv = [sys.executable, "-m", "gpunode", "dra", "run", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                raise
        return self.proc.returncode

    def __enter__(self) -> DraProcess:
        return self.start()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            self.stop()
        finally:
            if exc is not None:
                print(f"--- driver log ---\n{self.log()}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(pki) as server:
        server.add_node(NODE)
        server.node_identity(NODE)
        yield server


@pytest.fixture
def base() -> Iterator[Path]:
    with short_tempdir("dra-") as path:
        # A driver root: device nodes, the driver's libraries and their ld.so.cache (for the claims' CDI
        # specs), with the fake NVML as its libnvidia-ml so that --driver-root loads NVML from there too.
        cdinode.make_driver(path / "drv", gpus=range(4), hook=False)
        nvml = path / "drv" / cdinode.LIB_DIR.lstrip("/") / "libnvidia-ml.so.550.54.15"
        nvml.unlink()
        shutil.copyfile(fakenvml.build() / fakenvml.LIBNAME, nvml)
        yield path


@pytest.fixture
def kubeconfig(base: Path, api: ApiServer, pki: Pki) -> Path:
    """Like kubeadm's /etc/kubernetes/kubelet.conf: the node's client certificate."""
    pair = pki.client(f"system:node:{NODE}", ["system:nodes"])
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "k", "cluster": {"server": api.url, "certificate-authority": str(pki.ca.cert)}}
        ],
        "users": [
            {"name": "node", "user": {"client-certificate": str(pair.cert), "client-key": str(pair.key)}}
        ],
        "contexts": [{"name": "node", "context": {"cluster": "k", "user": "node"}}],
        "current-context": "node",
    }
    path = base / "kubelet.conf"
    path.write_text(yaml.safe_dump(document))
    return path


def _wipe(api: ApiServer) -> Callable[[str, str | None], None]:
    """kubelet's DeleteCollection of the node's slices (all drivers, or one), as an admin would."""

    def wipe(node: str, driver: str | None) -> None:
        for item in api.dra.items(_slices_kind()):
            spec = item["spec"]
            if spec.get("nodeName") == node and driver in (None, spec.get("driver")):
                api.dra.remove(_slices_kind(), item["metadata"]["name"])

    return wipe


def _slices_kind() -> Kind:
    return SLICES


def slices(api: ApiServer) -> list[dict[str, Any]]:
    return [s for s in api.dra.items(_slices_kind()) if s["spec"].get("driver") == DRIVER]


def devices_of(api: ApiServer) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices(api) for d in s["spec"].get("devices", [])}


@pytest.fixture
def kubelet(base: Path, api: ApiServer) -> Iterator[FakeDraKubelet]:
    with FakeDraKubelet(base / "registry", node_name=NODE, wipe_slices=_wipe(api), backoff_initial=0.1) as k:
        yield k


def test_registers_publishes_prepares_and_stops_cleanly(
    base: Path, api: ApiServer, kubelet: FakeDraKubelet, kubeconfig: Path
) -> None:
    with DraProcess(base, kubeconfig) as driver:
        registration = kubelet.wait_registered(DRIVER, timeout=WAIT)
        assert registration.endpoint == str(base / "plugins" / DRIVER / "dra.sock")
        assert registration.version == "v1.DRAPlugin"
        assert not kubelet.rejections()  # GetInfo answered within kubelet's 1 s the first time
        # Slices: one pool named after the node, validated by the test API server as kube-apiserver does.
        found = wait_for(lambda: devices_of(api) if len(devices_of(api)) == 4 else None, "4 devices", driver)
        assert sorted(found) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        (published,) = slices(api)
        assert published["spec"]["pool"]["name"] == NODE and published["spec"]["nodeName"] == NODE
        assert published["metadata"]["ownerReferences"][0]["kind"] == "Node"
        # kubelet restarts: it wipes all the node's slices; the driver puts them back.
        restarted = kubelet.restart()
        kubelet.wait_wiped(None, timeout=WAIT, after=restarted)
        wait_for(lambda: len(devices_of(api)) == 4, "slices back after the wipe", driver)
        kubelet.wait_registered(DRIVER, count=2, timeout=WAIT)
        # Prepare of a claim the scheduler allocated on this node: CDI IDs, and the spec on disk.
        made = api.dra.allocate_claim("ml", "train", node=NODE, driver=DRIVER, devices=("gpu-1",))
        claim = Claim("ml", made["metadata"]["uid"], "train")
        answer = kubelet.prepare(DRIVER, [claim])
        (device,) = answer[claim.uid]
        assert device.device_name == "gpu-1" and device.pool_name == NODE
        assert device.cdi_device_ids == (f"k8s.{DRIVER}/claim={claim.uid}-gpu-1",)
        spec = base / "cdi" / f"k8s.{DRIVER}-claim_{claim.uid}.yaml"
        assert spec.is_file()
        assert kubelet.prepare(DRIVER, [claim]) == answer  # asked again: the same answer
        kubelet.unprepare(DRIVER, [claim])
        assert not spec.exists()
        status = json.loads(driver.status_path.read_text())
        assert status["driver"] == DRIVER and sorted(status["devices"]) == [
            "gpu-0",
            "gpu-1",
            "gpu-2",
            "gpu-3",
        ]
        # SIGTERM: exit 0, both sockets gone, the status file removed.
        assert driver.stop() == 0
    assert not (base / "registry" / f"{DRIVER}-reg.sock").exists()
    assert not (base / "plugins" / DRIVER / "dra.sock").exists()
    assert not driver.status_path.exists()
    kubelet.wait_deregistered(DRIVER, timeout=WAIT)


def test_xid_taints_and_stream_then_recovery(
    base: Path, api: ApiServer, kubelet: FakeDraKubelet, kubeconfig: Path
) -> None:
    control = base / "nvml-control"
    control.write_text("")
    with DraProcess(base, kubeconfig, control=control, args=("--recovery-quiet-period", "3")) as driver:
        kubelet.wait_registered(DRIVER, timeout=WAIT)
        kubelet.wait_health(
            DRIVER, lambda h: len(h) == 4 and all(d.health == "HEALTHY" for d in h.values()), timeout=WAIT
        )
        wait_for(lambda: "health monitor armed" in driver.log(), "the health monitor armed", driver)
        fakenvml.inject(control, "xid 1 79")
        health = kubelet.wait_health(
            DRIVER,
            lambda h: h.get((NODE, "gpu-1")) is not None and h[(NODE, "gpu-1")].health == "UNHEALTHY",
            timeout=WAIT,
        )
        assert "79" in health[(NODE, "gpu-1")].message
        assert {k for k, d in health.items() if d.health == "UNHEALTHY"} == {(NODE, "gpu-1")}
        taints = wait_for(lambda: devices_of(api).get("gpu-1", {}).get("taints"), "the Xid taint", driver)
        assert taints[0]["key"] == f"{DRIVER}/xid" and taints[0]["value"] == "79"
        assert taints[0]["effect"] == "NoSchedule"
        assert "taints" not in devices_of(api)["gpu-0"]
        # NVML says the GPU is fine again: after the quiet period, HEALTHY and the taint gone.
        kubelet.wait_health(
            DRIVER, lambda h: all(d.health == "HEALTHY" for d in h.values()) and len(h) == 4, timeout=WAIT
        )
        wait_for(
            lambda: "taints" not in devices_of(api).get("gpu-1", {"taints": 1}), "the taint removed", driver
        )


def test_second_driver_of_the_same_name_is_refused(
    base: Path, api: ApiServer, kubelet: FakeDraKubelet, kubeconfig: Path
) -> None:
    with DraProcess(base, kubeconfig) as first:
        kubelet.wait_registered(DRIVER, timeout=WAIT)
        second = DraProcess(base, kubeconfig).start()
        assert second.proc is not None
        assert second.proc.wait(WAIT) == 3, second.log()
        assert "another DRA driver named gpu.nvidia.com is already registered" in second.log()
        # The first one still serves: its sockets are untouched.
        assert (base / "registry" / f"{DRIVER}-reg.sock").exists()
        assert first.proc is not None and first.proc.poll() is None
        assert kubelet.connected(DRIVER)


def test_mig_devices_created_and_destroyed_reach_the_slices_and_the_stream(
    base: Path, api: ApiServer, kubelet: FakeDraKubelet, kubeconfig: Path
) -> None:
    control = base / "nvml-control"
    control.write_text("")
    with DraProcess(base, kubeconfig, control=control, profile="mig") as driver:
        kubelet.wait_registered(DRIVER, timeout=WAIT)
        before = set(wait_for(lambda: devices_of(api) or None, "the first slices", driver))
        assert any("-mig-" in name for name in before)
        wait_for(lambda: "MIG watcher" in driver.log(), "the MIG watcher", driver)
        fakenvml.inject(control, "mig-create 0 3g.20gb 2")
        after = set(
            wait_for(
                lambda: devices_of(api) if len(devices_of(api)) > len(before) else None,
                "a new MIG device",
                driver,
            )
        )
        (new,) = after - before
        assert new.startswith("gpu-0-mig-3g20gb-")  # GPU instance 2 in the first free placement
        kubelet.wait_health(DRIVER, lambda h: (NODE, new) in h, timeout=WAIT)
        fakenvml.inject(control, "mig-destroy 0 2")
        wait_for(lambda: new not in devices_of(api), "the destroyed MIG device gone from the slices", driver)


def test_stale_sockets_replaced_ready_notified_after_serving_sighup_rereads(
    base: Path, api: ApiServer, kubelet: FakeDraKubelet, kubeconfig: Path
) -> None:
    # Sockets a killed driver left: bound once, nobody listening.
    stale = [base / "registry" / f"{DRIVER}-reg.sock", base / "plugins" / DRIVER / "dra.sock"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(path))
    notify_path = base / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(WAIT)
        driver = DraProcess(base, kubeconfig)
        driver.env["NOTIFY_SOCKET"] = str(notify_path)
        with driver:
            message = notify.recv(4096).decode()
            assert "READY=1" in message
            # READY only once both sockets are served: kubelet can register the driver at once.
            assert all(p.is_socket() for p in stale)
            kubelet.wait_registered(DRIVER, timeout=WAIT)
            wait_for(lambda: len(devices_of(api)) == 4, "the slices", driver)
            assert driver.proc is not None
            driver.proc.send_signal(signal.SIGHUP)
            wait_for(
                lambda: "read again: 4 GPU(s), 4 device(s)" in driver.log(), "the SIGHUP re-read", driver
            )
            assert driver.proc.poll() is None and kubelet.connected(DRIVER)
            assert driver.stop() == 0
            assert "STOPPING=1" in notify.recv(4096).decode()
