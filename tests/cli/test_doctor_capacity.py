"""`gpunode doctor`'s `node.capacity` finding end to end: the CLI, a kubelet node's files under a temp root
(tests/conftest.py), the real pynvml on the fake libnvidia-ml.so.1, and the test API server
(tests/kubeapi) over real TLS, found through a kubeconfig under the root or $KUBECONFIG."""

from __future__ import annotations

import base64
import json
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from tests.conftest import Node
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.pki import Pki

TOKEN = "doctor-token-51ac09-never-shown"  # noqa: S105 (a test token)
NODE = "gpu-node-1"
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(pki, tokens={TOKEN: "doctor"}, allow=[("doctor", "get", "nodes")]) as server:
        server.add_node(NODE)
        yield server


@pytest.fixture(autouse=True)
def token_never_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    assert TOKEN not in caplog.text


def kubeconfig(server: str, ca: Path) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": server,
                        "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode(),
                    },
                }
            ],
            "users": [{"name": "doctor", "user": {"token": TOKEN}}],
            "contexts": [{"name": "doctor", "context": {"cluster": "test", "user": "doctor"}}],
            "current-context": "doctor",
        }
    )


@pytest.fixture
def gpu_node(node: Node, api: ApiServer, pki: Pki, fake_nvml: Callable[..., None]) -> Node:
    """The healthy kubelet node of tests/conftest.py, 8 A100s, named gpu-node-1, with root's kubeconfig."""
    fake_nvml("dgx-a100")
    node.file("/etc/hostname", f"{NODE}\n")
    node.file("/root/.kube/config", kubeconfig(api.url, pki.ca.cert), mode=0o600)
    return node


def set_gpus(
    api: ApiServer,
    capacity: str | None,
    allocatable: str | None = None,
    *,
    resource: str = GPU,
    node: str = NODE,
) -> None:
    """The node's resource as kubelet reports it (None: absent); allocatable defaults to capacity."""
    allocatable = capacity if allocatable is None else allocatable

    def change(obj: dict[str, Any]) -> None:
        for field, value in (("capacity", capacity), ("allocatable", allocatable)):
            if value is None:
                obj["status"][field].pop(resource, None)
            else:
                obj["status"][field][resource] = value

    api.modify_node(node, change)


def doctor(
    node: Node, capsys: pytest.CaptureFixture[str], host: Host | None = None
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Run `gpunode doctor --json`: the exit code, the node.capacity finding and the report."""
    code = main(["doctor", "--json"], host=host or node.host())
    out, err = capsys.readouterr()
    assert TOKEN not in out and TOKEN not in err and "Traceback" not in err
    report = json.loads(out)
    (finding,) = [c for c in report["checks"] if c["id"].startswith("node.")]
    return code, finding, report


# -- skipped --------------------------------------------------------------------------------------------


def test_skipped_without_kubelet(gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    gpu_node.remove("/usr/bin/kubelet")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["id"] == "node.capacity" and finding["status"] == "skip"
    assert finding["summary"] == "advertised capacity not checked: no kubelet"
    assert api.requests == []


def test_skipped_without_credentials(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.remove("/root/.kube/config")
    code, finding, report = doctor(gpu_node, capsys)
    assert finding["status"] == "skip"
    assert finding["summary"] == "advertised capacity not checked: no Kubernetes API credentials on this node"
    assert "KUBECONFIG=" in finding["fix"]
    assert code == ExitCode.OK and report["healthy"] is True
    assert api.requests == []


def test_skipped_without_nvml(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str], fake_nvml: Callable[..., None]
) -> None:
    fake_nvml("no-driver")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "skip"
    assert finding["summary"] == "advertised capacity not checked: NVML cannot be used"
    assert api.requests == []


# -- ok ---------------------------------------------------------------------------------------------------


def test_ok_when_capacity_matches_the_gpus(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    set_gpus(api, "8")
    code, finding, report = doctor(gpu_node, capsys)
    assert finding == {
        "id": "node.capacity",
        "status": "ok",
        "summary": f"node {NODE} advertises {GPU}: 8 (8 GPU(s) present)",
        "detail": None,
        "fix": None,
    }
    assert code == ExitCode.OK and report["healthy"] is True
    # One read, as the token's user; nothing written.
    assert [(r.method, r.path, r.user) for r in api.requests] == [("GET", f"/api/v1/nodes/{NODE}", "doctor")]


def test_ok_with_time_slicing_replicas(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.file("/etc/gpunode/plugin.toml", "[time-slicing]\nreplicas = 4\n")
    set_gpus(api, "32")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "ok"
    assert finding["summary"] == f"node {NODE} advertises {GPU}: 32 (8 GPU(s) present, 4 replicas each)"

    set_gpus(api, "8")  # the plugin shares each GPU four ways, kubelet still says one each
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn" and "(expected 32)" in finding["summary"]


def test_ok_with_time_slicing_under_its_own_resource_name(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # rename-by-default: the plugin serves nvidia.com/gpu.shared, and nvidia.com/gpu is rightly absent.
    gpu_node.file("/etc/gpunode/plugin.toml", "[time-slicing]\nreplicas = 2\nrename-by-default = true\n")
    set_gpus(api, None)
    set_gpus(api, "16", resource=f"{GPU}.shared")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "ok", finding
    assert (
        finding["summary"] == f"node {NODE} advertises {GPU}.shared: 16 (8 GPU(s) present, 2 replicas each)"
    )


def test_ok_with_the_plugins_own_resource_name(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.file("/etc/gpunode/plugin.toml", 'resource-name = "example.com/gpu"\n')
    set_gpus(api, "8", resource="example.com/gpu")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "ok", finding
    assert finding["summary"] == f"node {NODE} advertises example.com/gpu: 8 (8 GPU(s) present)"


def test_ok_for_a_node_without_gpus_that_advertises_none(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str], fake_nvml: Callable[..., None]
) -> None:
    fake_nvml("no-gpu")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "ok", finding
    assert finding["summary"] == f"node {NODE} advertises no {GPU} (0 GPU(s) present)"


def test_kubeconfig_from_the_environment(
    gpu_node: Node, api: ApiServer, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.remove("/root/.kube/config")
    gpu_node.file("/etc/gpunode/doctor.conf", kubeconfig(api.url, pki.ca.cert))
    set_gpus(api, "8")
    base = gpu_node.host()
    host = Host(
        root=base.root, runner=base.runner, env={**base.env, "KUBECONFIG": "/etc/gpunode/doctor.conf"}, euid=0
    )
    _, finding, _ = doctor(gpu_node, capsys, host)
    assert finding["status"] == "ok"


def test_node_name_from_kubelet(gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    api.add_node("kubelet-name")
    set_gpus(api, "0")  # gpu-node-1, the host name, says 0: it is not the node asked about
    set_gpus(api, "8", node="kubelet-name")
    gpu_node.file(
        "/var/lib/kubelet/kubeadm-flags.env", 'KUBELET_KUBEADM_ARGS="--hostname-override=Kubelet-Name"\n'
    )
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "ok" and finding["summary"].startswith("node kubelet-name advertises")


# -- failed -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("capacity", "said"), [(None, "no"), ("0", "0")], ids=["missing", "zero"])
def test_fail_when_gpus_are_present_but_none_advertised(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str], capacity: str | None, said: str
) -> None:
    set_gpus(api, capacity)
    code, finding, report = doctor(gpu_node, capsys)
    assert finding["status"] == "fail"
    assert finding["summary"] == f"node {NODE} advertises {said} {GPU} although 8 GPU(s) present"
    assert "cannot be scheduled" in finding["detail"]
    assert "gpunode plugin status" in finding["fix"] and "gpunode-device-plugin" in finding["fix"]
    assert code == ExitCode.UNHEALTHY and report["healthy"] is False


# -- warnings ---------------------------------------------------------------------------------------------


def test_warn_when_the_count_differs(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    set_gpus(api, "4")
    code, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    assert finding["summary"] == f"node {NODE} advertises {GPU}: 4, but 8 GPU(s) present (expected 8)"
    assert finding["fix"]
    assert code == ExitCode.OK  # a warning does not make the node unhealthy


def test_warn_when_a_gpu_was_lost(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str], fake_nvml: Callable[..., None]
) -> None:
    fake_nvml("lost-gpu")  # four L4s, GPU 2 fell off the bus; kubelet still has 4
    set_gpus(api, "4")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    assert finding["summary"] == f"node {NODE} advertises {GPU}: 4, but 3 GPU(s) present (expected 3)"


def test_warn_when_less_is_allocatable(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    set_gpus(api, "8", allocatable="6")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    assert finding["summary"] == f"node {NODE}: {GPU} capacity 8, but only 6 allocatable"
    assert "unhealthy" in finding["detail"]


def test_warn_when_the_node_is_not_registered(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.file("/etc/hostname", "not-registered\n")
    code, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    assert finding["summary"] == "cannot read node not-registered from the Kubernetes API"
    assert f'node "not-registered" does not exist in the cluster at {api.url}' in finding["detail"]
    assert "/root/.kube/config" in finding["detail"]
    assert "kubectl get nodes" in finding["fix"]
    assert code == ExitCode.OK


def test_warn_when_not_allowed_to_read_the_node(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    api.rules.clear()
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    assert 'user "doctor" may not get nodes' in finding["detail"]
    assert "clusterrole" in finding["fix"]


def test_warn_when_the_api_server_is_unreachable(
    gpu_node: Node, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"https://127.0.0.1:{port}"
    gpu_node.file("/root/.kube/config", kubeconfig(url, pki.ca.cert))
    code, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    # One try only: a diagnosis does not wait for retries.
    assert finding["detail"].startswith(
        f"cannot reach the Kubernetes API at {url}/api/v1/nodes/{NODE}: connection refused ("
    )
    assert "tried" not in finding["detail"]
    assert code == ExitCode.OK


def test_warn_when_the_credentials_cannot_be_used(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.file("/root/.kube/config", "clusters: [\n")
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    assert finding["summary"] == "cannot use the Kubernetes API credentials"
    assert "/root/.kube/config is not valid YAML" in finding["detail"]
    assert api.requests == []


def test_warn_when_the_node_has_no_name(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.remove("/etc/hostname")
    code, finding, _ = doctor(gpu_node, capsys)
    assert finding["id"] == "node.capacity" and finding["status"] == "warn"
    assert "cannot tell this node's name" in finding["summary"]
    assert "--node" not in finding["fix"] and "NODE_NAME" in finding["fix"]
    assert code == ExitCode.OK and api.requests == []


def test_warn_within_the_deadline_when_the_api_server_trickles_its_answer(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # One byte every 2 s: each within doctor's 5 s read timeout, so only its overall deadline (3 s to
    # connect + 5 s to read) ends it. Without one, doctor would wait for the server's whole 60 s.
    api.trickle_next(2.0, limit=60.0)
    code, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    assert finding["summary"] == f"cannot read node {NODE} from the Kubernetes API"
    assert finding["detail"].startswith(
        f"the Kubernetes API at {api.url}/api/v1/nodes/{NODE} did not send its whole answer within 8 s"
    )
    assert code == ExitCode.OK
    assert api.streamed < 200


def test_warn_when_the_api_server_sends_a_gigabyte(
    gpu_node: Node, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    api.flood_next(announce=None)
    _, finding, _ = doctor(gpu_node, capsys)
    assert finding["status"] == "warn"
    assert finding["detail"].startswith(
        f"the answer from {api.url}/api/v1/nodes/{NODE} is larger than 16 MiB, far larger than any Node"
    )
    assert api.streamed < 64 * 2**20
