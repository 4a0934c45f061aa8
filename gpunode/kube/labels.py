"""Node labels for the GPUs, named and computed the way NVIDIA's GPU feature discovery (GFD) does, so that
node selectors and affinities written for GFD keep working on gpunode nodes.

Pure: an Inventory and the plugin's sharing settings in, a dict of labels out. Which labels gpunode set
is remembered in an annotation on the node, so that labels it no longer sets (a GPU model swapped, sharing
turned off) and, on withdraw, all of them are removed — and labels set by anything else are never touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpunode.nvml.model import Gpu, Inventory

PREFIX = "nvidia.com/"
MANAGED_ANNOTATION = "gpunode.io/managed-labels"
CAPACITY_ANNOTATION = "gpunode.io/advertised-resources"
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Sharing:
    """The device plugin's sharing settings (gpunode plugin config: replicas, rename-by-default)."""

    replicas: int = 1
    rename_by_default: bool = False
    mps: bool = False  # shared through MPS rather than time-slicing (GFD: sharing-strategy mps)


def sanitise(value: str) -> str:
    """A label value Kubernetes accepts: runs of spaces become '-', other characters it refuses become '-',
    at most 63 characters, starting and ending with a letter or digit ("NVIDIA A100-SXM4-80GB" →
    "NVIDIA-A100-SXM4-80GB")."""
    text = "-".join(value.split())
    text = re.sub(r"[^A-Za-z0-9_.-]", "-", text)
    text = text[:63].strip("-_.")
    return text


def family(gpu: Gpu) -> str | None:
    """GFD's gpu.family: from the compute capability, as GFD derives it."""
    if gpu.compute_capability is None:
        return gpu.architecture.lower().replace(" ", "-") if gpu.architecture else None
    major, minor = gpu.compute_capability
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell"}.get(
        major, "blackwell" if major == 12 else "undefined"
    )


def gpu_labels(inventory: Inventory, sharing: Sharing = Sharing()) -> dict[str, str]:
    """The labels for this node. No GPU: only gpu.present=false and gpu.count=0."""
    gpus = [g for g in inventory.gpus if not g.lost and g.error is None]
    labels: dict[str, str] = {
        "gpu.present": "true" if gpus else "false",
        "gpu.count": str(len(gpus)),
    }
    if gpus:
        # GFD labels a node by its first GPU: a node's GPUs are one model in practice.
        first = gpus[0]
        shared = sharing.replicas > 1
        if first.name:
            product = sanitise(first.name)
            labels["gpu.product"] = (
                sanitise(f"{product}-SHARED") if shared and not sharing.rename_by_default else product
            )
        if first.memory_total is not None:
            labels["gpu.memory"] = str(first.memory_total // MIB)
        if (fam := family(first)) is not None:
            labels["gpu.family"] = fam
        if first.compute_capability is not None:
            labels["gpu.compute.major"] = str(first.compute_capability[0])
            labels["gpu.compute.minor"] = str(first.compute_capability[1])
        if first.mig_capable is not None:
            labels["mig.capable"] = "true" if first.mig_capable else "false"
        labels["gpu.replicas"] = str(sharing.replicas)
        # GFD's values: none, time-slicing or mps; mps.capable tells NVIDIA's MPS control-daemon DaemonSet
        # (its node selector) whether the node shares through MPS.
        strategy = ("mps" if sharing.mps else "time-slicing") if shared else "none"
        labels["gpu.sharing-strategy"] = strategy
        # GFD: true whenever the node's sharing is MPS, also where only other resources than nvidia.com/gpu
        # are shared (gpu.replicas and gpu.sharing-strategy then say 1 and none, as GFD's do).
        labels["mps.capable"] = "true" if sharing.mps else "false"
        # The driver's and CUDA's versions only where there is a GPU to run on (the docstring's promise:
        # a node without GPUs carries nothing a GPU workload could select it by).
        if inventory.driver_version:
            parts = inventory.driver_version.split(".")
            for name, part in zip(("major", "minor", "revision"), parts, strict=False):
                labels[f"cuda.driver-version.{name}"] = part
            labels["cuda.driver-version.full"] = inventory.driver_version
        if inventory.cuda_driver_version is not None:
            major, minor = inventory.cuda_driver_version
            labels["cuda.runtime-version.major"] = str(major)
            labels["cuda.runtime-version.minor"] = str(minor)
            labels["cuda.runtime-version.full"] = f"{major}.{minor}"
    return {PREFIX + key: value for key, value in labels.items() if _LABEL_VALUE.fullmatch(value) and value}


def label_patch(
    current_labels: dict[str, str], current_annotations: dict[str, str], wanted: dict[str, str]
) -> dict[str, Any] | None:
    """The merge patch (RFC 7386) that sets `wanted`, removes what gpunode set before and no longer wants,
    and records the set; None when the node already is so."""
    managed_before = _managed(current_annotations)
    changes: dict[str, str | None] = {k: v for k, v in wanted.items() if current_labels.get(k) != v}
    for stale in sorted(managed_before - set(wanted)):
        if stale in current_labels:
            changes[stale] = None
    record = ",".join(sorted(wanted))
    annotation_change = current_annotations.get(MANAGED_ANNOTATION) != record
    if not changes and not annotation_change:
        return None
    metadata: dict[str, Any] = {}
    if changes:
        metadata["labels"] = changes
    if annotation_change:
        metadata["annotations"] = {MANAGED_ANNOTATION: record or None}
    return {"metadata": metadata}


def removal_patch(
    current_labels: dict[str, str], current_annotations: dict[str, str]
) -> dict[str, object] | None:
    """The merge patch that removes every label gpunode set (and its record); None when there are none."""
    labels = {k: None for k in sorted(_managed(current_annotations)) if k in current_labels}
    if not labels and MANAGED_ANNOTATION not in current_annotations:
        return None
    metadata: dict[str, Any] = {"annotations": {MANAGED_ANNOTATION: None}}
    if labels:
        metadata["labels"] = labels
    return {"metadata": metadata}


def _managed(annotations: dict[str, str]) -> set[str]:
    raw = annotations.get(MANAGED_ANNOTATION, "")
    return {k.strip() for k in raw.split(",") if k.strip().startswith(PREFIX)}
