"""NodePrepareResources / NodeUnprepareResources, without gRPC: `Preparer.prepare(claims)` and
`unprepare(claims)` answer per claim UID exactly what the DRA response carries (devices with their request
names, pool, device and CDI IDs, share ID; or an error), and the server only translates.

Prepare, per claim (shared/specs/dra-kubelet-plugin.md section 2, dra-nvidia-compat.md sections 4, 5, 7):
GET the claim with the node's credentials; its UID must be the one kubelet gave (a claim deleted and made
again under the same name is another claim); take this driver's allocation results; each device must be
in this node's pool, exist and be healthy, and not be held by another prepared claim unless the request has
adminAccess; the opaque config is decoded strictly (gpunode/dra/opaque.py) and applied: time-slicing is
recorded (the interval is the claim's, kept in the checkpoint), MPS is refused (below); then the checkpoint
says PrepareStarted with the devices and the spec's checksum, the claim's CDI spec is written, and the
checkpoint says PrepareCompleted — all before the answer. A completed claim asked again gets the same answer
from the checkpoint (the spec is rewritten if it went, as /var/run does at a reboot).

MPS: gpunode's MPS supervision (gpunode/plugin/mps.py MpsSupervisor) runs one control daemon per
device-plugin resource for the plugin's lifetime, set as a whole; it cannot yet start or stop a daemon per
claim, so a claim asking for MPS fails with an error saying so (NVIDIA's driver needs its MPSSupport gate).

Unprepare: the claim's spec is removed (only while it holds what gpunode wrote), then its checkpoint entry.
A claim never prepared, or unprepared already, succeeds.

Calls are serialised: one lock in the process, and a file lock beside the checkpoint against a second
driver process. A kill at any instant leaves a checkpoint that is the old or the new one; the entry is
always written before the spec and removed after it, so no spec is ever unknown to the checkpoint, and a
started entry holds its devices until kubelet asks again (so no device is ever given to two claims).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import posixpath
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpunode.cdi.hostfacts import HostFacts
from gpunode.dra import claimcdi, opaque
from gpunode.dra.checkpoint import COMPLETED, STARTED, Checkpoint, Device, Entry, default_path
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.nvml.model import Gpu, Inventory, MigDevice

log = logging.getLogger("gpunode.dra")

LOCK_NAME = "gpunode-prepare.lock"


class ClaimReader(Protocol):
    """What Prepare needs of the API client (gpunode/kube/client.py KubeClient has it)."""

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class NodeDevice:
    """A device this node publishes, as Prepare checks it: its slice name, type, UUID and health."""

    name: str
    type: str  # "gpu" or "mig"
    uuid: str
    healthy: bool = True
    reason: str | None = None  # why it is not healthy


def gpu_device_name(gpu: Gpu) -> str | None:
    """NVIDIA's name of a full GPU: gpu-<minor> (the N of /dev/nvidiaN)."""
    return None if gpu.minor is None else f"gpu-{gpu.minor}"


def inventory_devices(
    inventory: Inventory,
    *,
    unhealthy: Mapping[str, str] | None = None,
    mig_name: Callable[[Gpu, MigDevice], str | None] | None = None,
) -> dict[str, NodeDevice]:
    """The devices a node with `inventory` publishes in static mode, by name: full GPUs where MIG is off,
    the existing MIG devices where it is on (named by `mig_name`, the slices' naming; none without it).
    `unhealthy` maps a GPU or MIG UUID to why it is unhealthy; a GPU that cannot be used is unhealthy."""
    unhealthy = unhealthy or {}
    found: dict[str, NodeDevice] = {}
    for gpu in inventory.gpus:
        name = gpu_device_name(gpu)
        if name is None or gpu.uuid is None:
            continue
        gpu_reason = unhealthy.get(gpu.uuid) or (None if gpu.usable else gpu.error or "lost from the bus")
        if gpu.mig_mode is not None and gpu.mig_mode.current:
            for mig in gpu.mig_devices:
                mig_device = mig_name(gpu, mig) if mig_name else None
                if mig_device is not None:
                    reason = gpu_reason or unhealthy.get(mig.uuid)
                    found[mig_device] = NodeDevice(mig_device, "mig", mig.uuid, reason is None, reason)
            continue
        found[name] = NodeDevice(name, "gpu", gpu.uuid, gpu_reason is None, gpu_reason)
    return found


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[Device, ...] = ()
    error: str | None = None

    def response(self) -> dict[str, Any]:
        """NodePrepareResourceResponse's fields (v1; v1beta1 drops share_id)."""
        if self.error is not None:
            return {"error": self.error}
        return {
            "devices": [
                {
                    "request_names": list(d.request_names),
                    "pool_name": d.pool,
                    "device_name": d.device,
                    "cdi_device_ids": list(d.cdi_ids),
                }
                | ({"share_id": d.share_id} if d.share_id is not None else {})
                for d in self.devices
            ]
        }


@dataclass(frozen=True)
class UnprepareResult:
    error: str | None = None

    def response(self) -> dict[str, Any]:
        return {"error": self.error} if self.error is not None else {}


class ClaimRefused(GpunodeError):
    """This claim cannot be prepared here: its answer's error, the other claims of the call go on."""


def _one_line(exc: GpunodeError) -> str:
    return exc.message if not exc.fix else f"{exc.message}; fix: {exc.fix}"


@dataclass(frozen=True)
class _Plan:
    devices: tuple[Device, ...]
    spec_devices: tuple[claimcdi.ClaimDevice, ...]
    config: tuple[dict[str, Any], ...]


class Preparer:
    """Prepares and unprepares this driver's claims on one node; thread-safe, one call at a time."""

    def __init__(  # noqa: PLR0917 (what Prepare reads, each from its own part of the driver)
        self,
        host: Host,
        driver: str,
        node: str,
        devices: Callable[[], Mapping[str, NodeDevice]],
        inventory: Callable[[], Inventory],
        facts: Callable[[], HostFacts],
        kube: Callable[[], ClaimReader],
        checkpoint: Checkpoint | None = None,
        cdi_dir: str = claimcdi.DIRECTORY,
    ) -> None:
        self.host = host
        self.driver = driver
        self.node = node
        self._devices = devices
        self._inventory = inventory
        self._facts = facts
        self._kube = kube
        self.checkpoint = checkpoint or Checkpoint(host, default_path(driver))
        self.cdi_dir = cdi_dir
        self._lock = threading.Lock()
        self._claims: dict[str, Entry] | None = None  # read at the first call
        self.notes: list[str] = []  # what loading the checkpoint had to say (set aside, rebuilt)

    # -- the two calls --------------------------------------------------------------------------------

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        with self._serialised():
            answers: dict[str, PrepareResult] = {}
            for ref in claims:
                try:
                    answers[ref.uid] = PrepareResult(self._prepare_one(ref))
                except GpunodeError as exc:
                    log.warning(
                        "prepare of claim %s/%s (%s) failed: %s", ref.namespace, ref.name, ref.uid, exc
                    )
                    answers[ref.uid] = PrepareResult(error=_one_line(exc))
            return answers

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, UnprepareResult]:
        with self._serialised():
            answers: dict[str, UnprepareResult] = {}
            for ref in claims:
                try:
                    self._unprepare_one(ref)
                    answers[ref.uid] = UnprepareResult()
                except GpunodeError as exc:
                    log.warning("unprepare of claim %s (%s) failed: %s", ref.name, ref.uid, exc)
                    answers[ref.uid] = UnprepareResult(error=_one_line(exc))
            return answers

    def prepared(self) -> dict[str, Entry]:
        """The checkpoint's claims as this driver holds them now."""
        with self._serialised():
            return dict(self._state())

    # -- inside the lock ------------------------------------------------------------------------------

    def _serialised(self) -> contextlib.ExitStack[bool | None]:
        stack = contextlib.ExitStack()
        stack.enter_context(self._lock)
        lock_path = posixpath.join(posixpath.dirname(self.checkpoint.path), LOCK_NAME)
        try:
            stack.enter_context(self.host.lock(lock_path))
        except BaseException:
            stack.close()
            raise
        return stack

    def _state(self) -> dict[str, Entry]:
        if self._claims is None:
            loaded = self.checkpoint.load()
            claims = dict(loaded.claims)
            self.notes.extend(loaded.notes)
            if loaded.rebuild:
                self._rebuild(claims)
                self.checkpoint.save(claims)
            self._claims = claims
        return self._claims

    def _save(self, claims: dict[str, Entry]) -> None:
        try:
            self.checkpoint.save(claims)
        except BaseException:
            self._claims = None  # what is on disk is not known: read it again at the next call
            raise

    def _prepare_one(self, ref: ClaimRef) -> tuple[Device, ...]:
        claims = self._state()
        entry = claims.get(ref.uid)
        if entry is not None and entry.state == COMPLETED and self._spec_intact(entry):
            return entry.devices
        claim = self._read_claim(ref)
        plan = self._plan(ref, claim, check=True)
        spec = (
            claimcdi.build(
                self._inventory(),
                self._facts(),
                uid=ref.uid,
                namespace=ref.namespace,
                name=ref.name,
                devices=plan.spec_devices,
                directory=self.cdi_dir,
            )
            if plan.spec_devices
            else None
        )
        started = Entry(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            state=STARTED,
            devices=plan.devices,
            cdi_spec=spec.path if spec else None,
            cdi_sha256=spec.sha256 if spec else None,
            config=plan.config,
        )
        claims[ref.uid] = started
        self._save(claims)
        if spec is not None:
            try:
                claimcdi.write(self.host, spec)
            except BaseException:
                self._claims = None
                raise
        claims[ref.uid] = replace(started, state=COMPLETED)
        self._save(claims)
        return plan.devices

    def _unprepare_one(self, ref: ClaimRef) -> None:
        claims = self._state()
        entry = claims.get(ref.uid)
        if entry is None:
            return  # never prepared here, or unprepared already: kubelet's retries and restarts ask again
        if entry.cdi_spec is not None:
            claimcdi.remove(self.host, entry.cdi_spec, entry.cdi_sha256)
        del claims[ref.uid]
        self._save(claims)

    def _spec_intact(self, entry: Entry) -> bool:
        if entry.cdi_spec is None:
            return True
        data = self.host.read_bytes(entry.cdi_spec)
        return data is not None and hashlib.sha256(data).hexdigest() == entry.cdi_sha256

    def _read_claim(self, ref: ClaimRef) -> dict[str, Any]:
        claim = self._kube().get_resource_claim(ref.namespace, ref.name)
        uid = (claim.get("metadata") or {}).get("uid")
        if uid != ref.uid:
            raise ClaimRefused(
                f"ResourceClaim {ref.namespace}/{ref.name} has the UID {uid}, not {ref.uid} as kubelet "
                "asked: the claim was deleted and created again",
                "nothing to do here: kubelet prepares the new claim for the pods that use it",
            )
        return claim

    def _plan(self, ref: ClaimRef, claim: Mapping[str, Any], *, check: bool) -> _Plan:
        """What preparing the claim means: its devices, their CDI edits and the config; with `check`,
        refused for any device that is missing, unhealthy or held by another claim."""
        allocation = (claim.get("status") or {}).get("allocation")
        if not isinstance(allocation, dict):
            raise ClaimRefused(
                f"ResourceClaim {ref.namespace}/{ref.name} is not allocated",
                "kubelet prepares only allocated claims: check the scheduler's events for the pod",
            )
        device_status = allocation.get("devices") or {}
        results = [
            r
            for r in device_status.get("results") or []
            if isinstance(r, dict) and r.get("driver") == self.driver
        ]
        view = self._devices()
        held = self._held(ref.uid) if check else {}
        chosen: list[tuple[dict[str, Any], NodeDevice]] = []
        for result in results:
            name, pool = str(result.get("device", "")), str(result.get("pool", ""))
            where = f"device {name} of pool {pool}"
            if pool != self.node:
                raise ClaimRefused(
                    f"{where} is not on this node (its pool is {self.node})",
                    "the claim was allocated for another node: check its status.allocation.nodeSelector",
                )
            device = view.get(name)
            if device is None:
                raise ClaimRefused(
                    f"{where} does not exist on this node (anymore)",
                    "the GPU or MIG device went away since the scheduler chose it: delete the pod so its "
                    "claim is allocated again",
                )
            if check and not device.healthy:
                raise ClaimRefused(
                    f"{where} is unhealthy: {device.reason or 'no reason given'}",
                    "delete the pod so its claim is allocated another device, or wait until it is healthy",
                )
            admin = bool(result.get("adminAccess"))
            holder = held.get(name)
            if check and holder is not None and not admin:
                raise ClaimRefused(
                    f"{where} is prepared for claim {holder}; a device goes to one claim at a time unless "
                    "the request has adminAccess",
                    "wait until that claim is unprepared (its pods are gone), or delete this pod",
                )
            chosen.append((result, device))
        applied = opaque.configs_for(
            device_status.get("config") or [],
            self.driver,
            [(str(r.get("request", "")), d.type) for r, d in chosen],
        )
        groups: dict[int, dict[str, Any]] = {}
        for (result, device), config in zip(chosen, applied, strict=True):
            if config.config is None or config.entry is None:
                continue
            if config.config.sharing.strategy == opaque.MPS:
                raise ClaimRefused(
                    f"request {result.get('request')!r} asks for MPS sharing of {device.name}, which "
                    "gpunode's DRA driver cannot give yet: its MPS supervision runs one daemon per "
                    "device-plugin resource and cannot start one per claim",
                    "use the TimeSlicing strategy, or serve MPS through `gpunode plugin` (MPS sharing there)",
                )
            group = groups.setdefault(
                config.entry,
                {
                    "entry": config.entry,
                    "kind": config.config.kind,
                    "devices": [],
                    **config.config.sharing.as_record(),
                },
            )
            group["devices"].append(device.name)
        devices = tuple(
            Device(
                request_names=(opaque.main_request_name(str(result.get("request", ""))),),
                pool=self.node,
                device=device.name,
                cdi_ids=(claimcdi.device_id(ref.uid, device.name),),
                share_id=result.get("shareID") if isinstance(result.get("shareID"), str) else None,
                admin=bool(result.get("adminAccess")),
            )
            for result, device in chosen
        )
        spec_devices = tuple(dict.fromkeys(claimcdi.ClaimDevice(d.name, d.uuid) for _, d in chosen))
        return _Plan(devices, spec_devices, tuple(groups[k] for k in sorted(groups)))

    def _held(self, uid: str) -> dict[str, str]:
        """Device name -> the claim that holds it (started or completed, without admin access)."""
        held: dict[str, str] = {}
        for other in self._state().values():
            if other.uid == uid:
                continue
            for device in other.devices:
                if not device.admin:
                    held[device.device] = f"{other.namespace}/{other.name} ({other.uid})"
        return held

    def _rebuild(self, claims: dict[str, Entry]) -> None:
        """After a checkpoint was set aside: the claim specs gpunode wrote say which claims were prepared
        (their headers name the claim); each is read from the API and recorded as completed when it is
        still this allocation, removed when the claim is another one now, and recorded as started (holding
        its devices until kubelet asks again) when the API cannot say."""
        for path, text in claimcdi.written_claims(self.host, self.cdi_dir):
            found = claimcdi.claim_of(text)
            if found is None:
                continue
            namespace, name, uid = found
            ref = ClaimRef(namespace, uid, name)
            sha = hashlib.sha256(text.encode()).hexdigest()
            try:
                names = claimcdi.devices_in(text, uid)
            except GpunodeError:
                names = []
            held = tuple(Device((), self.node, n, (claimcdi.device_id(uid, n),)) for n in names)
            fallback = Entry(uid, namespace, name, STARTED, held, path, sha)
            try:
                claim = self._kube().get_resource_claim(namespace, name)
            except GpunodeError as exc:
                log.warning("rebuilding claim %s/%s (%s) from the API failed: %s", namespace, name, uid, exc)
                claims[uid] = fallback
                continue
            if (claim.get("metadata") or {}).get("uid") != uid:
                claimcdi.remove(self.host, path, sha)
                log.info("claim %s/%s (%s) is gone: its CDI spec %s was removed", namespace, name, uid, path)
                continue
            try:
                plan = self._plan(ref, claim, check=False)
            except GpunodeError as exc:
                log.warning("claim %s/%s (%s) cannot be rebuilt: %s", namespace, name, uid, exc)
                claims[uid] = fallback
                continue
            claims[uid] = Entry(uid, namespace, name, COMPLETED, plan.devices, path, sha, plan.config)
            log.info("claim %s/%s (%s) rebuilt from the API", namespace, name, uid)
