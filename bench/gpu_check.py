"""gpunode's NVML paths on a machine with a real GPU: what the driver answers, and what gpunode makes of it.

Usage (in the project's root on the GPU machine, after `../shared/gpu-check/prepare` here and the wheel
install there):  python3 scripts/gpu_check.py OUTDIR [--fake-lib DIR]

Read-only on the GPU: it queries NVML and registers for events, never sets anything (no MIG mode, clocks,
persistence or reset). It writes into OUTDIR:

- nvidia-smi.txt    `nvidia-smi -q`, `nvidia-smi topo -m` and `nvidia-smi -L` as the driver prints them
- nvml.json         every NVML query gpunode makes (and the ones a DRA driver needs), per GPU: value or error
                    code, and how long the call took
- gpunode.json      discover(), `doctor --json`, `cdi generate --dry-run --json`, the plugin against the
                    test kubelet (start → registered, devices, Allocate, GetPreferredAllocation, the health
                    monitor arming, SIGTERM → exit), timed; with --fake-lib the same plugin start and
                    Allocates on the fake NVML in the same run, for a side-by-side figure
- plugin.log        the plugin's own log
- fakenvml.ini      a fake-NVML config describing this machine (tests/fakenvml's format)

Every section catches its own failure and records it, so one surprise does not cost the rest of the run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULT: dict[str, Any] = {}


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "_fields_"):  # a ctypes structure
        return {name: _jsonable(getattr(value, name)) for name, *_ in value._fields_}
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return _jsonable(dataclasses.asdict(value))
    return repr(value)


def call(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """One NVML call: its value or its error code, and its time."""
    import pynvml

    start = time.perf_counter()
    try:
        value = fn(*args)
        return {"value": _jsonable(value), "us": round((time.perf_counter() - start) * 1e6, 1)}
    except pynvml.NVMLError as exc:
        return {
            "error": int(exc.value),
            "text": str(exc),
            "us": round((time.perf_counter() - start) * 1e6, 1),
        }
    except Exception as exc:  # a pynvml without this function, a ctypes surprise
        return {"exception": f"{type(exc).__name__}: {exc}"}


def section(name: str, body: Callable[[], Any]) -> None:
    start = time.monotonic()
    try:
        RESULT[name] = body()
    except BaseException as exc:
        RESULT[name] = {"failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    RESULT.setdefault("_seconds", {})[name] = round(time.monotonic() - start, 3)
    print(f"[gpu-check] {name}: {RESULT['_seconds'][name]} s", flush=True)


def nvidia_smi(out: Path) -> str:
    parts = []
    for argv in (
        ["nvidia-smi", "-L"],
        ["nvidia-smi", "-q"],
        ["nvidia-smi", "topo", "-m"],
        ["nvidia-smi", "nvlink", "-s"],
    ):
        try:
            run = subprocess.run(argv, check=False, capture_output=True, timeout=60)
            text = (run.stdout + run.stderr).decode("utf-8", "backslashreplace")
            parts.append(f"$ {' '.join(argv)}  (exit {run.returncode})\n{text}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            parts.append(f"$ {' '.join(argv)}: {exc}")
    (out / "nvidia-smi.txt").write_text("\n".join(parts))
    return "written"


EVENT_BITS = {
    "SingleBitEccError": 0x1,
    "DoubleBitEccError": 0x2,
    "PState": 0x4,
    "XidCriticalError": 0x8,
    "Clock": 0x10,
    "PowerSourceChange": 0x80,
    "MigConfigChange": 0x100,
    "GpuUnavailableError": 0x200,
    "GpuRecoveryAction": 0x400,
}


def _gpu_dump(i: int) -> dict[str, Any]:
    import pynvml as n

    h = n.nvmlDeviceGetHandleByIndex(i)
    g: dict[str, Any] = {"index": i}
    simple = [
        "Name",
        "UUID",
        "Serial",
        "MinorNumber",
        "CudaComputeCapability",
        "Architecture",
        "Brand",
        "NumaNodeId",
        "PersistenceMode",
        "MigMode",
        "MaxMigDeviceCount",
        "SupportedEventTypes",
        "MemoryInfo",
        "BAR1MemoryInfo",
        "PciInfo",
        "PciInfo_v3",
        "PciInfoExt",
        "Index",
        "BoardPartNumber",
        "VbiosVersion",
        "ComputeMode",
        "MultiGpuBoard",
        "BoardId",
        "ModuleId",
        "EccMode",
        "RetiredPagesPendingStatus",
        "RemappedRows",
        "CurrPcieLinkGeneration",
        "CurrPcieLinkWidth",
        "MaxPcieLinkGeneration",
        "MaxPcieLinkWidth",
        "IsMigDeviceHandle",
        "PowerManagementLimit",
        "GpuOperationMode",
        "VirtualizationMode",
        "HostVgpuMode",
        "NumGpuCores",
        "MemoryBusWidth",
        "PcieLinkMaxSpeed",
        "AdaptiveClockInfoStatus",
        "DefaultEccMode",
        "Attributes",
        "Attributes_v2",
        "CurrentClocksEventReasons",
        "DisplayMode",
    ]
    for name in simple:
        fn = getattr(n, "nvmlDeviceGet" + name, None)
        g[name] = call(fn, h) if fn else {"exception": "not in pynvml"}
    g["GpuFabricInfo"] = call(lambda: _struct(n.nvmlDeviceGetGpuFabricInfo, "c_nvmlGpuFabricInfo_t", h))
    g["GpuFabricInfoV"] = call(
        lambda: _struct(n.nvmlDeviceGetGpuFabricInfoV, "c_nvmlGpuFabricInfoV_t", h, "nvmlGpuFabricInfo_v2")
    )
    g["PlatformInfo"] = call(
        lambda: _struct(n.nvmlDeviceGetPlatformInfo, "c_nvmlPlatformInfo_t", h, "nvmlPlatformInfo_v2")
    )
    g["MemoryInfo_v2"] = call(lambda: n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2))
    g["TotalEccErrors"] = {
        f"{kind}/{counter}": call(n.nvmlDeviceGetTotalEccErrors, h, k, c)
        for kind, k in (
            ("uncorrected", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            ("corrected", n.NVML_MEMORY_ERROR_TYPE_CORRECTED),
        )
        for counter, c in (("volatile", n.NVML_VOLATILE_ECC), ("aggregate", n.NVML_AGGREGATE_ECC))
    }
    g["CpuAffinity"] = call(n.nvmlDeviceGetCpuAffinity, h, 4)
    g["MemoryAffinity"] = call(lambda: n.nvmlDeviceGetMemoryAffinity(h, 4, n.NVML_AFFINITY_SCOPE_NODE))
    links = {}
    for link in range(18):
        state = call(n.nvmlDeviceGetNvLinkState, h, link)
        entry: dict[str, Any] = {"state": state}
        if state.get("value") == 1:
            entry["remote"] = call(n.nvmlDeviceGetNvLinkRemotePciInfo_v2, h, link)
            entry["remote_type"] = call(
                getattr(n, "nvmlDeviceGetNvLinkRemoteDeviceType", lambda *a: None), h, link
            )
            entry["version"] = call(n.nvmlDeviceGetNvLinkVersion, h, link)
        links[str(link)] = entry
    g["NvLink"] = links
    g["ByUUID"] = call(lambda: n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(n.nvmlDeviceGetUUID(h))))
    g["ByPci"] = call(
        lambda: n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(n.nvmlDeviceGetPciInfo(h).busId))
    )
    # Which event types can be registered one by one (the health monitor's mask is built from these).
    reg = {}
    for ev, bit in EVENT_BITS.items():
        es = n.nvmlEventSetCreate()
        try:
            reg[ev] = call(n.nvmlDeviceRegisterEvents, h, bit, es)
        finally:
            n.nvmlEventSetFree(es)
    g["RegisterEvents"] = reg
    # nvmlEventSetWait with no event pending: how long a 100 ms / 500 ms wait really takes, and its code.
    es = n.nvmlEventSetCreate()
    waits = []
    try:
        mask = sum(
            bit
            for ev, bit in EVENT_BITS.items()
            if "error" not in reg.get(ev, {}) and "exception" not in reg.get(ev, {})
        )
        mask &= ~0x4 & ~0x10  # no PState/Clock: they fire on their own and would end the wait early
        g["wait_mask"] = mask
        if mask:
            n.nvmlDeviceRegisterEvents(h, mask, es)
            for timeout_ms in (100, 100, 500, 0):
                t = time.perf_counter()
                r = call(n.nvmlEventSetWait_v2, es, timeout_ms)
                r["asked_ms"] = timeout_ms
                r["took_ms"] = round((time.perf_counter() - t) * 1e3, 2)
                waits.append(r)
    finally:
        n.nvmlEventSetFree(es)
    g["EventSetWait"] = waits
    # Timing of the calls discovery makes, repeated (is any slow enough to matter for a start?).
    reps = {}
    for name in ("UUID", "Name", "MemoryInfo", "PciInfo", "NumaNodeId", "MigMode", "MinorNumber"):
        fn = getattr(n, "nvmlDeviceGet" + name, None)
        if fn is None:
            continue
        times = []
        for _ in range(50):
            t = time.perf_counter()
            with contextlib.suppress(Exception):  # an error is timed as well
                fn(h)
            times.append((time.perf_counter() - t) * 1e6)
        reps[name] = {"median_us": round(statistics.median(times), 1), "max_us": round(max(times), 1)}
    g["repeat_timing"] = reps
    return g


def nvml_dump() -> dict[str, Any]:
    import pynvml as n

    start = time.perf_counter()
    n.nvmlInit()
    dump: dict[str, Any] = {
        "init_ms": round((time.perf_counter() - start) * 1e3, 2),
        "pynvml": getattr(n, "__version__", None),
    }
    dump["system"] = {
        "driver": call(n.nvmlSystemGetDriverVersion),
        "nvml": call(n.nvmlSystemGetNVMLVersion),
        "cuda": call(n.nvmlSystemGetCudaDriverVersion),
        "cuda_v2": call(n.nvmlSystemGetCudaDriverVersion_v2),
        "count": call(n.nvmlDeviceGetCount),
    }
    count = dump["system"]["count"].get("value") or 0
    gpus = []
    for i in range(count):
        gpus.append(_gpu_dump(i))
    dump["gpus"] = gpus
    t = time.perf_counter()
    n.nvmlShutdown()
    dump["shutdown_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    return dump


def _struct(fn: Callable[..., Any], struct: str, handle: Any, version: str | None = None) -> Any:
    """Calls that fill a structure the caller passes (pynvml leaves their allocation to us)."""
    import pynvml as n

    info = getattr(n, struct)()
    if version and hasattr(info, "version") and hasattr(n, version):
        info.version = getattr(n, version)
    fn(handle, info)
    return info


def _value(gpu: dict[str, Any], key: str) -> Any:
    return gpu.get(key, {}).get("value")


def fake_config(dump: dict[str, Any]) -> str:
    """tests/fakenvml's INI for this machine, from the dump (values the fake knows)."""
    lines = ["# Written by scripts/gpu_check.py from a real driver's answers.", "[system]"]
    s = dump["system"]
    lines.append(f"driver_version = {s['driver'].get('value')}")
    lines.append(f"cuda_version = {s['cuda_v2'].get('value', s['cuda'].get('value'))}")
    lines.append(f"nvml_version = {s['nvml'].get('value')}")
    for g in dump["gpus"]:
        lines.append("")
        lines.append("[gpu]")
        v = functools.partial(_value, g)
        lines.append(f"name = {v('Name')}")
        lines.append(f"uuid = {v('UUID')}")
        if v("Serial"):
            lines.append(f"serial = {v('Serial')}")
        mem = v("MemoryInfo") or {}
        if mem:
            lines.append(f"memory_total = {mem.get('total')}")
            lines.append(f"memory_used = {mem.get('used')}")
        pci = v("PciInfo") or {}
        if pci:
            lines.append(f"pci_bus_id = {pci.get('busId')}")
            lines.append(f"pci_device_id = {hex(pci.get('pciDeviceId') or 0)}")
            lines.append(f"pci_subsystem_id = {hex(pci.get('pciSubSystemId') or 0)}")
        lines.append(f"minor = {v('MinorNumber')}")
        cc = v("CudaComputeCapability")
        if cc:
            lines.append(f"cc = {cc[0]}.{cc[1]}")
        lines.append(f"architecture = {v('Architecture')}")
        lines.append(f"brand = {v('Brand')}")
        lines.append(f"numa = {g['NumaNodeId'].get('value', -1)}")
        lines.append(f"persistence = {v('PersistenceMode') or 0}")
        mig = g["MigMode"]
        lines.append(f"mig_capable = {0 if 'error' in mig else 1}")
        if "value" in mig:
            lines.append(f"mig_mode = {mig['value'][0]}")
            lines.append(f"pending_mig_mode = {mig['value'][1]}")
            lines.append(f"max_mig_devices = {v('MaxMigDeviceCount') or 0}")
        if v("SupportedEventTypes") is not None:
            lines.append(f"supported_events = {hex(v('SupportedEventTypes'))}")
        registrable = sum(bit for ev, bit in EVENT_BITS.items() if "value" in g["RegisterEvents"].get(ev, {}))
        lines.append(f"registrable_events = {hex(registrable)}")
        unsupported = [
            f"nvmlDeviceGet{k}"
            for k in ("Serial", "NumaNodeId", "PersistenceMode", "RemappedRows")
            if g[k].get("error") == 3
        ]
        if unsupported:
            lines.append(f"unsupported = {', '.join(unsupported)}")
    return "\n".join(lines) + "\n"


def gpunode_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> dict[str, Any]:
    t = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "gpunode", *args],
        check=False,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )
    out = run.stdout.decode("utf-8", "backslashreplace")
    result: dict[str, Any] = {
        "exit": run.returncode,
        "ms": round((time.monotonic() - t) * 1e3),
        "stderr": run.stderr.decode("utf-8", "backslashreplace")[-4000:],
    }
    try:
        result["json"] = json.loads(out)
    except ValueError:
        result["stdout"] = out[-8000:]
    return result


def discover_section() -> Any:
    from gpunode.nvml.discovery import discover

    t = time.perf_counter()
    inv = discover()
    return {"ms": round((time.perf_counter() - t) * 1e3, 1), "inventory": _jsonable(inv)}


def plugin_section(out: Path, label: str, fake_env: dict[str, str] | None) -> dict[str, Any]:
    """The plugin as a process against the test kubelet: start, list, Allocate, preferred, health, stop."""
    from tests.integration.kubelet import FakeKubelet
    from tests.integration.pluginproc import PluginProcess

    res: dict[str, Any] = {}
    base = Path(tempfile.mkdtemp(prefix="gc-", dir="/tmp"))
    sock = base / "dp"
    with FakeKubelet(sock) as kubelet:
        env = {"GPUNODE_PLUGIN_LOG_LEVEL": "debug"}
        plugin = PluginProcess(sock, [], profile=None, env={**env, **(fake_env or {})}, log_dir=base)
        started = time.monotonic()
        plugin.start()
        try:
            reg = kubelet.wait_registered("nvidia.com/gpu", timeout=25)
            res["start_to_registered_ms"] = round((reg.time - started) * 1e3, 1)
            res["registered_after_ms"] = round((time.monotonic() - started) * 1e3, 1)
            devices = kubelet.wait_for_devices("nvidia.com/gpu", timeout=30)
            res["devices"] = [_jsonable(d._asdict()) for d in devices]
            ids = [d.id for d in devices]
            res["options"] = str(kubelet.options("nvidia.com/gpu"))
            times = []
            resp = None
            for _ in range(200):
                t = time.perf_counter()
                resp = kubelet.allocate("nvidia.com/gpu", [ids[:1]])
                times.append((time.perf_counter() - t) * 1e3)
            res["allocate_response"] = str(resp)
            times.sort()
            res["allocate_ms"] = {
                "p50": round(times[len(times) // 2], 3),
                "p99": round(times[int(len(times) * 0.99)], 3),
                "max": round(times[-1], 3),
            }
            try:
                pref = kubelet.get_preferred_allocation("nvidia.com/gpu", ids, size=1)
                res["preferred"] = str(pref)
            except Exception as exc:
                res["preferred"] = f"{type(exc).__name__}: {exc}"
            time.sleep(3)  # the health monitor arms and waits on real events meanwhile
            res["status_file"] = (
                json.loads(plugin.status_path.read_text()) if plugin.status_path.exists() else None
            )
        finally:
            t = time.monotonic()
            plugin.signal(signal.SIGTERM)
            res["exit"] = plugin.wait(30)
            res["sigterm_to_exit_ms"] = round((time.monotonic() - t) * 1e3, 1)
        log = plugin.log_path.read_text(errors="backslashreplace")
        (out / f"plugin-{label}.log").write_text(log)
        res["log_warnings"] = [
            line for line in log.splitlines() if any(w in line for w in ("WARNING", "ERROR", "Traceback"))
        ]
    return res


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    fake_lib = sys.argv[sys.argv.index("--fake-lib") + 1] if "--fake-lib" in sys.argv else None
    section("nvidia_smi", lambda: nvidia_smi(out))
    section("nvml", nvml_dump)
    if "gpus" in RESULT.get("nvml", {}):
        section("fake_config", lambda: (out / "fakenvml.ini").write_text(fake_config(RESULT["nvml"])))
    section("discover", discover_section)
    section("doctor", lambda: gpunode_cli(["doctor", "--json"]))
    section("cdi_generate", lambda: gpunode_cli(["cdi", "generate", "--dry-run", "--json"]))
    section(
        "cdi_generate_driver_root",
        lambda: gpunode_cli(
            [
                "cdi",
                "generate",
                "--dry-run",
                "--json",
                "--driver-root",
                "/usr/local/nvidia",
                "--dev-root",
                "/",
            ]
        ),
    )
    section("plugin_real", lambda: plugin_section(out, "real", None))
    if fake_lib:
        lib_dir = Path(fake_lib) if Path(fake_lib).is_dir() else Path(fake_lib).parent
        fake = {"LD_LIBRARY_PATH": str(lib_dir), "FAKE_NVML_PROFILE": "h100"}
        section("plugin_fake_h100", lambda: plugin_section(out, "fake", fake))
        section("plugin_real_again", lambda: plugin_section(out, "real2", None))
    (out / "gpunode.json").write_text(
        json.dumps({k: v for k, v in RESULT.items() if k != "nvml"}, indent=1, default=str)
    )
    if "nvml" in RESULT:
        (out / "nvml.json").write_text(json.dumps(RESULT["nvml"], indent=1, default=str))
    print(json.dumps(RESULT.get("_seconds"), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
