"""What the running plugin says about itself: per resource, the devices, their health and the
registration; what it waits for. Rebuilt by the event loop (lifecycle.Plugin) after every event and read
by sd_notify and the status file (runner.py) and by the observers (observe.py), which lifecycle imports:
kept here so that none of them imports the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ResourceStatus:
    name: str
    socket: str
    devices: int
    healthy: int
    registered: bool = False
    refused: str | None = None  # kubelet's reason, when it refused the registration
    unmonitored: int = 0  # devices on GPUs the health monitor cannot watch (healthy all the same)
    sharing: str = "none"  # none, time-slicing or mps
    down: str | None = None  # why every device is unhealthy (its MPS control daemon is not answering)


@dataclass(frozen=True)
class UnmonitoredGpu:
    index: int
    uuid: str
    reason: str


@dataclass
class PluginStatus:
    """What `gpunode plugin status` and sd_notify report; rebuilt after every event."""

    resources: list[ResourceStatus] = field(default_factory=list)
    waiting_for: str | None = None  # "kubelet", "NVML", "GPUs", "the device-plugins directory"
    nvml_error: str | None = None
    unmonitored: list[UnmonitoredGpu] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return bool(self.resources) and all(r.registered for r in self.resources)

    def summary(self) -> str:
        if self.waiting_for:
            return f"waiting for {self.waiting_for}"
        parts = [
            f"{r.name}: {r.healthy}/{r.devices} healthy, "
            + (f"all unhealthy: {r.down}, " if r.down else "")
            + (f"{r.unmonitored} unmonitored, " if r.unmonitored else "")
            + ("registered" if r.registered else f"refused ({r.refused})" if r.refused else "registering")
            for r in self.resources
        ]
        return "; ".join(parts) or "no devices"
