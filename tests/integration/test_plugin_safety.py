"""The device plugin on a production node: it cannot be starved or made to lie (issue 13).

`gpunode plugin run` as a real process against the fake kubelet, real gRPC clients over unix sockets,
the real pynvml on the fake libnvidia-ml.so.1. Every wait has a generous deadline and ends on the event
it waits for; nothing here measures time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.kubelet import HEALTHY, DeviceInfo, FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"
SOCKET = "gpunode-nvidia.com-gpu.sock"
DEADLINE = 60.0  # a shared 2-core machine under other engineers' test runs


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_dir) as k:
        yield k


def wait_status(plugin: PluginProcess, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The plugin's status file once it satisfies the predicate (it is rewritten on every change)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            status: dict[str, Any] = json.loads(plugin.status_path.read_text())
        except (FileNotFoundError, ValueError):  # not written yet, or caught mid-rename
            status = {}
        if status and predicate(status):
            return status
        assert time.monotonic() < deadline, f"status never matched; last: {status}\n{plugin.log()}"
        time.sleep(0.02)


def healthy(devices: list[DeviceInfo], count: int) -> bool:
    return len(devices) == count and all(d.health == HEALTHY for d in devices)


# -- "cannot monitor" is not "unhealthy" -------------------------------------------------------------


def test_nvml_without_uuid_lookup_still_advertises_every_gpu(kubelet: FakeKubelet, socket_dir: Path) -> None:
    config = socket_dir.parent / "machine.ini"
    config.write_text("[system]\nmissing = nvmlDeviceGetHandleByUUID\n" + "[gpu]\n" * 4)
    with PluginProcess(socket_dir, nvml_config=config, profile=None) as plugin:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
        plugin.wait_for_log("health monitor armed", timeout=DEADLINE)
        status = wait_status(plugin, lambda s: s["ready"])
        assert status["resources"][0]["healthy"] == 4
        assert status["unmonitored"] == []
        assert kubelet.allocatable(GPU) == 4
        assert "unhealthy" not in plugin.log()


def test_refused_event_registration_is_reported_unmonitored_and_stays_schedulable(
    kubelet: FakeKubelet, socket_dir: Path
) -> None:
    config = socket_dir.parent / "machine.ini"
    config.write_text("[system]\nmissing = nvmlDeviceRegisterEvents\n" + "[gpu]\n" * 2)
    with PluginProcess(socket_dir, nvml_config=config, profile=None) as plugin:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        devices = kubelet.wait_for_devices(GPU, lambda d: healthy(d, 2), timeout=DEADLINE)
        status = wait_status(plugin, lambda s: s["ready"] and len(s["unmonitored"]) == 2)
        assert [g["uuid"] for g in status["unmonitored"]] == [d.id for d in devices]
        assert all("registering its Xid/ECC events" in g["reason"] for g in status["unmonitored"])
        assert status["resources"][0]["healthy"] == 2 and status["resources"][0]["unmonitored"] == 2
        assert "2 unmonitored" in status["summary"]
        assert kubelet.allocatable(GPU) == 2
        assert "is not monitored" in plugin.log() and "unhealthy" not in plugin.log()
