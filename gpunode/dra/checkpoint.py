"""The DRA driver's checkpoint: which claims it prepared, with what, so that a restarted driver answers a
repeated Prepare identically, undoes exactly what it did at Unprepare, and never gives a GPU to two claims.

`/var/lib/kubelet/plugins/<driver>/gpunode-checkpoint.json` (beside NVIDIA's `checkpoint.json`, never that
file: a node moving between the two drivers keeps each one's own). The file is
`{"version": 1, "checksum": "sha256:<hex>", "data": {"claims": {<uid>: entry}}}`, the checksum over the
canonical JSON of `data`; it is written whole through Host.write_file (temp file, fsync, rename, fsync of
the directory), so a kill leaves the old or the new file.

An entry is `PrepareStarted` (written before anything else of the claim: the devices it will hold and
the CDI spec it will write, by checksum) then `PrepareCompleted` (the answer given). A started entry holds
its devices until kubelet repeats the Prepare or calls Unprepare.

What is read, and what is never a crash loop:
- version 1: as written;
- version 0 (`{"checksum": <crc32 of the claims' JSON>, "claims": {<uid>: {...completed claim}}}`, the
  first layout): converted, every claim completed;
- a file that is not JSON, fails its checksum, has an unknown version or an entry of the wrong shape:
  moved aside to `<name>.corrupt-<sha256 prefix>` (never deleted) with one log line saying where and why,
  and `Loaded.rebuild` tells the caller to rebuild the claims from the API.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpunode.errors import ConfigError
from gpunode.host import Host

log = logging.getLogger("gpunode.dra")

VERSION = 1
NAME = "gpunode-checkpoint.json"
STARTED = "PrepareStarted"
COMPLETED = "PrepareCompleted"
STATES = (STARTED, COMPLETED)


def plugin_dir(driver: str) -> str:
    return f"/var/lib/kubelet/plugins/{driver}"


def default_path(driver: str) -> str:
    return f"{plugin_dir(driver)}/{NAME}"


@dataclass(frozen=True)
class Device:
    """One prepared device, as the DRA response carries it (`admin` and `request` for the driver's own
    rules: the full request name a config was matched with, admin access)."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None
    admin: bool = False

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requestNames": list(self.request_names),
            "pool": self.pool,
            "device": self.device,
            "cdiDeviceIDs": list(self.cdi_ids),
        }
        if self.share_id is not None:
            out["shareID"] = self.share_id
        if self.admin:
            out["adminAccess"] = True
        return out

    @classmethod
    def read(cls, obj: Any) -> Device:
        if not isinstance(obj, dict):
            raise ValueError("a device is not an object")
        names, pool, device, ids = (
            obj.get("requestNames"),
            obj.get("pool"),
            obj.get("device"),
            obj.get("cdiDeviceIDs"),
        )
        share, admin = obj.get("shareID"), obj.get("adminAccess", False)
        if not (_strings(names) and isinstance(pool, str) and isinstance(device, str) and _strings(ids)):
            raise ValueError("a device lacks requestNames, pool, device or cdiDeviceIDs")
        if (share is not None and not isinstance(share, str)) or not isinstance(admin, bool):
            raise ValueError("a device has a shareID or adminAccess of the wrong type")
        return cls(tuple(names or ()), pool, device, tuple(ids or ()), share, admin)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


@dataclass(frozen=True)
class Entry:
    uid: str
    namespace: str
    name: str
    state: str
    devices: tuple[Device, ...]
    cdi_spec: str | None = None  # the spec's path
    cdi_sha256: str | None = None  # of the text written (so only that is ever removed)
    config: tuple[Mapping[str, Any], ...] = ()  # the sharing applied, per config group

    def record(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "state": self.state,
            "devices": [d.record() for d in self.devices],
            "cdiSpec": self.cdi_spec,
            "cdiSha256": self.cdi_sha256,
            "config": [dict(c) for c in self.config],
        }

    @classmethod
    def read(cls, uid: str, obj: Any) -> Entry:
        if not isinstance(obj, dict):
            raise ValueError(f"claim {uid} is not an object")
        state = obj.get("state")
        if state not in STATES:
            raise ValueError(f"claim {uid} has the state {state!r}")
        devices = obj.get("devices")
        config = obj.get("config", [])
        spec, sha = obj.get("cdiSpec"), obj.get("cdiSha256")
        if not isinstance(devices, list) or not isinstance(config, list):
            raise ValueError(f"claim {uid} has no device list")
        if not all(isinstance(v, (str, type(None))) for v in (spec, sha)) or not all(
            isinstance(c, dict) for c in config
        ):
            raise ValueError(f"claim {uid} has a cdiSpec, cdiSha256 or config of the wrong type")
        return cls(
            uid=uid,
            namespace=str(obj.get("namespace", "")),
            name=str(obj.get("name", "")),
            state=str(state),
            devices=tuple(Device.read(d) for d in devices),
            cdi_spec=spec,
            cdi_sha256=sha,
            config=tuple(config),
        )


@dataclass(frozen=True)
class Loaded:
    claims: dict[str, Entry]
    rebuild: bool = False  # the file was set aside: rebuild the claims from the API
    notes: tuple[str, ...] = field(default=())


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def checksum(data: Any) -> str:
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


def render(claims: Mapping[str, Entry]) -> str:
    data = {"claims": {uid: claims[uid].record() for uid in sorted(claims)}}
    return json.dumps({"version": VERSION, "checksum": checksum(data), "data": data}, indent=1) + "\n"


def _from_v1(document: dict[str, Any]) -> dict[str, Entry]:
    data = document.get("data")
    if document.get("checksum") != checksum(data):
        raise ValueError("its checksum does not match its content")
    if not isinstance(data, dict) or not isinstance(data.get("claims"), dict):
        raise ValueError("it has no claims")
    return {uid: Entry.read(uid, obj) for uid, obj in data["claims"].items()}


def _from_v0(document: dict[str, Any]) -> dict[str, Entry]:
    """The first layout: completed claims only, a CRC32 (IEEE, as kubelet's own checkpoint) of the
    claims' canonical JSON; per claim name, namespace, devices (same fields) and the spec."""
    claims = document.get("claims")
    if not isinstance(claims, dict):
        raise ValueError("it has no claims")
    if document.get("checksum") != zlib.crc32(_canonical(claims)):
        raise ValueError("its checksum does not match its content")
    out: dict[str, Entry] = {}
    for uid, obj in claims.items():
        if not isinstance(obj, dict):
            raise ValueError(f"claim {uid} is not an object")
        out[uid] = Entry.read(
            uid,
            {
                "namespace": obj.get("namespace", ""),
                "name": obj.get("name", ""),
                "state": COMPLETED,
                "devices": obj.get("devices"),
                "cdiSpec": obj.get("cdiSpec"),
                "cdiSha256": obj.get("cdiSha256"),
            },
        )
    return out


def parse(text: str) -> dict[str, Entry]:
    """The claims of a checkpoint's text, any version this gpunode reads; ValueError says what is wrong."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"it is not JSON ({exc})") from exc
    if not isinstance(document, dict):
        raise ValueError("it is not a JSON object")
    version = document.get("version", 0)
    if version == VERSION:
        return _from_v1(document)
    if version == 0:
        return _from_v0(document)
    raise ValueError(f"it has version {version!r}; this gpunode reads versions 0 and {VERSION}")


class Checkpoint:
    """The checkpoint file, read and written through the Host."""

    def __init__(self, host: Host, path: str) -> None:
        self.host = host
        self.path = path

    def load(self) -> Loaded:
        problem: str | None = None
        data: bytes | None = None
        try:
            data = self.host.read_bytes(self.path)
        except ConfigError as exc:  # a FIFO, a directory, a file over the read limit
            problem = exc.message
        if data is None and problem is None:
            return Loaded({})
        if data is not None:
            try:
                return Loaded(parse(data.decode("utf-8")))
            except (ValueError, UnicodeDecodeError) as exc:
                problem = str(exc)
        return self._set_aside(data, problem or "it cannot be read")

    def _set_aside(self, data: bytes | None, problem: str) -> Loaded:
        note = f"DRA checkpoint {self.path} is unusable ({problem})"
        if data is not None:
            aside = f"{self.path}.corrupt-{hashlib.sha256(data).hexdigest()[:12]}"
            # Copied whole first, then removed: the only copy is never lost.
            self.host.write_file(aside, data, mode=0o600)
            self.host.remove_file(self.path)
            note += f"; moved to {aside}; the prepared claims are rebuilt from the API"
        log.warning("%s", note)
        return Loaded({}, rebuild=True, notes=(note,))

    def save(self, claims: Mapping[str, Entry]) -> None:
        self.host.write_file(self.path, render(claims), mode=0o600, make_parents=True)
