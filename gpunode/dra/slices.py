"""The node's GPUs as ResourceSlices (resource.k8s.io/v1), named and attributed as NVIDIA's DRA driver
publishes them, so DeviceClasses and claims written for it select the same devices
(../shared/specs/dra-nvidia-compat.md sections 2, 3 and 6; dra-kubelet-plugin.md sections 4 and 7).

A pure function of the inventory, the health state and the settings: no NVML, no API, no clock. The
publisher decides the generation and when to call it; the same inputs give the same objects, so an
unchanged node republishes byte for byte.

- One pool named after the node; every slice of one call carries the same generation and
  `resourceSliceCount` = the number of slices. A device-less node still gets one empty slice (what the
  Go kubeletplugin library publishes), so the pool exists.
- Full GPUs `gpu-<minor>` while MIG is off; with MIG on only its existing MIG devices
  `gpu-<parentMinor>-mig-<profile>-<giProfileId>-<placementStart>` (NVIDIA's static mode).
- A fact NVML could not answer leaves that attribute out of that device; a device whose *name* cannot be
  made (no minor number; a MIG device without profile or placement) is left out of the slices, and
  `left_out()` says which and why. Nothing here is fatal for the node.
- Up to 128 devices a slice, 64 when any device of the pool has a taint (the API's limits): the pool is
  split into several slices, in device order.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from gpunode.dra import DEFAULT_DRIVER
from gpunode.errors import ConfigError
from gpunode.nvml.discovery import sysfs_pci_address
from gpunode.nvml.model import Gpu, Inventory, MigDevice
from gpunode.plugin.health import HealthSettings

API_VERSION = "resource.k8s.io/v1"
STANDARD_DOMAIN = "resource.kubernetes.io"  # attributes Kubernetes defines for every driver

MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64
MAX_NAME = 253

# nvml.h NVML_BRAND_*, spelled as NVIDIA's driver writes its `brand` attribute.
BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}

TaintEffect = Literal["None", "NoSchedule", "NoExecute"]

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VERSION = re.compile(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?")


@dataclass(frozen=True)
class Trouble:
    """One health state of a GPU or MIG device, as the health monitor knows it.

    `since` is when the state began (Unix seconds): it becomes the taint's timeAdded, so it must stay
    the same while the state lasts; a republish then changes nothing.
    """

    kind: Literal["xid", "lost", "unmonitored"]
    since: float
    xid: int | None = None  # the Xid, for kind "xid"


# UUID ("GPU-…" or "MIG-…") → its troubles. A GPU's troubles apply to its MIG devices too.
HealthState = Mapping[str, Sequence[Trouble]]


@dataclass(frozen=True)
class SliceSettings:
    node_name: str
    driver: str = DEFAULT_DRIVER
    # A lost GPU's taint: NoSchedule as NVIDIA's driver; NoExecute (evict its pods) only when asked.
    lost_effect: TaintEffect = "NoSchedule"
    # Which Xids are critical (NoSchedule) and which only noted (effect None): the plugin's settings.
    health: HealthSettings = field(default_factory=HealthSettings)
    node_uid: str | None = None  # given: the slices are owned by the Node, so they go with it

    def __post_init__(self) -> None:
        if len(self.node_name) > MAX_NAME or not _DNS_SUBDOMAIN.match(self.node_name):
            raise ConfigError(
                f"node name {self.node_name!r} is not a Kubernetes node name (a DNS subdomain of at most "
                f"{MAX_NAME} lowercase letters, digits, '-' and '.')",
                "give the node's name as `kubectl get nodes` shows it (NODE_NAME in a DaemonSet)",
            )
        if len(self.driver) > 63 or not _DNS_SUBDOMAIN.match(self.driver):
            raise ConfigError(
                f"DRA driver name {self.driver!r} is not a DNS subdomain of at most 63 characters",
                f"use the default {DEFAULT_DRIVER!r}, or a name such as 'gpu.example.com'",
            )
        if self.lost_effect not in ("NoSchedule", "NoExecute"):
            raise ConfigError(
                f"taint effect {self.lost_effect!r} for a lost GPU is not NoSchedule or NoExecute",
                "use NoSchedule (keep running pods) or NoExecute (evict them)",
            )


def build_slices(
    inventory: Inventory, health: HealthState, settings: SliceSettings, generation: int
) -> list[dict[str, Any]]:
    """The ResourceSlice objects of the node's pool, generation `generation`, ready to create."""
    if generation < 0:
        raise ValueError(f"a pool generation is 0 or more, got {generation}")
    devices = [device for device, _ in _devices(inventory, health, settings) if device is not None]
    limit = MAX_DEVICES_WITH_TAINTS if any("taints" in d for d in devices) else MAX_DEVICES
    chunks = [devices[i : i + limit] for i in range(0, len(devices), limit)] or [[]]
    return [_slice(settings, generation, index, len(chunks), chunk) for index, chunk in enumerate(chunks)]


def left_out(inventory: Inventory) -> list[str]:
    """Why a GPU or MIG device of the inventory is in no slice, one line each."""
    settings = SliceSettings(node_name="n")
    return [why for device, why in _devices(inventory, {}, settings) if device is None and why]


def device_name(gpu: Gpu, mig: MigDevice | None = None) -> str | None:
    """NVIDIA's name for a full GPU or a MIG device; None when a part of it is unknown."""
    if gpu.minor is None:
        return None
    if mig is None:
        return f"gpu-{gpu.minor}"
    if mig.profile is None or mig.placement is None:
        return None
    profile = _profile_label(mig.profile)
    return f"gpu-{gpu.minor}-mig-{profile}-{mig.placement.profile_id}-{mig.placement.start}"


def nvlink_domains(inventory: Inventory) -> dict[int, str]:
    """GPU index → the `nvlinkDomain` attribute: which GPUs NVLink joins (see docs/commands/dra.md).

    A GPU registered with an NVSwitch fabric (NVML fabric info, state completed) is in the domain
    `<clusterUUID>.<cliqueId>`, the same on every node of that fabric. Any other GPU with an active NVLink
    to another GPU of the node (directly or through NVSwitch) is in the domain of its connected component
    of the node's NVLink graph, `nvlink-` + 16 hex digits of the SHA-256 of the members' sorted UUIDs: the
    same for the same GPUs on every start. A GPU without NVLink has none.
    """
    domains: dict[int, str] = {}
    by_index = {g.index: g for g in inventory.gpus if g.usable}
    for gpu in by_index.values():
        if gpu.fabric is not None:
            domains[gpu.index] = f"{gpu.fabric.cluster_uuid}.{gpu.fabric.clique_id}"
    links: dict[int, set[int]] = {}
    for pair in inventory.pairs:
        if pair.nvlinks > 0 and pair.a in by_index and pair.b in by_index:
            links.setdefault(pair.a, set()).add(pair.b)
            links.setdefault(pair.b, set()).add(pair.a)
    seen: set[int] = set()
    for start in sorted(links):
        if start in seen:
            continue
        component, todo = set(), [start]
        while todo:
            index = todo.pop()
            if index not in component:
                component.add(index)
                todo.extend(links[index] - component)
        seen |= component
        names = sorted(by_index[i].uuid or by_index[i].pci_bus_id or f"index-{i}" for i in component)
        digest = hashlib.sha256(",".join(names).encode()).hexdigest()[:16]
        for index in component:
            domains.setdefault(index, f"nvlink-{digest}")
    return domains


# ---------------------------------------------------------------------------------------------------


def _devices(
    inventory: Inventory, health: HealthState, settings: SliceSettings
) -> list[tuple[dict[str, Any] | None, str]]:
    domains = nvlink_domains(inventory)
    out: list[tuple[dict[str, Any] | None, str]] = []
    names: set[str] = set()
    for gpu in inventory.gpus:
        mig_on = gpu.mig_mode is not None and gpu.mig_mode.current
        units: list[MigDevice | None] = list(gpu.mig_devices) if mig_on else [None]
        for mig in units:
            what = f"GPU {gpu.index}" + ("" if mig is None else f" MIG device {mig.index}")
            name = device_name(gpu, mig)
            if name is None:
                missing = "minor number" if gpu.minor is None else "MIG profile or GPU instance placement"
                out.append((None, f"{what}: left out, NVML did not say its {missing}"))
                continue
            if name in names:
                # Two compute instances of one GPU instance would share NVIDIA's name: publishing both
                # would make the whole pool invalid for the allocator.
                out.append((None, f"{what}: left out, its name {name} is taken by another device"))
                continue
            names.add(name)
            device: dict[str, Any] = {"name": name}
            if mig is None:
                device["attributes"] = _gpu_attributes(inventory, gpu, domains.get(gpu.index))
                if gpu.memory_total is not None:
                    device["capacity"] = {"memory": {"value": quantity(gpu.memory_total)}}
            else:
                device["attributes"] = _mig_attributes(inventory, gpu, mig)
                device["capacity"] = _mig_capacity(mig)
            troubles = list(health.get(gpu.uuid or "", ()))
            if mig is not None:
                troubles += health.get(mig.uuid, ())
            taints = _taints(troubles, settings)
            if taints:
                device["taints"] = taints
            out.append((device, ""))
    return out


def _common(inventory: Inventory, gpu: Gpu) -> dict[str, dict[str, Any]]:
    """The attributes a MIG device shares with its parent GPU."""
    a: dict[str, dict[str, Any]] = {}
    if gpu.name:
        a["productName"] = {"string": gpu.name[:64]}
    if gpu.brand is not None and gpu.brand in BRANDS:
        a["brand"] = {"string": BRANDS[gpu.brand]}
    if gpu.architecture and not gpu.architecture.startswith("unknown"):
        a["architecture"] = {"string": gpu.architecture}
    if gpu.compute_capability is not None:
        a["cudaComputeCapability"] = {"version": "{}.{}.0".format(*gpu.compute_capability)}
    driver = semver(inventory.driver_version)
    if driver is not None:
        a["driverVersion"] = {"version": driver}
    if inventory.cuda_driver_version is not None:
        a["cudaDriverVersion"] = {"version": "{}.{}.0".format(*inventory.cuda_driver_version)}
    if gpu.pci_bus_id:
        a[f"{STANDARD_DOMAIN}/pciBusID"] = {"string": sysfs_pci_address(gpu.pci_bus_id)}
    if gpu.pcie_root:
        a[f"{STANDARD_DOMAIN}/pcieRoot"] = {"string": gpu.pcie_root}
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        a[f"{STANDARD_DOMAIN}/numaNode"] = {"int": gpu.numa_node}
    return a


def _gpu_attributes(inventory: Inventory, gpu: Gpu, domain: str | None) -> dict[str, dict[str, Any]]:
    a: dict[str, dict[str, Any]] = {"type": {"string": "gpu"}}
    if gpu.uuid:
        a["uuid"] = {"string": gpu.uuid}
    a.update(_common(inventory, gpu))
    if domain is not None:
        a["nvlinkDomain"] = {"string": domain}
    return a


def _mig_attributes(inventory: Inventory, gpu: Gpu, mig: MigDevice) -> dict[str, dict[str, Any]]:
    # No nvlinkDomain: MIG devices do not talk over NVLink (no peer-to-peer in MIG mode).
    a: dict[str, dict[str, Any]] = {"type": {"string": "mig"}}
    if mig.uuid:
        a["uuid"] = {"string": mig.uuid}
    if gpu.uuid:
        a["parentUUID"] = {"string": gpu.uuid}
    if mig.profile:
        a["profile"] = {"string": mig.profile}
    a.update(_common(inventory, gpu))
    return a


def _mig_capacity(mig: MigDevice) -> dict[str, dict[str, str]]:
    c: dict[str, dict[str, str]] = {}
    if mig.attributes is not None:
        m = mig.attributes
        for key, value in (
            ("multiprocessors", m.multiprocessors),
            ("copyEngines", m.copy_engines),
            ("decoders", m.decoders),
            ("encoders", m.encoders),
            ("jpegEngines", m.jpeg_engines),
            ("ofaEngines", m.ofa_engines),
        ):
            c[key] = {"value": str(value)}
        c["memory"] = {"value": quantity(m.memory_mib * 2**20)}
    elif mig.memory_total is not None:
        c["memory"] = {"value": quantity(mig.memory_total)}
    if mig.placement is not None:
        # One counter per memory slice the GPU instance holds, as NVIDIA's static MIG devices carry.
        for i in range(mig.placement.start, mig.placement.start + mig.placement.size):
            c[f"memorySlice{i}"] = {"value": "1"}
    return c


def _taints(troubles: Sequence[Trouble], settings: SliceSettings) -> list[dict[str, str]]:
    """One taint per key (the latest trouble of that key), in a fixed key order."""
    latest: dict[str, Trouble] = {}
    for t in troubles:
        if t.kind not in latest or t.since >= latest[t.kind].since:
            latest[t.kind] = t
    taints: list[dict[str, str]] = []
    for kind in ("lost", "xid", "unmonitored"):
        if kind not in latest:
            continue
        t = latest[kind]
        taint: dict[str, str] = {"key": f"{settings.driver}/{_TAINT_KEYS[kind]}"}
        if kind == "xid" and t.xid is not None:
            taint["value"] = str(t.xid)
            taint["effect"] = "NoSchedule" if settings.health.is_critical(t.xid) else "None"
        else:
            taint["effect"] = settings.lost_effect if kind == "lost" else "None"
        taint["timeAdded"] = _timestamp(t.since)
        taints.append(taint)
    return taints


_TAINT_KEYS = {"lost": "gpu-lost", "xid": "xid", "unmonitored": "unmonitored"}


def _slice(
    settings: SliceSettings, generation: int, index: int, count: int, devices: list[dict[str, Any]]
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": slice_name(settings.node_name, settings.driver, index)}
    if settings.node_uid:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": settings.node_name,
                "uid": settings.node_uid,
                "controller": True,
            }
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": settings.driver,
            "nodeName": settings.node_name,
            "pool": {"name": settings.node_name, "generation": generation, "resourceSliceCount": count},
            "devices": devices,
        },
    }


def slice_name(node: str, driver: str, index: int) -> str:
    """`<node>-<driver>-<index>`, a DNS subdomain of at most 253; a long node name is shortened and a
    hash of it added, so two nodes never share a name."""
    name = f"{node}-{driver}-{index}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    tail = f"-{digest}-{driver}-{index}"
    return node[: MAX_NAME - len(tail)].rstrip("-.") + tail


def quantity(n: int) -> str:
    """Bytes as Kubernetes writes a binary quantity: the largest binary suffix that divides exactly."""
    for power, suffix in ((6, "Ei"), (5, "Pi"), (4, "Ti"), (3, "Gi"), (2, "Mi"), (1, "Ki")):
        unit = 1024**power
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def semver(text: str | None) -> str | None:
    """A driver version as semver: "535.104.05" → "535.104.5", "470.82" → "470.82.0" (the API refuses
    leading zeros and missing parts); None when it does not start with a number."""
    if not text:
        return None
    m = _VERSION.match(text)
    if m is None:
        return None
    return ".".join(str(int(part or 0)) for part in m.groups())


def _profile_label(profile: str) -> str:
    # NVIDIA's rule: lowercase, dots dropped, anything else outside [a-z0-9-] becomes "-".
    return re.sub(r"[^a-z0-9-]", "-", profile.lower().replace(".", ""))


def _timestamp(since: float) -> str:
    return datetime.fromtimestamp(int(since), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
