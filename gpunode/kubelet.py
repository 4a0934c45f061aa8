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
