"""The opaque device configuration of a claim: `resource.nvidia.com/v1beta1` GpuConfig and MigDeviceConfig,
read as NVIDIA's DRA driver reads them (shared/specs/dra-nvidia-compat.md section 4), so a claim written for
that driver means the same here.

Decoding is strict, as NVIDIA's is: an unknown field fails the claim with a message naming the field and
where it is, a value of the wrong type or out of range names the value. The parameters are bounded (10 KiB
as JSON) before anything else is looked at: they come from any user who can create a claim.

Which config applies to a device (`configs_for`): the allocation's config entries of this driver, the
class's before the claim's (the scheduler copies both), later entries above earlier ones; the highest entry
that fits wins: one naming the device's request exactly (a config of the wrong kind for it, a
MigDeviceConfig for a full GPU, is an error), or one with no `requests` whose kind fits the device (one
that does not fit is skipped). A request name is matched as written: like NVIDIA's driver, a config naming
`parent` does not reach a firstAvailable result `parent/sub` (only `parent/sub` does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpunode.errors import ConfigError

API_VERSION = "resource.nvidia.com/v1beta1"
GPU_CONFIG = "GpuConfig"
MIG_CONFIG = "MigDeviceConfig"
VFIO_CONFIG = "VfioDeviceConfig"
KIND_FOR_DEVICE = {"gpu": GPU_CONFIG, "mig": MIG_CONFIG}
TIME_SLICING = "TimeSlicing"
MPS = "MPS"
INTERVALS = ("Default", "Short", "Medium", "Long")  # nvidia-smi compute-policy --set-timeslice 0..3
MAX_PARAMETERS = 10 * 1024  # bytes of the parameters as JSON
MIB = 2**20

_QUANTITY = re.compile(r"^([+]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m|)$")
_FACTORS = {
    "": 1,
    "m": 0.001,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_UUID_KEY = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]{1,80}$")


class OpaqueConfigError(ConfigError):
    """A claim's opaque configuration that this driver cannot apply: fails that claim only."""


@dataclass(frozen=True)
class MpsConfig:
    default_active_thread_percentage: int | None = None
    default_pinned_memory_mib: int | None = None
    # Keys as written: a GPU/MIG UUID or an index into the group's devices sorted by UUID.
    per_device_pinned_memory_mib: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Sharing:
    strategy: str  # TIME_SLICING or MPS
    interval: str | None = None  # time-slicing only
    mps: MpsConfig | None = None

    def as_record(self) -> dict[str, Any]:
        """What the checkpoint keeps of it (plain JSON)."""
        record: dict[str, Any] = {"strategy": self.strategy}
        if self.interval is not None:
            record["interval"] = self.interval
        if self.mps is not None:
            record["mps"] = {
                "defaultActiveThreadPercentage": self.mps.default_active_thread_percentage,
                "defaultPinnedDeviceMemoryLimitMiB": self.mps.default_pinned_memory_mib,
                "defaultPerDevicePinnedMemoryLimitMiB": dict(self.mps.per_device_pinned_memory_mib),
            }
        return record


@dataclass(frozen=True)
class DeviceConfig:
    kind: str  # GPU_CONFIG or MIG_CONFIG
    sharing: Sharing


@dataclass(frozen=True)
class Applied:
    """The config one group of a claim's devices gets: `entry` numbers the config object (one MPS daemon,
    one set of per-device keys, per object, as NVIDIA's driver groups them); None: built-in defaults."""

    entry: int | None
    config: DeviceConfig | None


def _fields(obj: Any, where: str, allowed: Sequence[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise OpaqueConfigError(f"{where} must be an object, not {_shown(obj)}")
    for key in obj:
        if key not in allowed:
            raise OpaqueConfigError(
                f"{where} has an unknown field {key!r} (known: {', '.join(allowed)})",
                "remove it or fix its spelling: the driver decodes the configuration strictly",
            )
    return obj


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise OpaqueConfigError(f"{where} must be a string, not {_shown(value)}")
    return value


def mebibytes(value: Any, where: str) -> int:
    """A Kubernetes quantity ("10Gi", "512Mi", 1073741824) as whole MiB (rounded down, as NVIDIA's driver
    divides); at least 1."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OpaqueConfigError(f'{where} must be a quantity such as "1Gi", not {_shown(value)}')
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        raise OpaqueConfigError(f'{where}: {_shown(value)} is not a quantity (such as "512Mi" or "1Gi")')
    number, suffix = match.group(2), match.group(3)
    whole, _, fraction = number.partition(".")
    factor = _FACTORS[suffix]
    total = int(whole or "0") * factor + (int(fraction) * factor / 10 ** len(fraction) if fraction else 0)
    mib = int(total // MIB)
    if mib < 1:
        raise OpaqueConfigError(f"{where}: {_shown(value)} is less than 1Mi (limits are whole MiB)")
    return mib


def _mps(obj: Any, where: str) -> MpsConfig:
    body = _fields(
        obj,
        where,
        (
            "defaultActiveThreadPercentage",
            "defaultPinnedDeviceMemoryLimit",
            "defaultPerDevicePinnedMemoryLimit",
        ),
    )
    percentage = body.get("defaultActiveThreadPercentage")
    if percentage is not None and (
        isinstance(percentage, bool) or not isinstance(percentage, int) or not 0 <= percentage <= 100
    ):
        raise OpaqueConfigError(
            f"{where}.defaultActiveThreadPercentage must be an integer from 0 to 100, "
            f"not {_shown(percentage)}"
        )
    default = body.get("defaultPinnedDeviceMemoryLimit")
    per_device_raw = body.get("defaultPerDevicePinnedMemoryLimit")
    per_device: dict[str, int] = {}
    if per_device_raw is not None:
        at = f"{where}.defaultPerDevicePinnedMemoryLimit"
        if not isinstance(per_device_raw, dict):
            raise OpaqueConfigError(f"{at} must be a map of device (UUID or index) to quantity")
        for key, limit in per_device_raw.items():
            if not (key.isdigit() or _UUID_KEY.match(key)):
                raise OpaqueConfigError(
                    f"{at} has the key {_shown(key)}: a key is a GPU or MIG UUID or an index (0, 1, ...)"
                )
            per_device[key] = mebibytes(limit, f"{at}[{key}]")
    return MpsConfig(
        default_active_thread_percentage=percentage,
        default_pinned_memory_mib=None
        if default is None
        else mebibytes(default, f"{where}.defaultPinnedDeviceMemoryLimit"),
        per_device_pinned_memory_mib=per_device,
    )


def _sharing(obj: Any, kind: str) -> Sharing:
    where = f"{kind}.sharing"
    allowed = (
        ("strategy", "timeSlicingConfig", "mpsConfig") if kind == GPU_CONFIG else ("strategy", "mpsConfig")
    )
    body = _fields(obj, where, allowed)
    strategy = _string(body.get("strategy"), f"{where}.strategy")
    if strategy == TIME_SLICING:
        if body.get("mpsConfig") is not None:
            raise OpaqueConfigError(f"{where}: mpsConfig is set but the strategy is {TIME_SLICING}")
        if kind == MIG_CONFIG:
            return Sharing(TIME_SLICING)  # accepted, no effect on a MIG device (as NVIDIA's driver)
        block = body.get("timeSlicingConfig")
        if block is None:
            return Sharing(TIME_SLICING, interval="Default")
        slicing = _fields(block, f"{where}.timeSlicingConfig", ("interval",))
        # Inside an explicit block the interval is not defaulted (NVIDIA's driver refuses it missing too).
        interval = slicing.get("interval")
        if interval not in INTERVALS:
            raise OpaqueConfigError(
                f"{where}.timeSlicingConfig.interval must be one of {', '.join(INTERVALS)}, not "
                f"{_shown(interval) if interval is not None else 'missing'}"
            )
        return Sharing(TIME_SLICING, interval=str(interval))
    if strategy == MPS:
        if body.get("timeSlicingConfig") is not None:
            raise OpaqueConfigError(f"{where}: timeSlicingConfig is set but the strategy is {MPS}")
        block = body.get("mpsConfig")
        return Sharing(MPS, mps=MpsConfig() if block is None else _mps(block, f"{where}.mpsConfig"))
    raise OpaqueConfigError(f"{where}.strategy must be {TIME_SLICING} or {MPS}, not {_shown(strategy)}")


def decode(parameters: Any) -> DeviceConfig:
    """One opaque config object's parameters, strictly."""
    try:
        size = len(json.dumps(parameters, separators=(",", ":")).encode())
    except (TypeError, ValueError) as exc:
        raise OpaqueConfigError(f"the opaque parameters are not JSON: {exc}") from exc
    if size > MAX_PARAMETERS:
        raise OpaqueConfigError(
            f"the opaque parameters are {size} bytes as JSON; at most {MAX_PARAMETERS} are read"
        )
    if not isinstance(parameters, dict):
        raise OpaqueConfigError(f"the opaque parameters must be an object, not {_shown(parameters)}")
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api_version != API_VERSION:
        raise OpaqueConfigError(
            f"the opaque parameters have apiVersion {_shown(api_version)}; this driver reads {API_VERSION}"
        )
    if kind == VFIO_CONFIG:
        raise OpaqueConfigError(
            f"{VFIO_CONFIG} is not supported: gpunode publishes no VFIO (passthrough) devices"
        )
    if kind not in (GPU_CONFIG, MIG_CONFIG):
        raise OpaqueConfigError(
            f"the opaque parameters have kind {_shown(kind)}; the kinds of {API_VERSION} are "
            f"{GPU_CONFIG} and {MIG_CONFIG}"
        )
    body = _fields(parameters, str(kind), ("apiVersion", "kind", "sharing"))
    raw = body.get("sharing")
    if raw is None:
        # NVIDIA's defaults: time-slicing at the default interval (a GPU); nothing to change on a MIG device.
        return DeviceConfig(kind, Sharing(TIME_SLICING, interval="Default" if kind == GPU_CONFIG else None))
    return DeviceConfig(kind, _sharing(raw, kind))


def _main_name(request: str) -> str:
    return request.split("/", 1)[0]


def configs_for(entries: Sequence[Any], driver: str, results: Sequence[tuple[str, str]]) -> list[Applied]:
    """The config of each result, given as (request name, device type "gpu"|"mig"), from the allocation's
    `devices.config` entries. Raises OpaqueConfigError (the claim fails) for an entry of this driver that
    cannot be decoded, or one naming a request whose device its kind does not fit."""
    ordered: list[tuple[int, Any]] = []
    for source in ("FromClass", "FromClaim"):
        ordered += [
            (n, e) for n, e in enumerate(entries) if isinstance(e, dict) and e.get("source") == source
        ]
    ordered += [
        (n, e)
        for n, e in enumerate(entries)
        if isinstance(e, dict) and e.get("source") not in ("FromClass", "FromClaim")
    ]
    decoded: list[tuple[int, list[str], DeviceConfig]] = []
    for number, entry in ordered:
        opaque = entry.get("opaque")
        if not isinstance(opaque, dict) or opaque.get("driver") != driver:
            continue  # another driver's, or a structured one: not ours to read
        requests = entry.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise OpaqueConfigError(f"config entry {number}: requests must be a list of request names")
        try:
            config = decode(opaque.get("parameters"))
        except OpaqueConfigError as exc:
            raise OpaqueConfigError(
                f"config entry {number} ({entry.get('source')}): {exc.message}", exc.fix
            ) from exc
        decoded.append((number, requests, config))
    applied: list[Applied] = []
    for request, device_type in results:
        wanted = KIND_FOR_DEVICE[device_type]
        chosen = Applied(None, None)
        for number, requests, config in reversed(decoded):  # the highest precedence first
            if request in requests:
                if config.kind != wanted:
                    raise OpaqueConfigError(
                        f"config entry {number} names request {request!r}, whose device is a "
                        f"{'MIG device' if device_type == 'mig' else 'full GPU'}, but is a {config.kind}",
                        f"use kind {wanted} for that request",
                    )
                chosen = Applied(number, config)
                break
            if not requests and config.kind == wanted:
                chosen = Applied(number, config)
                break
        applied.append(chosen)
    return applied


def main_request_name(request: str) -> str:
    """The name kubelet matches container claims against: `req` of a firstAvailable result `req/sub`."""
    return _main_name(request)
