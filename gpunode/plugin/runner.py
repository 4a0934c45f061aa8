"""`gpunode plugin run` as a process: logging, signals, and the choice of a real or simulated node."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.nvml.model import Inventory
from gpunode.plugin import logsafe, statusfile
from gpunode.plugin.config import PluginConfig, load_config
from gpunode.plugin.logsafe import Line

if TYPE_CHECKING:
    from gpunode.plugin.pluginstatus import PluginStatus
    from gpunode.systemd.notify import Notifier


STATUS_FILE = statusfile.DEFAULT
STATUS_FILE_ENV = statusfile.ENV  # another place: a second plugin (tests, benchmarks), a container


class StatusReporter:
    """Tells systemd (READY=1 once every resource is registered, STATUS= on every change) and leaves the
    same facts in the status file (--status-file, $GPUNODE_PLUGIN_STATUS_FILE, else
    /run/gpunode/plugin-status.json) for `gpunode plugin status`."""

    def __init__(self, host: Host, notifier: Notifier, path: str | None = None) -> None:
        self.host = host
        self.notifier = notifier
        self.path = path or statusfile.plugin_path(None, host.env)[0]
        self.ready_sent = False
        self.was_ready = False
        self.last: str | None = None
        self.write_error: str | None = None  # the last failure to write the file, said once
        self.log = logging.getLogger("gpunode.plugin")

    def __call__(self, status: PluginStatus) -> None:
        summary = status.summary()
        # The file first: whoever sees the unit turn active (READY=1) must find the same facts in it.
        self._write(status, summary)
        if status.ready and not self.ready_sent:
            # Outside systemd nothing is sent; READY=1 is not tried again on every later update.
            self.ready_sent = self.notifier.ready(summary) or not self.notifier.enabled
        elif summary != self.last:
            self.notifier.status(summary)
        if status.ready and not self.was_ready:
            # Once per becoming ready (start, after a kubelet restart), not once per update or stream.
            self.log.info("ready: %s", summary)
        self.was_ready = status.ready
        self.last = summary

    def _write(self, status: PluginStatus, summary: str) -> None:
        document = {
            "pid": os.getpid(),
            "ready": status.ready,
            "waiting_for": status.waiting_for,
            "nvml_error": status.nvml_error,
            "summary": summary,
            "resources": [dataclasses.asdict(r) for r in status.resources],
            "unmonitored": [dataclasses.asdict(u) for u in status.unmonitored],
        }
        try:
            self.host.make_dirs(os.path.dirname(self.path), mode=0o755)
            self.host.write_file(self.path, json.dumps(document, indent=2) + "\n", mode=0o644)
        except (GpunodeError, OSError) as err:  # the status is a courtesy: never let it stop the plugin
            message = err.message if isinstance(err, GpunodeError) else f"{err.strerror or err}"
            if message != self.write_error:  # once per distinct failure: it recurs on every update
                self.log.warning(
                    "cannot write the status file %s (%s); serving on without it (`gpunode plugin status` "
                    "will not see this plugin; %s or %s puts the file elsewhere)",
                    self.path,
                    message,
                    statusfile.FLAG,
                    STATUS_FILE_ENV,
                )
                self.write_error = message
            return
        if self.write_error is not None:
            self.log.info("status file %s written again", self.path)
            self.write_error = None

    def remove(self) -> None:
        with contextlib.suppress(GpunodeError):
            self.host.remove_file(self.path)


class LogWriter:
    """Writes the plugin's log lines from a thread of its own, so that no thread serving kubelet or
    watching GPU health ever waits for the log's I/O.

    A write to stderr can stall: journald busy or rate-limiting, a pipe nobody reads, or the kernel's
    dirty-page throttling of a log file (a writer is paused up to 200 ms at a time under I/O load). The
    health thread logs "GPU n unhealthy" before it publishes the change, and Allocate logs before it
    answers: with the write in line, a stalled write held a health change back from kubelet (reported: ~240
    ms from the warning line to kubelet for 1 update in 5 under load) and would hold Allocate too. Now the
    caller queues the record (cheap) and this thread formats and writes it; the lines keep their order and
    their time stamps (taken at the call).

    The thread waits BATCH_DELAY after a record arrives before it formats and writes what has come, with
    one write(): records that come meanwhile wake nobody, and the thread that logged (an Allocate logs just
    before it answers) gets on without this one taking the GIL from it at once.
    """

    BATCH_DELAY = 0.002  # seconds

    def __init__(self, target: logging.StreamHandler[Any]) -> None:
        # Records, and lines from logsafe.log_line (a tuple: the record is made here, not by the caller).
        self.queue: queue.SimpleQueue[logging.LogRecord | Line | None] = queue.SimpleQueue()
        self.handler: logging.Handler = _Enqueue(self.queue)
        self._target = target
        self._thread = threading.Thread(target=self._run, name="gpunode-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self.queue.get()]
            time.sleep(self.BATCH_DELAY)
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self.queue.get_nowait())
            if None in batch:
                stopping = True
                batch = batch[: batch.index(None)]
            self._write([r for r in batch if r is not None])

    def _write(self, items: list[logging.LogRecord | Line]) -> None:
        target = self._target
        lines = []
        records = [item if isinstance(item, logging.LogRecord) else _record(*item) for item in items]
        for record in records:
            if record.levelno < target.level:
                continue
            try:
                lines.append(target.format(record) + target.terminator)
            except Exception:  # a record that cannot be formatted: logging's own report, not the thread's end
                target.handleError(record)
        if not lines:
            return
        try:
            target.stream.write("".join(lines))
            target.flush()
        except Exception:  # stderr gone (a closed pipe): logging's report, as StreamHandler.emit does
            target.handleError(records[-1])

    def own(self, root: logging.Logger) -> None:
        """This writer's handler is now `root`'s only one, and nothing propagates past it: log_line may hand
        lines of root's children straight to the queue."""
        logsafe.SINK.put, logsafe.SINK.root, logsafe.SINK.handler = self.queue.put, root, self.handler

    def stop(self, timeout: float = 2.0) -> None:
        """Write what is queued; give up after `timeout` (a stalled stderr must not keep the plugin up)."""
        if logsafe.SINK.handler is self.handler:  # later lines go through logging again
            logsafe.SINK.put = logsafe.SINK.root = logsafe.SINK.handler = None
        self.queue.put(None)
        self._thread.join(timeout)


class _Formatter(logging.Formatter):
    """logging.Formatter, with the date and time of the time stamp made once per second: localtime and
    strftime were ~60 % of formatting a line, and the log thread formats one per Allocate, taking the GIL
    from the threads serving kubelet (issue 24). Only the log thread formats, so the cache needs no lock."""

    _second: int | None = None
    _stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._stamp = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        # As logging.Formatter.formatTime: ",mmm" unless default_msec_format is None.
        msec = self.default_msec_format
        return msec % (self._stamp, record.msecs) if msec else self._stamp


def _record(created: float, level: int, name: str, message: str) -> logging.LogRecord:
    """The record logging would have made at `created` for `message` (no args, no caller), made in the
    log thread; its time stamps are the call's (msecs computed as LogRecord computes it)."""
    # Through the record factory, as Logger.makeRecord makes every record.
    factory = logging.getLogRecordFactory()
    record = factory(name, level, "(unknown file)", 0, message, None, None, "(unknown function)")
    record.relativeCreated -= (record.created - created) * 1000
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0
    return record


class _Enqueue(logging.Handler):
    """Hands each record to the log thread as it is, where logging.handlers.QueueHandler would format it
    and copy it first: an Allocate pays ~10 µs less, and the record is formatted by the log thread. Safe
    because gpunode's log arguments are strings and numbers, never objects that change after the call."""

    def __init__(self, target: queue.SimpleQueue[logging.LogRecord | Line | None]) -> None:
        super().__init__()
        self._put = target.put

    def handle(self, record: logging.LogRecord) -> bool:
        # No filters and no lock: SimpleQueue.put is thread-safe and never blocks.
        self._put(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self._put(record)


def setup_logging(debug: bool, env: Mapping[str, str]) -> LogWriter:
    # Under systemd the journal stamps every line itself (JOURNAL_STREAM is set); elsewhere add the time.
    fmt = (
        "%(levelname)s %(message)s" if env.get("JOURNAL_STREAM") else "%(asctime)s %(levelname)s %(message)s"
    )
    # Nothing gpunode's format prints: not looked up for every record (an Allocate logs one line).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # Nor where the call came from: without this every record walks the caller's stack (findCaller, ~10 %
    # of an Allocate's own time, issue 24) for file, line and function names the format never prints. The
    # logging documentation's own advice ("Optimization"): set logging._srcfile to None.
    logging._srcfile = None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(fmt))
    writer = LogWriter(handler)
    root = logging.getLogger("gpunode")
    root.handlers[:] = [writer.handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False
    writer.own(root)
    return writer


def config_loader(
    host: Host, config_path: str | None, flags: Mapping[str, Any]
) -> Callable[[], PluginConfig]:
    """Re-reads the file and the environment each call, so SIGHUP picks up edits."""

    def load() -> PluginConfig:
        return load_config(host, config_path=config_path, env=os.environ, flags=flags)

    return load


def inventory_source(host: Host, simulate: str | None) -> Callable[[PluginConfig], Inventory]:
    if simulate:
        from gpunode.plugin.simulate import PROFILES, simulated_inventory

        if simulate not in PROFILES:
            simulated_inventory(simulate)  # raises the UsageError that names the known profiles
        # `no-driver` and `init-fail` fail later, like NVML would, so fail-on-init-error applies to them.
        return lambda _config: simulated_inventory(simulate)

    def real(config: PluginConfig) -> Inventory:
        from gpunode.nvml import discover
        from gpunode.plugin.driver import preload_nvml

        preload_nvml(host, config.driver_root)
        return discover(host)

    return real


def run_plugin(
    host: Host,
    *,
    config_path: str | None,
    flags: Mapping[str, Any],
    simulate: str | None,
    debug: bool,
    status_file: str | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT; SIGHUP reloads. Raises GpunodeError for what stops it at start."""
    writer = setup_logging(debug, os.environ)
    try:
        _serve(host, config_path=config_path, flags=flags, simulate=simulate, status_file=status_file)
    finally:
        # Every line logged so far is written before the process exits (or the CLI prints an error).
        writer.stop()


def _serve(
    host: Host,
    *,
    config_path: str | None,
    flags: Mapping[str, Any],
    simulate: str | None,
    status_file: str | None,
) -> None:
    from gpunode.plugin.lifecycle import Plugin
    from gpunode.plugin.signals import SignalRelay
    from gpunode.systemd.notify import Notifier

    log = logging.getLogger("gpunode.plugin")
    loader = config_loader(host, config_path, flags)
    notifier = Notifier()
    status_path, status_source = statusfile.plugin_path(status_file, host.env)
    reporter = StatusReporter(host, notifier, status_path)
    interval = notifier.watchdog_interval
    plugin = Plugin(
        host,
        loader,
        inventory_source(host, simulate),
        simulated=bool(simulate),
        on_status=reporter,
        heartbeat=(interval, notifier.watchdog) if interval else None,
        status_file=status_path,
    )
    if statusfile.in_socket_dir(host, status_path, plugin.config.socket_dir):
        raise statusfile.socket_dir_error(status_path, status_source, plugin.config.socket_dir)
    # Relayed from a thread, not handled by the main one: see gpunode/plugin/signals.py.
    relay = SignalRelay(
        {
            signal.SIGTERM: plugin.request_stop,
            signal.SIGINT: plugin.request_stop,
            signal.SIGHUP: plugin.request_reload,
        }
    ).start()
    log.info(
        "gpunode device plugin starting (%s; socket dir %s)",
        f"simulated node {simulate!r}" if simulate else "NVML",
        plugin.config.socket_dir,
    )
    # Start-up is done: the modules, classes and config built so far live as long as the process. Frozen,
    # the collector never scans them again (each later collection is cheaper); `plugin run` had it off
    # while it imported (argv.run).
    gc.freeze()
    gc.enable()
    try:
        plugin.run()
    finally:
        notifier.stopping()
        reporter.remove()
        # Last, and the handlers left doing nothing: a second SIGTERM (or a SIGHUP) while the plugin
        # cleans up must not cut it short and leave its status file behind.
        relay.close(restore=False)
    log.info("stopped")
