"""Where each containerd flavour runs: its systemd unit (found among the unit directories) and its socket.

What the containerd editor, the k3s / RKE2 template planner, the reader that restarts and verifies, and
revert all need to know about a flavour; kept apart from them so that none imports another for it.
"""

from __future__ import annotations

from gpunode.host import Host

UNITS = {
    "containerd": ("containerd.service",),
    "k3s": ("k3s.service", "k3s-agent.service"),
    "rke2": ("rke2-server.service", "rke2-agent.service"),
    "microk8s": ("snap.microk8s.daemon-containerd.service",),
}
UNIT_DIRS = ("/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
SOCKETS = {
    "containerd": "/run/containerd/containerd.sock",
    "k3s": "/run/k3s/containerd/containerd.sock",
    "rke2": "/run/k3s/containerd/containerd.sock",
    "microk8s": "/var/snap/microk8s/common/run/containerd.sock",
}


def unit_for(host: Host, flavour: str) -> str:
    """The unit that runs this containerd: a k3s/RKE2 agent has its own unit name, found by its file."""
    candidates = UNITS[flavour]
    for unit in candidates:
        if any(host.is_file(f"{directory}/{unit}") for directory in UNIT_DIRS):
            return unit
    return candidates[0]
