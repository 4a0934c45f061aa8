"""Doctor checks of the kubelet API that serves the node's GPUs (device plugin, DRA, both or neither), of the
DRA driver registered with kubelet, its ResourceSlices, and CDI in the runtime for DRA's CDI ids
(../shared/specs/dra-kubelet-plugin.md sections 1, 5 and 6).

Files are read under the Host's root. A registration socket is dialled (GetInfo, kubelet's 1 s deadline)
only where the Host's commands reach its root: under `--root DIR` with this machine's programs, a socket
in DIR belongs to another system (or to none), so it is not asked and the findings say "not asked: --root".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpunode import paths
from gpunode.doctor.context import Context, simulated_tag
from gpunode.doctor.model import Finding, Status
from gpunode.dra import DEFAULT_DRIVER
from gpunode.errors import GpunodeError, NotFound, NvmlError
from gpunode.host import Host

REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR = "/var/lib/kubelet/plugins"
# gpu.nvidia.com (gpunode.dra.DEFAULT_DRIVER): the name NVIDIA's driver registers, and gpunode's by
# default, so that DeviceClasses and claims written for NVIDIA's select the same GPUs. Spelled here so that
# doctor imports nothing of the DRA driver (and its NVML and health modules) on a node without one.
GPU_RESOURCE = "nvidia.com/gpu"
# kubelet gives GetInfo 1 s (pkg/kubelet/pluginmanager): a driver slower than that is not registered.
GETINFO_TIMEOUT = 1.0
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
# The checkpoint NVIDIA's driver keeps in its plugin directory; gpunode's is gpunode-checkpoint.json
# (gpunode.dra.checkpoint.NAME), beside it and never that file.
NVIDIA_CHECKPOINT = "checkpoint.json"
GPUNODE_CHECKPOINT = "gpunode-checkpoint.json"
# How many registration sockets doctor asks at most: a node has a handful (CSI drivers, DRA drivers).
MAX_ASKED = 32
API_TIMEOUT = (3.0, 5.0)  # a diagnosis must not hang on an unreachable API server (as node.capacity)


def reg_socket(driver: str) -> str:
    return f"{REGISTRY_DIR}/{driver}-reg.sock"


def plugin_dir(driver: str) -> str:
    return f"{PLUGINS_DIR}/{driver}"


def dra_socket(driver: str) -> str:
    """Where gpunode's driver serves the DRA service (and the Go kubeletplugin library's default)."""
    return f"{plugin_dir(driver)}/dra.sock"


# -- what the node shows, from its files -------------------------------------------------------------


@dataclass(frozen=True)
class Sides:
    """Which kubelet APIs advertise GPUs here, from the sockets (and gpunode's plugin status file)."""

    device_plugin: tuple[str, ...]  # sockets in the device-plugins directory serving GPUs
    registered: tuple[str, ...]  # resources gpunode's plugin status file says are registered
    dra: str | None  # the driver's registration socket, when present


def dra_in_use(host: Host, driver: str = DEFAULT_DRIVER) -> bool:
    """A DRA driver for `driver` registers here (or left its sockets): the DRA checks apply."""
    return host.is_socket(reg_socket(driver)) or host.is_socket(dra_socket(driver))


def read_sides(host: Host, driver: str = DEFAULT_DRIVER) -> Sides:
    try:
        names = host.listdir(paths.DEVICE_PLUGIN_DIR)
    except GpunodeError:
        names = []
    # gpunode's sockets are gpunode-<resource>.sock; NVIDIA's plugin names its own nvidia-<resource>.sock
    # (nvidia-gpu.sock; nvidia-mig-<profile>.sock with MIG's mixed strategy). kubelet.sock is kubelet's.
    sockets = tuple(
        f"{paths.DEVICE_PLUGIN_DIR}/{name}"
        for name in sorted(names)
        if name.startswith((paths.PLUGIN_SOCKET_PREFIX, "nvidia-"))
        and name.endswith(".sock")
        and host.is_socket(f"{paths.DEVICE_PLUGIN_DIR}/{name}")
    )
    reg = reg_socket(driver)
    return Sides(sockets, _registered_resources(host), reg if host.is_socket(reg) else None)


def _registered_resources(host: Host) -> tuple[str, ...]:
    try:
        document = json.loads(host.read_text_if_exists(paths.PLUGIN_STATUS_FILE) or "{}")
    except (GpunodeError, ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        return ()
    resources = document.get("resources") if isinstance(document, dict) else None
    return tuple(
        str(r.get("name"))
        for r in resources or []
        if isinstance(r, dict) and r.get("registered") is True and isinstance(r.get("name"), str)
    )


# -- kubelet.api -------------------------------------------------------------------------------------


def check_kubelet_api(ctx: Context) -> Iterable[Finding]:
    if not ctx.has_kubelet:
        yield Finding("kubelet.api", Status.SKIP, "which kubelet API serves the GPUs not checked: no kubelet")
        return
    sides = read_sides(ctx.host)
    plugin = ", ".join(sides.device_plugin)
    registered = (
        f"\ngpunode's plugin status file says registered: {', '.join(sides.registered)}"
        if sides.registered
        else ""
    )
    if sides.device_plugin and sides.dra:
        yield Finding(
            "kubelet.api",
            Status.FAIL,
            "both kubelet APIs advertise this node's GPUs: a device plugin and the DRA driver "
            f"{DEFAULT_DRIVER}",
            detail=f"device plugin: {plugin}{registered}\nDRA: {sides.dra}\n"
            "Each side hands out the same GPUs without knowing of the other, so one GPU can go to a pod and "
            "to a claim at once. And while the node's allocatable "
            f"{GPU_RESOURCE} is above 0 the scheduler serves {GPU_RESOURCE} from the device plugin, never "
            "through DRA (DRAExtendedResource): claims for it through the DeviceClass's extended resource "
            "never schedule here.",
            fix="keep one: for DRA stop the device plugin (`gpunode plugin uninstall`, or remove NVIDIA's "
            "k8s-device-plugin DaemonSet); for the device plugin stop the DRA driver whose socket is "
            f"{sides.dra} (NVIDIA's: `helm uninstall` its nvidia-dra-driver-gpu release)",
        )
    elif sides.device_plugin:
        yield Finding(
            "kubelet.api",
            Status.OK,
            f"the device plugin API serves the GPUs ({plugin})",
            detail=registered.strip() or None,
        )
    elif sides.dra:
        yield Finding(
            "kubelet.api",
            Status.OK,
            f"DRA serves the GPUs: driver {DEFAULT_DRIVER} ({sides.dra})",
            detail=f"{GPU_RESOURCE} is served through DRA only where the node's allocatable {GPU_RESOURCE} "
            "is 0 or absent: no device plugin advertises it here.",
        )
    else:
        yield Finding(
            "kubelet.api",
            Status.WARN,
            "neither kubelet API serves the GPUs: no GPU device plugin socket in "
            f"{paths.DEVICE_PLUGIN_DIR} and no {DEFAULT_DRIVER} registration socket in {REGISTRY_DIR}",
            fix="install gpunode's device plugin (`gpunode plugin install`), or deploy a DRA driver for "
            f"{DEFAULT_DRIVER}; not both",
        )


# -- dra.driver, dra.duplicate ---------------------------------------------------------------------


@dataclass(frozen=True)
class Info:
    """A registration socket's GetInfo answer."""

    type: str
    name: str
    endpoint: str
    versions: tuple[str, ...]


@dataclass(frozen=True)
class Asked:
    socket: str
    info: Info | None
    error: str | None  # why GetInfo gave no answer


def get_info(host: Host, socket: str, timeout: float = GETINFO_TIMEOUT) -> Asked:
    """GetInfo of the registration socket `socket` (a host path), as kubelet asks it."""
    import grpc

    from gpunode.dra.api import pluginregistration_pb2 as pb
    from gpunode.dra.api import pluginregistration_pb2_grpc
    from gpunode.plugin.logsafe import shown

    stubs: Any = pluginregistration_pb2_grpc  # generated, untyped
    try:
        with grpc.insecure_channel(f"unix:{host.path(socket)}") as channel:
            reply = stubs.RegistrationStub(channel).GetInfo(pb.InfoRequest(), timeout=timeout)
    except grpc.RpcError as err:
        code = err.code() if isinstance(err, grpc.Call) else None
        detail = err.details() if isinstance(err, grpc.Call) else str(err)
        # Whatever answers on the socket wrote it: escaped and bounded before it is shown.
        return Asked(socket, None, f"{code.name if code else 'error'}: {shown(detail or '', limit=200)}")
    except (GpunodeError, OSError, ValueError) as err:
        return Asked(socket, None, str(err))
    return Asked(
        socket,
        Info(
            shown(reply.type, limit=64),
            shown(reply.name, limit=64),
            shown(reply.endpoint, limit=200),
            tuple(shown(v, limit=64) for v in reply.supported_versions),
        ),
        None,
    )


def _registry_sockets(host: Host) -> list[str]:
    """The sockets kubelet's plugin watcher would find: not hidden, sockets only."""
    try:
        names = host.listdir(REGISTRY_DIR)
    except GpunodeError:
        return []
    found = [
        f"{REGISTRY_DIR}/{name}"
        for name in sorted(names)
        if not name.startswith(".") and host.is_socket(f"{REGISTRY_DIR}/{name}")
    ]
    return found[:MAX_ASKED]


def _ask_all(host: Host, sockets: Sequence[str]) -> dict[str, Asked]:
    """GetInfo of every socket at once: one that hangs costs its 1 s once, not once per socket."""
    from concurrent.futures import ThreadPoolExecutor

    if not sockets:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(sockets))) as pool:
        return dict(zip(sockets, pool.map(lambda s: get_info(host, s), sockets), strict=True))


def _endpoint(socket: str, info: Info) -> str:
    return info.endpoint or socket  # empty: the registration socket serves DRA itself


def check_dra_driver(ctx: Context) -> Iterable[Finding]:
    host = ctx.host
    driver = DEFAULT_DRIVER
    reg, endpoint = reg_socket(driver), dra_socket(driver)
    ours_ckpt = f"{plugin_dir(driver)}/{GPUNODE_CHECKPOINT}"
    nvidia_ckpt = f"{plugin_dir(driver)}/{NVIDIA_CHECKPOINT}"
    if not ctx.has_kubelet:
        yield Finding("dra.driver", Status.SKIP, "DRA driver not checked: no kubelet")
        return
    if not dra_in_use(host, driver):
        yield Finding(
            "dra.driver",
            Status.SKIP,
            f"no DRA driver {driver} on this node (no {reg}, no {endpoint})",
        )
        return
    yield from _checkpoints(host, ours_ckpt, nvidia_ckpt)
    if host.offline:
        yield _driver_by_files(host, driver)
        return
    asked = _ask_all(host, _registry_sockets(host))
    yield from _driver_by_getinfo(host, driver, asked.get(reg))
    yield from _second_driver(host, driver, asked)


def _checkpoints(host: Host, ours: str, nvidia: str) -> Iterator[Finding]:
    if host.exists(ours) and host.exists(nvidia):
        yield Finding(
            "dra.duplicate",
            Status.FAIL,
            f"two {DEFAULT_DRIVER} drivers use this node: NVIDIA's checkpoint {nvidia} is beside gpunode's "
            f"{ours}",
            detail="Two drivers of one name each prepare claims for the same GPUs; kubelet calls whichever "
            "registered last, and the other's prepared claims are never unprepared.",
            fix="remove NVIDIA's DRA driver from this node (`helm uninstall` its nvidia-dra-driver-gpu "
            f"release, or exclude the node from its DaemonSet); once it is gone, move {nvidia} aside",
        )


def _driver_by_files(host: Host, driver: str) -> Finding:
    """Under --root: what the files say; no socket is dialled."""
    reg, endpoint = reg_socket(driver), dra_socket(driver)
    if not host.is_socket(reg):
        return Finding(
            "dra.driver",
            Status.FAIL,
            f"{endpoint} is there but {reg} is missing: kubelet does not know the driver",
            detail="GetInfo not asked: --root",
            fix="restart the DRA driver (it creates its registration socket after serving DRA)",
        )
    if not host.is_socket(endpoint):
        return Finding(
            "dra.driver",
            Status.WARN,
            f"{reg} is there but {endpoint} is not: the registration may name another endpoint",
            detail="GetInfo not asked: --root (it names the endpoint kubelet dials)",
            fix="run `gpunode doctor` on the node itself: it asks the socket",
        )
    return Finding(
        "dra.driver",
        Status.OK,
        f"DRA driver {driver}: {reg} and {endpoint} present (GetInfo not asked: --root)",
    )


def _driver_by_getinfo(host: Host, driver: str, asked: Asked | None) -> Iterator[Finding]:
    reg = reg_socket(driver)
    restart = "restart the DRA driver; if none runs here, its socket is stale: remove " + reg
    if asked is None:  # no registration socket: only the DRA socket (or a checkpoint) was left
        yield Finding(
            "dra.driver",
            Status.FAIL,
            f"no {reg}: kubelet does not know the DRA driver {driver}",
            detail=f"{dra_socket(driver)} is there without a registration socket: the driver stopped, or "
            "never got as far as registering.",
            fix="restart the DRA driver and read its log",
        )
        return
    if asked.info is None:
        yield Finding(
            "dra.driver",
            Status.FAIL,
            f"{reg} does not answer GetInfo within {GETINFO_TIMEOUT:g} s: kubelet cannot register the driver",
            detail=asked.error,
            fix=restart,
        )
        return
    info = asked.info
    problems = []
    if info.type != "DRAPlugin":
        problems.append(f"its type is {info.type!r}, not 'DRAPlugin'")
    if info.name != driver:
        problems.append(f"it registers as {info.name!r}, not {driver!r}")
    if not any(v in DRA_SERVICES for v in info.versions):
        problems.append(
            f"it offers {', '.join(info.versions) or 'no version'}: kubelet needs {' or '.join(DRA_SERVICES)}"
        )
    endpoint = _endpoint(asked.socket, info)
    if not endpoint.startswith("/") or not host.is_socket(endpoint):
        problems.append(f"its endpoint {endpoint} is not a socket: kubelet cannot call Prepare")
    if problems:
        yield Finding(
            "dra.driver",
            Status.FAIL,
            f"{reg} answers, but kubelet refuses it: {problems[0]}",
            detail="\n".join(problems[1:]) or None,
            fix=restart,
        )
        return
    whose = ""
    if host.exists(f"{plugin_dir(driver)}/{GPUNODE_CHECKPOINT}"):
        whose = " (gpunode's checkpoint is there)"
    elif host.exists(f"{plugin_dir(driver)}/{NVIDIA_CHECKPOINT}"):
        whose = " (NVIDIA's checkpoint is there)"
    yield Finding(
        "dra.driver",
        Status.OK,
        f"DRA driver {driver} registered: GetInfo answers, endpoint {endpoint}{whose}",
        detail=f"services: {', '.join(info.versions)}",
    )


def _second_driver(host: Host, driver: str, asked: Mapping[str, Asked]) -> Iterator[Finding]:
    """Another registration of `driver`: another socket answering with its name, or the driver's own
    socket naming an endpoint other than gpunode's while gpunode's DRA socket is served too."""
    ours = dra_socket(driver)
    same = {
        a.socket: _endpoint(a.socket, a.info)
        for a in asked.values()
        if a.info is not None and a.info.name == driver
    }
    endpoints = set(same.values())
    if len(endpoints) > 1 or (endpoints and ours not in endpoints and host.is_socket(ours)):
        lines = [f"{socket} → {endpoint}" for socket, endpoint in sorted(same.items())]
        if ours not in endpoints:
            lines.append(f"{ours} (gpunode's DRA socket) is served but registered by none")
        yield Finding(
            "dra.duplicate",
            Status.FAIL,
            f"two DRA drivers named {driver} on this node: {len(endpoints | {ours})} endpoints",
            detail="\n".join(lines)
            + "\nkubelet calls only the newest registered instance; the other's claims are never "
            "prepared or unprepared there, and both publish the same GPUs.",
            fix="remove the other driver (NVIDIA's: `helm uninstall` its nvidia-dra-driver-gpu release, or "
            "exclude the node from its DaemonSet)",
        )


# -- dra.slices --------------------------------------------------------------------------------------


def check_dra_slices(ctx: Context) -> Iterable[Finding]:
    host = ctx.host
    driver = DEFAULT_DRIVER
    if not ctx.has_kubelet or not dra_in_use(host, driver):
        yield Finding("dra.slices", Status.SKIP, f"ResourceSlices not checked: no DRA driver {driver} here")
        return
    if ctx.simulated:
        # The API holds this node's real GPUs: compared with simulated ones they would read as stale.
        yield Finding(
            "dra.slices",
            Status.SKIP,
            f"ResourceSlices not compared: the GPUs are simulated {simulated_tag(ctx.simulated)}",
        )
        return
    from gpunode.kube.credentials import resolve_credentials

    try:
        credentials = resolve_credentials(host)
    except NotFound:
        yield Finding(
            "dra.slices",
            Status.SKIP,
            "ResourceSlices not checked: no Kubernetes API credentials on this node",
            fix="to include it: KUBECONFIG=/path/to/kubeconfig gpunode doctor",
        )
        return
    except GpunodeError as exc:
        yield Finding(
            "dra.slices", Status.WARN, "cannot use the Kubernetes API credentials", exc.message, exc.fix
        )
        return
    from gpunode import kubelet
    from gpunode.errors import UsageError
    from gpunode.kube.client import KubeClient, RetryPolicy, Timeouts

    try:
        node, _ = kubelet.node_name(host)
    except UsageError as exc:
        yield Finding(
            "dra.slices",
            Status.WARN,
            f"ResourceSlices not checked: {exc.message}",
            fix="name the node: NODE_NAME=<name shown by `kubectl get nodes`> gpunode doctor",
        )
        return
    try:
        with KubeClient(
            credentials,
            timeouts=Timeouts(*API_TIMEOUT),
            retry=RetryPolicy(attempts=1, conflict_attempts=1),
            env=host.env,
            host=host,
        ) as client:
            slices = client.list_resource_slices(node, driver)
    except GpunodeError as exc:
        yield Finding(
            "dra.slices",
            Status.WARN,
            f"cannot list the ResourceSlices of node {node} from the Kubernetes API",
            detail=f"{exc.message} (credentials: {credentials.source})",
            fix=exc.fix,
        )
        return
    yield _judge_slices(ctx, node, driver, slices)


def _judge_slices(ctx: Context, node: str, driver: str, slices: Sequence[Mapping[str, Any]]) -> Finding:
    restart = "restart the DRA driver (it publishes the node's slices when it starts) and read its log"
    if not slices:
        return Finding(
            "dra.slices",
            Status.FAIL,
            f"no ResourceSlices of driver {driver} for node {node}: no claim can be allocated here",
            detail="kubelet deletes the node's slices when it starts, and a driver's 30 s after losing its "
            "connection; a running driver publishes them again.",
            fix=restart,
        )
    pools: dict[str, list[Mapping[str, Any]]] = {}
    for s in slices:
        pools.setdefault(str(_pool(s).get("name")), []).append(s)
    if len(pools) > 1:
        return Finding(
            "dra.slices",
            Status.FAIL,
            f"node {node} has {len(pools)} pools of driver {driver}: {', '.join(sorted(pools))}",
            detail="One driver publishes one pool named after the node; another pool is another "
            "publisher, and the same GPUs are offered twice.",
            fix="see dra.duplicate: remove the other driver; its slices go with it",
        )
    (name, members), *_ = pools.items()
    generation = max(_int(_pool(s).get("generation")) for s in members)
    current = [s for s in members if _int(_pool(s).get("generation")) == generation]
    wanted = _int(_pool(current[0]).get("resourceSliceCount"))
    if len(current) != wanted:
        return Finding(
            "dra.slices",
            Status.FAIL,
            f"pool {name} (generation {generation}) is incomplete: {len(current)} of {wanted} slices",
            detail="The scheduler allocates nothing from an incomplete pool.",
            fix=restart,
        )
    names = [str(d.get("name")) for s in current for d in _devices(s)]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        return Finding(
            "dra.slices",
            Status.FAIL,
            f"pool {name} names a device twice: {', '.join(duplicated)}",
            detail="The scheduler allocates nothing from a pool with duplicate device names.",
            fix=restart,
        )
    summary = f"pool {name}: {len(current)} slice(s), generation {generation}, {len(names)} device(s)"
    inventory = ctx.inventory()
    if isinstance(inventory, NvmlError):
        return Finding("dra.slices", Status.OK, f"{summary} (not compared with the GPUs: no NVML)")
    from gpunode.dra.slices import SliceSettings, build_slices

    # Device names do not depend on health (a fault is a taint) nor on the generation.
    published = build_slices(inventory, {}, SliceSettings(node, driver), 0)
    expected = {str(d["name"]) for s in published for d in _devices(s)}
    missing, gone = sorted(expected - set(names)), sorted(set(names) - expected)
    if missing or gone:
        detail = []
        if missing:
            detail.append(f"not published: {', '.join(missing)}")
        if gone:
            detail.append(f"published, but not on the node now: {', '.join(gone)}")
        return Finding(
            "dra.slices",
            Status.FAIL,
            f"pool {name} is not current: its devices are not the node's GPUs now",
            detail="\n".join(detail) + "\nTypical after a MIG change or a GPU lost while the driver did not "
            "publish; a claim on a device that is gone fails to prepare.",
            fix=restart,
        )
    return Finding("dra.slices", Status.OK, summary + ", as the node's GPUs are now")


def _pool(s: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = s.get("spec")
    pool = spec.get("pool") if isinstance(spec, Mapping) else None
    return pool if isinstance(pool, Mapping) else {}


def _devices(s: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = s.get("spec")
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    return [d for d in devices or [] if isinstance(d, Mapping)]


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# -- runtime.cdi -------------------------------------------------------------------------------------

# Where a DRA driver writes each claim's CDI spec (gpunode's and NVIDIA's): the runtime must read it.
DYNAMIC_CDI_DIR = "/var/run/cdi"


def check_runtime_cdi(ctx: Context) -> Iterable[Finding]:
    """kubelet passes a DRA claim's devices to the runtime as CDI ids (the CRI's CDI_devices): a runtime
    that does not apply CDI starts the container without its GPUs."""
    host = ctx.host
    if not ctx.has_kubelet or not dra_in_use(host):
        yield Finding("runtime.cdi", Status.SKIP, "CDI for DRA not checked: no DRA driver here")
        return
    from gpunode.kubelet import kubelet_runtime

    try:
        runtime = kubelet_runtime(host) or "containerd"  # kubelet's default endpoint since 1.27
    except GpunodeError:
        runtime = "containerd"
    if runtime == "crio":
        yield _crio_cdi(host)
    elif runtime == "containerd":
        yield _containerd_cdi(host)
    else:
        yield Finding(
            "runtime.cdi",
            Status.WARN,
            f"kubelet uses {runtime}, which does not apply the CDI ids DRA gives",
            fix="run kubelet on containerd 1.7 or later (enable_cdi) or CRI-O",
        )


def _containerd_cdi(host: Host) -> Finding:
    from gpunode.doctor.runtime import read_runtime_state
    from gpunode.runtimes import containerd

    try:
        state = read_runtime_state(host, "containerd")
    except GpunodeError as exc:
        return Finding(
            "runtime.cdi", Status.WARN, "containerd: cannot tell whether CDI is on", exc.message, exc.fix
        )
    fix = "`gpunode configure-runtime containerd --cdi` (`--dry-run` first shows the diff)"
    # Asked as containerd's own reading asks it (under --root, the root's containerd by its path there).
    major_minor = containerd.installed_containerd_version(host)
    version = f"{major_minor[0]}.{major_minor[1]}" if major_minor else None
    if major_minor is not None and major_minor < (1, 7):
        return Finding(
            "runtime.cdi",
            Status.WARN,
            f"containerd {version} does not read the CDI ids kubelet sends for DRA claims",
            detail="The CRI's CDI_devices field is read from containerd 1.7 on; 1.6 starts the container "
            "without the claim's GPUs.",
            fix="upgrade containerd to 1.7 or later, then " + fix,
        )
    if state.cdi_enabled is True:
        return Finding("runtime.cdi", Status.OK, f"containerd: CDI is enabled ({state.config_path})")
    if state.cdi_enabled is False:
        return Finding(
            "runtime.cdi",
            Status.WARN,
            f"containerd: CDI is turned off in {state.config_path}: DRA claims' containers get no GPU",
            fix=fix,
        )
    if (major_minor is not None and major_minor[0] >= 2) or state.version == 3:
        return Finding("runtime.cdi", Status.OK, f"containerd {version or '2.x'}: CDI is on by default")
    return Finding(
        "runtime.cdi",
        Status.WARN,
        f"containerd {version or '1.x'}: enable_cdi is not set in {state.config_path}: DRA claims' "
        "containers get no GPU",
        detail="containerd before 2.0 applies the CDI ids kubelet sends only with enable_cdi = true in its "
        "CRI plugin.",
        fix=fix,
    )


def _crio_cdi(host: Host) -> Finding:
    """CRI-O always applies CDI (1.27 on); it reads the directories of crio.runtime.cdi_spec_dirs, which
    must hold the one DRA drivers write claims' specs to."""
    from gpunode.runtimes import crio
    from gpunode.runtimes.containerd import parse_toml

    try:
        merged: dict[str, Any] = {}
        for file in ([crio.CRIO_CONF] if host.is_file(crio.CRIO_CONF) else []) + crio.dropin_files(host):
            merged = crio.merge_dropin(merged, parse_toml(host.read_text(file), file))
    except GpunodeError as exc:
        return Finding(
            "runtime.cdi", Status.WARN, "crio: cannot read its configuration", exc.message, exc.fix
        )
    table = merged.get("crio")
    runtime = table.get("runtime") if isinstance(table, Mapping) else None
    dirs = runtime.get("cdi_spec_dirs") if isinstance(runtime, Mapping) else None
    if not isinstance(dirs, list):
        return Finding("runtime.cdi", Status.OK, "crio: CDI is always on, /etc/cdi and /var/run/cdi read")
    normalised = {str(d).rstrip("/").replace("/var/run/", "/run/", 1) for d in dirs}
    if DYNAMIC_CDI_DIR.replace("/var/run/", "/run/", 1) in normalised:
        shown_dirs = ", ".join(map(str, dirs))
        return Finding("runtime.cdi", Status.OK, f"crio: CDI is always on; cdi_spec_dirs: {shown_dirs}")
    return Finding(
        "runtime.cdi",
        Status.WARN,
        f"crio: cdi_spec_dirs leaves out {DYNAMIC_CDI_DIR}, where DRA drivers write each claim's CDI spec",
        detail=f"cdi_spec_dirs = {dirs}",
        fix=f'add "{DYNAMIC_CDI_DIR}" to cdi_spec_dirs in [crio.runtime], then `systemctl restart crio`',
    )
