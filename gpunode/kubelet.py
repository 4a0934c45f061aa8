"""What kubelet is configured to use, read from its files (kubeadm layout and common packagings)."""

from __future__ import annotations

import re

from gpunode.host import Host
from gpunode.paths import KUBEADM_FLAGS, KUBELET_CONFIG, KUBELET_DEFAULTS

_FLAG = re.compile(r"--container-runtime-endpoint[= ]+[\"']?([^\s\"']+)")
_CONFIG_KEY = re.compile(r"^containerRuntimeEndpoint:\s*[\"']?([^\s\"'#]+)", re.MULTILINE)

# Socket names → runtime, for endpoints such as unix:///run/containerd/containerd.sock.
_RUNTIME_BY_SOCKET = {
    "containerd.sock": "containerd",
    "crio.sock": "crio",
    "cri-dockerd.sock": "docker",
    "dockershim.sock": "docker",
}


def container_runtime_endpoint(host: Host) -> str | None:
    """kubelet's --container-runtime-endpoint (flags win over the config file, as in kubelet)."""
    for path in (KUBEADM_FLAGS, *KUBELET_DEFAULTS):
        text = host.read_text_if_exists(path) or ""
        for line in text.splitlines():
            if not line.lstrip().startswith("#") and (m := _FLAG.search(line)):
                return m.group(1)
    config = host.read_text_if_exists(KUBELET_CONFIG)
    if config and (m := _CONFIG_KEY.search(config)):
        return m.group(1)
    return None


def runtime_for_endpoint(endpoint: str | None) -> str | None:
    if not endpoint:
        return None
    return _RUNTIME_BY_SOCKET.get(endpoint.rstrip("/").rsplit("/", 1)[-1])


def kubelet_runtime(host: Host) -> str | None:
    """ "containerd", "crio" or "docker" when kubelet's endpoint says so; None when unknown."""
    return runtime_for_endpoint(container_runtime_endpoint(host))


_HOSTNAME_FLAG = re.compile(r"--hostname-override[= ]+[\"']?([^\s\"']+)")
_HOSTNAME_KEY = re.compile(r"^hostnameOverride:\s*[\"']?([^\s\"'#]+)", re.MULTILINE)
KUBELET_CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"


def hostname_override(host: Host) -> str | None:
    """kubelet's --hostname-override (or hostnameOverride in its config file): the node's name when set.

    kubeadm's drop-in runs `kubelet … $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS`, and of a flag given twice
    the last one counts: so /etc/default/kubelet (EXTRA_ARGS) wins over kubeadm-flags.env, the last
    occurrence in a file wins, and any flag wins over the config file."""
    for path in (*KUBELET_DEFAULTS, KUBEADM_FLAGS):
        text = host.read_text_if_exists(path) or ""
        found = [
            m.group(1)
            for line in text.splitlines()
            if not line.lstrip().startswith("#")
            for m in _HOSTNAME_FLAG.finditer(line)
        ]
        if found:
            return found[-1]
    config = host.read_text_if_exists(KUBELET_CONFIG)
    if config and (m := _HOSTNAME_KEY.search(config)):
        return m.group(1)
    return None


def node_name(host: Host, explicit: str | None = None) -> tuple[str, str]:
    """(node name, where it came from) the way kubelet names its node: --node, $NODE_NAME, kubelet's
    hostname override, then the host name — lower-cased, as kubelet does."""
    if explicit:
        return explicit, "--node"
    if value := host.env.get("NODE_NAME"):
        return value, "$NODE_NAME"
    if value := hostname_override(host):
        return value.lower(), "kubelet's --hostname-override"
    if host.is_real_root:
        import socket

        return socket.gethostname().lower(), "the host name"
    text = (host.read_text_if_exists("/etc/hostname") or "").strip()
    if text:
        return text.split()[0].lower(), "/etc/hostname"
    from gpunode.errors import UsageError

    raise UsageError(
        "cannot tell this node's name: no --node, no $NODE_NAME, no kubelet --hostname-override and no "
        "/etc/hostname",
        "pass --node NAME (the name `kubectl get nodes` shows)",
    )


def registered_resources(host: Host) -> list[str]:
    """Resources a device plugin has registered with kubelet, from kubelet's own checkpoint."""
    import json

    text = host.read_text_if_exists(KUBELET_CHECKPOINT) if host.is_file(KUBELET_CHECKPOINT) else None
    if not text:
        return []
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, a number of 4,300+ digits, or nested thousands deep
        return []
    registered = data.get("Data", {}).get("RegisteredDevices", {}) if isinstance(data, dict) else {}
    return sorted(registered) if isinstance(registered, dict) else []
