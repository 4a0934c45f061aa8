"""`gpunode doctor`'s DRA findings end to end: `kubelet.api`, `dra.driver`, `dra.duplicate`, `dra.slices` and
`runtime.cdi`. A kubelet node's files under a short temp root (a unix socket path must fit in 107 bytes),
registration sockets served by a tiny Registration server on gpunode's stubs over real gRPC, fake
device-plugin sockets (mknod), the real pynvml on the fake libnvidia-ml.so.1, and the test API server
(tests/kubeapi, `server.dra`) over real TLS for the slices."""

from __future__ import annotations

import base64
import importlib
import json
import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.cli.main import main
from gpunode.doctor.checks import Context
from gpunode.doctor.dra import check_dra_driver
from gpunode.dra.api import pluginregistration_pb2 as reg_pb
from gpunode.dra.api import pluginregistration_pb2_grpc as reg_grpc
from gpunode.dra.slices import SliceSettings, build_slices
from gpunode.errors import ExitCode
from gpunode.host import Host, SubprocessRunner
from gpunode.nvml.discovery import discover
from tests.conftest import Node, healthy_node
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.dra import SLICES
from tests.kubeapi.pki import Pki

grpc: Any = importlib.import_module("grpc")
_reg: Any = reg_grpc

DRIVER = "gpu.nvidia.com"
REGISTRY = "/var/lib/kubelet/plugins_registry"
REG = f"{REGISTRY}/{DRIVER}-reg.sock"
DRA_SOCK = f"/var/lib/kubelet/plugins/{DRIVER}/dra.sock"
PLUGIN_DIR = f"/var/lib/kubelet/plugins/{DRIVER}"
DP_SOCKET = "/var/lib/kubelet/device-plugins/gpunode-nvidia.com-gpu.sock"
TOKEN = "dra-doctor-token-7c1e-never-shown"  # noqa: S105 (a test token)
NODE = "gpu-node-1"


class Registration(reg_grpc.RegistrationServicer):
    """What a DRA driver answers kubelet on its registration socket; counts the GetInfo calls."""

    def __init__(self, name: str, endpoint: str, versions: tuple[str, ...], plugin_type: str) -> None:
        self.info = reg_pb.PluginInfo(
            type=plugin_type, name=name, endpoint=endpoint, supported_versions=list(versions)
        )
        self.calls = 0

    def GetInfo(self, request: Any, context: Any) -> reg_pb.PluginInfo:
        self.calls += 1
        return self.info

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> reg_pb.RegistrationStatusResponse:
        return reg_pb.RegistrationStatusResponse()


@pytest.fixture
def node(fake_nvml: Callable[..., None]) -> Iterator[Node]:
    """The healthy node of tests/conftest.py (8 A100s, containerd with enable_cdi, kubelet), under a short
    root, with no device plugin: each test adds the side it needs."""
    fake_nvml("dgx-a100")
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="d9-") as tmp:
        n = healthy_node(Path(tmp) / "r")
        n.remove(DP_SOCKET)
        n.services["gpunode-device-plugin.service"] = "inactive"
        yield n


@pytest.fixture
def serve(node: Node) -> Iterator[Callable[..., Registration]]:
    """Serve Registration on a socket of the node (default: the driver's own registration socket)."""
    servers: list[Any] = []

    def start(
        socket: str = REG,
        *,
        name: str = DRIVER,
        endpoint: str = DRA_SOCK,
        versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
        plugin_type: str = "DRAPlugin",
    ) -> Registration:
        path = node.root / socket.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        servicer = Registration(name, endpoint, versions, plugin_type)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        _reg.add_RegistrationServicer_to_server(servicer, server)
        assert server.add_insecure_port(f"unix:{path}") != 0
        server.start()
        servers.append(server)
        return servicer

    yield start
    for server in servers:
        server.stop(None).wait()


def doctor(
    node: Node, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, dict[str, dict[str, Any]]]:
    code = main(["doctor", "--json", *args], host=node.host())
    out, err = capsys.readouterr()
    assert "Traceback" not in err and TOKEN not in out + err
    report = json.loads(out)
    checks = {c["id"]: c for c in report["checks"]}
    assert len(checks) == len(report["checks"])
    for check in report["checks"]:
        if check["status"] in ("warn", "fail"):
            assert check["fix"], check
    return code, checks


def dra_node(node: Node, serve: Callable[..., Registration]) -> Registration:
    """gpunode's driver as it runs: its DRA socket, its registration socket answering, its checkpoint."""
    node.socket(DRA_SOCK)
    node.file(f"{PLUGIN_DIR}/gpunode-checkpoint.json", "{}")
    return serve()


# -- kubelet.api -----------------------------------------------------------------------------------------


def test_device_plugin_only(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.socket(DP_SOCKET)
    node.file(
        "/run/gpunode/plugin-status.json",
        json.dumps({"resources": [{"name": "nvidia.com/gpu", "registered": True}]}),
    )
    code, checks = doctor(node, capsys)
    api = checks["kubelet.api"]
    assert code == ExitCode.OK
    assert api["status"] == "ok" and api["summary"].startswith("the device plugin API serves the GPUs")
    assert DP_SOCKET in api["summary"] and "registered: nvidia.com/gpu" in api["detail"]
    for fid in ("dra.driver", "dra.slices", "runtime.cdi"):
        assert checks[fid]["status"] == "skip", checks[fid]
    assert "dra.duplicate" not in checks


def test_nvidias_device_plugin_counts_as_the_device_plugin(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    node.socket("/var/lib/kubelet/device-plugins/nvidia-gpu.sock")
    dra_node(node, serve)
    code, checks = doctor(node, capsys)
    assert code == ExitCode.UNHEALTHY
    assert checks["kubelet.api"]["status"] == "fail"
    assert "nvidia-gpu.sock" in checks["kubelet.api"]["detail"]


def test_dra_only(node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]) -> None:
    registration = dra_node(node, serve)
    code, checks = doctor(node, capsys)
    assert checks["kubelet.api"]["status"] == "ok"
    assert checks["kubelet.api"]["summary"] == f"DRA serves the GPUs: driver {DRIVER} ({REG})"
    driver = checks["dra.driver"]
    assert driver["status"] == "ok", driver
    assert driver["summary"] == (
        f"DRA driver {DRIVER} registered: GetInfo answers, endpoint {DRA_SOCK} "
        "(gpunode's checkpoint is there)"
    )
    assert driver["detail"] == "services: v1.DRAPlugin, v1beta1.DRAPlugin"
    assert registration.calls == 1
    # No device plugin is right on a DRA node: neither `plugin` nor `node.capacity` fails for it.
    assert checks["plugin"]["status"] == "skip" and "DRA serves the GPUs" in checks["plugin"]["summary"]
    assert checks["node.capacity"]["status"] == "skip"
    assert checks["dra.slices"]["status"] == "skip"
    assert "no Kubernetes API credentials" in checks["dra.slices"]["summary"]
    assert checks["runtime.cdi"]["status"] == "ok"
    assert checks["runtime.cdi"]["summary"] == "containerd: CDI is enabled (/etc/containerd/config.toml)"
    assert "dra.duplicate" not in checks
    assert code == ExitCode.OK


def test_both_apis_is_a_failure(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    node.socket(DP_SOCKET)
    dra_node(node, serve)
    code, checks = doctor(node, capsys)
    api = checks["kubelet.api"]
    assert code == ExitCode.UNHEALTHY
    assert api["status"] == "fail" and api["summary"].startswith("both kubelet APIs advertise")
    assert "DRAExtendedResource" in api["detail"] and "allocatable" in api["detail"]
    assert "gpunode plugin uninstall" in api["fix"]


def test_neither_api(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    _, checks = doctor(node, capsys)
    assert checks["kubelet.api"]["status"] == "warn"
    assert checks["kubelet.api"]["summary"].startswith("neither kubelet API serves the GPUs")
    assert checks["plugin"]["status"] == "fail"  # as before: no plugin and no DRA


def test_without_kubelet_everything_is_skipped(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.remove("/usr/bin/kubelet")
    _, checks = doctor(node, capsys)
    for fid in ("kubelet.api", "dra.driver", "dra.slices", "runtime.cdi"):
        assert checks[fid]["status"] == "skip", checks[fid]


# -- dra.driver ----------------------------------------------------------------------------------------


def test_a_registration_socket_nobody_answers(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.socket(REG)  # a socket file left behind: nothing listens on it
    node.socket(DRA_SOCK)
    code, checks = doctor(node, capsys)
    driver = checks["dra.driver"]
    assert code == ExitCode.UNHEALTHY
    assert driver["status"] == "fail"
    assert (
        driver["summary"] == f"{REG} does not answer GetInfo within 1 s: kubelet cannot register the driver"
    )
    assert driver["detail"].startswith("UNAVAILABLE") and REG in driver["fix"]


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"versions": ("v1alpha3.DRAPlugin",)}, "it offers v1alpha3.DRAPlugin: kubelet needs v1.DRAPlugin"),
        ({"plugin_type": "CSIPlugin"}, "its type is 'CSIPlugin', not 'DRAPlugin'"),
        ({"endpoint": "/var/lib/kubelet/plugins/elsewhere/dra.sock"}, "is not a socket: kubelet cannot call"),
    ],
)
def test_an_answer_kubelet_refuses(
    node: Node,
    serve: Callable[..., Registration],
    capsys: pytest.CaptureFixture[str],
    kwargs: dict[str, Any],
    problem: str,
) -> None:
    node.socket(DRA_SOCK)
    serve(**kwargs)
    code, checks = doctor(node, capsys)
    driver = checks["dra.driver"]
    assert code == ExitCode.UNHEALTHY and driver["status"] == "fail"
    assert driver["summary"].startswith(f"{REG} answers, but kubelet refuses it: ")
    assert problem in driver["summary"]


def test_the_dra_socket_missing(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    serve()
    _, checks = doctor(node, capsys)
    assert checks["dra.driver"]["status"] == "fail"
    assert f"its endpoint {DRA_SOCK} is not a socket" in checks["dra.driver"]["summary"]


def test_a_dra_socket_without_registration(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.socket(DRA_SOCK)
    _, checks = doctor(node, capsys)
    assert checks["dra.driver"]["status"] == "fail"
    assert checks["dra.driver"]["summary"] == f"no {REG}: kubelet does not know the DRA driver {DRIVER}"


def test_a_second_driver_of_the_same_name(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    dra_node(node, serve)
    other = "/var/lib/kubelet/plugins/nvidia-dra/dra.sock"
    node.socket(other)
    serve(f"{REGISTRY}/nvidia-dra-reg.sock", endpoint=other)
    code, checks = doctor(node, capsys)
    duplicate = checks["dra.duplicate"]
    assert code == ExitCode.UNHEALTHY and duplicate["status"] == "fail"
    assert duplicate["summary"] == f"two DRA drivers named {DRIVER} on this node: 2 endpoints"
    assert f"{REGISTRY}/nvidia-dra-reg.sock → {other}" in duplicate["detail"]
    assert "helm uninstall" in duplicate["fix"]


def test_the_registration_names_another_endpoint_than_gpunodes(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    node.socket(DRA_SOCK)  # gpunode's DRA socket, served, but the registration names another driver's
    other = "/var/lib/kubelet/plugins/nvidia/dra.sock"
    node.socket(other)
    serve(endpoint=other)
    _, checks = doctor(node, capsys)
    assert checks["dra.driver"]["status"] == "ok"
    duplicate = checks["dra.duplicate"]
    assert duplicate["status"] == "fail"
    assert f"{DRA_SOCK} (gpunode's DRA socket) is served but registered by none" in duplicate["detail"]


def test_nvidias_checkpoint_beside_gpunodes(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    dra_node(node, serve)
    node.file(f"{PLUGIN_DIR}/checkpoint.json", "{}")
    code, checks = doctor(node, capsys)
    duplicate = checks["dra.duplicate"]
    assert code == ExitCode.UNHEALTHY and duplicate["status"] == "fail"
    assert f"NVIDIA's checkpoint {PLUGIN_DIR}/checkpoint.json is beside gpunode's" in duplicate["summary"]


def test_nvidias_driver_alone_is_fine(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    node.socket(DRA_SOCK)
    node.file(f"{PLUGIN_DIR}/checkpoint.json", "{}")
    serve()
    _, checks = doctor(node, capsys)
    assert checks["dra.driver"]["status"] == "ok"
    assert checks["dra.driver"]["summary"].endswith("(NVIDIA's checkpoint is there)")
    assert "dra.duplicate" not in checks


def test_under_root_no_socket_is_dialled(node: Node, serve: Callable[..., Registration]) -> None:
    registration = dra_node(node, serve)
    host = Host(root=node.root, runner=SubprocessRunner(), env={"PATH": "/usr/sbin:/usr/bin"}, euid=0)
    findings = list(check_dra_driver(Context(host=host, discover=discover)))
    assert [(f.id, f.status.value) for f in findings] == [("dra.driver", "ok")]
    assert (
        findings[0].summary
        == f"DRA driver {DRIVER}: {REG} and {DRA_SOCK} present (GetInfo not asked: --root)"
    )
    assert registration.calls == 0


# -- runtime.cdi ---------------------------------------------------------------------------------------


def test_dra_with_containerd_17_without_enable_cdi_warns(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    dra_node(node, serve)
    config = node.root / "etc/containerd/config.toml"
    config.write_text(config.read_text().replace("enable_cdi = true\n", ""))
    code, checks = doctor(node, capsys)
    cdi = checks["runtime.cdi"]
    assert cdi["status"] == "warn"
    assert cdi["summary"] == (
        "containerd 1.7: enable_cdi is not set in /etc/containerd/config.toml: DRA claims' containers get "
        "no GPU"
    )
    assert "gpunode configure-runtime containerd --cdi" in cdi["fix"]
    assert code == ExitCode.OK  # a warning


def test_dra_with_containerd_16_warns_to_upgrade(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    dra_node(node, serve)
    node.runner.answer(
        ["containerd", "--version"], stdout="containerd github.com/containerd/containerd v1.6.20 x\n"
    )
    _, checks = doctor(node, capsys)
    assert checks["runtime.cdi"]["status"] == "warn"
    assert checks["runtime.cdi"]["summary"].startswith("containerd 1.6 does not read the CDI ids")


def test_dra_with_crio_reads_its_cdi_dirs(
    node: Node, serve: Callable[..., Registration], capsys: pytest.CaptureFixture[str]
) -> None:
    dra_node(node, serve)
    node.program("crio")
    node.file(
        "/var/lib/kubelet/config.yaml",
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
        "containerRuntimeEndpoint: unix:///var/run/crio/crio.sock\n",
    )
    node.file("/etc/crio/crio.conf.d/10-cdi.conf", '[crio.runtime]\ncdi_spec_dirs = ["/etc/cdi"]\n')
    _, checks = doctor(node, capsys)
    cdi = checks["runtime.cdi"]
    assert cdi["status"] == "warn" and "cdi_spec_dirs leaves out /var/run/cdi" in cdi["summary"]
    node.file(
        "/etc/crio/crio.conf.d/10-cdi.conf", '[crio.runtime]\ncdi_spec_dirs = ["/etc/cdi", "/run/cdi"]\n'
    )
    _, checks = doctor(node, capsys)
    assert checks["runtime.cdi"]["status"] == "ok"


# -- dra.slices ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(pki, tokens={TOKEN: "doctor"}, allow=[("doctor", "list", "resourceslices")]) as server:
        server.add_node(NODE)
        yield server


@pytest.fixture
def api_node(node: Node, serve: Callable[..., Registration], api: ApiServer, pki: Pki) -> Node:
    """gpunode's driver running on gpu-node-1, with root's kubeconfig for the test API server."""
    dra_node(node, serve)
    node.file("/etc/hostname", f"{NODE}\n")
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "test",
                "cluster": {
                    "server": api.url,
                    "certificate-authority-data": base64.b64encode(pki.ca.cert.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": "doctor", "user": {"token": TOKEN}}],
        "contexts": [{"name": "doctor", "context": {"cluster": "test", "user": "doctor"}}],
        "current-context": "doctor",
    }
    node.file("/root/.kube/config", yaml.safe_dump(kubeconfig), mode=0o600)
    return node


def publish(api: ApiServer, slices: list[dict[str, Any]]) -> None:
    for s in slices:
        api.dra.put(SLICES, s)


def current_slices(node: Node, generation: int = 1) -> list[dict[str, Any]]:
    return build_slices(discover(node.host()), {}, SliceSettings(NODE, DRIVER), generation)


def test_current_slices(api_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    publish(api, current_slices(api_node))
    code, checks = doctor(api_node, capsys)
    assert checks["dra.slices"] == {
        "id": "dra.slices",
        "status": "ok",
        "summary": f"pool {NODE}: 1 slice(s), generation 1, 8 device(s), as the node's GPUs are now",
        "detail": None,
        "fix": None,
    }
    assert code == ExitCode.OK


def test_no_slices(api_node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = doctor(api_node, capsys)
    assert code == ExitCode.UNHEALTHY and checks["dra.slices"]["status"] == "fail"
    assert checks["dra.slices"]["summary"].startswith(f"no ResourceSlices of driver {DRIVER} for node {NODE}")


def test_stale_slices(api_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    (stale,) = current_slices(api_node)
    devices = stale["spec"]["devices"]
    stale["spec"]["devices"] = [*devices[:6], dict(devices[0], name="gpu-99")]
    publish(api, [stale])
    _, checks = doctor(api_node, capsys)
    finding = checks["dra.slices"]
    assert finding["status"] == "fail" and "is not current" in finding["summary"]
    assert "not published: gpu-6, gpu-7" in finding["detail"]
    assert "published, but not on the node now: gpu-99" in finding["detail"]


def test_an_incomplete_pool(api_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    (one,) = current_slices(api_node, generation=2)
    one["spec"]["pool"]["resourceSliceCount"] = 2
    old = current_slices(api_node, generation=1)[0]
    old["metadata"]["name"] = "older"
    publish(api, [one, old])
    _, checks = doctor(api_node, capsys)
    finding = checks["dra.slices"]
    assert finding["status"] == "fail"
    assert finding["summary"] == f"pool {NODE} (generation 2) is incomplete: 1 of 2 slices"


def test_slices_not_compared_with_simulated_gpus(
    api_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    _, checks = doctor(api_node, capsys, "--simulate", "pcie-4")
    assert checks["dra.slices"]["status"] == "skip"
    assert checks["dra.slices"]["summary"].endswith("(simulated: pcie-4)")
    assert api.requests == []
