"""The plugin's health monitor: the REAL pynvml against the fake libnvidia-ml.so.1, faults injected through
its control file. Waits poll the registry with generous deadlines; the monitor itself is event driven."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpunode.errors import ConfigError
from gpunode.host import Host
from gpunode.nvml import Inventory, discover
from gpunode.plugin.devices import DeviceRegistry, Sharing, Unit, build_resources
from gpunode.plugin.health import (
    APPLICATION_XIDS,
    LOST_REASON,
    HealthMonitor,
    HealthSettings,
    apply_dp_environment,
)
from tests import fakenvml

DEADLINE = 10.0  # seconds; only a broken monitor gets near it
LOGGER = "gpunode.plugin.health"


def until(predicate: Callable[[], bool], timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


@dataclass
class Node:
    """A simulated node: its control file, what discovery found and the registry a monitor reports to."""

    ctl: Path
    inventory: Inventory
    registry: DeviceRegistry
    monitors: list[HealthMonitor] = field(default_factory=list)

    def monitor(
        self, settings: HealthSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> HealthMonitor:
        m = HealthMonitor(self.registry, self.inventory.gpus, settings or HealthSettings(), clock=clock)
        self.monitors.append(m)
        m.start()
        return m

    def armed(
        self, settings: HealthSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> HealthMonitor:
        m = self.monitor(settings, clock)
        assert m.wait_ready(DEADLINE), "the monitor never armed"
        return m

    def inject(self, line: str) -> None:
        fakenvml.inject(self.ctl, line)

    def unhealthy(self) -> dict[Unit, str]:
        return self.registry.unhealthy_units()

    def devices(self) -> dict[str, str | None]:
        """Every served device ID → why it is unhealthy (None: healthy)."""
        out: dict[str, str | None] = {}
        for resource in self.registry.resources():
            for h in self.registry.snapshot(resource.name)[1]:
                out[h.device.id] = h.reason
        return out

    def uuid(self, index: int) -> str:
        uuid = self.inventory.gpus[index].uuid
        assert uuid is not None
        return uuid


@pytest.fixture
def make_node(fake_nvml: Callable[..., None], tmp_path: Path) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make(
        profile: str | None = "pcie-4",
        *,
        config: Path | None = None,
        replicas: int = 2,
        mig_strategy: str = "none",
    ) -> Node:
        ctl = tmp_path / "control"
        ctl.touch()
        fake_nvml(profile, config=config, control=ctl)
        inventory = discover(Host(root=tmp_path))
        resources = build_resources(inventory, mig_strategy=mig_strategy, sharing=Sharing(replicas=replicas))
        node = Node(ctl, inventory, DeviceRegistry(resources))
        nodes.append(node)
        return node

    yield make
    # Before fake_nvml's teardown: every monitor must give its NVML reference back.
    for node in nodes:
        for m in node.monitors:
            assert m.stop(DEADLINE)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


# ---------------------------------------------------------------------------------------------
# Settings and NVIDIA's DP_* variables
# ---------------------------------------------------------------------------------------------


def test_default_settings_ignore_the_application_xids_only() -> None:
    s = HealthSettings()
    assert s.enabled and s.ignored_xids == APPLICATION_XIDS == {13, 31, 43, 45, 68, 109}
    assert [x for x in (13, 31, 43, 45, 48, 68, 79, 94, 109) if s.is_critical(x)] == [48, 79, 94]
    assert HealthSettings(critical_xids=frozenset({13})).is_critical(13)  # critical wins over ignored
    assert HealthSettings(all_xids_critical=True).is_critical(31)


# (DP_DISABLE_HEALTHCHECKS, DP_ENABLE_HEALTHCHECKS) → (enabled, ignored, critical, every Xid critical);
# the cases of NVIDIA's own TestGetDisabledHealthCheckXids plus their neighbours.
DP_CASES = [
    ("", "", (True, APPLICATION_XIDS, frozenset(), False)),
    ("all", "", (False, APPLICATION_XIDS, frozenset(), False)),
    ("xids", "", (False, APPLICATION_XIDS, frozenset(), False)),
    (" ALL ", "", (False, APPLICATION_XIDS, frozenset(), False)),
    ("48,all", "", (False, APPLICATION_XIDS | {48}, frozenset(), False)),
    ("68", "", (True, APPLICATION_XIDS, frozenset(), False)),
    (" 48 , 79 ,, ", "", (True, APPLICATION_XIDS | {48, 79}, frozenset(), False)),
    ("", "all", (True, APPLICATION_XIDS, frozenset(), True)),
    ("", "31", (True, APPLICATION_XIDS, frozenset({31}), False)),
    ("11", "11", (True, APPLICATION_XIDS | {11}, frozenset({11}), False)),
    ("all", "all", (True, APPLICATION_XIDS, frozenset(), True)),  # enable=all keeps the checks on
    ("all", "79", (False, APPLICATION_XIDS, frozenset({79}), False)),  # as NVIDIA's plugin: still all off
]


@pytest.mark.parametrize(("disable", "enable", "expected"), DP_CASES)
def test_dp_environment_as_nvidia_reads_it(
    disable: str, enable: str, expected: tuple[bool, frozenset[int], frozenset[int], bool]
) -> None:
    env = {"DP_DISABLE_HEALTHCHECKS": disable, "DP_ENABLE_HEALTHCHECKS": enable}
    s = apply_dp_environment(HealthSettings(), env)
    assert (s.enabled, s.ignored_xids, s.critical_xids, s.all_xids_critical) == expected
    if disable == "11" and enable == "11":
        assert s.is_critical(11)


def test_dp_environment_adds_to_the_configured_settings() -> None:
    configured = HealthSettings(ignored_xids=frozenset({13}), critical_xids=frozenset({94}))
    s = apply_dp_environment(configured, {"DP_DISABLE_HEALTHCHECKS": "48,79", "DP_ENABLE_HEALTHCHECKS": "13"})
    assert (s.ignored_xids, s.critical_xids) == (frozenset({13, 48, 79}), frozenset({13, 94}))
    assert apply_dp_environment(configured, {}) == configured
    assert s.recovery_quiet_period == configured.recovery_quiet_period


def test_dp_disable_all_with_a_list_to_enable_says_the_list_has_no_effect(
    logs: pytest.LogCaptureFixture,
) -> None:
    apply_dp_environment(HealthSettings(), {"DP_DISABLE_HEALTHCHECKS": "all", "DP_ENABLE_HEALTHCHECKS": "79"})
    assert "have no effect" in logs.text


@pytest.mark.parametrize(
    "bad", ["abc", "48,abc", "-68", "+68", "0x4f", "4 8", "48;79", "0", "18446744073709551616"]
)
@pytest.mark.parametrize("variable", ["DP_DISABLE_HEALTHCHECKS", "DP_ENABLE_HEALTHCHECKS"])
def test_a_bad_dp_value_is_a_config_error_naming_it(variable: str, bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_dp_environment(HealthSettings(), {variable: bad})
    assert variable in info.value.message and repr(bad) in info.value.message
    assert info.value.fix


@pytest.mark.parametrize(
    "kwargs",
    [
        {"recovery_quiet_period": -1.0},
        {"recovery_quiet_period": float("nan")},
        {"ignored_xids": frozenset({-1})},
        {"critical_xids": frozenset({"79"})},
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        HealthSettings(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------


def test_critical_xid_marks_the_gpu_and_every_replica(
    make_node: Callable[..., Node], logs: pytest.LogCaptureFixture
) -> None:
    node = make_node("pcie-4", replicas=2)
    node.armed()
    node.inject("xid 0 79")
    assert until(lambda: Unit(0) in node.unhealthy())
    devices = node.devices()
    u0 = node.uuid(0)
    assert {i: r for i, r in devices.items() if r} == {
        f"{u0}::0": "Xid 79 (GPU has fallen off the bus)",
        f"{u0}::1": "Xid 79 (GPU has fallen off the bus)",
    }
    assert len(devices) == 8
    assert f"GPU 0 ({u0}) unhealthy: Xid 79 (GPU has fallen off the bus)" in logs.text


def test_application_xid_is_ignored(make_node: Callable[..., Node], logs: pytest.LogCaptureFixture) -> None:
    node = make_node()
    node.armed()
    node.inject("xid 0 13")
    node.inject("xid 1 48")  # events come in order: once GPU 1 is marked, the Xid 13 was handled
    assert until(lambda: Unit(1) in node.unhealthy())
    assert set(node.unhealthy()) == {Unit(1)}
    assert "Xid 13 (graphics engine exception) on GPU 0" in logs.text and "ignored" in logs.text


def test_dp_disable_all_starts_nothing(
    make_node: Callable[..., Node], logs: pytest.LogCaptureFixture
) -> None:
    node = make_node()
    m = node.monitor(apply_dp_environment(HealthSettings(), {"DP_DISABLE_HEALTHCHECKS": "all"}))
    node.inject("xid 0 79")
    assert not m.running and not m.wait_ready(0.0)
    assert node.unhealthy() == {}
    assert "health checks are off" in logs.text
    assert m.stop()


def test_dp_disable_list_ignores_those_xids(make_node: Callable[..., Node]) -> None:
    node = make_node()
    node.armed(apply_dp_environment(HealthSettings(), {"DP_DISABLE_HEALTHCHECKS": "79"}))
    node.inject("xid 0 79")
    node.inject("xid 1 48")
    assert until(lambda: Unit(1) in node.unhealthy())
    assert set(node.unhealthy()) == {Unit(1)}


def test_dp_enable_makes_an_application_xid_critical(make_node: Callable[..., Node]) -> None:
    node = make_node()
    node.armed(apply_dp_environment(HealthSettings(), {"DP_ENABLE_HEALTHCHECKS": "13"}))
    node.inject("xid 2 31")  # still ignored
    node.inject("xid 3 13")
    assert until(lambda: Unit(3) in node.unhealthy())
    assert node.unhealthy() == {Unit(3): "Xid 13 (graphics engine exception)"}


def test_double_bit_ecc_marks_the_gpu(make_node: Callable[..., Node]) -> None:
    node = make_node()
    node.armed()
    node.inject("ecc 2")
    assert until(lambda: Unit(2) in node.unhealthy())
    assert node.unhealthy() == {Unit(2): "double-bit ECC error"}


def mig_devices(node: Node) -> dict[tuple[int, int] | None, str | None]:
    """(gi, ci) of each MIG device on GPU 0 (None for GPU 1, served whole) → its unhealthy reason."""
    out: dict[tuple[int, int] | None, str | None] = {}
    for resource in node.registry.resources():
        for h in node.registry.snapshot(resource.name)[1]:
            out[h.device.unit.instance] = h.reason
    return out


def test_mig_xid_marks_only_that_instance_and_a_gpu_xid_marks_all(make_node: Callable[..., Node]) -> None:
    node = make_node("mig", replicas=1, mig_strategy="mixed")
    assert mig_devices(node) == {(7, 0): None, (8, 0): None, (3, 0): None, None: None}
    node.armed()
    node.inject("xid 0:7:0 79")
    assert until(lambda: Unit(0, (7, 0)) in node.unhealthy())
    assert mig_devices(node) == {
        (7, 0): "Xid 79 (GPU has fallen off the bus)",
        (8, 0): None,
        (3, 0): None,
        None: None,
    }
    node.inject("xid 0:8:0 43")  # an application error in one instance: ignored
    node.inject("xid 0 94")
    assert until(lambda: Unit(0) in node.unhealthy())
    healths = mig_devices(node)
    assert healths.pop(None) is None  # GPU 1
    assert all(reason is not None for reason in healths.values())
    assert healths[(8, 0)] == healths[(3, 0)] == "Xid 94 (contained ECC error)"


def test_a_new_mig_layout_is_taken_without_a_new_event_set(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """A MIG change (the MIG watcher's re-discovery): the running monitor takes the new instances without
    re-arming, so no Xid can fall into a gap between two event sets; an instance created since is
    watched, and a destroyed one's pending recovery is dropped."""
    node = make_node("mig", replicas=1, mig_strategy="mixed")
    settings = HealthSettings(recovery_quiet_period=3600)
    monitor = node.armed(settings)
    node.inject("xid 0:8:0 79")
    assert until(lambda: Unit(0, (8, 0)) in node.unhealthy())
    node.inject("mig-destroy 0 8")
    node.inject("mig-create 0 1g.5gb 9")
    assert until(
        lambda: {m.gpu_instance_id for m in discover(Host(root=tmp_path)).gpus[0].mig_devices} == {7, 3, 9}
    )
    after = discover(Host(root=tmp_path))
    node.registry.replace(
        build_resources(after, mig_strategy="mixed", sharing=Sharing(replicas=1)),
        {g.uuid: g.index for g in after.gpus if g.uuid},
    )
    assert monitor.update(after.gpus, settings)
    # An Xid naming only the new GPU instance marks its compute instance: the monitor knows it now.
    node.inject(f"xid 0:9:{0xFFFFFFFF} 79")
    assert until(lambda: Unit(0, (9, 0)) in node.unhealthy())
    assert monitor.arms == 1  # the same event set throughout
    assert Unit(0, (8, 0)) not in monitor._troubles  # gone with its instance
    # Another set of GPUs, or other settings, takes a new monitor.
    assert not monitor.update(after.gpus[:1], settings)
    assert not monitor.update(after.gpus, HealthSettings(recovery_quiet_period=1))


def test_mig_xid_naming_only_a_gpu_instance_marks_its_compute_instances(
    make_node: Callable[..., Node],
) -> None:
    node = make_node("mig", replicas=1, mig_strategy="mixed")
    node.armed()
    node.inject(f"xid 0:3:{0xFFFFFFFF} 79")
    assert until(lambda: Unit(0, (3, 0)) in node.unhealthy())
    assert set(node.unhealthy()) == {Unit(0, (3, 0))}


def test_only_supported_event_types_are_registered(
    make_node: Callable[..., Node], tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "machine.ini"
    config.write_text("[gpu]\nsupported_events = 0x8\n[gpu]\nsupported_events = 0\n[gpu]\n")
    node = make_node(None, config=config, replicas=1)
    node.armed()
    assert "events registered on 2 of 3 GPU(s)" in logs.text
    expected = f"GPU 1 ({node.uuid(1)}) is not monitored: it supports no Xid or double-bit ECC events"
    assert expected in logs.text
    assert f"GPU 0 ({node.uuid(0)}) supports only Xid events" in logs.text
    node.inject("xid 0 79")
    node.inject("ecc 2")
    assert until(lambda: {Unit(0), Unit(2)} <= set(node.unhealthy()))


# ---------------------------------------------------------------------------------------------
# Lost GPUs, recovery, failed waits
# ---------------------------------------------------------------------------------------------


def test_lost_gpu_is_marked_and_recovers_after_the_quiet_period(
    make_node: Callable[..., Node], logs: pytest.LogCaptureFixture
) -> None:
    node = make_node()
    node.armed(HealthSettings(recovery_quiet_period=0.2))
    node.inject("lost 1")  # the wait returns GPU_IS_LOST without saying which GPU: the monitor probes
    assert until(lambda: Unit(1) in node.unhealthy())
    assert node.unhealthy() == {Unit(1): LOST_REASON}
    assert f"GPU 1 ({node.uuid(1)}) unhealthy: lost from the bus" in logs.text
    node.inject("recover 1")
    assert until(lambda: node.unhealthy() == {})
    assert f"GPU 1 ({node.uuid(1)}) healthy again" in logs.text
    # Its events were registered again: a new Xid on it is seen.
    node.inject("xid 1 79")
    assert until(lambda: Unit(1) in node.unhealthy())


def test_repeated_lost_reports_make_a_new_event_set_without_the_lost_gpu(
    make_node: Callable[..., Node], logs: pytest.LogCaptureFixture
) -> None:
    node = make_node()
    m = node.armed()
    node.inject("lost 1")
    assert until(lambda: Unit(1) in node.unhealthy())
    before = m.arms
    node.inject("recover 1")
    node.inject("lost 1")  # a second GPU_IS_LOST from the wait, for a GPU already known lost
    assert until(lambda: m.arms > before and m.wait_ready(0.0))
    assert "NVML keeps reporting a lost GPU" in logs.text
    assert node.unhealthy() == {Unit(1): LOST_REASON}
    node.inject("xid 0 79")
    assert until(lambda: Unit(0) in node.unhealthy())


def test_a_gpu_stays_unhealthy_while_it_is_lost(make_node: Callable[..., Node]) -> None:
    node = make_node()
    clock = FakeClock()
    node.armed(HealthSettings(recovery_quiet_period=30.0), clock=clock)
    node.inject("lost 3")
    assert until(lambda: Unit(3) in node.unhealthy())
    clock.advance(31.0)
    # The re-check after each wait finds GPU 3 still lost, so its quiet period starts over. Two more
    # events are the marker: the loop that handled the first one has re-checked GPU 3 before the second.
    node.inject("xid 0 79")
    assert until(lambda: Unit(0) in node.unhealthy())
    node.inject("xid 1 79")
    assert until(lambda: Unit(1) in node.unhealthy())
    assert node.unhealthy()[Unit(3)] == LOST_REASON


def test_xid_marked_gpu_recovers_by_the_injected_clock(make_node: Callable[..., Node]) -> None:
    node = make_node()
    clock = FakeClock()
    node.armed(HealthSettings(recovery_quiet_period=1000.0), clock=clock)
    node.inject("xid 2 79")
    assert until(lambda: Unit(2) in node.unhealthy())
    clock.advance(1000.0)
    assert until(lambda: node.unhealthy() == {})


def test_gpu_lost_before_start_is_marked_and_the_rest_are_watched(
    make_node: Callable[..., Node], logs: pytest.LogCaptureFixture
) -> None:
    node = make_node()
    node.inject("lost 2")  # applied when the monitor initialises NVML
    node.armed()
    assert until(lambda: Unit(2) in node.unhealthy())
    # The first line that mentions health says the monitor is armed (the plugin's tests wait for it).
    first = next(r.getMessage() for r in logs.records if "health" in r.getMessage())
    assert first.startswith("health monitor armed: events registered on 3 of 4 GPU(s)")
    node.inject("xid 0 79")
    assert until(lambda: Unit(0) in node.unhealthy())
    assert node.unhealthy() == {Unit(2): LOST_REASON, Unit(0): "Xid 79 (GPU has fallen off the bus)"}


def test_marks_from_an_earlier_monitor_are_rechecked(make_node: Callable[..., Node]) -> None:
    node = make_node()
    node.registry.mark(Unit(1), "Xid 79 (GPU has fallen off the bus)")  # left by a monitor before a reload
    node.armed(HealthSettings(recovery_quiet_period=0.2))
    assert until(lambda: node.unhealthy() == {})


def test_wait_failing_because_nvml_was_shut_down_is_retried_not_all_unhealthy(
    make_node: Callable[..., Node], logs: pytest.LogCaptureFixture
) -> None:
    import pynvml

    node = make_node()
    m = node.armed()
    before = m.arms
    # Take the monitor's NVML reference away: its event set is freed and the wait fails (UNINITIALIZED).
    pynvml.nvmlShutdown()
    assert until(lambda: m.arms > before and m.wait_ready(0.0))
    assert node.unhealthy() == {}
    assert "re-initialising" in logs.text
    node.inject("xid 3 79")
    assert until(lambda: Unit(3) in node.unhealthy())
    assert set(node.unhealthy()) == {Unit(3)}


def test_wait_failing_on_a_broken_event_set_is_retried_on_a_new_one(
    make_node: Callable[..., Node], logs: pytest.LogCaptureFixture
) -> None:
    import pynvml

    node = make_node()
    m = node.armed()
    before = m.arms
    pynvml.nvmlEventSetFree(m._event_set)  # the wait now fails with INVALID_ARGUMENT
    assert until(lambda: m.arms > before and m.wait_ready(0.0))
    assert "waiting for NVML events failed" in logs.text and "no GPU is marked" in logs.text
    assert node.unhealthy() == {}
    node.inject("xid 2 79")
    assert until(lambda: Unit(2) in node.unhealthy())
    assert set(node.unhealthy()) == {Unit(2)}


def test_stop_returns_and_the_thread_is_gone(
    make_node: Callable[..., Node], fake_nvml: Callable[..., None]
) -> None:
    node = make_node()
    m = node.armed()
    assert m.running
    assert m.stop(DEADLINE)
    assert not m.running
    assert not [t for t in threading.enumerate() if t.name == "gpunode-health"]
    assert m.stop()  # twice is fine
    assert HealthMonitor(node.registry, [], HealthSettings()).stop()  # never started
    # The monitor gave its NVML reference back: the next init reads a new machine.
    fake_nvml("h100")
    assert len(discover(Host(root=node.ctl.parent)).gpus) == 1


@dataclass
class FakeClock:
    now: float = 1000.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


# ---------------------------------------------------------------------------------------------
# "Cannot monitor" is not "unhealthy"
# ---------------------------------------------------------------------------------------------


def test_nvml_without_uuid_lookup_keeps_every_gpu_healthy_and_watched_by_index(
    make_node: Callable[..., Node], tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    # The field's commonest GPU-node failure: such an NVML used to turn every GPU unhealthy (0 allocatable).
    config = tmp_path / "machine.ini"
    config.write_text("[system]\nmissing = nvmlDeviceGetHandleByUUID\n[gpu]\n[gpu]\n")
    node = make_node(None, config=config, replicas=1)
    node.armed()
    assert "events registered on 2 of 2 GPU(s)" in logs.text
    assert node.unhealthy() == {}
    assert node.registry.unmonitored() == {}
    assert all(reason is None for reason in node.devices().values())
    # Found by index (its UUID checked), so its events still arrive and still count.
    node.inject("xid 1 79")
    assert until(lambda: Unit(1) in node.unhealthy())
    assert set(node.unhealthy()) == {Unit(1)}


@pytest.mark.parametrize(
    ("machine", "step"),
    [
        # FUNCTION_NOT_FOUND: a library without the call.
        ("[system]\nmissing = nvmlDeviceRegisterEvents\n[gpu]\n[gpu]\n", "registering its Xid/ECC events"),
        # NOT_SUPPORTED, per GPU; the supported-events query refused too (it is then tried anyway).
        (
            "[gpu]\nunsupported = nvmlDeviceRegisterEvents, nvmlDeviceGetSupportedEventTypes\n" * 2,
            "registering its Xid/ECC events",
        ),
    ],
)
def test_refused_event_registration_leaves_the_gpu_healthy_and_unmonitored(
    make_node: Callable[..., Node],
    tmp_path: Path,
    logs: pytest.LogCaptureFixture,
    machine: str,
    step: str,
) -> None:
    config = tmp_path / "machine.ini"
    config.write_text(machine)
    node = make_node(None, config=config, replicas=1)
    node.armed()
    assert node.unhealthy() == {}
    assert all(reason is None for reason in node.devices().values())
    unmonitored = node.registry.unmonitored()
    assert sorted(index for index, _ in unmonitored.values()) == [0, 1]
    assert all(why.startswith(f"NVML refused {step} (") for _, why in unmonitored.values())
    assert f"GPU 0 ({node.uuid(0)}) is not monitored: NVML refused {step}" in logs.text
    assert "it stays schedulable" in logs.text


def test_no_permission_for_events_is_unmonitored_not_unhealthy(
    make_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    import pynvml

    def refuse(*_args: object) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    # The fake library has no switch for NO_PERMISSION: the real pynvml call is replaced for GPU 2 only.
    real = pynvml.nvmlDeviceRegisterEvents
    node = make_node(replicas=1)
    target = node.uuid(2)

    def register(handle: object, events: int, event_set: object) -> None:
        if pynvml.nvmlDeviceGetUUID(handle) == target:
            refuse()
        real(handle, events, event_set)

    monkeypatch.setattr(pynvml, "nvmlDeviceRegisterEvents", register)
    node.armed()
    assert node.unhealthy() == {}
    assert list(node.registry.unmonitored()) == [target]
    assert "events registered on 3 of 4 GPU(s)" in logs.text
    # The others are still watched; the unmonitored one is still served as healthy.
    node.inject("xid 0 79")
    assert until(lambda: Unit(0) in node.unhealthy())
    assert set(node.unhealthy()) == {Unit(0)}


def test_a_gpu_without_events_is_reported_unmonitored_and_the_others_still_count(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    config = tmp_path / "machine.ini"
    config.write_text("[gpu]\nsupported_events = 0\n[gpu]\n")
    node = make_node(None, config=config, replicas=1)
    node.armed()
    assert node.registry.unmonitored() == {node.uuid(0): (0, "it supports no Xid or double-bit ECC events")}
    assert node.unhealthy() == {}
    node.inject("ecc 1")
    assert until(lambda: Unit(1) in node.unhealthy())
    assert set(node.unhealthy()) == {Unit(1)}


def test_a_gpu_refusing_the_ecc_event_is_still_watched_for_xids(
    make_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    import pynvml

    real = pynvml.nvmlDeviceRegisterEvents

    def no_ecc(handle: object, events: int, event_set: object) -> None:
        if events & pynvml.nvmlEventTypeDoubleBitEccError:  # a GPU without ECC, say
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        real(handle, events, event_set)

    monkeypatch.setattr(pynvml, "nvmlDeviceRegisterEvents", no_ecc)
    node = make_node(replicas=1)
    node.armed()
    assert node.registry.unmonitored() == {}
    assert "events registered on 4 of 4 GPU(s)" in logs.text
    assert f"GPU 0 ({node.uuid(0)}) supports only Xid events" in logs.text
    node.inject("xid 2 79")
    assert until(lambda: Unit(2) in node.unhealthy())
