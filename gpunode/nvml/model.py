"""What discovery returns: plain immutable data, read once. `None` means "the driver did not tell us"."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class TopologyLevel(IntEnum):
    """NVML's common-ancestor levels between two GPUs; smaller is closer (NVML_TOPOLOGY_*)."""

    INTERNAL = 0  # the same board
    SINGLE = 10  # one PCIe switch
    MULTIPLE = 20  # several PCIe switches, no host bridge
    HOSTBRIDGE = 30  # the same PCIe host bridge
    NODE = 40  # the same NUMA node (crosses host bridges)
    SYSTEM = 50  # across CPU sockets (SMP interconnect)

    @property
    def label(self) -> str:
        return {
            0: "same board",
            10: "same PCIe switch",
            20: "PCIe switches",
            30: "same host bridge",
            40: "same NUMA node",
            50: "across sockets",
        }[int(self)]


@dataclass(frozen=True)
class MigMode:
    current: bool
    pending: bool


@dataclass(frozen=True)
class MigAttributes:
    """What one MIG device has of its parent (nvmlDeviceGetAttributes on the MIG handle)."""

    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    gpu_instance_slices: int
    compute_instance_slices: int
    memory_mib: int


@dataclass(frozen=True)
class MigPlacement:
    """The GPU instance a MIG device lives in (nvmlGpuInstanceGetInfo): its profile id as
    `nvidia-smi mig -lgip` lists it, and its placement in memory slices."""

    profile_id: int
    start: int
    size: int


@dataclass(frozen=True)
class Fabric:
    """The NVSwitch fabric a GPU was registered with (nvmlDeviceGetGpuFabricInfo, state completed): GPUs
    with the same cluster UUID and clique id share one NVLink domain, across nodes too."""

    cluster_uuid: str  # "6b1c6a3e-1f0e-4d2b-9a77-0c5d2e8f4a11"
    clique_id: int


@dataclass(frozen=True)
class MigDevice:
    parent_index: int
    index: int  # slot on the parent GPU
    uuid: str
    name: str | None
    profile: str | None  # e.g. "1g.5gb"
    memory_total: int | None  # bytes
    gpu_instance_id: int | None
    compute_instance_id: int | None
    placement: MigPlacement | None = None
    attributes: MigAttributes | None = None


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str | None
    name: str | None = None
    memory_total: int | None = None  # bytes
    pci_bus_id: str | None = None  # NVML form, "00000000:07:00.0"
    minor: int | None = None  # /dev/nvidia<minor>
    numa_node: int | None = None
    compute_capability: tuple[int, int] | None = None
    architecture: str | None = None
    mig_capable: bool | None = None
    mig_mode: MigMode | None = None
    mig_devices: tuple[MigDevice, ...] = ()
    persistence_mode: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    brand: int | None = None  # NVML_BRAND_*
    pcie_root: str | None = None  # "pci0000:64", the PCI root complex from sysfs
    fabric: Fabric | None = None  # None: not in an NVSwitch fabric, or NVML cannot say
    lost: bool = False  # fell off the bus (NVML_ERROR_GPU_IS_LOST)
    error: str | None = None  # why this GPU could not be read at all (e.g. no permission)

    @property
    def device_path(self) -> str | None:
        return None if self.minor is None else f"/dev/nvidia{self.minor}"

    @property
    def usable(self) -> bool:
        return not self.lost and self.error is None


@dataclass(frozen=True)
class GpuPair:
    a: int
    b: int
    level: TopologyLevel | None
    nvlinks: int  # active NVLink links joining the two (directly or through NVSwitch)


@dataclass(frozen=True)
class Inventory:
    driver_version: str | None
    cuda_driver_version: tuple[int, int] | None
    nvml_version: str | None
    gpus: tuple[Gpu, ...]
    pairs: tuple[GpuPair, ...] = ()
    # Facts this driver does not implement or refuses, as "what: why" lines (never fatal).
    unknown: tuple[str, ...] = field(default=())

    def pair(self, a: int, b: int) -> GpuPair | None:
        lo, hi = min(a, b), max(a, b)
        for p in self.pairs:
            if p.a == lo and p.b == hi:
                return p
        return None
