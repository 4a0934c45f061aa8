"""MPS: how fast a dead control daemon takes its replicas out of kubelet's list, and brings them back.

Usage: python bench/mps.py [--quick]   (from the repo root; prints a markdown table)

One real `python -m gpunode plugin run` (tests/integration/pluginproc.py) serving `pcie-4` (4 GPUs) as
`nvidia.com/gpu` with 4 MPS replicas each (16 devices), the stand-in `nvidia-cuda-mps-control`
(tests/fakemps) as its daemon, the fake NVML and the fake kubelet (tests/integration/kubelet.py). In the
same plugin, taken in turn so that load hits both alike:

- **MPS daemon killed** (SIGKILL by PID) → the ListAndWatch message with all 16 replicas Unhealthy, and
  → all Healthy again (the supervisor restarts the daemon: the stand-in's start, its readiness on the
  control socket and the defaults set through the control program, three program runs, are in it).
- **Baseline: Xid 79 on GPU 0** (the health monitor's NVML event, `xid 0 79` appended to the fake
  library's control file, which it reads about every 5 ms) → the message with GPU 0's 4 replicas
  Unhealthy: the path every health change has taken so far.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import fakemps, fakenvml
from tests.integration.kubelet import HEALTHY, UNHEALTHY, DeviceInfo, FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"
REPLICAS = 4


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def every(health: str, count: int = 16) -> Callable[[list[DeviceInfo]], bool]:
    return lambda d: len(d) == count and all(x.health == health for x in d)


def gpu0_down(devices: list[DeviceInfo]) -> bool:
    down = {d.id for d in devices if d.health == UNHEALTHY}
    return len(down) == REPLICAS and len({i.split("::")[0] for i in down}) == 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 samples each instead of 30")
    n = 5 if parser.parse_args().quick else 30
    killed: list[float] = []
    back: list[float] = []
    xid: list[float] = []
    with short_tempdir("mpsbench-") as base:
        fakemps.install(base / "bin")
        control = base / "nvml-control"
        control.write_text("")
        resources = json.dumps([{"name": GPU, "replicas": REPLICAS}])
        args = [
            "--mps-resources",
            resources,
            "--mps-root",
            str(base / "mps"),
            "--recovery-quiet-period",
            "0.2",
        ]
        try:
            with (
                FakeKubelet(base / "device-plugins") as kubelet,
                PluginProcess(
                    base / "device-plugins",
                    args,
                    profile="pcie-4",
                    control=control,
                    env=fakemps.env(base / "bin"),
                    log_dir=base,
                ) as plugin,
            ):
                kubelet.wait_for_devices(GPU, every(HEALTHY), timeout=60)
                plugin.wait_for_log("health monitor armed", timeout=30)
                for _ in range(n):
                    [pid] = fakemps.daemon_pids(base / "mps").values()
                    t0 = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                    down = kubelet.wait_for_update(GPU, every(UNHEALTHY), after=t0, timeout=30)
                    up = kubelet.wait_for_update(GPU, every(HEALTHY), after=down.time, timeout=60)
                    killed.append(down.time - t0)
                    back.append(up.time - t0)

                    t0 = time.monotonic()
                    fakenvml.inject(control, "xid 0 79")
                    update = kubelet.wait_for_update(GPU, gpu0_down, after=t0, timeout=30)
                    xid.append(update.time - t0)
                    kubelet.wait_for_update(GPU, every(HEALTHY), after=update.time, timeout=30)
        finally:
            fakemps.kill_all(base / "mps")
    print(
        f"### MPS daemon death → kubelet ({n} samples each, {platform.node()}, "
        f"Python {platform.python_version()})\n"
    )
    print("| from | to | median | p90 | max |")
    print("|---|---|---|---|---|")
    for start, end, samples in (
        ("SIGKILL of the MPS control daemon", "16 replicas Unhealthy at kubelet", killed),
        ("SIGKILL of the MPS control daemon", "16 replicas Healthy again (daemon restarted)", back),
        ("baseline: Xid 79 written for the fake NVML", "GPU 0's 4 replicas Unhealthy at kubelet", xid),
    ):
        print(
            f"| {start} | {end} | {ms(statistics.median(samples))} | {ms(percentile(samples, 90))} | "
            f"{ms(max(samples))} |"
        )


if __name__ == "__main__":
    main()
