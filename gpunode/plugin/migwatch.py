"""Notice MIG geometry changes (instances created or destroyed, MIG mode flipped by a GPU reset) on its own.

The plugin reads the GPUs once per discovery; without this a MIG change reached kubelet only on SIGHUP or a
restart (as with NVIDIA's plugin, k8s-device-plugin issue 992). One thread per `MigWatcher`, with its own
NVML reference (taken under `session_lock`, as the health monitor does), compares a *fingerprint* of every
MIG-capable GPU — its current MIG mode and its MIG devices' UUID, GPU instance and compute instance ids —
with the fingerprint of what the plugin serves, and calls `on_change` when they differ. It is told of
changes two ways:

- `nvmlEventMigConfigChange` (0x100), registered on each GPU that lists it among its supported events.
  The event says only "changed", not what, so it is a prompt to read the fingerprint.
- A periodic read (`poll_interval`), on every node: a GPU without the event is only ever seen this way,
  and a MIG mode flip comes with a GPU reset, not with an event. Where every GPU has the event the read
  is slower (`slow_poll_interval`): it is the safety net, not the path.

A repartition is a series of steps (destroy seven instances, create seven, each an `nvidia-smi` run): a
read is made only once no event came for `DEBOUNCE_S` (1 s), and a difference found by a periodic read is
confirmed by a second read `DEBOUNCE_S` later, so kubelet is not shown each half-done layout. Nothing waits
longer than `MAX_DELAY_S` after the first sign of a change, however long the steps go on.

NVML failures never mark anything unhealthy (that is the health monitor's business); they are logged and
retried with backoff. A GPU that cannot be read (lost, refused) keeps its last known fingerprint. Every
wait is at most `WAIT_SLICE_S`, so `stop()` is prompt.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

from gpunode.nvml.discovery import (
    FUNCTION_NOT_FOUND,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    session_lock,
)
from gpunode.nvml.model import Gpu
from gpunode.plugin.nvmlthread import TIMEOUT, UNINITIALIZED, Backoff, NvmlThread, nvml_code, nvml_text

LOGGER_NAME = "gpunode.plugin.migwatch"

EVENT_MIG_CONFIG_CHANGE = 0x100  # nvml.h nvmlEventMigConfigChange

POLL_INTERVAL_S = 5.0  # a periodic read while some MIG-capable GPU has no MIG event
SLOW_POLL_INTERVAL_S = 30.0  # ... while every one has it: mode flips by reset send no event
# Quiet after the last event before reading. A repartition is a series of steps (nvidia-smi mig -dci, -dgi,
# -cgi, -cci, or a MIG manager's calls), each a process of its own, hundreds of milliseconds apart: a
# shorter quiet served every half-done layout in turn (kubelet would schedule onto capacity about to go).
DEBOUNCE_S = 1.0
MAX_DELAY_S = 10.0  # never later than this after the first sign of a change, however long the steps go on
WAIT_SLICE_S = 0.25  # the longest single wait: how late stop() can be noticed

# One GPU: (MIG mode on, ((MIG UUID, gi, ci), ...) sorted). None for the mode when NVML has no MIG mode.
GpuPrint = tuple[bool | None, tuple[tuple[str, int | None, int | None], ...]]
Fingerprint = dict[str, GpuPrint]  # by GPU UUID


def mig_capable(gpu: Gpu) -> bool:
    return bool(gpu.uuid) and gpu.mig_mode is not None and not gpu.lost


def fingerprint_of(gpus: Sequence[Gpu]) -> Fingerprint:
    """The fingerprint of what a discovery read: what the plugin serves from."""
    out: Fingerprint = {}
    for gpu in gpus:
        if not mig_capable(gpu) or gpu.uuid is None or gpu.mig_mode is None:
            continue
        devices = tuple(sorted((m.uuid, m.gpu_instance_id, m.compute_instance_id) for m in gpu.mig_devices))
        out[gpu.uuid] = (gpu.mig_mode.current, devices)
    return out


def describe_change(before: Fingerprint, after: Fingerprint) -> str:
    """One line for the log: which GPUs changed and how (instances added, removed, mode)."""
    parts = []
    for uuid in sorted(set(before) | set(after)):
        old, new = before.get(uuid), after.get(uuid)
        if old == new or old is None or new is None:
            continue
        bits = []
        if old[0] != new[0]:
            bits.append(f"MIG mode {'on' if new[0] else 'off'}")
        added = len({d[0] for d in new[1]} - {d[0] for d in old[1]})
        removed = len({d[0] for d in old[1]} - {d[0] for d in new[1]})
        if added:
            bits.append(f"{added} MIG device{'s' if added > 1 else ''} created")
        if removed:
            bits.append(f"{removed} MIG device{'s' if removed > 1 else ''} destroyed")
        parts.append(f"GPU {uuid}: {', '.join(bits) or 'MIG devices changed'}")
    return "; ".join(parts)


class _NvmlGone(Exception):
    """Internal: NVML says it is not initialised any more; initialise it again."""


class MigWatcher(NvmlThread):
    """Watches the MIG geometry of one discovery's GPUs; calls `on_change()` when it differs from it.

    `on_change` runs on the watcher's thread and must only post to the plugin's queue. After it ran, the
    watcher takes what it read as served, so one change is reported once; `update()` (after the plugin's
    next discovery) sets what is really served."""

    def __init__(
        self,
        gpus: Sequence[Gpu],
        on_change: Callable[[], object],
        *,
        poll_interval: float = POLL_INTERVAL_S,
        slow_poll_interval: float = SLOW_POLL_INTERVAL_S,
        debounce: float = DEBOUNCE_S,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(log or logging.getLogger(LOGGER_NAME))
        self._on_change = on_change
        self._poll_interval = poll_interval
        self._slow_poll_interval = max(slow_poll_interval, poll_interval)
        self._debounce = debounce
        self._clock = clock
        self._lock = threading.Lock()  # guards _served and _gpus, which update() replaces
        self._gpus: dict[str, int] = {}  # UUID -> index (for log lines and the lookup by index)
        self._served: Fingerprint = {}
        self._rearm = False
        self._set_gpus(gpus)
        self._ready = threading.Event()
        self._nvml: Any = None
        self._initialised = False
        self._event_set: Any = None
        self._with_event: set[str] = set()  # GPUs whose MIG event is registered on the current set
        self._checks = 0
        self._changes = 0

    @staticmethod
    def wanted(gpus: Sequence[Gpu], mig_strategy: str) -> bool:
        """Only a MIG strategy makes MIG devices resources, and only a MIG-capable GPU can change them."""
        return mig_strategy in ("single", "mixed") and any(mig_capable(g) for g in gpus)

    # -- control ----------------------------------------------------------------------------------

    THREAD_NAME = "gpunode-migwatch"
    WHAT = "the MIG watcher"

    def start(self) -> None:
        self._start_thread()

    def update(self, gpus: Sequence[Gpu]) -> None:
        """What the plugin serves now (after its discovery). Cheaper than a new watcher: no NVML init, no
        new event set unless the set of MIG-capable GPUs changed."""
        self._set_gpus(gpus)

    def wait_ready(self, timeout: float) -> bool:
        """Block until the watcher has read the GPUs once (events registered where they can be)."""
        return self._ready.wait(timeout)

    @property
    def with_events(self) -> frozenset[str]:
        """UUIDs of the GPUs whose MIG event is registered."""
        return frozenset(self._with_event)

    @property
    def served(self) -> Fingerprint:
        """What the watcher takes as served: the last discovery's, or the last change it reported."""
        return self._served_copy()

    @property
    def checks(self) -> int:
        """Fingerprint reads made so far."""
        return self._checks

    @property
    def changes(self) -> int:
        """How many times on_change was called."""
        return self._changes

    def _set_gpus(self, gpus: Sequence[Gpu]) -> None:
        watched = {g.uuid: g.index for g in gpus if mig_capable(g) and g.uuid is not None}
        with self._lock:
            if set(watched) != set(self._gpus):
                self._rearm = True
            self._gpus = watched
            self._served = fingerprint_of(gpus)

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        import pynvml

        self._nvml = pynvml
        backoff = Backoff()
        pending_since: float | None = None  # first sign of a change not yet acted on
        check_at = 0.0  # read now: a change between the plugin's discovery and this start is not missed
        confirm: Fingerprint | None = None  # a periodic read that differed, waiting to be confirmed
        try:
            while not self._stop.is_set():
                try:
                    # Taken first, whatever else holds: the flag set for the GPUs given at construction
                    # must not arm a second time right after the first arm.
                    rearm = self._take_rearm()
                    if not self._initialised or self._event_set is None or rearm:
                        self._arm()
                        # Events queued in the old set, or sent while it was down, are gone: read now
                        # rather than at the next periodic read (30 s where every GPU sends the event).
                        check_at = 0.0
                    now = self._clock()
                    if now >= check_at:
                        event_driven = pending_since is not None and confirm is None
                        seen = self._read()
                        self._checks += 1
                        self._ready.set()
                        served = self._served_copy()
                        if seen == served:
                            pending_since = confirm = None
                        elif event_driven or seen == confirm:
                            self._report(served, seen)
                            pending_since = confirm = None
                        elif pending_since is not None and now - pending_since >= MAX_DELAY_S:
                            self._report(served, seen)  # a burst that never settles still gets served
                            pending_since = confirm = None
                        else:
                            # A periodic read differs: read again once things had a moment to settle.
                            pending_since = pending_since if pending_since is not None else now
                            confirm = seen
                            check_at = now + self._debounce
                            backoff.reset()
                            continue
                        check_at = now + self._interval()
                    if self._wait_for_event(check_at):
                        now = self._clock()
                        pending_since = pending_since if pending_since is not None else now
                        confirm = None
                        check_at = min(now + self._debounce, pending_since + MAX_DELAY_S)
                    # A whole read-and-wait went through: only now is the trouble over (an arm that works
                    # followed by a wait that keeps failing must still back off).
                    backoff.reset()
                except _NvmlGone:
                    self._initialised = False
                    self._disarm()
                    delay = backoff.next()
                    self._log.warning(
                        "NVML was shut down under the MIG watcher; initialising again in %.1fs", delay
                    )
                    self._stop.wait(delay)
                except Exception as exc:
                    # NVML refusing, a GPU vanishing mid-read, a bug: never fatal, never a health mark.
                    delay = backoff.next()
                    self._log.warning("MIG watcher: %s; trying again in %.1fs", _why(exc), delay)
                    self._disarm()
                    self._stop.wait(delay)
        finally:
            self._disarm()
            if self._initialised:
                with session_lock, suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()
                self._initialised = False

    def _interval(self) -> float:
        with self._lock:
            everyone = set(self._gpus) <= self._with_event
        return self._slow_poll_interval if everyone else self._poll_interval

    def _take_rearm(self) -> bool:
        with self._lock:
            rearm, self._rearm = self._rearm, False
        return rearm

    def _served_copy(self) -> Fingerprint:
        with self._lock:
            return dict(self._served)

    def _report(self, served: Fingerprint, seen: Fingerprint) -> None:
        self._log.info("MIG geometry changed (%s); re-reading the GPUs", describe_change(served, seen))
        with self._lock:
            self._served = dict(seen)
        self._changes += 1
        self._on_change()

    def _arm(self) -> None:
        nvml = self._nvml
        self._disarm()
        if not self._initialised:
            with session_lock:  # never interleaved with a discovery's init/shutdown
                nvml.nvmlInit()
            self._initialised = True
        self._event_set = nvml.nvmlEventSetCreate()
        with self._lock:
            gpus = dict(self._gpus)
        without = []
        for uuid, index in gpus.items():
            if self._register(uuid):
                self._with_event.add(uuid)
            else:
                without.append(f"GPU {index}")
        if without:
            self._log.info(
                "MIG watcher: %s send%s no MIG change events; reading %s MIG devices every %gs",
                ", ".join(without),
                "s" if len(without) == 1 else "",
                "its" if len(without) == 1 else "their",
                self._poll_interval,
            )
        else:
            self._log.info("MIG watcher: MIG change events registered on %d GPU(s)", len(gpus))

    def _register(self, uuid: str) -> bool:
        """Register the MIG event on the GPU; False where it cannot be had (NOT_SUPPORTED: an older
        driver, or one that offers it only while MIG is on)."""
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            # Tried whatever nvmlDeviceGetSupportedEventTypes says, as DCGM does: it is not known that every
            # driver that delivers the MIG event lists it there, and a refusal costs one call. On its own,
            # never with other types: a driver that refuses one type refuses the whole mask.
            nvml.nvmlDeviceRegisterEvents(handle, EVENT_MIG_CONFIG_CHANGE, self._event_set)
        except nvml.NVMLError as exc:
            if nvml_code(exc) == UNINITIALIZED:
                raise _NvmlGone from exc
            # Lost, refused, unknown: the periodic read still covers this GPU.
            self._log.debug("MIG watcher: no MIG event on GPU %s (%s)", uuid, exc)
            return False
        return True

    def _disarm(self) -> None:
        self._with_event.clear()
        if self._event_set is not None:
            with suppress(Exception):  # a set of a torn-down NVML is gone already
                self._nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None

    def _wait_for_event(self, until: float) -> bool:
        """Wait until `until` (in slices), or until a MIG event arrives (True); False early when the GPUs to
        watch changed (update())."""
        nvml = self._nvml
        while not self._stop.is_set():
            left = until - self._clock()
            if left <= 0:
                return False
            with self._lock:
                if self._rearm:
                    return False  # other GPUs to watch: arm for them now, not after this wait
            slice_s = min(left, WAIT_SLICE_S)
            if not self._with_event:
                self._stop.wait(slice_s)
                continue
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, max(1, math.ceil(slice_s * 1000)))
            except nvml.NVMLError as exc:
                code = nvml_code(exc)
                if code == TIMEOUT:
                    continue
                if code == UNINITIALIZED:
                    raise _NvmlGone from exc
                raise
            if int(data.eventType) & EVENT_MIG_CONFIG_CHANGE:
                return True
        return False

    def _read(self) -> Fingerprint:
        """The fingerprint as NVML has it now. Cheap calls only; a GPU that cannot be read keeps what was
        served (a lost GPU is the health monitor's to report)."""
        nvml = self._nvml
        with self._lock:
            gpus = dict(self._gpus)
            served = dict(self._served)
        out: Fingerprint = {}
        for uuid in gpus:
            try:
                out[uuid] = self._read_gpu(nvml.nvmlDeviceGetHandleByUUID(uuid))
            except nvml.NVMLError as exc:
                if nvml_code(exc) == UNINITIALIZED:
                    raise _NvmlGone from exc
                self._log.debug("MIG watcher: GPU %s not read (%s)", uuid, exc)
                if uuid in served:
                    out[uuid] = served[uuid]
        return out

    def _read_gpu(self, handle: Any) -> GpuPrint:
        nvml = self._nvml
        try:
            current = bool(nvml.nvmlDeviceGetMigMode(handle)[0])
        except nvml.NVMLError as exc:
            if nvml_code(exc) not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                raise
            return (None, ())
        if not current:
            return (False, ())
        devices = []
        for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError as exc:
                if nvml_code(exc) in (NOT_FOUND, INVALID_ARGUMENT):
                    continue  # an empty slot
                raise
            devices.append(
                (
                    nvml_text(nvml.nvmlDeviceGetUUID(mig)),
                    self._soft(nvml.nvmlDeviceGetGpuInstanceId, mig),
                    self._soft(nvml.nvmlDeviceGetComputeInstanceId, mig),
                )
            )
        return (True, tuple(sorted(devices)))

    def _soft(self, fn: Callable[[Any], Any], handle: Any) -> int | None:
        # As discovery reads them: a driver that does not answer gives None, on both sides.
        try:
            return int(fn(handle))
        except self._nvml.NVMLError as exc:
            if nvml_code(exc) not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                raise
            return None


def _why(exc: BaseException) -> str:
    return f"NVML: {exc}" if nvml_code(exc) is not None else f"{type(exc).__name__}: {exc}"


__all__ = ["EVENT_MIG_CONFIG_CHANGE", "POLL_INTERVAL_S", "MigWatcher", "describe_change", "fingerprint_of"]
