"""Built-in simulated nodes for `--simulate PROFILE` (demos, GPU-less clusters): `plugin run` serves them,
`doctor`, `cdi generate --dry-run` and `up --dry-run` read them instead of NVML. The one source of their GPUs.

The profiles are the machines of the test suite's fake NVML library (tests/fakenvml, not shipped), and
`simulated_inventory(p)` is exactly what `discover()` returns when the real pynvml runs against that
library with profile p; tests/unit/test_plugin_simulate.py holds the two equal. It is built here in pure
Python, from a short description of each machine, so a simulated plugin needs no NVML, no ctypes and no
compiler. The description mirrors the fake library's config keys (bus, numa, pcie_switch, host_bridge,
nvlink, missing/unsupported functions), and the expansion below mirrors what discovery makes of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from gpunode.errors import UsageError
from gpunode.nvml.discovery import (
    ARCHITECTURES,
    DRIVER_NOT_LOADED,
    FUNCTION_NOT_FOUND,
    LIB_RM_VERSION_MISMATCH,
    NOT_SUPPORTED,
    translate_nvml_error,
)
from gpunode.nvml.model import (
    Gpu,
    GpuPair,
    Inventory,
    MigAttributes,
    MigDevice,
    MigMode,
    MigPlacement,
    TopologyLevel,
)

__all__ = ["PROFILES", "check_profile", "driver_loaded", "simulated_inventory"]

T = TypeVar("T")

MIB = 1024**2

# ---------------------------------------------------------------------------------------------------
# What a machine is made of (the subset of the fake library's config that its profiles use)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Model:
    """Facts shared by every GPU of one model."""

    name: str
    memory_mib: int
    cc: tuple[int, int]
    arch: int  # NVML_DEVICE_ARCH_*, named through discovery's table so the labels cannot drift
    mig_capable: bool = False
    brand: int = 14  # NVML_BRAND_*; the fake library's default is NVML_BRAND_NVIDIA


@dataclass(frozen=True)
class _Mig:
    profile: str  # "1g.5gb"; the fake names the instance "<GPU name> MIG <profile>"
    memory_mib: int
    gpu_instance_id: int
    slices: int
    # The GPU instance's profile id and placement (memory slices), as the fake library assigns them.
    profile_id: int
    placement_start: int
    placement_size: int


@dataclass(frozen=True)
class _Slot:
    """One GPU where the machine has it. Switch and bridge ids only matter by equality; -1 means a
    switch or host bridge of its own (the fake library's default)."""

    model: _Model
    bus: int  # PCI bus number; domain, device and function are always 0
    numa: int
    switch: int = -1
    bridge: int = -1
    nvlink: tuple[tuple[int, int], ...] = ()  # (remote bus, active links): a GPU's bus, else an NVSwitch
    mig_mode: bool = False
    migs: tuple[_Mig, ...] = ()  # in slot order 0, 1, ...
    lost: bool = False


@dataclass(frozen=True)
class _Machine:
    gpus: tuple[_Slot, ...] = ()
    driver: str = "550.54.15"
    cuda: int = 12040  # as nvmlSystemGetCudaDriverVersion reports it: 1000 * major + 10 * minor
    nvml: str = "12.550.54.15"
    init_error: int = 0  # non-zero: nvmlInit fails with this NVML return code
    # NVML functions (base names, without _vN) the driver lacks, and those it refuses for every GPU.
    missing: frozenset[str] = frozenset()
    unsupported: frozenset[str] = frozenset()


# ---------------------------------------------------------------------------------------------------
# The profiles (fakenvml.c PROFILES[], same order)
# ---------------------------------------------------------------------------------------------------

_A100_80 = _Model("NVIDIA A100-SXM4-80GB", 81920, (8, 0), 7, mig_capable=True)
_A100_40 = _Model("NVIDIA A100-SXM4-40GB", 40960, (8, 0), 7, mig_capable=True)
_L4 = _Model("NVIDIA L4", 23034, (8, 9), 8)
_A6000 = _Model("NVIDIA RTX A6000", 49140, (8, 6), 7, brand=13)
_H100 = _Model("NVIDIA H100 80GB HBM3", 81559, (9, 0), 9, mig_capable=True)

# HGX A100 baseboard: two links from every GPU to each of six NVSwitches (C4..C9).
_NVSWITCH_LINKS = tuple((bus, 2) for bus in range(0xC4, 0xCA))


def _dgx_a100() -> _Machine:
    buses = (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD)
    # GPUs 0-3 on socket 0, 4-7 on socket 1 (one host bridge each); a PCIe switch per pair.
    return _Machine(
        tuple(
            _Slot(_A100_80, bus, numa=i // 4, switch=i // 2, bridge=i // 4, nvlink=_NVSWITCH_LINKS)
            for i, bus in enumerate(buses)
        )
    )


def _pcie_4(
    lost: int | None = None, missing: frozenset[str] = frozenset(), unsupported: frozenset[str] = frozenset()
) -> _Machine:
    # Two GPUs behind one switch per socket; no NVLink.
    placement = ((0x17, 0), (0x18, 0), (0xCA, 1), (0xCB, 1))
    return _Machine(
        tuple(
            _Slot(_L4, bus, numa=node, switch=node, bridge=node, lost=i == lost)
            for i, (bus, node) in enumerate(placement)
        ),
        missing=missing,
        unsupported=unsupported,
    )


def _pairs_4() -> _Machine:
    # NVLink bridges join 0-1 and 2-3; one socket, one host bridge, a switch per bridged pair.
    pairs = ((0x1B, 0x1C), (0x3D, 0x3E))
    return _Machine(
        tuple(
            _Slot(_A6000, bus, numa=0, switch=p, bridge=0, nvlink=((peer, 4),))
            for p, (a, b) in enumerate(pairs)
            for bus, peer in ((a, b), (b, a))
        )
    )


def _mig() -> _Machine:
    migs = (
        _Mig("1g.5gb", 4864, 7, slices=1, profile_id=19, placement_start=0, placement_size=1),
        _Mig("1g.5gb", 4864, 8, slices=1, profile_id=19, placement_start=1, placement_size=1),
        _Mig("2g.10gb", 9984, 3, slices=2, profile_id=14, placement_start=2, placement_size=2),
    )
    return _Machine((_Slot(_A100_40, 0x07, numa=0, mig_mode=True, migs=migs), _Slot(_A100_40, 0x0F, numa=0)))


_MACHINES: dict[str, _Machine] = {
    "dgx-a100": _dgx_a100(),
    "pcie-4": _pcie_4(),
    "pairs-4": _pairs_4(),
    "mig": _mig(),
    "h100": _Machine((_Slot(_H100, 0x18, numa=0),), driver="560.35.03", cuda=12060, nvml="12.560.35.03"),
    "no-gpu": _Machine(),
    "no-driver": _Machine(init_error=DRIVER_NOT_LOADED),
    "init-fail": _Machine(init_error=LIB_RM_VERSION_MISMATCH),
    "lost-gpu": _pcie_4(lost=2),
    "old-driver": _pcie_4(
        missing=frozenset({"nvmlDeviceGetNumaNodeId", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetMigMode"}),
        unsupported=frozenset({"nvmlDeviceGetPersistenceMode", "nvmlDeviceGetNvLinkState"}),
    ),
}

PROFILES: tuple[str, ...] = tuple(_MACHINES)


# ---------------------------------------------------------------------------------------------------
# UUIDs: the fake library's default derivation (fakenvml.c hash_str/mix64/make_uuid), bit for bit
# ---------------------------------------------------------------------------------------------------

_U64 = (1 << 64) - 1


def _mix64(x: int) -> int:  # splitmix64's finaliser
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def _hash_str(text: str, seed: int) -> int:  # FNV-1a 64, seeded, then mixed
    h = 0xCBF29CE484222325 ^ seed
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & _U64
    return _mix64(h)


def _uuid(prefix: str, a: int, b: int) -> str:
    return (
        f"{prefix}-{a >> 32:08x}-{(a >> 16) & 0xFFFF:04x}-{a & 0xFFFF:04x}-"
        f"{(b >> 48) & 0xFFFF:04x}-{b & 0xFFFFFFFFFFFF:012x}"
    )


def _gpu_seed(name: str, index: int) -> int:
    # Seeded by the GPU's position, so identical GPUs still get distinct UUIDs.
    return _hash_str(name, index)


def _gpu_uuid(seed: int) -> str:
    return _uuid("GPU", seed, _mix64((seed + 1) & _U64))


def _mig_uuid(gpu_seed: int, slot: int) -> str:
    h = _mix64(gpu_seed ^ (0x1000 + slot))
    return _uuid("MIG", h, _mix64((h + 1) & _U64))


# ---------------------------------------------------------------------------------------------------
# Expansion: what discovery makes of a machine
# ---------------------------------------------------------------------------------------------------


class _InitFailure(Exception):
    """Stands in for pynvml.NVMLError, so discovery's own translation words the error."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class _Expander:
    def __init__(self, machine: _Machine) -> None:
        self.machine = machine
        self.unknown: list[str] = []
        # Discovery maps buses to GPUs from what it read, and reads no bus id from a lost GPU.
        self.by_bus = {slot.bus: i for i, slot in enumerate(machine.gpus) if not slot.lost}
        # NVML still says a link's far end is a GPU when that GPU is lost: only other buses are NVSwitches.
        self.gpu_buses = {slot.bus for slot in machine.gpus}

    def refusal(self, fn: str) -> int | None:
        """The NVML error `fn` answers with on this machine (the fake checks missing first)."""
        if fn in self.machine.missing:
            return FUNCTION_NOT_FOUND
        if fn in self.machine.unsupported:
            return NOT_SUPPORTED
        return None

    def fact(self, what: str, fn: str, value: T, *, supported: bool = True) -> T | None:
        """`value`, or None plus discovery's `unknown` line when the driver lacks or refuses `fn`."""
        code = self.refusal(fn) or (None if supported else NOT_SUPPORTED)
        if code is None:
            return value
        reason = (
            "not implemented by this driver's NVML"
            if code == FUNCTION_NOT_FOUND
            else "not supported by this GPU/driver"
        )
        self.unknown.append(f"{what}: {reason}")
        return None

    def inventory(self) -> Inventory:
        m = self.machine
        if m.init_error:
            raise translate_nvml_error(_InitFailure(m.init_error), "NVML initialisation")
        driver = self.fact("driver version", "nvmlSystemGetDriverVersion", m.driver)
        cuda = self.fact("CUDA driver version", "nvmlSystemGetCudaDriverVersion", m.cuda)
        nvml = self.fact("NVML version", "nvmlSystemGetNVMLVersion", m.nvml)
        gpus = tuple(self.gpu(i, slot) for i, slot in enumerate(m.gpus))
        pairs = self.topology(gpus)
        return Inventory(
            driver_version=driver,
            cuda_driver_version=None if cuda is None else (cuda // 1000, cuda % 1000 // 10),
            nvml_version=nvml,
            gpus=gpus,
            pairs=pairs,
            unknown=tuple(self.unknown),
        )

    def gpu(self, index: int, slot: _Slot) -> Gpu:
        if slot.lost:
            # The fake fails the handle lookup itself, so discovery knows nothing else about it.
            return Gpu(index=index, uuid=None, lost=True)
        model = slot.model
        seed = _gpu_seed(model.name, index)
        label = f"GPU {index}"
        f = self.fact
        # Same order as discovery's queries, so the `unknown` lines come out in the same order.
        uuid = f(f"{label} UUID", "nvmlDeviceGetUUID", _gpu_uuid(seed))
        name = f(f"{label} name", "nvmlDeviceGetName", model.name)
        memory = f(f"{label} memory", "nvmlDeviceGetMemoryInfo", model.memory_mib * MIB)
        bus_id = f(f"{label} PCI info", "nvmlDeviceGetPciInfo", f"00000000:{slot.bus:02X}:00.0")
        minor = f(f"{label} minor number", "nvmlDeviceGetMinorNumber", index)
        cc = f(f"{label} compute capability", "nvmlDeviceGetCudaComputeCapability", model.cc)
        arch = f(f"{label} architecture", "nvmlDeviceGetArchitecture", ARCHITECTURES[model.arch])
        brand = f(f"{label} brand", "nvmlDeviceGetBrand", model.brand)
        persistence = f(f"{label} persistence mode", "nvmlDeviceGetPersistenceMode", True)
        ecc = f(f"{label} ECC errors", "nvmlDeviceGetTotalEccErrors", 0)
        retired = f(f"{label} retired pages", "nvmlDeviceGetRetiredPagesPendingStatus", False)
        remapped = f(f"{label} remapped rows", "nvmlDeviceGetRemappedRows", False)
        mig_mode = f(
            f"{label} MIG mode",
            "nvmlDeviceGetMigMode",
            MigMode(current=slot.mig_mode, pending=slot.mig_mode),
            supported=model.mig_capable,
        )
        migs = self.mig_devices(index, slot, seed) if slot.mig_mode and mig_mode is not None else ()
        numa = f(f"{label} NUMA node", "nvmlDeviceGetNumaNodeId", slot.numa)
        return Gpu(
            index=index,
            uuid=uuid,
            name=name,
            memory_total=memory,
            pci_bus_id=bus_id,
            minor=minor,
            numa_node=numa,
            compute_capability=cc,
            architecture=arch,
            # Discovery calls a GPU MIG capable when it answers the MIG mode query at all.
            mig_capable=mig_mode is not None,
            mig_mode=mig_mode,
            mig_devices=migs,
            persistence_mode=persistence,
            ecc_uncorrected_volatile=ecc,
            retired_pages_pending=retired,
            # The profiles have no remapped rows: neither pending nor failed.
            remapped_rows_pending=remapped,
            remapped_rows_failure=remapped,
            brand=brand,
            # No fabric: the profiles' GPUs before Hopper answer NOT_SUPPORTED, the H100 is in none; no
            # /sys under a simulation, so no PCIe root either.
        )

    def mig_devices(self, parent: int, slot: _Slot, seed: int) -> tuple[MigDevice, ...]:
        label = f"GPU {parent}"
        if self.fact(f"{label} MIG device count", "nvmlDeviceGetMaxMigDeviceCount", len(slot.migs)) is None:
            return ()  # discovery then has no slots to walk
        found: list[MigDevice] = []
        for index, mig in enumerate(slot.migs):
            mlabel = f"{label} MIG device {index}"
            name = self.fact(f"{mlabel} name", "nvmlDeviceGetName", f"{slot.model.name} MIG {mig.profile}")
            memory = self.fact(f"{mlabel} memory", "nvmlDeviceGetMemoryInfo", mig.memory_mib * MIB)
            uuid = self.fact(f"{mlabel} UUID", "nvmlDeviceGetUUID", _mig_uuid(seed, index))
            gi = self.fact(f"{mlabel} GPU instance", "nvmlDeviceGetGpuInstanceId", mig.gpu_instance_id)
            ci = self.fact(f"{mlabel} compute instance", "nvmlDeviceGetComputeInstanceId", 0)
            placement = self.fact(
                f"{mlabel} GPU instance placement",
                "nvmlGpuInstanceGetInfo",
                MigPlacement(mig.profile_id, mig.placement_start, mig.placement_size),
            )
            n = mig.slices  # the fake library's defaults for a full-size compute instance
            attributes = self.fact(
                f"{mlabel} attributes",
                "nvmlDeviceGetAttributes",
                MigAttributes(
                    multiprocessors=14 * n,
                    copy_engines=n,
                    decoders=n // 2,
                    encoders=0,
                    jpeg_engines=1 if n == 7 else 0,
                    ofa_engines=1 if n == 7 else 0,
                    gpu_instance_slices=n,
                    compute_instance_slices=n,
                    memory_mib=mig.memory_mib,
                ),
            )
            found.append(
                MigDevice(
                    parent_index=parent,
                    index=index,
                    uuid=uuid or "",
                    name=name,
                    profile=mig.profile if name is not None else None,
                    memory_total=memory,
                    gpu_instance_id=gi,
                    compute_instance_id=ci,
                    placement=None if gi is None else placement,
                    attributes=attributes,
                )
            )
        return tuple(found)

    def topology(self, gpus: tuple[Gpu, ...]) -> tuple[GpuPair, ...]:
        slots = self.machine.gpus
        usable = [g.index for g in gpus if g.usable]
        for i in usable:
            # Discovery notes a GPU without NVLink once, when its first link query is refused.
            code = self.refusal("nvmlDeviceGetNvLinkState") or (None if slots[i].nvlink else NOT_SUPPORTED)
            if code is not None:
                why = "not implemented by this driver" if code == FUNCTION_NOT_FOUND else "not supported"
                self.unknown.append(f"GPU {i} NVLink: {why}")
        nvlink_state_ok = self.refusal("nvmlDeviceGetNvLinkState") is None
        pairs: list[GpuPair] = []
        for n, a in enumerate(usable):
            for b in usable[n + 1 :]:
                level = self.fact(
                    f"topology GPU {a}-{b}", "nvmlDeviceGetTopologyCommonAncestor", _level(slots[a], slots[b])
                )
                links = self.nvlinks(slots[a], slots[b], b) if nvlink_state_ok else 0
                pairs.append(GpuPair(a=a, b=b, level=level, nvlinks=links))
        return tuple(pairs)

    def nvlinks(self, a: _Slot, b: _Slot, b_index: int) -> int:
        # Discovery counts a direct link from the lower index's end only (each end reports it) ...
        direct = sum(count for bus, count in a.nvlink if self.by_bus.get(bus) == b_index)
        # ... and lets a pair behind common NVSwitches use all of the smaller side's switch links.
        a_switch = {bus: count for bus, count in a.nvlink if bus not in self.gpu_buses}
        b_switch = {bus: count for bus, count in b.nvlink if bus not in self.gpu_buses}
        if a_switch.keys() & b_switch.keys():
            direct += min(sum(a_switch.values()), sum(b_switch.values()))
        return direct


def _level(a: _Slot, b: _Slot) -> TopologyLevel:
    """The fake library's nvmlDeviceGetTopologyCommonAncestor for two different GPUs."""
    if a.switch >= 0 and a.switch == b.switch:
        return TopologyLevel.SINGLE
    if a.bridge >= 0 and a.bridge == b.bridge:
        return TopologyLevel.HOSTBRIDGE
    if a.numa >= 0 and a.numa == b.numa:
        return TopologyLevel.NODE
    return TopologyLevel.SYSTEM


def check_profile(profile: str) -> str:
    """`profile` when it is a built-in simulated node; else the UsageError that names the known ones (every
    command with --simulate says it before it reads anything)."""
    _machine(profile)
    return profile


def _machine(profile: str) -> _Machine:
    machine = _MACHINES.get(profile)
    if machine is None:
        raise UsageError(
            f"unknown simulation profile {profile!r} (known: {', '.join(PROFILES)})",
            "pick one of the listed profiles for --simulate",
        )
    return machine


def driver_loaded(profile: str) -> bool:
    """Whether the simulated node has its nvidia kernel module loaded: all but `no-driver`, whose NVML fails
    because no driver is loaded (`init-fail` has a module, of another version than its library)."""
    return _machine(profile).init_error != DRIVER_NOT_LOADED


def simulated_inventory(profile: str) -> Inventory:
    """The Inventory `discover()` reads from the fake NVML library's `profile`, without NVML.

    Raises the NvmlError that discover() raises for profiles whose NVML cannot start (`no-driver`,
    `init-fail`), and UsageError for a profile that does not exist.
    """
    return _Expander(_machine(profile)).inventory()
