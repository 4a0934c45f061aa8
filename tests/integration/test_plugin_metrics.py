"""Health people can see (issue 18): `gpunode plugin run` as a real process against the fake kubelet and
fake NVML, its Prometheus endpoint scraped over real HTTP, and its Events and GPUHealthy condition written
to the test API server (real TLS) with a kubelet's own identity (a client certificate for
system:node:NAME, the Node authorizer's permissions, NodeRestriction)."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests import fakenvml
from tests.integration.kubelet import HEALTHY, UNHEALTHY, FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir
from tests.kubeapi.apiserver import JSON_PATCH, ApiServer
from tests.kubeapi.pki import Pki

GPU = "nvidia.com/gpu"
NODE = "gpu-node-1"
WAIT = 60.0  # generous: the machine is shared


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_dir) as k:
        yield k


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(pki) as server:
        server.add_node(NODE)
        server.add_node("other-node")
        server.node_identity(NODE)
        yield server


def kubelet_kubeconfig(directory: Path, api: ApiServer, pki: Pki) -> Path:
    """A kubeconfig like kubeadm's /etc/kubernetes/kubelet.conf: the node's client certificate."""
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
    path = directory / "kubelet.conf"
    path.write_text(yaml.safe_dump(document))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(address: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every sample, over HTTP as Prometheus scrapes."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    found = [v for got, v in samples.get(name, []) if all(got.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def wait_until(check: Callable[[], Any], what: str, plugin: PluginProcess) -> Any:
    deadline = time.monotonic() + WAIT
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}\n{plugin.log()}"
        time.sleep(0.05)


def condition(api: ApiServer) -> dict[str, Any] | None:
    for c in api.node(NODE)["status"]["conditions"]:
        if c["type"] == "GPUHealthy":
            return dict(c)
    return None


def start_plugin(
    socket_dir: Path, api: ApiServer, pki: Pki, control: Path, port: int, *, quiet_period: float
) -> PluginProcess:
    kubeconfig = kubelet_kubeconfig(socket_dir.parent, api, pki)
    env = {
        "GPUNODE_METRICS_ADDRESS": f"127.0.0.1:{port}",
        "GPUNODE_EVENTS_KUBECONFIG": str(kubeconfig),
        "GPUNODE_NODE_NAME": NODE,
    }
    return PluginProcess(
        socket_dir,
        ["--recovery-quiet-period", f"{quiet_period:g}"],
        profile="pcie-4",
        control=control,
        env=env,
    )


def test_xid_changes_metrics_event_and_condition(
    kubelet: FakeKubelet, socket_dir: Path, api: ApiServer, pki: Pki
) -> None:
    control = socket_dir.parent / "nvml-control"
    control.write_text("")
    port = free_port()
    address = f"127.0.0.1:{port}"
    # Long enough for the unhealthy state to be scraped, and for the reporter to write the False condition
    # before the recovery replaces it (it writes only the newest condition), on a busy machine.
    with start_plugin(socket_dir, api, pki, control, port, quiet_period=5) as plugin:
        kubelet.wait_registered(GPU)
        devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        plugin.wait_for_log("health monitor armed")
        plugin.wait_for_log("metrics: serving")

        # Healthy node: every device 1, kubelet's view, a registration, the library's process metrics.
        # kubelet can list the devices before the plugin's event loop has taken the new devices and the
        # registration into the metrics (a scrape may lag kubelet by milliseconds), so wait for all of it.
        def started(s: dict[str, list[tuple[dict[str, str], float]]]) -> bool:
            wanted = (
                "gpunode_resource_devices_allocatable",
                "gpunode_resource_devices_advertised",
                "gpunode_registrations_total",
            )
            # A registration's counter child exists (at 0) before it is incremented, and the delay is
            # observed after: wait for the figures, not only the series.
            return all(s.get(name) for name in wanted) and (
                value(s, "gpunode_registrations_total", resource=GPU) == 1
                and bool(s.get("gpunode_registration_delay_seconds_count"))
            )

        samples = wait_until(
            lambda: (s := scrape(address)) and started(s) and s, "the start never reached the metrics", plugin
        )
        assert value(samples, "gpunode_resource_devices_advertised", resource=GPU) == 4
        assert value(samples, "gpunode_resource_devices_healthy", resource=GPU) == 4
        assert value(samples, "gpunode_resource_devices_allocatable", resource=GPU) == 4
        assert value(samples, "gpunode_registrations_total", resource=GPU) == 1
        assert value(samples, "gpunode_registration_delay_seconds_count", resource=GPU) == 1
        assert "process_cpu_seconds_total" in samples and "process_resident_memory_bytes" in samples
        gpu1 = next(d for d in devices if d.id == value_uuid(samples, "1"))
        labels = {"resource": GPU, "device": gpu1.id, "uuid": gpu1.id, "index": "1"}
        assert value(samples, "gpunode_device_healthy", **labels) == 1
        assert value(samples, "gpunode_device_monitored", **labels) == 1
        assert value(samples, "gpunode_device_last_critical_xid", **labels) == 0
        assert value(samples, "gpunode_device_state_info", **labels, state="healthy", reason="healthy") == 1
        # The condition, written with the node's own certificate as a JSON patch of nodes/status.
        good = wait_until(lambda: (c := condition(api)) and c["status"] == "True" and c, "no True", plugin)
        assert good["reason"] == "GPUsHealthy"

        # Calls are counted and timed; a refusal is counted by reason.
        kubelet.allocate(GPU, [[devices[0].id]])
        import grpc

        with pytest.raises(grpc.RpcError):
            kubelet.allocate(GPU, [["no-such-gpu"]])
        samples = scrape(address)
        assert value(samples, "gpunode_allocations_total", resource=GPU) == 1
        assert value(samples, "gpunode_allocate_duration_seconds_count", resource=GPU) == 1
        assert (
            value(samples, "gpunode_refusals_total", resource=GPU, call="Allocate", reason="invalid_request")
            == 1
        )

        # An Xid: the device, the Event and the condition all say so.
        fakenvml.inject(control, "xid 1 79")
        kubelet.wait_for_devices(GPU, lambda d: any(x.health == UNHEALTHY for x in d))
        samples = wait_until(
            lambda: (s := scrape(address)) and value(s, "gpunode_device_healthy", **labels) == 0 and s,
            "device 1 never unhealthy in the metrics",
            plugin,
        )
        assert value(samples, "gpunode_device_last_critical_xid", **labels) == 79
        assert value(samples, "gpunode_resource_devices_healthy", resource=GPU) == 3
        assert value(samples, "gpunode_resource_devices_allocatable", resource=GPU) == 3
        (info,) = [(lab, v) for lab, v in samples["gpunode_device_state_info"] if lab["device"] == gpu1.id]
        assert info[0]["state"] == "unhealthy" and "Xid 79" in info[0]["reason"]
        bad = wait_until(lambda: (c := condition(api)) and c["status"] == "False" and c, "no False", plugin)
        assert bad["reason"] == "GPUUnhealthy" and gpu1.id in bad["message"] and "Xid 79" in bad["message"]
        assert bad["lastTransitionTime"]
        warning = wait_until(
            lambda: [e for e in api.events if e["reason"] == "GPUUnhealthy"], "no GPUUnhealthy Event", plugin
        )[0]
        assert warning["type"] == "Warning" and warning["metadata"]["namespace"] == "default"
        assert warning["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
        assert gpu1.id in warning["message"] and "Xid 79" in warning["message"]
        assert "nvidia-smi -r -i 1" in warning["message"]  # the fix

        # Recovery after the quiet period: counted, a Normal Event, the condition True again.
        kubelet.wait_for_devices(GPU, lambda d: all(x.health == HEALTHY for x in d) and len(d) == 4)
        samples = wait_until(
            lambda: (s := scrape(address)) and value(s, "gpunode_device_healthy", **labels) == 1 and s,
            "device 1 never healthy again",
            plugin,
        )
        assert value(samples, "gpunode_device_recoveries_total", **labels) == 1
        assert value(samples, "gpunode_device_last_critical_xid", **labels) == 79
        wait_until(
            lambda: [e for e in api.events if e["reason"] == "GPURecovered"], "no GPURecovered", plugin
        )
        back = wait_until(lambda: (c := condition(api)) and c["status"] == "True" and c, "not True", plugin)
        assert back["reason"] == "GPUsHealthy"
        assert value(samples, "gpunode_kube_reports_dropped_total") == 0

    # Every request was the node's own, of the kinds the real API takes, and none was refused.
    for request in api.requests:
        assert request.user == f"system:node:{NODE}" and request.authenticated_by == "certificate"
        assert request.status < 300, request
        if request.method == "PATCH":
            assert request.path == f"/api/v1/nodes/{NODE}/status" and request.content_type == JSON_PATCH
        elif request.method == "POST":
            assert request.path == "/api/v1/namespaces/default/events"
    assert kubelet.violations == []


def value_uuid(samples: dict[str, list[tuple[dict[str, str], float]]], index: str) -> str:
    (uuid,) = {lab["uuid"] for lab, _ in samples["gpunode_device_healthy"] if lab["index"] == index}
    return uuid


def test_a_hanging_api_never_delays_health_or_allocate(
    kubelet: FakeKubelet, socket_dir: Path, api: ApiServer, pki: Pki
) -> None:
    """Every API request hangs (far longer than the test): kubelet still sees the Xid and Allocate is
    answered, while not one Event or condition write has completed."""
    control = socket_dir.parent / "nvml-control"
    control.write_text("")
    api.delay_next(600.0, count=1000)  # answers only when the server stops
    port = free_port()
    # No recovery: the unhealthy GPU stays so until the test has seen it everywhere.
    with start_plugin(socket_dir, api, pki, control, port, quiet_period=0) as plugin:
        kubelet.wait_registered(GPU)
        devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        plugin.wait_for_log("health monitor armed")
        fakenvml.inject(control, "xid 2 79")
        kubelet.wait_for_devices(GPU, lambda d: any(x.health == UNHEALTHY for x in d))
        kubelet.allocate(GPU, [[devices[0].id]])
        # The device gauges follow the plugin's event loop, which takes the health change after the
        # ListAndWatch stream has sent it: a scrape can come between the two, so wait for the loop.
        samples = wait_until(
            lambda: (
                (s := scrape(f"127.0.0.1:{port}"))
                and value(s, "gpunode_resource_devices_healthy", resource=GPU) == 3
                and s
            ),
            "the Xid never reached the metrics",
            plugin,
        )
        assert value(samples, "gpunode_allocations_total", resource=GPU) == 1
        # Nothing reached the API: the plugin did all of the above with its requests still hanging.
        assert api.requests == [] and api.events == []
        assert condition(api) is None
