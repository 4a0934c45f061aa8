"""Allocate: check the requested device IDs, then tell the container runtime which GPUs to expose.

Pure functions over the resource's devices; the gRPC servicer turns `Refused` into a status code and
`ContainerAllocation` into the protobuf answer. What the host offers (device nodes, MIG capability
nodes) is read once at start by `read_device_nodes`, never per call: kubelet waits on Allocate.
"""

from __future__ import annotations

import logging
import posixpath
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpunode.cdi.spec import ANNOTATION_PREFIX, annotation_key
from gpunode.errors import ConfigError
from gpunode.host import Host
from gpunode.nvml.capabilities import cap_minor
from gpunode.plugin.devices import DeviceHealth, PluginDevice, Resource
from gpunode.plugin.logsafe import shown, shown_ids

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNT_DIR = "/var/run/nvidia-container-devices"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
# Control nodes every CUDA container needs besides its /dev/nvidiaN, when they exist on the host.
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
IMEX_CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
IMEX_CHANNELS = "NVIDIA_IMEX_CHANNELS"
IMEX_CDI_KIND = "nvidia.com/imex-channel"  # NVIDIA's CDI class for the channels
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
SHM = "/dev/shm"  # noqa: S108 (the container's shared-memory mount point, not a temporary file)


class Refused(Exception):
    """A request kubelet must not get devices for; `code` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class DeviceNodes:
    """Device nodes under the driver root, found once at start."""

    driver_root: str = "/"
    control: tuple[str, ...] = ()  # container paths of the control nodes that exist
    mig_caps: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # MIG UUID -> cap device paths
    imex_channels: tuple[str, ...] = ()  # IDs of the configured IMEX channels whose device nodes exist
    imex_cdi: tuple[str, ...] = ()  # their CDI names (nvidia.com/imex-channel=0) that a CDI spec defines

    def host_path(self, container_path: str) -> str:
        if self.driver_root == "/":
            return container_path
        return posixpath.join(self.driver_root, container_path.lstrip("/"))


@dataclass(frozen=True)
class MpsMounts:
    """What a container of an MPS-shared resource needs to reach its control daemon and server: the pipe
    directory (named pipes, sockets) and the shared memory the daemon's servers use, both on the host."""

    pipe_dir: str  # host path, <mps-root>/<resource>/pipe
    shm_dir: str  # host path, the daemon's own /dev/shm (<mps-root>/<resource>/shm)
    container_pipe_dir: str  # where the container sees the pipe directory (NVIDIA's /mps/<resource>/pipe)
    active_thread_percentage: int = 0  # the client's share, as the daemon's default (0: not said)


@dataclass(frozen=True)
class AllocateSettings:
    device_list_strategy: tuple[str, ...] = ("envvar",)
    pass_device_specs: bool = False
    cdi_kind: str = "nvidia.com/gpu"
    fail_requests_greater_than_one: bool = False
    nodes: DeviceNodes = field(default_factory=DeviceNodes)
    # NVIDIA_GDS / NVIDIA_MOFED / NVIDIA_GDRCOPY=enabled: every container gets them, whatever the strategy
    extra_envs: Mapping[str, str] = field(default_factory=dict)
    annotation_prefix: str = ANNOTATION_PREFIX
    # Resources shared through MPS, by name: their containers get the daemon's pipe directory and shm.
    mps: Mapping[str, MpsMounts] = field(default_factory=dict)


@dataclass(frozen=True)
class ContainerAllocation:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (container path, host path, read only)
    devices: tuple[tuple[str, str, str], ...] = ()  # (container path, host path, permissions)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


def allocate(
    resource: Resource,
    containers: Sequence[Sequence[str]],
    health: Callable[[PluginDevice], DeviceHealth],
    settings: AllocateSettings,
) -> list[ContainerAllocation]:
    """One answer per container, or Refused naming the first bad ID (nothing is half-allocated).

    O(number of IDs) whatever the request holds; more IDs than the resource has devices is refused before
    any is looked at (kubelet never sends that).
    """
    known = resource.by_id()
    total = sum(map(len, containers))
    if total > len(known):
        raise Refused(
            "INVALID_ARGUMENT",
            f"Allocate names {total} device IDs, but {resource.name} has only {len(known)} device"
            f"{'s' if len(known) != 1 else ''}",
        )
    answers: list[ContainerAllocation] = []
    for ids in containers:
        devices = _check(resource, known, ids, health, settings)
        answers.append(_answer(devices, settings, settings.mps.get(resource.name)))
    return answers


def _check(
    resource: Resource,
    known: Mapping[str, PluginDevice],
    ids: Sequence[str],
    health: Callable[[PluginDevice], DeviceHealth],
    settings: AllocateSettings,
) -> list[PluginDevice]:
    if not ids:
        raise Refused("INVALID_ARGUMENT", f"Allocate for {resource.name} named no device IDs")
    if len(set(ids)) != len(ids):
        # One pass (Counter), not a count() per ID: a request may name thousands.
        dupes = sorted(i for i, n in Counter(ids).items() if n > 1)
        raise Refused("INVALID_ARGUMENT", f"device ID {shown_ids(dupes)} requested more than once")
    # Only replicas are limited: GPUs an entry's `devices` leaves whole may be asked for together, as
    # NVIDIA's plugin allows (it refuses only requests that name a replica).
    replica = len(ids) > 1 and any((d := known.get(i)) is not None and d.replica is not None for i in ids)
    if resource.sharing == "mps" and replica:
        # A replica is a fixed share of one GPU (threads, memory) set by its daemon: two would still get one
        # share while kubelet counts two (NVIDIA's plugin refuses these too).
        raise Refused(
            "INVALID_ARGUMENT",
            f"request for {len(ids)} {resource.name} refused: the GPUs are shared through MPS, and a "
            "container gets one replica (a fixed share of one GPU); ask for 1",
        )
    if resource.replicas > 1 and settings.fail_requests_greater_than_one and replica:
        raise Refused(
            "INVALID_ARGUMENT",
            f"request for {len(ids)} {resource.name} refused: the GPUs are time-sliced and "
            "fail-requests-greater-than-one is set, so a container may ask for at most 1",
        )
    devices: list[PluginDevice] = []
    for device_id in ids:
        device = known.get(device_id)
        if device is None:
            raise Refused(
                "INVALID_ARGUMENT",
                f"unknown device ID '{shown(device_id)}' for resource {resource.name} "
                f"({len(known)} device{'s' if len(known) != 1 else ''} served)",
            )
        state = health(device)
        if not state.healthy:
            raise Refused("FAILED_PRECONDITION", f"device {device_id} is unhealthy: {state.reason}")
        devices.append(device)
    return devices


def _answer(
    devices: list[PluginDevice], settings: AllocateSettings, mps: MpsMounts | None = None
) -> ContainerAllocation:
    # Replicas of one GPU are one device to the runtime: expose each physical device once, in order.
    visible = (
        [devices[0].visible_id] if len(devices) == 1 else list(dict.fromkeys(d.visible_id for d in devices))
    )
    envs: dict[str, str] = dict(settings.extra_envs)
    mounts: list[tuple[str, str, bool]] = []
    annotations: dict[str, str] = {}
    cdi: list[str] = []
    channels = settings.nodes.imex_channels
    for strategy in settings.device_list_strategy:
        if strategy == "envvar":
            envs[VISIBLE_DEVICES] = ",".join(visible)
            # As NVIDIA's plugin does: the channels with the envvar strategy, for the runtime to inject.
            if channels:
                envs[IMEX_CHANNELS] = ",".join(channels)
        elif strategy == "volume-mounts":
            # nvidia-container-runtime reads the IDs from these mount points when its config says
            # accept-nvidia-visible-devices-as-volume-mounts = true (unprivileged pods cannot fake it).
            envs[VISIBLE_DEVICES] = VOLUME_MOUNT_DIR
            mounts.extend((f"{VOLUME_MOUNT_DIR}/{v}", "/dev/null", True) for v in visible)
            mounts.extend((f"{VOLUME_MOUNT_DIR}/imex/{c}", "/dev/null", True) for c in channels)
        elif strategy == "cdi-cri":
            cdi.extend(f"{settings.cdi_kind}={v}" for v in visible)
            cdi.extend(settings.nodes.imex_cdi)
        elif strategy == "cdi-annotations":
            for v in visible:
                # The CDI rules' key (prefix, `/` replaced, at most 63 characters after the prefix): a key
                # the runtime's CDI library refuses would fail the container, not just lose the device.
                key = annotation_key("gpunode", v)
                # cdiAnnotationPrefix: NVIDIA's plugin swaps the prefix of the keys the CDI rules made.
                key = settings.annotation_prefix + key.removeprefix(ANNOTATION_PREFIX)
                annotations[key] = f"{settings.cdi_kind}={v}"
            for name in settings.nodes.imex_cdi:
                key = annotation_key("gpunode", name.rpartition("/")[2].replace("=", "-"))
                annotations[settings.annotation_prefix + key.removeprefix(ANNOTATION_PREFIX)] = name
    specs: list[tuple[str, str, str]] = []
    if settings.pass_device_specs:
        nodes = settings.nodes
        wanted = list(nodes.control)
        for device in devices:
            if device.minor is not None:
                wanted.append(f"/dev/nvidia{device.minor}")
            if device.mig is not None:
                wanted.extend(nodes.mig_caps.get(device.uuid, ()))
        wanted.extend(f"{IMEX_CHANNEL_DIR}/channel{c}" for c in channels)
        specs = [(p, nodes.host_path(p), "rw") for p in dict.fromkeys(wanted)]
    if mps is not None and any(d.replica is not None for d in devices):
        # Only for replicas (an MPS entry's `devices` may leave GPUs unshared in the resource), whatever the
        # device-list strategy (the runtime still exposes the GPU): the client's CUDA finds the
        # control daemon through the pipe directory, and talks to its server through shared memory, which
        # must be the daemon's own /dev/shm, not the pod's.
        envs[MPS_PIPE_ENV] = mps.container_pipe_dir
        # The daemon's defaults apply already; the thread share is said in the environment too, so the
        # workload (and whoever debugs it) sees it. The memory limit is not: it names device ordinals as
        # the MPS server numbers them, which need not be the container's.
        if mps.active_thread_percentage:
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps.active_thread_percentage)
        mounts.append((mps.container_pipe_dir, mps.pipe_dir, False))
        mounts.append((SHM, mps.shm_dir, False))
    return ContainerAllocation(envs, tuple(mounts), tuple(specs), annotations, tuple(cdi))


def read_device_nodes(
    host: Host,
    driver_root: str,
    resources: Sequence[Resource],
    *,
    imex_channel_ids: Sequence[int] = (),
    imex_required: bool = False,
) -> DeviceNodes:
    """Which control nodes exist under the driver (or device) root, each MIG instance's capability nodes,
    and which configured IMEX channels exist.

    An IMEX channel that does not exist is skipped with a warning, or, with imex-required, refused
    (ConfigError), as NVIDIA's plugin does (internal/imex GetChannels)."""
    probe = DeviceNodes(driver_root=driver_root)
    control = tuple(p for p in CONTROL_DEVICES if host.exists(probe.host_path(p)))
    caps: dict[str, tuple[str, ...]] = {}
    for resource in resources:
        for device in resource.devices:
            mig = device.mig
            if mig is None or device.minor is None or device.uuid in caps:
                continue
            if mig.gpu_instance_id is None or mig.compute_instance_id is None:
                continue
            # The driver publishes each instance's access capability as a minor of /dev/nvidia-caps.
            base = f"/proc/driver/nvidia/capabilities/gpu{device.minor}/mig/gi{mig.gpu_instance_id}"
            found = []
            for access in (f"{base}/access", f"{base}/ci{mig.compute_instance_id}/access"):
                minor = cap_minor(host, probe.host_path(access))
                if minor is not None:
                    found.append(f"/dev/nvidia-caps/nvidia-cap{minor}")
            caps[device.uuid] = tuple(found)
    channels: list[str] = []
    for channel in imex_channel_ids:
        path = f"{IMEX_CHANNEL_DIR}/channel{channel}"
        if host.is_char_device(probe.host_path(path)):
            channels.append(str(channel))
            continue
        message = f"IMEX channel {probe.host_path(path)} does not exist (or is not a character device)"
        if imex_required:
            raise ConfigError(
                message + " and imex.required is set",
                "create the channel (the nvidia driver's NVreg_CreateImexChannel0=1, or mknod with the "
                "nvidia-caps-imex-channels major of /proc/devices), or set imex.required = false",
            )
        logging.getLogger("gpunode.plugin").warning("%s; containers get no IMEX channel", message)
    return DeviceNodes(driver_root=driver_root, control=control, mig_caps=caps, imex_channels=tuple(channels))
