"""Device health as the plugin reports it: per-device records and transitions (HealthTracker keeps them),
and the interfaces of the two that report them, metrics and the Kubernetes reporter.

What both sides of health reporting share: gpunode.plugin.observe wires them together and starts the
metrics (gpunode.plugin.metrics) and the reporter (gpunode.kube.events), which implement MetricsSink and
HealthReporter and read the records. Kept apart from observe.py so that those two and observe.py need not
import each other.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpunode.plugin.devices import DeviceRegistry, PluginDevice

if TYPE_CHECKING:
    from gpunode.plugin.preferred import Topology
    from gpunode.plugin.server import DevicePluginService, ServeSettings

_XID = re.compile(r"\bXid (\d+)")


@dataclass
class DeviceRecord:
    """One served device's health as people see it (updated by the event loop, read by scrapes)."""

    resource: str
    device: PluginDevice
    healthy: bool
    monitored: bool
    reason: str  # "healthy", or why it is not
    since: float  # monotonic time the current state began
    last_critical_xid: int = 0  # 0: none seen
    recoveries: int = 0


@dataclass(frozen=True)
class Transition:
    """A unit (GPU or MIG instance) turned unhealthy or recovered; one per unit, not per replica."""

    resource: str
    device: PluginDevice
    healthy: bool
    reason: str  # why it is unhealthy; on recovery, why it was


class HealthReporter:
    """What observe.HealthObserver asks of gpunode.kube.events.NodeReporter (and DeferredReporter, which
    stands in for it until it is loaded)."""

    def counts(self) -> tuple[int, int, int]:
        """(sent, failed, dropped): requests the API accepted, requests that failed (API down, refused),
        reports dropped (a full queue, the rate limit)."""
        raise NotImplementedError

    def device_changed(self, transition: Transition) -> None:
        raise NotImplementedError

    def condition(self, unhealthy: list[DeviceRecord], *, served: bool) -> None:
        raise NotImplementedError

    def registered(self, resource: str) -> None:
        raise NotImplementedError

    def register_failed(self, resource: str, why: str, *, refused: bool) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class HealthTracker:
    """Per-device records, kept across status updates, and the transitions each update brings."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str], DeviceRecord] = {}

    def update(self, registry: DeviceRegistry) -> list[Transition]:
        now = self._clock()
        unmonitored = registry.unmonitored()
        records: dict[tuple[str, str], DeviceRecord] = {}
        transitions: list[Transition] = []
        seen_units: set[tuple[str, str, bool]] = set()
        for resource in registry.resources():
            _, states = registry.snapshot(resource.name)
            for state in states:
                key = (resource.name, state.device.id)
                old = self._records.get(key)
                reason = state.reason or "healthy"
                monitored = state.device.gpu_uuid not in unmonitored
                if old is not None and old.device.uuid != state.device.uuid:
                    old = None  # another device under the same ID after a re-discovery
                if old is None:
                    record = DeviceRecord(resource.name, state.device, state.healthy, monitored, reason, now)
                    if not state.healthy:
                        record.last_critical_xid = _xid(reason)
                        transitions.append(Transition(resource.name, state.device, False, reason))
                        seen_units.add((resource.name, state.device.uuid, False))
                else:
                    record = old
                    record.monitored = monitored
                    if old.healthy != state.healthy or old.reason != reason:
                        was = old.reason
                        if state.healthy and not old.healthy:
                            record.recoveries += 1
                        if not state.healthy:
                            record.last_critical_xid = _xid(reason) or record.last_critical_xid
                        record.healthy, record.reason, record.since = state.healthy, reason, now
                        # Replicas of one GPU change together: one transition for the unit.
                        unit = (resource.name, state.device.uuid, state.healthy)
                        if unit not in seen_units:
                            seen_units.add(unit)
                            transitions.append(
                                Transition(
                                    resource.name,
                                    state.device,
                                    state.healthy,
                                    was if state.healthy else reason,
                                )
                            )
                records[key] = record
        with self._lock:
            self._records = records
        return transitions

    def records(self) -> list[DeviceRecord]:
        with self._lock:
            return list(self._records.values())

    def unhealthy(self) -> list[DeviceRecord]:
        """One record per unhealthy unit (the first replica), in resource and device order."""
        seen: set[tuple[str, str]] = set()
        out = []
        for record in self.records():
            unit = (record.resource, record.device.uuid)
            if not record.healthy and unit not in seen:
                seen.add(unit)
                out.append(record)
        return out

    def now(self) -> float:
        return self._clock()


def _xid(reason: str) -> int:
    match = _XID.search(reason)
    return int(match[1]) if match else 0


class MetricsSink:
    """What HealthObserver asks of gpunode.plugin.metrics.PluginMetrics (kept here so that this module
    does not import prometheus_client)."""

    def registered(self, resource: str, *, restart: bool, delay: float | None) -> None:
        raise NotImplementedError

    def register_failed(self, resource: str, *, refused: bool) -> None:
        raise NotImplementedError

    def service(
        self, resource: str, registry: DeviceRegistry, topology: Topology, settings: ServeSettings
    ) -> DevicePluginService:
        raise NotImplementedError

    def watch_reporter(self, reporter: HealthReporter) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError
