"""Issue 18's pieces without processes: the health tracker's transitions, the reporter's bound and rate
limit (the event loop never waits on the API), the condition's patch ops, the metrics' exposition and the
new options' checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpunode.errors import ApiError, ConfigError
from gpunode.host import Host
from gpunode.kube.client import KubeClient
from gpunode.kube.condition import condition_ops
from gpunode.kube.credentials import Credentials, Pem
from gpunode.kube.events import NodeReporter
from gpunode.nvml.model import Gpu, Inventory
from gpunode.plugin.config import load_config
from gpunode.plugin.devices import DeviceRegistry, Sharing, Unit, build_resources
from gpunode.plugin.healthreport import DeviceRecord, HealthReporter, HealthTracker, Transition
from gpunode.plugin.metrics import PluginMetrics
from gpunode.plugin.observe import DeferredReporter
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.pki import Pki

GPU = "nvidia.com/gpu"


def registry(gpus: int = 2, replicas: int = 1) -> DeviceRegistry:
    inventory = Inventory(
        None,
        None,
        None,
        tuple(Gpu(index=i, uuid=f"GPU-{i:04d}", name="A100", minor=i, numa_node=0) for i in range(gpus)),
    )
    resources = build_resources(
        inventory,
        resource_name="nvidia.com/gpu",
        mig_strategy="none",
        device_id_strategy="uuid",
        sharing=Sharing(replicas, False, ()),
    )
    return DeviceRegistry(resources)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tracker_records_transitions_xid_and_recoveries_once_per_gpu() -> None:
    clock = Clock()
    reg = registry(gpus=2, replicas=2)
    tracker = HealthTracker(clock)
    assert tracker.update(reg) == []  # all healthy at first: nothing to tell
    clock.now = 110.0
    reg.mark(Unit(1), "Xid 79 (GPU has fallen off the bus)")
    changes = tracker.update(reg)
    assert [(t.device.uuid, t.healthy) for t in changes] == [("GPU-0001", False)]  # not one per replica
    bad = [r for r in tracker.records() if not r.healthy]
    assert len(bad) == 2 and all(r.last_critical_xid == 79 and r.since == 110.0 for r in bad)
    assert [r.device.uuid for r in tracker.unhealthy()] == ["GPU-0001"]
    clock.now = 130.0
    reg.mark(Unit(1), None)
    (back,) = tracker.update(reg)
    assert back.healthy and "Xid 79" in back.reason  # the recovery says what it recovered from
    again = [r for r in tracker.records() if r.device.gpu_index == 1]
    assert all(r.healthy and r.recoveries == 1 and r.last_critical_xid == 79 for r in again)
    assert tracker.update(reg) == []


def test_metrics_exposition_names_and_values() -> None:
    reg = registry(gpus=2)
    tracker = HealthTracker()
    reg.mark(Unit(0), "Xid 48 (double-bit ECC error)")
    tracker.update(reg)
    metrics = PluginMetrics(tracker)
    metrics.registered("nvidia.com/gpu", restart=False, delay=0.5)
    metrics.registered("nvidia.com/gpu", restart=True, delay=0.2)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for s in f.samples
    }
    labels = (("device", "GPU-0000"), ("index", "0"), ("resource", "nvidia.com/gpu"), ("uuid", "GPU-0000"))
    assert samples[("gpunode_device_healthy", labels)] == 0
    assert samples[("gpunode_device_last_critical_xid", labels)] == 48
    assert samples[("gpunode_resource_devices_healthy", (("resource", "nvidia.com/gpu"),))] == 1
    assert samples[("gpunode_registrations_total", (("resource", "nvidia.com/gpu"),))] == 2
    assert samples[("gpunode_kubelet_restarts_total", ())] == 1
    assert samples[("gpunode_registration_delay_seconds_count", (("resource", "nvidia.com/gpu"),))] == 2
    # Time-sliced: the resource counts every replica, the device series are one set per GPU.
    shared = registry(gpus=2, replicas=4)
    shared.mark(Unit(1), "Xid 79 (GPU has fallen off the bus)")
    tracker = HealthTracker()
    tracker.update(shared)
    families = {
        f.name: f for f in text_string_to_metric_families(PluginMetrics(tracker).exposition().decode())
    }
    assert [s.value for s in families["gpunode_resource_devices_advertised"].samples] == [8]
    assert [s.value for s in families["gpunode_resource_devices_healthy"].samples] == [4]
    assert sorted((s.labels["device"], s.value) for s in families["gpunode_device_healthy"].samples) == [
        ("GPU-0000", 1.0),
        ("GPU-0001", 0.0),
    ]
    # Prometheus conventions: the prefix (or the library's process_/python_), counters end in _total.
    for name, _ in samples:
        assert name.startswith(("gpunode_", "process_", "python_")), name


def test_condition_ops_add_keep_replace_remove() -> None:
    node: dict[str, object] = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    wanted = {"type": "GPUHealthy", "status": "True", "reason": "GPUsHealthy", "message": "fine"}
    ops = condition_ops(node, wanted, now="2026-01-01T00:00:00Z")
    assert ops == [
        {
            "op": "add",
            "path": "/status/conditions/-",
            "value": {
                **wanted,
                "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            },
        }
    ]
    node["status"]["conditions"].append(ops[0]["value"])  # type: ignore[index]
    assert condition_ops(node, wanted) == []  # the same: no write
    worse = {**wanted, "status": "False", "reason": "GPUUnhealthy", "message": "1 unhealthy"}
    test, replace = condition_ops(node, worse, now="2026-01-02T00:00:00Z")
    assert test == {"op": "test", "path": "/status/conditions/1/type", "value": "GPUHealthy"}
    assert replace["value"]["lastTransitionTime"] == "2026-01-02T00:00:00Z"
    same_status = {**wanted, "message": "other"}
    _, replace = condition_ops(node, same_status, now="2026-01-03T00:00:00Z")
    assert replace["value"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"  # the status did not change
    assert condition_ops(node, None)[1] == {"op": "remove", "path": "/status/conditions/1"}
    assert condition_ops({"status": {}}, None) == []
    # A heartbeat renews an unchanged condition's lastHeartbeatTime and keeps its transition.
    _, beat = condition_ops(node, wanted, now="2026-01-04T00:00:00Z", heartbeat=True)
    assert beat["value"]["lastHeartbeatTime"] == "2026-01-04T00:00:00Z"
    assert beat["value"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"


class HangingClient:
    """A KubeClient whose every request blocks until released: the API down or stuck."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.finished = 0

    def _hang(self) -> dict[str, object]:
        self.entered.set()
        self.release.wait(60)
        self.finished += 1
        raise ApiError("the API hangs")

    def create_event(self, namespace: str, event: dict[str, object]) -> dict[str, object]:
        return self._hang()

    def update_node_status(self, name: str, compute: object) -> dict[str, object]:
        return self._hang()

    def close(self) -> None:
        pass


def test_reporter_never_blocks_and_counts_what_it_drops() -> None:
    """With the API hanging, reports beyond the queue and the rate limit are dropped and counted; every
    call from the event loop returns without waiting for the API."""
    client = HangingClient()
    reporter = NodeReporter(
        "node-1", lambda: cast(KubeClient, client), burst=3, refill=60.0, queue_size=2, clock=Clock()
    )
    try:
        reporter.register_failed("example.com/first", "UNAVAILABLE", refused=False)
        assert client.entered.wait(60)  # the thread is inside a request that does not return
        for n in range(10):
            reporter.register_failed(f"example.com/r{n}", "UNAVAILABLE", refused=False)
            reporter.condition([], served=True)
        # Every call above returned while that request still hangs.
        assert client.finished == 0
        # 3 Events passed the rate limit (the burst), the queue holds 2 of them: 8 of 11 dropped.
        assert reporter.dropped == 8
        assert reporter.sent == 0
    finally:
        client.release.set()
        reporter.stop(timeout=30)
    assert reporter.failed >= 1


def test_reporter_is_off_without_the_nodes_kubeconfig(tmp_path: Path) -> None:
    host = Host(root=tmp_path, env={})
    config = load_config(host, env={"GPUNODE_NODE_NAME": "n1"})
    assert NodeReporter.from_node_credentials(host, config) is None


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("", True),
        ("127.0.0.1:9402", True),
        ("0.0.0.0:9402", True),
        ("[::1]:9402", True),
        ("9402", False),
        ("localhost:", False),
        ("::1:9402", False),
        ("127.0.0.1:70000", False),
    ],
)
def test_metrics_address_is_checked(tmp_path: Path, value: str, ok: bool) -> None:
    host = Host(root=tmp_path, env={})
    if ok:
        assert load_config(host, env={"GPUNODE_METRICS_ADDRESS": value}).metrics_address == value
    else:
        with pytest.raises(ConfigError, match="GPUNODE_METRICS_ADDRESS"):
            load_config(host, env={"GPUNODE_METRICS_ADDRESS": value})


def test_a_busy_metrics_port_is_a_clear_error() -> None:
    first = PluginMetrics.serve("127.0.0.1:0", HealthTracker())
    try:
        with pytest.raises(ConfigError, match="cannot listen") as err:
            PluginMetrics.serve(f"127.0.0.1:{first.port}", HealthTracker())
        assert err.value.fix and "metrics.address" in err.value.fix
    finally:
        first.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


def node_client(api: ApiServer, pki: Pki, node: str) -> KubeClient:
    """A client with kubelet's identity for `node`: a certificate for system:node:NODE, group system:nodes."""
    pair = pki.client(f"system:node:{node}", ["system:nodes"])
    ca = Pem(origin="test CA", path=pki.ca.cert)
    cert = (Pem(origin="node cert", path=pair.cert), Pem(origin="node key", path=pair.key))
    return KubeClient(Credentials(server=api.url, source="test kubelet.conf", verify=ca, cert=cert))


def wait_for(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60  # generous: a shared machine
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_registration_failures_are_one_event_per_streak(pki: Pki) -> None:
    with ApiServer(pki) as api:
        api.add_node("node-1")
        api.node_identity("node-1")
        reporter = NodeReporter("node-1", lambda: node_client(api, pki, "node-1"))
        try:
            for _ in range(5):  # a retry every few seconds: one Event for the streak
                reporter.register_failed(GPU, "UNAVAILABLE: connect failed", refused=False)
            reporter.registered(GPU)
            reporter.registered(GPU)  # registered again, no failure in between: nothing to say
            wait_for(lambda: len(api.events) == 2)
        finally:
            reporter.stop(timeout=30)
        failed, back = api.events
        assert failed["reason"] == "DevicePluginRegistrationFailed" and failed["type"] == "Warning"
        assert "UNAVAILABLE" in failed["message"] and "systemctl status kubelet" in failed["message"]
        assert back["reason"] == "DevicePluginRegistered" and back["type"] == "Normal"
        assert reporter.sent == 2 and reporter.failed == 0


def test_the_condition_is_renewed_while_nothing_changes(pki: Pki) -> None:
    """A heartbeat keeps GPUHealthy's lastHeartbeatTime current, so a condition left by a plugin that is
    gone (nobody renews it) can be told from a current one."""
    with ApiServer(pki) as api:
        api.add_node("node-1")
        api.node_identity("node-1")
        reporter = NodeReporter("node-1", lambda: node_client(api, pki, "node-1"), heartbeat=0.3)

        def gpu_healthy() -> dict[str, str] | None:
            found = [c for c in api.node("node-1")["status"]["conditions"] if c["type"] == "GPUHealthy"]
            return found[0] if found else None

        try:
            reporter.condition([], served=True)
            wait_for(lambda: gpu_healthy() is not None)
            first = gpu_healthy()
            assert first is not None
            # The times have whole seconds: wait for a renewal that shows.
            wait_for(lambda: (gpu_healthy() or first)["lastHeartbeatTime"] != first["lastHeartbeatTime"])
        finally:
            reporter.stop(timeout=30)
        renewed = gpu_healthy()
        assert renewed is not None
        assert renewed["lastTransitionTime"] == first["lastTransitionTime"]
        assert (renewed["status"], renewed["reason"]) == ("True", "GPUsHealthy")
        assert reporter.failed == 0


def test_another_nodes_identity_is_refused_and_counted(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    """NodeRestriction: kubelet credentials of node-2 may not patch node-1's status. The reporter logs
    the refusal once, with the fix, and counts it; nothing is written."""
    with ApiServer(pki) as api:
        api.add_node("node-1")
        api.node_identity("node-2")
        reporter = NodeReporter("node-1", lambda: node_client(api, pki, "node-2"))
        try:
            reporter.condition([], served=True)
            wait_for(lambda: reporter.failed >= 1)
        finally:
            reporter.stop(timeout=30)
        assert all(c["type"] != "GPUHealthy" for c in api.node("node-1")["status"]["conditions"])
        assert [r.status for r in api.requests if r.method == "PATCH"] == [403]
        assert 'may not modify node "node-1" (NodeRestriction)' in caplog.text
        assert 'may change only their own node ("node-2")' in caplog.text


def test_prometheus_client_is_imported_by_the_metrics_module_only(tmp_path: Path) -> None:
    """The library is the plugin's, and only when metrics.address is set: doctor, the CLI and a plugin
    without metrics never load it."""
    import re
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    importers = sorted(
        str(p.relative_to(repo))
        for p in (repo / "gpunode").rglob("*.py")
        if re.search(r"^\s*(import|from) prometheus_client\b", p.read_text(), re.MULTILINE)
    )
    assert importers == ["gpunode/plugin/metrics.py"]
    code = (
        "import sys, gpunode.plugin.lifecycle, gpunode.plugin.observe, gpunode.kube.events, "
        "gpunode.doctor.prometheus, gpunode.cli.main; print('prometheus_client' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert out.stdout.strip() == "False"
    # A plugin with events on (the default) on a node without kubelet's kubeconfig, metrics off: neither
    # the library nor the Kubernetes client (requests, PyYAML) is loaded.
    code = (
        "import sys; from gpunode.host import Host; from gpunode.plugin.config import PluginConfig; "
        "from gpunode.plugin.observe import start_observer; "
        "start_observer(Host(root=sys.argv[1], env={}), PluginConfig(), simulated=False); "
        "loaded = ('prometheus_client', 'requests', 'yaml', 'gpunode.kube.client'); "
        "print(sorted(m for m in loaded if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo,
    )
    assert out.stdout.strip() == "[]"


class Recorder(HealthReporter):
    """A reporter that records what it is told."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.done = threading.Event()

    def counts(self) -> tuple[int, int, int]:
        return len(self.calls), 0, 0

    def device_changed(self, transition: Transition) -> None:
        self.calls.append(f"device {transition.device.uuid} {transition.healthy}")

    def condition(self, unhealthy: list[DeviceRecord], *, served: bool) -> None:
        self.calls.append(f"condition {len(unhealthy)} {served}")
        self.done.set()

    def registered(self, resource: str) -> None:
        self.calls.append(f"registered {resource}")

    def register_failed(self, resource: str, why: str, *, refused: bool) -> None:
        self.calls.append(f"failed {resource}")

    def stop(self) -> None:
        self.calls.append("stop")


def test_the_kubernetes_client_waits_for_the_first_registration() -> None:
    """Until the plugin has registered (or tried to), no reporter is built (the Kubernetes client is not
    imported); what was reported meanwhile is handed over in order, the condition only as the newest."""
    real = Recorder()
    built = threading.Event()

    def make() -> HealthReporter:
        built.set()
        return real

    deferred = DeferredReporter(make, delay=3600)
    reg = registry(gpus=1)
    reg.mark(Unit(0), "Xid 79")
    tracker = HealthTracker()
    (transition,) = tracker.update(reg)
    deferred.condition([], served=False)
    deferred.device_changed(transition)
    deferred.condition(tracker.unhealthy(), served=True)
    assert not built.is_set() and real.calls == []
    deferred.registered(GPU)  # the first registration starts it
    assert real.done.wait(60)
    assert real.calls == ["device GPU-0000 False", f"registered {GPU}", "condition 1 True"]
    deferred.condition([], served=True)  # from now on straight through
    assert real.calls[-1] == "condition 0 True"
    assert deferred.counts() == (4, 0, 0)
    deferred.stop()
    assert real.calls[-1] == "stop"
