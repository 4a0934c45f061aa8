"""The MIG watcher and the registry's replace(): the REAL pynvml against the fake libnvidia-ml.so.1, MIG
instances created and destroyed through its control file (mig-create / mig-destroy), with the MIG event
where the GPU lists it and without it. Waits poll with generous deadlines; nothing here times anything."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpunode.host import Host
from gpunode.nvml import Inventory, discover
from gpunode.plugin.devices import DeviceRegistry, Resource, Unit, build_resources
from gpunode.plugin.migwatch import MigWatcher, describe_change, fingerprint_of
from tests import fakenvml

DEADLINE = 10.0  # seconds; only a broken watcher gets near it
FAST = 0.05  # the periodic read in tests (the plugin's is 5 s)

# Two A100 40GB in MIG mode that never send the MIG event (their driver lacks it): polling only.
NO_EVENTS = """
[gpu]
name = NVIDIA A100-SXM4-40GB
memory_total = 40960 MiB
mig_capable = 1
mig_mode = 1
supported_events = 0x1f
[mig]
name = NVIDIA A100-SXM4-40GB MIG 1g.5gb
memory_total = 4864 MiB
gpu_instance_id = 7
compute_instance_id = 0
[gpu]
name = NVIDIA A100-SXM4-40GB
memory_total = 40960 MiB
mig_capable = 1
mig_mode = 0
supported_events = 0x1f
"""


def until(predicate: Callable[[], bool], timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


@dataclass
class Node:
    ctl: Path
    root: Path
    watchers: list[MigWatcher] = field(default_factory=list)
    calls: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def discover(self) -> Inventory:
        return discover(Host(root=self.root))

    def watch(
        self,
        inventory: Inventory | None = None,
        *,
        poll_interval: float = FAST,
        slow_poll_interval: float = FAST,
    ) -> MigWatcher:
        gpus = (inventory or self.discover()).gpus
        watcher = MigWatcher(
            gpus, self.called, poll_interval=poll_interval, slow_poll_interval=slow_poll_interval
        )
        self.watchers.append(watcher)
        watcher.start()
        assert watcher.wait_ready(DEADLINE), "the watcher never read the GPUs"
        return watcher

    def called(self) -> None:
        with self.lock:
            self.calls.append(time.monotonic())

    def inject(self, *lines: str) -> None:
        # One write: the fake applies the lines in one poll, as one burst.
        with open(self.ctl, "a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))

    def changes(self) -> int:
        with self.lock:
            return len(self.calls)


@pytest.fixture
def make_node(fake_nvml: Callable[..., None], tmp_path: Path) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make(profile: str | None = "mig", *, config: str | None = None) -> Node:
        ctl = tmp_path / "control"
        ctl.touch()
        path = None
        if config is not None:
            path = tmp_path / "machine.ini"
            path.write_text(config)
        fake_nvml(profile if path is None else None, config=path, control=ctl)
        node = Node(ctl, tmp_path)
        nodes.append(node)
        return node

    yield make
    # Before fake_nvml's teardown: every watcher must give its NVML reference back.
    for node in nodes:
        for w in node.watchers:
            assert w.stop(DEADLINE)
            assert not w.running


# ---------------------------------------------------------------------------------------------
# When it runs
# ---------------------------------------------------------------------------------------------


def test_wanted_only_for_a_mig_strategy_on_a_mig_capable_node(make_node: Callable[..., Node]) -> None:
    mig = make_node("mig").discover().gpus
    assert MigWatcher.wanted(mig, "mixed") and MigWatcher.wanted(mig, "single")
    assert not MigWatcher.wanted(mig, "none")
    plain = make_node("pcie-4").discover().gpus
    assert not MigWatcher.wanted(plain, "mixed")


# ---------------------------------------------------------------------------------------------
# The event path
# ---------------------------------------------------------------------------------------------


def test_the_mig_event_is_registered_where_the_gpu_has_it(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    inventory = node.discover()
    watcher = node.watch(inventory)
    assert watcher.with_events == {g.uuid for g in inventory.gpus}
    assert watcher.served == fingerprint_of(inventory.gpus)


def test_the_mig_event_is_tried_where_the_supported_mask_leaves_it_out(
    make_node: Callable[..., Node],
) -> None:
    # A driver whose nvmlDeviceGetSupportedEventTypes lacks the MIG event but delivers it (as DCGM assumes
    # of newer drivers): registered all the same, and a change is told at once, not by a periodic read.
    config = NO_EVENTS.replace(
        "supported_events = 0x1f", "supported_events = 0x1f\nregistrable_events = 0x11f"
    )
    node = make_node(None, config=config)
    inventory = node.discover()
    watcher = node.watch(inventory, poll_interval=3600, slow_poll_interval=3600)
    assert watcher.with_events == {g.uuid for g in inventory.gpus}
    node.inject("mig-create 0 3g.20gb 2")
    assert until(lambda: node.changes() == 1)


def test_a_new_event_set_is_followed_by_a_read_at_once(make_node: Callable[..., Node]) -> None:
    """Re-arming (the MIG-capable GPUs changed, or a failed wait) frees the old event set, and what it had
    queued is lost: the watcher reads at once instead of at its next periodic read (an hour here)."""
    import dataclasses

    node = make_node("mig")
    inventory = node.discover()
    watcher = node.watch(inventory, poll_interval=3600, slow_poll_interval=3600)
    gpu0 = inventory.gpus[0]
    assert gpu0.mig_devices
    # The plugin now serves GPU 0 alone, and (as if an event had been lost) without its instances: another
    # set of GPUs, so a new event set, and the read that follows finds what the plugin lacks.
    watcher.update([dataclasses.replace(gpu0, mig_devices=())])
    assert until(lambda: node.changes() == 1)
    assert watcher.served == {gpu0.uuid: fingerprint_of(inventory.gpus)[gpu0.uuid or ""]}


def test_a_created_instance_is_reported_once(make_node: Callable[..., Node]) -> None:
    # The periodic read is an hour away: only the event can tell the watcher.
    node = make_node("mig")
    before = node.discover()
    watcher = node.watch(before, poll_interval=3600, slow_poll_interval=3600)
    node.inject("mig-create 0 3g.20gb 2")
    assert until(lambda: node.changes() == 1)
    after = node.discover()
    assert watcher.served == fingerprint_of(after.gpus) != fingerprint_of(before.gpus)
    assert "1 MIG device created" in describe_change(fingerprint_of(before.gpus), watcher.served)


def test_a_repartition_burst_is_read_once_whole(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    watcher = node.watch(poll_interval=3600, slow_poll_interval=3600)
    # Three instances replaced by five: eight events in a row. One read once they are quiet, of the end state.
    node.inject(
        "mig-destroy 0 7",
        "mig-destroy 0 8",
        "mig-destroy 0 3",
        *(f"mig-create 0 1g.5gb {gi}" for gi in range(9, 14)),
    )
    assert until(lambda: node.changes() >= 1)
    gpus = node.discover().gpus
    assert watcher.served == fingerprint_of(gpus)
    assert {gi for _, gi, _ in watcher.served[gpus[0].uuid or ""][1]} == {9, 10, 11, 12, 13}
    assert node.changes() == 1


def test_a_change_between_discovery_and_start_is_not_missed(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    stale = node.discover()
    node.inject("mig-destroy 0 3")
    node.discover()  # any NVML call applies the line
    watcher = node.watch(stale, poll_interval=3600, slow_poll_interval=3600)
    assert until(lambda: node.changes() == 1)
    assert watcher.served == fingerprint_of(node.discover().gpus)


def test_update_takes_what_the_plugin_serves_now(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    watcher = node.watch(poll_interval=FAST, slow_poll_interval=FAST)
    node.inject("mig-create 0 1g.5gb 9")
    assert until(lambda: node.changes() == 1)
    watcher.update(node.discover().gpus)  # the plugin re-read the GPUs
    checks = watcher.checks
    assert until(lambda: watcher.checks >= checks + 5)  # several reads of an unchanged node
    assert node.changes() == 1
    node.inject("mig-destroy 0 9")
    assert until(lambda: node.changes() == 2)


def test_nothing_changed_nothing_reported(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    watcher = node.watch(poll_interval=FAST, slow_poll_interval=FAST)
    assert until(lambda: watcher.checks >= 10)
    node.inject("xid 0 79")  # other events are no MIG change
    assert until(lambda: watcher.checks >= 20)
    assert node.changes() == 0


# ---------------------------------------------------------------------------------------------
# The periodic path: GPUs without the event, and MIG mode flips (no event on any driver)
# ---------------------------------------------------------------------------------------------


def test_without_the_event_the_periodic_read_finds_the_change(make_node: Callable[..., Node]) -> None:
    node = make_node(config=NO_EVENTS)
    before = node.discover()
    watcher = node.watch(before, poll_interval=FAST)
    assert watcher.with_events == frozenset()
    node.inject("mig-create 0 2g.10gb 5")
    assert until(lambda: node.changes() == 1)
    assert watcher.served == fingerprint_of(node.discover().gpus)
    node.inject("mig-destroy 0 7", "mig-destroy 0 5")
    assert until(lambda: node.changes() == 2)
    gpu0 = watcher.served[before.gpus[0].uuid or ""]
    assert gpu0 == (True, ())


def test_a_mig_mode_flip_is_found_by_the_slow_read_where_events_exist(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    before = node.discover()
    watcher = node.watch(before, poll_interval=FAST, slow_poll_interval=FAST * 2)
    assert watcher.with_events == {g.uuid for g in before.gpus}
    node.inject("mig 1 1")  # a GPU reset turned MIG on: no event
    assert until(lambda: node.changes() == 1)
    assert "MIG mode on" in describe_change(fingerprint_of(before.gpus), watcher.served)


# ---------------------------------------------------------------------------------------------
# NVML trouble and stopping
# ---------------------------------------------------------------------------------------------


def test_a_lost_gpu_is_no_change_and_the_watcher_carries_on(
    make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpunode.plugin.migwatch")
    node = make_node("mig")
    watcher = node.watch(poll_interval=FAST, slow_poll_interval=FAST)
    node.inject("lost 0")
    checks = watcher.checks
    assert until(lambda: watcher.checks >= checks + 5)
    assert node.changes() == 0  # a GPU it cannot read keeps its last known geometry
    node.inject("recover 0", "mig-create 0 1g.5gb 9")
    assert until(lambda: node.changes() == 1)
    assert watcher.running


def test_nvml_init_failing_is_retried_not_fatal(
    make_node: Callable[..., Node], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpunode.plugin.migwatch")
    node = make_node("mig")
    inventory = node.discover()
    broken = tmp_path / "broken.ini"
    broken.write_text("[system]\ninit_error = 9\n")
    fakenvml.load_into_process(None, config=broken, control=node.ctl)  # the driver went away
    watcher = MigWatcher(inventory.gpus, node.called, poll_interval=FAST)
    node.watchers.append(watcher)
    watcher.start()
    assert until(lambda: "trying again in" in caplog.text)
    assert watcher.running and node.changes() == 0
    fakenvml.load_into_process("mig", control=node.ctl)  # back
    assert watcher.wait_ready(DEADLINE)


def test_stop_is_prompt_and_gives_nvml_back(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    watcher = node.watch()
    assert watcher.running
    assert watcher.stop(DEADLINE)
    assert not watcher.running
    node.watchers.clear()
    import pynvml

    # The watcher's reference is gone: one init and one shutdown leave NVML uninitialised.
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()


# ---------------------------------------------------------------------------------------------
# DeviceRegistry.replace: unchanged resources are not resent, gone MIG instances lose their marks
# ---------------------------------------------------------------------------------------------


def test_replace_bumps_only_the_resources_that_changed(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    registry = DeviceRegistry(build_resources(node.discover(), mig_strategy="mixed"))
    versions = {r.name: registry.snapshot(r.name)[0] for r in registry.resources()}
    registry.replace(build_resources(node.discover(), mig_strategy="mixed"))  # nothing changed
    assert {r.name: registry.snapshot(r.name)[0] for r in registry.resources()} == versions
    node.inject("mig-create 0 1g.5gb 9")
    registry.replace(build_resources(node.discover(), mig_strategy="mixed"))
    after = {r.name: registry.snapshot(r.name)[0] for r in registry.resources()}
    assert after["nvidia.com/mig-1g.5gb"] == versions["nvidia.com/mig-1g.5gb"] + 1
    assert after["nvidia.com/mig-2g.10gb"] == versions["nvidia.com/mig-2g.10gb"]
    assert after["nvidia.com/gpu"] == versions["nvidia.com/gpu"]


def test_replace_drops_the_marks_of_gone_mig_instances(make_node: Callable[..., Node]) -> None:
    node = make_node("mig")
    registry = DeviceRegistry(build_resources(node.discover(), mig_strategy="mixed"))
    registry.mark(Unit(0, (7, 0)), "Xid 94")
    registry.mark(Unit(0, (3, 0)), "Xid 94")
    v2g = registry.snapshot("nvidia.com/mig-2g.10gb")[0]
    # gi 7 destroyed and made again: a new device under the same ids, healthy. gi 3 stays, still marked.
    node.inject("mig-destroy 0 7", "mig-create 0 1g.5gb 7")
    registry.replace(build_resources(node.discover(), mig_strategy="mixed"))
    assert registry.unhealthy_units() == {Unit(0, (3, 0)): "Xid 94"}
    small = registry.snapshot("nvidia.com/mig-1g.5gb")[1]
    assert [h.healthy for h in small] == [True, True]
    version, big = registry.snapshot("nvidia.com/mig-2g.10gb")
    assert [h.reason for h in big] == ["Xid 94"] and version == v2g


def test_a_gpu_mark_survives_a_moment_with_no_instance_served(make_node: Callable[..., Node]) -> None:
    """Mid-repartition a MIG GPU can serve no device at all; its GPU-wide mark (an Xid) must still be
    there for the instances that come next, as long as the discovery still sees the GPU."""
    node = make_node("mig")

    def served() -> tuple[list[Resource], dict[str, int]]:
        inventory = node.discover()
        gpus = {g.uuid: g.index for g in inventory.gpus if g.uuid}
        return list(build_resources(inventory, mig_strategy="mixed")), gpus

    registry = DeviceRegistry(served()[0])
    registry.mark(Unit(0), "Xid 48")
    node.inject("mig-destroy 0 7", "mig-destroy 0 8", "mig-destroy 0 3")
    registry.replace(*served())
    assert registry.unhealthy_units() == {Unit(0): "Xid 48"}
    node.inject("mig-create 0 3g.20gb 1")
    registry.replace(*served())
    [state] = registry.snapshot("nvidia.com/mig-3g.20gb")[1]
    assert not state.healthy and state.reason == "Xid 48"
    # Without the discovery's GPUs (the old behaviour) the mark had nothing to follow.
    bare = DeviceRegistry(served()[0])
    bare.mark(Unit(0), "Xid 48")
    node.inject("mig-destroy 0 1")
    bare.replace(served()[0])
    assert bare.unhealthy_units() == {}


def test_a_wait_that_keeps_failing_backs_off(
    make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    """Arming works, every wait fails: the retries must still back off (a successful arm used to reset the
    backoff, and the watcher retried every 0.1 s for ever, two log lines each time)."""
    caplog.set_level(logging.INFO, logger="gpunode.plugin.migwatch")
    node = make_node(
        None,
        config="[system]\nunsupported = nvmlEventSetWait_v2\n[gpu]\nname = NVIDIA A100-SXM4-40GB\n"
        "memory_total = 40960 MiB\nmig_capable = 1\nmig_mode = 1\n[mig]\n"
        "name = NVIDIA A100-SXM4-40GB MIG 1g.5gb\nmemory_total = 4864 MiB\ngpu_instance_id = 7\n"
        "compute_instance_id = 0\n",
    )
    node.watch()

    def delays() -> list[float]:
        found = re.findall(r"trying again in ([0-9.]+)s", caplog.text)
        return [float(d) for d in found]

    assert until(lambda: len(delays()) >= 4)
    first = delays()[:4]
    assert first == sorted(first) and first[3] > first[0], first
