"""What the plugin serves: the devices of each resource, built from the Inventory, and their health.

`build_resources` is pure (Inventory + settings → resources and devices). `DeviceRegistry` is the one
mutable, thread-safe piece: the health monitor marks GPUs or MIG instances unhealthy or healthy again,
and every ListAndWatch stream of an affected resource wakes up (a condition variable, no polling).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from gpunode.errors import ConfigError
from gpunode.nvml.model import Gpu, Inventory, MigDevice

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

MIG_STRATEGIES = ("none", "single", "mixed")
DEVICE_ID_STRATEGIES = ("uuid", "index")


@dataclass(frozen=True)
class Unit:
    """Where a health event lands: a whole GPU (instance None) or one MIG instance (gi, ci) on it."""

    gpu_index: int
    instance: tuple[int, int] | None = None


@dataclass(frozen=True)
class PluginDevice:
    """One device as kubelet sees it, and what it stands for on the host."""

    id: str  # the ID kubelet sees: the visible ID, plus "::<n>" for a time-sliced replica
    visible_id: str  # what the container runtime is told: a GPU/MIG UUID, or "3" / "0:1" by index
    uuid: str  # the GPU's or MIG instance's UUID, whatever the ID strategy
    gpu_index: int  # the physical GPU (the parent of a MIG instance)
    gpu_uuid: str  # ... and its UUID, which survives a re-enumeration that changes indexes
    minor: int | None  # /dev/nvidia<minor> of the physical GPU
    numa_node: int | None
    mig: MigDevice | None = None
    replica: int | None = None

    @cached_property
    def unit(self) -> Unit:
        # Cached (a device never changes): every health lookup, one per device of each Allocate, needs it.
        if self.mig is None or self.mig.gpu_instance_id is None or self.mig.compute_instance_id is None:
            return Unit(self.gpu_index)
        return Unit(self.gpu_index, (self.mig.gpu_instance_id, self.mig.compute_instance_id))

    @cached_property
    def gpu_unit(self) -> Unit:
        """The whole GPU the device is on (a mark there covers it)."""
        return Unit(self.gpu_index)


@dataclass(frozen=True)
class Resource:
    """One extended resource: its name, its socket file and its devices (in a stable order)."""

    name: str  # e.g. nvidia.com/gpu, nvidia.com/mig-1g.5gb, nvidia.com/gpu.shared
    socket_name: str  # file name in the device-plugins directory
    devices: tuple[PluginDevice, ...]
    replicas: int = 1  # replicas per physical device (1: not shared)
    sharing: str = "none"  # how the replicas share a device: "none", "time-slicing" or "mps"

    def by_id(self) -> dict[str, PluginDevice]:
        return self._by_id

    @cached_property
    def _by_id(self) -> dict[str, PluginDevice]:
        # Built once per resource: Allocate looks IDs up on every call, with up to thousands of replicas.
        return {d.id: d for d in self.devices}


def socket_name(resource: str) -> str:
    """gpunode's socket for a resource: `gpunode-nvidia.com-gpu.sock` (kubelet allows only a file name)."""
    return "gpunode-" + resource.replace("/", "-") + ".sock"


@dataclass(frozen=True)
class SharedResource:
    """Time-slicing for one resource (NVIDIA's `sharing.timeSlicing.resources[]`): which of its devices are
    shared, how many replicas each gets, and the name the shared devices are advertised under."""

    name: str  # the resource whose devices are shared, e.g. nvidia.com/gpu or nvidia.com/mig-1g.5gb
    replicas: int
    rename: str = ""  # "" : the name itself, or <name>.shared with rename-by-default
    # "all", a count (the first N devices of the resource), or GPU indexes "3", MIG indexes "0:1" and
    # GPU or MIG UUIDs
    devices: str | int | tuple[str, ...] = "all"

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "replicas": self.replicas}
        if self.rename:
            out["rename"] = self.rename
        if self.devices != "all":
            out["devices"] = list(self.devices) if isinstance(self.devices, tuple) else self.devices
        return out


@dataclass(frozen=True)
class NamedResource:
    """A resource name for the GPUs (or MIG profiles) whose name matches a pattern (NVIDIA's
    `resources.gpus[]` / `resources.mig[]`): `*` matches anything, and the pattern may match anywhere in
    the name, as NVIDIA's plugin matches it (its wildcard is turned into an unanchored regular expression)."""

    pattern: str
    name: str

    def matches(self, text: str) -> bool:
        regex = ".*".join(re.escape(part) for part in self.pattern.split("*"))
        return re.search(regex, text) is not None

    def as_dict(self) -> dict[str, object]:
        return {"pattern": self.pattern, "name": self.name}


SHARING_STRATEGIES = ("time-slicing", "mps")


@dataclass(frozen=True)
class Sharing:
    replicas: int = 1  # every resource, every device (gpunode's time-slicing.replicas)
    rename_by_default: bool = False
    resources: tuple[SharedResource, ...] = ()  # per resource; these win over `replicas` for their names
    # How replicas share a GPU. One strategy per plugin, as in NVIDIA's plugin: config refuses a mix.
    strategy: str = "time-slicing"


def build_resources(
    inventory: Inventory,
    *,
    resource_name: str = "nvidia.com/gpu",
    mig_strategy: str = "none",
    device_id_strategy: str = "uuid",
    sharing: Sharing = Sharing(),
    gpu_names: tuple[NamedResource, ...] = (),
    mig_names: tuple[NamedResource, ...] = (),
) -> tuple[Resource, ...]:
    """Group the node's usable GPUs and MIG instances into resources, the way the strategies say.

    `gpu_names` gives whole GPUs a resource per model (the first pattern that matches the GPU's name wins;
    a GPU none matches is not served, as in NVIDIA's plugin), `mig_names` does so for MIG profiles under the
    mixed strategy. Raises ConfigError when the node does not fit the MIG strategy (e.g. `single` with two
    profiles), naming what was found, so the operator can pick `mixed` or re-partition.
    """
    if mig_strategy not in MIG_STRATEGIES:
        raise ConfigError(
            f"unknown MIG strategy {mig_strategy!r}", f"use one of: {', '.join(MIG_STRATEGIES)}"
        )
    if device_id_strategy not in DEVICE_ID_STRATEGIES:
        raise ConfigError(
            f"unknown device ID strategy {device_id_strategy!r}",
            f"use one of: {', '.join(DEVICE_ID_STRATEGIES)}",
        )
    gpus = [g for g in inventory.gpus if g.uuid]
    groups: dict[str, list[tuple[Gpu, MigDevice | None]]] = {}
    domain = resource_name.split("/", 1)[0]

    def whole(gpu: Gpu) -> None:
        if not gpu_names:
            groups.setdefault(resource_name, []).append((gpu, None))
            return
        for named in gpu_names:
            if named.matches(gpu.name or ""):
                groups.setdefault(_qualified(domain, named.name), []).append((gpu, None))
                return

    if mig_strategy == "none":
        groups[resource_name] = []
        for gpu in gpus:
            whole(gpu)
        if gpu_names and not groups[resource_name]:
            del groups[resource_name]
    elif mig_strategy == "single":
        if gpu_names:
            raise ConfigError(
                "resources.gpus (a resource per GPU model) does not go with mig-strategy single",
                "use mig-strategy mixed or none, or drop resources.gpus",
            )
        groups[resource_name] = _single(gpus)
    else:
        for gpu in gpus:
            if _mig_on(gpu):
                for instance in gpu.mig_devices:
                    if not instance.profile:
                        raise ConfigError(
                            f"MIG device {instance.uuid} on GPU {gpu.index} has no recognisable profile "
                            f"(name {instance.name!r}), so it cannot be given a nvidia.com/mig-<profile> "
                            "resource",
                            "check `nvidia-smi -L`; use mig-strategy `single` or `none`",
                        )
                    name = _mig_name(domain, instance.profile, mig_names)
                    if name is not None:
                        groups.setdefault(name, []).append((gpu, instance))
            else:
                whole(gpu)
        if not gpu_names:
            groups.setdefault(resource_name, [])

    mig_mode_gpus = {g.uuid for g in gpus if _mig_on(g)}
    by_name: dict[str, list[PluginDevice]] = {}
    replicas_of: dict[str, int] = {}
    shared_names: set[str] = set()
    for name, members in groups.items():
        base = [_device(gpu, mig, device_id_strategy) for gpu, mig in members]
        share = _sharing_for(name, domain, sharing)
        if share is None or share.replicas <= 1:
            by_name.setdefault(name, []).extend(base)
            replicas_of.setdefault(name, 1)
            continue
        chosen = _selected(base, share.devices)
        if sharing.strategy == "mps" and any(d.mig is not None for d in chosen):
            # MPS runs on whole GPUs only (NVIDIA: "MPS is not supported with MIG").
            raise ConfigError(
                f"{name}: MPS sharing of MIG devices is not possible (MPS shares whole GPUs only)",
                "use mig-strategy none for MPS, or share the MIG devices with time-slicing",
            )
        in_mig_mode = sorted({d.gpu_index for d in chosen if d.mig is None and d.gpu_uuid in mig_mode_gpus})
        if sharing.strategy == "mps" and in_mig_mode:
            # Served whole under mig-strategy none, but its MPS server would not start: the daemon's servers
            # fail while MIG devices are visible, which would leave every replica of the resource, other
            # GPUs' too, advertised Healthy and unusable.
            listed = ", ".join(map(str, in_mig_mode))
            raise ConfigError(
                f"{name}: GPU {listed} {'is' if len(in_mig_mode) == 1 else 'are'} in MIG mode, which MPS "
                "cannot share",
                f"turn MIG mode off (nvidia-smi -i {in_mig_mode[0]} -mig 0, with the GPU idle) or leave the "
                "GPU out of the MPS entry's devices",
            )
        shared_name = _qualified(domain, share.rename) if share.rename else name
        if not share.rename and sharing.rename_by_default:
            shared_name = name + ".shared"
        # Devices the entry does not select stay under the resource's own name, unshared (NVIDIA's rule).
        rest = [d for d in base if d not in chosen]
        if rest or shared_name == name:
            by_name.setdefault(name, []).extend(rest)
            replicas_of.setdefault(name, 1)
        by_name.setdefault(shared_name, []).extend(r for d in chosen for r in _replicate(d, share.replicas))
        replicas_of[shared_name] = share.replicas
        shared_names.add(shared_name)
    return tuple(
        Resource(
            name,
            socket_name(name),
            tuple(devices),
            replicas_of[name],
            sharing.strategy if name in shared_names else "none",
        )
        for name, devices in by_name.items()
    )


def _replicate(base: PluginDevice, replicas: int) -> list[PluginDevice]:
    return [
        PluginDevice(
            id=f"{base.id}::{n}",
            visible_id=base.visible_id,
            uuid=base.uuid,
            gpu_index=base.gpu_index,
            gpu_uuid=base.gpu_uuid,
            minor=base.minor,
            numa_node=base.numa_node,
            mig=base.mig,
            replica=n,
        )
        for n in range(replicas)
    ]


def _qualified(domain: str, name: str) -> str:
    # NVIDIA's rule (api/config/v1 NewResourceName): a name without a domain gets the plugin's domain.
    return name if "/" in name else f"{domain}/{name}"


def _mig_name(domain: str, profile: str, mig_names: tuple[NamedResource, ...]) -> str | None:
    if not mig_names:
        return f"{domain}/mig-{profile}"
    for named in mig_names:
        if named.matches(profile):
            return _qualified(domain, named.name)
    return None


def _sharing_for(name: str, domain: str, sharing: Sharing) -> SharedResource | None:
    for share in sharing.resources:
        if _qualified(domain, share.name) == name:
            return share
    if sharing.replicas > 1:
        return SharedResource(name, sharing.replicas)
    return None


def _selected(devices: list[PluginDevice], which: str | int | tuple[str, ...]) -> list[PluginDevice]:
    """The devices a sharing entry names: all, the first N, or those whose index or UUID is listed."""
    if which == "all":
        return list(devices)
    if isinstance(which, int):
        return list(devices[:which])
    wanted = set(which)
    out = []
    for device in devices:
        index = f"{device.gpu_index}:{device.mig.index}" if device.mig is not None else str(device.gpu_index)
        if index in wanted or device.uuid in wanted:
            out.append(device)
    return out


def _mig_on(gpu: Gpu) -> bool:
    return gpu.mig_mode is not None and gpu.mig_mode.current


def _single(gpus: list[Gpu]) -> list[tuple[Gpu, MigDevice | None]]:
    mig_gpus = [g for g in gpus if _mig_on(g)]
    if not mig_gpus:
        return [(g, None) for g in gpus]
    plain = [g.index for g in gpus if not _mig_on(g)]
    if plain:
        raise ConfigError(
            "MIG strategy `single` needs every GPU in MIG mode, but GPU "
            + ", ".join(str(i) for i in plain)
            + " is not",
            "enable MIG on every GPU (`nvidia-smi -mig 1`) or use mig-strategy `mixed`",
        )
    profiles = sorted({m.profile or "?" for g in mig_gpus for m in g.mig_devices})
    if len(profiles) > 1:
        raise ConfigError(
            "MIG strategy `single` needs one MIG profile on the whole node, found: " + ", ".join(profiles),
            "re-partition the GPUs to one profile, or use mig-strategy `mixed`",
        )
    return [(g, m) for g in mig_gpus for m in g.mig_devices]


def _device(gpu: Gpu, mig: MigDevice | None, id_strategy: str) -> PluginDevice:
    uuid = mig.uuid if mig is not None else (gpu.uuid or "")
    if id_strategy == "index":
        visible = f"{gpu.index}:{mig.index}" if mig is not None else str(gpu.index)
    else:
        visible = uuid
    return PluginDevice(
        id=visible,
        visible_id=visible,
        uuid=uuid,
        gpu_index=gpu.index,
        gpu_uuid=gpu.uuid or "",
        minor=gpu.minor,
        numa_node=gpu.numa_node,
        mig=mig,
    )


@dataclass(frozen=True)
class DeviceHealth:
    device: PluginDevice
    healthy: bool
    reason: str | None  # why it is unhealthy


@dataclass
class _ResourceState:
    resource: Resource
    version: int = 0


class DeviceRegistry:
    """The served resources and the health of every unit, shared by the gRPC servers and the monitor.

    Readers wait for a change with `wait_for_change(resource, seen_version)`; writers bump the version
    of each resource whose devices changed and wake every waiter at once.
    """

    def __init__(
        self, resources: Iterable[Resource] = (), on_health_change: Callable[[], object] | None = None
    ) -> None:
        """`on_health_change` is called (outside the lock) after a mark changed something."""
        self.on_health_change = on_health_change
        self._states: dict[str, _ResourceState] = {}
        self._unhealthy: dict[Unit, str] = {}
        # GPUs the health monitor cannot watch (by UUID: index, why). They stay healthy and schedulable;
        # this is only reported (status file, `plugin status`, doctor), never sent to kubelet.
        self._unmonitored: dict[str, tuple[int, str]] = {}
        # Resources whose every device is unhealthy for a reason outside the GPUs (an MPS control daemon
        # that is down): resource name -> why. Kept across replace(): the supervisor of that reason clears it.
        self._down: dict[str, str] = {}
        self._gpu_uuid: dict[int, str] = {}  # index -> UUID of the GPUs known at the last replace()
        self._cond = threading.Condition()
        self._closed = False
        self.replace(resources)

    # -- writers --------------------------------------------------------------------------------

    def replace(self, resources: Iterable[Resource], gpus: Mapping[str, int] | None = None) -> None:
        """Serve a new set of resources (after a reload, or a MIG change found by the MIG watcher).

        A resource's version moves (its ListAndWatch streams send again) only when what kubelet sees of it
        changed: its devices or their health. A MIG change re-reads every resource, and kubelet must not
        get a resend of the ones it did not touch.

        Health marks follow their GPU by UUID, since a re-enumeration may change indexes; marks of GPUs
        that are gone are dropped. A mark on a MIG instance follows that instance by its MIG UUID and is
        dropped once the instance is gone: an instance created later with the same gi/ci ids is another
        device and starts healthy. `gpus` (GPU UUID -> index, from the discovery) keeps the marks of GPUs
        that serve no device for a moment: a MIG GPU with every instance destroyed mid-repartition keeps
        its Xid mark for the instances that come next.
        """
        with self._cond:
            old = self._states
            shown_before = {name: self._shown(s.resource) for name, s in old.items()}
            old_uuid = {
                **self._gpu_uuid,
                **{d.gpu_index: d.gpu_uuid for s in old.values() for d in s.resource.devices},
            }
            old_mig = _mig_units(s.resource for s in old.values())
            self._states = {}
            for r in resources:
                prev = old.get(r.name)
                self._states[r.name] = _ResourceState(r, prev.version if prev else 0)
            new_index = {
                **(gpus or {}),
                **{d.gpu_uuid: d.gpu_index for s in self._states.values() for d in s.resource.devices},
            }
            self._gpu_uuid = {index: uuid for uuid, index in new_index.items()}
            new_mig = {
                uuid: unit for unit, uuid in _mig_units(s.resource for s in self._states.values()).items()
            }
            marks: dict[Unit, str] = {}
            for unit, reason in self._unhealthy.items():
                mig_uuid = old_mig.get(unit) if unit.instance is not None else None
                if mig_uuid is not None:
                    moved = new_mig.get(mig_uuid)
                    if moved is not None:
                        marks[moved] = reason
                    continue
                # A whole GPU, or an instance no served device stood for (mig-strategy none): by GPU UUID.
                index = new_index.get(old_uuid.get(unit.gpu_index, ""))
                if index is not None:
                    marks[Unit(index, unit.instance)] = reason
            self._unhealthy = marks
            self._unmonitored = {u: v for u, v in self._unmonitored.items() if u in new_index}
            for name, state in self._states.items():
                prev = old.get(name)
                if prev is not None and (
                    prev.resource != state.resource or shown_before[name] != self._shown(state.resource)
                ):
                    state.version += 1
            self._cond.notify_all()

    def _shown(self, resource: Resource) -> tuple[DeviceHealth, ...]:
        """What a ListAndWatch message of the resource carries, as far as the GPU marks decide it."""
        return tuple(self._health(d) for d in resource.devices)

    def mark(self, unit: Unit, reason: str | None) -> bool:
        """Mark a GPU (and everything on it) or one MIG instance unhealthy (reason) or healthy (None).

        Returns True if anything changed.
        """
        with self._cond:
            if reason is None:
                if unit not in self._unhealthy:
                    return False
                del self._unhealthy[unit]
            else:
                if self._unhealthy.get(unit) == reason:
                    return False
                self._unhealthy[unit] = reason
            for state in self._states.values():
                if any(_covers(unit, d.unit) for d in state.resource.devices):
                    state.version += 1
            self._cond.notify_all()
        if self.on_health_change is not None:
            self.on_health_change()
        return True

    def set_resource_down(self, name: str, reason: str | None) -> bool:
        """Make every replica of a resource unhealthy (reason) or take that back (None); True if that changed.

        For what serves a whole resource besides its GPUs: its MPS control daemon. GPU marks are untouched,
        so a device is healthy only when both its GPU and its resource are."""
        with self._cond:
            if self._down.get(name) == reason:
                return False
            if reason is None:
                del self._down[name]
            else:
                self._down[name] = reason
            state = self._states.get(name)
            if state is not None:
                state.version += 1
            self._cond.notify_all()
        if self.on_health_change is not None:
            self.on_health_change()
        return True

    def set_unmonitored(self, gpu_uuid: str, gpu_index: int, reason: str | None) -> bool:
        """Record that a GPU cannot be watched (reason) or can be again (None); True if that changed.

        Health is untouched: "cannot monitor" is not "unhealthy". No stream wakes (kubelet's view does
        not change); `on_health_change` runs so the plugin's status shows it.
        """
        with self._cond:
            entry = (gpu_index, reason) if reason is not None else None
            if self._unmonitored.get(gpu_uuid) == entry:
                return False
            if entry is None:
                del self._unmonitored[gpu_uuid]
            else:
                self._unmonitored[gpu_uuid] = entry
        if self.on_health_change is not None:
            self.on_health_change()
        return True

    def down_reason(self, name: str) -> str | None:
        """Why every device of the resource is unhealthy (set_resource_down), or None."""
        with self._cond:
            return self._down.get(name)

    def unmonitored(self) -> dict[str, tuple[int, str]]:
        """GPU UUID → (index, why it is not watched)."""
        with self._cond:
            return dict(self._unmonitored)

    def close(self) -> None:
        """Wake every waiter for good: the plugin is stopping."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake waiters so they can re-check their own stop condition (a stream was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    # -- readers --------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def resources(self) -> tuple[Resource, ...]:
        with self._cond:
            return tuple(s.resource for s in self._states.values())

    def resource(self, name: str) -> Resource | None:
        with self._cond:
            state = self._states.get(name)
            return state.resource if state else None

    def unhealthy_units(self) -> dict[Unit, str]:
        with self._cond:
            return dict(self._unhealthy)

    def health_of(self, device: PluginDevice, resource: str | None = None) -> DeviceHealth:
        """The device's health; with `resource`, as a device of that resource (its down mark counts)."""
        with self._cond:
            return self._health(device, resource)

    def allocation_view(self, name: str) -> tuple[Resource | None, Callable[[PluginDevice], DeviceHealth]]:
        """The resource and the health of its devices as of one moment, for one Allocate: one lock for the
        whole call, where a `health_of` per device took it once per device (issue 24). The marks are
        copied (almost always none), so the health callable reads them without the lock."""
        with self._cond:
            state = self._states.get(name)
            unhealthy = dict(self._unhealthy)
            down = self._down.get(name)
        if not unhealthy and down is None:
            return (state.resource if state else None), _healthy
        return (state.resource if state else None), lambda d: _health_under(unhealthy, down, d)

    def snapshot(self, name: str) -> tuple[int, tuple[DeviceHealth, ...]]:
        """The resource's version and every device with its health (empty if the resource is gone)."""
        with self._cond:
            state = self._states.get(name)
            if state is None:
                return -1, ()
            return state.version, tuple(self._health(d, name) for d in state.resource.devices)

    def wait_for_change(self, name: str, seen: int, stop: Callable[[], bool] | None = None) -> bool:
        """Block until the resource's version differs from `seen`; False once closed or `stop()` is true.

        Whoever makes `stop()` true must call `wake()` after, so the waiter looks again.
        """
        with self._cond:
            while True:
                if self._closed or (stop is not None and stop()):
                    return False
                state = self._states.get(name)
                current = state.version if state else -1
                if current != seen:
                    return True
                self._cond.wait()

    def _health(self, device: PluginDevice, resource: str | None = None) -> DeviceHealth:
        return _health_under(
            self._unhealthy, self._down.get(resource) if resource is not None else None, device
        )


def _health_under(unhealthy: Mapping[Unit, str], down: str | None, device: PluginDevice) -> DeviceHealth:
    """The device's health under these GPU marks and its resource's down reason (None: not down)."""
    unit = device.unit
    reason = unhealthy.get(device.gpu_unit)
    if reason is None and unit.instance is not None:
        reason = unhealthy.get(unit)
    if reason is None and device.replica is not None:
        # The replicas are what a resource-wide reason (its MPS daemon) serves; GPUs an entry leaves
        # unshared in the same resource do not depend on it.
        reason = down
    return DeviceHealth(device, reason is None, reason)


def _healthy(device: PluginDevice) -> DeviceHealth:
    """The health of any device while no GPU is marked and the resource is not down."""
    return DeviceHealth(device, True, None)


def _mig_units(resources: Iterable[Resource]) -> dict[Unit, str]:
    """Each served MIG instance's unit and its MIG UUID."""
    return {d.unit: d.uuid for r in resources for d in r.devices if d.unit.instance is not None and d.uuid}


def _covers(marked: Unit, device_unit: Unit) -> bool:
    """A mark on a whole GPU covers every device on it; a mark on a MIG instance covers only that one."""
    if marked.gpu_index != device_unit.gpu_index:
        return False
    return marked.instance is None or marked.instance == device_unit.instance
