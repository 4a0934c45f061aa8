"""What an Allocate costs the thread that serves it (issue 24, speed): the registry's lock is taken once for
the whole call, whatever the number of devices named, and the per-Allocate log line is handed to the log
writer thread as text, where the LogRecord is made; the health the call sees and the line written are
what they were."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
from typing import Any

import pytest

from gpunode.plugin.allocate import AllocateSettings
from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.devices import DeviceRegistry, Sharing, Unit, build_resources
from gpunode.plugin.logsafe import log_line
from gpunode.plugin.preferred import Topology
from gpunode.plugin.server import DevicePluginService, ServeSettings
from gpunode.plugin.simulate import simulated_inventory

GPU = "nvidia.com/gpu"


class _Context:
    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return None


class _CountingLock:
    """The registry's condition, counting how often it is entered (and by which thread)."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.entered: list[str] = []

    def __enter__(self) -> bool:
        self.entered.append(threading.current_thread().name)
        return self._cond.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._cond.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cond, name)


def _request(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )


def test_an_allocate_takes_the_registry_lock_once_whatever_it_names() -> None:
    inventory = simulated_inventory("pcie-4")
    [gpu] = build_resources(inventory)
    registry = DeviceRegistry([gpu])
    service = DevicePluginService(
        GPU, registry, Topology.from_inventory(inventory), ServeSettings(False, AllocateSettings())
    )
    counting = _CountingLock(registry._cond)
    registry._cond = counting  # type: ignore[assignment]
    ids = [d.id for d in gpu.devices]
    answer = service.Allocate(_request(ids[:1], ids[1:]), _Context())
    assert [dict(c.envs) for c in answer.container_responses] == [
        {"NVIDIA_VISIBLE_DEVICES": ids[0]},
        {"NVIDIA_VISIBLE_DEVICES": ",".join(ids[1:])},
    ]
    assert len(counting.entered) == 1  # one lock per Allocate, not one per device (4) plus the lookup
    # ... and a device marked unhealthy after is refused with its reason, still in one look.
    registry._cond = counting._cond
    registry.mark(Unit(2), "Xid 79")
    registry._cond = counting  # type: ignore[assignment]
    counting.entered.clear()
    with pytest.raises(RuntimeError, match=r"FAILED_PRECONDITION.*Xid 79"):
        service.Allocate(_request(ids), _Context())
    assert len(counting.entered) == 1


@pytest.mark.parametrize("profile", ["pcie-4", "mig"])
def test_the_allocation_view_sees_the_health_that_health_of_sees(profile: str) -> None:
    """GPU marks, MIG instance marks and a resource that is down (its MPS daemon): the one-look view and
    the per-device lookup agree for every device, replicas and unshared GPUs of one resource included."""
    inventory = simulated_inventory(profile)
    resources = build_resources(
        inventory, mig_strategy="mixed" if profile == "mig" else "none", sharing=Sharing(replicas=2)
    )
    registry = DeviceRegistry(resources)

    def agree() -> int:
        unhealthy = 0
        for resource in resources:
            served, health = registry.allocation_view(resource.name)
            assert served == resource
            for device in resource.devices:
                expected = registry.health_of(device, resource.name)
                assert health(device) == expected
                unhealthy += not expected.healthy
        return unhealthy

    assert agree() == 0
    device = resources[0].devices[0]
    registry.mark(device.unit, "Xid 48")
    assert agree() > 0
    registry.mark(device.unit, None)
    registry.mark(Unit(device.gpu_index), "Xid 79")
    assert agree() > 0
    registry.mark(Unit(device.gpu_index), None)
    registry.set_resource_down(resources[0].name, "the MPS control daemon is down")
    assert agree() == len(resources[0].devices)
    assert registry.allocation_view("nvidia.com/gone")[0] is None


def test_log_line_is_plain_logging_where_the_log_writer_does_not_own_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="gpunode.plugin"):
        log_line(logging.getLogger("gpunode.plugin"), logging.INFO, "nvidia.com/gpu: allocated 100%s")
        log_line(logging.getLogger("gpunode.plugin"), logging.DEBUG, "not logged at INFO")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "nvidia.com/gpu: allocated 100%s")
    ]


# In a process of its own: setup_logging sets the logging module's state for the whole process.
CODE = """
import logging, sys, threading, time
from gpunode.plugin.runner import setup_logging
from gpunode.plugin.allocate import AllocateSettings
from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.devices import DeviceRegistry, build_resources
from gpunode.plugin.preferred import Topology
from gpunode.plugin.server import DevicePluginService, ServeSettings
from gpunode.plugin.simulate import simulated_inventory

made = []
factory = logging.getLogRecordFactory()

def record(*args, **kwargs):
    r = factory(*args, **kwargs)
    made.append((threading.current_thread().name, r))
    return r

logging.setLogRecordFactory(record)
writer = setup_logging(False, {})
inventory = simulated_inventory("pcie-4")
[gpu] = build_resources(inventory)
service = DevicePluginService(
    "nvidia.com/gpu", DeviceRegistry([gpu]), Topology.from_inventory(inventory),
    ServeSettings(False, AllocateSettings()),
)

class Context:
    def is_active(self): return True
    def time_remaining(self): return None

ids = [d.id for d in gpu.devices]
request = pb.AllocateRequest(container_requests=[
    pb.ContainerAllocateRequest(devices_ids=ids[:1]), pb.ContainerAllocateRequest(devices_ids=ids[1:3])])
before = time.time()
service.Allocate(request, Context())
after = time.time()
logging.getLogger("gpunode.plugin").warning("a record %s", "as before")
writer.stop()
for thread, r in made:
    print(thread, before <= r.created <= after, r.levelname, r.getMessage(), sep="|", file=sys.stdout)
"""


def test_the_allocate_line_is_made_into_a_record_by_the_log_thread_with_the_calls_time() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    records = [line.split("|") for line in done.stdout.splitlines()]
    # (The Allocate's record is made after the later warning's: when the log thread takes the line.)
    [allocated] = [r for r in records if "allocated" in r[3]]
    [other] = [r for r in records if "allocated" not in r[3]]
    lines = done.stderr.splitlines()
    assert allocated[0] == "gpunode-log"  # not the thread that served the call
    assert allocated[1:3] == ["True", "INFO"]  # stamped with the call's time
    assert allocated[3].startswith("nvidia.com/gpu: allocated GPU-") and "; GPU-" in allocated[3]
    assert other[0] == "MainThread" and other[2:] == ["WARNING", "a record as before"]
    # On stderr, as logging formats any record: time stamp, level, message; in the order logged.
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert len(lines) == 2
    assert re.fullmatch(f"{stamp} INFO {re.escape(allocated[3])}", lines[0])
    assert re.fullmatch(f"{stamp} WARNING a record as before", lines[1])


def test_the_log_thread_makes_each_seconds_time_stamp_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log thread formats a line per Allocate: localtime + strftime (~60 % of a line) once per second,
    and every line exactly as logging.Formatter writes it."""
    import time

    from gpunode.plugin.runner import _Formatter

    fmt = "%(asctime)s %(levelname)s %(message)s"
    ours, theirs = _Formatter(fmt), logging.Formatter(fmt)
    records = []
    for created in (1_800_000_000.0, 1_800_000_000.25, 1_800_000_000.999, 1_800_000_001.5, 1_800_000_061.0):
        record = logging.LogRecord("gpunode.plugin", logging.INFO, "", 0, "allocated %s", ("GPU-1",), None)
        record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
        records.append(record)
    expected = [theirs.format(r) for r in records]
    calls: list[str] = []
    strftime = time.strftime

    def counting(*args: Any) -> str:
        calls.append(args[0])
        return strftime(*args)

    monkeypatch.setattr(time, "strftime", counting)
    assert [ours.format(r) for r in records] == expected
    assert len(calls) == 3  # seconds 1_800_000_000, ..._001 and ..._061
    assert expected[1].endswith(",250 INFO allocated GPU-1")
