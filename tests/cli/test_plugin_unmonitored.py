"""GPUs the device plugin serves but cannot watch reach `gpunode doctor` as a warning, never a failure
(issue 13: "cannot monitor" is not "unhealthy"). The plugin's status file as the plugin writes it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from tests.conftest import Node

STATUS = "/run/gpunode/plugin-status.json"


def doctor(node: Node, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, dict[str, Any]]]:
    code = main(["doctor", "--json"], host=node.host())
    report = json.loads(capsys.readouterr().out)
    return code, {c["id"]: c for c in report["checks"]}


def test_unmonitored_gpus_are_a_doctor_warning(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("dgx-a100")
    gone = {
        "index": 3,
        "uuid": "GPU-3",
        "reason": "NVML refused registering its Xid/ECC events (Not Supported)",
    }
    node.file(STATUS, json.dumps({"ready": True, "resources": [], "unmonitored": [gone]}))
    code, checks = doctor(node, capsys)
    assert code == ExitCode.OK  # a warning: the GPUs are served and schedulable
    finding = checks["plugin.health"]
    assert finding["status"] == "warn"
    assert (
        finding["summary"] == "the device plugin cannot watch the health of 1 GPU(s); they stay schedulable"
    )
    assert finding["detail"] == "GPU 3 (GPU-3): NVML refused registering its Xid/ECC events (Not Supported)"
    assert finding["fix"]
    assert checks["plugin"]["status"] == "ok"


@pytest.mark.parametrize("status", [None, '{"ready": true, "unmonitored": []}', "{not json"])
def test_no_warning_without_unmonitored_gpus(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str], status: str | None
) -> None:
    fake_nvml("dgx-a100")
    if status is not None:
        node.file(STATUS, status)
    _, checks = doctor(node, capsys)
    assert "plugin.health" not in checks
    assert checks["plugin"]["status"] == "ok"


def test_a_resource_down_for_its_mps_daemon_is_a_doctor_failure(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("dgx-a100")
    resource = {
        "name": "nvidia.com/gpu",
        "socket": "gpunode-nvidia.com-gpu.sock",
        "devices": 32,
        "healthy": 0,
        "registered": True,
        "sharing": "mps",
        "down": "its MPS control daemon exited",
    }
    node.file(STATUS, json.dumps({"ready": True, "resources": [resource], "unmonitored": []}))
    code, checks = doctor(node, capsys)
    assert code == 1  # a check failed
    finding = checks["plugin.sharing"]
    assert finding["status"] == "fail"
    assert finding["summary"] == (
        "1 resource(s) served with every device unhealthy: nvidia.com/gpu: its MPS control daemon exited"
    )
    assert "control.log" in finding["fix"]
    node.file(STATUS, json.dumps({"ready": True, "resources": [{**resource, "down": None}]}))
    assert "plugin.sharing" not in doctor(node, capsys)[1]


def test_nvidia_plugin_serving_the_same_resource_is_a_failure(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("dgx-a100")
    node.socket("/var/lib/kubelet/device-plugins/nvidia-gpu.sock")
    code, checks = doctor(node, capsys)
    assert code == 1  # a check failed
    assert checks["plugin.duplicate"]["status"] == "fail"
    assert "kubectl delete ds" in checks["plugin.duplicate"]["fix"]
    assert checks["plugin"]["status"] == "ok"
