"""`gpunode doctor`: diagnose the node, read-only."""

from __future__ import annotations

from collections.abc import Callable

from gpunode.doctor.model import SCHEMA, Finding, Report, Status
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.nvml.model import Inventory


def run_doctor(host: Host | None = None, discover: Callable[[Host], Inventory] | None = None) -> Report:
    """Run every check against `host` and return the findings in a fixed order."""
    from gpunode.doctor.checks import ALL_CHECKS, Context

    if discover is None:
        from gpunode.nvml.discovery import discover as nvml_discover

        discover = nvml_discover
    ctx = Context(host=host or Host(), discover=discover)
    findings: list[Finding] = []
    for check in ALL_CHECKS:
        try:
            findings.extend(check(ctx))
        except GpunodeError as exc:
            # A check that cannot finish is a finding too; the other checks still run.
            name = check.__name__.removeprefix("check_")
            findings.append(Finding(name, Status.FAIL, f"{name} could not be checked", exc.message, exc.fix))
    return Report(tuple(findings))


__all__ = ["SCHEMA", "Finding", "Report", "Status", "run_doctor"]
