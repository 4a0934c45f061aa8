"""Doctor checks of the Node object: the capacity the API server really advertises for the GPUs."""

from __future__ import annotations

from collections.abc import Iterable

from gpunode import paths
from gpunode.doctor.context import Context, simulated_tag
from gpunode.doctor.dra import dra_in_use, read_sides
from gpunode.doctor.model import Finding, Status
from gpunode.errors import GpunodeError, NotFound, NvmlError

API_TIMEOUT = (3.0, 5.0)  # a diagnosis must not hang on an unreachable API server


def check_capacity(ctx: Context) -> Iterable[Finding]:
    """The node's advertised GPU capacity against the GPUs present: the "GPUs read 0" failure."""
    if not ctx.has_kubelet:
        yield Finding("node.capacity", Status.SKIP, "advertised capacity not checked: no kubelet")
        return
    if dra_in_use(ctx.host) and not read_sides(ctx.host).device_plugin:
        # Under DRA the node advertises no nvidia.com/gpu: 0 is right there (dra.slices checks the GPUs).
        yield Finding(
            "node.capacity",
            Status.SKIP,
            "advertised capacity not checked: DRA serves the GPUs (see dra.slices)",
        )
        return
    if ctx.simulated:
        # The API server advertises this node's real GPUs: comparing them with simulated ones says nothing.
        yield Finding(
            "node.capacity",
            Status.SKIP,
            f"advertised capacity not compared: the GPUs are simulated {simulated_tag(ctx.simulated)}",
        )
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
            host=ctx.host,  # an exec credential plugin runs through the node's Host, under --root too
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
            fix=f"`gpunode plugin status`; `systemctl restart {paths.PLUGIN_SERVICE}` "
            "(or `gpunode plugin install`)",
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
