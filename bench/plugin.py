"""The device plugin (`gpunode plugin run`) as a real process against the fake kubelet: latencies, size, cost.

Usage: python bench/plugin.py [--quick] [--only 1,2,...]   (from the repo root; prints markdown tables)

Every figure is taken on a real `python -m gpunode plugin run` (tests/integration/pluginproc.py) talking
gRPC over unix sockets to tests/integration/kubelet.py's FakeKubelet, with the real pynvml loading the fake
libnvidia-ml.so.1 (tests/fakenvml) or with `--simulate`. Times are time.monotonic() stamps of this process
(the fake kubelet stamps registrations and ListAndWatch messages on arrival).

1. start → registered      5. GetPreferredAllocation (in-process and over gRPC)
2. Allocate latency        6. ListAndWatch of 1,024 devices
3. kubelet restart         7. RSS
4. Xid → Unhealthy         8. idle CPU (60 s; 10 s with --quick)
                           9. SIGTERM → exit, SIGHUP → registered again

`--quick` shortens every section for a smoke run; its figures are not the ones to publish.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.timing import measure  # noqa: E402 (needs the repo on sys.path)
from gpunode.plugin.api import deviceplugin_pb2 as pb  # noqa: E402
from tests import fakenvml  # noqa: E402
from tests.integration.kubelet import HEALTHY, UNHEALTHY, DeviceInfo, FakeKubelet  # noqa: E402
from tests.integration.pluginproc import PluginProcess, short_tempdir  # noqa: E402

GPU = "nvidia.com/gpu"
CLK_TCK = os.sysconf("SC_CLK_TCK")
IMPORTS = "import grpc, pynvml, click, gpunode.plugin.lifecycle"  # the plugin's main dependencies
# Every module `gpunode plugin run` imports before it registers (python -X importtime), CLI included.
ALL_IMPORTS = (
    "import gpunode.cli.main, gpunode.cli.plugin, gpunode.plugin.runner, "
    "gpunode.plugin.lifecycle, gpunode.runtimes.edits, gpunode.plugin.driver, pynvml, grpc._server, "
    "grpc._channel"
)
# Log lines that say something went wrong; expected ones (the injected Xids) are filtered per section.
_NOTABLE = ("WARNING", "ERROR", "CRITICAL", "Traceback")


@dataclass(frozen=True)
class Counts:
    """Iteration counts: the full run, or --quick."""

    start_runs: int
    allocates: int
    restarts: int
    xid_samples: int
    preferred_inprocess: int
    preferred_grpc: int
    big_runs: int
    big_allocates: int
    idle_s: float


FULL = Counts(10, 10_000, 25, 16, 2_000, 500, 5, 1_000, 60.0)
QUICK = Counts(3, 1_000, 5, 10, 200, 50, 2, 200, 10.0)


@dataclass
class Notes:
    """Anything odd seen on the way: unexpected log lines, exit codes, protocol violations."""

    lines: list[str] = field(default_factory=list)

    def add(self, section: str, text: str) -> None:
        self.lines.append(f"[{section}] {text}")


NOTES = Notes()


# -- statistics and formatting ---------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def dur(seconds: float) -> str:
    """A duration for a table: µs below 1 ms, else ms with a sensible number of digits."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1e-2:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 0.1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e3:.0f} ms"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


# -- /proc -----------------------------------------------------------------------------------------------


def vm_kib(pid: int, key: str) -> int:
    """A `Vm*` line of /proc/<pid>/status, in KiB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise LookupError(f"{key} not in /proc/{pid}/status")


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB ({kib * 1024 / 1e6:.1f} MB)"


def import_rss(code: str) -> int:
    """VmRSS in KiB of a fresh interpreter after running `code` (imports, say)."""
    script = f"{code}\nimport pathlib\nprint(pathlib.Path('/proc/self/status').read_text())"
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    return next(int(line.split()[1]) for line in out.splitlines() if line.startswith("VmRSS:"))


@dataclass(frozen=True)
class ThreadTimes:
    name: str
    cpu_ticks: int
    switches: int  # voluntary + involuntary context switches: roughly, wake-ups


def thread_times(pid: int) -> dict[int, ThreadTimes]:
    """utime + stime and context switches of every thread of the process, by thread id."""
    result: dict[int, ThreadTimes] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        switches = sum(
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"))
        )
        result[int(task.name)] = ThreadTimes(name, int(fields[11]) + int(fields[12]), switches)
    return result


def process_cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process (all its threads), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


# -- running the plugin ----------------------------------------------------------------------------------


@dataclass
class Session:
    kubelet: FakeKubelet
    plugin: PluginProcess
    base: Path
    started: float  # monotonic, just before Popen


@contextlib.contextmanager
def plugin_session(
    section: str,
    args: Sequence[str] = (),
    *,
    profile: str | None = "pcie-4",
    nvml_config: Path | None = None,
    control: bool = False,
    expected: Sequence[str] = (),
) -> Iterator[Session]:
    """A fake kubelet and a plugin process in a private directory under /tmp; both stopped on exit.

    The plugin's log is scanned afterwards: WARNING/ERROR lines not matching `expected`, a non-zero exit
    status and protocol violations seen by the fake kubelet go to NOTES.
    """
    with short_tempdir("dpbench-") as base:
        socket_dir = base / "device-plugins"
        control_path = base / "nvml-control" if control else None
        if control_path is not None:
            control_path.write_text("")
        with FakeKubelet(socket_dir) as kubelet:
            plugin = PluginProcess(
                socket_dir, args, profile=profile, nvml_config=nvml_config, control=control_path, log_dir=base
            )
            started = time.monotonic()
            plugin.start()
            try:
                yield Session(kubelet, plugin, base, started)
            finally:
                status = plugin.stop()
                _review(section, plugin, status, kubelet, expected)


def _review(
    section: str, plugin: PluginProcess, status: int | None, kubelet: FakeKubelet, expected: Sequence[str]
) -> None:
    if status not in (0, None):
        NOTES.add(section, f"plugin exited {status} on SIGTERM (expected 0)")
    seen: dict[str, int] = {}
    for line in plugin.log().splitlines():
        if any(word in line for word in _NOTABLE) and not any(e in line for e in expected):
            # Drop the asctime stamp ("2026-11-22 10:00:00,123 ") so repeats collapse.
            text = line[24:] if line[:4].isdigit() else line
            seen[text] = seen.get(text, 0) + 1
    for text, count in seen.items():
        NOTES.add(section, f"log: {text}" + (f"  (x{count})" if count > 1 else ""))
    for violation in kubelet.violations:
        NOTES.add(section, f"fake kubelet: protocol violation: {violation}")
    for rejection in kubelet.rejections():
        NOTES.add(section, f"fake kubelet refused a registration: {rejection.message}")


def ready(s: Session, count: int, timeout: float = 60.0) -> list[DeviceInfo]:
    """Wait for the registration and a full device list; the list."""
    s.kubelet.wait_registered(GPU, timeout=timeout)
    return s.kubelet.wait_for_devices(GPU, lambda d: len(d) == count, timeout=timeout)


def has(count: int) -> Callable[[list[DeviceInfo]], bool]:
    return lambda devices: len(devices) == count


def unhealthy_at(index: int) -> Callable[[list[DeviceInfo]], bool]:
    return lambda devices: devices[index].health == UNHEALTHY


def all_healthy(devices: list[DeviceInfo]) -> bool:
    return all(d.health == HEALTHY for d in devices)


# -- 1. start → registered --------------------------------------------------------------------------------


def bench_start(counts: Counts) -> None:
    print("### 1. Start → registered\n")
    print(
        "From Popen of `python -m gpunode plugin run` to the fake kubelet's accepted registration, and to "
        f"the first full ListAndWatch message; median and best of {counts.start_runs} runs after one warm-up "
        "run, a fresh kubelet and directory each time.\n"
    )
    rows = []
    cases = [
        ("fake NVML `pcie-4` (4 x L4)", [], "pcie-4", 4),
        ("fake NVML `dgx-a100` (8 x A100)", [], "dgx-a100", 8),
        ("`--simulate dgx-a100` (no NVML)", ["--simulate", "dgx-a100"], None, 8),
    ]
    for label, args, profile, count in cases:
        registered: list[float] = []
        listed: list[float] = []
        for run in range(counts.start_runs + 1):
            with plugin_session("start", args, profile=profile) as s:
                reg = s.kubelet.wait_registered(GPU, timeout=60)
                update = s.kubelet.wait_for_update(GPU, has(count), timeout=60)
                if run > 0:
                    registered.append(reg.time - s.started)
                    listed.append(update.time - s.started)
        rows.append(
            [
                label,
                dur(statistics.median(registered)),
                dur(min(registered)),
                dur(statistics.median(listed)),
            ]
        )
    floor = measure([sys.executable, "-c", "pass"], counts.start_runs)
    imports = measure(
        [sys.executable, "-c", IMPORTS],
        counts.start_runs,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    rows.append(["`python -c pass` (interpreter floor)", dur(floor[0]), dur(floor[1]), ""])
    rows.append([f"`python -c '{IMPORTS}'`", *map(dur, imports), ""])
    table(["plugin", "registered (median)", "registered (best)", "first full list (median)"], rows)


# -- 2 and 7. Allocate latency, RSS ------------------------------------------------------------------------


class _Context:
    """Enough of grpc.ServicerContext for an in-process call that succeeds."""

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")

    def is_active(self) -> bool:
        return True  # kubelet is waiting

    def time_remaining(self) -> float | None:
        return None  # no deadline, as kubelet's Allocate


def _service(profile: str, replicas: int = 1) -> tuple[Any, list[str]]:
    """An in-process DevicePluginService over the simulated profile, and its device IDs."""
    from gpunode.plugin.allocate import AllocateSettings
    from gpunode.plugin.devices import DeviceRegistry, Sharing, build_resources
    from gpunode.plugin.preferred import Topology
    from gpunode.plugin.server import DevicePluginService, ServeSettings
    from gpunode.plugin.simulate import simulated_inventory

    inventory = simulated_inventory(profile)
    resources = build_resources(inventory, sharing=Sharing(replicas))
    registry = DeviceRegistry(resources)
    service = DevicePluginService(
        GPU, registry, Topology.from_inventory(inventory), ServeSettings(False, AllocateSettings())
    )
    return service, [d.id for d in resources[0].devices]


def _time_calls(call: Callable[[int], object], n: int) -> list[float]:
    samples = []
    for i in range(n):
        t = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - t)
    return samples


@contextlib.contextmanager
def _production_logging() -> Iterator[None]:
    """Log gpunode.plugin at INFO to a file as `gpunode plugin run` does (to stderr there): its format,
    through its log writer thread (runner.LogWriter), with the caller lookup off as setup_logging has it."""
    from gpunode.plugin import runner

    with tempfile.TemporaryDirectory(prefix="dpbench-log-", dir="/tmp") as tmp:
        handler = logging.FileHandler(Path(tmp) / "plugin.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        writer = runner.LogWriter(handler)
        root = logging.getLogger("gpunode")
        saved = root.handlers[:], root.level, root.propagate, logging._srcfile
        root.handlers[:] = [writer.handler]
        root.setLevel(logging.INFO)
        root.propagate = False
        logging._srcfile = None
        if hasattr(writer, "own"):  # trees before issue 24's log_line have no fast path to turn on
            writer.own(root)
        try:
            yield
        finally:
            writer.stop()
            root.handlers[:], level, root.propagate, logging._srcfile = saved
            root.setLevel(level)
            handler.close()


def bench_allocate(counts: Counts) -> dict[str, str]:
    """Sections 2 and 7 share one plugin: Allocate latency, then RSS after all those Allocates."""
    n = counts.allocates
    print("### 2. Allocate latency\n")
    print(
        f"{n:,} Allocate calls (one container, 1 GPU, envvar strategy) through the fake kubelet's gRPC "
        f"channel, client side (perf_counter around the blocking call); each interleaved with a "
        "GetDevicePluginOptions call (the plugin does nothing for it: the cost of a gRPC round trip over a "
        "unix socket in Python) on the same channel. Fake NVML `pcie-4`, after 200 warm-up calls of each.\n"
    )
    rss: dict[str, str] = {}
    with plugin_session("allocate", profile="pcie-4") as s:
        ids = [d.id for d in ready(s, 4)]
        rss["after registration"] = mib(vm_kib(s.plugin.pid, "VmRSS"))
        for i in range(200):
            s.kubelet.allocate(GPU, [[ids[i % 4]]])
            s.kubelet.options(GPU)
        alloc: list[float] = []
        noop: list[float] = []
        for i in range(n):
            t0 = time.perf_counter()
            s.kubelet.options(GPU)
            t1 = time.perf_counter()
            answer = s.kubelet.allocate(GPU, [[ids[i % 4]]])
            t2 = time.perf_counter()
            noop.append(t1 - t0)
            alloc.append(t2 - t1)
        assert dict(answer.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": ids[(n - 1) % 4]}
        total = n + 200
        rss[f"after {total:,} Allocates (+ as many GetDevicePluginOptions)"] = mib(
            vm_kib(s.plugin.pid, "VmRSS")
        )
        rss["peak (VmHWM)"] = mib(vm_kib(s.plugin.pid, "VmHWM"))
        log_lines = len(s.plugin.log().splitlines())

    # Server side: the servicer's Allocate called in-process, no gRPC; with the plugin's INFO log line
    # written to a file as in production, and without logging.
    service, sids = _service("pcie-4")
    big, big_ids = _service("dgx-a100", 128)
    ctx = _Context()

    def direct(svc: Any, device_ids: list[str]) -> Callable[[int], object]:
        def call(i: int) -> object:
            request = pb.AllocateRequest(
                container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=[device_ids[i % len(device_ids)]])
                ]
            )
            return svc.Allocate(request, ctx)

        return call

    quiet = _time_calls(direct(service, sids), n)
    with _production_logging():
        logged = _time_calls(direct(service, sids), n)
        logged_big = _time_calls(direct(big, big_ids), n)

    def row(label: str, samples: list[float]) -> list[str]:
        return [label, dur(statistics.median(samples)), dur(percentile(samples, 99)), dur(max(samples))]

    table(
        ["call", "p50", "p99", "max"],
        [
            row("Allocate over gRPC (client side)", alloc),
            row("GetDevicePluginOptions over gRPC (no-op baseline)", noop),
            row(
                "Allocate handler in-process, INFO line through the log thread to a file (4 devices)", logged
            ),
            row("Allocate handler in-process, logging off (4 devices)", quiet),
            row("Allocate handler in-process, INFO logged, 1,024-device resource", logged_big),
        ],
    )
    diff = statistics.median(alloc) - statistics.median(noop)
    print(
        f"Allocate minus the no-op round trip (medians): {dur(diff)}. The plugin wrote {log_lines:,} log "
        f"lines for {total:,} Allocates.\n"
    )
    return rss


# -- 3. kubelet restart → re-registered -------------------------------------------------------------------


def bench_restart(counts: Counts) -> None:
    n = counts.restarts
    print("### 3. Kubelet restart → registered again\n")
    print(
        f"{n} restarts of the fake kubelet (its server stops, every socket in the directory is deleted, a "
        "new kubelet.sock is served): from the moment the new kubelet.sock serves (FakeKubelet.restart()'s "
        "return value) to the plugin's accepted registration, and to the first device list on the new "
        "stream. Fake NVML `pcie-4`.\n"
    )
    registered: list[float] = []
    listed: list[float] = []
    restart_cost: list[float] = []
    with plugin_session("restart", profile="pcie-4") as s:
        ready(s, 4)
        for _ in range(n):
            before = time.monotonic()
            serving = s.kubelet.restart()
            reg = s.kubelet.wait_registered(GPU, after=serving, timeout=30)
            update = s.kubelet.wait_for_update(GPU, lambda d: len(d) == 4, after=reg.time, timeout=30)
            registered.append(reg.time - serving)
            listed.append(update.time - serving)
            restart_cost.append(serving - before)
            time.sleep(0.05)
        time.sleep(0.5)
        if len(s.kubelet.registrations(GPU)) != n + 1:
            NOTES.add("restart", f"{len(s.kubelet.registrations(GPU))} registrations for {n} restarts (+1)")
        ended = s.kubelet.stream_ends(GPU, by_plugin_only=True)
        if ended:
            NOTES.add("restart", f"{len(ended)} ListAndWatch streams ended by the plugin during restarts")
    table(
        ["from new kubelet.sock serving to", "median", "p90", "max"],
        [
            [
                "registration accepted",
                dur(statistics.median(registered)),
                dur(percentile(registered, 90)),
                dur(max(registered)),
            ],
            [
                "first device list on the new stream",
                dur(statistics.median(listed)),
                dur(percentile(listed, 90)),
                dur(max(listed)),
            ],
        ],
    )
    print(
        f"(The fake kubelet's restart itself, old server stop to new server serving: median "
        f"{dur(statistics.median(restart_cost))}; not counted above.)\n"
    )


# -- 4. Xid → Unhealthy ------------------------------------------------------------------------------------


def bench_xid(counts: Counts) -> None:
    n = counts.xid_samples
    quiet = 0.2
    print("### 4. Xid event → Unhealthy in ListAndWatch\n")
    print(
        f"{n} samples on fake NVML `dgx-a100` (8 GPUs, taken in turn) with "
        f"`--recovery-quiet-period {quiet}`: from just before `xid <gpu> 79` is appended to the "
        "fake library's control file to the fake kubelet's receipt of the ListAndWatch message "
        "that shows that GPU Unhealthy. The fake library looks at its control file about every "
        "5 ms inside nvmlEventSetWait, so up to 5 ms (2.5 ms on average) of each figure is the "
        "fake's polling; a random 0-20 ms pause before each write spreads the samples over that "
        "period. Also: from the write until the GPU is listed Healthy again.\n"
    )
    rng = random.Random(1)  # noqa: S311 (jitter, not secrets)
    latency: list[float] = []
    recovery: list[float] = []
    args = ["--recovery-quiet-period", str(quiet)]
    expected = ["unhealthy: Xid 79"]
    with plugin_session("xid", args, profile="dgx-a100", control=True, expected=expected) as s:
        ready(s, 8)
        s.plugin.wait_for_log("health monitor armed", timeout=30)
        control = s.base / "nvml-control"
        for i in range(n):
            gpu = i % 8
            s.kubelet.wait_for_devices(GPU, all_healthy, timeout=30)
            time.sleep(rng.uniform(0.0, 0.02))
            t0 = time.monotonic()
            fakenvml.inject(control, f"xid {gpu} 79")
            update = s.kubelet.wait_for_update(GPU, unhealthy_at(gpu), after=t0, timeout=30)
            latency.append(update.time - t0)
            wrong = [j for j, d in enumerate(update.devices) if d.health == UNHEALTHY and j != gpu]
            if wrong:
                NOTES.add("xid", f"xid on GPU {gpu} also marked GPUs {wrong}")
            back = s.kubelet.wait_for_update(GPU, all_healthy, after=update.time, timeout=30)
            recovery.append(back.time - t0)
    table(
        ["from the control-file write to", "median", "p90", "max"],
        [
            [
                "Unhealthy received by kubelet",
                dur(statistics.median(latency)),
                dur(percentile(latency, 90)),
                dur(max(latency)),
            ],
            [
                f"Healthy again (quiet period {quiet:g} s)",
                dur(statistics.median(recovery)),
                dur(percentile(recovery, 90)),
                dur(max(recovery)),
            ],
        ],
    )


# -- 5. GetPreferredAllocation ----------------------------------------------------------------------------


def _preferred_at(rev: str) -> Any:
    """gpunode/plugin/preferred.py as of git revision `rev`, imported under another name (for A/B)."""
    import importlib.util

    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:gpunode/plugin/preferred.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    name = "preferred_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is created
    exec(compile(source, f"{rev}:gpunode/plugin/preferred.py", "exec"), module.__dict__)  # noqa: S102
    return module


def bench_preferred(counts: Counts, baseline: str | None = None) -> None:
    from gpunode.plugin.devices import Sharing, build_resources
    from gpunode.plugin.preferred import Topology, preferred_allocation
    from gpunode.plugin.simulate import simulated_inventory

    print("### 5. GetPreferredAllocation\n")
    print(
        "`dgx-a100` (8 x A100 on NVSwitches, 2 PCIe switches and a NUMA node per 4), every device available "
        "unless a GPU is named in use, nothing must be included. In-process: `preferred_allocation` on "
        f"`simulated_inventory` + `build_resources`, {counts.preferred_inprocess} calls"
        + (
            f", interleaved call by call with `preferred.py` of {baseline} (same process, same inputs)"
            if baseline
            else ""
        )
        + "; gRPC: client side through the fake "
        f"kubelet against `--simulate dgx-a100 [--replicas 16]`, {counts.preferred_grpc} calls.\n"
    )
    inventory = simulated_inventory("dgx-a100")
    topology = Topology.from_inventory(inventory)
    old = _preferred_at(baseline) if baseline else None
    old_topology = old.Topology.from_inventory(inventory) if old else None
    cases: list[tuple[str, int, str, int, frozenset[int]]] = [
        ("8 GPUs", 1, "spread", 1, frozenset()),
        ("8 GPUs, GPU 7 in use", 1, "spread", 1, frozenset({7})),
        ("8 GPUs", 1, "spread", 2, frozenset()),
        ("8 GPUs", 1, "spread", 4, frozenset()),
        ("8 GPUs", 1, "spread", 8, frozenset()),
        ("8 GPUs x 16 replicas (128)", 16, "spread", 4, frozenset()),
        ("8 GPUs x 16 replicas (128)", 16, "spread", 8, frozenset()),
        ("8 GPUs x 16 replicas (128)", 16, "spread", 16, frozenset()),
        ("8 GPUs x 16 replicas (128)", 16, "packed", 8, frozenset()),
    ]
    rows = []
    # label, size, IDs offered, in-process samples (current, baseline), answer, GPUs of both answers
    Item = tuple[str, int, list[str], list[float], list[float], list[str], str]
    sessions: dict[tuple[int, str], list[Item]] = {}
    for label, replicas, placement, size, busy in cases:
        [resource] = build_resources(inventory, sharing=Sharing(replicas))
        by_id = resource.by_id()
        ids = [d.id for d in resource.devices if d.gpu_index not in busy]
        inproc: list[float] = []
        before: list[float] = []
        for _ in range(counts.preferred_inprocess):
            t = time.perf_counter()
            preferred_allocation(topology, by_id, ids, [], size, placement)
            inproc.append(time.perf_counter() - t)
            if old is not None:
                t = time.perf_counter()
                old.preferred_allocation(old_topology, by_id, ids, [], size, placement)
                before.append(time.perf_counter() - t)
        answer = preferred_allocation(topology, by_id, ids, [], size, placement)
        gpus = [by_id[i].gpu_index for i in answer]
        changed = ""
        if old is not None:
            old_gpus = [
                by_id[i].gpu_index
                for i in old.preferred_allocation(old_topology, by_id, ids, [], size, placement)
            ]
            changed = "same" if old_gpus == gpus else f"GPU {_gpus(old_gpus)} → {_gpus(gpus)}"
        sessions.setdefault((replicas, placement), []).append(
            (label, size, ids, inproc, before, answer, changed)
        )
    for (replicas, placement), items in sessions.items():
        args = ["--simulate", "dgx-a100", "--replicas", str(replicas), "--placement", placement]
        with plugin_session("preferred", args, profile=None) as s:
            listed = {d.id for d in ready(s, 8 * replicas)}
            for label, size, ids, inproc, before, answer, changed in items:
                assert set(ids) <= listed
                for _ in range(20):
                    s.kubelet.get_preferred_allocation(GPU, ids, [], size)
                remote: list[float] = []
                for _ in range(counts.preferred_grpc):
                    t = time.perf_counter()
                    response = s.kubelet.get_preferred_allocation(GPU, ids, [], size)
                    remote.append(time.perf_counter() - t)
                got = list(response.container_responses[0].deviceIDs)
                if got != answer:
                    NOTES.add("preferred", f"{label} size {size}: gRPC answer {got} != in-process {answer}")
                row = [
                    f"{label}, {placement}",
                    str(size),
                    str(len({i.split("::")[0] for i in answer})),
                    dur(statistics.median(inproc)),
                    dur(percentile(inproc, 99)),
                ]
                if before:
                    row += [dur(statistics.median(before)), dur(percentile(before, 99)), changed]
                rows.append([*row, dur(statistics.median(remote)), dur(percentile(remote, 99))])
    header = ["devices", "size", "GPUs in answer", "in-process p50", "in-process p99"]
    if baseline:
        header += [f"{baseline} p50", f"{baseline} p99", f"answer vs {baseline}"]
    table([*header, "gRPC p50", "gRPC p99"], rows)


def _gpus(indexes: Sequence[int]) -> str:
    """The GPUs of an answer for a table cell: 0,1 or, with replicas, 0x2,1x2."""
    counted = {g: indexes.count(g) for g in indexes}
    return ",".join(f"{g}x{c}" if c > 1 else str(g) for g, c in counted.items())


# -- 6. 1,024 devices --------------------------------------------------------------------------------------


def _config_32_gpus(path: Path) -> Path:
    """A fake NVML config of 32 L4-like GPUs (the fake library's maximum), NUMA 0 for 0-15, 1 for 16-31."""
    sections = []
    for i in range(32):
        sections.append(
            "[gpu]\n"
            "name = NVIDIA L4\n"
            "memory_total = 23034 MiB\n"
            f"pci_bus_id = 00000000:{i + 0x10:02X}:00.0\n"
            f"numa = {i // 16}\n"
            f"pcie_switch = {i // 4}\n"
            f"host_bridge = {i // 16}\n"
            "cc = 8.9\n"
            "architecture = 8\n"
        )
    path.write_text("[system]\n\n" + "\n".join(sections))
    return path


def _message_bytes(devices: Sequence[DeviceInfo]) -> int:
    """The serialized size of the ListAndWatchResponse the fake kubelet received (re-encoded: same fields)."""
    message = pb.ListAndWatchResponse(
        devices=[
            pb.Device(
                ID=d.id,
                health=d.health,
                topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=n) for n in d.numa_nodes])
                if d.numa_nodes
                else None,
            )
            for d in devices
        ]
    )
    return message.ByteSize()


def bench_big(counts: Counts) -> dict[str, str]:
    print("### 6. ListAndWatch of 1,024 devices\n")
    print(
        f"Median and best of {counts.big_runs} plugin starts: from the accepted registration to the fake "
        "kubelet's receipt of the first message listing all 1,024 devices; its size re-encoded from what "
        "was received. Then Allocate over gRPC on that resource "
        f"({counts.big_allocates} calls, 1 device each).\n"
    )
    rss: dict[str, str] = {}
    rows = []
    with short_tempdir("dpbench-cfg-") as tmp:
        config = _config_32_gpus(tmp / "32-gpus.conf")
        cases: list[tuple[str, list[str], str | None, Path | None]] = [
            (
                "`--simulate dgx-a100 --replicas 128`",
                ["--simulate", "dgx-a100", "--replicas", "128"],
                None,
                None,
            ),
            ("fake NVML, 32 GPUs x 32 replicas", ["--replicas", "32"], None, config),
        ]
        for label, args, profile, nvml_config in cases:
            to_list: list[float] = []
            to_reg: list[float] = []
            size = 0
            alloc: list[float] = []
            for run in range(counts.big_runs):
                with plugin_session("1024", args, profile=profile, nvml_config=nvml_config) as s:
                    reg = s.kubelet.wait_registered(GPU, timeout=120)
                    update = s.kubelet.wait_for_update(GPU, lambda d: len(d) == 1024, timeout=120)
                    to_reg.append(reg.time - s.started)
                    to_list.append(update.time - reg.time)
                    size = _message_bytes(update.devices)
                    if run == 0:
                        ids = [d.id for d in update.devices]
                        for i in range(50):
                            s.kubelet.allocate(GPU, [[ids[i]]])
                        for i in range(counts.big_allocates):
                            t = time.perf_counter()
                            s.kubelet.allocate(GPU, [[ids[(i * 7) % 1024]]])
                            alloc.append(time.perf_counter() - t)
                        rss[f"1,024 devices ({label}), after {counts.big_allocates + 50} Allocates"] = mib(
                            vm_kib(s.plugin.pid, "VmRSS")
                        )
            rows.append(
                [
                    label,
                    dur(statistics.median(to_reg)),
                    dur(statistics.median(to_list)),
                    dur(min(to_list)),
                    f"{size:,} B",
                    f"{dur(statistics.median(alloc))} / {dur(percentile(alloc, 99))}",
                ]
            )
    table(
        [
            "plugin",
            "start → registered (median)",
            "registered → full list (median)",
            "(best)",
            "message",
            "Allocate p50 / p99",
        ],
        rows,
    )
    return rss


# -- 7. RSS (printed from what 2 and 6 measured) -------------------------------------------------------------


def print_rss(rss: dict[str, str]) -> None:
    print("### 7. Resident memory of the plugin process\n")
    print("VmRSS from /proc/<pid>/status (VmHWM: the peak so far). Fake NVML `pcie-4` unless said.\n")
    rss = {
        **rss,
        "for comparison: `python -c pass`": mib(import_rss("pass")),
        f"for comparison: a fresh interpreter after `{IMPORTS}`": mib(import_rss(IMPORTS)),
        "for comparison: a fresh interpreter after every module the plugin imports (CLI and tomlkit "
        "included)": mib(import_rss(ALL_IMPORTS)),
    }
    table(["when", "RSS"], [[k, v] for k, v in rss.items()])


# -- 8. idle CPU -------------------------------------------------------------------------------------------


def bench_idle(counts: Counts) -> None:
    idle = counts.idle_s
    print("### 8. CPU while idle\n")
    print(
        f"Registered with its ListAndWatch stream open, no calls, for {idle:g} s: utime + stime of the whole "
        "process from /proc/<pid>/stat (10 ms ticks), and context switches summed over its threads from "
        "/proc/<pid>/task/*/status (about one per wake-up), before and after. Measured after a 2 s settle.\n"
    )
    cases: list[tuple[str, list[str], str | None]] = [
        ("fake NVML `pcie-4`, health checks on (default)", [], "pcie-4"),
        ("fake NVML `pcie-4`, `--no-health-checks`", ["--no-health-checks"], "pcie-4"),
        ("`--simulate pcie-4` (no NVML, no health thread)", ["--simulate", "pcie-4"], None),
    ]
    rows = []
    details = []
    for label, args, profile in cases:
        with plugin_session("idle", args, profile=profile) as s:
            ready(s, 4)
            if not args:
                s.plugin.wait_for_log("health monitor armed", timeout=30)
            time.sleep(2.0)
            pid = s.plugin.pid
            before = thread_times(pid)
            cpu0 = process_cpu_ticks(pid)
            t0 = time.monotonic()
            time.sleep(idle)
            cpu1 = process_cpu_ticks(pid)
            elapsed = time.monotonic() - t0
            after = thread_times(pid)
        cpu_s = (cpu1 - cpu0) / CLK_TCK
        switches = sum(a.switches - before[t].switches for t, a in after.items() if t in before)
        rows.append(
            [
                label,
                f"{cpu_s * 1000:.0f} ms",
                f"{cpu_s / elapsed * 100:.2f} %",
                f"{switches / elapsed:.0f}/s",
                str(len(after)),
            ]
        )
        busy = sorted(
            (
                (a.cpu_ticks - before[t].cpu_ticks, (a.switches - before[t].switches) / elapsed, a.name, t)
                for t, a in after.items()
                if t in before
            ),
            reverse=True,
        )
        top = ", ".join(
            f"{name} (tid {tid}): {ticks * 1000 // CLK_TCK} ms, {rate:.0f} wake-ups/s"
            for ticks, rate, name, tid in busy
            if ticks or rate >= 1
        )
        details.append(f"- {label}: {top or 'no thread woke up'}")
    table(["plugin", f"CPU in {idle:g} s", "of one core", "wake-ups", "threads"], rows)
    print("Busy threads (CPU, wake-ups per second):\n")
    print("\n".join(details) + "\n")


# -- 9. SIGTERM and SIGHUP ----------------------------------------------------------------------------------


def bench_signals(counts: Counts) -> None:
    runs = counts.big_runs
    print("### 9. SIGTERM → exit, SIGHUP → registered again\n")
    print(
        f"Median and max of {runs} runs each, after registration and a 0.5 s pause. SIGTERM: until the "
        "process has exited (waitpid), and until the fake kubelet saw the last ListAndWatch stream end. "
        "SIGHUP (reload, same settings): until the new registration is accepted.\n"
    )
    mig = ["nvidia.com/mig-1g.5gb", "nvidia.com/mig-2g.10gb", GPU]
    sim = ["--simulate", "pcie-4"]
    cases: list[tuple[str, list[str], str | None, str, list[str]]] = [
        ("SIGTERM, fake NVML `pcie-4` (health thread), stream open", [], "pcie-4", "term", [GPU]),
        ("SIGTERM, `--simulate pcie-4`, stream open", sim, None, "term", [GPU]),
        ("SIGTERM, `--simulate pcie-4`, kubelet stopped first (no stream)", sim, None, "gone", [GPU]),
        (
            "SIGTERM, fake NVML `mig`, `--mig-strategy mixed` (3 resources), streams open",
            ["--mig-strategy", "mixed"],
            "mig",
            "term",
            mig,
        ),
        ("SIGHUP, `--simulate pcie-4`", sim, None, "hup", [GPU]),
    ]
    rows = []
    for label, args, profile, kind, resources in cases:
        done: list[float] = []
        ended: list[float] = []
        for _ in range(runs):
            with plugin_session("signals", args, profile=profile) as s:
                for name in resources:
                    s.kubelet.wait_registered(name, timeout=60)
                    s.kubelet.wait_for_devices(name, timeout=60)
                time.sleep(0.5)
                if kind == "gone":
                    s.kubelet.stop()
                    time.sleep(0.2)
                t0 = time.monotonic()
                if kind == "hup":
                    s.plugin.signal(signal.SIGHUP)
                    done.append(s.kubelet.wait_registered(GPU, after=t0, timeout=30).time - t0)
                    continue
                s.plugin.signal(signal.SIGTERM)
                s.plugin.wait(30)
                done.append(time.monotonic() - t0)
                if kind == "term":
                    ends = [s.kubelet.wait_stream_ended(n, after=t0, timeout=30).time for n in resources]
                    ended.append(max(ends) - t0)
        rows.append(
            [
                label,
                f"{dur(statistics.median(done))} / {dur(max(done))}",
                f"{dur(statistics.median(ended))} / {dur(max(ended))}" if ended else "",
            ]
        )
    table(["signal", "exited / registered again (median / max)", "last stream ended (median / max)"], rows)


# -- main -------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short smoke run (10 s idle, fewer iterations)")
    parser.add_argument("--only", default="", help="comma-separated section numbers to run, e.g. 2,7")
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="plugin starts in section 1 (bench/run passes it to every script)",
    )
    parser.add_argument(
        "--preferred-baseline",
        default=None,
        metavar="REV",
        help="section 5: also time gpunode/plugin/preferred.py of this git revision, call by call",
    )
    args = parser.parse_args()
    counts = QUICK if args.quick else FULL
    if args.runs is not None:
        counts = dataclasses.replace(counts, start_runs=max(1, args.runs))
    only = {int(x) for x in args.only.split(",") if x.strip()} or set(range(1, 10))

    fakenvml.build()  # compiled once, outside every timing
    print(
        f"Device plugin benchmark, {datetime.date.today().isoformat()}: Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {platform.platform()}{' (--quick)' if args.quick else ''}\n"
    )
    rss: dict[str, str] = {}
    if 1 in only:
        bench_start(counts)
    if only & {2, 7}:
        rss.update(bench_allocate(counts))
    if 3 in only:
        bench_restart(counts)
    if 4 in only:
        bench_xid(counts)
    if 5 in only:
        bench_preferred(counts, args.preferred_baseline)
    if only & {6, 7}:
        rss.update(bench_big(counts))
    if 7 in only:
        print_rss(rss)
    if 8 in only:
        bench_idle(counts)
    if 9 in only:
        bench_signals(counts)
    print("### Notes\n")
    print(
        "\n".join(f"- {line}" for line in NOTES.lines) if NOTES.lines else "Nothing odd in the plugin logs."
    )


if __name__ == "__main__":
    main()
