"""The GPU feature discovery labels gpunode computes (pure: an Inventory in, labels out) and the merge
patches that set them, remove the stale ones and never touch a label gpunode did not set."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpunode.kube.labels import (
    MANAGED_ANNOTATION,
    Sharing,
    family,
    gpu_labels,
    label_patch,
    removal_patch,
    sanitise,
)
from gpunode.nvml.model import Gpu, Inventory

MIB = 1024 * 1024
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")  # kube-apiserver's rule


def a100(index: int, **changes: object) -> Gpu:
    fields: dict[str, object] = {
        "index": index,
        "uuid": f"GPU-{index:08d}",
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_total": 81920 * MIB,
        "compute_capability": (8, 0),
        "architecture": "Ampere",
        "mig_capable": True,
    }
    fields.update(changes)
    return Gpu(**fields)  # type: ignore[arg-type]


def inventory(
    *gpus: Gpu, driver: str | None = "550.54.15", cuda: tuple[int, int] | None = (12, 4)
) -> Inventory:
    return Inventory(driver_version=driver, cuda_driver_version=cuda, nvml_version="12.550.54.15", gpus=gpus)


DGX = inventory(*(a100(i) for i in range(8)))

# What NVIDIA's GPU feature discovery labels an 8 x A100 node with (driver 550.54.15, CUDA 12.4).
DGX_LABELS: dict[str, str] = json.loads(
    (Path(__file__).resolve().parent.parent / "fixtures/labels/dgx-a100.json").read_text()
)


# -- sanitise ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("  Tesla   V100  ", "Tesla-V100"),  # runs of spaces are one '-', none at the ends
        ("Quadro RTX 8000 (rev/2)", "Quadro-RTX-8000--rev-2"),  # refused characters become '-'
        ("GeForce RTX 4090 Ti+", "GeForce-RTX-4090-Ti"),  # ... and trailing ones go
        ("_.-name-._", "name"),  # must start and end with a letter or digit
        ("A" * 70, "A" * 63),  # at most 63 characters
        ("A" * 62 + " B", "A" * 62),  # cut at 63, then the '-' it ends with goes
        ("()", ""),
    ],
)
def test_sanitise(raw: str, label: str) -> None:
    assert sanitise(raw) == label
    assert LABEL_VALUE.fullmatch(label) and len(label) <= 63


# -- family -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cc", "expected"),
    [
        ((3, 7), "kepler"),
        ((5, 2), "maxwell"),
        ((6, 0), "pascal"),
        ((7, 0), "volta"),
        ((7, 2), "volta"),
        ((7, 5), "turing"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 7), "ampere"),
        ((8, 9), "ada-lovelace"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((12, 0), "blackwell"),
        ((4, 0), "undefined"),
        ((11, 0), "undefined"),
    ],
)
def test_family_from_compute_capability(cc: tuple[int, int], expected: str) -> None:
    # The compute capability decides, whatever architecture NVML names.
    assert family(a100(0, compute_capability=cc, architecture="Something Else")) == expected


def test_family_without_compute_capability() -> None:
    assert family(a100(0, compute_capability=None, architecture="Ada Lovelace")) == "ada-lovelace"
    assert family(a100(0, compute_capability=None, architecture=None)) is None


# -- gpu_labels -------------------------------------------------------------------------------------


def test_eight_a100() -> None:
    assert gpu_labels(DGX) == DGX_LABELS


def test_every_value_is_one_the_api_server_accepts() -> None:
    odd = inventory(a100(0, name="NVIDIA  Weird/Name (engineering sample) " + "x" * 80))
    labels = gpu_labels(odd, Sharing(replicas=4))
    assert labels["nvidia.com/gpu.product"].startswith("NVIDIA-Weird-Name--engineering-sample")
    for key, value in labels.items():
        assert key.startswith("nvidia.com/")
        assert LABEL_VALUE.fullmatch(value) and value and len(value) <= 63, (key, value)


def test_no_gpu_labels_only_presence_and_count() -> None:
    # A driver without GPUs (the `no-gpu` machine): nothing about GPUs or CUDA to select on.
    assert gpu_labels(inventory()) == {"nvidia.com/gpu.present": "false", "nvidia.com/gpu.count": "0"}
    assert gpu_labels(inventory(driver=None, cuda=None)) == {
        "nvidia.com/gpu.present": "false",
        "nvidia.com/gpu.count": "0",
    }


def test_only_lost_or_unreadable_gpus_count_as_none() -> None:
    labels = gpu_labels(
        inventory(Gpu(index=0, uuid=None, lost=True), a100(1, error="Insufficient Permissions"))
    )
    assert labels == {"nvidia.com/gpu.present": "false", "nvidia.com/gpu.count": "0"}


def test_a_lost_gpu_is_not_counted_and_does_not_describe_the_node() -> None:
    lost_first = inventory(Gpu(index=0, uuid=None, lost=True), a100(1), a100(2))
    labels = gpu_labels(lost_first)
    assert labels["nvidia.com/gpu.count"] == "2"
    assert labels["nvidia.com/gpu.present"] == "true"
    # The product and the rest come from the first GPU that can be read.
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert labels["nvidia.com/gpu.memory"] == "81920"


def test_l4_node_without_mig() -> None:
    l4 = a100(0, name="NVIDIA L4", memory_total=23034 * MIB, compute_capability=(8, 9), mig_capable=False)
    labels = gpu_labels(inventory(l4, driver="535.104.05", cuda=(12, 2)))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-L4"
    assert labels["nvidia.com/gpu.memory"] == "23034"
    assert labels["nvidia.com/gpu.family"] == "ada-lovelace"
    assert labels["nvidia.com/gpu.compute.minor"] == "9"
    assert labels["nvidia.com/mig.capable"] == "false"
    assert labels["nvidia.com/cuda.driver-version.revision"] == "05"  # the string as the driver says it
    assert labels["nvidia.com/cuda.driver-version.full"] == "535.104.05"
    assert labels["nvidia.com/cuda.runtime-version.full"] == "12.2"


def test_facts_the_driver_did_not_tell_are_left_out() -> None:
    bare = Gpu(index=0, uuid="GPU-0")
    labels = gpu_labels(inventory(bare, driver="550.54", cuda=None))
    assert labels == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.full": "550.54",
    }


def test_time_slicing_marks_the_product_shared() -> None:
    labels = gpu_labels(DGX, Sharing(replicas=4))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-SHARED"
    assert labels["nvidia.com/gpu.replicas"] == "4"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/gpu.count"] == "8"  # GPUs, not replicas
    changed = {"nvidia.com/gpu.product", "nvidia.com/gpu.replicas", "nvidia.com/gpu.sharing-strategy"}
    assert set(labels) == set(DGX_LABELS)
    assert {k for k in labels if labels[k] != DGX_LABELS[k]} == changed


def test_rename_by_default_keeps_the_product_name() -> None:
    # The shared resource has its own name (nvidia.com/gpu.shared): the product needs no suffix.
    labels = gpu_labels(DGX, Sharing(replicas=4, rename_by_default=True))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/gpu.replicas"] == "4"


def test_one_replica_is_no_sharing_whatever_rename_says() -> None:
    assert gpu_labels(DGX, Sharing(replicas=1, rename_by_default=True)) == DGX_LABELS


def test_a_long_shared_product_stays_a_valid_label() -> None:
    labels = gpu_labels(inventory(a100(0, name="N" * 60)), Sharing(replicas=2))
    product = labels["nvidia.com/gpu.product"]
    assert len(product) <= 63 and LABEL_VALUE.fullmatch(product)


# -- label_patch -------------------------------------------------------------------------------------

OTHERS = {"kubernetes.io/hostname": "gpu-1", "team": "ml", "nvidia.com/gpu.deploy.operator": "false"}


def test_first_advertise_sets_every_label_and_records_them() -> None:
    patch = label_patch(OTHERS, {}, DGX_LABELS)
    assert patch == {
        "metadata": {
            "labels": DGX_LABELS,
            "annotations": {MANAGED_ANNOTATION: ",".join(sorted(DGX_LABELS))},
        }
    }


def test_nothing_to_do_is_none() -> None:
    current = {**OTHERS, **DGX_LABELS}
    annotations = {MANAGED_ANNOTATION: ",".join(sorted(DGX_LABELS)), "other/annotation": "x"}
    assert label_patch(current, annotations, DGX_LABELS) is None


def test_only_changed_values_are_sent() -> None:
    current = {**OTHERS, **DGX_LABELS, "nvidia.com/gpu.count": "7"}
    annotations = {MANAGED_ANNOTATION: ",".join(sorted(DGX_LABELS))}
    assert label_patch(current, annotations, DGX_LABELS) == {
        "metadata": {"labels": {"nvidia.com/gpu.count": "8"}}
    }


def test_stale_labels_are_removed_and_others_never_touched() -> None:
    # Yesterday: time-sliced A100s. Today: plain L4s, without MIG.
    before = gpu_labels(DGX, Sharing(replicas=4))
    l4 = a100(0, name="NVIDIA L4", memory_total=23034 * MIB, compute_capability=(8, 9), mig_capable=None)
    now = gpu_labels(inventory(l4, cuda=None))
    current = {**OTHERS, **before, "nvidia.com/gpu.deploy.dcgm": "true"}  # set by someone else
    annotations = {MANAGED_ANNOTATION: ",".join(sorted(before)), "kept": "yes"}

    patch = label_patch(current, annotations, now)
    assert patch is not None
    labels = patch["metadata"]["labels"]
    removed = {k for k, v in labels.items() if v is None}
    assert removed == {
        "nvidia.com/mig.capable",
        "nvidia.com/cuda.runtime-version.major",
        "nvidia.com/cuda.runtime-version.minor",
        "nvidia.com/cuda.runtime-version.full",
    }
    assert {k: v for k, v in labels.items() if v is not None} == {
        "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.product": "NVIDIA-L4",
        "nvidia.com/gpu.memory": "23034",
        "nvidia.com/gpu.family": "ada-lovelace",
        "nvidia.com/gpu.compute.minor": "9",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
    }
    assert not set(labels) & set(OTHERS) and "nvidia.com/gpu.deploy.dcgm" not in labels
    assert patch["metadata"]["annotations"] == {MANAGED_ANNOTATION: ",".join(sorted(now))}


def test_a_stale_label_someone_already_removed_is_not_sent() -> None:
    annotations = {MANAGED_ANNOTATION: ",".join(sorted({*DGX_LABELS, "nvidia.com/gpu.old"}))}
    current = {**OTHERS, **DGX_LABELS}  # nvidia.com/gpu.old is gone already
    assert label_patch(current, annotations, DGX_LABELS) == {
        "metadata": {"annotations": {MANAGED_ANNOTATION: ",".join(sorted(DGX_LABELS))}}
    }


def test_a_record_naming_labels_outside_nvidia_com_does_not_remove_them() -> None:
    # The annotation is editable by anyone: gpunode only ever owns nvidia.com/ labels.
    annotations = {MANAGED_ANNOTATION: "team, kubernetes.io/hostname ,nvidia.com/gpu.count"}
    patch = label_patch({**OTHERS, **DGX_LABELS}, annotations, DGX_LABELS)
    assert patch is not None
    assert "labels" not in patch["metadata"]


# -- removal_patch -----------------------------------------------------------------------------------


def test_removal_removes_exactly_what_gpunode_set() -> None:
    current = {**OTHERS, **DGX_LABELS, "nvidia.com/gpu.deploy.dcgm": "true"}
    annotations = {MANAGED_ANNOTATION: ",".join(sorted(DGX_LABELS)), "kept": "yes"}
    assert removal_patch(current, annotations) == {
        "metadata": {
            "annotations": {MANAGED_ANNOTATION: None},
            "labels": {k: None for k in sorted(DGX_LABELS)},
        }
    }


def test_removal_with_the_labels_already_gone_drops_the_record() -> None:
    annotations = {MANAGED_ANNOTATION: ",".join(sorted(DGX_LABELS))}
    assert removal_patch(OTHERS, annotations) == {"metadata": {"annotations": {MANAGED_ANNOTATION: None}}}


def test_removal_on_a_node_gpunode_never_labelled_is_none() -> None:
    # Even with GFD's own labels on it: without gpunode's record, none of them is gpunode's.
    assert removal_patch({**OTHERS, **DGX_LABELS}, {"other": "x"}) is None


def test_sharing_strategy_and_mps_capable_as_gfd_sets_them() -> None:
    # GFD: sharing-strategy none | time-slicing | mps, and mps.capable true only for MPS sharing (the MPS
    # control-daemon DaemonSet of NVIDIA's chart selects nodes by it).
    assert gpu_labels(DGX)["nvidia.com/mps.capable"] == "false"
    sliced = gpu_labels(DGX, Sharing(replicas=4))
    assert (sliced["nvidia.com/gpu.sharing-strategy"], sliced["nvidia.com/mps.capable"]) == (
        "time-slicing",
        "false",
    )
    mps = gpu_labels(DGX, Sharing(replicas=4, mps=True))
    assert (mps["nvidia.com/gpu.sharing-strategy"], mps["nvidia.com/mps.capable"]) == ("mps", "true")
    assert mps["nvidia.com/gpu.replicas"] == "4"
    # MPS sharing only resources other than nvidia.com/gpu: GFD's gpu.* labels stay 1 / none, and
    # mps.capable still says the node shares through MPS.
    other = gpu_labels(DGX, Sharing(mps=True))
    assert (
        other["nvidia.com/gpu.replicas"],
        other["nvidia.com/gpu.sharing-strategy"],
        other["nvidia.com/mps.capable"],
    ) == ("1", "none", "true")
    assert other["nvidia.com/gpu.product"] == DGX_LABELS["nvidia.com/gpu.product"]
