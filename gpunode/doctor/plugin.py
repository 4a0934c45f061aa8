"""Doctor checks of the device plugin: registered with kubelet, and the GPUs it serves but cannot watch."""

from __future__ import annotations

from collections.abc import Iterable

from gpunode import paths
from gpunode.doctor.context import Context
from gpunode.doctor.dra import dra_in_use
from gpunode.doctor.model import Finding, Status
from gpunode.errors import GpunodeError
from gpunode.host import Host


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
        yield from _down_resources(host)
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
    elif dra_in_use(host):
        # No device plugin is what a DRA node should have: a second side would give the GPUs twice.
        yield Finding("plugin", Status.SKIP, "no device plugin: DRA serves the GPUs (see kubelet.api)")
    else:
        yield Finding(
            "plugin",
            Status.FAIL,
            "no GPU device plugin is serving: the node advertises no nvidia.com/gpu",
            fix="install gpunode's device plugin as a service: `gpunode plugin install`, or deploy "
            "NVIDIA's k8s-device-plugin DaemonSet",
        )
    if (
        ours
        and nvidia
        and any(s.endswith(f"/{paths.PLUGIN_SOCKET_PREFIX}nvidia.com-gpu.sock") for s in sockets)
    ):
        yield Finding(
            "plugin.duplicate",
            Status.FAIL,
            f"NVIDIA's device plugin serves nvidia.com/gpu too ({paths.NVIDIA_PLUGIN_SOCKET}): kubelet keeps "
            "whichever registered last, and the two take turns after every restart",
            fix="remove NVIDIA's DaemonSet (`kubectl -n kube-system get ds | grep nvidia-device-plugin`, "
            "then `kubectl delete ds`), or give gpunode another resource-name",
        )


def _unmonitored_gpus(host: Host) -> Iterable[Finding]:
    """GPUs the running plugin serves but cannot watch (from its status file): still schedulable, but a
    fault on them would go unnoticed. A warning, never a failure: "cannot monitor" is not "unhealthy"."""
    import json

    try:
        document = json.loads(host.read_text_if_exists(paths.PLUGIN_STATUS_FILE) or "{}")
    except (GpunodeError, ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
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


def _down_resources(host: Host) -> Iterable[Finding]:
    """Resources the running plugin serves all-unhealthy for a reason of their own (an MPS control daemon
    that is down), from its status file: kubelet schedules nothing on them."""
    import json

    try:
        document = json.loads(host.read_text_if_exists(paths.PLUGIN_STATUS_FILE) or "{}")
    except (GpunodeError, ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        return
    resources = document.get("resources") if isinstance(document, dict) else None
    down = [r for r in resources or [] if isinstance(r, dict) and r.get("down")]
    if not down:
        return
    yield Finding(
        "plugin.sharing",
        Status.FAIL,
        f"{len(down)} resource(s) served with every device unhealthy: "
        + "; ".join(f"{r.get('name')}: {r.get('down')}" for r in down),
        fix=f"`journalctl -u {paths.PLUGIN_SERVICE}` says why; for MPS see "
        "`<mps-root>/<resource>/log/control.log` and that nvidia-cuda-mps-control is installed (the plugin "
        "restarts the daemon on its own)",
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
