"""Prometheus metrics of `gpunode plugin run` (the only module that imports prometheus_client).

Three kinds of figures, each read where it is cheapest:
- device and resource state is computed at scrape time from the HealthTracker's records (no per-device
  series to keep in step, no stale series for a device that is gone);
- calls (Allocate, GetPreferredAllocation, ListAndWatch) are counted by a subclass of the gRPC service,
  with the labelled children bound once per resource so a call pays one clock read, one histogram
  observe and one counter increment (a few microseconds against a call of ~100 us and up);
- registrations, kubelet restarts and the reporter's requests are counted as they happen.
The library's process and platform collectors are included. GPU telemetry (clocks, temperatures,
utilisation, ECC counts) is DCGM's: dcgm-exporter publishes it, and nothing here repeats it.

The registry is this plugin's own (not the library's global one), so tests can run several plugins in
one process.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from gpunode.errors import ConfigError
from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.devices import DeviceRegistry
from gpunode.plugin.healthreport import HealthReporter, HealthTracker, MetricsSink
from gpunode.plugin.preferred import Topology
from gpunode.plugin.server import DevicePluginService, ServeSettings

log = logging.getLogger("gpunode.plugin")

# Allocate and GetPreferredAllocation take ~0.1-1 ms on a node; the upper buckets catch a loaded host.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
# kubelet.sock appearing → registered: sub-second when the plugin runs, up to minutes after a plugin start.
DELAY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)
# device: the ID kubelet sees, less a time-slicing replica's "::N" (the GPU's or MIG device's visible ID).
DEVICE_LABELS = ("resource", "device", "uuid", "index")

# Why a call was refused, by the gRPC status the servicer answered: the reasons server.py and allocate.py
# give, without their free text (a label must have few values).
REFUSAL_REASONS = {
    "INVALID_ARGUMENT": "invalid_request",  # unknown, repeated or too many device IDs; more than 1 shared
    "FAILED_PRECONDITION": "unhealthy_device",
    "DEADLINE_EXCEEDED": "deadline_passed",
    "UNAVAILABLE": "not_served",
    "RESOURCE_EXHAUSTED": "too_many_streams",
}


class PluginMetrics(MetricsSink):
    def __init__(self, tracker: HealthTracker) -> None:
        self.tracker = tracker
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        r = self.registry
        self.allocations = Counter(
            "gpunode_allocations", "Containers given devices by Allocate.", ["resource"], registry=r
        )
        self.allocate_seconds = Histogram(
            "gpunode_allocate_duration_seconds",
            "Time the plugin took to answer Allocate (successful calls).",
            ["resource"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.preferred_seconds = Histogram(
            "gpunode_preferred_allocation_duration_seconds",
            "Time the plugin took to answer GetPreferredAllocation.",
            ["resource"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.refusals = Counter(
            "gpunode_refusals",
            "Calls the plugin refused, by call and reason.",
            ["resource", "call", "reason"],
            registry=r,
        )
        self.allocatable = Gauge(
            "gpunode_resource_devices_allocatable",
            "Healthy devices in the last ListAndWatch answer sent to kubelet (what kubelet counts as "
            "allocatable).",
            ["resource"],
            registry=r,
        )
        self.streams = Gauge(
            "gpunode_resource_watch_streams", "ListAndWatch streams open now.", ["resource"], registry=r
        )
        self.registrations = Counter(
            "gpunode_registrations", "Registrations kubelet accepted.", ["resource"], registry=r
        )
        self.registration_failures = Counter(
            "gpunode_registration_failures",
            "Registrations that failed: kubelet unreachable (unavailable) or said no (refused).",
            ["resource", "reason"],
            registry=r,
        )
        self.kubelet_restarts = Counter(
            "gpunode_kubelet_restarts",
            "New kubelets (a new kubelet.sock) the plugin registered with after the first.",
            registry=r,
        )
        self.registration_delay = Histogram(
            "gpunode_registration_delay_seconds",
            "Seconds from kubelet.sock's creation to the plugin's registration with that kubelet.",
            ["resource"],
            buckets=DELAY_BUCKETS,
            registry=r,
        )
        self.reporter: HealthReporter | None = None
        r.register(_StateCollector(self))
        self._server: MetricsServer | None = None

    @classmethod
    def serve(cls, address: str, tracker: HealthTracker) -> PluginMetrics:
        """Metrics served over HTTP at http://ADDRESS/metrics (any path answers, as the library does)."""
        metrics = cls(tracker)
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        try:
            metrics._server = MetricsServer(host, int(port), metrics.registry)
        except OSError as exc:
            raise ConfigError(
                f"metrics.address {address}: cannot listen there: {exc.strerror or exc}",
                "pick a free port and an address of this node (metrics.address, GPUNODE_METRICS_ADDRESS, "
                '--metrics-address), or "" to turn metrics off',
            ) from exc
        log.info("metrics: serving Prometheus metrics on http://%s/metrics", address)
        return metrics

    @property
    def port(self) -> int:
        return self._server.port if self._server is not None else 0

    # -- MetricsSink ------------------------------------------------------------------------------

    def registered(self, resource: str, *, restart: bool, delay: float | None) -> None:
        self.registrations.labels(resource).inc()
        if restart:
            self.kubelet_restarts.inc()
        if delay is not None:
            self.registration_delay.labels(resource).observe(delay)

    def register_failed(self, resource: str, *, refused: bool) -> None:
        self.registration_failures.labels(resource, "refused" if refused else "unavailable").inc()

    def service(
        self, resource: str, registry: DeviceRegistry, topology: Topology, settings: ServeSettings
    ) -> DevicePluginService:
        return InstrumentedService(resource, registry, topology, settings, self)

    def watch_reporter(self, reporter: HealthReporter) -> None:
        self.reporter = reporter

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def exposition(self) -> bytes:
        """The text a scrape gets (for tests and the benchmark, without HTTP)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# The HTTP endpoint. prometheus-client's start_http_server starts a thread per connection, with no limit
# and no timeout: 3,000 idle connections to a node's 0.0.0.0:9402 made 3,014 threads (RSS 46 -> 121 MiB),
# and a client that never finishes its request held one for ever. Here one thread reads requests for every
# connection (a selector: an idle one costs a socket, not a thread), at most MAX_CONNECTIONS at once (the
# one waiting longest is dropped for a new one), each within REQUEST_TIMEOUT of its accept (a slowloris
# client is dropped); WORKERS fixed threads answer complete requests with the library's own handler.
MAX_CONNECTIONS = 64
REQUEST_TIMEOUT = 10.0  # from accept to the end of the request's headers (a scrape sends them at once)
SEND_TIMEOUT = 10.0  # per write of the answer: a reader that stops reading is dropped
WORKERS = 2
MAX_REQUEST = 16 * 1024  # a GET's request line and headers; more is not a scrape


class _Handler(MetricsHandler):
    """The library's handler (its content negotiation, compression and exposition), on a request already
    read: `request` is (socket, the request's bytes)."""

    def setup(self) -> None:
        connection, data = self.request
        self.connection = connection
        self.rfile = io.BytesIO(data)
        self.wfile = connection.makefile("wb")


class MetricsServer:
    """A bounded HTTP server for the metrics: one selector thread, a fixed pool of WORKERS threads."""

    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, *, request_timeout: float = REQUEST_TIMEOUT
    ) -> None:
        self._handler = _Handler.factory(registry)
        self._request_timeout = request_timeout
        info = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self._listener = socket.socket(info[0], socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(info[4])
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        # Connections still sending their request: socket -> (deadline, bytes so far), oldest first.
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}
        self._work: queue.Queue[tuple[socket.socket, bytes] | None] = queue.Queue(MAX_CONNECTIONS)
        self._stopping = False
        self._threads = [threading.Thread(target=self._loop, name="gpunode-metrics", daemon=True)]
        self._threads += [
            threading.Thread(target=self._answer, name=f"gpunode-metrics-{n}", daemon=True)
            for n in range(WORKERS)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._threads[0].join(5.0)
        # Requests not yet taken are dropped (a put would wait on a full queue), then each worker ends.
        with contextlib.suppress(queue.Empty):
            while (item := self._work.get_nowait()) is not None:
                item[0].close()
        for _ in range(WORKERS):
            self._work.put(None)
        for thread in self._threads[1:]:
            thread.join(SEND_TIMEOUT + 5.0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _drop(self, conn: socket.socket) -> None:
        if self._pending.pop(conn, None) is not None:
            self._selector.unregister(conn)
        conn.close()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                now = time.monotonic()
                for conn in [c for c, (deadline, _) in self._pending.items() if deadline <= now]:
                    self._drop(conn)  # too slow to send a request: a scraper sends it at once
                timeout = min((d for d, _ in self._pending.values()), default=now + 60.0) - now
                for key, _ in self._selector.select(max(0.0, timeout)):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 64)
                    else:
                        assert isinstance(key.fileobj, socket.socket)  # noqa: S101 (only sockets added)
                        self._receive(key.fileobj)
        except Exception:  # the endpoint must not take the plugin down; it stops serving, said once
            log.exception("metrics: the HTTP endpoint failed; metrics are no longer served")
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()
            self._listener.close()

    def _accept(self) -> None:
        for _ in range(MAX_CONNECTIONS):  # what is queued now; the rest on the next round
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, a connection reset while queued: not fatal
                log.warning("metrics: cannot accept a connection: %s", exc.strerror or exc)
                return
            if len(self._pending) >= MAX_CONNECTIONS:
                self._drop(next(iter(self._pending)))  # the one waiting longest makes room
            conn.setblocking(False)
            self._pending[conn] = (time.monotonic() + self._request_timeout, bytearray())
            self._selector.register(conn, selectors.EVENT_READ)

    def _receive(self, conn: socket.socket) -> None:
        try:
            chunk = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        data = self._pending[conn][1]
        data += chunk
        if not chunk or len(data) > MAX_REQUEST:
            self._drop(conn)
        elif b"\r\n\r\n" in data or b"\n\n" in data:
            self._pending.pop(conn)
            self._selector.unregister(conn)
            try:
                self._work.put_nowait((conn, bytes(data)))
            except queue.Full:
                conn.close()

    def _answer(self) -> None:
        while (item := self._work.get()) is not None:
            conn = item[0]
            try:
                conn.settimeout(SEND_TIMEOUT)
                self._handler(item, conn.getpeername(), self)
            except OSError:
                pass  # the scraper went away, or stopped reading
            except Exception:
                log.exception("metrics: answering a scrape failed")
            finally:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()


class InstrumentedService(DevicePluginService):
    """The plugin's gRPC service, timed and counted. Only served with metrics on: without them the plain
    service runs and pays nothing."""

    def __init__(
        self,
        resource_name: str,
        registry: DeviceRegistry,
        topology: Topology,
        settings: ServeSettings,
        metrics: PluginMetrics,
    ) -> None:
        super().__init__(resource_name, registry, topology, settings)
        self._metrics = metrics
        # Children bound once: a labels() lookup per call would cost a lock and a dict look-up.
        self._allocations = metrics.allocations.labels(resource_name)
        self._allocate_seconds = metrics.allocate_seconds.labels(resource_name)
        self._preferred_seconds = metrics.preferred_seconds.labels(resource_name)
        self._allocatable = metrics.allocatable.labels(resource_name)
        self._streams_open = metrics.streams.labels(resource_name)

    def _refused(self, call: str, context: grpc.ServicerContext) -> None:
        code = getattr(context, "code", lambda: None)()
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        reason = REFUSAL_REASONS.get(name, name.lower())
        self._metrics.refusals.labels(self.resource_name, call, reason).inc()

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        start = time.perf_counter()
        try:
            response = super().Allocate(request, context)
        except Exception:
            self._refused("Allocate", context)
            raise
        self._allocate_seconds.observe(time.perf_counter() - start)
        self._allocations.inc(len(response.container_responses))
        return response

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        start = time.perf_counter()
        try:
            response = super().GetPreferredAllocation(request, context)
        except Exception:
            self._refused("GetPreferredAllocation", context)
            raise
        self._preferred_seconds.observe(time.perf_counter() - start)
        return response

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        stream = super().ListAndWatch(request, context)
        self._streams_open.inc()
        try:
            for response in stream:
                self._allocatable.set(sum(1 for d in response.devices if d.health == "Healthy"))
                yield response
        except Exception:
            self._refused("ListAndWatch", context)
            raise
        finally:
            self._streams_open.dec()


class _StateCollector(Collector):
    """Device and resource state, and the reporter's counts, computed when scraped."""

    def __init__(self, metrics: PluginMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        tracker = self._metrics.tracker
        now = tracker.now()
        healthy = GaugeMetricFamily(
            "gpunode_device_healthy",
            "1 if the device is healthy (served as Healthy to kubelet).",
            labels=DEVICE_LABELS,
        )
        monitored = GaugeMetricFamily(
            "gpunode_device_monitored",
            "1 if the health monitor watches the device's GPU (Xid and ECC events).",
            labels=DEVICE_LABELS,
        )
        state = GaugeMetricFamily(
            "gpunode_device_state_info",
            'The device\'s state and its reason ("healthy", or why it is not); always 1.',
            labels=(*DEVICE_LABELS, "state", "reason"),
        )
        seconds = GaugeMetricFamily(
            "gpunode_device_state_seconds",
            "Seconds the device has been in its current state (since the plugin saw it change).",
            labels=DEVICE_LABELS,
        )
        xid = GaugeMetricFamily(
            "gpunode_device_last_critical_xid",
            "The last critical Xid that made the device unhealthy; 0 if none since the plugin started.",
            labels=DEVICE_LABELS,
        )
        recoveries = CounterMetricFamily(
            "gpunode_device_recoveries",
            "Times the device became healthy again after being unhealthy.",
            labels=DEVICE_LABELS,
        )
        advertised: Tally[str] = Tally()
        healthy_count: Tally[str] = Tally()
        seen: set[tuple[str, str]] = set()
        for record in tracker.records():
            device = record.device
            advertised[record.resource] += 1
            healthy_count[record.resource] += int(record.healthy)
            # One set of series per GPU or MIG device: its time-slicing replicas share its health, and a
            # series per replica would multiply the answer (and the scrape's cost) by the replica count.
            if (record.resource, device.uuid) in seen:
                continue
            seen.add((record.resource, device.uuid))
            labels = [record.resource, device.visible_id, device.uuid, _index(device)]
            healthy.add_metric(labels, 1.0 if record.healthy else 0.0)
            monitored.add_metric(labels, 1.0 if record.monitored else 0.0)
            state.add_metric([*labels, "healthy" if record.healthy else "unhealthy", record.reason], 1.0)
            seconds.add_metric(labels, max(0.0, now - record.since))
            xid.add_metric(labels, float(record.last_critical_xid))
            recoveries.add_metric(labels, float(record.recoveries))
        yield from (healthy, monitored, state, seconds, xid, recoveries)
        served = GaugeMetricFamily(
            "gpunode_resource_devices_advertised",
            "Devices the plugin serves for the resource.",
            labels=["resource"],
        )
        good = GaugeMetricFamily(
            "gpunode_resource_devices_healthy", "Healthy devices of the resource.", labels=["resource"]
        )
        for resource, count in advertised.items():
            served.add_metric([resource], float(count))
            good.add_metric([resource], float(healthy_count[resource]))
        yield served
        yield good
        reporter = self._metrics.reporter
        if reporter is not None:
            requests = CounterMetricFamily(
                "gpunode_kube_requests",
                "Requests to the Kubernetes API for Events and the GPUHealthy condition, by outcome.",
                labels=["outcome"],
            )
            sent, failed, dropped_count = reporter.counts()
            requests.add_metric(["sent"], float(sent))
            requests.add_metric(["failed"], float(failed))
            yield requests
            dropped = CounterMetricFamily(
                "gpunode_kube_reports_dropped",
                "Events or condition updates dropped (queue full or rate limit) so the plugin never waits on "
                "the API.",
            )
            dropped.add_metric([], float(dropped_count))
            yield dropped


def _index(device: Any) -> str:
    mig = device.mig
    if mig is not None and mig.gpu_instance_id is not None and mig.compute_instance_id is not None:
        return f"{device.gpu_index}:{mig.gpu_instance_id}:{mig.compute_instance_id}"
    return str(device.gpu_index)
