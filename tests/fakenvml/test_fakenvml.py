"""The fake libnvidia-ml.so.1, exercised through the real pynvml module.

Most tests load the library into this process (fast, and it proves re-initialisation with a
different machine works); the profile survey runs in subprocesses through ``env()``, the way
the CLI is tested.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from . import LIBNAME, PROFILES, SOURCE, build, env, inject, last_error, load_into_process

N = pynvml
GiB = 1 << 30
MiB = 1 << 20

Start = Callable[..., Any]


def _shutdown_all() -> None:
    if N.nvmlLib is None:
        return
    for _ in range(100):
        try:
            N.nvmlShutdown()
        except N.NVMLError_Uninitialized:
            return


@pytest.fixture
def nvml() -> Iterator[Start]:
    """start(profile=..., config=..., control=...) -> pynvml, initialised on the fake."""
    _shutdown_all()

    def start(profile: str | None = None, config: Path | None = None, control: Path | None = None) -> Any:
        load_into_process(profile, config, control)
        N.nvmlInit()
        return N

    yield start
    _shutdown_all()
    load_into_process()


@pytest.fixture
def lib() -> ctypes.CDLL:
    return load_into_process()


def write(tmp_path: Path, text: str, name: str = "gpus.ini") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def handles(n: Any) -> list[Any]:
    return [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]


# ---------------------------------------------------------------------------------------------
# build() and env()
# ---------------------------------------------------------------------------------------------


def test_build_is_cached_and_has_the_nvml_soname(tmp_path: Path) -> None:
    first = build(tmp_path)
    lib_path = first / LIBNAME
    mtime = lib_path.stat().st_mtime_ns
    assert build(tmp_path) == first
    assert lib_path.stat().st_mtime_ns == mtime
    dyn = subprocess.run(["readelf", "-d", str(lib_path)], capture_output=True, text=True, check=True)
    assert "Library soname: [libnvidia-ml.so.1]" in dyn.stdout


def test_build_has_no_warnings(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
         "-Wl,-soname,libnvidia-ml.so.1", "-o", str(tmp_path / LIBNAME), str(SOURCE), "-lpthread"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_changed_source_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = build(tmp_path)
    edited = tmp_path / "fakenvml.c"
    edited.write_text(SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(sys.modules[build.__module__], "SOURCE", edited)
    rebuilt = build(tmp_path)
    assert rebuilt != original
    assert (rebuilt / LIBNAME).is_file()


def test_compile_error_raises_with_gcc_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "fakenvml.c"
    broken.write_text("int broken( {\n")
    monkeypatch.setattr(sys.modules[build.__module__], "SOURCE", broken)
    with pytest.raises(RuntimeError, match="gcc exit") as exc:
        build(tmp_path / "out")
    assert "error" in str(exc.value)


def test_missing_gcc_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    edited = tmp_path / "fakenvml.c"
    edited.write_text(SOURCE.read_text() + "\n/* never built */\n")
    monkeypatch.setattr(sys.modules[build.__module__], "SOURCE", edited)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="gcc not found"):
        build(tmp_path / "out")


def test_env_prepends_library_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/x")
    e = env("h100", control=tmp_path / "ctl")
    assert e["LD_LIBRARY_PATH"] == f"{build()}:/opt/x"
    assert e["FAKE_NVML_PROFILE"] == "h100"
    assert e["FAKE_NVML_CONFIG"] == ""
    assert e["FAKE_NVML_CONTROL"] == str(tmp_path / "ctl")


# ---------------------------------------------------------------------------------------------
# Every profile, seen by a fresh process through env()
# ---------------------------------------------------------------------------------------------

SURVEY = r"""
import json, pynvml as N

def q(f, *a):
    try:
        v = f(*a)
    except N.NVMLError as e:
        return {"error": e.value}
    return v.decode() if isinstance(v, bytes) else v

try:
    N.nvmlInit()
except N.NVMLError as e:
    print(json.dumps({"init_error": e.value}))
    raise SystemExit(0)
out = {"driver": N.nvmlSystemGetDriverVersion(), "cuda": N.nvmlSystemGetCudaDriverVersion_v2(),
       "nvml": N.nvmlSystemGetNVMLVersion(), "gpus": []}
hs = []
for i in range(N.nvmlDeviceGetCount()):
    h = q(N.nvmlDeviceGetHandleByIndex, i)
    if isinstance(h, dict):
        out["gpus"].append(h)
        hs.append(None)
        continue
    hs.append(h)
    links = 0
    while not isinstance(q(N.nvmlDeviceGetNvLinkState, h, links), dict):
        links += 1
    out["gpus"].append({
        "name": q(N.nvmlDeviceGetName, h), "uuid": q(N.nvmlDeviceGetUUID, h),
        "mem": q(lambda: N.nvmlDeviceGetMemoryInfo(h).total),
        "bus": q(lambda: N.nvmlDeviceGetPciInfo_v3(h).busId),
        "cc": q(N.nvmlDeviceGetCudaComputeCapability, h), "arch": q(N.nvmlDeviceGetArchitecture, h),
        "numa": q(N.nvmlDeviceGetNumaNodeId, h), "minor": q(N.nvmlDeviceGetMinorNumber, h),
        "mig": q(N.nvmlDeviceGetMigMode, h), "persistence": q(N.nvmlDeviceGetPersistenceMode, h),
        "links": links,
    })
ok = [h for h in hs if h is not None]
out["topo"] = [[q(N.nvmlDeviceGetTopologyCommonAncestor, a, b) for b in ok] for a in ok]
out["nvlink"] = [[q(N.nvmlDeviceGetP2PStatus, a, b, N.NVML_P2P_CAPS_INDEX_NVLINK) for b in ok] for a in ok]
print(json.dumps(out))
N.nvmlShutdown()
"""


def survey(**kwargs: Any) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", SURVEY],
        env={**os.environ, **env(**kwargs)},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_every_profile_initialises_or_fails_as_designed() -> None:
    for profile in PROFILES:
        s = survey(profile=profile)
        if profile == "no-driver":
            assert s == {"init_error": N.NVML_ERROR_DRIVER_NOT_LOADED}
        elif profile == "init-fail":
            assert s == {"init_error": N.NVML_ERROR_LIB_RM_VERSION_MISMATCH}
        else:
            assert "init_error" not in s, profile


def test_default_profile_is_dgx_a100() -> None:
    assert survey() == survey(profile="dgx-a100")


def test_profile_dgx_a100() -> None:
    s = survey(profile="dgx-a100")
    assert (s["driver"], s["cuda"], s["nvml"]) == ("550.54.15", 12040, "12.550.54.15")
    g = s["gpus"]
    assert len(g) == 8
    assert {x["name"] for x in g} == {"NVIDIA A100-SXM4-80GB"}
    assert {x["mem"] for x in g} == {80 * GiB}
    assert [x["bus"] for x in g] == [
        f"00000000:{b}:00.0" for b in ("07", "0F", "47", "4E", "87", "90", "B7", "BD")
    ]
    assert [x["numa"] for x in g] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [x["minor"] for x in g] == list(range(8))
    assert {tuple(x["cc"]) for x in g} == {(8, 0)}
    assert {x["arch"] for x in g} == {N.NVML_DEVICE_ARCH_AMPERE}
    assert {x["links"] for x in g} == {12}
    assert {tuple(x["mig"]) for x in g} == {(0, 0)}
    assert len({x["uuid"] for x in g}) == 8
    t = s["topo"]
    assert t[0][0] == N.NVML_TOPOLOGY_INTERNAL
    assert t[0][1] == t[2][3] == t[4][5] == t[6][7] == N.NVML_TOPOLOGY_SINGLE
    assert t[0][2] == t[1][3] == t[4][7] == N.NVML_TOPOLOGY_HOSTBRIDGE
    assert t[0][4] == t[3][7] == N.NVML_TOPOLOGY_SYSTEM
    assert all(v == N.NVML_P2P_STATUS_OK for row in s["nvlink"] for v in row)


def test_profile_pcie_4() -> None:
    s = survey(profile="pcie-4")
    g = s["gpus"]
    assert [x["name"] for x in g] == ["NVIDIA L4"] * 4
    assert {x["mem"] for x in g} == {23034 * MiB}
    assert {tuple(x["cc"]) for x in g} == {(8, 9)}
    assert {x["arch"] for x in g} == {N.NVML_DEVICE_ARCH_ADA}
    assert [x["numa"] for x in g] == [0, 0, 1, 1]
    assert {x["links"] for x in g} == {0}
    assert {x["mig"]["error"] for x in g} == {N.NVML_ERROR_NOT_SUPPORTED}
    t = s["topo"]
    assert t[0][1] == t[2][3] == N.NVML_TOPOLOGY_SINGLE
    assert t[0][2] == t[1][3] == N.NVML_TOPOLOGY_SYSTEM
    off_diag = {s["nvlink"][i][j] for i in range(4) for j in range(4) if i != j}
    assert off_diag == {N.NVML_P2P_STATUS_NOT_SUPPORTED}


def test_profile_pairs_4() -> None:
    s = survey(profile="pairs-4")
    g = s["gpus"]
    assert [x["name"] for x in g] == ["NVIDIA RTX A6000"] * 4
    assert {tuple(x["cc"]) for x in g} == {(8, 6)}
    assert {x["links"] for x in g} == {4}
    assert {x["numa"] for x in g} == {0}
    ok, no = N.NVML_P2P_STATUS_OK, N.NVML_P2P_STATUS_NOT_SUPPORTED
    assert s["nvlink"] == [[ok, ok, no, no], [ok, ok, no, no], [no, no, ok, ok], [no, no, ok, ok]]
    assert s["topo"][0][1] == N.NVML_TOPOLOGY_SINGLE
    assert s["topo"][0][2] == s["topo"][1][3] == N.NVML_TOPOLOGY_HOSTBRIDGE


def test_profile_mig() -> None:
    s = survey(profile="mig")
    g = s["gpus"]
    assert [x["name"] for x in g] == ["NVIDIA A100-SXM4-40GB"] * 2
    assert [x["mig"] for x in g] == [[1, 1], [0, 0]]


def test_profile_h100() -> None:
    s = survey(profile="h100")
    assert (s["driver"], s["cuda"], s["nvml"]) == ("560.35.03", 12060, "12.560.35.03")
    (g,) = s["gpus"]
    assert g["name"] == "NVIDIA H100 80GB HBM3"
    assert tuple(g["cc"]) == (9, 0)
    assert g["arch"] == N.NVML_DEVICE_ARCH_HOPPER
    assert g["mig"] == [0, 0]


def test_profile_no_gpu() -> None:
    s = survey(profile="no-gpu")
    assert s["gpus"] == []
    assert s["driver"] == "550.54.15"


def test_profile_lost_gpu() -> None:
    g = survey(profile="lost-gpu")["gpus"]
    assert len(g) == 4
    assert g[2] == {"error": N.NVML_ERROR_GPU_IS_LOST}
    assert [x["name"] for x in (g[0], g[1], g[3])] == ["NVIDIA L4"] * 3


def test_profile_old_driver() -> None:
    g = survey(profile="old-driver")["gpus"]
    assert len(g) == 4
    for x in g:
        assert x["numa"] == {"error": N.NVML_ERROR_FUNCTION_NOT_FOUND}
        assert x["mig"] == {"error": N.NVML_ERROR_FUNCTION_NOT_FOUND}
        assert x["persistence"] == {"error": N.NVML_ERROR_NOT_SUPPORTED}
        assert x["name"] == "NVIDIA L4"


def test_config_file_wins_over_profile(tmp_path: Path) -> None:
    cfg = write(tmp_path, "[gpu]\nname = Only One\n")
    s = survey(profile="dgx-a100", config=cfg)
    assert [x["name"] for x in s["gpus"]] == ["Only One"]


# ---------------------------------------------------------------------------------------------
# Init, shutdown, reference counting, errors
# ---------------------------------------------------------------------------------------------


def test_calls_before_init_are_uninitialized(nvml: Start) -> None:
    n = nvml("pcie-4")
    n.nvmlShutdown()
    with pytest.raises(N.NVMLError_Uninitialized):
        n.nvmlDeviceGetCount()
    with pytest.raises(N.NVMLError_Uninitialized):
        n.nvmlSystemGetDriverVersion()
    with pytest.raises(N.NVMLError_Uninitialized):
        n.nvmlShutdown()


def test_init_is_reference_counted(nvml: Start) -> None:
    n = nvml("pcie-4")
    n.nvmlInit()
    n.nvmlShutdown()
    assert n.nvmlDeviceGetCount() == 4
    n.nvmlShutdown()
    with pytest.raises(N.NVMLError_Uninitialized):
        n.nvmlDeviceGetCount()


def test_reinit_reads_new_configuration(nvml: Start) -> None:
    n = nvml("dgx-a100")
    assert n.nvmlDeviceGetCount() == 8
    n.nvmlShutdown()
    n = nvml("h100")
    assert n.nvmlDeviceGetCount() == 1
    assert n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA H100 80GB HBM3"


def test_init_with_flags_and_init_v2(nvml: Start, lib: ctypes.CDLL) -> None:
    n = nvml("h100")
    n.nvmlShutdown()
    n.nvmlInitWithFlags(1)
    assert n.nvmlDeviceGetCount() == 1
    assert lib.nvmlInit_v2() == 0
    assert lib.nvmlInit() == 0
    for _ in range(3):
        n.nvmlShutdown()
    with pytest.raises(N.NVMLError_Uninitialized):
        n.nvmlDeviceGetCount()


@pytest.mark.parametrize(
    ("profile", "error"),
    [("no-driver", N.NVMLError_DriverNotLoaded), ("init-fail", N.NVMLError_LibRmVersionMismatch)],
)
def test_init_failure_profiles(nvml: Start, profile: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        nvml(profile)
    with pytest.raises(N.NVMLError_Uninitialized):
        N.nvmlDeviceGetCount()


@pytest.mark.parametrize("code", [4, 9, 18, 999])
def test_init_error_key(nvml: Start, tmp_path: Path, code: int) -> None:
    with pytest.raises(N.NVMLError) as exc:
        nvml(config=write(tmp_path, f"[system]\ninit_error = {code}\n"))
    assert exc.value.value == code


def test_unknown_profile_fails_init_with_reason(nvml: Start) -> None:
    with pytest.raises(N.NVMLError_Unknown):
        nvml("dgx-z9000")
    assert "unknown FAKE_NVML_PROFILE 'dgx-z9000'" in last_error()
    assert "pairs-4" in last_error()


def test_missing_config_file_fails_init(nvml: Start, tmp_path: Path) -> None:
    with pytest.raises(N.NVMLError_Unknown):
        nvml(config=tmp_path / "nope.ini")
    assert "cannot read FAKE_NVML_CONFIG" in last_error()


def test_config_error_is_printed_on_stderr(tmp_path: Path) -> None:
    cfg = write(tmp_path, "[gpu]\nnmae = typo\n")
    proc = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"],
        env={**os.environ, **env(config=cfg)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert "NVMLError_Unknown" in proc.stderr
    assert f"fakenvml: {cfg}:2: unknown key 'nmae' in [gpu]" in proc.stderr


def test_error_strings(nvml: Start) -> None:
    nvml("no-gpu")
    assert N.nvmlErrorString(N.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
    assert N.nvmlErrorString(N.NVML_ERROR_DRIVER_NOT_LOADED) == "Driver Not Loaded"
    assert N.nvmlErrorString(N.NVML_ERROR_FUNCTION_NOT_FOUND) == "Function Not Found"
    assert N.nvmlErrorString(N.NVML_ERROR_UNKNOWN) == "Unknown Error"
    assert str(N.NVMLError(N.NVML_ERROR_NO_PERMISSION)) == "Insufficient Permissions"


# ---------------------------------------------------------------------------------------------
# Config format
# ---------------------------------------------------------------------------------------------

FULL = """
# a comment line
[system]
driver_version = 535.104.05   # trailing comment
cuda_version = 12020
nvml_version = 12.535.104.05

[gpu]
name = Test GPU Alpha
uuid = GPU-00000000-1111-2222-3333-444444444444
serial = 1234567890123
memory_total = 16 GiB
memory_used = 0x40000000
memory_reserved = 256 MiB
pci_bus_id = 0000:3b:00.0
pci_device_id = 0x1DB610DE
pci_subsystem_id = 0x124A10DE
pci_class = 0x0300
minor = 5
cc = 7.0
architecture = 5
brand = 2
numa = 1
persistence = no
ecc_uncorrected = 3
ecc_corrected = 11
retired_pages_pending = yes
remapped_corrected = 2
remapped_uncorrected = 1
remapped_pending = 1
remapped_failure = true
supported_events = 0x8

[gpu]
name = Test GPU Beta
pci_bus_id = 86:00.0
numa = -1
ecc_enabled = 0
nvlink_links = 6
"""


def test_config_keys(nvml: Start, tmp_path: Path) -> None:
    n = nvml(config=write(tmp_path, FULL))
    assert n.nvmlSystemGetDriverVersion() == "535.104.05"
    assert n.nvmlSystemGetCudaDriverVersion() == 12020
    assert n.nvmlSystemGetNVMLVersion() == "12.535.104.05"
    a, b = handles(n)
    assert n.nvmlDeviceGetName(a) == "Test GPU Alpha"
    assert n.nvmlDeviceGetUUID(a) == "GPU-00000000-1111-2222-3333-444444444444"
    assert n.nvmlDeviceGetSerial(a) == "1234567890123"
    m1 = n.nvmlDeviceGetMemoryInfo(a)
    assert (m1.total, m1.used, m1.free) == (16 * GiB, GiB, 15 * GiB)
    m2 = n.nvmlDeviceGetMemoryInfo(a, version=N.nvmlMemory_v2)
    assert (m2.total, m2.reserved, m2.used, m2.free) == (16 * GiB, 256 * MiB, 768 * MiB, 15 * GiB)
    pci = n.nvmlDeviceGetPciInfo_v3(a)
    assert pci.busId == "00000000:3B:00.0"
    assert pci.busIdLegacy == "0000:3B:00.0"
    assert (pci.domain, pci.bus, pci.device) == (0, 0x3B, 0)
    assert (pci.pciDeviceId, pci.pciSubSystemId) == (0x1DB610DE, 0x124A10DE)
    ext = N.nvmlPciInfoExt_v1_t()
    ext.version = N.nvmlPciInfoExt_v1
    n.nvmlDeviceGetPciInfoExt(a, ctypes.byref(ext))
    assert (ext.bus, ext.baseClass, ext.subClass, ext.busId) == (0x3B, 3, 0, "00000000:3B:00.0")
    assert n.nvmlDeviceGetMinorNumber(a) == 5
    assert n.nvmlDeviceGetCudaComputeCapability(a) == (7, 0)
    assert n.nvmlDeviceGetArchitecture(a) == N.NVML_DEVICE_ARCH_VOLTA
    assert n.nvmlDeviceGetBrand(a) == N.NVML_BRAND_TESLA
    assert n.nvmlDeviceGetNumaNodeId(a) == 1
    assert n.nvmlDeviceGetPersistenceMode(a) == 0
    for counter in (N.NVML_VOLATILE_ECC, N.NVML_AGGREGATE_ECC):
        assert n.nvmlDeviceGetTotalEccErrors(a, N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter) == 3
        assert n.nvmlDeviceGetTotalEccErrors(a, N.NVML_MEMORY_ERROR_TYPE_CORRECTED, counter) == 11
    assert n.nvmlDeviceGetRetiredPagesPendingStatus(a) == 1
    assert n.nvmlDeviceGetRemappedRows(a) == (2, 1, 1, 1)
    assert n.nvmlDeviceGetSupportedEventTypes(a) == N.nvmlEventTypeXidCriticalError
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetMigMode(a)
    assert n.nvmlDeviceGetMaxMigDeviceCount(a) == 0

    # defaults of the second GPU
    assert n.nvmlDeviceGetIndex(b) == 1
    assert n.nvmlDeviceGetMinorNumber(b) == 1
    assert n.nvmlDeviceGetPciInfo_v3(b).busId == "00000000:86:00.0"
    assert n.nvmlDeviceGetUUID(b).startswith("GPU-")
    assert len(n.nvmlDeviceGetUUID(b)) == 40
    assert len(n.nvmlDeviceGetSerial(b)) == 13
    mb = n.nvmlDeviceGetMemoryInfo(b)
    assert mb.used == mb.total // 200
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetNumaNodeId(b)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetTotalEccErrors(b, 1, 0)
    assert n.nvmlDeviceGetNvLinkState(b, 5) == 0
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetNvLinkState(b, 6)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetNvLinkRemotePciInfo(b, 0)
    assert n.nvmlDeviceGetTopologyCommonAncestor(a, b) == N.NVML_TOPOLOGY_SYSTEM


def test_generated_ids_are_deterministic(nvml: Start, tmp_path: Path) -> None:
    cfg = write(tmp_path, "[gpu]\n[gpu]\n")
    n = nvml(config=cfg)
    first = [(n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetSerial(h)) for h in handles(n)]
    n.nvmlShutdown()
    n = nvml(config=cfg)
    assert [(n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetSerial(h)) for h in handles(n)] == first
    assert first[0] != first[1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[gpu]\nnmae = x\n", "unknown key 'nmae' in [gpu]"),
        ("[gpus]\n", "unknown section [gpus]"),
        ("name = x\n", "outside of a section"),
        ("[gpu]\nmemory_total = lots\n", "bad value for memory_total"),
        ("[gpu]\ncc = 8\n", "bad value for cc"),
        ("[gpu]\npci_bus_id = 0000:zz:00.0\n", "bad value for pci_bus_id"),
        ("[gpu]\nname\n", "expected 'key = value'"),
        ("[gpu\n", "bad section header"),
        ("[mig]\n", "[mig] before any [gpu]"),
        ("[gpu]\n[mig]\n", "need mig_capable = 1"),
        ("[gpu]\nmig_capable = 1\nmax_mig_devices = 2\n[mig]\nslot = 2\n", "MIG slot 2"),
        ("[gpu]\npci_bus_id = 07:00.0\n[gpu]\npci_bus_id = 0:7:0.0\n", "same pci_bus_id"),
        ("[gpu]\nnvlink = 00000000:C4:00.0*40\n", "more than 36 NVLink links"),
        ("[gpu]\nnvlink = 00000000:C4:00.0*4\nnvlink_links = 2\n", "nvlink_links"),
        ("[gpu]\nmemory_total = 1 GiB\nmemory_used = 2 GiB\n", "memory_used"),
        ("[gpu]\npersistence = maybe\n", "bad value for persistence"),
        ("[system]\ncuda_version = 12.4\n", "bad value for cuda_version"),
    ],
)
def test_config_errors(nvml: Start, tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(N.NVMLError_Unknown):
        nvml(config=write(tmp_path, text))
    assert message in last_error()


# ---------------------------------------------------------------------------------------------
# Failure modes
# ---------------------------------------------------------------------------------------------


def test_bad_index_and_lookups(nvml: Start) -> None:
    n = nvml("pcie-4")
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetHandleByIndex(4)
    with pytest.raises(N.NVMLError_NotFound):
        n.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(N.NVMLError_NotFound):
        n.nvmlDeviceGetHandleByPciBusId("00000000:99:00.0")
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetHandleByPciBusId("not a bus id")
    h = n.nvmlDeviceGetHandleByIndex(2)
    assert n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(n.nvmlDeviceGetUUID(h))) == 2
    for bus in ("00000000:CA:00.0", "0000:ca:00.0", "CA:00.0"):
        assert n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(bus)) == 2


def test_handle_error(nvml: Start, tmp_path: Path) -> None:
    n = nvml(config=write(tmp_path, "[gpu]\n[gpu]\nhandle_error = 4\n"))
    assert n.nvmlDeviceGetCount() == 2
    n.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(N.NVMLError_NoPermission):
        n.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(N.NVMLError_NoPermission):
        n.nvmlDeviceGetHandleByPciBusId("00000000:02:00.0")


def test_lost_key(nvml: Start, tmp_path: Path) -> None:
    n = nvml(config=write(tmp_path, "[gpu]\n[gpu]\nlost = 1\n"))
    with pytest.raises(N.NVMLError_GpuIsLost):
        n.nvmlDeviceGetHandleByIndex(1)
    n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(0))


def test_unsupported_and_missing_lists(nvml: Start, tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        "[system]\n"
        "unsupported = nvmlDeviceGetPersistenceMode, nvmlSystemGetNVMLVersion\n"
        "missing = nvmlDeviceGetNumaNodeId,nvmlDeviceGetMemoryInfo\n"
        "[gpu]\n"
        "[gpu]\n"
        "unsupported = nvmlDeviceGetSerial\n",
    )
    n = nvml(config=cfg)
    a, b = handles(n)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetPersistenceMode(a)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlSystemGetNVMLVersion()
    with pytest.raises(N.NVMLError_FunctionNotFound):
        n.nvmlDeviceGetNumaNodeId(a)
    # a name without _vN also covers the versioned symbol
    with pytest.raises(N.NVMLError_FunctionNotFound):
        n.nvmlDeviceGetMemoryInfo(a)
    with pytest.raises(N.NVMLError_FunctionNotFound):
        n.nvmlDeviceGetMemoryInfo(a, version=N.nvmlMemory_v2)
    assert n.nvmlDeviceGetSerial(a)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetSerial(b)
    assert n.nvmlSystemGetDriverVersion() == "550.54.15"


def test_old_driver_profile(nvml: Start) -> None:
    n = nvml("old-driver")
    h = n.nvmlDeviceGetHandleByIndex(0)
    for fn in (n.nvmlDeviceGetNumaNodeId, n.nvmlDeviceGetRemappedRows, n.nvmlDeviceGetMigMode):
        with pytest.raises(N.NVMLError_FunctionNotFound):
            fn(h)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetPersistenceMode(h)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetNvLinkState(h, 0)
    assert n.nvmlDeviceGetName(h) == "NVIDIA L4"


def test_insufficient_size_and_null_arguments(nvml: Start, lib: ctypes.CDLL) -> None:
    n = nvml("dgx-a100")
    h = n.nvmlDeviceGetHandleByIndex(0)
    small = ctypes.create_string_buffer(8)
    assert lib.nvmlDeviceGetName(h, small, 8) == N.NVML_ERROR_INSUFFICIENT_SIZE
    assert lib.nvmlDeviceGetUUID(h, small, 8) == N.NVML_ERROR_INSUFFICIENT_SIZE
    assert lib.nvmlSystemGetDriverVersion(small, 8) == N.NVML_ERROR_INSUFFICIENT_SIZE
    exact = ctypes.create_string_buffer(22)  # "NVIDIA A100-SXM4-80GB" + NUL
    assert lib.nvmlDeviceGetName(h, exact, 22) == N.NVML_SUCCESS
    assert lib.nvmlDeviceGetName(h, exact, 21) == N.NVML_ERROR_INSUFFICIENT_SIZE
    assert lib.nvmlDeviceGetName(h, None, 96) == N.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetCount_v2(None) == N.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetMemoryInfo(h, None) == N.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, None) == N.NVML_ERROR_INVALID_ARGUMENT
    bogus = ctypes.c_void_p(0x1234)
    assert lib.nvmlDeviceGetName(bogus, small, 8) == N.NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetName(None, small, 8) == N.NVML_ERROR_INVALID_ARGUMENT
    mem = N.c_nvmlMemory_v2_t()
    mem.version = 0x01000028
    assert lib.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(mem)) == N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    ext = N.nvmlPciInfoExt_v1_t()
    assert lib.nvmlDeviceGetPciInfoExt(h, ctypes.byref(ext)) == N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetTotalEccErrors(h, 2, 0)


def test_stale_handle_after_reinit(nvml: Start) -> None:
    n = nvml("dgx-a100")
    h7 = n.nvmlDeviceGetHandleByIndex(7)
    h0 = n.nvmlDeviceGetHandleByIndex(0)
    n.nvmlShutdown()
    with pytest.raises(N.NVMLError_Uninitialized):
        n.nvmlDeviceGetName(h0)
    n = nvml("pcie-4")
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetName(h7)
    assert n.nvmlDeviceGetName(h0) == "NVIDIA L4"


# ---------------------------------------------------------------------------------------------
# Topology, NVLink, MIG
# ---------------------------------------------------------------------------------------------


def test_nvlink_details(nvml: Start) -> None:
    n = nvml("dgx-a100")
    h = n.nvmlDeviceGetHandleByIndex(3)
    remotes = [n.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId for link in range(12)]
    assert remotes[0] == remotes[1] == "00000000:C4:00.0"
    assert remotes[11] == "00000000:C9:00.0"
    assert n.nvmlDeviceGetNvLinkRemotePciInfo(h, 0).pciDeviceId == 0x1AF110DE
    assert {n.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) for link in range(12)} == {
        N.NVML_NVLINK_DEVICE_TYPE_SWITCH
    }
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetNvLinkState(h, 12)
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetNvLinkState(h, N.NVML_NVLINK_MAX_LINKS)
    # non-NVLink P2P capabilities are always OK
    h5 = n.nvmlDeviceGetHandleByIndex(5)
    assert n.nvmlDeviceGetP2PStatus(h, h5, N.NVML_P2P_CAPS_INDEX_WRITE) == N.NVML_P2P_STATUS_OK
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetP2PStatus(h, h5, N.NVML_P2P_CAPS_INDEX_UNKNOWN)

    n.nvmlShutdown()
    n = nvml("pairs-4")
    g0, g1, _, _ = handles(n)
    assert n.nvmlDeviceGetNvLinkRemoteDeviceType(g0, 3) == N.NVML_NVLINK_DEVICE_TYPE_GPU
    peer = n.nvmlDeviceGetNvLinkRemotePciInfo(g0, 0)
    assert peer.busId == n.nvmlDeviceGetPciInfo_v3(g1).busId
    assert peer.pciDeviceId == 0x223010DE


def test_mig_devices(nvml: Start) -> None:
    n = nvml("mig")
    g0, g1 = handles(n)
    assert n.nvmlDeviceGetMaxMigDeviceCount(g0) == 7
    migs = [n.nvmlDeviceGetMigDeviceHandleByIndex(g0, i) for i in range(3)]
    for i in range(3, 7):
        with pytest.raises(N.NVMLError_NotFound):
            n.nvmlDeviceGetMigDeviceHandleByIndex(g0, i)
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetMigDeviceHandleByIndex(g0, 7)
    with pytest.raises(N.NVMLError_NotFound):
        n.nvmlDeviceGetMigDeviceHandleByIndex(g1, 0)
    names = [n.nvmlDeviceGetName(m) for m in migs]
    assert names == [
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
        "NVIDIA A100-SXM4-40GB MIG 2g.10gb",
    ]
    assert [n.nvmlDeviceGetMemoryInfo(m).total for m in migs] == [4864 * MiB, 4864 * MiB, 9984 * MiB]
    assert [n.nvmlDeviceGetGpuInstanceId(m) for m in migs] == [7, 8, 3]
    assert [n.nvmlDeviceGetComputeInstanceId(m) for m in migs] == [0, 0, 0]
    assert [n.nvmlDeviceGetIndex(m) for m in migs] == [0, 1, 2]
    assert all(n.nvmlDeviceIsMigDeviceHandle(m).value == 1 for m in migs)
    assert n.nvmlDeviceIsMigDeviceHandle(g0).value == 0
    uuids = [n.nvmlDeviceGetUUID(m) for m in migs]
    assert all(u.startswith("MIG-") for u in uuids)
    assert len(set(uuids)) == 3
    assert n.nvmlDeviceGetGpuInstanceId(n.nvmlDeviceGetHandleByUUID(uuids[2])) == 3
    parent = n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migs[1])
    assert n.nvmlDeviceGetUUID(parent) == n.nvmlDeviceGetUUID(g0)
    attrs = n.nvmlDeviceGetAttributes_v2(migs[2])
    assert (attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount, attrs.memorySizeMB) == (2, 2, 9984)
    assert attrs.multiprocessorCount == 28
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetAttributes_v2(g0)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetGpuInstanceId(g0)
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(g0)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetPciInfo_v3(migs[0])
    assert n.nvmlDeviceGetCudaComputeCapability(migs[0]) == (8, 0)

    n.nvmlShutdown()
    n = nvml("pcie-4")
    h = n.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert n.nvmlDeviceGetMaxMigDeviceCount(h) == 0


def test_mig_slots_and_defaults(nvml: Start, tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        "[gpu]\nname = X\nmig_capable = 1\nmig_mode = 1\npending_mig_mode = 0\n"
        "[mig]  # goes to slot 4\nslot = 4\nmemory_total = 20 GiB\nslice_count = 7\n"
        "[mig]\ngpu_instance_id = 1\n",
    )
    n = nvml(config=cfg)
    (g,) = handles(n)
    assert n.nvmlDeviceGetMigMode(g) == [1, 0]
    first = n.nvmlDeviceGetMigDeviceHandleByIndex(g, 0)
    assert n.nvmlDeviceGetGpuInstanceId(first) == 1
    big = n.nvmlDeviceGetMigDeviceHandleByIndex(g, 4)
    assert n.nvmlDeviceGetName(big) == "X MIG 7g.20gb"
    attrs = n.nvmlDeviceGetAttributes_v2(big)
    assert (attrs.multiprocessorCount, attrs.sharedJpegCount, attrs.sharedOfaCount) == (98, 1, 1)


# ---------------------------------------------------------------------------------------------
# Control file and events
# ---------------------------------------------------------------------------------------------


def wait(n: Any, es: Any, timeout_ms: int = 2000) -> Any:
    return n.nvmlEventSetWait_v2(es, timeout_ms)


def test_xid_is_delivered_to_a_waiting_thread(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    n = nvml("dgx-a100", control=ctl)
    h3 = n.nvmlDeviceGetHandleByIndex(3)
    es = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(h3, N.nvmlEventTypeXidCriticalError, es)
    results: list[Any] = []

    def waiter() -> None:
        try:
            results.append(wait(n, es, 120_000))
        except N.NVMLError as e:
            results.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    inject(ctl, "xid 3 79")
    # The wait's own timeout is two minutes: an event in the result (not NVML_ERROR_TIMEOUT) shows the
    # injected line woke it, with no clock reading that a loaded machine could upset.
    t.join(120)
    (data,) = results
    assert not isinstance(data, Exception), data
    assert data.eventType == N.nvmlEventTypeXidCriticalError
    assert data.eventData == 79
    assert (data.gpuInstanceId, data.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert n.nvmlDeviceGetIndex(data.device) == 3
    with pytest.raises(N.NVMLError_Timeout):
        wait(n, es, 0)
    n.nvmlEventSetFree(es)


def test_events_are_filtered_by_device_and_type(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    n = nvml("pcie-4", control=ctl)
    h0, h1, _, _ = handles(n)
    xid_only = n.nvmlEventSetCreate()
    both = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(h0, N.nvmlEventTypeXidCriticalError, xid_only)
    n.nvmlDeviceRegisterEvents(h0, N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeDoubleBitEccError, both)
    n.nvmlDeviceRegisterEvents(h1, N.nvmlEventTypeXidCriticalError, both)
    for line in ("ecc 0", "xid 2 13", "xid 1 31", "xid 0 48"):
        inject(ctl, line)
    got = [
        (n.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData) for d in (wait(n, both) for _ in range(3))
    ]
    assert got == [(0, N.nvmlEventTypeDoubleBitEccError, 0), (1, 8, 31), (0, 8, 48)]
    assert [wait(n, xid_only).eventData] == [48]
    for es in (xid_only, both):
        with pytest.raises(N.NVMLError_Timeout):
            wait(n, es, 10)
    assert n.nvmlDeviceGetTotalEccErrors(h0, 1, 0) == 1


def test_xid_addressed_to_a_mig_instance(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    n = nvml("mig", control=ctl)
    g0 = n.nvmlDeviceGetHandleByIndex(0)
    es = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(g0, N.nvmlEventTypeXidCriticalError, es)
    inject(ctl, "xid 0:8:0 43")
    d = wait(n, es)
    assert (d.eventData, d.gpuInstanceId, d.computeInstanceId) == (43, 8, 0)
    assert n.nvmlDeviceGetIndex(d.device) == 0
    mig = n.nvmlDeviceGetMigDeviceHandleByIndex(g0, 0)
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceRegisterEvents(mig, N.nvmlEventTypeXidCriticalError, es)


def test_lost_and_recover(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    n = nvml("pcie-4", control=ctl)
    h0, h1, _, _ = handles(n)
    es = n.nvmlEventSetCreate()
    other = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(h1, N.nvmlEventTypeXidCriticalError, es)
    n.nvmlDeviceRegisterEvents(h0, N.nvmlEventTypeXidCriticalError, other)
    inject(ctl, "lost 1")
    with pytest.raises(N.NVMLError_GpuIsLost):
        wait(n, es)
    with pytest.raises(N.NVMLError_Timeout):
        wait(n, es, 20)  # only once
    with pytest.raises(N.NVMLError_Timeout):
        wait(n, other, 20)  # not registered on the lost GPU
    with pytest.raises(N.NVMLError_GpuIsLost):
        n.nvmlDeviceGetName(h1)
    with pytest.raises(N.NVMLError_GpuIsLost):
        n.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(N.NVMLError_GpuIsLost):
        n.nvmlDeviceGetTopologyCommonAncestor(h0, h1)
    with pytest.raises(N.NVMLError_GpuIsLost):
        n.nvmlDeviceRegisterEvents(h1, N.nvmlEventTypeXidCriticalError, other)
    assert n.nvmlDeviceGetName(h0) == "NVIDIA L4"
    inject(ctl, "recover 1")
    assert n.nvmlDeviceGetName(h1) == "NVIDIA L4"


def test_control_lines_before_init_apply_at_init(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    inject(ctl, "lost 0")
    inject(ctl, "mig 1 1")
    n = nvml("mig", control=ctl)
    with pytest.raises(N.NVMLError_GpuIsLost):
        n.nvmlDeviceGetHandleByIndex(0)
    g1 = n.nvmlDeviceGetHandleByIndex(1)
    assert n.nvmlDeviceGetMigMode(g1) == [1, 1]
    inject(ctl, "mig 1 0")
    assert n.nvmlDeviceGetMigMode(g1) == [0, 0]


def test_mig_mode_switch_hides_mig_handles(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    n = nvml("mig", control=ctl)
    g0 = n.nvmlDeviceGetHandleByIndex(0)
    m = n.nvmlDeviceGetMigDeviceHandleByIndex(g0, 0)
    inject(ctl, "mig 0 0")
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlDeviceGetName(m)
    with pytest.raises(N.NVMLError_NotFound):
        n.nvmlDeviceGetMigDeviceHandleByIndex(g0, 0)


def test_partial_and_bad_control_lines(
    nvml: Start, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ctl = tmp_path / "control"
    n = nvml("pcie-4", control=ctl)
    h = n.nvmlDeviceGetHandleByIndex(0)
    es = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, es)
    with open(ctl, "a") as fh:
        fh.write("# comment\n\nbogus 1\nxid 9 1\nxid 0 6")  # last line has no newline yet
    with pytest.raises(N.NVMLError_Timeout):
        wait(n, es, 20)
    with open(ctl, "a") as fh:
        fh.write("3\n")
    assert wait(n, es).eventData == 63
    err = capfd.readouterr().err
    assert "ignoring bad control line: bogus 1" in err
    assert "ignoring bad control line: xid 9 1" in err


def test_event_api_errors(nvml: Start, lib: ctypes.CDLL) -> None:
    n = nvml("pcie-4")
    h = n.nvmlDeviceGetHandleByIndex(0)
    supported = n.nvmlDeviceGetSupportedEventTypes(h)
    assert supported & N.nvmlEventTypeXidCriticalError
    assert supported & N.nvmlEventTypeDoubleBitEccError
    es = n.nvmlEventSetCreate()
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeGpuRecoveryAction, es)
    start = time.monotonic()
    with pytest.raises(N.NVMLError_Timeout):
        wait(n, es, 50)
    assert time.monotonic() - start >= 0.045  # the wait lasted its timeout (an upper bound would be load's)
    n.nvmlEventSetFree(es)
    data = N.c_nvmlEventData_t()
    assert lib.nvmlEventSetWait_v2(es, ctypes.byref(data), 0) == N.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(N.NVMLError_InvalidArgument):
        n.nvmlEventSetFree(es)


def test_legacy_event_wait(nvml: Start, lib: ctypes.CDLL, tmp_path: Path) -> None:
    class EventDataV1(ctypes.Structure):
        _fields_ = [
            ("device", ctypes.c_void_p),
            ("eventType", ctypes.c_ulonglong),
            ("eventData", ctypes.c_ulonglong),
        ]

    ctl = tmp_path / "control"
    n = nvml("h100", control=ctl)
    h = n.nvmlDeviceGetHandleByIndex(0)
    es = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, es)
    inject(ctl, "xid 0 94")
    buf = (ctypes.c_ubyte * 64)(*([0xAB] * 64))
    data = EventDataV1.from_buffer(buf)
    assert lib.nvmlEventSetWait(es, ctypes.byref(data), 1000) == N.NVML_SUCCESS
    assert (data.eventType, data.eventData) == (N.nvmlEventTypeXidCriticalError, 94)
    assert bytes(buf[ctypes.sizeof(EventDataV1) :]) == b"\xab" * (64 - ctypes.sizeof(EventDataV1))


def test_queries_are_not_blocked_by_a_waiting_thread(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    n = nvml("dgx-a100", control=ctl)
    hs = handles(n)
    es = n.nvmlEventSetCreate()
    for h in hs:
        n.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, es)
    seen: list[int] = []
    stop = threading.Event()

    def health() -> None:
        while not stop.is_set():
            try:
                seen.append(wait(n, es, 100).eventData)
            except N.NVMLError_Timeout:
                continue

    threads = [threading.Thread(target=health) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(2000):
        h = hs[i % 8]
        assert n.nvmlDeviceGetMemoryInfo(h).total == 80 * GiB
        if i % 100 == 0:
            inject(ctl, f"xid {i % 8} {i}")
    deadline = time.monotonic() + 60
    while len(seen) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(5)
    assert sorted(seen) == list(range(0, 2000, 100))


# ---------------------------------------------------------------------------------------------
# MIG geometry changed at run time: mig-create / mig-destroy and nvmlEventMigConfigChange
# ---------------------------------------------------------------------------------------------


def mig_devices(n: Any, gpu: Any) -> list[tuple[int, str, str, int, int, int]]:
    """(slot, UUID, name, MiB, gi, ci) of every MIG device NVML lists on the GPU."""
    out = []
    for slot in range(n.nvmlDeviceGetMaxMigDeviceCount(gpu)):
        try:
            m = n.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
        except N.NVMLError_NotFound:
            continue
        out.append(
            (
                slot,
                n.nvmlDeviceGetUUID(m),
                n.nvmlDeviceGetName(m),
                n.nvmlDeviceGetMemoryInfo(m).total // MiB,
                n.nvmlDeviceGetGpuInstanceId(m),
                n.nvmlDeviceGetComputeInstanceId(m),
            )
        )
    return out


def test_mig_capable_gpus_list_the_mig_event(nvml: Start) -> None:
    n = nvml("mig")
    for h in handles(n):  # both A100s are MIG capable, MIG on or off
        assert n.nvmlDeviceGetSupportedEventTypes(h) & N.nvmlEventMigConfigChange
    n.nvmlShutdown()
    n = nvml("pcie-4")
    assert not n.nvmlDeviceGetSupportedEventTypes(handles(n)[0]) & N.nvmlEventMigConfigChange


def test_mig_create_and_destroy_change_the_geometry_and_send_the_event(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    n = nvml("mig", control=ctl)
    g0, g1 = handles(n)
    es = n.nvmlEventSetCreate()
    xid_only = n.nvmlEventSetCreate()
    n.nvmlDeviceRegisterEvents(g0, N.nvmlEventMigConfigChange, es)
    n.nvmlDeviceRegisterEvents(g1, N.nvmlEventMigConfigChange, es)
    n.nvmlDeviceRegisterEvents(g0, N.nvmlEventTypeXidCriticalError, xid_only)
    before = mig_devices(n, g0)
    assert [(d[0], d[4]) for d in before] == [(0, 7), (1, 8), (2, 3)]

    inject(ctl, "mig-create 0 3g.20gb 2")
    after = mig_devices(n, g0)
    assert after[:3] == before
    slot, uuid, name, mib, gi, ci = after[3]
    assert (slot, name, mib, gi, ci) == (3, "NVIDIA A100-SXM4-40GB MIG 3g.20gb", 19968, 2, 0)
    assert uuid.startswith("MIG-") and uuid not in {d[1] for d in before}
    event = wait(n, es)
    assert (event.eventType, event.eventData) == (N.nvmlEventMigConfigChange, 0)
    assert (event.gpuInstanceId, event.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)  # only "changed"
    assert n.nvmlDeviceGetUUID(event.device) == n.nvmlDeviceGetUUID(g0)
    with pytest.raises(N.NVMLError_Timeout):
        wait(n, xid_only, 20)  # not registered for the MIG event

    inject(ctl, "mig-destroy 0 7")
    assert [d[4] for d in mig_devices(n, g0)] == [8, 3, 2]
    assert wait(n, es).eventType == N.nvmlEventMigConfigChange
    # The freed slot takes the next instance, under a UUID of its own.
    inject(ctl, "mig-create 0 1g.5gb 7 0")
    slot0 = mig_devices(n, g0)[0]
    assert (slot0[0], slot0[3], slot0[4]) == (0, 4864, 7)
    assert slot0[1] != before[0][1]
    assert wait(n, es).eventType == N.nvmlEventMigConfigChange


@pytest.mark.parametrize(
    ("line", "code", "why"),
    [
        ("mig-create 1 1g.5gb 5", "3 NOT_SUPPORTED", "MIG mode is off"),
        ("mig-create 0 2g.20gb 5", "2 INVALID_ARGUMENT", "no such GPU instance profile"),
        ("mig-create 0 4g.20gb 5", "23 INSUFFICIENT_RESOURCES", "not enough free slices"),
        ("mig-create 0 1g.5gb 7", "23 INSUFFICIENT_RESOURCES", "that GPU instance exists"),
        ("mig-destroy 0 42", "6 NOT_FOUND", "no such GPU or compute instance"),
        ("mig-destroy 0 7 1", "6 NOT_FOUND", "no such GPU or compute instance"),
        ("mig-destroy 1 7", "3 NOT_SUPPORTED", "MIG mode is off"),
    ],
)
def test_a_refused_mig_change_changes_nothing_and_says_what_nvml_would_return(
    nvml: Start, tmp_path: Path, line: str, code: str, why: str
) -> None:
    ctl = tmp_path / "control"
    n = nvml("mig", control=ctl)
    g0, g1 = handles(n)
    es = n.nvmlEventSetCreate()
    for h in (g0, g1):
        n.nvmlDeviceRegisterEvents(h, N.nvmlEventMigConfigChange, es)
    before = [mig_devices(n, g) for g in (g0, g1)]
    inject(ctl, line)
    assert [mig_devices(n, g) for g in (g0, g1)] == before
    assert f"as NVML would return {code}" in last_error() and why in last_error()
    with pytest.raises(N.NVMLError_Timeout):
        wait(n, es, 20)


def test_mig_changes_on_gpus_without_mig_or_without_the_event(nvml: Start, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    n = nvml("pcie-4", control=ctl)
    inject(ctl, "mig-create 0 1g.5gb 1")
    n.nvmlDeviceGetCount()
    assert "NOT_SUPPORTED" in last_error() and "not MIG capable" in last_error()
    n.nvmlShutdown()
    # An A100 whose driver does not send the MIG event: the geometry changes all the same, nobody is told.
    config = tmp_path / "no-event.ini"
    config.write_text(
        "[gpu]\nname = NVIDIA A100-SXM4-40GB\nmemory_total = 40960 MiB\nmig_capable = 1\nmig_mode = 1\n"
        "supported_events = 0x1f\n"
    )
    ctl = tmp_path / "control-2"  # lines present at nvmlInit apply then: the first file's would too
    n = nvml(config=config, control=ctl)
    (g,) = handles(n)
    es = n.nvmlEventSetCreate()
    with pytest.raises(N.NVMLError_NotSupported):
        n.nvmlDeviceRegisterEvents(g, N.nvmlEventMigConfigChange, es)
    inject(ctl, "mig-create 0 7g.40gb 0")
    assert [(d[2], d[3]) for d in mig_devices(n, g)] == [("NVIDIA A100-SXM4-40GB MIG 7g.40gb", 40192)]
