"""What the plugin's Prometheus metrics (issue 18) cost: Allocate with metrics off and on, side by side, and
a scrape.

Usage: python bench/metrics.py [--allocates N] [--scrapes N]   (from the repo root; prints markdown)

1. Allocate over gRPC: two `python -m gpunode plugin run` processes on the fake NVML `pcie-4`, each with its
   own fake kubelet, one without metrics.address and one with it; one client (this process) alternates the
   same Allocate between them (A B, B A, A B, ...), so the machine's load falls on both alike. p50 / p99 of
   each and the difference of the medians.
2. The Allocate handler in-process (no gRPC): DevicePluginService against the metrics' InstrumentedService
   (a clock read, a histogram observation, a counter increment), calls alternating, logging off.
3. A scrape: GET /metrics over HTTP from the plugin with metrics on (client side, a new connection each
   time as Prometheus does), its size, and the plugin's CPU per scrape (its /proc ticks over N scrapes);
   and the exposition built in-process for 4 devices and for a 1,024-device resource (8 GPUs x 128
   time-slicing replicas), the largest a node is likely to have.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.plugin import _Context, _service, dur, percentile, process_cpu_ticks, table  # noqa: E402
from gpunode.plugin.api import deviceplugin_pb2 as pb  # noqa: E402
from tests import fakenvml  # noqa: E402
from tests.integration.kubelet import FakeKubelet  # noqa: E402
from tests.integration.pluginproc import PluginProcess, short_tempdir  # noqa: E402

GPU = "nvidia.com/gpu"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def row(label: str, samples: list[float]) -> list[str]:
    return [label, dur(statistics.median(samples)), dur(percentile(samples, 99)), dur(max(samples))]


def bench_grpc(allocates: int, scrapes: int) -> None:
    port = free_port()
    with short_tempdir("dpbench-m-") as base:
        dirs = [base / "off" / "device-plugins", base / "on" / "device-plugins"]
        with FakeKubelet(dirs[0]) as k_off, FakeKubelet(dirs[1]) as k_on:
            env_on = {"GPUNODE_METRICS_ADDRESS": f"127.0.0.1:{port}"}
            off = PluginProcess(dirs[0], profile="pcie-4", log_dir=base).start()
            on = PluginProcess(dirs[1], profile="pcie-4", log_dir=base, env=env_on).start()
            try:
                ids = []
                for kubelet in (k_off, k_on):
                    kubelet.wait_registered(GPU, timeout=60)
                    ids.append([d.id for d in kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)])
                on.wait_for_log("metrics: serving")
                for i in range(200):  # warm-up of both
                    k_off.allocate(GPU, [[ids[0][i % 4]]])
                    k_on.allocate(GPU, [[ids[1][i % 4]]])
                a: list[float] = []
                b: list[float] = []
                pairs = ((k_off, ids[0], a), (k_on, ids[1], b))
                for i in range(allocates):
                    # Which goes first alternates too: the second call of a pair finds the CPU warmer.
                    for kubelet, device_ids, out in pairs if i % 2 else pairs[::-1]:
                        t = time.perf_counter()
                        kubelet.allocate(GPU, [[device_ids[i % 4]]])
                        out.append(time.perf_counter() - t)
                print(f"### 1. Allocate over gRPC, metrics off and on, alternating ({allocates:,} each)\n")
                table(
                    ["plugin", "p50", "p99", "max"],
                    [row("metrics off (the default)", a), row(f"metrics on (127.0.0.1:{port})", b)],
                )
                diff = statistics.median(b) - statistics.median(a)
                print(f"Difference of the medians (on - off): {dur(diff)}.\n")

                url = f"http://127.0.0.1:{port}/metrics"
                for _ in range(20):
                    urllib.request.urlopen(url, timeout=30).read()
                samples = []
                size = 0
                ticks0 = process_cpu_ticks(on.pid)
                for _ in range(scrapes):
                    t = time.perf_counter()
                    with urllib.request.urlopen(url, timeout=30) as answer:
                        size = len(answer.read())
                    samples.append(time.perf_counter() - t)
                cpu = (process_cpu_ticks(on.pid) - ticks0) / CLK_TCK / scrapes
                print(f"### 3. A scrape ({scrapes:,} GET /metrics, 4 GPUs)\n")
                table(["scrape", "p50", "p99", "max"], [row("GET /metrics over HTTP, client side", samples)])
                print(f"Answer: {size:,} bytes. The plugin's CPU per scrape: {dur(cpu)} (its /proc ticks).\n")
            finally:
                off.stop()
                on.stop()


def bench_handler(allocates: int) -> None:
    from gpunode.plugin.healthreport import HealthTracker
    from gpunode.plugin.metrics import InstrumentedService, PluginMetrics

    plain, ids = _service("pcie-4")
    metrics = PluginMetrics(HealthTracker())
    topology, settings = plain.current
    timed = InstrumentedService(GPU, plain.registry, topology, settings, metrics)
    ctx: Any = _Context()

    def call(service: Any) -> Callable[[int], object]:
        def one(i: int) -> object:
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[ids[i % len(ids)]])]
            )
            return service.Allocate(request, ctx)

        return one

    import logging

    logging.getLogger("gpunode").setLevel(logging.WARNING)  # the handler's INFO line is not what is timed
    a: list[float] = []
    b: list[float] = []
    plain_call, timed_call = call(plain), call(timed)
    for i in range(1000):
        plain_call(i)
        timed_call(i)
    calls = ((plain_call, a), (timed_call, b))
    for i in range(allocates):
        for one, out in calls if i % 2 else calls[::-1]:
            t = time.perf_counter()
            one(i)
            out.append(time.perf_counter() - t)
    print(f"### 2. Allocate handler in-process, alternating ({allocates:,} each, logging off)\n")
    table(
        ["service", "p50", "p99", "max"],
        [row("DevicePluginService (metrics off)", a), row("InstrumentedService (metrics on)", b)],
    )
    print(f"Difference of the medians: {dur(statistics.median(b) - statistics.median(a))}.\n")


def bench_exposition(scrapes: int) -> None:
    from gpunode.plugin.healthreport import HealthTracker
    from gpunode.plugin.metrics import PluginMetrics

    rows = []
    for label, (service, _) in (
        ("4 GPUs (pcie-4)", _service("pcie-4")),
        ("1,024 devices (dgx-a100, 128 replicas)", _service("dgx-a100", 128)),
    ):
        tracker = HealthTracker()
        tracker.update(service.registry)
        metrics = PluginMetrics(tracker)
        size = len(metrics.exposition())
        samples = []
        for _ in range(scrapes):
            t = time.perf_counter()
            metrics.exposition()
            samples.append(time.perf_counter() - t)
        rows.append([*row(label, samples), f"{size:,}"])
    print(f"### 3b. The exposition built in-process ({scrapes:,} times)\n")
    table(["devices", "p50", "p99", "max", "bytes"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--allocates", type=int, default=20_000)
    parser.add_argument("--scrapes", type=int, default=500)
    args = parser.parse_args()
    fakenvml.build()
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}\n"
    )
    bench_grpc(args.allocates, args.scrapes)
    bench_handler(args.allocates)
    bench_exposition(max(20, args.scrapes // 10))


if __name__ == "__main__":
    main()
