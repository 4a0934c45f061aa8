"""What the plugin tells people about itself: device health over time, for metrics, Events and a Node
condition.

The event loop (lifecycle.Plugin) calls a `PluginObserver` at a handful of points: after every status
update (health changes included), when a registration with kubelet succeeds or fails, and when it makes a
resource's gRPC service. `HealthTracker` (healthreport.py) turns the registry's marks into per-device
records (since when, last critical Xid, recoveries) and transitions; `start_observer` wires the Prometheus
endpoint (gpunode.plugin.metrics, only when metrics.address is set) and the Kubernetes reporter
(gpunode.kube.events, only with the node's credentials). Nothing here blocks the loop: the metrics are
read by the scrape's own thread and the API is written by the reporter's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.plugin.devices import DeviceRegistry
from gpunode.plugin.healthreport import DeviceRecord, HealthReporter, HealthTracker, MetricsSink, Transition

if TYPE_CHECKING:
    from gpunode.plugin.config import PluginConfig
    from gpunode.plugin.pluginstatus import PluginStatus
    from gpunode.plugin.preferred import Topology
    from gpunode.plugin.server import DevicePluginService, ServeSettings

log = logging.getLogger("gpunode.plugin")


class PluginObserver:
    """The hooks the event loop calls. This base does nothing, so a plugin without metrics or events pays
    one method call per hook and serves the plain gRPC service."""

    def on_status(self, status: PluginStatus, registry: DeviceRegistry) -> None:
        pass

    def registered(self, resource: str, kubelet: tuple[int, int]) -> None:
        """Registered with the kubelet whose kubelet.sock has this (inode, ctime in ns)."""

    def register_failed(self, resource: str, why: str, *, refused: bool) -> None:
        pass

    def service(
        self, resource: str, registry: DeviceRegistry, topology: Topology, settings: ServeSettings
    ) -> DevicePluginService:
        from gpunode.plugin.server import DevicePluginService

        return DevicePluginService(resource, registry, topology, settings)

    def stop(self) -> None:
        pass


class HealthObserver(PluginObserver):
    """Metrics and/or the Kubernetes reporter, fed by one HealthTracker."""

    def __init__(
        self,
        tracker: HealthTracker,
        metrics: MetricsSink | None,
        reporter: HealthReporter | None,
    ) -> None:
        self.tracker = tracker
        self.metrics = metrics
        self.reporter = reporter
        self._kubelet: tuple[int, int] | None = None
        self._registered_with: dict[str, tuple[int, int]] = {}

    def on_status(self, status: PluginStatus, registry: DeviceRegistry) -> None:
        transitions = self.tracker.update(registry)
        if self.reporter is not None:
            for t in transitions:
                self.reporter.device_changed(t)
            # Every update: the reporter sends only when the condition it would write changes (the first
            # update comes before the devices are loaded, so "no GPUs served" must be replaced then).
            self.reporter.condition(self.tracker.unhealthy(), served=bool(self.tracker.records()))

    def registered(self, resource: str, kubelet: tuple[int, int]) -> None:
        restart = self._kubelet is not None and self._kubelet != kubelet
        first_with_this_kubelet = self._registered_with.get(resource) != kubelet
        self._kubelet = kubelet
        self._registered_with[resource] = kubelet
        if self.metrics is not None:
            # kubelet.sock's change time is when this kubelet created it: the delay is how long this
            # kubelet ran without the resource (at a plugin start: since the kubelet started).
            delay = max(0.0, time.time() - kubelet[1] / 1e9) if first_with_this_kubelet else None
            self.metrics.registered(resource, restart=restart, delay=delay)
        if self.reporter is not None:
            self.reporter.registered(resource)

    def register_failed(self, resource: str, why: str, *, refused: bool) -> None:
        if self.metrics is not None:
            self.metrics.register_failed(resource, refused=refused)
        if self.reporter is not None:
            self.reporter.register_failed(resource, why, refused=refused)

    def service(
        self, resource: str, registry: DeviceRegistry, topology: Topology, settings: ServeSettings
    ) -> DevicePluginService:
        if self.metrics is None:
            return super().service(resource, registry, topology, settings)
        return self.metrics.service(resource, registry, topology, settings)

    def stop(self) -> None:
        if self.reporter is not None:
            self.reporter.stop()
        if self.metrics is not None:
            self.metrics.stop()


class DeferredReporter(HealthReporter):
    """Stands in for the NodeReporter until the plugin has registered with kubelet (or tried to), or
    `delay` seconds have passed: the Kubernetes client it needs (requests, urllib3, PyYAML: ~60 ms of
    imports and ~9 MB) is loaded then, on a thread of its own, off the path from start to registered.
    Reports made meanwhile are kept (Events up to PENDING, the newest condition) and handed over."""

    PENDING = 64

    def __init__(self, make: Callable[[], HealthReporter | None], delay: float = 30.0) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._real: HealthReporter | None = None
        self._started = False
        self._stopped = False
        self._pending: collections.deque[Callable[[HealthReporter], None]] = collections.deque()
        self._condition: Callable[[HealthReporter], None] | None = None
        self._dropped = 0
        self._timer = threading.Timer(delay, self.start)
        self._timer.daemon = True
        self._timer.start()

    def start(self) -> None:
        with self._lock:
            if self._started or self._stopped:
                return
            self._started = True
        threading.Thread(target=self._build, name="gpunode-events-start", daemon=True).start()

    def _build(self) -> None:
        try:
            real = self._make()
        except Exception:  # the plugin serves on without Events: nothing here may stop it
            log.exception("cannot start reporting GPU health to Kubernetes")
            real = None
        with self._lock:
            if self._stopped:
                if real is not None:
                    real.stop()
                return
            pending, self._pending = list(self._pending), collections.deque()
            condition, self._condition = self._condition, None
            self._real = real
        if real is not None:
            for call in pending:
                call(real)
            if condition is not None:
                condition(real)

    def _call(self, call: Callable[[HealthReporter], None], *, condition: bool = False) -> None:
        with self._lock:
            if self._stopped:
                return
            real = self._real
            if real is None:
                if condition:
                    self._condition = call  # only the newest matters
                elif len(self._pending) < self.PENDING:
                    self._pending.append(call)
                else:
                    self._dropped += 1
                return
        call(real)

    def counts(self) -> tuple[int, int, int]:
        real = self._real
        sent, failed, dropped = real.counts() if real is not None else (0, 0, 0)
        return sent, failed, dropped + self._dropped

    def device_changed(self, transition: Transition) -> None:
        self._call(lambda r: r.device_changed(transition))

    def condition(self, unhealthy: list[DeviceRecord], *, served: bool) -> None:
        self._call(lambda r: r.condition(unhealthy, served=served), condition=True)

    def registered(self, resource: str) -> None:
        self._call(lambda r: r.registered(resource))
        self.start()

    def register_failed(self, resource: str, why: str, *, refused: bool) -> None:
        self._call(lambda r: r.register_failed(resource, why, refused=refused))
        self.start()

    def stop(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._stopped = True
            real = self._real
        if real is not None:
            real.stop()


def start_observer(host: Host, config: PluginConfig, *, simulated: bool) -> PluginObserver:
    """The observer for this configuration. Neither part may stop the plugin: a metrics address that
    cannot be bound, or API credentials that do not load, are logged and that part is left off."""
    tracker = HealthTracker()
    metrics: MetricsSink | None = None
    reporter: HealthReporter | None = None
    if config.metrics_address:
        from gpunode.plugin.metrics import PluginMetrics

        try:
            metrics = PluginMetrics.serve(config.metrics_address, tracker)
        except GpunodeError as err:
            log.error("%s (fix: %s); serving the devices without metrics", err.message, err.fix)
    if config.events_enabled and not simulated:
        from gpunode.kube.credentials import KUBELET_KUBECONFIG

        path = config.events_kubeconfig or KUBELET_KUBECONFIG
        if host.is_file(path):

            def make() -> HealthReporter | None:
                from gpunode.kube.events import NodeReporter

                return NodeReporter.from_node_credentials(host, config)

            reporter = DeferredReporter(make)
            if metrics is not None:
                metrics.watch_reporter(reporter)
        elif config.events_kubeconfig:
            log.error(
                "events.kubeconfig %s does not exist; no Events and no GPUHealthy condition (fix: point it "
                "at the node's kubeconfig, or set events.enabled = false)",
                path,
            )
        else:
            log.info(
                "no kubelet kubeconfig at %s: health is not reported as Events or the GPUHealthy condition "
                "(set events.kubeconfig to the node's kubeconfig to turn it on)",
                path,
            )
    if metrics is None and reporter is None:
        return PluginObserver()
    return HealthObserver(tracker, metrics, reporter)
