"""The checks `gpunode doctor` runs, in order; each area's checks live in a module of its own. Each check
returns Findings; none raises for what it finds on the host.

Order matters only for reading: later checks use what earlier ones learnt through the shared Context
(e.g. no NVML → the per-GPU checks are skipped with the reason).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpunode.doctor.cdi import check_cdi
from gpunode.doctor.context import RUNTIMES, Context, kubelet_present, program_version
from gpunode.doctor.dra import check_dra_driver, check_dra_slices, check_kubelet_api, check_runtime_cdi
from gpunode.doctor.kubelet import check_kubelet
from gpunode.doctor.model import Finding
from gpunode.doctor.node import check_capacity
from gpunode.doctor.plugin import check_plugin
from gpunode.doctor.runtime import check_runtimes, check_toolkit, read_runtime_state
from gpunode.doctor.system import check_device_nodes, check_driver, check_gpus, check_nvml, check_os

__all__ = ["ALL_CHECKS", "RUNTIMES", "Context", "kubelet_present", "program_version", "read_runtime_state"]

ALL_CHECKS: tuple[Callable[[Context], Iterable[Finding]], ...] = (
    check_os,
    check_driver,
    check_nvml,
    check_gpus,
    check_device_nodes,
    check_toolkit,
    check_runtimes,
    check_kubelet,
    check_plugin,
    check_kubelet_api,
    check_capacity,
    check_cdi,
    check_dra_driver,
    check_dra_slices,
    check_runtime_cdi,
)
