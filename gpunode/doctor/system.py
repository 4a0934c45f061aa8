"""Doctor checks of the machine itself: the operating system, the NVIDIA driver and NVML, each GPU, and the
device nodes containers need."""

from __future__ import annotations

import re
from collections.abc import Iterable

from gpunode import paths
from gpunode.distribution import SUPPORTED_TEXT, read_distribution
from gpunode.doctor.context import GIB, Context
from gpunode.doctor.model import Finding, Status
from gpunode.errors import GpunodeError, NotFound, NvmlError
from gpunode.host import Host
from gpunode.nvml.model import Gpu


def check_os(ctx: Context) -> Iterable[Finding]:
    yield _distribution_finding(ctx.host)
    if ctx.host.euid == 0:
        yield Finding("os.privileges", Status.OK, "running as root")
    else:
        yield Finding(
            "os.privileges",
            Status.WARN,
            "not running as root: some files and devices may be unreadable",
            fix="run `gpunode doctor` as root for a complete diagnosis",
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
    if ctx.simulated:
        yield _simulated_module(ctx)
    elif ctx.driver_module_loaded():
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
            fix=_DRIVER_FIX,
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


_DRIVER_FIX = (
    "install the NVIDIA driver (e.g. `apt install nvidia-driver` / `ubuntu-drivers install`) and load it "
    "with `modprobe nvidia`; if it will not load, see `dmesg | grep -i nvrm`"
)


def _simulated_module(ctx: Context) -> Finding:
    """The simulated node's kernel module: loaded unless the node is one without a driver; its version is
    the one its NVML reports (a real module and NVML of one driver agree)."""
    if not ctx.driver_module_loaded():
        return Finding(
            "driver.module",
            Status.FAIL,
            "the nvidia kernel module is not loaded",
            detail=f"the simulated node {ctx.simulated!r} has no NVIDIA driver loaded",
            fix=_DRIVER_FIX,
        )
    inv = ctx.inventory()
    version = None if isinstance(inv, NvmlError) else inv.driver_version
    return Finding(
        "driver.module",
        Status.OK,
        f"nvidia kernel module loaded{f' (version {version})' if version else ''}",
    )


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
    if ctx.simulated:
        # A simulated node's device nodes are not on this host: looking would fail every GPU-less box.
        if not isinstance(inv, NvmlError):
            wanted += [g.device_path for g in inv.gpus if g.device_path]
        yield Finding(
            "devices.nodes",
            Status.SKIP,
            "device nodes not checked: a simulated node has none on this host",
            detail="A real node of this shape needs " + ", ".join(wanted),
        )
        return
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
