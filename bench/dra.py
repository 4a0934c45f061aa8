"""The DRA driver (`gpunode dra run`) beside the device plugin (`gpunode plugin run`), in one run.

Usage: python bench/dra.py [--quick] [--runs N]   (from the repo root; prints markdown tables)

The driver is a real `python -m gpunode dra run` (tests/integration/test_dra_run.py's DraProcess: the real
pynvml over the fake libnvidia-ml, a driver root with device nodes and libraries for the claims' CDI specs)
against tests/integration/drakubelet.py's FakeDraKubelet and the test API server (tests/kubeapi: real TLS,
the node's client certificate). The plugin is bench/plugin.py's session against the fake device-plugin
kubelet. Rows of the two are interleaved sample by sample, so both see the same load.

Stamps are time.monotonic() of this process: the fake kubelets stamp registrations, health and ListAndWatch
messages on arrival; the test API server is wrapped (StampedApiServer) to stamp every ResourceSlice write it
stored, with a snapshot of the node's devices after it, so "slices in the API" is the moment the write was
stored, not the moment a poll noticed it.

1. start → registered; → slices in the API     4. Xid → health stream UNHEALTHY; → the slice's taint
2. NodePrepareResources 1 and 8 GPUs            5. RSS
3. kubelet restart (wipe) → slices back

`--quick` shortens every section for a smoke run; its figures are not the ones to publish.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import random
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import plugin as dp  # noqa: E402 (needs the repo on sys.path)
from bench.plugin import dur, mib, percentile, table, vm_kib  # noqa: E402
from bench.timing import measure  # noqa: E402
from tests import cdinode, fakenvml  # noqa: E402
from tests.integration.drakubelet import Claim, DeviceHealth, FakeDraKubelet  # noqa: E402
from tests.integration.pluginproc import short_tempdir  # noqa: E402
from tests.integration.test_dra_run import DRIVER, NODE, DraProcess  # noqa: E402
from tests.kubeapi.apiserver import ApiServer  # noqa: E402
from tests.kubeapi.dra import SLICES  # noqa: E402
from tests.kubeapi.pki import Pki  # noqa: E402

GPU = dp.GPU
WAIT = 60.0  # a bound on every wait (the machine is shared), never a figure
PROFILE_GPUS = {"pcie-4": 4, "dgx-a100": 8}
QUIET = 0.2  # --recovery-quiet-period for the Xid section, so that samples can follow one another


@dataclass(frozen=True)
class Counts:
    start_runs: int
    prepares: int  # per claim size
    restarts: int
    xid_samples: int


FULL = Counts(10, 1_000, 20, 16)
QUICK = Counts(2, 50, 3, 4)

Devices = dict[str, dict[str, Any]]  # device name → its entry in the node's slices


# -- the API server, stamping slice writes ------------------------------------------------------------------


class StampedApiServer(ApiServer):
    """The test API server; every stored ResourceSlice write is stamped with the devices after it."""

    def __init__(self, pki: Pki) -> None:
        super().__init__(pki)
        self._stamps: list[tuple[float, Devices]] = []
        self._stamped = threading.Condition()

    def handle(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: bytes, peer_cert: Any
    ) -> Any:
        answer = super().handle(method, raw_path, headers, body, peer_cert)
        if (
            method in {"POST", "PUT", "PATCH", "DELETE"}
            and "/resourceslices" in raw_path
            and answer.code < 300
        ):
            now = time.monotonic()
            devices = self.devices()
            with self._stamped:
                self._stamps.append((now, devices))
                self._stamped.notify_all()
        return answer

    def devices(self) -> Devices:
        return {
            d["name"]: d
            for s in self.dra.items(SLICES)
            if s["spec"].get("driver") == DRIVER
            for d in s["spec"].get("devices", [])
        }

    def wait_write(self, predicate: Callable[[Devices], bool], after: float, timeout: float = WAIT) -> float:
        """The time of the first slice write after `after` that left the devices satisfying `predicate`."""
        deadline = time.monotonic() + timeout
        with self._stamped:
            while True:
                for stamp, devices in self._stamps:
                    if stamp > after and predicate(devices):
                        return stamp
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no slice write matching the condition within {timeout} s")
                self._stamped.wait(left)

    def wipe(self, node: str, driver: str | None) -> None:
        """kubelet's DeleteCollection of the node's slices (not stamped: not the driver's write)."""
        for item in self.dra.items(SLICES):
            spec = item["spec"]
            if spec.get("nodeName") == node and driver in (None, spec.get("driver")):
                self.dra.remove(SLICES, item["metadata"]["name"])


# -- running the driver -------------------------------------------------------------------------------------


@dataclass
class DraSession:
    kubelet: FakeDraKubelet
    driver: DraProcess
    api: StampedApiServer
    base: Path
    started: float  # monotonic, just before Popen
    control: Path | None

    @property
    def pid(self) -> int:
        assert self.driver.proc is not None
        return self.driver.proc.pid


class Env:
    """The PKI and the API server, made once for the whole run (key generation is slow)."""

    def __init__(self, pki: Pki, api: StampedApiServer) -> None:
        self.pki = pki
        self.api = api
        self.notes: list[str] = []

    def kubeconfig(self, base: Path) -> Path:
        pair = self.pki.client(f"system:node:{NODE}", ["system:nodes"])
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "k",
                    "cluster": {"server": self.api.url, "certificate-authority": str(self.pki.ca.cert)},
                }
            ],
            "users": [
                {"name": "node", "user": {"client-certificate": str(pair.cert), "client-key": str(pair.key)}}
            ],
            "contexts": [{"name": "node", "context": {"cluster": "k", "user": "node"}}],
            "current-context": "node",
        }
        path = base / "kubelet.conf"
        path.write_text(yaml.safe_dump(document))
        return path

    @contextlib.contextmanager
    def session(
        self, section: str, profile: str = "pcie-4", *, control: bool = False, args: Sequence[str] = ()
    ) -> Iterator[DraSession]:
        """A fresh directory and fake DRA kubelet (its start-up wipe done), then the driver; both stopped."""
        with short_tempdir("drabench-") as base:
            # As test_dra_run's fixture: the driver root holds the fake NVML as its libnvidia-ml.
            cdinode.make_driver(base / "drv", gpus=range(PROFILE_GPUS[profile]), hook=False)
            nvml = base / "drv" / cdinode.LIB_DIR.lstrip("/") / "libnvidia-ml.so.550.54.15"
            nvml.unlink()
            shutil.copyfile(fakenvml.build() / fakenvml.LIBNAME, nvml)
            control_path = base / "nvml-control" if control else None
            if control_path is not None:
                control_path.write_text("")
            kubeconfig = self.kubeconfig(base)
            with FakeDraKubelet(
                base / "registry", node_name=NODE, wipe_slices=self.api.wipe, backoff_initial=0.1
            ) as kubelet:
                kubelet.wait_wiped(None, timeout=WAIT)  # the last session's slices gone before the start
                driver = DraProcess(base, kubeconfig, control=control_path, args=tuple(args), profile=profile)
                started = time.monotonic()
                driver.start()
                try:
                    yield DraSession(kubelet, driver, self.api, base, started, control_path)
                finally:
                    status = driver.stop()
                    self._review(section, driver, status, kubelet)

    def _review(self, section: str, driver: DraProcess, status: int | None, kubelet: FakeDraKubelet) -> None:
        if status not in (0, None):
            self.notes.append(f"[{section}] driver exited {status} on SIGTERM (expected 0)")
        seen: dict[str, int] = {}
        for line in driver.log().splitlines():
            if any(word in line for word in dp._NOTABLE) and "Xid 79" not in line:
                text = line[24:] if line[:4].isdigit() else line
                seen[text] = seen.get(text, 0) + 1
        for text, count in seen.items():
            self.notes.append(f"[{section}] driver log: {text}" + (f"  (x{count})" if count > 1 else ""))
        for rejection in kubelet.rejections():
            self.notes.append(f"[{section}] fake DRA kubelet refused a registration: {rejection.message}")


def has_devices(count: int) -> Callable[[Devices], bool]:
    return lambda devices: len(devices) == count


def health_time(
    kubelet: FakeDraKubelet, predicate: Callable[[dict[tuple[str, str], DeviceHealth]], bool], after: float
) -> float:
    """The arrival time of the first health message after `after` whose devices satisfy `predicate`
    (the state did not satisfy it at `after`, so the message that made it true came later)."""
    kubelet.wait_health(DRIVER, predicate, timeout=WAIT)
    for update in kubelet.health_updates(DRIVER):
        if update.time > after and predicate({(d.pool_name, d.device_name): d for d in update.devices}):
            return update.time
    raise AssertionError("kubelet's view satisfied the condition through no message after the write")


def tainted(name: str, wanted: bool) -> Callable[[Devices], bool]:
    """Whether the device is listed with taints (wanted True) or listed without any (False)."""
    return lambda devices: name in devices and bool(devices[name].get("taints")) == wanted


def med_p99(samples: Sequence[float]) -> str:
    return f"{dur(statistics.median(samples))} / {dur(percentile(samples, 99))}"


def goal(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "n/a"}[met]


# -- 1. start ------------------------------------------------------------------------------------------------


def bench_start(env: Env, counts: Counts, rss: dict[str, str]) -> None:
    n = counts.start_runs
    print("### 1. Start → registered, → slices in the API / first full list\n")
    print(
        f"Fake NVML `pcie-4` (4 GPUs); {n} runs after one warm-up run, driver and plugin starts "
        "interleaved, a fresh directory and kubelet each time. From just before Popen to the fake kubelet's "
        "accepted registration (the DRA kubelet finds `<driver>-reg.sock` by inotify and calls GetInfo at "
        'once, so this bounds "registration socket served" from above), and to the first ResourceSlice '
        "write that left all 4 devices in the API (driver) / the first full ListAndWatch message (plugin).\n"
    )
    reg: list[float] = []
    slices: list[float] = []
    p_reg: list[float] = []
    p_list: list[float] = []
    for run in range(n + 1):
        with env.session("start") as s:
            r = s.kubelet.wait_registered(DRIVER, timeout=WAIT)
            w = s.api.wait_write(has_devices(4), after=s.started)
            if run > 0:
                reg.append(r.time - s.started)
                slices.append(w - s.started)
            if run == n:
                s.kubelet.wait_health(DRIVER, lambda h: len(h) == 4, timeout=WAIT)
                rss["driver, after registration (4 GPUs)"] = mib(vm_kib(s.pid, "VmRSS"))
        with dp.plugin_session("start", profile="pcie-4") as p:
            pr = p.kubelet.wait_registered(GPU, timeout=WAIT)
            pu = p.kubelet.wait_for_update(GPU, dp.has(4), timeout=WAIT)
            if run > 0:
                p_reg.append(pr.time - p.started)
                p_list.append(pu.time - p.started)
            if run == n:
                rss["plugin, after registration (4 GPUs)"] = mib(vm_kib(p.plugin.pid, "VmRSS"))
    floor = measure([sys.executable, "-c", "pass"], n)
    table(
        ["from Popen to", "driver median (best, max)", "goal", "plugin median (best, max)"],
        [
            [
                "registered",
                f"{dur(statistics.median(reg))} ({dur(min(reg))}, {dur(max(reg))})",
                f"≤ 150 ms: {goal(statistics.median(reg) <= 0.150)}",
                f"{dur(statistics.median(p_reg))} ({dur(min(p_reg))}, {dur(max(p_reg))})",
            ],
            [
                "slices in the API / first full list",
                f"{dur(statistics.median(slices))} ({dur(min(slices))}, {dur(max(slices))})",
                f"≤ 300 ms: {goal(statistics.median(slices) <= 0.300)}",
                f"{dur(statistics.median(p_list))} ({dur(min(p_list))}, {dur(max(p_list))})",
            ],
            [
                "`python -c pass` (interpreter floor, same run)",
                f"{dur(floor[0])} (best {dur(floor[1])})",
                "",
                "",
            ],
        ],
    )


# -- 2. NodePrepareResources beside Allocate ---------------------------------------------------------------


def bench_prepare(env: Env, counts: Counts, rss: dict[str, str]) -> None:
    n = counts.prepares
    print("### 2. NodePrepareResources beside Allocate\n")
    print(
        f"Fake NVML `dgx-a100` (8 GPUs) for both. {n:,} calls per row, client side (perf_counter around the "
        "blocking gRPC call of the fake kubelet), rows interleaved call by call after 20 warm-up rounds. "
        "Each Prepare is of a new claim allocated in the test API server (the driver reads it from the API, "
        "writes its CDI spec and syncs its checkpoint), each followed by its Unprepare (timed too). The "
        "plugin's rows: Allocate of one container with 1 or 8 GPUs (envvar strategy).\n"
    )
    sizes = (1, 8)
    prep: dict[int, list[float]] = {k: [] for k in sizes}
    unprep: dict[int, list[float]] = {k: [] for k in sizes}
    alloc: dict[int, list[float]] = {k: [] for k in sizes}
    with env.session("prepare", "dgx-a100") as s, dp.plugin_session("allocate", profile="dgx-a100") as p:
        s.kubelet.wait_registered(DRIVER, timeout=WAIT)
        s.api.wait_write(has_devices(8), after=s.started)
        ids = [d.id for d in dp.ready(p, 8)]
        counter = 0
        for i in range(n + 20):
            for size in sizes:
                counter += 1
                devices = tuple(f"gpu-{(i + k) % 8}" for k in range(size))
                made = s.api.dra.allocate_claim(
                    "ml", f"c{counter}", node=NODE, driver=DRIVER, devices=devices
                )
                claim = Claim("ml", made["metadata"]["uid"], f"c{counter}")
                t0 = time.perf_counter()
                answer = s.kubelet.prepare(DRIVER, [claim])
                t1 = time.perf_counter()
                s.kubelet.unprepare(DRIVER, [claim])
                t2 = time.perf_counter()
                if len(answer[claim.uid]) != size:
                    env.notes.append(
                        f"[prepare] {size}-GPU claim prepared as {len(answer[claim.uid])} devices"
                    )
                t3 = time.perf_counter()
                p.kubelet.allocate(GPU, [[ids[(i + k) % 8] for k in range(size)]])
                t4 = time.perf_counter()
                if i >= 20:
                    prep[size].append(t1 - t0)
                    unprep[size].append(t2 - t1)
                    alloc[size].append(t4 - t3)
        spec = s.base / "cdi"
        left = sorted(x.name for x in spec.iterdir()) if spec.is_dir() else []
        if any(name.startswith(f"k8s.{DRIVER}-claim_") for name in left):
            env.notes.append(f"[prepare] claim CDI specs left after Unprepare: {left}")
        rss[f"driver, after {2 * (n + 20):,} Prepares (as many Unprepares; 8 GPUs)"] = mib(
            vm_kib(s.pid, "VmRSS")
        )
        rss["driver, peak (VmHWM)"] = mib(vm_kib(s.pid, "VmHWM"))
        rss[f"plugin, after {2 * (n + 20):,} Allocates (8 GPUs)"] = mib(vm_kib(p.plugin.pid, "VmRSS"))
        rss["plugin, peak (VmHWM)"] = mib(vm_kib(p.plugin.pid, "VmHWM"))
    rows = []
    for size, limit in ((1, 0.005), (8, 0.010)):
        rows.append(
            [
                f"{size} GPU{'s' if size > 1 else ''}",
                med_p99(prep[size]),
                f"p50 ≤ {limit * 1e3:.0f} ms: {goal(statistics.median(prep[size]) <= limit)}",
                med_p99(unprep[size]),
                med_p99(alloc[size]),
            ]
        )
    table(
        ["claim / request", "Prepare p50 / p99", "goal", "Unprepare p50 / p99", "plugin Allocate p50 / p99"],
        rows,
    )


# -- 3. kubelet restart -------------------------------------------------------------------------------------


def bench_restart(env: Env, counts: Counts) -> None:
    n = counts.restarts
    print("### 3. Kubelet restart → slices back, registered again\n")
    print(
        f"{n} restarts of each fake kubelet, interleaved, fake NVML `pcie-4`. Driver: from the fake DRA "
        "kubelet's start-up wipe of all the node's slices (its DeleteCollection done) to the driver's first "
        "slice write that left all 4 devices in the API; and from the new kubelet's start to the "
        "accepted registration. Plugin: from the new kubelet.sock serving to the accepted registration "
        "and to the first full list.\n"
    )
    back: list[float] = []
    d_reg: list[float] = []
    p_reg: list[float] = []
    p_list: list[float] = []
    with env.session("restart") as s, dp.plugin_session("restart", profile="pcie-4") as p:
        s.kubelet.wait_registered(DRIVER, timeout=WAIT)
        s.api.wait_write(has_devices(4), after=s.started)
        dp.ready(p, 4)
        for _ in range(n):
            started = s.kubelet.restart()
            wiped = s.kubelet.wait_wiped(None, timeout=WAIT, after=started)
            back.append(s.api.wait_write(has_devices(4), after=wiped.time) - wiped.time)
            d_reg.append(s.kubelet.wait_registered(DRIVER, timeout=WAIT, after=started).time - started)
            serving = p.kubelet.restart()
            reg = p.kubelet.wait_registered(GPU, after=serving, timeout=WAIT)
            update = p.kubelet.wait_for_update(GPU, dp.has(4), after=reg.time, timeout=WAIT)
            p_reg.append(reg.time - serving)
            p_list.append(update.time - serving)

    def row(label: str, samples: list[float], target: str = "") -> list[str]:
        return [
            label,
            dur(statistics.median(samples)),
            dur(percentile(samples, 90)),
            dur(max(samples)),
            target,
        ]

    table(
        ["after a kubelet restart", "median", "p90", "max", "goal"],
        [
            row("driver: wipe → slices back in the API", back, f"≤ 1 s: {goal(max(back) <= 1.0)} (max)"),
            row("driver: kubelet start → registered again", d_reg),
            row("plugin: kubelet.sock serving → registered again", p_reg),
            row("plugin: kubelet.sock serving → first full list", p_list),
        ],
    )


# -- 4. Xid → health stream and taint ---------------------------------------------------------------------


def bench_xid(env: Env, counts: Counts) -> None:
    n = counts.xid_samples
    print("### 4. Xid → kubelet's health stream, → the slice's taint; the plugin's Xid → Unhealthy\n")
    print(
        f"{n} samples each, interleaved, fake NVML `pcie-4` (GPUs taken in turn), "
        f"`--recovery-quiet-period {QUIET}` on both. From just before `xid <gpu> 79` is appended to the fake "
        "library's control file to: the fake DRA kubelet's receipt of the NodeWatchResources message showing "
        "the device UNHEALTHY; the first slice write that left the device with the `xid` taint; the plugin's "
        "ListAndWatch message showing the GPU Unhealthy. The fake library reads its control file about "
        "every 5 ms inside nvmlEventSetWait, so up to 5 ms of each figure is the fake's polling (a random "
        "0-20 ms pause before each write spreads the samples over it).\n"
    )
    rng = random.Random(1)  # noqa: S311 (jitter, not secrets)
    stream: list[float] = []
    taint: list[float] = []
    plug: list[float] = []
    args = ["--recovery-quiet-period", str(QUIET)]
    with (
        env.session("xid", control=True, args=args) as s,
        dp.plugin_session("xid", args, profile="pcie-4", control=True, expected=["unhealthy: Xid 79"]) as p,
    ):
        s.kubelet.wait_registered(DRIVER, timeout=WAIT)
        dp.ready(p, 4)
        _wait_log(s.driver, "health monitor armed")
        p.plugin.wait_for_log("health monitor armed", timeout=WAIT)
        assert s.control is not None
        for i in range(n):
            gpu = i % 4
            name = f"gpu-{gpu}"
            s.kubelet.wait_health(
                DRIVER, lambda h: len(h) == 4 and all(d.health == "HEALTHY" for d in h.values()), timeout=WAIT
            )
            p.kubelet.wait_for_devices(GPU, dp.all_healthy, timeout=WAIT)
            time.sleep(rng.uniform(0.0, 0.02))
            t0 = time.monotonic()
            fakenvml.inject(s.control, f"xid {gpu} 79")

            def bad(h: dict[tuple[str, str], DeviceHealth], name: str = name) -> bool:
                entry = h.get((NODE, name))
                return entry is not None and entry.health == "UNHEALTHY"

            stream.append(health_time(s.kubelet, bad, t0) - t0)
            taint.append(s.api.wait_write(tainted(name, True), after=t0) - t0)
            time.sleep(rng.uniform(0.0, 0.02))
            t1 = time.monotonic()
            fakenvml.inject(p.base / "nvml-control", f"xid {gpu} 79")
            update = p.kubelet.wait_for_update(GPU, dp.unhealthy_at(gpu), after=t1, timeout=WAIT)
            plug.append(update.time - t1)
            # Recovery (after the quiet period) before the next sample: no taint left, all healthy.
            s.api.wait_write(tainted(name, False), after=t0)
            p.kubelet.wait_for_update(GPU, dp.all_healthy, after=update.time, timeout=WAIT)

    def row(label: str, samples: list[float], target: str = "") -> list[str]:
        return [
            label,
            dur(statistics.median(samples)),
            dur(percentile(samples, 90)),
            dur(max(samples)),
            target,
        ]

    table(
        ["from the control-file write to", "median", "p90", "max", "goal"],
        [
            row(
                "driver: UNHEALTHY on kubelet's health stream",
                stream,
                f"≤ 20 ms: {goal(statistics.median(stream) <= 0.020)} (median)",
            ),
            row(
                "driver: the slice's `xid` taint in the API", taint, f"≤ 1 s: {goal(max(taint) <= 1.0)} (max)"
            ),
            row("plugin: Unhealthy in ListAndWatch", plug),
        ],
    )


def _wait_log(driver: DraProcess, text: str) -> None:
    deadline = time.monotonic() + WAIT
    while text not in driver.log():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {text!r} in the driver's log within {WAIT} s:\n{driver.log()}")
        time.sleep(0.05)  # polling a log file; the bound above is the only deadline


# -- 5. RSS ------------------------------------------------------------------------------------------------


def print_rss(rss: dict[str, str]) -> None:
    print("### 5. Resident memory (goal for the driver: ≤ 50 MB)\n")
    print("VmRSS from /proc/<pid>/status (VmHWM: the peak so far), taken in sections 1 and 2.\n")
    table(["process, when", "RSS"], [[k, v] for k, v in rss.items()])


# -- main -------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short smoke run (fewer iterations)")
    parser.add_argument("--only", default="", help="comma-separated section numbers to run, e.g. 2,5")
    parser.add_argument("--runs", type=int, default=None, help="starts in section 1 (bench/run passes it on)")
    args = parser.parse_args()
    counts = QUICK if args.quick else FULL
    if args.runs is not None:
        counts = dataclasses.replace(counts, start_runs=max(1, args.runs))
    only = {int(x) for x in args.only.split(",") if x.strip()} or set(range(1, 6))

    fakenvml.build()  # compiled once, outside every timing
    load = os.getloadavg()
    now = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"DRA driver beside the device plugin, {now:%Y-%m-%d %H:%M} UTC: "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.platform()}, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}{' (--quick)' if args.quick else ''}\n"
    )
    rss: dict[str, str] = {}
    with short_tempdir("drabench-pki-") as tmp:
        pki = Pki.create(tmp)
        api = StampedApiServer(pki)
        with api:
            api.add_node(NODE)
            api.node_identity(NODE)
            env = Env(pki, api)
            if 1 in only or 5 in only:
                bench_start(env, counts, rss)
            if 2 in only or 5 in only:
                bench_prepare(env, counts, rss)
            if 3 in only:
                bench_restart(env, counts)
            if 4 in only:
                bench_xid(env, counts)
            if 5 in only:
                print_rss(rss)
    load = os.getloadavg()
    print(f"Load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("### Notes\n")
    lines = env.notes + dp.NOTES.lines
    print(
        "\n".join(f"- {line}" for line in lines) if lines else "Nothing odd in the driver's or plugin's logs."
    )


if __name__ == "__main__":
    main()
