"""Doctor checks of the device plugin: registered with kubelet, and the GPUs it serves but cannot watch."""

from __future__ import annotations

from collections.abc import Iterable

from gpunode import paths
from gpunode.doctor.context import Context
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
