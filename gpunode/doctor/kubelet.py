"""Doctor checks of kubelet: installed, running, and the device-plugin directory it serves."""

from __future__ import annotations

from collections.abc import Iterable

from gpunode import paths
from gpunode.doctor.context import KUBELET_UNIT, Context
from gpunode.doctor.model import Finding, Status


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
