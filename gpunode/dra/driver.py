"""`gpunode dra run`: the DRA kubelet plugin, composed of the parts gpunode/dra and gpunode/plugin hold
(shared/specs/dra-kubelet-plugin.md; docs/commands/dra.md "dra run").

Order at start: the inventory is read (NVML, or a simulated node); a live driver of the same name already
registered on the node (its `<driver>-reg.sock` answers GetInfo with that name) refuses the start; the DRA
service (v1, v1beta1: one Preparer) and the v1alpha1 health stream are served on
`<plugins>/<driver>/dra.sock`, proven to accept connections, and only then `<registry>/<driver>-reg.sock`
is created, so kubelet never dials an endpoint that is not there; sd_notify READY follows.

Slices: one publisher thread reconciles the node's pool with what `build_slices` makes of the inventory and
the health state — lists the driver's slices of the node (the field selector a node's credentials need),
deletes obsolete ones, updates changed ones, creates missing ones — whenever health or the inventory
changes and every `poll` seconds (the test API server, like a node's proxy, gives no watch; kubelet wipes
the node's slices when it starts and a driver's slices 30 s after losing it, and a list every 0.5 s brings
them back well within 1 s). The generation goes up only when the content changes, so a wiped pool is
recreated as it was. API errors are logged and retried with a doubling backoff: never a crash.

Health: the plugin's HealthMonitor marks units in a DeviceRegistry; every change wakes the health streams
(full list each time, and at least every `health_resend` seconds so kubelet's 30 s timeout never turns a
device Unknown) and the publisher (taints). A GPU that cannot be monitored is not unhealthy: it gets the
`unmonitored` taint of effect None and stays HEALTHY on the stream.

Stop (SIGTERM/SIGINT): the registration socket goes first (kubelet deregisters), then the DRA socket. The
slices are left: a driver restarted within kubelet's 30 s keeps its pool without churn, and kubelet wipes
them once the driver has been gone 30 s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from gpunode.cdi.hostfacts import HostFacts, Roots, read_host_facts, simulated_host_facts
from gpunode.dra import claimcdi
from gpunode.dra.api import dra_health_v1alpha1_pb2 as health_pb
from gpunode.dra.api import dra_health_v1alpha1_pb2_grpc as health_grpc
from gpunode.dra.api import dra_v1_pb2 as v1_pb
from gpunode.dra.api import dra_v1_pb2_grpc as v1_grpc
from gpunode.dra.api import dra_v1beta1_pb2 as v1beta1_pb
from gpunode.dra.api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from gpunode.dra.api import pluginregistration_pb2 as reg_pb
from gpunode.dra.api import pluginregistration_pb2_grpc as reg_grpc
from gpunode.dra.checkpoint import Checkpoint
from gpunode.dra.prepare import ClaimRef, NodeDevice, Preparer, inventory_devices
from gpunode.dra.slices import SliceSettings, TaintEffect, Trouble, build_slices, device_name
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.nvml.model import Inventory
from gpunode.plugin.devices import DeviceRegistry, Unit
from gpunode.plugin.health import LOST_REASON, HealthMonitor, HealthSettings
from gpunode.plugin.migwatch import MigWatcher, mig_capable

log = logging.getLogger("gpunode.dra")

DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_KUBECONFIG = "/etc/kubernetes/kubelet.conf"  # kubelet's own: the node's credentials
DEFAULT_STATUS_FILE = "/run/gpunode/dra.json"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # v1 first: kubelet takes the first it knows
PLUGIN_TYPE = "DRAPlugin"
HEALTH_TIMEOUT_S = 60  # what each health entry tells kubelet; resent every health_resend seconds anyway
_XID = re.compile(r"^Xid (\d+)")

# _untyped: the generated service modules have no types; going through Any keeps mypy --strict quiet.
_reg: Any = reg_grpc
_v1: Any = v1_grpc
_v1beta1: Any = v1beta1_grpc
_health: Any = health_grpc


@dataclass(frozen=True)
class DriverSettings:
    driver: str
    node_name: str
    plugins_dir: str = DEFAULT_PLUGINS_DIR
    registry_dir: str = DEFAULT_REGISTRY_DIR
    kubeconfig: str | None = None
    driver_root: str = "/"
    dev_root: str | None = None
    cdi_dir: str = claimcdi.DIRECTORY
    simulate: str | None = None
    lost_effect: TaintEffect = "NoSchedule"
    status_file: str | None = DEFAULT_STATUS_FILE
    recovery_quiet_period: float = 60.0  # seconds a GPU must be fine again before it is healthy
    poll: float = 0.5  # how often the publisher lists the slices (kubelet deletes them without a word)
    health_resend: float = 10.0  # kubelet marks a device Unknown after 30 s without news of it

    @property
    def dra_socket(self) -> str:
        return f"{self.plugins_dir.rstrip('/')}/{self.driver}/dra.sock"

    @property
    def registration_socket(self) -> str:
        return f"{self.registry_dir.rstrip('/')}/{self.driver}-reg.sock"

    @property
    def checkpoint(self) -> str:
        return f"{self.plugins_dir.rstrip('/')}/{self.driver}/gpunode-checkpoint.json"


def trouble_of(reason: str, since: float) -> Trouble:
    """The health monitor's reason for a unit as the slices' taint kinds see it."""
    match = _XID.match(reason)
    if match:
        return Trouble("xid", since, int(match.group(1)))
    if reason == LOST_REASON:
        return Trouble("lost", since)
    # Anything else the monitor marks (a double-bit ECC error, a probe that failed) makes the device
    # unusable as a lost GPU is: NoSchedule, never a guess at an Xid.
    return Trouble("lost", since)


class HealthState:
    """The registry's marks by UUID, with when each began (wall clock: a taint's timeAdded)."""

    def __init__(self, registry: DeviceRegistry, clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self._clock = clock
        self._since: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def read(self, inventory: Inventory) -> tuple[dict[str, list[Trouble]], dict[str, str]]:
        """(UUID → troubles for the slices, UUID → why unhealthy for Prepare and the health stream)."""
        uuids = _unit_uuids(inventory)
        unhealthy: dict[str, str] = {}
        for unit, reason in self.registry.unhealthy_units().items():
            uuid = uuids.get(unit)
            if uuid is not None:
                unhealthy[uuid] = reason
        unmonitored = {uuid: why for uuid, (_index, why) in self.registry.unmonitored().items()}
        now = self._clock()
        troubles: dict[str, list[Trouble]] = {}
        with self._lock:
            seen = {(uuid, reason) for uuid, reason in unhealthy.items()}
            seen |= {(uuid, "unmonitored") for uuid in unmonitored}
            # A state that ended is forgotten, so the next one has its own timeAdded.
            self._since = {key: since for key, since in self._since.items() if key in seen}
            for key in seen:
                self._since.setdefault(key, now)
            for uuid, reason in unhealthy.items():
                troubles.setdefault(uuid, []).append(trouble_of(reason, self._since[(uuid, reason)]))
            for uuid in unmonitored:
                troubles.setdefault(uuid, []).append(
                    Trouble("unmonitored", self._since[(uuid, "unmonitored")])
                )
        return troubles, unhealthy


def _unit_uuids(inventory: Inventory) -> dict[Unit, str]:
    found: dict[Unit, str] = {}
    for gpu in inventory.gpus:
        if gpu.uuid:
            found[Unit(gpu.index)] = gpu.uuid
        for mig in gpu.mig_devices:
            if mig.gpu_instance_id is not None and mig.compute_instance_id is not None:
                found[Unit(gpu.index, (mig.gpu_instance_id, mig.compute_instance_id))] = mig.uuid
    return found


def _content(slices: Sequence[Mapping[str, Any]]) -> list[Any]:
    """What a pool holds, without its generation: a change here is a new generation."""
    out = []
    for item in slices:
        spec = dict(item["spec"])
        spec["pool"] = {k: v for k, v in spec["pool"].items() if k != "generation"}
        out.append((item["metadata"]["name"], spec))
    return out


def _same(existing: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """The slice in the API carries what gpunode wants (fields the server adds are not gpunode's)."""
    spec = existing.get("spec") or {}
    if any(spec.get(key) != value for key, value in wanted["spec"].items()):
        return False
    owners = wanted["metadata"].get("ownerReferences")
    return owners is None or (existing.get("metadata") or {}).get("ownerReferences") == owners


class Publisher:
    """Keeps the node's pool in the API equal to what build_slices says; see the module docstring."""

    def __init__(
        self,
        client: Any,
        settings: SliceSettings,
        state: Callable[[], tuple[Inventory, Mapping[str, Sequence[Trouble]]]],
        poll: float,
        on_published: Callable[[int, str | None], None] = lambda generation, error: None,
    ) -> None:
        self._client = client
        self._settings = settings
        self._state = state
        self._poll = poll
        self._on_published = on_published
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._generation: int | None = None
        self._content: list[Any] | None = None
        self._thread: threading.Thread | None = None
        self.writes = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpunode-dra-slices", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30.0)

    def _run(self) -> None:
        backoff = self._poll
        while not self._stop.is_set():
            try:
                self.reconcile()
            except GpunodeError as exc:
                log.warning("publishing the ResourceSlices failed (again in %.1f s): %s", backoff, exc)
                self._on_published(self._generation or 0, str(exc))
                self._wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            except Exception:  # a bug must not stop the slices for good: logged, then tried again
                log.exception("publishing the ResourceSlices failed unexpectedly (again in %.1f s)", backoff)
                self._wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = self._poll
            self._wait(self._poll)

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def reconcile(self) -> int:
        """One pass: the API's slices made equal to the wanted ones; the number of writes."""
        inventory, troubles = self._state()
        existing = self._client.list_resource_slices(self._settings.node_name, self._settings.driver)
        content = _content(build_slices(inventory, troubles, self._settings, 0))
        if self._generation is None:
            generations = [
                int(((s.get("spec") or {}).get("pool") or {}).get("generation") or 0) for s in existing
            ]
            start = max(generations, default=0)
            # Slices of an earlier run that hold exactly this content keep their generation.
            self._generation = start if _content(existing) == content else start + 1
        elif content != self._content:
            self._generation += 1
        self._content = content
        wanted = build_slices(inventory, troubles, self._settings, self._generation)
        by_name = {str(s["metadata"]["name"]): s for s in existing}
        names = {str(s["metadata"]["name"]) for s in wanted}
        writes = 0
        for name, item in by_name.items():
            if name not in names:
                self._client.delete_resource_slice(name, uid=(item.get("metadata") or {}).get("uid"))
                writes += 1
        for item in wanted:
            name = str(item["metadata"]["name"])
            there = by_name.get(name)
            if there is None:
                self._client.create_resource_slice(item)
                writes += 1
            elif not _same(there, item):
                update = dict(item)
                update["metadata"] = {
                    **item["metadata"],
                    "resourceVersion": there["metadata"]["resourceVersion"],
                }
                self._client.update_resource_slice(update)
                writes += 1
        if writes:
            log.info(
                "ResourceSlices of pool %s published: generation %d, %d written",
                self._settings.node_name,
                self._generation,
                writes,
            )
        self.writes += writes
        self._on_published(self._generation, None)
        return writes


class _Registration:
    def __init__(self, settings: DriverSettings, endpoint: str) -> None:
        self._settings = settings
        self._endpoint = endpoint
        self.registered = threading.Event()

    def GetInfo(self, request: Any, context: Any) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self._settings.driver,
            endpoint=self._endpoint,
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> reg_pb.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("registered with kubelet as DRA driver %s", self._settings.driver)
            self.registered.set()
        else:
            log.warning("kubelet refused the registration: %s", request.error)
        return reg_pb.RegistrationStatusResponse()


class _DraService:
    """NodePrepareResources / NodeUnprepareResources of one version; both versions share one Preparer."""

    def __init__(self, preparer: Callable[[], Preparer], pb: Any, share_ids: bool) -> None:
        self._preparer = preparer
        self._pb = pb
        self._share_ids = share_ids

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        refs = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
        response = self._pb.NodePrepareResourcesResponse()
        for uid, result in self._preparer().prepare(refs).items():
            answer = result.response()
            entry = response.claims[uid]
            if "error" in answer:
                entry.error = answer["error"]
                continue
            for device in answer["devices"]:
                # v1beta1's Device has no share_id field.
                entry.devices.add(**{k: v for k, v in device.items() if self._share_ids or k != "share_id"})
        return response

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        refs = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
        response = self._pb.NodeUnprepareResourcesResponse()
        for uid, result in self._preparer().unprepare(refs).items():
            response.claims[uid].error = result.response().get("error", "")
        return response


class _HealthService:
    def __init__(self, driver: DraDriver) -> None:
        self._driver = driver

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        driver = self._driver
        seen = -1
        while context.is_active() and not driver.stopping.is_set():
            version = driver.wait_health_change(seen, driver.settings.health_resend)
            seen = version
            if driver.stopping.is_set():
                return
            yield health_pb.NodeWatchResourcesResponse(devices=driver.health_list())


class DraDriver:
    """One running driver. `run()` serves until `request_stop()`; `request_reload()` re-reads the node."""

    def __init__(
        self,
        host: Host,
        settings: DriverSettings,
        *,
        inventory: Callable[[], Inventory],
        kube: Callable[[], Any],
        health_settings: HealthSettings,
        on_ready: Callable[[], object] = lambda: None,
        on_status: Callable[[dict[str, Any]], object] = lambda status: None,
    ) -> None:
        self.host = host
        self.settings = settings
        self._read_inventory = inventory
        self._kube_factory = kube
        self._health_settings = health_settings
        self._on_ready = on_ready
        self._on_status = on_status
        self.stopping = threading.Event()
        self._reload = threading.Event()
        self._cond = threading.Condition()
        self._health_version = 0
        self._inventory: Inventory | None = None
        self._facts: HostFacts | None = None
        self._kube: Any = None
        self._servers: list[tuple[Any, str, int]] = []
        self._registry = DeviceRegistry(on_health_change=self._health_changed)
        self._health = HealthState(self._registry)
        self._monitor: HealthMonitor | None = None
        self._mig_watch: MigWatcher | None = None
        self._mig_change = threading.Event()
        self._publisher: Publisher | None = None
        self._preparer: Preparer | None = None
        self._published: tuple[int, str | None] = (0, None)

    # -- control (any thread) ------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.stopping.set()
        with self._cond:
            self._cond.notify_all()

    def request_reload(self) -> None:
        self._reload.set()
        with self._cond:
            self._cond.notify_all()

    def _mig_changed(self) -> None:
        """The MIG watcher's thread saw the geometry change: the main loop reads the GPUs again."""
        self._mig_change.set()
        with self._cond:
            self._cond.notify_all()

    # -- what the services read ---------------------------------------------------------------------

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            raise RuntimeError("the driver has not read the node's GPUs yet")
        return self._inventory

    def node_devices(self) -> dict[str, NodeDevice]:
        _troubles, unhealthy = self._health.read(self.inventory)
        return inventory_devices(self.inventory, unhealthy=unhealthy, mig_name=device_name)

    def troubles(self) -> tuple[Inventory, Mapping[str, Sequence[Trouble]]]:
        inventory = self.inventory
        troubles, _unhealthy = self._health.read(inventory)
        return inventory, troubles

    def health_list(self) -> list[Any]:
        now = int(time.time())
        return [
            health_pb.DeviceHealth(
                device=health_pb.DeviceIdentifier(pool_name=self.settings.node_name, device_name=name),
                health=health_pb.HEALTHY if device.healthy else health_pb.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                message=(device.reason or "")[:200],
            )
            for name, device in sorted(self.node_devices().items())
        ]

    def wait_health_change(self, seen: int, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(
                lambda: self._health_version != seen or self.stopping.is_set(), timeout=timeout
            )
            return self._health_version

    def facts(self) -> HostFacts:
        if self._facts is None:
            roots = Roots(self.settings.driver_root, self.settings.dev_root or self.settings.driver_root)
            if self.settings.simulate:
                self._facts = simulated_host_facts(self.inventory, roots)
            else:
                self._facts = read_host_facts(self.host, self.inventory, roots)
        return self._facts

    def kube(self) -> Any:
        if self._kube is None:
            self._kube = self._kube_factory()
        return self._kube

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> None:
        s = self.settings
        self._inventory = self._read_inventory()
        self._refuse_second_driver()
        self.kube()  # credentials that cannot be found stop the start, before kubelet is told anything
        self._preparer = Preparer(
            self.host,
            s.driver,
            s.node_name,
            devices=self.node_devices,
            inventory=lambda: self.inventory,
            facts=self.facts,
            kube=self.kube,
            checkpoint=Checkpoint(self.host, s.checkpoint),
            cdi_dir=s.cdi_dir,
        )
        try:
            self._serve()
            self._start_health()
            self._status("serving")
            self._on_ready()
            node_uid = self._node_uid()
            slice_settings = SliceSettings(
                node_name=s.node_name,
                driver=s.driver,
                lost_effect=s.lost_effect,
                health=self._health_settings,
                node_uid=node_uid,
            )
            self._publisher = Publisher(
                self.kube(), slice_settings, self.troubles, s.poll, self._published_at
            )
            self._publisher.start()
            while not self.stopping.is_set():
                with self._cond:
                    self._cond.wait_for(
                        lambda: self.stopping.is_set() or self._reload.is_set() or self._mig_change.is_set()
                    )
                if self.stopping.is_set():
                    break
                if self._reload.is_set():
                    self._reload.clear()
                    self._mig_change.clear()
                    self._do_reload("SIGHUP")
                elif self._mig_change.is_set():
                    self._mig_change.clear()
                    self._do_reload("the MIG geometry changed")
        finally:
            self._shutdown()

    def _refuse_second_driver(self) -> None:
        """A live registration socket of this driver name that is not ours: another driver serves it."""
        path = self.settings.registration_socket
        if not self.host.exists(path):
            return
        if not self.host.is_socket(path):
            raise GpunodeError(
                f"{path} exists and is not a socket; gpunode does not delete it",
                "look at what put it there and remove it by hand if it is not needed",
            )
        info = _get_info(str(self.host.path(path)))
        if info is not None and info.name == self.settings.driver:
            raise GpunodeError(
                f"another DRA driver named {self.settings.driver} is already registered on this node "
                f"({path} answers; endpoint {info.endpoint or path}): two drivers of one name would publish "
                "and prepare the same GPUs",
                "stop the other driver (NVIDIA's DRA driver DaemonSet, or another `gpunode dra run`), or "
                "give this one another --driver name",
            )

    def _serve(self) -> None:
        s = self.settings
        dra_path = str(self.host.path(s.dra_socket))
        reg_path = str(self.host.path(s.registration_socket))
        os.makedirs(os.path.dirname(dra_path), exist_ok=True)
        os.makedirs(os.path.dirname(reg_path), exist_ok=True)
        dra = _server("gpunode-dra")
        _v1.add_DRAPluginServicer_to_server(_DraService(self._the_preparer, v1_pb, True), dra)
        _v1beta1.add_DRAPluginServicer_to_server(_DraService(self._the_preparer, v1beta1_pb, False), dra)
        _health.add_DRAResourceHealthServicer_to_server(_HealthService(self), dra)
        self._servers.append((dra, dra_path, _listen(dra, dra_path)))
        # Only now the registration socket: kubelet dials the endpoint as soon as GetInfo answered.
        reg = _server("gpunode-dra-reg")
        _reg.add_RegistrationServicer_to_server(_Registration(s, s.dra_socket), reg)
        self._servers.append((reg, reg_path, _listen(reg, reg_path)))
        log.info(
            "serving DRA driver %s on %s, registration %s", s.driver, s.dra_socket, s.registration_socket
        )

    def _the_preparer(self) -> Preparer:
        if self._preparer is None:
            raise RuntimeError("the DRA service runs before the Preparer is made")
        return self._preparer

    def _start_health(self) -> None:
        if self.settings.simulate:
            log.info("simulated node: no GPU health is watched")
            return
        self._monitor = HealthMonitor(self._registry, self.inventory.gpus, self._health_settings)
        self._monitor.start()
        if any(mig_capable(g) for g in self.inventory.gpus):
            # MIG devices created or destroyed (nvidia-smi mig, a MIG manager) change the slices' devices.
            self._mig_watch = MigWatcher(self.inventory.gpus, self._mig_changed)
            self._mig_watch.start()

    def _node_uid(self) -> str | None:
        """The Node's UID owns the slices (they go with the Node); without it they are only unowned."""
        try:
            uid = (self.kube().get_node(self.settings.node_name).get("metadata") or {}).get("uid")
        except GpunodeError as exc:
            log.warning(
                "cannot read Node %s (slices published without an owner): %s", self.settings.node_name, exc
            )
            return None
        return str(uid) if uid else None

    def _do_reload(self, why: str) -> None:
        log.info("%s: reading the node's GPUs again", why)
        try:
            inventory = self._read_inventory()
        except GpunodeError as exc:
            log.error("reload failed, keeping what is served: %s", exc)
            return
        self._inventory = inventory
        self._facts = None
        if self._monitor is not None and not self._monitor.update(inventory.gpus, self._health_settings):
            self._monitor.stop()
            self._monitor = HealthMonitor(self._registry, inventory.gpus, self._health_settings)
            self._monitor.start()
        if self._mig_watch is not None:
            self._mig_watch.update(inventory.gpus)
        self._health_changed()
        log.info(
            "read again: %d GPU(s), %d device(s) to publish", len(inventory.gpus), len(self.node_devices())
        )

    def _health_changed(self) -> None:
        with self._cond:
            self._health_version += 1
            self._cond.notify_all()
        if self._publisher is not None:
            self._publisher.wake()
        self._status("serving")

    def _published_at(self, generation: int, error: str | None) -> None:
        if self._published != (generation, error):
            self._published = (generation, error)
            self._status("serving")

    def _status(self, state: str) -> None:
        if self._inventory is None:
            return
        devices = self.node_devices()
        generation, error = self._published
        self._on_status(
            {
                "pid": os.getpid(),
                "state": state,
                "driver": self.settings.driver,
                "node": self.settings.node_name,
                "dra_socket": self.settings.dra_socket,
                "registration_socket": self.settings.registration_socket,
                "simulated": bool(self.settings.simulate),
                "devices": {
                    name: {"uuid": d.uuid, "healthy": d.healthy, "reason": d.reason}
                    for name, d in sorted(devices.items())
                },
                "slices": {"generation": generation, "error": error},
            }
        )

    def _shutdown(self) -> None:
        self.stopping.set()
        with self._cond:
            self._cond.notify_all()
        # Registration first: kubelet deregisters before the endpoint goes.
        for server, path, inode in reversed(self._servers):
            server.stop(0.5).wait(3.0)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == inode:  # only our own socket
                    os.unlink(path)
        self._servers = []
        if self._publisher is not None:
            self._publisher.stop()
        if self._mig_watch is not None:
            self._mig_watch.stop()
        if self._monitor is not None:
            self._monitor.stop()
        self._registry.close()
        if self._kube is not None:
            self._kube.close()


def _server(prefix: str) -> Any:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=prefix),
        options=[("grpc.so_reuseport", 0)],
    )


def _listen(server: Any, path: str) -> int:
    """Serve on a fresh socket at `path` (a stale one removed) and prove it accepts; its inode."""
    with contextlib.suppress(FileNotFoundError):
        if not _is_socket(path):
            raise GpunodeError(
                f"{path} exists and is not a socket; gpunode does not delete it",
                "look at what put it there and remove it by hand if it is not needed",
            )
        os.unlink(path)  # stale: a live one was refused before (_refuse_second_driver)
    if server.add_insecure_port(f"unix://{path}") == 0:
        raise GpunodeError(f"cannot listen on {path}", f"check that {os.path.dirname(path)} is writable")
    server.start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(10.0)
        probe.connect(path)
    return os.stat(path).st_ino


def _is_socket(path: str) -> bool:
    import stat

    return stat.S_ISSOCK(os.lstat(path).st_mode)


def _get_info(path: str) -> Any:
    """GetInfo of the registration socket at `path` within kubelet's 1 s; None when nothing answers."""
    channel = grpc.insecure_channel(f"unix://{path}")
    try:
        return _reg.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=1.0)
    except grpc.RpcError:
        return None
    finally:
        channel.close()


def status_json(status: Mapping[str, Any]) -> str:
    return json.dumps(dict(status), indent=2, sort_keys=True) + "\n"


class _StatusFile:
    """The status file (`gpunode dra` status for people and scripts): written atomically on each change,
    removed at exit; a failure to write it is logged once and never stops the driver."""

    def __init__(self, host: Host, path: str | None) -> None:
        self.host = host
        self.path = path
        self._last: str | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def __call__(self, status: Mapping[str, Any]) -> None:
        if self.path is None:
            return
        text = status_json(status)
        with self._lock:
            if text == self._last:
                return
            try:
                self.host.make_dirs(os.path.dirname(self.path), mode=0o755)
                self.host.write_file(self.path, text, mode=0o644)
            except (GpunodeError, OSError) as err:
                message = err.message if isinstance(err, GpunodeError) else str(err)
                if message != self._error:
                    log.warning(
                        "cannot write the status file %s (%s); serving on without it", self.path, message
                    )
                    self._error = message
                return
            self._last = text

    def remove(self) -> None:
        if self.path is not None:
            with contextlib.suppress(GpunodeError):
                self.host.remove_file(self.path)


def run_driver(host: Host, settings: DriverSettings, *, debug: bool) -> None:
    """Serve until SIGTERM/SIGINT; SIGHUP re-reads the node. GpunodeError for what stops the start."""
    import signal

    from gpunode.plugin.health import apply_dp_environment
    from gpunode.plugin.runner import setup_logging
    from gpunode.plugin.signals import SignalRelay
    from gpunode.systemd.notify import Notifier

    writer = setup_logging(debug, host.env)
    notifier = Notifier()
    status = _StatusFile(host, settings.status_file)
    try:
        health_settings = apply_dp_environment(
            HealthSettings(recovery_quiet_period=settings.recovery_quiet_period), host.env
        )
        driver = DraDriver(
            host,
            settings,
            inventory=inventory_source(host, settings),
            kube=kube_source(host, settings),
            health_settings=health_settings,
            on_ready=lambda: notifier.ready(f"serving DRA driver {settings.driver}"),
            on_status=status,
        )
        relay = SignalRelay(
            {
                signal.SIGTERM: driver.request_stop,
                signal.SIGINT: driver.request_stop,
                signal.SIGHUP: driver.request_reload,
            }
        ).start()
        log.info(
            "gpunode DRA driver %s starting on node %s (%s)",
            settings.driver,
            settings.node_name,
            f"simulated node {settings.simulate!r}" if settings.simulate else "NVML",
        )
        try:
            driver.run()
        finally:
            notifier.stopping()
            status.remove()
            relay.close(restore=False)
        log.info("stopped")
    finally:
        writer.stop()


def inventory_source(host: Host, settings: DriverSettings) -> Callable[[], Inventory]:
    if settings.simulate:
        from gpunode.plugin.simulate import simulated_inventory

        name = settings.simulate
        return lambda: simulated_inventory(name)

    def real() -> Inventory:
        from gpunode.nvml import discover
        from gpunode.plugin.driver import preload_nvml

        preload_nvml(host, settings.driver_root)
        return discover(host)

    return real


def kube_source(host: Host, settings: DriverSettings) -> Callable[[], Any]:
    """The node's own credentials: --kubeconfig, else KUBECONFIG, else kubelet's kubeconfig."""

    def make() -> Any:
        from gpunode.kube.client import KubeClient

        # KUBECONFIG is read as kubectl reads it (a list of files); kubelet's own file only without either.
        kubeconfig = settings.kubeconfig or (None if host.env.get("KUBECONFIG") else DEFAULT_KUBECONFIG)
        return KubeClient.from_host(host, kubeconfig=kubeconfig)

    return make
