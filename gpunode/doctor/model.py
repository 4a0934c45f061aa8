"""Findings: what doctor reports, as data (the CLI renders it as a table or JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

SCHEMA = "gpunode.doctor/v1"


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"  # not applicable here, or could not be checked because an earlier check failed


@dataclass(frozen=True)
class Finding:
    id: str  # stable, dotted: "driver.module", "gpu.0", "runtime.containerd"
    status: Status
    summary: str  # one line
    detail: str | None = None  # what was seen, more lines allowed
    fix: str | None = None  # the exact thing to do (None when status is ok/skip)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data


@dataclass(frozen=True)
class Report:
    findings: tuple[Finding, ...]
    simulated: str | None = None  # the built-in node doctor --simulate read instead of NVML

    @property
    def healthy(self) -> bool:
        return not any(f.status is Status.FAIL for f in self.findings)

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in Status}
        for f in self.findings:
            counts[f.status.value] += 1
        return counts

    def to_json(self) -> dict[str, Any]:
        # The envelope every --json document has (gpunode/jsonout.py): doctor only reads, so changed is false.
        return {
            "schema": SCHEMA,
            "changed": False,
            "dry_run": False,
            "healthy": self.healthy,
            "counts": self.counts(),
            "checks": [f.to_json() for f in self.findings],
            "simulated": self.simulated,
            "error": None,
        }
