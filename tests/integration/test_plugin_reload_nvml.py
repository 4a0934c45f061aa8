"""A SIGHUP while NVML cannot be read: the new settings apply to what is served, the devices stay.

The plugin's own event loop and gRPC servers run in this process against the fake kubelet; discovery is the
simulated node's, made to fail as NVML does when the driver goes away (the fake library cannot fail its
init while the plugin's health monitor holds it open).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpunode.errors import DriverNotLoaded
from gpunode.host import Host
from gpunode.nvml.model import Inventory
from gpunode.plugin.config import PluginConfig, load_config
from gpunode.plugin.lifecycle import Plugin
from gpunode.plugin.pluginstatus import PluginStatus
from gpunode.plugin.simulate import simulated_inventory
from tests.integration.kubelet import HEALTHY, FakeKubelet
from tests.integration.pluginproc import short_tempdir

GPU = "nvidia.com/gpu"
WAIT = 60.0


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


class FlakyDriver:
    """The simulated node's GPUs, or NVML's answer when the driver is gone, as the test says."""

    def __init__(self) -> None:
        self.gone = threading.Event()
        self.calls = 0

    def __call__(self, _config: PluginConfig) -> Inventory:
        self.calls += 1
        if self.gone.is_set():
            raise DriverNotLoaded(
                "the NVIDIA kernel module is not loaded (NVML_ERROR_DRIVER_NOT_LOADED)",
                fix="load it: modprobe nvidia",
            )
        return simulated_inventory("pcie-4")


class Statuses:
    """Every status the plugin published, for waiting on one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.latest: PluginStatus | None = None

    def __call__(self, status: PluginStatus) -> None:
        with self._cond:
            self.latest = status
            self._cond.notify_all()

    def wait(self, check: Callable[[PluginStatus], object], what: str) -> PluginStatus:
        deadline = time.monotonic() + WAIT
        with self._cond:
            while self.latest is None or not check(self.latest):
                left = deadline - time.monotonic()
                assert left > 0, f"waited {WAIT} s for {what}; last status {self.latest}"
                self._cond.wait(left)
            return self.latest


def test_a_reload_while_nvml_fails_applies_the_new_settings_and_keeps_the_devices(
    socket_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "plugin.toml"
    config.write_text('device-list-strategy = "envvar"\n')
    host = Host()

    def load() -> PluginConfig:
        return load_config(host, config_path=str(config), env={}, flags={"socket_dir": str(socket_dir)})

    driver = FlakyDriver()
    statuses = Statuses()
    with FakeKubelet(socket_dir) as kubelet:
        plugin = Plugin(host, load, driver, simulated=True, on_status=statuses)
        thread = threading.Thread(target=plugin.run, name="plugin", daemon=True)
        thread.start()
        try:
            first = kubelet.wait_registered(GPU, timeout=WAIT)
            devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4, timeout=WAIT)
            answer = kubelet.allocate(GPU, [[devices[0].id]]).container_responses[0]
            assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == devices[0].id and not answer.mounts

            # The driver goes away; the operator changes the strategy and reloads.
            driver.gone.set()
            config.write_text('device-list-strategy = "volume-mounts"\n')
            plugin.request_reload()
            status = statuses.wait(lambda s: s.nvml_error, "the reload to meet the NVML error")
            assert "NVML_ERROR_DRIVER_NOT_LOADED" in (status.nvml_error or "")
            # kubelet is asked to register again (it re-reads the options) and keeps every device, healthy.
            kubelet.wait_registered(GPU, after=first.time, timeout=WAIT)
            after = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4, timeout=WAIT)
            assert {d.id for d in after} == {d.id for d in devices}
            assert all(d.health == HEALTHY for d in after)
            # The new strategy is what Allocate answers with, though the GPUs could not be read again.
            answer = kubelet.allocate(GPU, [[devices[1].id]]).container_responses[0]
            # (NVIDIA's volume-mounts: the variable names the directory, a mount per device.)
            assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
            assert [m.host_path for m in answer.mounts] == ["/dev/null"]
            assert [m.container_path for m in answer.mounts] == [
                f"/var/run/nvidia-container-devices/{devices[1].id}"
            ]

            # Discovery is retried on its own; once the driver is back the error clears, nothing else moves.
            calls = driver.calls
            driver.gone.clear()
            statuses.wait(lambda s: s.nvml_error is None and driver.calls > calls, "the retry to succeed")
            assert {d.id for d in kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)} == {
                d.id for d in devices
            }
            answer = kubelet.allocate(GPU, [[devices[2].id]]).container_responses[0]
            assert [m.container_path for m in answer.mounts] == [
                f"/var/run/nvidia-container-devices/{devices[2].id}"
            ]
        finally:
            plugin.request_stop()
            thread.join(WAIT)
        assert not thread.is_alive()
        assert kubelet.violations == []
