"""The device plugin's health, told to Kubernetes: Events on the Node and the Node condition GPUHealthy.

Written with the node's own identity where the node has one: kubelet's kubeconfig
(/etc/kubernetes/kubelet.conf, user system:node:<name>). What that identity may do decides the requests:
- Events: the Node authorizer lets kubelets write events, and the system:node role grants create on
  core v1 `events`. Each Event is what kubelet itself records about its node: a core v1 Event in the
  `default` namespace (a cluster-scoped object's events live there) whose involvedObject is the Node,
  with the node's name as UID, as kubelet's node reference has it — so no read of the Node is needed.
- The condition: kubelets may patch their own node's status (NodeRestriction refuses other nodes); it is
  one JSON patch of /status/conditions on nodes/status, guarded by the resourceVersion that was read
  (KubeClient.update_node_status), written only when status, reason or message change. kubelet's own
  status updates patch only the condition types it owns, so GPUHealthy stays.

Nothing here may slow the plugin: the event loop only appends to a bounded queue (a full queue drops the
report and counts it) or replaces the wanted condition (only the newest matters); one background thread
does the requests, each with a short timeout and no retries (the next change or the periodic re-check
sends again). Events are rate-limited (a token bucket) so a flapping GPU cannot flood the API.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.kube.client import KubeClient, RetryPolicy, Timeouts
from gpunode.kube.condition import CONDITION, condition_ops, now_rfc3339
from gpunode.kube.credentials import KUBELET_KUBECONFIG
from gpunode.plugin.healthreport import DeviceRecord, HealthReporter, Transition

if TYPE_CHECKING:
    from gpunode.plugin.config import PluginConfig

log = logging.getLogger("gpunode.plugin")

COMPONENT = "gpunode-device-plugin"
EVENT_NAMESPACE = "default"
QUEUE_SIZE = 64
BURST = 10  # events sent at once before the rate limit holds
REFILL = 6.0  # seconds per further event (10 a minute)
TIMEOUTS = Timeouts(connect=3.0, read=5.0, total=8.0)
# The condition's lastHeartbeatTime is renewed this often while nothing changes (kubelet reports its own
# node status every 5 minutes when nothing changes, too): older than two of these, the plugin is gone.
HEARTBEAT = 300.0
XID_CATALOGUE = "https://docs.nvidia.com/deploy/xid-errors/"


def describe(record_or_transition: DeviceRecord | Transition) -> str:
    device = record_or_transition.device
    where = f"GPU {device.gpu_index}" if device.mig is None else f"a MIG device on GPU {device.gpu_index}"
    return f"{record_or_transition.resource} device {device.id} ({where}, {device.uuid})"


def fix_for(reason: str, device_index: int) -> str:
    if "Xid" in reason:
        return (
            f"look the Xid up in NVIDIA's catalogue ({XID_CATALOGUE}); drain the node, then reset the GPU "
            f"(`nvidia-smi -r -i {device_index}`) or reboot; the plugin marks it healthy again once it stays "
            "free of errors for health.recovery-quiet-period"
        )
    if "lost" in reason or "bus" in reason:
        return (
            "the GPU fell off the bus: drain the node and reboot it; if it recurs, check the GPU's power "
            "and seating"
        )
    if "ECC" in reason:
        return (
            "drain the node and reset the GPU or reboot (a retired page needs a reset); replace the GPU if "
            "it recurs"
        )
    return "drain the node and check the GPU with `gpunode doctor` and `nvidia-smi -q`"


class NodeReporter(HealthReporter):
    """Events and the condition for one node, sent by a background thread. See the module docstring."""

    def __init__(
        self,
        node: str,
        connect: Callable[[], KubeClient],
        *,
        burst: int = BURST,
        refill: float = REFILL,
        queue_size: int = QUEUE_SIZE,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: float = HEARTBEAT,
    ) -> None:
        self.node = node
        self._heartbeat = heartbeat
        self._current: dict[str, Any] | None = None  # the condition the API holds (last sent)
        self._connect = connect
        self._client: KubeClient | None = None
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=queue_size)
        self._wanted: dict[str, Any] | None = None  # the newest condition not yet sent
        self._have_wanted = False
        self._handed_over: dict[str, Any] | None = None  # the last condition given to the thread
        self.sent = 0  # requests the API accepted
        self.failed = 0  # requests that failed (API down, refused)
        self.dropped = 0  # Events dropped: the queue was full, or the rate limit held them back
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._clock = clock
        self._burst, self._refill = burst, refill
        self._tokens = float(burst)
        self._filled = clock()
        self._failing: set[str] = set()  # resources whose registration failure was reported
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="gpunode-events", daemon=True)
        self._thread.start()

    @classmethod
    def from_node_credentials(cls, host: Host, config: PluginConfig) -> NodeReporter | None:
        """A reporter with the node's own kubeconfig, or None (logged) when the node has none."""
        from gpunode import kubelet

        path = config.events_kubeconfig or KUBELET_KUBECONFIG
        if not host.is_file(path):
            if config.events_kubeconfig:
                log.error(
                    "events.kubeconfig %s does not exist; no Events and no %s condition (fix: point it at "
                    "the node's kubeconfig, or set events.enabled = false)",
                    path,
                    CONDITION,
                )
            else:
                log.info(
                    "no kubelet kubeconfig at %s: health is not reported as Events or the %s condition "
                    "(set events.kubeconfig to the node's kubeconfig to turn it on)",
                    path,
                    CONDITION,
                )
            return None
        try:
            node = config.node_name or kubelet.node_name(host)[0]
        except GpunodeError as err:
            log.error("%s; no Events and no %s condition (fix: %s)", err.message, CONDITION, err.fix)
            return None

        def connect() -> KubeClient:
            # One attempt per request: the next change or re-check sends again; retries would only keep
            # this thread on a dead API while newer state waits.
            return KubeClient.from_host(
                host, kubeconfig=path, timeouts=TIMEOUTS, retry=RetryPolicy(attempts=1, conflict_attempts=3)
            )

        log.info("reporting GPU health to node %s as Events and the %s condition (%s)", node, CONDITION, path)
        return cls(node, connect)

    # -- called from the event loop: never blocks -------------------------------------------------

    def counts(self) -> tuple[int, int, int]:
        return self.sent, self.failed, self.dropped

    def device_changed(self, transition: Transition) -> None:
        what = describe(transition)
        if transition.healthy:
            self._event("Normal", "GPURecovered", f"{what} is healthy again (it was: {transition.reason})")
        else:
            fix = fix_for(transition.reason, transition.device.gpu_index)
            self._event(
                "Warning",
                "GPUUnhealthy",
                f"{what} is unhealthy: {transition.reason}; pods are no longer given it. Fix: {fix}",
            )

    def condition(self, unhealthy: list[DeviceRecord], *, served: bool) -> None:
        if unhealthy:
            shown = "; ".join(f"{describe(r)}: {r.reason}" for r in unhealthy[:20])
            more = f"; and {len(unhealthy) - 20} more" if len(unhealthy) > 20 else ""
            wanted = {
                "type": CONDITION,
                "status": "False",
                "reason": "GPUUnhealthy",
                "message": f"{len(unhealthy)} unhealthy: {shown}{more}",
            }
        else:
            wanted = {
                "type": CONDITION,
                "status": "True",
                "reason": "GPUsHealthy" if served else "NoGPUsServed",
                "message": "every device gpunode serves is healthy" if served else "gpunode serves no GPUs",
            }
        if wanted == self._handed_over:
            return  # nothing new for the API
        self._handed_over = wanted
        with self._lock:
            self._wanted = wanted  # the thread sends the newest; one not yet sent is replaced
            self._have_wanted = True
        self._wake.set()

    def registered(self, resource: str) -> None:
        if resource in self._failing:
            self._failing.discard(resource)
            self._event("Normal", "DevicePluginRegistered", f"{resource}: registered with kubelet again")

    def register_failed(self, resource: str, why: str, *, refused: bool) -> None:
        if resource in self._failing:
            return  # once per failure streak: retries every few seconds must not each be an Event
        self._failing.add(resource)
        fix = (
            "check resource-name (kubelet accepts <domain>/<name> outside kubernetes.io)"
            if refused
            else "check that kubelet runs (`systemctl status kubelet`) and uses the plugin's socket "
            "directory; `gpunode doctor` checks both"
        )
        self._event(
            "Warning",
            "DevicePluginRegistrationFailed",
            f"{resource}: the device plugin cannot register with kubelet: {why}. Fix: {fix}",
        )

    def stop(self, timeout: float = 0.5) -> None:
        """Stop sending. A request in flight is not waited for beyond `timeout` (a hanging API must not
        hold up the plugin's exit); the thread is a daemon, and the client is closed only once it is done
        with it (else its finalizer does that at exit)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._client is not None and not self._thread.is_alive():
            self._client.close()

    def _event(self, kind: str, reason: str, message: str) -> None:
        now = self._clock()
        self._tokens = min(float(self._burst), self._tokens + (now - self._filled) / self._refill)
        self._filled = now
        if self._tokens < 1.0:
            self.dropped += 1
            return
        self._tokens -= 1.0
        stamp = now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{self.node}.{uuid.uuid4().hex[:16]}", "namespace": EVENT_NAMESPACE},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node},
            "reason": reason,
            "message": message[:1024],  # the API's limit on an Event's message
            "type": kind,
            "source": {"component": COMPONENT, "host": self.node},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            return
        self._wake.set()

    # -- the background thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            woken = self._wake.wait(self._heartbeat)
            self._wake.clear()
            if not woken and self._current is not None and not self._stop.is_set():
                # Nothing changed for a heartbeat: the same condition, its lastHeartbeatTime renewed.
                self._send(self._condition_request(self._current, heartbeat=True), f"renew {CONDITION}")
                continue
            while not self._stop.is_set():
                try:
                    event = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._send(self._event_request(event), "record an Event")
            with self._lock:
                wanted, have = self._wanted, self._have_wanted
                self._have_wanted = False
            if have and not self._stop.is_set():
                ok = self._send(self._condition_request(wanted), f"set the {CONDITION} condition")
                if ok:
                    self._current = wanted
                else:
                    with self._lock:
                        if not self._have_wanted:  # nothing newer: try this one again at the next wake
                            self._wanted, self._have_wanted = wanted, True
                    self._stop.wait(5.0)
                    self._wake.set()

    def _event_request(self, event: dict[str, Any]) -> Callable[[KubeClient], object]:
        return lambda client: client.create_event(EVENT_NAMESPACE, event)

    def _condition_request(
        self, wanted: dict[str, Any] | None, *, heartbeat: bool = False
    ) -> Callable[[KubeClient], object]:
        def request(client: KubeClient) -> object:
            return client.update_node_status(
                self.node, lambda node: condition_ops(node, wanted, heartbeat=heartbeat)
            )

        return request

    def _send(self, request: Callable[[KubeClient], object], what: str) -> bool:
        try:
            if self._client is None:
                self._client = self._connect()
            request(self._client)
        except GpunodeError as err:
            self.failed += 1
            if err.message != self._last_error:  # the same failure every few seconds is logged once
                self._last_error = err.message
                fix = err.fix or f"check that the credentials may write node {self.node}'s status and events"
                log.warning("cannot %s on node %s: %s (fix: %s)", what, self.node, err.message, fix)
            return False
        except Exception:  # this thread must survive anything a request raises
            self.failed += 1
            log.exception("cannot %s on node %s", what, self.node)
            return False
        self.sent += 1
        self._last_error = None
        return True
