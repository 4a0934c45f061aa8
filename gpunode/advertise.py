"""Advertise the node's GPUs through the Kubernetes API, and take that back.

detect (node name, GPUs, the plugin's sharing settings, whether a device plugin owns the resource) → plan
against the Node as the API returns it (pure: JSON patch operations for its status, a merge patch for its
labels) → apply, each write guarded by the resourceVersion that was read (a 409 means: read and plan again).
What gpunode set is recorded in two annotations on the Node, so that stale labels and, on withdraw,
everything gpunode set are removed, and nothing anyone else set is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpunode import kubelet, paths
from gpunode.errors import UsageError
from gpunode.host import Host
from gpunode.kube.condition import condition_ops
from gpunode.kube.jsonpointer import json_pointer
from gpunode.kube.labels import CAPACITY_ANNOTATION, Sharing, gpu_labels, label_patch, removal_patch
from gpunode.nvml.model import Inventory

if TYPE_CHECKING:
    from gpunode.kube.client import KubeClient
    from gpunode.plugin.config import PluginConfig

DEFAULT_RESOURCE = "nvidia.com/gpu"
STATUS_FIELDS = ("capacity", "allocatable")


@dataclass(frozen=True)
class AdvertiseOptions:
    node: str | None = None
    resource: str = DEFAULT_RESOURCE
    count: int | None = None  # None: the GPUs NVML reports
    labels: bool = True
    capacity: bool = True


@dataclass
class Change:
    """What one advertise or withdraw did (or, in a dry run, would do) to the Node."""

    node: str
    node_source: str
    resource: str | None = None
    count: int | None = None
    capacity_before: str | None = None
    capacity_ops: list[dict[str, Any]] = field(default_factory=list)
    labels_set: dict[str, str] = field(default_factory=dict)
    labels_removed: list[str] = field(default_factory=list)
    metadata_patch: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def changes_nothing(self) -> bool:
        return not self.capacity_ops and self.metadata_patch is None

    @property
    def condition_removed(self) -> bool:
        """The patch removes the plugin's GPUHealthy condition (withdraw, down)."""
        return any(
            op["op"] == "remove" and op["path"].startswith("/status/conditions/") for op in self.capacity_ops
        )


# -- pure planning over the Node object ---------------------------------------------------------------


def _status(node: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = node.get("status", {}).get(name)
    return value if isinstance(value, dict) else {}


def _metadata(node: Mapping[str, Any], name: str) -> dict[str, str]:
    value = node.get("metadata", {}).get(name)
    return value if isinstance(value, dict) else {}


def capacity_ops(node: Mapping[str, Any], resource: str, count: int) -> list[dict[str, Any]]:
    """JSON patch operations setting capacity and allocatable of `resource` to `count` (a string, as the API
    keeps quantities); [] when both already say so. Allocatable too: the scheduler places pods by it, and
    without a device plugin nothing else would set it."""
    ops: list[dict[str, Any]] = []
    for name in STATUS_FIELDS:
        if name not in node.get("status", {}):
            ops.append({"op": "add", "path": json_pointer("status", name), "value": {}})
        if _status(node, name).get(resource) != str(count):
            ops.append({"op": "add", "path": json_pointer("status", name, resource), "value": str(count)})
    return ops


def removal_ops(node: Mapping[str, Any], resources: list[str]) -> list[dict[str, Any]]:
    """JSON patch operations removing these resources from capacity and allocatable, where they are."""
    return [
        {"op": "remove", "path": json_pointer("status", name, resource)}
        for resource in resources
        for name in STATUS_FIELDS
        if resource in _status(node, name)
    ]


def advertised_resources(node: Mapping[str, Any]) -> list[str]:
    """The resources gpunode recorded advertising. Only extended resources count: the annotation is anyone's
    to edit, and `cpu` or `memory` there must not make withdraw remove kubelet's own capacity."""
    raw = _metadata(node, "annotations").get(CAPACITY_ANNOTATION, "")
    return sorted(
        {r.strip() for r in raw.split(",") if r.strip() and _extended_resource_problem(r.strip()) is None}
    )


def _extended_resource_problem(resource: str) -> str | None:
    from gpunode.plugin.config import resource_name_problem

    return resource_name_problem(resource)


def _check_resource(resource: str) -> None:
    """--resource names an extended resource (domain/name): never cpu, memory, pods or a kubernetes.io one,
    which kubelet owns."""
    problem = _extended_resource_problem(resource)
    if problem is not None:
        raise UsageError(
            f"--resource {resource}: {problem}", "name an extended resource such as nvidia.com/gpu"
        )


def plan_metadata(
    node: Mapping[str, Any], wanted_labels: dict[str, str] | None, resources: list[str] | None
) -> dict[str, Any] | None:
    """The merge patch for the labels (None: leave them) and the record of advertised resources (None:
    leave it)."""
    labels, annotations = _metadata(node, "labels"), _metadata(node, "annotations")
    patch: dict[str, Any] = {"metadata": {}}
    if wanted_labels is not None:
        patch = label_patch(labels, annotations, wanted_labels) or patch
    if resources is not None:
        record = ",".join(sorted(resources)) or None
        if annotations.get(CAPACITY_ANNOTATION) != record:
            patch["metadata"].setdefault("annotations", {})[CAPACITY_ANNOTATION] = record
    return patch if patch["metadata"] else None


# -- detect -------------------------------------------------------------------------------------------


def plugin_owner(host: Host, resource: str) -> str | None:
    """Why a device plugin owns `resource` on this node (kubelet then overwrites a manual capacity)."""
    if resource in kubelet.registered_resources(host):
        return f"a device plugin has registered {resource} with kubelet (kubelet's checkpoint says so)"
    sockets = {f"{paths.PLUGIN_SOCKET_PREFIX}{resource.replace('/', '-')}.sock"}
    if resource == DEFAULT_RESOURCE:
        sockets.add(paths.NVIDIA_PLUGIN_SOCKET.rsplit("/", 1)[-1])
    for name in sorted(sockets):
        if host.is_socket(f"{paths.DEVICE_PLUGIN_DIR}/{name}"):
            return f"a device plugin serves {resource} on this node ({paths.DEVICE_PLUGIN_DIR}/{name})"
    return None


def plugin_sharing(host: Host) -> Sharing:
    """The installed plugin's sharing, time-slicing or MPS (its config file: TOML or NVIDIA's), or none.

    With per-resource sharing (time-slicing.resources, mps.resources) the replicas are those of the
    whole-GPU resource (resource-name), as GFD labels them: where only other resources are shared (MIG
    profiles, say) the gpu.* labels say 1 and none, as GFD's do, and only mps.capable tells of MPS. A
    per-resource rename counts as a rename (the product label then needs no -SHARED)."""
    config = _plugin_config(host)
    if config is None:
        return Sharing()
    mps = any(e.replicas > 1 for e in config.mps_resources)
    entries = [e for e in (config.mps_resources if mps else config.shared_resources) if e.replicas > 1]
    if not entries:
        return Sharing(replicas=config.replicas, rename_by_default=config.rename_by_default)
    domain = config.resource_name.split("/", 1)[0]
    full = [e for e in entries if (e.name if "/" in e.name else f"{domain}/{e.name}") == config.resource_name]
    if not full:
        return Sharing(mps=mps)
    entry = full[0]
    return Sharing(
        replicas=entry.replicas, rename_by_default=config.rename_by_default or bool(entry.rename), mps=mps
    )


def plugin_resource(host: Host) -> str:
    """The resource the installed gpunode plugin makes kubelet advertise: its resource-name, renamed as its
    sharing renames it (an entry's rename, or ".shared" with rename-by-default); nvidia.com/gpu without a
    plugin config."""
    config = _plugin_config(host)
    if config is None:
        return DEFAULT_RESOURCE
    domain = config.resource_name.split("/", 1)[0]

    def qualified(name: str) -> str:
        return name if "/" in name else f"{domain}/{name}"

    # A per-resource entry (time-slicing.resources or mps.resources) for the whole-GPU resource wins, as
    # in the plugin: its own rename, else <name>.shared with rename-by-default.
    entries = config.mps_resources if any(e.replicas > 1 for e in config.mps_resources) else ()
    entries = entries or config.shared_resources
    for entry in entries:
        if entry.replicas > 1 and qualified(entry.name) == config.resource_name:
            if entry.rename:
                return qualified(entry.rename)
            return f"{config.resource_name}.shared" if config.rename_by_default else config.resource_name
    shared = config.replicas > 1 and config.rename_by_default
    return f"{config.resource_name}.shared" if shared else config.resource_name


def _plugin_config(host: Host) -> PluginConfig | None:
    from gpunode.plugin.config import load_config
    from gpunode.systemd.service import CONFIG_PATH

    if not host.is_file(CONFIG_PATH):
        return None
    return load_config(host, config_path=CONFIG_PATH, env={})


def gpu_count(inventory: Inventory) -> int:
    return sum(1 for g in inventory.gpus if not g.lost and g.error is None)


# -- apply --------------------------------------------------------------------------------------------


def advertise(
    host: Host,
    client: KubeClient,
    opts: AdvertiseOptions,
    inventory: Inventory,
    *,
    dry_run: bool = False,
) -> Change:
    if opts.capacity:
        _check_resource(opts.resource)
    name, source = kubelet.node_name(host, opts.node)
    count = opts.count if opts.count is not None else gpu_count(inventory)
    if count < 0:
        raise UsageError(f"--count {count}: a count cannot be negative")
    change = Change(node=name, node_source=source, resource=opts.resource if opts.capacity else None)
    if opts.capacity:
        change.count = count
        owner = plugin_owner(host, opts.resource)
        if owner:
            change.warnings.append(
                f"{owner}: kubelet keeps {opts.resource} at what the plugin reports and overwrites a value "
                "set by hand; advertise only the labels (--no-capacity), or stop that plugin"
            )
    wanted = gpu_labels(inventory, plugin_sharing(host)) if opts.labels else None

    def status_ops(node: dict[str, Any]) -> list[dict[str, Any]]:
        change.capacity_before = _status(node, "capacity").get(opts.resource)
        change.capacity_ops = capacity_ops(node, opts.resource, count) if opts.capacity else []
        return change.capacity_ops

    def metadata(node: dict[str, Any]) -> dict[str, Any] | None:
        resources = sorted({*advertised_resources(node), opts.resource}) if opts.capacity else None
        change.metadata_patch = plan_metadata(node, wanted, resources)
        _describe_labels(change)
        return change.metadata_patch

    _run(client, name, status_ops, metadata, dry_run=dry_run)
    return change


def withdraw(
    host: Host, client: KubeClient, *, node: str | None, resource: str | None, dry_run: bool = False
) -> Change:
    if resource is not None:
        _check_resource(resource)
    name, source = kubelet.node_name(host, node)
    change = Change(node=name, node_source=source, resource=resource)

    def status_ops(current: dict[str, Any]) -> list[dict[str, Any]]:
        resources = sorted({*advertised_resources(current), *([resource] if resource else [])})
        change.resource = ", ".join(resources) or None
        # The plugin's GPUHealthy condition goes too: a node that no longer offers GPUs has no GPU health.
        change.capacity_ops = removal_ops(current, resources) + condition_ops(current, None)
        return change.capacity_ops

    def metadata(current: dict[str, Any]) -> dict[str, Any] | None:
        patch: dict[str, Any] | None = removal_patch(
            _metadata(current, "labels"), _metadata(current, "annotations")
        )
        if CAPACITY_ANNOTATION in _metadata(current, "annotations"):
            patch = patch or {"metadata": {}}
            patch["metadata"].setdefault("annotations", {})[CAPACITY_ANNOTATION] = None
        change.metadata_patch = patch
        _describe_labels(change)
        return patch

    _run(client, name, status_ops, metadata, dry_run=dry_run)
    return change


def _run(
    client: KubeClient,
    name: str,
    status_ops: Callable[[dict[str, Any]], list[dict[str, Any]]],
    metadata: Callable[[dict[str, Any]], dict[str, Any] | None],
    *,
    dry_run: bool,
) -> None:
    if dry_run:
        node = client.get_node(name)
        status_ops(node)
        metadata(node)
        return
    client.update_node_status(name, status_ops)
    client.update_node(name, metadata)


def _describe_labels(change: Change) -> None:
    labels = (change.metadata_patch or {}).get("metadata", {}).get("labels", {})
    change.labels_set = {k: v for k, v in labels.items() if v is not None}
    change.labels_removed = sorted(k for k, v in labels.items() if v is None)
