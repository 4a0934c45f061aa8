"""serve → register → watch: the plugin's life, driven by events on one queue.

Everything that changes the plugin's state happens on the thread that calls `run()`, one event at a
time: inotify events from the device-plugins directory, signals (stop, reload), timers (register
retries, NVML retries). Each event ends in `_reconcile()`, which compares what should be (a server per
resource on a socket that is still ours, registered with the kubelet.sock that exists now) with what is,
and fixes the difference. A kubelet restart is just such a difference: our socket is gone and
kubelet.sock has a new inode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import posixpath
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from gpunode.errors import ConfigError, ExitCode, GpunodeError, NvmlError
from gpunode.host import Host
from gpunode.nvml.model import Inventory
from gpunode.paths import PLUGIN_SERVICE as PLUGIN_UNIT
from gpunode.plugin.allocate import IMEX_CDI_KIND, AllocateSettings, DeviceNodes, read_device_nodes
from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.api import deviceplugin_pb2_grpc
from gpunode.plugin.config import PluginConfig
from gpunode.plugin.devices import DeviceHealth, DeviceRegistry, Resource, Sharing, Unit, build_resources
from gpunode.plugin.health import HealthMonitor
from gpunode.plugin.logsafe import shown
from gpunode.plugin.migwatch import MigWatcher
from gpunode.plugin.observe import PluginObserver, start_observer
from gpunode.plugin.pluginstatus import PluginStatus, ResourceStatus, UnmonitoredGpu
from gpunode.plugin.preferred import Topology
from gpunode.plugin.server import ResourceServer, ServeSettings, device_message
from gpunode.plugin.statusfile import in_socket_dir, socket_dir_error
from gpunode.plugin.watch import DirectoryWatch, DirEvent

if TYPE_CHECKING:
    from gpunode.plugin.mps import MpsSupervisor

log = logging.getLogger("gpunode.plugin")
pb_grpc: Any = deviceplugin_pb2_grpc  # generated, untyped

KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"
REGISTER_TIMEOUT = 5.0
RETRY_FIRST = 0.2
RETRY_MAX = 10.0
DISCOVERY_RETRY_MAX = 60.0
# kubelet's gRPC client refuses any message over 4 MiB (Go grpc's default): a longer device list would be
# served while the plugin says "ready", and kubelet would see nothing but errors.
KUBELET_MAX_MESSAGE = 4 * 1024 * 1024
DETAIL_LIMIT = 300  # characters of kubelet's error text kept (its real messages are one short sentence)


class SocketDirBusy(GpunodeError):
    """Another gpunode plugin serves in this socket directory."""


def check_message_sizes(resources: tuple[Resource, ...]) -> None:
    """Refuse device lists kubelet could not receive (ConfigError naming the resource and the fix).

    Measured on the real message, every device Unhealthy (the longest it gets)."""
    for resource in resources:
        message = pb.ListAndWatchResponse(
            devices=[device_message(DeviceHealth(d, False, "size")) for d in resource.devices]
        )
        size = message.ByteSize()
        if size > KUBELET_MAX_MESSAGE:
            raise ConfigError(
                f"{resource.name}: the device list of {len(resource.devices)} devices is a "
                f"{size / 1048576:.1f} MiB ListAndWatch message, over kubelet's 4 MiB limit",
                "use fewer time-slicing replicas (time-slicing.replicas), or a MIG layout with fewer "
                "instances",
            )


def _warn_unused_sharing(config: PluginConfig, resources: tuple[Resource, ...]) -> None:
    """A sharing entry for a resource this node does not serve (a MIG profile it lacks, a typo) shares
    nothing; NVIDIA's plugin says nothing, gpunode says so once per (re)load."""
    domain = config.resource_name.split("/", 1)[0]
    served = {r.name for r in resources}
    entries = [("time-slicing.resources", e) for e in config.shared_resources]
    entries += [("mps.resources", e) for e in config.mps_resources]
    for key, entry in entries:
        name = entry.name if "/" in entry.name else f"{domain}/{entry.name}"
        renamed = entry.rename if "/" in entry.rename else f"{domain}/{entry.rename}"
        if (
            name not in served
            and name + ".shared" not in served
            and (not entry.rename or renamed not in served)
        ):
            log.warning(
                "%s: %s is not a resource of this node (it serves %s); that entry shares nothing",
                key,
                name,
                ", ".join(sorted(served)) or "none",
            )


def _sharing(config: PluginConfig) -> Sharing:
    """How replicas share a GPU: MPS when mps.resources shares anything (config refuses a mix with
    time-slicing), else time-slicing."""
    if any(e.replicas > 1 for e in config.mps_resources):
        return Sharing(1, config.rename_by_default, config.mps_resources, strategy="mps")
    return Sharing(config.replicas, config.rename_by_default, config.shared_resources)


class ServeFailed(GpunodeError):
    """A resource's socket could not be served (permissions, a bad socket directory)."""


@dataclass
class _Served:
    server: ResourceServer
    # Identity of the kubelet.sock we registered with: (inode, ctime). File systems reuse inode numbers at
    # once (ext4 gives a re-created kubelet.sock the old one's), the change time tells the two apart.
    registered_with: tuple[int, int] | None = None
    refused: str | None = None
    retry_delay: float = RETRY_FIRST
    retry_timer: threading.Timer | None = None


class Plugin:
    """The device plugin process. `run()` blocks until `request_stop()` (SIGTERM/SIGINT)."""

    def __init__(
        self,
        host: Host,
        load_config: Callable[[], PluginConfig],
        discover: Callable[[PluginConfig], Inventory],
        *,
        simulated: bool = False,
        on_status: Callable[[PluginStatus], None] | None = None,
        heartbeat: tuple[float, Callable[[], object]] | None = None,
        status_file: str | None = None,
    ) -> None:
        """`heartbeat` (interval, fn): fn is called at least that often from the event loop itself, so
        a watchdog fed by it notices a loop that is stuck (systemd's WatchdogSec). `status_file`: where
        the status is written, which a reload may not move the socket directory over."""
        self.host = host
        self._status_file = status_file
        self._load_config = load_config
        self._discover = discover
        self.simulated = simulated
        self.on_status = on_status
        self._heartbeat = heartbeat
        self.config: PluginConfig = load_config()
        # Health changes reach the status (STATUS=, the status file) through the event loop too.
        self.registry = DeviceRegistry(on_health_change=lambda: self._events.put(("health", None)))
        self.status = PluginStatus()
        self._events: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._served: dict[str, _Served] = {}
        self._topology = Topology.from_inventory(Inventory(None, None, None, ()))
        self._nodes = DeviceNodes()
        self._inventory: Inventory | None = None
        self._health: HealthMonitor | None = None
        self._health_pending: Inventory | None = None  # a discovery whose GPUs the monitor should watch
        self._mps: MpsSupervisor | None = None  # MPS control daemons, once a resource shares through MPS
        self._mig_watch: MigWatcher | None = None  # MIG geometry changes, seen without a SIGHUP
        self._watch: DirectoryWatch | None = None
        self._discovery_timer: threading.Timer | None = None
        self._discovery_delay = 1.0
        self._stopped = threading.Event()
        self._dir_lock: tuple[int, int] | None = None  # (fd, inode) of the socket directory we hold
        # Metrics, Events and the GPUHealthy condition (issue 18); a do-nothing observer until run().
        self._observer = PluginObserver()

    # -- called from other threads (signal handlers, timers, the watch) -------------------------

    def request_stop(self) -> None:
        self._events.put(("stop", None))

    def request_reload(self) -> None:
        self._events.put(("reload", None))

    # -- the loop -------------------------------------------------------------------------------

    @property
    def socket_dir(self) -> str:
        return str(self.host.path(self.config.socket_dir))

    def run(self) -> None:
        try:
            # Read once: a new metrics address or events setting takes a restart, not a SIGHUP.
            self._observer = start_observer(self.host, self.config, simulated=self.simulated)
            self._load_devices(first=True)
            self._start_watch()
            self._reconcile()
            self._restart_pending_health()
            next_beat = 0.0
            while True:
                if self._heartbeat is not None:
                    interval, beat = self._heartbeat
                    now = time.monotonic()
                    if now >= next_beat:
                        beat()
                        next_beat = now + interval
                    try:
                        kind, payload = self._events.get(timeout=max(0.0, next_beat - time.monotonic()))
                    except queue.Empty:
                        continue
                else:
                    kind, payload = self._events.get()
                if kind == "stop":
                    log.info("stopping")
                    return
                if kind == "health":
                    self._update_status(self.status.waiting_for)
                    continue
                if kind == "reload":
                    self._reload()
                elif kind == "rediscover":
                    self._rediscover("after NVML came back")
                elif kind == "mig":
                    self._mig_changed()
                elif kind == "fs" and isinstance(payload, DirEvent):
                    if not self._relevant(payload):
                        continue
                    if payload.name == KUBELET_SOCKET:
                        self._kubelet_appeared()
                try:
                    self._reconcile()
                except (ServeFailed, SocketDirBusy) as err:
                    # Fatal at start (above); later, e.g. the directory re-created with other permissions,
                    # keep the plugin alive and try again.
                    log.error("%s; retrying in 1s", err.message)
                    retry = threading.Timer(1.0, lambda: self._events.put(("retry", None)))
                    retry.daemon = True
                    retry.start()
                finally:
                    self._restart_pending_health()
        finally:
            self._shutdown()

    def _relevant(self, event: DirEvent) -> bool:
        if event.kind in ("dir-ready", "dir-gone"):
            return True
        if event.name == KUBELET_SOCKET:
            return event.kind == "created"
        return event.kind == "deleted" and any(
            os.path.basename(s.server.socket_path) == event.name for s in self._served.values()
        )

    def _kubelet_appeared(self) -> None:
        # A new kubelet: register now, whatever retries were pending (reconcile sees it is new).
        for served in self._served.values():
            served.retry_delay = RETRY_FIRST
            if served.retry_timer is not None:
                served.retry_timer.cancel()
                served.retry_timer = None

    def _start_watch(self) -> None:
        self._watch = DirectoryWatch(self.socket_dir, lambda e: self._events.put(("fs", e)))
        self._watch.start()

    def _shutdown(self) -> None:
        self._stopped.set()
        for timer in [self._discovery_timer, *(s.retry_timer for s in self._served.values())]:
            if timer is not None:
                timer.cancel()
        # Streams first (closing the registry ends every ListAndWatch at once), then the servers, which
        # then have nothing in flight to wait for.
        self.registry.close()
        for name, served in list(self._served.items()):
            served.server.stop()
            log.info("%s: stopped serving, removed %s", name, served.server.socket_path)
        self._served.clear()
        if self._watch is not None:
            self._watch.stop()
        if self._health is not None:
            self._health.stop()
        if self._mps is not None:
            self._mps.stop()
        if self._mig_watch is not None:
            self._mig_watch.stop()
        self._release_dir_lock()
        self._observer.stop()

    # -- devices --------------------------------------------------------------------------------

    def _load_devices(self, *, first: bool) -> None:
        config = self.config
        try:
            inventory = self._discover(config)
        except NvmlError as err:
            if first and config.fail_on_init_error:
                raise
            self.status.nvml_error = err.message
            log.error("NVML: %s%s; retrying", err.message, f" (fix: {err.fix})" if err.fix else "")
            self._schedule_discovery()
            if first:
                self.registry.replace(())
            else:
                self._update_services()  # a reload's new settings apply while the GPUs cannot be read too
            return
        self.status.nvml_error = None
        resources = build_resources(
            inventory,
            resource_name=config.resource_name,
            mig_strategy=config.mig_strategy,
            device_id_strategy=config.device_id_strategy,
            sharing=_sharing(config),
            gpu_names=config.gpu_resources,
            mig_names=config.mig_resources,
        )
        check_message_sizes(resources)
        _warn_unused_sharing(config, resources)
        if not self.simulated:
            self._refresh_cdi_spec(inventory)
            self._check_cdi_spec(resources, first=first)
        # Device nodes are looked for, and handed to the runtime, under the device root (NVIDIA's
        # nvidiaDevRoot), which is the driver root unless set. Read before anything is replaced: a
        # required IMEX channel that is missing refuses the (re)load as a whole.
        dev_root = config.dev_root or config.driver_root
        nodes = (
            DeviceNodes(driver_root=dev_root)
            if self.simulated
            else self._imex_cdi(
                read_device_nodes(
                    self.host,
                    dev_root,
                    resources,
                    imex_channel_ids=config.imex_channel_ids,
                    imex_required=config.imex_required,
                )
            )
        )
        self._inventory = inventory
        if not any(r.devices for r in resources):
            log.warning("NVML reports no GPUs; waiting for some to appear")
            self._schedule_discovery()
        else:
            self._discovery_delay = 1.0
        if not self.simulated:
            self._apply_mps(resources, inventory)
        self._topology = Topology.from_inventory(inventory)
        self._nodes = nodes
        if not first:
            # Servers that stay answer Allocate for new devices too: they get the new discovery's device
            # nodes (MIG nvidia-caps) and topology before the new lists reach kubelet (replace() wakes the
            # streams), so an Allocate of a device kubelet just learnt of never misses its nodes.
            self._update_services()
        self.registry.replace(resources, {g.uuid: g.index for g in inventory.gpus if g.uuid})
        marked = self.registry.unhealthy_units()
        for gpu in inventory.gpus:
            if gpu.lost and Unit(gpu.index) not in marked:
                # Once: on a re-discovery the health monitor's own mark (and its recovery) stands, and a
                # rewrite would resend a list nothing changed in.
                self.registry.mark(Unit(gpu.index), "lost from the bus (at start)")
        for resource in resources:
            log.info(
                "%s: %d device%s%s",
                resource.name,
                len(resource.devices),
                "" if len(resource.devices) == 1 else "s",
                f" ({resource.replicas} replicas per GPU)" if resource.replicas > 1 else "",
            )
        if first:
            self._restart_health(inventory)  # watching before anything is served
        elif (
            self._health_pending is None
            and self._health is not None
            and self._health.update(inventory.gpus, self.config.health)
        ):
            pass  # the same GPUs and settings (a MIG change): the running monitor takes the new layout
        else:
            # After the reconcile that follows: stopping the old monitor (which watches meanwhile) waits up
            # to its NVML wait slice, which a new resource (a MIG profile just created) should not wait for.
            self._health_pending = inventory
        self._follow_mig(inventory)

    def _refresh_cdi_spec(self, inventory: Inventory) -> None:
        """Keep gpunode's own CDI spec true to what NVML reports now: at start, and on every re-discovery
        (SIGHUP after a MIG repartitioning, GPUs that appear). Only a spec gpunode wrote (`gpunode cdi
        generate` / `cdi install`, at its default path) is regenerated, and only rewritten when it changed;
        a node whose operator never asked for one gets none. A failure is logged: the check that follows
        says what is missing."""
        config = self.config
        if not any(s.startswith("cdi-") for s in config.device_list_strategy):
            return
        from gpunode.cdi.generate import GenerateOptions, default_output, generate, write_spec
        from gpunode.cdi.registry import spec_dirs

        # gpunode's spec by its name, in the dynamic (last, winning) directory the runtimes read.
        path = posixpath.join(spec_dirs(self.host)[-1], posixpath.basename(default_output(config.cdi_kind)))
        options = GenerateOptions(
            kind=config.cdi_kind,
            driver_root=config.driver_root,
            dev_root=config.dev_root or None,
            output=path,
        )
        if not self.host.is_file(path):
            return
        try:
            if write_spec(self.host, generate(self.host, inventory, options)):
                log.info("CDI spec %s regenerated: the GPUs or MIG devices changed", options.path)
        except GpunodeError as exc:
            log.error("could not regenerate the CDI spec %s: %s", options.path, exc.message)

    def _check_cdi_spec(self, resources: tuple[Resource, ...], *, first: bool) -> None:
        """With a cdi-* strategy every device answered must be in a CDI spec the runtime reads: a name it
        lacks fails each pod given it ("unresolvable CDI devices"), long after the plugin said ready. At
        start that refuses the start; later (SIGHUP, new GPUs) it is logged, and the devices are served."""
        config = self.config
        if not any(s.startswith("cdi-") for s in config.device_list_strategy):
            return
        from gpunode.cdi.registry import spec_dirs, unresolvable

        names = list(dict.fromkeys(d.visible_id for r in resources for d in r.devices))
        missing = unresolvable(self.host, config.cdi_kind, names)
        if not missing:
            return
        shown_names = ", ".join(f"{config.cdi_kind}={n}" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        strategies = " and ".join(s for s in config.device_list_strategy if s.startswith("cdi-"))
        where = " or ".join(spec_dirs(self.host))
        message = (
            f"device-list strategy {strategies} answers with CDI devices that no spec in {where} defines "
            f"(or that two specs define at once): {shown(shown_names)}{more}"
        )
        options = "" if config.cdi_kind == "nvidia.com/gpu" else f" --kind {config.cdi_kind}"
        if config.driver_root != "/":
            options += f" --driver-root {config.driver_root}"
        fix = (
            f"run `gpunode cdi generate{options}` (and `gpunode cdi install` to keep it current); "
            "`gpunode cdi check` names any conflicting spec"
        )
        if first:
            raise ConfigError(message, fix)
        log.error("%s (fix: %s)", message, fix)

    def _imex_cdi(self, nodes: DeviceNodes) -> DeviceNodes:
        """With a cdi-* strategy NVIDIA's plugin answers each IMEX channel as the CDI device
        nvidia.com/imex-channel=<id>; gpunode does so for the channels a CDI spec defines, and says which
        it cannot (a name no spec holds would fail every pod given it)."""
        if not nodes.imex_channels or not any(s.startswith("cdi-") for s in self.config.device_list_strategy):
            return nodes
        from gpunode.cdi.registry import unresolvable

        missing = set(unresolvable(self.host, IMEX_CDI_KIND, list(nodes.imex_channels)))
        for channel in sorted(missing):
            log.warning(
                "IMEX channel %s: no CDI spec defines %s=%s, so the cdi-* strategies do not pass it (the "
                "envvar and volume-mounts strategies and pass-device-specs still do)",
                channel,
                IMEX_CDI_KIND,
                channel,
            )
        names = tuple(f"{IMEX_CDI_KIND}={c}" for c in nodes.imex_channels if c not in missing)
        return dataclasses.replace(nodes, imex_cdi=names)

    def _apply_mps(self, resources: tuple[Resource, ...], inventory: Inventory) -> None:
        """Want a control daemon for each MPS-shared resource (the supervisor starts, adopts or stops them);
        a resource whose daemon is not answering yet is served all-unhealthy until it does."""
        if self._mps is None and not any(r.sharing == "mps" for r in resources):
            return  # no MPS on this node: the module is not even imported (start-up, memory)
        from gpunode.plugin.mps import MpsSupervisor, daemon_specs, find_control_program

        config = self.config
        specs = daemon_specs(
            resources,
            inventory,
            root=config.mps_root,
            active_thread_percentage=config.mps_active_thread_percentage,
            pinned_memory_limit_mib=config.mps_pinned_memory_limit,
        )
        if self._mps is None:
            if not specs:
                return
            self._mps = MpsSupervisor(
                self.host,
                config.mps_root,
                self.registry.set_resource_down,
                find_program=lambda: find_control_program(self.host),
            )
        self._mps.apply(specs)

    def _restart_pending_health(self) -> None:
        inventory, self._health_pending = self._health_pending, None
        if inventory is not None:
            self._restart_health(inventory)

    def _restart_health(self, inventory: Inventory) -> None:
        if self._health is not None:
            self._health.stop()
            self._health = None
        if self.simulated:
            return  # no NVML to ask: a simulated node is always healthy
        self._health = HealthMonitor(self.registry, inventory.gpus, self.config.health)
        self._health.start()

    def _follow_mig(self, inventory: Inventory) -> None:
        """Watch the MIG geometry of what was just read (only a MIG strategy on a MIG-capable node needs it;
        a simulated node has no NVML). A running watcher is told what is served now rather than replaced:
        no new NVML session or event set for each change it reports."""
        if self.simulated or not MigWatcher.wanted(inventory.gpus, self.config.mig_strategy):
            if self._mig_watch is not None:
                self._mig_watch.stop()
                self._mig_watch = None
            return
        if self._mig_watch is None:
            self._mig_watch = MigWatcher(inventory.gpus, lambda: self._events.put(("mig", None)))
            self._mig_watch.start()
        else:
            self._mig_watch.update(inventory.gpus)

    def _mig_changed(self) -> None:
        """The MIG watcher saw the geometry change: read the GPUs again and serve what is there now.

        The registry resends only the lists that changed; _reconcile (after this) serves and registers new
        resources and stops those that are gone; resources that did not change keep their socket,
        registration and stream. Devices kubelet allocated are not touched (MIG instances in use cannot
        be destroyed)."""
        self._rediscover("after a MIG change")

    def _rediscover(self, when: str) -> None:
        """Read the GPUs again (a MIG change, a discovery retried after NVML failed) and serve what is there;
        a node that does not fit the settings now keeps what it serves."""
        try:
            self._load_devices(first=False)
        except ConfigError as err:
            # E.g. mig-strategy single while a repartition is half done (two profiles at once): keep what is
            # served; the watcher reports the next change, and SIGHUP re-reads at any time.
            log.error(
                "%s: %s%s; keeping the resources served",
                when,
                err.message,
                f" (fix: {err.fix})" if err.fix else "",
            )
            return

    def _update_services(self) -> None:
        """The running servers take the current topology, device nodes and settings."""
        settings = self._serve_settings()
        for served in self._served.values():
            served.server.service.update(self._topology, settings)

    def _schedule_discovery(self) -> None:
        if self._discovery_timer is not None:
            self._discovery_timer.cancel()
        delay = self._discovery_delay
        self._discovery_delay = min(delay * 2, DISCOVERY_RETRY_MAX)
        self._discovery_timer = threading.Timer(delay, lambda: self._events.put(("rediscover", None)))
        self._discovery_timer.daemon = True
        self._discovery_timer.start()

    def _reload(self) -> None:
        log.info("reloading configuration and re-reading the GPUs (SIGHUP)")
        try:
            config = self._load_config()
        except GpunodeError as err:
            log.error("reload refused, keeping the running configuration: %s", err.message)
            return
        old = self.config
        if self._mps is not None and config.mps_root != old.mps_root:
            # Moving the daemons means stopping them all: that is a restart's business, not a reload's.
            log.error(
                "reload refused, keeping the running configuration: mps.root changed (%s -> %s); restart "
                "the plugin to move the MPS control daemons",
                old.mps_root,
                config.mps_root,
            )
            return
        if self._status_file is not None and in_socket_dir(self.host, self._status_file, config.socket_dir):
            # As at start (runner): a status file there would wait on the socket directory's lock.
            log.error(
                "reload refused, keeping the running configuration: %s",
                socket_dir_error(self._status_file, "this plugin's", config.socket_dir).message,
            )
            return
        self.config = config
        try:
            self._load_devices(first=False)
        except (ConfigError, NvmlError) as err:
            log.error("reload refused, keeping the running configuration: %s", err.message)
            self.config = old
            return
        if old.socket_dir != config.socket_dir and self._watch is not None:
            self._watch.stop()
            self._start_watch()
        # Servers of resources that stay keep their sockets and took the new settings (_load_devices);
        # registering again makes kubelet open a fresh stream (and read the new options) without a gap in
        # which it would count the devices as unhealthy. Resources that went away are stopped by _reconcile.
        for served in self._served.values():
            served.registered_with = None

    # -- serve and register ---------------------------------------------------------------------

    def _serve_settings(self) -> ServeSettings:
        c = self.config
        return ServeSettings(
            pre_start_required=c.pre_start_required,
            placement=c.placement,
            allocate=AllocateSettings(
                device_list_strategy=c.device_list_strategy,
                pass_device_specs=c.pass_device_specs and not self.simulated,
                cdi_kind=c.cdi_kind,
                fail_requests_greater_than_one=c.fail_requests_greater_than_one,
                nodes=self._nodes,
                extra_envs={
                    name: "enabled"
                    for name, on in (
                        ("NVIDIA_GDS", c.gds_enabled),
                        ("NVIDIA_MOFED", c.mofed_enabled),
                        ("NVIDIA_GDRCOPY", c.gdrcopy_enabled),
                    )
                    if on
                },
                annotation_prefix=c.cdi_annotation_prefix,
                mps=self._mps.mounts() if self._mps is not None else {},
            ),
        )

    def _reconcile(self) -> None:
        wanted = {r.name: r for r in self.registry.resources() if r.devices}
        for name in [n for n in self._served if n not in wanted]:
            self._served.pop(name).server.stop()
            log.info("%s: no longer served", name)

        if not os.path.isdir(self.socket_dir):
            self._update_status("the device-plugins directory " + self.config.socket_dir)
            return
        if wanted:
            self._lock_socket_dir()
        for name, resource in wanted.items():
            served = self._served.get(name)
            if served is not None and served.server.socket_is_ours():
                continue
            if served is not None:
                log.info("%s: our socket was removed (kubelet restart?); serving again", name)
                # No grace: the kubelet that held streams on it is gone. Stopped before the new server
                # binds, because gRPC unlinks its socket path when it stops.
                served.server.stop(grace=0.0, remove_socket=False)
                if served.retry_timer is not None:
                    served.retry_timer.cancel()
            self._served[name] = _Served(self._serve(resource))

        kubelet = os.path.join(self.socket_dir, KUBELET_SOCKET)
        try:
            st = os.stat(kubelet)
            kubelet_inode: tuple[int, int] | None = (st.st_ino, st.st_ctime_ns)
        except FileNotFoundError:
            kubelet_inode = None
        if kubelet_inode is not None:
            for name, served in self._served.items():
                if served.registered_with != kubelet_inode and served.retry_timer is None:
                    self._register(name, served, kubelet, kubelet_inode)
        waiting = None
        if self.status.nvml_error:
            waiting = "NVML"
        elif not wanted:
            waiting = "GPUs"
        elif kubelet_inode is None:
            waiting = f"kubelet ({kubelet} does not exist)"
        self._update_status(waiting)

    def _lock_socket_dir(self) -> None:
        """Hold an exclusive flock on the socket directory itself while serving in it.

        Two plugins on one directory would take turns replacing each other's sockets and registering
        (each sees its socket gone and serves again): the second one is refused instead. The directory
        is locked rather than a file in it, because kubelet deletes the directory's files when it
        restarts; a directory re-created since is locked again.
        """
        st = os.stat(self.socket_dir)
        if self._dir_lock is not None and self._dir_lock[1] == st.st_ino:
            return
        self._release_dir_lock()
        fd = os.open(self.socket_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SocketDirBusy(
                f"another gpunode device plugin is serving in {self.config.socket_dir}; refusing to "
                "start a second one (they would keep replacing each other's sockets)",
                f"stop the other one (`systemctl status {PLUGIN_UNIT}`, `pgrep -af 'gpunode plugin run'`), "
                "or give this one another --socket-dir",
            ) from None
        self._dir_lock = (fd, os.fstat(fd).st_ino)

    def _release_dir_lock(self) -> None:
        if self._dir_lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir_lock[0])  # closing the only descriptor releases the flock
            self._dir_lock = None

    def _serve(self, resource: Resource) -> ResourceServer:
        path = os.path.join(self.socket_dir, resource.socket_name)
        service = self._observer.service(resource.name, self.registry, self._topology, self._serve_settings())
        server = ResourceServer(path, service)
        try:
            server.start()
        except (OSError, RuntimeError) as exc:  # grpc reports a failed bind as RuntimeError
            server.stop(grace=0.0, remove_socket=False)
            raise ServeFailed(
                f"{resource.name}: cannot serve on {path}: {exc}",
                f"check that {self.config.socket_dir} is kubelet's device-plugins directory and that "
                "gpunode runs as root (it must create sockets there)",
                exit_code=ExitCode.PERMISSION if isinstance(exc, PermissionError) else ExitCode.ERROR,
            ) from exc
        log.info("%s: serving on %s", resource.name, path)
        return server

    def _register(self, name: str, served: _Served, kubelet: str, inode: tuple[int, int]) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=os.path.basename(served.server.socket_path),
            resource_name=name,
            options=pb.DevicePluginOptions(
                pre_start_required=self.config.pre_start_required, get_preferred_allocation_available=True
            ),
        )
        served.server.service.expect_kubelet()  # kubelet answers Register by opening ListAndWatch
        try:
            with grpc.insecure_channel(f"unix://{kubelet}") as channel:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            detail = err.details() if isinstance(err, grpc.Call) else str(err)
            # Whatever answers on kubelet.sock wrote it: escaped and bounded before it is logged or shown.
            detail = shown(detail or "", limit=DETAIL_LIMIT)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None):
                self._observer.register_failed(
                    name, f"{code.name if code else 'error'}: {detail}", refused=False
                )
                self._retry_register(name, served, f"{code.name if code else 'error'}: {detail}")
                return
            # kubelet looked at the request and said no (bad version or resource name): asking again
            # gets the same answer, so wait for a new kubelet (a new kubelet.sock) or a reload.
            served.registered_with = inode
            served.refused = detail or (code.name if code else "refused")
            log.error(
                "%s: kubelet refused the registration: %s (fix: check resource-name; kubelet accepts "
                "<domain>/<name> outside kubernetes.io and API version %s)",
                name,
                served.refused,
                API_VERSION,
            )
            self._observer.register_failed(name, served.refused, refused=True)
            return
        served.registered_with = inode
        served.refused = None
        served.retry_delay = RETRY_FIRST
        log.info("%s: registered with kubelet (%s)", name, kubelet)
        self._observer.registered(name, inode)

    def _retry_register(self, name: str, served: _Served, why: str) -> None:
        delay = served.retry_delay
        served.retry_delay = min(delay * 2, RETRY_MAX)
        log.warning("%s: registering with kubelet failed (%s); retrying in %.1fs", name, why, delay)

        def fire() -> None:
            served.retry_timer = None
            self._events.put(("retry", name))

        served.retry_timer = threading.Timer(delay, fire)
        served.retry_timer.daemon = True
        served.retry_timer.start()

    def _update_status(self, waiting_for: str | None) -> None:
        unmonitored = self.registry.unmonitored()
        resources = []
        for resource in self.registry.resources():
            _, states = self.registry.snapshot(resource.name)
            served = self._served.get(resource.name)
            resources.append(
                ResourceStatus(
                    name=resource.name,
                    socket=resource.socket_name,
                    devices=len(states),
                    healthy=sum(1 for s in states if s.healthy),
                    registered=served is not None
                    and served.registered_with is not None
                    and not served.refused,
                    refused=served.refused if served else None,
                    unmonitored=sum(1 for s in states if s.device.gpu_uuid in unmonitored),
                    sharing=resource.sharing,
                    down=self.registry.down_reason(resource.name),
                )
            )
        if waiting_for and waiting_for != self.status.waiting_for:
            log.info("waiting for %s", waiting_for)
        self.status = PluginStatus(
            resources,
            waiting_for,
            self.status.nvml_error,
            [UnmonitoredGpu(i, u, why) for u, (i, why) in sorted(unmonitored.items(), key=lambda e: e[1][0])],
        )
        self._observer.on_status(self.status, self.registry)
        if self.on_status is not None:
            self.on_status(self.status)
