"""The DeviceClasses that select this driver's devices, as NVIDIA's DRA driver's chart installs them
(../shared/specs/dra-nvidia-compat.md section 1), so that claims written for that driver work unchanged:

- `gpu.nvidia.com`: full GPUs (`type == 'gpu'`), with `extendedResourceName: nvidia.com/gpu`, so that a
  pod spec asking `nvidia.com/gpu: 2` is served by DRA on a node without a device plugin (Kubernetes 1.36's
  DRAExtendedResource: the scheduler makes the claim; dra-kubelet-plugin.md section 6);
- `mig.nvidia.com`: MIG devices (`type == 'mig'`).

The selectors are NVIDIA's CEL word for word. Under another driver name the classes follow it: the gpu
class is named after the driver, the mig class `mig.` + the driver without a leading `gpu.`, and both
expressions name that driver (a device's bare attributes live in its driver's domain).

Pure: the objects only; gpunode/cli/dra.py prints them or applies them through gpunode.kube.client.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpunode.dra import DEFAULT_DRIVER
from gpunode.errors import UsageError

if TYPE_CHECKING:
    from gpunode.kube.client import KubeClient

EXTENDED_RESOURCE = "nvidia.com/gpu"  # what unchanged pod specs ask for
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpunode"}  # says who wrote the class; others' labels stay
API_VERSION = "resource.k8s.io/v1"  # the newest version, and the only one 1.34+ serves by default

# A DNS subdomain, as the API requires of a driver name (ResourceSlice spec.driver: at most 63 characters).
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_driver(name: str) -> str:
    """A DRA driver name as the API accepts it in a ResourceSlice and a CEL selector; UsageError (exit 2)
    otherwise, before anything is asked of the API."""
    if len(name) > 63 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise UsageError(
            f"--driver {name!r} is not a valid DRA driver name",
            "give a DNS subdomain of at most 63 characters: lower-case letters, digits, '-' and '.' "
            f"(default {DEFAULT_DRIVER})",
        )
    return name


def class_names(driver: str) -> tuple[str, str]:
    """(the gpu class, the mig class) for `driver`: gpu.nvidia.com gives NVIDIA's own names."""
    return driver, "mig." + driver.removeprefix("gpu.")


def selector(driver: str, device_type: str) -> str:
    """NVIDIA's chart's CEL expression (deviceclass-*.yaml), with `driver` in both places."""
    return f"device.driver == '{driver}' && device.attributes['{driver}'].type == '{device_type}'"


def device_classes(driver: str = DEFAULT_DRIVER, *, extended_resource: bool = True) -> list[dict[str, Any]]:
    """The DeviceClass objects, gpu first. `extended_resource=False` leaves out the gpu class's
    extendedResourceName (for a node whose `nvidia.com/gpu` stays with the device plugin, or a second
    driver beside NVIDIA's that must not claim the same resource)."""
    check_driver(driver)
    gpu_name, mig_name = class_names(driver)
    gpu_spec: dict[str, Any] = {"selectors": [{"cel": {"expression": selector(driver, "gpu")}}]}
    if extended_resource:
        gpu_spec["extendedResourceName"] = EXTENDED_RESOURCE
    mig_spec: dict[str, Any] = {"selectors": [{"cel": {"expression": selector(driver, "mig")}}]}
    return [_device_class(gpu_name, gpu_spec), _device_class(mig_name, mig_spec)]


def _device_class(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": name, "labels": dict(MANAGED_BY)},
        "spec": spec,
    }


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as one multi-document YAML stream, as `kubectl apply -f -` takes it."""
    import yaml  # only when YAML is printed

    return "".join(
        "---\n" + yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=1000)
        for obj in objects
    )


@dataclass(frozen=True)
class ClassChange:
    """One DeviceClass applied (or, in a dry run, compared): `action` is create, update or unchanged."""

    name: str
    action: str
    diff: str  # for an update, the class there against what it becomes (YAML, unified); else ""
    written: bool  # whether this run wrote it (never in a dry run)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "action": self.action, "diff": self.diff, "written": self.written}


def apply(client: KubeClient, objects: list[dict[str, Any]], *, dry_run: bool) -> list[ClassChange]:
    """Make the cluster's DeviceClasses carry `objects` (their spec and labels; labels and annotations
    others set are kept), or with `dry_run` say what that would change without writing anything. A second
    apply finds them as wanted and writes nothing."""
    changes = []
    for obj in objects:
        name = obj["metadata"]["name"]
        current, body = client.plan_device_class(obj)
        if body is None:
            changes.append(ClassChange(name, "unchanged", "", written=False))
            continue
        action = "create" if current is None else "update"
        diff = "" if current is None else _diff(name, current, body)
        written = False
        if not dry_run:
            # The client reads the class again and writes it only if it still differs (another writer
            # may have made it so meanwhile: then nothing was written by this run).
            _, written = client.apply_device_class(obj)
        changes.append(ClassChange(name, action if dry_run or written else "unchanged", diff, written))
    return changes


def _diff(name: str, current: dict[str, Any], wanted: dict[str, Any]) -> str:
    """What an update changes, as YAML lines: the fields gpunode sets (labels, annotations, spec), not the
    server's bookkeeping (resourceVersion, uid, managedFields) that both sides carry."""

    def shown(obj: dict[str, Any]) -> list[str]:
        metadata = obj.get("metadata") or {}
        kept = {
            "metadata": {k: metadata[k] for k in ("labels", "annotations") if metadata.get(k)},
            "spec": obj.get("spec") or {},
        }
        return to_yaml([kept]).splitlines(keepends=True)[1:]

    return "".join(
        difflib.unified_diff(shown(current), shown(wanted), f"deviceclass/{name} (cluster)", "gpunode")
    )
