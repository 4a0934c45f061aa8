"""MIG geometry changed while `gpunode plugin run` serves (issue 17): the plugin notices on its own and
re-advertises, through the fake kubelet, with the real pynvml over the fake NVML (mig-create / mig-destroy
control lines). Both ways the plugin learns of a change: the MIG event, and the periodic read on a GPU
that does not send it. Resources the change did not touch must keep their registration and stream: no new
Register, no new ListAndWatch message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import fakenvml
from tests.integration.kubelet import FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"
SMALL = "nvidia.com/mig-1g.5gb"
MEDIUM = "nvidia.com/mig-2g.10gb"
LARGE = "nvidia.com/mig-3g.20gb"
WAIT = 60.0  # the periodic read is every 5 s; only a broken plugin gets near this

# The `mig` profile's machine with a driver that never sends the MIG event: the periodic read only.
NO_EVENTS = """
[system]
driver_version = 550.54.15
[gpu]
name = NVIDIA A100-SXM4-40GB
memory_total = 40960 MiB
pci_bus_id = 00000000:07:00.0
mig_capable = 1
mig_mode = 1
supported_events = 0x1f
[mig]
name = NVIDIA A100-SXM4-40GB MIG 1g.5gb
memory_total = 4864 MiB
gpu_instance_id = 7
compute_instance_id = 0
[mig]
name = NVIDIA A100-SXM4-40GB MIG 1g.5gb
memory_total = 4864 MiB
gpu_instance_id = 8
compute_instance_id = 0
[mig]
name = NVIDIA A100-SXM4-40GB MIG 2g.10gb
memory_total = 9984 MiB
gpu_instance_id = 3
compute_instance_id = 0
slice_count = 2
[gpu]
name = NVIDIA A100-SXM4-40GB
memory_total = 40960 MiB
pci_bus_id = 00000000:0F:00.0
mig_capable = 1
mig_mode = 0
supported_events = 0x1f
"""


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_dir) as k:
        yield k


def _untouched(kubelet: FakeKubelet, resource: str, registrations: int, messages: int) -> None:
    """The resource kept its registration and its stream, and kubelet got no message for it."""
    assert len(kubelet.registrations(resource)) == registrations
    assert len(kubelet.updates(resource)) == messages
    assert kubelet.stream_ends(resource) == []


def _walk_through_changes(kubelet: FakeKubelet, plugin: PluginProcess, control: Path) -> None:
    kubelet.wait_registered(GPU)
    kubelet.wait_registered(MEDIUM)
    small = kubelet.wait_for_devices(SMALL, lambda d: len(d) == 2)
    kubelet.wait_for_devices(MEDIUM, lambda d: len(d) == 1)
    kubelet.wait_for_devices(GPU, lambda d: len(d) == 1)  # GPU 1, MIG off: a whole GPU
    plugin.wait_for_log("MIG watcher")
    gpu_messages = len(kubelet.updates(GPU))
    medium_messages = len(kubelet.updates(MEDIUM))

    # A 3g.20gb instance in the free slices: a resource of its own, registered and listed.
    fakenvml.inject(control, "mig-create 0 3g.20gb 2")
    registration = kubelet.wait_registered(LARGE, timeout=WAIT)
    assert registration.endpoint == "gpunode-nvidia.com-mig-3g.20gb.sock"
    [large] = kubelet.wait_for_devices(LARGE, lambda d: len(d) == 1, timeout=WAIT)
    assert large.id.startswith("MIG-") and large.health == "Healthy"
    _untouched(kubelet, GPU, 1, gpu_messages)
    _untouched(kubelet, MEDIUM, 1, medium_messages)
    assert kubelet.latest_devices(SMALL) == small
    # The health monitor knows the new instance at once (it took the new layout; no new event set): an
    # Xid naming only its GPU instance reaches kubelet.
    fakenvml.inject(control, f"xid 0:2:{0xFFFFFFFF} 79")
    kubelet.wait_for_devices(LARGE, lambda d: [x.health for x in d] == ["Unhealthy"], timeout=WAIT)

    # One 1g.5gb destroyed: its resource's list shrinks, on the same stream.
    small_registrations = len(kubelet.registrations(SMALL))
    fakenvml.inject(control, "mig-destroy 0 8")
    left = kubelet.wait_for_devices(SMALL, lambda d: len(d) == 1, timeout=WAIT)
    assert left == small[:1] or left == small[1:]
    assert len(kubelet.registrations(SMALL)) == small_registrations
    assert kubelet.stream_ends(SMALL) == []
    # ... and made again: the list grows, with a new device (a new UUID).
    fakenvml.inject(control, "mig-create 0 1g.5gb 8")
    again = kubelet.wait_for_devices(SMALL, lambda d: len(d) == 2, timeout=WAIT)
    assert {d.id for d in again} - {d.id for d in small}

    # The only 2g.10gb destroyed: that resource is no longer served (its socket is gone).
    fakenvml.inject(control, "mig-destroy 0 3")
    plugin.wait_for_log(f"{MEDIUM}: no longer served", timeout=WAIT)
    assert not (kubelet.socket_dir / "gpunode-nvidia.com-mig-2g.10gb.sock").exists()
    # Its stream said so before it ended: an empty list, so kubelet's capacity drops to 0 at once.
    kubelet.wait_for_devices(MEDIUM, lambda d: d == [], timeout=WAIT)

    # Whatever else happened, nvidia.com/gpu never heard of it, and nothing was re-registered.
    _untouched(kubelet, GPU, 1, gpu_messages)
    assert len(kubelet.registrations(LARGE)) == 1
    assert kubelet.stream_ends(LARGE) == [] and kubelet.stream_ends(SMALL) == []
    assert kubelet.violations == []
    # One event set for health all along: no MIG change re-armed the health monitor.
    log = plugin.log()
    assert log.count("health monitor armed") == 1 and "GPU health checks stopped" not in log


def test_mig_changes_reach_kubelet_through_the_mig_event(
    kubelet: FakeKubelet, socket_dir: Path, tmp_path: Path
) -> None:
    control = tmp_path / "nvml-control"
    control.write_text("")
    with PluginProcess(socket_dir, ["--mig-strategy", "mixed"], profile="mig", control=control) as plugin:
        _walk_through_changes(kubelet, plugin, control)
        assert "send no MIG change events" not in plugin.log()
        assert "MIG change events registered on 2 GPU(s)" in plugin.log()


def test_mig_changes_reach_kubelet_without_the_event_by_the_periodic_read(
    kubelet: FakeKubelet, socket_dir: Path, tmp_path: Path
) -> None:
    control = tmp_path / "nvml-control"
    control.write_text("")
    config = tmp_path / "no-mig-event.ini"
    config.write_text(NO_EVENTS)
    args = ["--mig-strategy", "mixed"]
    with PluginProcess(socket_dir, args, profile=None, nvml_config=config, control=control) as plugin:
        _walk_through_changes(kubelet, plugin, control)
        assert "GPU 0, GPU 1 send no MIG change events" in plugin.log()


def test_mig_mode_turned_on_by_a_reset_is_found_by_the_periodic_read(
    kubelet: FakeKubelet, socket_dir: Path, tmp_path: Path
) -> None:
    control = tmp_path / "nvml-control"
    control.write_text("")
    with PluginProcess(socket_dir, ["--mig-strategy", "mixed"], profile="mig", control=control) as plugin:
        kubelet.wait_for_devices(GPU, lambda d: len(d) == 1)
        plugin.wait_for_log("MIG watcher")
        # GPU 1's MIG mode turned on (no MIG event on any driver): it leaves nvidia.com/gpu, whose last
        # device it was. With no MIG devices yet it serves nothing; the slow read (30 s) finds it.
        fakenvml.inject(control, "mig 1 1")
        plugin.wait_for_log(f"{GPU}: no longer served", timeout=90)
        assert "MIG mode on" in plugin.log()
