"""`gpunode doctor --prometheus FILE` (issue 18): the findings as node_exporter textfile metrics, written
through the Host (under the node's temp root), parsed back with Prometheus's own parser."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from tests.conftest import Node

TEXTFILE_DIR = "/var/lib/node_exporter/textfile_collector"
FILE = f"{TEXTFILE_DIR}/gpunode_doctor.prom"


def run(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, dict[str, str]], dict[tuple[str, str], float]]:
    (node.root / TEXTFILE_DIR.lstrip("/")).mkdir(parents=True, exist_ok=True)
    code = main(["doctor", "--json", "--prometheus", FILE], host=node.host())
    checks = {c["id"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    text = (node.root / FILE.lstrip("/")).read_text()
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())))] = s.value
    # Only the .prom file is left in the collector's directory (the temp file was renamed over it).
    assert [p.name for p in (node.root / TEXTFILE_DIR.lstrip("/")).iterdir()] == ["gpunode_doctor.prom"]
    return code, checks, samples


def test_findings_become_textfile_metrics(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("dgx-a100")
    code, checks, samples = run(node, capsys)
    assert code == ExitCode.OK
    assert samples[("gpunode_doctor_healthy", "")] == 1
    for check in checks.values():
        for status in ("ok", "warn", "fail", "skip"):
            want = 1 if check["status"] == status else 0
            assert samples[("gpunode_doctor_check_status", f"check={check['id']},status={status}")] == want
    assert samples[("gpunode_doctor_checks", "status=fail")] == 0
    assert samples[("gpunode_doctor_last_run_timestamp_seconds", "")] > 0


def test_a_failed_check_is_written_and_still_exits_unhealthy(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("dgx-a100")
    run(node, capsys)  # a previous, healthy run: its file is replaced, not appended to
    fake_nvml("no-driver")
    node.remove("/sys/module/nvidia")
    node.remove("/proc/driver/nvidia")
    code, checks, samples = run(node, capsys)
    assert code == ExitCode.UNHEALTHY
    assert samples[("gpunode_doctor_healthy", "")] == 0
    assert samples[("gpunode_doctor_check_status", "check=driver.module,status=fail")] == 1
    assert samples[("gpunode_doctor_check_status", "check=driver.module,status=ok")] == 0
    fails = sum(1 for c in checks.values() if c["status"] == "fail")
    assert fails >= 1 and samples[("gpunode_doctor_checks", "status=fail")] == fails
