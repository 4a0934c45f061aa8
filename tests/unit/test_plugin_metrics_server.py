"""The metrics endpoint's HTTP server (issue 23): bounded in threads and connections, a slow client dropped,
and still the library's exposition (prometheus-client's handler, content negotiation and compression)."""

from __future__ import annotations

import gzip
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from gpunode.plugin.healthreport import HealthTracker
from gpunode.plugin.metrics import MAX_CONNECTIONS, WORKERS, MetricsServer, PluginMetrics

SAFETY = 60.0  # only against a hang: nothing here is expected to take more than a fraction of it


def scrape(port: int, **headers: str) -> tuple[bytes, dict[str, str]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=SAFETY) as answer:
        return answer.read(), dict(answer.headers)


def new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Live threads that were not there `before` (threads of other tests ending meanwhile do not count)."""
    return [t for t in threading.enumerate() if t not in before]


def closed_by_server(sock: socket.socket) -> bool:
    """True if the server closed this connection (EOF or reset is waiting), without blocking."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + SAFETY
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def metrics() -> Iterator[PluginMetrics]:
    served = PluginMetrics.serve("127.0.0.1:0", HealthTracker())
    try:
        yield served
    finally:
        served.stop()


def test_idle_connections_cost_no_thread_and_a_scrape_still_answers(metrics: PluginMetrics) -> None:
    """Before: a thread per connection, none ever timed out (3,000 idle connections: 3,014 threads)."""
    baseline = set(threading.enumerate())
    count = MAX_CONNECTIONS * 3
    idle = [socket.create_connection(("127.0.0.1", metrics.port)) for _ in range(count)]
    try:
        # Accepted in order: once this scrape is answered, every idle connection before it was taken.
        body, _ = scrape(metrics.port)
        assert "gpunode_kubelet_restarts_total" in {
            s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples
        }
        assert new_threads(baseline) == []  # the server's threads are fixed: none per connection
        # Beyond the cap, connections are closed at once (the longest waiting first), not queued.
        assert sum(closed_by_server(s) for s in idle) >= count - MAX_CONNECTIONS
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: new_threads(baseline) == [], "threads back to the baseline after the clients closed")
    scrape(metrics.port)  # and still serving


def test_threads_are_fixed_and_gone_after_stop() -> None:
    before = set(threading.enumerate())
    served = PluginMetrics.serve("127.0.0.1:0", HealthTracker())
    started = new_threads(before)
    assert len(started) == 1 + WORKERS  # the selector loop and the workers, started once
    scrape(served.port)
    assert new_threads(before) == started
    served.stop()
    assert not any(t.is_alive() for t in started)


def test_a_client_that_never_finishes_its_request_is_dropped() -> None:
    registry = CollectorRegistry(auto_describe=False)
    server = MetricsServer("127.0.0.1", 0, registry, request_timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            # A slowloris keeps sending a byte now and then: the time limit runs from the accept, so
            # trickling does not keep the connection.
            deadline = time.monotonic() + SAFETY
            while not closed_by_server(slow):
                assert time.monotonic() < deadline, "the slow client was never dropped"
                try:
                    slow.sendall(b"X")
                except OSError:
                    break  # reset: dropped
                select.select([slow], [], [], 0.05)  # pace the trickle; returns early once closed
    finally:
        server.stop()


def test_the_librarys_exposition_is_served() -> None:
    registry = CollectorRegistry(auto_describe=False)
    Counter("gpunode_test_events", "Test.", registry=registry).inc(3)
    server = MetricsServer("127.0.0.1", 0, registry)
    try:
        body, headers = scrape(server.port)
        assert b"gpunode_test_events_total 3.0" in body
        assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
        zipped, headers = scrape(server.port, **{"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip" and gzip.decompress(zipped) == body
        open_metrics, headers = scrape(server.port, Accept="application/openmetrics-text; version=1.0.0")
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert open_metrics.endswith(b"# EOF\n")
    finally:
        server.stop()
