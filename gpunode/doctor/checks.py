"""The checks `gpunode doctor` runs. Each returns Findings; none raises for what it finds on the host.

Order matters only for reading: later checks use what earlier ones learnt through the shared Context
(e.g. no NVML → the per-GPU checks are skipped with the reason).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

from gpunode import paths
from gpunode.distribution import SUPPORTED_TEXT, read_distribution
from gpunode.doctor.cdi import check_cdi
from gpunode.doctor.model import Finding, Status
from gpunode.errors import CommandFailed, GpunodeError, NotFound, NvmlError
from gpunode.host import Host
from gpunode.kubelet import kubelet_runtime
from gpunode.nvml.model import Gpu, Inventory
from gpunode.runtimes.model import RuntimeConfigState
from gpunode.services import service_states

VERSION_TIMEOUT = 5.0
GIB = 1024**3


# (name shown, binary, systemd unit)
RUNTIMES: tuple[tuple[str, str, str], ...] = (
    ("containerd", "containerd", "containerd.service"),
    ("docker", "dockerd", "docker.service"),
    ("crio", "crio", "crio.service"),
)
KUBELET_UNIT = "kubelet.service"


@dataclass
class Context:
    host: Host
    discover: Callable[[Host], Inventory]
    _inventory: Inventory | NvmlError | None = None
    _discovery_bug: Exception | None = None
    _services: dict[str, str | None] = field(default_factory=dict)

    def inventory(self) -> Inventory | NvmlError:
        if self._discovery_bug is not None:
            raise self._discovery_bug  # discover once, even when it fails unexpectedly
        if self._inventory is None:
            try:
                self._inventory = self.discover(self.host)
            except NvmlError as exc:
                self._inventory = exc
            except Exception as exc:
                self._discovery_bug = exc
                raise
        return self._inventory

    def service(self, unit: str) -> str | None:
        if not self._services:
            units = [unit for _, _, unit in RUNTIMES] + [KUBELET_UNIT, paths.PLUGIN_SERVICE]
            self._services = service_states(self.host, units)
        return self._services.get(unit)

    @cached_property
    def embedded_containerd(self) -> str | None:
        return _embedded_containerd(self.host)

    @cached_property
    def has_kubelet(self) -> bool:
        return kubelet_present(self.host)

    def driver_module_loaded(self) -> bool:
        return self.host.exists(paths.NVIDIA_MODULE) or self.host.exists(paths.NVIDIA_DRIVER_VERSION)


# -- operating system ----------------------------------------------------------------------------


def check_os(ctx: Context) -> Iterable[Finding]:
    yield _distribution_finding(ctx.host)
    if ctx.host.euid == 0:
        yield Finding("os.privileges", Status.OK, "running as root")
    else:
        yield Finding(
            "os.privileges",
            Status.WARN,
            "not running as root: some files and devices may be unreadable",
            fix="run `sudo gpunode doctor` for a complete diagnosis",
        )


def _distribution_finding(host: Host) -> Finding:
    try:
        dist = read_distribution(host)
    except NotFound:
        return Finding(
            "os.distribution", Status.WARN, "distribution unknown (no os-release file)", fix=SUPPORTED_TEXT
        )
    except GpunodeError as exc:
        return Finding(
            "os.distribution", Status.WARN, "distribution unknown", detail=exc.message, fix=SUPPORTED_TEXT
        )
    label = dist.pretty or dist.id
    if dist.family is None:
        return Finding(
            "os.distribution",
            Status.WARN,
            f"{label} is not a distribution gpunode supports",
            detail="NVIDIA publishes nvidia-container-toolkit packages for apt, dnf and zypper systems only.",
            fix=SUPPORTED_TEXT,
        )
    if dist.too_old:
        return Finding(
            "os.distribution",
            Status.WARN,
            f"{label} is older than gpunode supports",
            detail="NVIDIA no longer publishes nvidia-container-toolkit for it.",
            fix=SUPPORTED_TEXT,
        )
    return Finding("os.distribution", Status.OK, label)


# -- driver -------------------------------------------------------------------------------------

_NVRM = re.compile(r"Kernel Module(?: for [\w-]+)?\s+([0-9][0-9.]+)")


def check_driver(ctx: Context) -> Iterable[Finding]:
    host = ctx.host
    if ctx.driver_module_loaded():
        try:
            text = host.read_text_if_exists(paths.NVIDIA_DRIVER_VERSION) or ""
        except GpunodeError:
            text = ""  # the module is there (sysfs); its version is just unknown
        match = _NVRM.search(text)
        version = match.group(1) if match else None
        yield Finding(
            "driver.module",
            Status.OK,
            f"nvidia kernel module loaded{f' (version {version})' if version else ''}",
            detail=text.strip().splitlines()[0] if text.strip() else None,
        )
    else:
        yield Finding(
            "driver.module",
            Status.FAIL,
            "the nvidia kernel module is not loaded",
            detail=f"neither {paths.NVIDIA_MODULE} nor {paths.NVIDIA_DRIVER_VERSION} exists",
            fix="install the NVIDIA driver (e.g. `apt install nvidia-driver` / `ubuntu-drivers install`) and "
            "load it with `modprobe nvidia`; if it will not load, see `dmesg | grep -i nvrm`",
        )
    if host.exists(paths.NOUVEAU_MODULE):
        yield Finding(
            "driver.nouveau",
            Status.FAIL,
            "the open-source nouveau driver is loaded and blocks the NVIDIA driver",
            fix="blacklist it: `echo 'blacklist nouveau' > /etc/modprobe.d/blacklist-nouveau.conf && "
            "update-initramfs -u` (or `dracut -f`), then reboot",
        )
    else:
        yield Finding("driver.nouveau", Status.OK, "nouveau is not loaded")


def check_nvml(ctx: Context) -> Iterable[Finding]:
    inv = ctx.inventory()
    if isinstance(inv, NvmlError):
        yield Finding("nvml.init", Status.FAIL, "NVML cannot be used", detail=inv.message, fix=inv.fix)
        return
    cuda = (
        f"{inv.cuda_driver_version[0]}.{inv.cuda_driver_version[1]}" if inv.cuda_driver_version else "unknown"
    )
    yield Finding(
        "nvml.init",
        Status.OK,
        f"NVML initialised: driver {inv.driver_version or 'unknown'}, CUDA {cuda}",
        detail=("Unknown facts (the driver does not provide them):\n" + "\n".join(inv.unknown))
        if inv.unknown
        else None,
    )


def _describe(gpu: Gpu) -> str:
    parts = [gpu.name or "unknown model"]
    if gpu.memory_total is not None:
        parts.append(f"{gpu.memory_total / GIB:.0f} GiB")
    if gpu.mig_mode is not None:
        parts.append(f"MIG {'on' if gpu.mig_mode.current else 'off'}")
    return ", ".join(parts)


def check_gpus(ctx: Context) -> Iterable[Finding]:
    inv = ctx.inventory()
    if isinstance(inv, NvmlError):
        yield Finding("gpu.count", Status.SKIP, "GPUs not listed: NVML cannot be used (see nvml.init)")
        return
    if not inv.gpus:
        yield Finding(
            "gpu.count",
            Status.FAIL,
            "the driver is loaded but sees no GPU",
            fix="check `lspci | grep -i nvidia` and `dmesg | grep -i nvrm`; the GPU may be disabled in the "
            "BIOS, passed to a VM, or unsupported by this driver version",
        )
        return
    yield Finding("gpu.count", Status.OK, f"{len(inv.gpus)} GPU{'s' if len(inv.gpus) != 1 else ''} found")
    for gpu in inv.gpus:
        yield _gpu_finding(gpu)
    not_persistent = [g.index for g in inv.gpus if g.persistence_mode is False]
    if not_persistent:
        yield Finding(
            "gpu.persistence",
            Status.WARN,
            f"persistence mode is off on GPU {', '.join(map(str, not_persistent))}",
            detail="Without it the driver tears the GPU state down whenever no process uses it, which slows "
            "every container start and can race with the device plugin.",
            fix="`systemctl enable --now nvidia-persistenced` (or `nvidia-smi -pm 1`)",
        )
    elif any(g.persistence_mode for g in inv.gpus):
        yield Finding("gpu.persistence", Status.OK, "persistence mode is on")


def _gpu_finding(gpu: Gpu) -> Finding:
    fid = f"gpu.{gpu.index}"
    if gpu.lost:
        return Finding(
            fid,
            Status.FAIL,
            f"GPU {gpu.index}{f' ({gpu.uuid})' if gpu.uuid else ''} has fallen off the bus",
            fix="check `dmesg` for Xid 79; drain the node, then reset the GPU (`nvidia-smi -r -i "
            f"{gpu.index}`) or reboot",
        )
    if gpu.error:
        return Finding(
            fid,
            Status.FAIL,
            f"GPU {gpu.index} cannot be read",
            detail=gpu.error,
            fix=f"see `nvidia-smi -i {gpu.index}` and `dmesg | grep -i nvrm`; on permission denied, run "
            "gpunode as root or fix the permissions of /dev/nvidia*",
        )
    summary = f"GPU {gpu.index}: {_describe(gpu)}"
    detail_lines = [f"UUID {gpu.uuid}"] if gpu.uuid else []
    if gpu.pci_bus_id:
        detail_lines.append(
            f"PCI {gpu.pci_bus_id}, NUMA node {gpu.numa_node if gpu.numa_node is not None else '-'}"
        )
    if gpu.compute_capability:
        detail_lines.append(
            f"compute capability {gpu.compute_capability[0]}.{gpu.compute_capability[1]}"
            + (f" ({gpu.architecture})" if gpu.architecture else "")
        )
    for mig in gpu.mig_devices:
        detail_lines.append(f"MIG {mig.profile or mig.name}: {mig.uuid}")
    problems: list[tuple[Status, str, str]] = []
    if gpu.remapped_rows_failure:
        problems.append(
            (
                Status.FAIL,
                "row remapping failed: the GPU memory is faulty",
                "drain the node and have the GPU replaced (RMA)",
            )
        )
    if gpu.ecc_uncorrected_volatile:
        problems.append(
            (
                Status.WARN,
                f"{gpu.ecc_uncorrected_volatile} uncorrectable ECC errors since the last driver load",
                "drain the node and reset the GPU; if errors recur, replace it",
            )
        )
    if gpu.retired_pages_pending or gpu.remapped_rows_pending:
        problems.append(
            (
                Status.WARN,
                "memory page retirement / row remapping is pending",
                f"drain the node, then reset the GPU (`nvidia-smi -r -i {gpu.index}`) or reboot",
            )
        )
    if gpu.mig_mode is not None and gpu.mig_mode.current != gpu.mig_mode.pending:
        problems.append(
            (
                Status.WARN,
                f"MIG mode change to {'on' if gpu.mig_mode.pending else 'off'} is pending",
                f"reset the GPU (`nvidia-smi -r -i {gpu.index}`) or reboot to apply it",
            )
        )
    if gpu.mig_mode is not None and gpu.mig_mode.current and not gpu.mig_devices:
        problems.append(
            (
                Status.WARN,
                "MIG is on but no MIG devices exist, so no workload can use this GPU",
                f"list the profiles with `nvidia-smi mig -i {gpu.index} -lgip`, then create instances with "
                f"`nvidia-smi mig -i {gpu.index} -cgi <profile> -C`",
            )
        )
    if not problems:
        return Finding(fid, Status.OK, summary, detail="\n".join(detail_lines))
    worst = Status.FAIL if any(s is Status.FAIL for s, _, _ in problems) else Status.WARN
    return Finding(
        fid,
        worst,
        summary + ": " + "; ".join(p for _, p, _ in problems),
        detail="\n".join(detail_lines),
        fix="; ".join(dict.fromkeys(f for _, _, f in problems)),
    )


def check_device_nodes(ctx: Context) -> Iterable[Finding]:
    if not ctx.driver_module_loaded():
        yield Finding("devices.nodes", Status.SKIP, "device nodes not checked: no nvidia kernel module")
        return
    wanted = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    inv = ctx.inventory()
    unchecked = ""
    if isinstance(inv, NvmlError):
        unchecked = "GPU nodes not checked: NVML cannot be used"
    else:
        wanted += [g.device_path for g in inv.gpus if g.device_path]
        unknown = [str(g.index) for g in inv.gpus if g.device_path is None]
        if unknown:
            unchecked = f"no minor number known for GPU {', '.join(unknown)}"
    missing = [p for p in wanted if not ctx.host.is_char_device(p)]
    if missing:
        yield Finding(
            "devices.nodes",
            Status.FAIL,
            f"missing device node{'s' if len(missing) > 1 else ''}: {', '.join(missing)}",
            detail="Containers get GPUs through these character devices; without /dev/nvidia-uvm CUDA "
            "cannot start." + (f"\n{unchecked}" if unchecked else ""),
            fix="`nvidia-modprobe -u -c=0` (creates the nodes; part of the driver), or `modprobe nvidia-uvm`",
        )
        return
    gpu_nodes = len(wanted) - 2
    summary = "/dev/nvidiactl and /dev/nvidia-uvm present"
    if not isinstance(inv, NvmlError):
        summary = f"/dev/nvidiactl, /dev/nvidia-uvm and {gpu_nodes} GPU node{'s' * (gpu_nodes != 1)} present"
    yield Finding(
        "devices.nodes",
        Status.OK,
        summary + (f" ({unchecked})" if unchecked else ""),
        detail=", ".join(wanted),
    )


# -- nvidia-container-toolkit -------------------------------------------------------------------

_VERSION = re.compile(r"version\s+v?(\d+\.\d+\.\d+\S*)", re.IGNORECASE)


def program_version(host: Host, program: str) -> tuple[str | None, str | None]:
    """(host path, version) of a program; (None, None) when it is not installed."""
    path = host.which(program)
    if path is None:
        return None, None
    try:
        result = host.run([path, "--version"], timeout=VERSION_TIMEOUT)
    except CommandFailed:
        return path, None
    match = _VERSION.search(result.stdout + "\n" + result.stderr)
    return path, match.group(1) if match else None


def check_toolkit(ctx: Context) -> Iterable[Finding]:
    found = {prog: program_version(ctx.host, prog) for prog in ("nvidia-ctk", "nvidia-container-runtime")}
    missing = [prog for prog, (path, _) in found.items() if path is None]
    if missing:
        yield Finding(
            "toolkit",
            Status.FAIL,
            f"nvidia-container-toolkit is not installed ({', '.join(missing)} not found)",
            detail="Without nvidia-container-runtime no container runtime can give a container a GPU.",
            fix="sudo gpunode toolkit install (NVIDIA's signed repository, its key checked; add --dry-run "
            "to see every file and command first)",
        )
        return
    versions = ", ".join(f"{prog} {ver or 'version unknown'}" for prog, (_, ver) in found.items())
    yield Finding("toolkit", Status.OK, f"nvidia-container-toolkit installed: {versions}")


# -- container runtimes -------------------------------------------------------------------------


def read_runtime_state(host: Host, runtime: str) -> RuntimeConfigState:
    if runtime == "docker":
        from gpunode.runtimes import docker

        return docker.read_state(host)
    if runtime == "containerd":
        from gpunode.runtimes import containerd

        # Where containerd can be asked (the real root, the program installed), its `config dump` decides:
        # imports, migration and keys it ignores are its to judge.
        return containerd.read_state(host, effective=True)
    from gpunode.runtimes import crio

    # Where the crio program is here, CRI-O's own view decides (`crio status config` of the running CRI-O,
    # else `crio config`): drop-in layouts, built-in defaults and handlers CRI-O ignored are its to judge.
    return crio.read_state(host, effective=True)


def check_runtimes(ctx: Context) -> Iterable[Finding]:
    host = ctx.host
    try:
        kubelet_uses = kubelet_runtime(host)
    except GpunodeError:
        kubelet_uses = None  # kubelet's files unreadable: which runtime it uses is unknown
    if kubelet_uses is None and ctx.has_kubelet:
        kubelet_uses = "containerd"  # kubelet's built-in default endpoint since Kubernetes 1.27
    installed = [(name, unit) for name, binary, unit in RUNTIMES if host.which(binary)]
    if "containerd" not in [n for n, _ in installed] and ctx.embedded_containerd:
        installed.insert(0, ("containerd", "containerd.service"))
    if not installed:
        yield Finding(
            "runtime",
            Status.FAIL,
            "no container runtime is installed (containerd, docker or CRI-O)",
            fix="install containerd (`apt install containerd` / `dnf install containerd.io`), the runtime "
            "Kubernetes uses by default",
        )
        return
    if kubelet_uses and kubelet_uses not in [n for n, _ in installed]:
        yield Finding(
            f"runtime.{kubelet_uses}",
            Status.FAIL,
            f"kubelet is configured for {kubelet_uses}, which is not installed",
            detail="kubelet's --container-runtime-endpoint (or containerRuntimeEndpoint) names it.",
            fix=f"install {kubelet_uses}, or point kubelet's container runtime endpoint at the installed one",
        )
    for name, _binary, unit in RUNTIMES:
        if name == kubelet_uses and (name, unit) not in installed:
            continue
        if (name, unit) not in installed:
            yield Finding(f"runtime.{name}", Status.SKIP, f"{name} is not installed")
            continue
        essential = name == kubelet_uses or len(installed) == 1
        yield _runtime_finding(ctx, name, unit, essential, name == kubelet_uses)


def _runtime_finding(ctx: Context, name: str, unit: str, essential: bool, kubelets: bool) -> Finding:
    fid = f"runtime.{name}"
    # k3s, RKE2 and microk8s run their own containerd inside their own service.
    embedded = ctx.embedded_containerd if name == "containerd" else None
    state_word = None if embedded else ctx.service(unit)
    running = "" if state_word is None else f", service {state_word}"
    bad = Status.FAIL if essential else Status.WARN
    try:
        state = read_runtime_state(ctx.host, name)
    except GpunodeError as exc:
        return Finding(
            fid,
            bad,
            f"{name}: its configuration cannot be read",
            detail=exc.message,
            fix=exc.fix or "fix the file (the message says where), then run doctor again",
        )
    detail_lines = [
        f"config: {', '.join(state.files) or state.config_path}"
        + ("" if state.exists else " (absent: built-in defaults)")
    ]
    detail_lines.append(
        f"runtimes: {', '.join(state.runtimes) or '(none defined)'}; default: {state.default_runtime or '-'}"
    )
    detail_lines += list(state.notes)
    detail = "\n".join(detail_lines)
    configure = _configure_fix(name, embedded)
    restart = EMBEDDED_FIX[embedded][1] if embedded else f"`systemctl restart {unit}`"
    if state.problems:
        return Finding(
            fid,
            bad,
            f"{name}{running}: {state.problems[0]}",
            detail=detail,
            fix="correct the configuration as described" + (f", then {restart}" if state.exists else ""),
        )
    if state.nvidia_runtime is None:
        return Finding(
            fid,
            bad,
            f"{name}{running}: no nvidia runtime configured"
            + (" (kubelet uses this runtime)" if kubelets else ""),
            detail=detail,
            fix=configure,
        )
    if state_word is not None and state_word != "active":
        return Finding(
            fid,
            bad,
            f"{name}: nvidia runtime '{state.nvidia_runtime}' configured, but the service is {state_word}",
            detail=detail,
            fix=f"{restart} and read `journalctl -u {unit} -n 50`",
        )
    summary = f"{name}{running}: nvidia runtime '{state.nvidia_runtime}' configured"
    if state.nvidia_is_default:
        return Finding(fid, Status.OK, summary + " and is the default", detail=detail)
    return Finding(
        fid,
        Status.WARN,
        summary + f", but the default is '{state.default_runtime}'",
        detail=detail + "\nPods get a GPU only when they ask for the nvidia runtime class.",
        fix=f"make it the default ({_configure_fix(name, embedded, default=True)}), or give GPU pods "
        f"`runtimeClassName: {state.nvidia_runtime}`",
    )


def _embedded_containerd(host: Host) -> str | None:
    """The service ("k3s", "rke2", "microk8s") whose own containerd runs here, or None."""
    from gpunode.runtimes.containerd import detect_location

    flavour = detect_location(host).flavour
    return None if flavour == "containerd" else flavour


def kubelet_present(host: Host) -> bool:
    """kubelet as a program, or embedded in k3s / RKE2 (which keep the usual /var/lib/kubelet)."""
    return any(host.which(p) for p in ("kubelet", "k3s", "rke2"))


EMBEDDED_FIX = {
    # (template, restart) for distributions that rewrite containerd's config.toml at every start.
    "k3s": ("config.toml.tmpl next to k3s's config.toml", "`systemctl restart k3s` (k3s-agent on agents)"),
    "rke2": (
        "config.toml.tmpl next to RKE2's config.toml",
        "`systemctl restart rke2-server` (or rke2-agent)",
    ),
    "microk8s": (
        "/var/snap/microk8s/current/args/containerd-template.toml",
        "`microk8s stop && microk8s start`",
    ),
}


def _configure_fix(name: str, embedded: str | None = None, *, default: bool = False) -> str:
    # gpunode edits k3s/RKE2/microk8s templates itself, and restarts and checks the runtime.
    runtime = "containerd" if embedded else name
    flag = " --set-as-default" if default else ""
    return f"`gpunode configure-runtime {runtime}{flag}` (`--dry-run` first shows the diff)"


# -- kubelet and the device plugin --------------------------------------------------------------


def check_kubelet(ctx: Context) -> Iterable[Finding]:
    host = ctx.host
    if not ctx.has_kubelet:
        yield Finding(
            "kubelet",
            Status.WARN,
            "kubelet is not installed: this machine is not a Kubernetes node yet",
            fix="join the node to a cluster (kubeadm join, k3s agent, ...); GPU checks above still apply",
        )
        return
    embedded = host.which("kubelet") is None  # inside k3s / RKE2: no kubelet.service of its own
    state = None if embedded else ctx.service(KUBELET_UNIT)
    if state not in (None, "active"):
        yield Finding(
            "kubelet",
            Status.FAIL,
            f"kubelet service is {state}",
            fix="`systemctl restart kubelet` and read `journalctl -u kubelet -n 50`",
        )
    else:
        summary = "kubelet is running" if state else "kubelet is installed"
        yield Finding("kubelet", Status.OK, "kubelet is embedded in k3s / RKE2" if embedded else summary)
    if host.is_socket(paths.KUBELET_SOCKET):
        yield Finding(
            "kubelet.socket", Status.OK, f"device plugin registration socket {paths.KUBELET_SOCKET}"
        )
    else:
        yield Finding(
            "kubelet.socket",
            Status.FAIL,
            f"{paths.KUBELET_SOCKET} is missing: device plugins cannot register",
            detail="kubelet creates this socket when it starts; it is missing when kubelet is not running or "
            "uses another root directory (--root-dir).",
            fix="`systemctl restart kubelet`; if kubelet runs with --root-dir, use that directory",
        )


def check_plugin(ctx: Context) -> Iterable[Finding]:
    host = ctx.host
    if not ctx.has_kubelet:
        yield Finding("plugin", Status.SKIP, "device plugin not checked: no kubelet")
        return
    state = ctx.service(paths.PLUGIN_SERVICE)
    sockets = _our_plugin_sockets(host)
    ours = ", ".join(sockets)
    nvidia = host.is_socket(paths.NVIDIA_PLUGIN_SOCKET)
    if state == "active" and ours:
        yield Finding("plugin", Status.OK, f"gpunode device plugin running ({ours})")
        yield from _unmonitored_gpus(host)
    elif state == "active":
        yield Finding(
            "plugin",
            Status.FAIL,
            f"{paths.PLUGIN_SERVICE} is active but its socket is missing",
            fix=f"`journalctl -u {paths.PLUGIN_SERVICE}`; `systemctl restart {paths.PLUGIN_SERVICE}`",
        )
    elif state in ("failed", "activating"):
        yield Finding(
            "plugin",
            Status.FAIL,
            f"{paths.PLUGIN_SERVICE} is {state}",
            fix=f"`journalctl -u {paths.PLUGIN_SERVICE} -n 50`",
        )
    elif nvidia:
        yield Finding(
            "plugin", Status.OK, f"NVIDIA's device plugin is serving ({paths.NVIDIA_PLUGIN_SOCKET})"
        )
    elif ours:
        yield Finding("plugin", Status.OK, f"a gpunode device plugin is serving ({ours})")
    else:
        yield Finding(
            "plugin",
            Status.FAIL,
            "no GPU device plugin is serving: the node advertises no nvidia.com/gpu",
            fix="install gpunode's device plugin as a service: `sudo gpunode plugin install`, or deploy "
            "NVIDIA's k8s-device-plugin DaemonSet",
        )


def _unmonitored_gpus(host: Host) -> Iterable[Finding]:
    """GPUs the running plugin serves but cannot watch (from its status file): still schedulable, but a
    fault on them would go unnoticed. A warning, never a failure: "cannot monitor" is not "unhealthy"."""
    import json

    try:
        document = json.loads(host.read_text_if_exists(paths.PLUGIN_STATUS_FILE) or "{}")
    except (GpunodeError, ValueError):
        return
    gpus = document.get("unmonitored") if isinstance(document, dict) else None
    if not gpus or not isinstance(gpus, list):
        return
    lines = [
        f"GPU {g.get('index')} ({g.get('uuid')}): {g.get('reason')}" for g in gpus if isinstance(g, dict)
    ]
    yield Finding(
        "plugin.health",
        Status.WARN,
        f"the device plugin cannot watch the health of {len(lines)} GPU(s); they stay schedulable",
        detail="\n".join(lines),
        fix=f"`journalctl -u {paths.PLUGIN_SERVICE}` says why; usually a driver too old for NVML events or "
        "the plugin running without root: update the driver, run the plugin as root",
    )


def _our_plugin_sockets(host: Host) -> list[str]:
    """gpunode's sockets in the device-plugins directory: one per resource it serves."""
    try:
        names = host.listdir(paths.DEVICE_PLUGIN_DIR)
    except GpunodeError:
        return []
    return [
        f"{paths.DEVICE_PLUGIN_DIR}/{name}"
        for name in sorted(names)
        if name.startswith(paths.PLUGIN_SOCKET_PREFIX)
        and name.endswith(".sock")
        and host.is_socket(f"{paths.DEVICE_PLUGIN_DIR}/{name}")
    ]


# -- the node as the Kubernetes API sees it ----------------------------------------------------------

API_TIMEOUT = (3.0, 5.0)  # a diagnosis must not hang on an unreachable API server


def check_capacity(ctx: Context) -> Iterable[Finding]:
    """The node's advertised GPU capacity against the GPUs present: the "GPUs read 0" failure."""
    if not ctx.has_kubelet:
        yield Finding("node.capacity", Status.SKIP, "advertised capacity not checked: no kubelet")
        return
    from gpunode.kube.credentials import resolve_credentials

    try:
        credentials = resolve_credentials(ctx.host)
    except NotFound:
        yield Finding(
            "node.capacity",
            Status.SKIP,
            "advertised capacity not checked: no Kubernetes API credentials on this node",
            fix="to include it: KUBECONFIG=/path/to/kubeconfig gpunode doctor",
        )
        return
    except GpunodeError as exc:
        yield Finding(
            "node.capacity",
            Status.WARN,
            "cannot use the Kubernetes API credentials",
            detail=exc.message,
            fix=exc.fix,
        )
        return
    inventory = ctx.inventory()
    if isinstance(inventory, NvmlError):
        yield Finding("node.capacity", Status.SKIP, "advertised capacity not checked: NVML cannot be used")
        return
    from gpunode import kubelet
    from gpunode.advertise import gpu_count, plugin_resource, plugin_sharing
    from gpunode.errors import UsageError
    from gpunode.kube.client import KubeClient, RetryPolicy, Timeouts

    try:
        node, _ = kubelet.node_name(ctx.host)
    except UsageError as exc:
        yield Finding(
            "node.capacity",
            Status.WARN,
            f"advertised capacity not checked: {exc.message}",
            fix="name the node: NODE_NAME=<name shown by `kubectl get nodes`> gpunode doctor",
        )
        return
    # What the plugin makes kubelet advertise: its own resource name (nvidia.com/gpu.shared when
    # time-slicing renames it), each GPU counted once per replica.
    resource = plugin_resource(ctx.host)
    replicas = plugin_sharing(ctx.host).replicas
    expected = gpu_count(inventory) * replicas
    try:
        with KubeClient(
            credentials,
            timeouts=Timeouts(*API_TIMEOUT),
            retry=RetryPolicy(attempts=1, conflict_attempts=1),
            env=ctx.host.env,
        ) as client:
            obj = client.get_node(node)
    except GpunodeError as exc:
        yield Finding(
            "node.capacity",
            Status.WARN,
            f"cannot read node {node} from the Kubernetes API",
            detail=f"{exc.message} (credentials: {credentials.source})",
            fix=exc.fix,
        )
        return
    status = obj.get("status", {}) if isinstance(obj.get("status"), dict) else {}
    capacity = (status.get("capacity") or {}).get(resource)
    allocatable = (status.get("allocatable") or {}).get(resource)
    present = f"{gpu_count(inventory)} GPU(s) present"
    if replicas > 1:
        present += f", {replicas} replicas each"
    if not expected and capacity in (None, "0"):
        yield Finding(
            "node.capacity",
            Status.OK,
            f"node {node} advertises {'no' if capacity is None else capacity} {resource} ({present})",
        )
    elif expected and capacity in (None, "0"):
        yield Finding(
            "node.capacity",
            Status.FAIL,
            f"node {node} advertises {capacity or 'no'} {resource} although {present}",
            detail="Pods asking for GPUs cannot be scheduled here. Typical after a kubelet restart when the "
            "device plugin did not register again, or when no plugin runs.",
            fix=f"`gpunode plugin status`; `sudo systemctl restart {paths.PLUGIN_SERVICE}` "
            "(or `sudo gpunode plugin install`)",
        )
    elif str(expected) != capacity:
        yield Finding(
            "node.capacity",
            Status.WARN,
            f"node {node} advertises {resource}: {capacity}, but {present} (expected {expected})",
            fix="`gpunode plugin status` shows what the plugin serves; a GPU lost or hidden (MIG) also "
            "changes the count",
        )
    elif allocatable is not None and allocatable != capacity:
        yield Finding(
            "node.capacity",
            Status.WARN,
            f"node {node}: {resource} capacity {capacity}, but only {allocatable} allocatable",
            detail="The device plugin reports some devices unhealthy.",
            fix="`gpunode plugin status` and the gpu checks above name the unhealthy GPUs",
        )
    else:
        yield Finding(
            "node.capacity", Status.OK, f"node {node} advertises {resource}: {capacity} ({present})"
        )


ALL_CHECKS: tuple[Callable[[Context], Iterable[Finding]], ...] = (
    check_os,
    check_driver,
    check_nvml,
    check_gpus,
    check_device_nodes,
    check_toolkit,
    check_runtimes,
    check_kubelet,
    check_plugin,
    check_capacity,
    check_cdi,
)
