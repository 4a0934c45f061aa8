"""GPU health for the device plugin: NVML events and lost GPUs, reported into the DeviceRegistry.

One thread per `HealthMonitor` holds its own NVML reference for its whole life and blocks in
`nvmlEventSetWait_v2` on an event set that has every watched GPU's Xid and double-bit ECC events
registered. NVML cannot interrupt a wait, so each wait lasts at most `WAIT_SLICE_S`: that bounds how long
`stop()` takes, and costs nothing measurable (the real wait sleeps in the kernel).

What it does beyond NVIDIA's plugin, whose known weak points are listed in the deviceplugin spec:

- A critical event marks the whole GPU (`Unit(index)`), which the registry applies to every replica and
  MIG device on it; an event addressed to one MIG instance marks only that instance.
- A GPU that falls off the bus is found by probing, since a wait that returns GPU_IS_LOST does not say
  which GPU it was.
- An unhealthy GPU becomes healthy again once NVML has reported it fine for `recovery_quiet_period`
  seconds with no new critical event. Re-checks are scheduled through the wait's timeout, only while
  something is unhealthy.
- A failed wait is logged and retried with backoff (a new event set, re-initialising NVML if it was torn
  down), and never marks anything unhealthy by itself.
- "Cannot monitor" is not "unhealthy": when NVML answers NOT_SUPPORTED, FUNCTION_NOT_FOUND or
  NO_PERMISSION to a lookup, a probe or an event registration, the GPU stays schedulable and is reported
  *unmonitored* (`DeviceRegistry.unmonitored`, the status file, `plugin status`, doctor). Only real
  signals make a GPU unhealthy: GPU_IS_LOST, a critical Xid, a double-bit ECC error. (An NVML without
  nvmlDeviceGetHandleByUUID used to turn every GPU unhealthy: 0 allocatable, the commonest GPU-node
  failure in the field.)
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

from gpunode.errors import ConfigError
from gpunode.nvml.discovery import FUNCTION_NOT_FOUND, GPU_IS_LOST, NO_PERMISSION, NOT_SUPPORTED, session_lock
from gpunode.nvml.model import Gpu, MigDevice
from gpunode.plugin.devices import DeviceRegistry, Unit
from gpunode.plugin.nvmlthread import TIMEOUT, UNINITIALIZED, Backoff, NvmlThread, nvml_code, nvml_text

LOGGER_NAME = "gpunode.plugin.health"

# Application errors: the job that caused them failed, the GPU itself is fine (NVIDIA's plugin ignores
# the same six by default).
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})

ENV_DISABLE = "DP_DISABLE_HEALTHCHECKS"
ENV_ENABLE = "DP_ENABLE_HEALTHCHECKS"

# nvml.h values, named here so the module reads without pynvml at hand.
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
WATCHED_EVENTS = EVENT_XID | EVENT_DOUBLE_BIT_ECC
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of an event for the whole GPU
# NVML's "I cannot / may not tell you": the GPU may be perfectly fine, we just cannot watch it.
CANNOT_MONITOR = frozenset({NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND})

WAIT_SLICE_S = 0.25  # the longest single nvmlEventSetWait: how late stop() can be noticed
RECHECK_MAX_S = 5.0  # while something is unhealthy, probe it at least this often

LOST_REASON = "lost from the bus (NVML: GPU is lost)"
ECC_REASON = "double-bit ECC error"

# A few Xids an operator meets most; the rest are named by number only (see NVIDIA's Xid catalogue).
XID_NAMES = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapping recording failure",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
}

_XID_TEXT = re.compile(r"[0-9]+")


def xid_reason(xid: int) -> str:
    name = XID_NAMES.get(xid)
    return f"Xid {xid} ({name})" if name else f"Xid {xid}"


@dataclass(frozen=True)
class HealthSettings:
    """What makes a GPU unhealthy, and when it may become healthy again."""

    enabled: bool = True
    ignored_xids: frozenset[int] = APPLICATION_XIDS
    critical_xids: frozenset[int] = frozenset()  # always critical: wins over ignored_xids
    all_xids_critical: bool = False  # every Xid is critical, ignored_xids included
    recovery_quiet_period: float = 60.0  # seconds a GPU must be fine again; 0: never recover on its own

    def __post_init__(self) -> None:
        if isinstance(self.recovery_quiet_period, bool) or not (
            isinstance(self.recovery_quiet_period, (int, float))
            and math.isfinite(self.recovery_quiet_period)
            and self.recovery_quiet_period >= 0
        ):
            raise ConfigError(
                f"health recovery quiet period {self.recovery_quiet_period!r} is not a number of seconds "
                "(0 or more)",
                "give seconds, e.g. 60; 0 turns automatic recovery off",
            )
        for name in ("ignored_xids", "critical_xids"):
            for xid in getattr(self, name):
                if isinstance(xid, bool) or not isinstance(xid, int) or xid < 0:
                    raise ConfigError(f"health {name}: {xid!r} is not an Xid number")

    def is_critical(self, xid: int) -> bool:
        if self.all_xids_critical or xid in self.critical_xids:
            return True
        return xid not in self.ignored_xids

    def describe(self) -> str:
        if not self.enabled:
            return "health checks are off"
        if self.all_xids_critical:
            xids = "every Xid is critical"
        else:
            ignored = sorted(self.ignored_xids - self.critical_xids)
            xids = "ignoring Xids " + ", ".join(map(str, ignored)) if ignored else "no Xid is ignored"
        recovery = (
            f"a GPU is healthy again after {self.recovery_quiet_period:g}s fine"
            if self.recovery_quiet_period > 0
            else "no automatic recovery"
        )
        return f"{xids}; double-bit ECC errors and lost GPUs are critical; {recovery}"


def apply_dp_environment(settings: HealthSettings, env: Mapping[str, str]) -> HealthSettings:
    """Apply NVIDIA's DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS, as k8s-device-plugin reads them.

    Both are comma-separated, case-insensitive, blanks around items and empty items ignored.
    - DP_DISABLE_HEALTHCHECKS: an item `all` or `xids` turns the health checks off; Xid numbers are
      ignored in addition to `ignored_xids`.
    - DP_ENABLE_HEALTHCHECKS: Xid numbers are critical even if ignored (`critical_xids`); `all` or
      `xids` makes every Xid critical, and then DP_DISABLE_HEALTHCHECKS=all does not turn checks off.
    Unlike NVIDIA's plugin, which skips a malformed item silently, a malformed item is a ConfigError.
    """
    disable_all, disabled = _parse_xid_list(ENV_DISABLE, env.get(ENV_DISABLE, ""))
    enable_all, enabled_xids = _parse_xid_list(ENV_ENABLE, env.get(ENV_ENABLE, ""))
    enabled = settings.enabled
    if disable_all and not enable_all:
        enabled = False
        if enabled_xids:
            # NVIDIA's plugin turns everything off here too, whatever the Xid list says; say so.
            logging.getLogger(LOGGER_NAME).warning(
                "%s=all turns the health checks off; the Xids in %s have no effect (use %s=all to keep "
                "checks on)",
                ENV_DISABLE,
                ENV_ENABLE,
                ENV_ENABLE,
            )
    return replace(
        settings,
        enabled=enabled,
        ignored_xids=settings.ignored_xids | disabled,
        critical_xids=settings.critical_xids | enabled_xids,
        all_xids_critical=settings.all_xids_critical or enable_all,
    )


def _parse_xid_list(variable: str, raw: str) -> tuple[bool, frozenset[int]]:
    """(`all` given, the Xids given) of one DP_* variable."""
    xids: set[int] = set()
    everything = False
    for item in (part.strip() for part in raw.lower().split(",")):
        if not item:
            continue
        if item in ("all", "xids"):
            everything = True
            continue
        if not _XID_TEXT.fullmatch(item):
            raise ConfigError(
                f"{variable}={raw!r}: {item!r} is not an Xid number",
                f"set {variable} to `all`, or to Xid numbers separated by commas, e.g. `48,79`",
            )
        xid = int(item)
        if xid == 0 or xid >= 2**64:
            # NVIDIA's plugin keeps "all" under Xid 0, so a 0 there would silently mean `all`.
            raise ConfigError(
                f"{variable}={raw!r}: {item} is not an Xid",
                "write `all` to mean every Xid; Xids are numbers from 1 up, e.g. `48,79`",
            )
        xids.add(xid)
    return everything, frozenset(xids)


# -- the monitor --------------------------------------------------------------------------------


class _NvmlGone(Exception):
    """Internal: NVML says it is not initialised any more; the thread must init it again."""


@dataclass
class _Watched:
    """One physical GPU the monitor watches, found again by UUID on every lookup."""

    index: int
    uuid: str
    migs: tuple[MigDevice, ...]
    address: int | None = None  # the NVML handle's address: events name their GPU by handle
    registered: bool = False  # on the current event set, with every event it supports (maybe none)
    events: int = 0  # the event types registered

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})"

    def mig_at(self, instance: tuple[int, int]) -> MigDevice | None:
        for mig in self.migs:
            if (mig.gpu_instance_id, mig.compute_instance_id) == instance:
                return mig
        return None


@dataclass
class _Trouble:
    """A unit this monitor marked unhealthy, and when to look at it again."""

    reason: str
    since: float  # the last bad news (an event or a failed probe): the quiet period counts from here
    next_check: float


class HealthMonitor(NvmlThread):
    """Watches the GPUs of one discovery and marks units unhealthy (and healthy again) in the registry."""

    THREAD_NAME = "gpunode-health"
    WHAT = "the health thread"

    def __init__(
        self,
        registry: DeviceRegistry,
        gpus: Sequence[Gpu],
        settings: HealthSettings,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(log or logging.getLogger(LOGGER_NAME))
        self._registry = registry
        self._settings = settings
        self._clock = clock
        self._watched: dict[int, _Watched] = {}
        for gpu in gpus:
            if not gpu.uuid:
                # Without a UUID the GPU cannot be found again safely, and it serves no device either.
                self._log.warning("GPU %d has no UUID (%s); not watching it", gpu.index, _why_no_uuid(gpu))
                continue
            self._watched[gpu.index] = _Watched(gpu.index, gpu.uuid, gpu.mig_devices)
        self._troubles: dict[Unit, _Trouble] = {}
        # A new MIG layout of the same GPUs (update()), taken by the monitor's own thread.
        self._layout_lock = threading.Lock()
        self._new_layout: dict[int, tuple[MigDevice, ...]] | None = None
        self._ready = threading.Event()
        self._arms = 0
        self._nvml: Any = None
        self._event_set: Any = None
        self._initialised = False  # this monitor holds an NVML reference

    # -- control ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching in a background thread (returns at once; see wait_ready)."""
        if not self._settings.enabled:
            self._log.info("GPU health checks are off (configuration or %s); no GPU is watched", ENV_DISABLE)
            return
        self._start_thread()

    def wait_ready(self, timeout: float) -> bool:
        """Block until events are registered and the thread is waiting for them; False on timeout."""
        return self._ready.wait(timeout)

    def update(self, gpus: Sequence[Gpu], settings: HealthSettings) -> bool:
        """Take a new MIG layout of the GPUs this monitor watches, without a new NVML session or event set:
        a MIG change must not open a gap in which an Xid is lost (events are registered on the GPU, not on
        its instances, so the set stays valid), nor restart the quiet period of a GPU being watched for
        recovery. False where a new monitor is needed: other GPUs, other settings, not running."""
        if settings != self._settings:
            return False
        if not settings.enabled:
            return True  # nothing runs, and nothing would
        layout = {g.index: g.mig_devices for g in gpus if g.uuid}
        if not self.running or {g.index: g.uuid for g in gpus if g.uuid} != {
            i: w.uuid for i, w in self._watched.items()
        }:
            return False
        with self._layout_lock:
            self._new_layout = layout
        return True

    @property
    def arms(self) -> int:
        """How many times an event set was armed: grows by one on each recovery from a failed wait."""
        return self._arms

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        import pynvml

        self._nvml = pynvml
        backoff = Backoff()
        try:
            while not self._stop.is_set():
                try:
                    self._take_layout()
                    if self._event_set is None and not self._arm():
                        self._pause(backoff.next())
                        continue
                    self._wait_once(backoff)
                    self._recheck()
                except _NvmlGone:
                    self._initialised = False
                    self._disarm()
                    delay = backoff.next()
                    self._log.warning(
                        "NVML was shut down under the health monitor; re-initialising in %.1fs", delay
                    )
                    self._pause(delay)
                except Exception:
                    # A bug or an NVML surprise must not end health checking for the plugin's lifetime.
                    delay = backoff.next()
                    self._log.exception("health monitor error; re-arming in %.1fs", delay)
                    self._disarm()
                    self._pause(delay)
        finally:
            self._disarm()
            if self._initialised:
                with session_lock, suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()
                self._initialised = False
            self._log.info("GPU health checks stopped")

    def _pause(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _take_layout(self) -> None:
        """Apply update()'s MIG layout (in this thread: the lists and troubles are this thread's)."""
        with self._layout_lock:
            layout, self._new_layout = self._new_layout, None
        if layout is None:
            return
        for index, migs in layout.items():
            self._watched[index].migs = tuple(migs)
        # The registry's marks decide, as they do for a new monitor: a mark it dropped with its instance
        # (destroyed, or another instance under the same ids now) is no trouble any more, and a mark it
        # kept or made meanwhile (an instance no device stands for, a GPU lost at the re-read) is watched
        # for recovery like the monitor's own.
        marks = self._registry.unhealthy_units()
        for unit in [u for u in self._troubles if u not in marks]:
            del self._troubles[unit]
        self._adopt_marks(self._clock())

    def _adopt_marks(self, now: float) -> None:
        # Marks left by an earlier monitor (before a reload) would otherwise never be re-checked.
        for unit, reason in self._registry.unhealthy_units().items():
            if unit.gpu_index in self._watched and unit not in self._troubles:
                self._troubles[unit] = _Trouble(reason, now, now + self._recheck_interval())
                self._log.info("%s was unhealthy before (%s); re-checking it", self._unit_label(unit), reason)

    def _arm(self) -> bool:
        nvml = self._nvml
        if not self._initialised:
            try:
                # The lock keeps this init from interleaving with a discovery's init/shutdown.
                with session_lock:
                    nvml.nvmlInit()
            except nvml.NVMLError as exc:
                self._log.warning("NVML initialisation for health checks failed: %s", exc)
                self._all_unmonitored(f"health checks cannot initialise NVML ({exc})")
                return False
            self._initialised = True
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            if nvml_code(exc) == UNINITIALIZED:
                raise _NvmlGone from exc
            self._log.warning("creating an NVML event set failed: %s", exc)
            # No event set, no events: every GPU stays schedulable, and says it is not watched.
            self._all_unmonitored(f"NVML cannot create an event set ({exc})")
            return False
        now = self._clock()
        failures = [(w, f) for w in self._watched.values() if (f := self._register(w)) is not None]
        registered = sum(1 for w in self._watched.values() if w.registered and w.events)
        # The first line that says "health": tests and operators may take it as "armed".
        if self._arms == 0:
            self._log.info(
                "health monitor armed: events registered on %d of %d GPU(s); %s",
                registered,
                len(self._watched),
                self._settings.describe(),
            )
        else:
            self._log.info("health monitor armed again: events registered on %d GPU(s)", registered)
        self._arms += 1
        self._ready.set()
        for watched, failure in failures:
            self._probe_failed(Unit(watched.index), failure, now)
        if self._arms == 1:
            self._adopt_marks(now)
        return True

    def _disarm(self) -> None:
        self._ready.clear()
        for watched in self._watched.values():
            watched.registered = False
            watched.events = 0
            watched.address = None
        if self._event_set is not None:
            # A set from a torn-down NVML is already gone; freeing it can only fail.
            with suppress(Exception):
                self._nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None

    def _register(self, watched: _Watched) -> Exception | None:
        """Register the GPU's supported health events on the current set.

        Returns the NVML error only for a lost GPU (the one failure that says something about the GPU);
        any other refusal or failure leaves the GPU healthy and records it as unmonitored, with why.
        """
        nvml = self._nvml
        step = "looking it up"
        unmonitored: str | None = None
        wanted = 0
        try:
            handle = self._lookup(watched.uuid, watched.index)
            if handle is None:
                unmonitored = (
                    f"NVML has no UUID lookup and index {watched.index} is another GPU now, so this one "
                    "cannot be found"
                )
            else:
                watched.address = _address(handle)
                step = "asking for its supported events"
                try:
                    supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                except nvml.NVMLError as exc:
                    if nvml_code(exc) not in CANNOT_MONITOR:
                        raise
                    # Older drivers lack the query but still deliver events: try what we watch.
                    supported = WATCHED_EVENTS
                wanted = supported & WATCHED_EVENTS
                if wanted:
                    step = "registering its Xid/ECC events"
                    wanted = self._register_events(handle, wanted)
                else:
                    unmonitored = "it supports no Xid or double-bit ECC events"
        except nvml.NVMLError as exc:
            code = nvml_code(exc)
            if code == UNINITIALIZED:
                raise _NvmlGone from exc
            if code == GPU_IS_LOST:
                failure: Exception = exc  # pynvml is untyped
                return failure
            wanted = 0
            unmonitored = f"NVML refused {step} ({exc})"
        watched.registered = True
        watched.events = wanted
        self._set_unmonitored(watched, unmonitored)
        if wanted and wanted != WATCHED_EVENTS:
            self._log.info("%s supports only %s events", watched.label, _event_names(wanted))
        return None

    def _register_events(self, handle: Any, wanted: int) -> int:
        """Register `wanted` on the current set; the events registered (NVMLError if none could be)."""
        nvml = self._nvml
        try:
            nvml.nvmlDeviceRegisterEvents(handle, wanted, self._event_set)
        except nvml.NVMLError as exc:
            if nvml_code(exc) not in CANNOT_MONITOR or wanted == EVENT_XID or not wanted & EVENT_XID:
                raise
            # A GPU without ECC refuses the ECC event, and a driver may refuse the pair where it takes
            # Xids alone: those are the events that matter most.
            nvml.nvmlDeviceRegisterEvents(handle, EVENT_XID, self._event_set)
            return EVENT_XID
        return wanted

    def _lookup(self, uuid: str, index: int | None) -> Any:
        """The device's NVML handle by UUID; where NVML has no UUID lookup, by index with the UUID checked.

        None when the index now holds another GPU (a re-enumeration): the GPU cannot be found safely.
        """
        nvml = self._nvml
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError as exc:
            if nvml_code(exc) not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND) or index is None:
                raise
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        return handle if nvml_text(nvml.nvmlDeviceGetUUID(handle)) == uuid else None

    def _set_unmonitored(self, watched: _Watched, reason: str | None) -> None:
        if not self._registry.set_unmonitored(watched.uuid, watched.index, reason):
            return  # said already (a re-arm finds the same)
        if reason is not None:
            self._log.warning(
                "%s is not monitored: %s; it stays schedulable, but an Xid or ECC error on it goes unnoticed",
                watched.label,
                reason,
            )
        else:
            self._log.info("%s is monitored again", watched.label)

    def _all_unmonitored(self, reason: str) -> None:
        for watched in self._watched.values():
            self._set_unmonitored(watched, reason)

    def _wait_once(self, backoff: Backoff) -> None:
        nvml = self._nvml
        timeout_ms = math.ceil(self._wait_timeout() * 1000)
        try:
            data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except nvml.NVMLError as exc:
            code = nvml_code(exc)
            if code == TIMEOUT:
                backoff.reset()
            elif code == GPU_IS_LOST:
                if self._find_lost() == 0:
                    # Told again about a GPU already known lost: a set without it stops the repeats
                    # (a lost GPU cannot be registered), and the backoff keeps this from spinning.
                    delay = backoff.next()
                    self._log.info("NVML keeps reporting a lost GPU; making a new event set in %.1fs", delay)
                    self._disarm()
                    self._pause(delay)
            elif code == UNINITIALIZED:
                raise _NvmlGone from exc
            else:
                delay = backoff.next()
                self._log.warning(
                    "waiting for NVML events failed (%s); no GPU is marked for it; re-arming in %.1fs "
                    "(failure %d in a row)",
                    exc,
                    delay,
                    backoff.failures,
                )
                self._disarm()
                self._pause(delay)
            return
        backoff.reset()
        self._on_event(data)

    def _wait_timeout(self) -> float:
        if not self._troubles or self._settings.recovery_quiet_period <= 0:
            return WAIT_SLICE_S
        due = min(t.next_check for t in self._troubles.values()) - self._clock()
        return max(0.0, min(WAIT_SLICE_S, due))

    # -- events -----------------------------------------------------------------------------------

    def _on_event(self, data: Any) -> None:
        self._take_layout()  # an event for an instance update() has just told of
        now = self._clock()
        event_type = int(data.eventType)
        watched = self._watched_by_handle(data.device)
        if event_type == EVENT_XID:
            xid = int(data.eventData)
            reason = xid_reason(xid)
            where = watched.label if watched is not None else "an unidentified GPU"
            if not self._settings.is_critical(xid):
                self._log.info("%s on %s ignored (not critical by the settings)", reason, where)
                return
        elif event_type == EVENT_DOUBLE_BIT_ECC:
            reason = ECC_REASON
        else:
            self._log.debug("ignoring NVML event type %#x", event_type)
            return
        if watched is None:
            # Never mark every GPU for one unattributable event; a lost GPU shows up in the probes.
            self._log.warning("%s on a GPU this monitor cannot identify; probing for lost GPUs", reason)
            self._find_lost()
            return
        for unit in self._units_for(watched, int(data.gpuInstanceId), int(data.computeInstanceId), reason):
            self._mark_bad(unit, reason, now)

    def _watched_by_handle(self, handle: Any) -> _Watched | None:
        address = _address(handle)
        for watched in self._watched.values():
            if address is not None and watched.address == address:
                return watched
        # A handle from outside our lookups: ask for its UUID (fails on a lost GPU).
        try:
            uuid = nvml_text(self._nvml.nvmlDeviceGetUUID(handle))
        except self._nvml.NVMLError:
            return None
        for watched in self._watched.values():
            if watched.uuid == uuid:
                return watched
        return None

    def _units_for(self, watched: _Watched, gi: int, ci: int, reason: str) -> list[Unit]:
        known = [
            (m.gpu_instance_id, m.compute_instance_id)
            for m in watched.migs
            if m.gpu_instance_id is not None and m.compute_instance_id is not None
        ]
        if (gi == NO_INSTANCE and ci == NO_INSTANCE) or not known:
            return [Unit(watched.index)]
        if NO_INSTANCE not in (gi, ci):
            return [Unit(watched.index, (gi, ci))]
        # Only one of the two ids given: every instance that matches the given one.
        matched = [k for k in known if gi in (NO_INSTANCE, k[0]) and ci in (NO_INSTANCE, k[1])]
        if not matched:
            self._log.warning(
                "%s on %s names MIG instance gi %s ci %s, which this node does not serve; nothing marked",
                reason,
                watched.label,
                "any" if gi == NO_INSTANCE else gi,
                "any" if ci == NO_INSTANCE else ci,
            )
        return [Unit(watched.index, k) for k in matched]

    def _find_lost(self) -> int:
        """A wait said some GPU is lost without naming it: probe each and mark the lost ones.

        Returns how many of them were not known to be lost before."""
        now = self._clock()
        lost = new = 0
        for watched in self._watched.values():
            failure = self._probe(watched.uuid, watched.index)
            if failure is not None and nvml_code(failure) == GPU_IS_LOST:
                lost += 1
                trouble = self._troubles.get(Unit(watched.index))
                new += trouble is None or trouble.reason != LOST_REASON
                watched.registered = False
                self._mark_bad(Unit(watched.index), LOST_REASON, now)
        if not lost:
            self._log.info("NVML reported a lost GPU, but every watched GPU answers; nothing marked")
        return new

    # -- marking and recovery ---------------------------------------------------------------------

    def _mark_bad(self, unit: Unit, reason: str, now: float) -> None:
        trouble = self._troubles.get(unit)
        if trouble is None:
            # The log line first: whoever sees the device unhealthy (kubelet, a test) finds the reason logged.
            self._log.warning("%s unhealthy: %s", self._unit_label(unit), reason)
            self._troubles[unit] = _Trouble(reason, now, now + self._recheck_interval())
            self._registry.mark(unit, reason)
            return
        changed = self._registry.mark(unit, reason)
        trouble.since = now
        trouble.next_check = now + self._recheck_interval()
        if changed or trouble.reason != reason:
            self._log.warning("%s still unhealthy, now: %s", self._unit_label(unit), reason)
        else:
            self._log.info("%s: %s again; its quiet period starts over", self._unit_label(unit), reason)
        trouble.reason = reason

    def _probe_failed(self, unit: Unit, exc: Exception, now: float) -> None:
        """A registration found the GPU lost (the only failure _register reports)."""
        if nvml_code(exc) == UNINITIALIZED:
            raise _NvmlGone from exc
        watched = self._watched.get(unit.gpu_index)
        if watched is not None and unit.instance is None:
            watched.registered = False
        self._mark_bad(unit, LOST_REASON, now)

    def _recheck_interval(self) -> float:
        quiet = self._settings.recovery_quiet_period
        if quiet <= 0:
            return math.inf
        return min(max(quiet / 4, 0.01), RECHECK_MAX_S)

    def _recheck(self) -> None:
        """Probe the unhealthy units that are due, and clear those fine for the whole quiet period."""
        quiet = self._settings.recovery_quiet_period
        if quiet <= 0 or not self._troubles:
            return
        now = self._clock()
        for unit, trouble in list(self._troubles.items()):
            if trouble.next_check > now:
                continue
            watched = self._watched.get(unit.gpu_index)
            if watched is None:
                continue
            failure = self._probe_unit(watched, unit)
            if failure is not None:
                # Still bad: the quiet period starts over; a lost GPU is named as such.
                reason = LOST_REASON if nvml_code(failure) == GPU_IS_LOST else trouble.reason
                if reason != trouble.reason:
                    self._mark_bad(unit, reason, now)
                trouble.since = now
                trouble.next_check = now + self._recheck_interval()
                continue
            if now - trouble.since < quiet:
                trouble.next_check = min(now + self._recheck_interval(), trouble.since + quiet)
                continue
            # Back from the bus (or first reachable now): its events need registering again. Only a lost
            # GPU fails that; a refusal leaves the GPU healthy and unmonitored.
            if unit.instance is None and not watched.registered and self._register(watched) is not None:
                self._mark_bad(unit, LOST_REASON, now)
                continue
            del self._troubles[unit]
            self._log.info(
                "%s healthy again: NVML has reported it fine for %gs since %s",
                self._unit_label(unit),
                quiet,
                trouble.reason,
            )
            self._registry.mark(unit, None)

    def _probe_unit(self, watched: _Watched, unit: Unit) -> Exception | None:
        failure = self._probe(watched.uuid, watched.index)
        if failure is None and unit.instance is not None:
            mig = watched.mig_at(unit.instance)
            if mig is not None and mig.uuid:
                failure = self._probe(mig.uuid)
        return failure

    def _probe(self, uuid: str, index: int | None = None) -> Exception | None:
        """None if NVML finds the device by UUID and it answers a cheap query; else the NVML error."""
        nvml = self._nvml
        try:
            handle = self._lookup(uuid, index)
            if handle is not None:
                nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as exc:
            code = nvml_code(exc)
            if code == UNINITIALIZED:
                raise _NvmlGone from exc
            if code in CANNOT_MONITOR:
                return None  # it answered, with a refusal: reachable
            failure: Exception = exc  # pynvml is untyped
            return failure
        return None

    def _unit_label(self, unit: Unit) -> str:
        watched = self._watched.get(unit.gpu_index)
        gpu = watched.label if watched is not None else f"GPU {unit.gpu_index}"
        if unit.instance is None:
            return gpu
        gi, ci = unit.instance
        mig = watched.mig_at(unit.instance) if watched is not None else None
        name = f" ({mig.uuid})" if mig is not None and mig.uuid else ""
        return f"MIG device gi {gi} ci {ci}{name} on {gpu}"


def _address(handle: Any) -> int | None:
    try:
        value = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
    return int(value) if value else None


def _event_names(mask: int) -> str:
    names = [n for bit, n in ((EVENT_XID, "Xid"), (EVENT_DOUBLE_BIT_ECC, "double-bit ECC")) if mask & bit]
    return " and ".join(names)


def _why_no_uuid(gpu: Gpu) -> str:
    if gpu.lost:
        return "it was lost from the bus at discovery"
    return gpu.error or "NVML did not report one"


__all__ = [
    "APPLICATION_XIDS",
    "ENV_DISABLE",
    "ENV_ENABLE",
    "LOST_REASON",
    "HealthMonitor",
    "HealthSettings",
    "apply_dp_environment",
    "xid_reason",
]
