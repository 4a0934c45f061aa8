"""Read the node's GPUs through NVML (nvidia-ml-py, module `pynvml`) into an Inventory.

Drivers differ in what they implement. A query the installed library lacks (FUNCTION_NOT_FOUND) or
refuses (NOT_SUPPORTED, NO_PERMISSION for one fact) makes that fact None and adds a line to
`Inventory.unknown`; it never stops discovery. Only a library or driver that cannot be used at all
raises, as one of gpunode's NvmlError classes.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from gpunode.errors import (
    DriverNotLoaded,
    GpuLost,
    GpunodeError,
    NvmlError,
    NvmlLibraryNotFound,
    NvmlNoPermission,
)
from gpunode.host import Host
from gpunode.nvml.model import (
    Fabric,
    Gpu,
    GpuPair,
    Inventory,
    MigAttributes,
    MigDevice,
    MigMode,
    MigPlacement,
    TopologyLevel,
)

T = TypeVar("T")

# NVML return codes (nvml.h); named here so this module can be read without pynvml at hand.
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
DRIVER_NOT_LOADED = 9
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
LIB_RM_VERSION_MISMATCH = 18
INVALID_ARGUMENT = 2
ARGUMENT_VERSION_MISMATCH = 25

FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED: the GPU is registered with its fabric

NVLINK_DEVICE_TYPE_GPU = 0
NVLINK_DEVICE_TYPE_SWITCH = 2

ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}

_PCI_ROOT = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}")

_MIG_PROFILE = re.compile(r"\b(\d+g\.\d+gb)\b")

# NVML's init/shutdown are reference counted and its library handle is process-wide; serialise
# sessions so a health thread and a re-discovery never interleave init and shutdown.
session_lock = threading.RLock()


class _Lost(Exception):
    """Internal: the GPU being read fell off the bus."""


def translate_nvml_error(exc: Exception, context: str = "NVML") -> NvmlError:
    """Turn a pynvml.NVMLError into the gpunode error a user can act on."""
    code = getattr(exc, "value", None)
    if code == LIBRARY_NOT_FOUND:
        return NvmlLibraryNotFound(
            "libnvidia-ml.so.1 (NVML) was not found: the NVIDIA driver's user-space libraries are not "
            "installed, or not on the loader path",
            "install the NVIDIA driver for this GPU (e.g. `apt install nvidia-driver` or your vendor's "
            "driver package), then run `ldconfig`",
        )
    if code == DRIVER_NOT_LOADED:
        return DriverNotLoaded(
            "NVML found no running NVIDIA kernel driver (Driver Not Loaded)",
            "load the driver with `modprobe nvidia` (install it first if `modinfo nvidia` finds nothing), "
            "and check `dmesg | grep -i nvrm` for why it did not load",
        )
    if code == LIB_RM_VERSION_MISMATCH:
        return DriverNotLoaded(
            "the NVIDIA kernel module and the user-space library (libnvidia-ml) are different versions "
            "(Driver/library version mismatch), usually after a driver upgrade without a reboot",
            "reboot the node, or unload and reload the nvidia modules "
            "(`rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`)",
        )
    if code == NO_PERMISSION:
        return NvmlNoPermission(
            f"{context}: permission denied by the NVIDIA driver",
            "run gpunode as root, or give this user access to /dev/nvidia*",
        )
    if code == GPU_IS_LOST:
        return GpuLost(
            f"{context}: the GPU has fallen off the bus (GPU is lost)",
            "check `dmesg` for Xid 79; drain the node and reset or reboot it",
        )
    return NvmlError(f"{context} failed: {exc}", "check `nvidia-smi` and `dmesg | grep -i nvrm`")


@contextmanager
def nvml_session() -> Iterator[Any]:
    """Initialise NVML for the duration of the block and yield the pynvml module."""
    import pynvml

    with session_lock:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise translate_nvml_error(exc, "NVML initialisation") from exc
        try:
            yield pynvml
        finally:
            # A failed shutdown changes nothing for the caller.
            with suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()


def discover(host: Host | None = None) -> Inventory:
    """Read everything gpunode needs about the GPUs, once. Raises NvmlError if NVML is unusable."""
    host = host or Host()
    with nvml_session() as nvml:
        return _Reader(nvml, host).read()


def sysfs_pci_address(nvml_bus_id: str) -> str:
    """NVML writes the PCI domain with 8 hex digits ("00000000:07:00.0"); sysfs uses 4 ("0000:07:00.0")."""
    domain, _, rest = nvml_bus_id.strip().lower().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return nvml_bus_id.lower()


class _Reader:
    def __init__(self, nvml: Any, host: Host) -> None:
        self.nvml = nvml
        self.host = host
        self.unknown: list[str] = []

    # Every single-fact query goes through here: a missing or refused fact becomes None.
    def soft(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == GPU_IS_LOST:
                raise _Lost from exc
            # Any other failure of one query loses that one fact, never the whole inventory.
            self.unknown.append(f"{what}: {_reason(code, exc)}")
            return None

    def read(self) -> Inventory:
        nvml = self.nvml
        driver = self.soft("driver version", nvml.nvmlSystemGetDriverVersion)
        cuda_raw = self.soft("CUDA driver version", nvml.nvmlSystemGetCudaDriverVersion_v2)
        cuda = None if cuda_raw is None else (int(cuda_raw) // 1000, (int(cuda_raw) % 1000) // 10)
        nvml_version = self.soft("NVML version", nvml.nvmlSystemGetNVMLVersion)
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise translate_nvml_error(exc, "listing GPUs") from exc

        gpus: list[Gpu] = []
        handles: dict[int, Any] = {}
        for index in range(count):
            gpu, handle = self.read_gpu(index)
            gpus.append(gpu)
            if handle is not None and gpu.usable:
                handles[index] = handle
        pairs = self.read_topology(gpus, handles)
        return Inventory(
            driver_version=_text(driver),
            cuda_driver_version=cuda,
            nvml_version=_text(nvml_version),
            gpus=tuple(gpus),
            pairs=pairs,
            unknown=tuple(self.unknown),
        )

    def read_gpu(self, index: int) -> tuple[Gpu, Any]:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == GPU_IS_LOST:
                return Gpu(index=index, uuid=None, lost=True), None
            return Gpu(
                index=index, uuid=None, error=str(translate_nvml_error(exc, f"GPU {index}").message)
            ), None
        try:
            return self._read_gpu(index, handle), handle
        except _Lost:
            uuid = None
            with suppress(nvml.NVMLError):
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            return Gpu(index=index, uuid=uuid, lost=True), None

    def _read_gpu(self, index: int, handle: Any) -> Gpu:
        nvml = self.nvml
        label = f"GPU {index}"
        uuid = _text(self.soft(f"{label} UUID", nvml.nvmlDeviceGetUUID, handle))
        name = _text(self.soft(f"{label} name", nvml.nvmlDeviceGetName, handle))
        mem = self.soft(f"{label} memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        pci = self.soft(f"{label} PCI info", nvml.nvmlDeviceGetPciInfo, handle)
        bus_id = _text(pci.busId) if pci is not None else None
        minor = self.soft(f"{label} minor number", nvml.nvmlDeviceGetMinorNumber, handle)
        cc = self.soft(f"{label} compute capability", nvml.nvmlDeviceGetCudaComputeCapability, handle)
        arch = self.soft(f"{label} architecture", nvml.nvmlDeviceGetArchitecture, handle)
        brand = self.soft(f"{label} brand", nvml.nvmlDeviceGetBrand, handle)
        persistence = self.soft(f"{label} persistence mode", nvml.nvmlDeviceGetPersistenceMode, handle)
        ecc = self.soft(
            f"{label} ECC errors",
            nvml.nvmlDeviceGetTotalEccErrors,
            handle,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        retired = self.soft(f"{label} retired pages", nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        remapped = self.soft(f"{label} remapped rows", nvml.nvmlDeviceGetRemappedRows, handle)
        mig_raw = self.soft(f"{label} MIG mode", nvml.nvmlDeviceGetMigMode, handle)
        mig_mode = None if mig_raw is None else MigMode(current=bool(mig_raw[0]), pending=bool(mig_raw[1]))
        mig_devices: tuple[MigDevice, ...] = ()
        if mig_mode is not None and mig_mode.current:
            mig_devices = self.read_mig_devices(index, handle)
        return Gpu(
            index=index,
            uuid=uuid,
            name=name,
            memory_total=None if mem is None else int(mem.total),
            pci_bus_id=bus_id,
            minor=None if minor is None else int(minor),
            numa_node=self.numa_node(label, bus_id, handle),
            compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
            architecture=None if arch is None else ARCHITECTURES.get(int(arch), f"unknown ({int(arch)})"),
            mig_capable=mig_mode is not None,
            mig_mode=mig_mode,
            mig_devices=mig_devices,
            persistence_mode=None if persistence is None else bool(persistence),
            ecc_uncorrected_volatile=None if ecc is None else int(ecc),
            retired_pages_pending=None if retired is None else bool(retired),
            remapped_rows_pending=None if remapped is None else bool(remapped[2]),
            remapped_rows_failure=None if remapped is None else bool(remapped[3]),
            brand=None if brand is None else int(brand),
            pcie_root=self.pcie_root(bus_id),
            fabric=self.fabric(label, handle),
        )

    def pcie_root(self, bus_id: str | None) -> str | None:
        # What Kubernetes' deviceattribute helper reads: /sys/bus/pci/devices/<address> links to
        # /sys/devices/pci<domain>:<bus>/.../<address>; the first part names the root complex.
        if not bus_id:
            return None
        try:
            real = self.host.canonical(f"/sys/bus/pci/devices/{sysfs_pci_address(bus_id)}")
        except (GpunodeError, OSError, ValueError):
            return None
        parts = real.split("/")
        if len(parts) > 4 and parts[1:3] == ["sys", "devices"] and _PCI_ROOT.fullmatch(parts[3]):
            return parts[3]
        return None

    def fabric(self, label: str, handle: Any) -> Fabric | None:
        # NOT_SUPPORTED is the answer of every GPU before Hopper ("no fabric"), not a fact NVML lacks:
        # it adds no `unknown` line. A driver without the versioned call gets the first one.
        import ctypes  # here: simulated nodes import this module and must not load ctypes

        nvml = self.nvml

        def query() -> Any:
            versioned = getattr(nvml, "c_nvmlGpuFabricInfo_v2_t", None)
            if versioned is not None:
                info = versioned()
                try:
                    nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
                    return info
                except nvml.NVMLError as exc:
                    if getattr(exc, "value", None) not in (FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH):
                        raise
            info = nvml.c_nvmlGpuFabricInfo_t()
            nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
            return info

        try:
            info = query()
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == GPU_IS_LOST:
                raise _Lost from exc
            if code != NOT_SUPPORTED:
                self.unknown.append(f"{label} NVLink fabric: {_reason(code, exc)}")
            return None
        if int(info.state) != FABRIC_STATE_COMPLETED or int(info.status) != 0:
            return None  # outside a fabric, or not registered with it (yet): no domain to name
        raw = bytes(info.clusterUuid)
        if not any(raw):
            return None
        h = raw.hex()
        return Fabric(
            cluster_uuid=f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}", clique_id=int(info.cliqueId)
        )

    def numa_node(self, label: str, bus_id: str | None, handle: Any) -> int | None:
        # sysfs is what the kernel (and so kubelet's topology manager) uses; NVML is the fallback for
        # containers that do not see /sys.
        if bus_id:
            try:
                raw = self.host.read_text_if_exists(
                    f"/sys/bus/pci/devices/{sysfs_pci_address(bus_id)}/numa_node"
                )
            except GpunodeError:
                raw = None  # unreadable sysfs: ask NVML
            if raw is not None and raw.strip().lstrip("-").isdigit():
                sysfs_node = int(raw.strip())
                return sysfs_node if sysfs_node >= 0 else None
        node = self.soft(f"{label} NUMA node", self.nvml.nvmlDeviceGetNumaNodeId, handle)
        return None if node is None or int(node) < 0 else int(node)

    def read_mig_devices(self, parent: int, handle: Any) -> tuple[MigDevice, ...]:
        nvml = self.nvml
        label = f"GPU {parent}"
        slots = self.soft(f"{label} MIG device count", nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
        found: list[MigDevice] = []
        for slot in range(int(slots)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) in (NOT_FOUND, INVALID_ARGUMENT):
                    continue  # an empty slot
                if getattr(exc, "value", None) == GPU_IS_LOST:
                    raise _Lost from exc
                raise translate_nvml_error(exc, f"{label} MIG device {slot}") from exc
            mlabel = f"{label} MIG device {slot}"
            name = _text(self.soft(f"{mlabel} name", nvml.nvmlDeviceGetName, mig))
            mem = self.soft(f"{mlabel} memory", nvml.nvmlDeviceGetMemoryInfo, mig)
            match = _MIG_PROFILE.search(name or "")
            uuid = _text(self.soft(f"{mlabel} UUID", nvml.nvmlDeviceGetUUID, mig)) or ""
            gi = self.soft(f"{mlabel} GPU instance", nvml.nvmlDeviceGetGpuInstanceId, mig)
            found.append(
                MigDevice(
                    parent_index=parent,
                    index=slot,
                    uuid=uuid,
                    name=name,
                    profile=match.group(1) if match else None,
                    memory_total=None if mem is None else int(mem.total),
                    gpu_instance_id=gi,
                    compute_instance_id=self.soft(
                        f"{mlabel} compute instance", nvml.nvmlDeviceGetComputeInstanceId, mig
                    ),
                    placement=None if gi is None else self.mig_placement(mlabel, handle, int(gi)),
                    attributes=self.mig_attributes(mlabel, mig),
                )
            )
        return tuple(found)

    def mig_placement(self, mlabel: str, parent: Any, gi: int) -> MigPlacement | None:
        nvml = self.nvml

        def query() -> Any:
            return nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(parent, gi))

        info = self.soft(f"{mlabel} GPU instance placement", query)
        if info is None:
            return None
        return MigPlacement(
            profile_id=int(info.profileId), start=int(info.placement.start), size=int(info.placement.size)
        )

    def mig_attributes(self, mlabel: str, mig: Any) -> MigAttributes | None:
        a = self.soft(f"{mlabel} attributes", self.nvml.nvmlDeviceGetAttributes_v2, mig)
        if a is None:
            return None
        return MigAttributes(
            multiprocessors=int(a.multiprocessorCount),
            copy_engines=int(a.sharedCopyEngineCount),
            decoders=int(a.sharedDecoderCount),
            encoders=int(a.sharedEncoderCount),
            jpeg_engines=int(a.sharedJpegCount),
            ofa_engines=int(a.sharedOfaCount),
            gpu_instance_slices=int(a.gpuInstanceSliceCount),
            compute_instance_slices=int(a.computeInstanceSliceCount),
            memory_mib=int(a.memorySizeMB),
        )

    def read_topology(self, gpus: list[Gpu], handles: dict[int, Any]) -> tuple[GpuPair, ...]:
        nvml = self.nvml
        by_bus = {g.pci_bus_id.lower(): g.index for g in gpus if g.pci_bus_id}
        direct: dict[tuple[int, int], int] = {}
        switch_links: dict[int, dict[str, int]] = {}
        for index, handle in handles.items():
            try:
                self._read_nvlinks(index, handle, by_bus, direct, switch_links)
            except _Lost:
                continue
        pairs: list[GpuPair] = []
        indexes = sorted(handles)
        for i, a in enumerate(indexes):
            for b in indexes[i + 1 :]:
                try:
                    raw = self.soft(
                        f"topology GPU {a}-{b}",
                        nvml.nvmlDeviceGetTopologyCommonAncestor,
                        handles[a],
                        handles[b],
                    )
                except _Lost:
                    raw = None
                level = None
                if raw is not None:
                    try:
                        level = TopologyLevel(int(raw))
                    except ValueError:
                        level = None
                # Links seen from the lower index: each physical link is reported by both ends.
                links = direct.get((a, b), 0)
                shared = set(switch_links.get(a, {})) & set(switch_links.get(b, {}))
                if shared:
                    # Through NVSwitch every pair can use all of the smaller side's switch links.
                    links += min(sum(switch_links[a].values()), sum(switch_links[b].values()))
                pairs.append(GpuPair(a=a, b=b, level=level, nvlinks=links))
        return tuple(pairs)

    def _read_nvlinks(
        self,
        index: int,
        handle: Any,
        by_bus: dict[str, int],
        direct: dict[tuple[int, int], int],
        switch_links: dict[int, dict[str, int]],
    ) -> None:
        nvml = self.nvml
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == GPU_IS_LOST:
                    raise _Lost from exc
                if link == 0 and code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                    self.unknown.append(
                        f"GPU {index} NVLink: "
                        + ("not supported" if code == NOT_SUPPORTED else "not implemented by this driver")
                    )
                return  # past the last link this GPU has, or no NVLink at all
            if not active:
                continue
            pci = self.soft(
                f"GPU {index} NVLink {link} peer", nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link
            )
            if pci is None:
                continue
            remote = (_text(pci.busId) or "").lower()
            kind = self.soft(
                f"GPU {index} NVLink {link} peer type", nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link
            )
            peer = by_bus.get(remote)
            if peer is not None and kind in (None, NVLINK_DEVICE_TYPE_GPU):
                if index < peer:
                    direct[(index, peer)] = direct.get((index, peer), 0) + 1
            # A GPU-type peer that was not read (lost) is no switch: counting it as one would join every
            # GPU linked to it. Without a device type, an unknown peer is taken for an NVSwitch.
            elif kind == NVLINK_DEVICE_TYPE_SWITCH or (peer is None and kind is None):
                per_switch = switch_links.setdefault(index, {})
                per_switch[remote] = per_switch.get(remote, 0) + 1


def _reason(code: object, exc: Exception) -> str:
    return {
        NOT_SUPPORTED: "not supported by this GPU/driver",
        FUNCTION_NOT_FOUND: "not implemented by this driver's NVML",
        NO_PERMISSION: "permission denied",
        NOT_FOUND: "not found",
        INVALID_ARGUMENT: "refused (invalid argument)",
    }.get(code if isinstance(code, int) else -1, f"failed ({exc})")


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)
