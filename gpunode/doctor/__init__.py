"""`gpunode doctor`: diagnose the node, read-only."""

from __future__ import annotations

from collections.abc import Callable

from gpunode.doctor.model import SCHEMA, Finding, Report, Status
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.nvml.model import Inventory

# The id of the finding that stands for a check that could not finish.
FAILED_CHECK_IDS = {
    "check_os": "os.error",
    "check_driver": "driver.error",
    "check_nvml": "nvml.error",
    "check_gpus": "gpu.error",
    "check_device_nodes": "devices.error",
    "check_toolkit": "toolkit.error",
    "check_runtimes": "runtime.error",
    "check_kubelet": "kubelet.error",
    "check_plugin": "plugin.error",
    "check_capacity": "node.error",
    "check_cdi": "cdi.error",
    "check_kubelet_api": "kubelet.api.error",
    "check_dra_driver": "dra.error",
    "check_dra_slices": "dra.slices.error",
    "check_runtime_cdi": "runtime.cdi.error",
}


def run_doctor(
    host: Host | None = None,
    discover: Callable[[Host], Inventory] | None = None,
    *,
    raise_bugs: bool = False,
    simulate: str | None = None,
) -> Report:
    """Run every check against `host` and return the findings in a fixed order.

    A check that cannot finish becomes a failed finding and the others still run: a partial diagnosis
    beats none. With `raise_bugs` (the CLI's --debug) an unexpected exception propagates instead.
    With `simulate`, the built-in simulated node of that name stands in for the driver and NVML (its GPUs,
    unless `discover` is given); the host's own checks (runtimes, kubelet, ...) still read the host.
    """
    from gpunode.doctor.checks import ALL_CHECKS, Context

    if discover is None and simulate:
        discover = simulated_discover(simulate)
    if discover is None:
        from gpunode.nvml.discovery import discover as nvml_discover

        discover = nvml_discover
    ctx = Context(host=host or Host(), discover=discover, simulated=simulate)
    findings: list[Finding] = []
    for check in ALL_CHECKS:
        fid = FAILED_CHECK_IDS[check.__name__]
        area = fid.removesuffix(".error")
        try:
            findings.extend(check(ctx))  # findings yielded before a failure are kept
        except GpunodeError as exc:
            fix = exc.fix or "correct what the detail names, then run `gpunode doctor` again"
            findings.append(Finding(fid, Status.FAIL, f"{area}: could not finish checking", exc.message, fix))
        except Exception as exc:
            if raise_bugs:
                raise
            findings.append(
                Finding(
                    fid,
                    Status.FAIL,
                    f"{area}: internal error while checking",
                    f"{type(exc).__name__}: {exc}",
                    "this is a bug in gpunode: run `gpunode --debug doctor` for the traceback and report it",
                )
            )
    if simulate:
        findings = [_mark_simulated(f, simulate) for f in findings]
    return Report(tuple(findings), simulated=simulate)


def simulated_discover(name: str) -> Callable[[Host], Inventory]:
    """A discover() that reads the built-in simulated node `name` instead of NVML (doctor, up)."""
    from functools import partial

    return partial(_simulated_inventory, name)


def _simulated_inventory(name: str, _host: Host) -> Inventory:
    from gpunode.plugin.simulate import simulated_inventory

    return simulated_inventory(name)


# The findings made from the driver and NVML, which a simulated node answers (the others read the host).
_SIMULATED_AREAS = ("driver.module", "driver.error", "nvml.", "gpu.", "devices.")


def _mark_simulated(finding: Finding, name: str) -> Finding:
    from dataclasses import replace

    from gpunode.doctor.context import simulated_tag

    tag = simulated_tag(name)
    if not finding.id.startswith(_SIMULATED_AREAS) or finding.summary.endswith(tag):
        return finding
    return replace(finding, summary=f"{finding.summary} {tag}")


__all__ = ["SCHEMA", "Finding", "Report", "Status", "run_doctor", "simulated_discover"]
