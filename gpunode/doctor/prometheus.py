"""`gpunode doctor --prometheus FILE`: the findings as metrics for node_exporter's textfile collector.

node_exporter reads every `*.prom` file in its --collector.textfile.directory at each scrape, so the file
is replaced atomically (Host.write_file: a temp file in the same directory, named so that it does not end
in .prom, then a rename); a scrape sees the old findings or the new, never half. A timer keeps it fresh
(`gpunode plugin install --doctor-metrics DIR`).

The text format is written here rather than with prometheus_client: doctor must not need the plugin's
dependencies, and the format of a few gauges is simple (label values escaped as the format requires).
Each check is an enum-style gauge: one series per status, 1 for the check's current status and 0 for the
others, so `gpunode_doctor_check_status{status="fail"} == 1` alerts on any failed check and a check that
recovers resets its series instead of leaving a stale one.
"""

from __future__ import annotations

from gpunode.doctor.model import Report, Status
from gpunode.host import Host


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(report: Report, now: float) -> str:
    lines = [
        "# HELP gpunode_doctor_check_status Result of each gpunode doctor check: 1 for its status, 0 for "
        "the others.",
        "# TYPE gpunode_doctor_check_status gauge",
    ]
    for finding in report.findings:
        for status in Status:
            value = 1 if finding.status is status else 0
            lines.append(
                f'gpunode_doctor_check_status{{check="{_label(finding.id)}",status="{status.value}"}} {value}'
            )
    lines += [
        "# HELP gpunode_doctor_checks Checks of the last gpunode doctor run, by status.",
        "# TYPE gpunode_doctor_checks gauge",
    ]
    for name, count in report.counts().items():
        lines.append(f'gpunode_doctor_checks{{status="{_label(name)}"}} {count}')
    lines += [
        "# HELP gpunode_doctor_healthy 1 if no check of the last gpunode doctor run failed.",
        "# TYPE gpunode_doctor_healthy gauge",
        f"gpunode_doctor_healthy {1 if report.healthy else 0}",
        "# HELP gpunode_doctor_last_run_timestamp_seconds When gpunode doctor wrote these findings "
        "(Unix time).",
        "# TYPE gpunode_doctor_last_run_timestamp_seconds gauge",
        f"gpunode_doctor_last_run_timestamp_seconds {now:.3f}",
    ]
    return "\n".join(lines) + "\n"


def write(host: Host, path: str, report: Report, now: float) -> None:
    """Replace `path` with the findings, atomically (mode 0644: node_exporter may run as another user)."""
    host.write_file(path, render(report, now), mode=0o644)
