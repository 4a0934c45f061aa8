"""The plugin's option table: each option's TOML key, environment variable, flag and parser.

A leaf of the plugin's configuration: config.py resolves the options (flag > environment > file >
default), and the readers of NVIDIA's file and variables (nvidia_config.py, nvidia_env.py) translate into
them. Those readers and config.py import this table; it imports none of them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpunode.errors import ConfigError
from gpunode.plugin.devices import DEVICE_ID_STRATEGIES, MIG_STRATEGIES, NamedResource, SharedResource

DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-cri", "cdi-annotations")
PLACEMENTS = ("spread", "packed")

# kubelet's rule for extended resource names (see deviceplugin-v1beta1.md, "What kubelet does" 1).
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NODE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # RFC 1123 subdomain


@dataclass(frozen=True)
class Option:
    name: str  # the PluginConfig field (health options: "health.<field>")
    key: str  # dotted TOML key
    env: str
    flag: str
    parse: Callable[[Any, str], Any]  # (raw value, where it came from) -> value; raises ConfigError


def _str_choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: Any, where: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(
                f"{where}: {value!r} is not one of: {', '.join(choices)}", f"use one of: {', '.join(choices)}"
            )
        return value

    return parse


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    ):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{where}: {value!r} is not a boolean (true or false)")


def _digits(text: str) -> int | None:
    """The number a plain decimal string (ASCII digits, at most 18 of them) stands for; None otherwise.
    str.isdigit() also takes digits int() refuses ('²'), and int() raises ValueError past 4,300 digits: no
    count or size gpunode takes has 19 digits."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _quoted(value: Any) -> str:
    """repr(value) for a message, cut to a readable length (an environment variable may hold anything)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, str) and _digits(value) is not None:
        value = _digits(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {_quoted(value)} is not a whole number of at least 1")
    return value


# Time-slicing replicas per GPU. Each replica is a device in every ListAndWatch message (about 70 bytes),
# and kubelet takes at most 4 MiB; far beyond any real sharing factor, and the device list is still
# measured against kubelet's limit at start (lifecycle.check_message_sizes).
MAX_REPLICAS = 1024


def _replicas(value: Any, where: str) -> int:
    count = _positive_int(value, where)
    if count > MAX_REPLICAS:
        raise ConfigError(
            f"{where}: {count} replicas per GPU is more than {MAX_REPLICAS}",
            f"use at most {MAX_REPLICAS}: every replica is a device kubelet lists, and its list is limited",
        )
    return count


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("s")
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{where}: {value!r} is not a number of seconds (0 or more)")
    return float(value)


def _absolute_path(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(f"{where}: {value!r} is not an absolute path", "give a path that starts with /")
    # A NUL cannot reach the OS at all (Python raises ValueError, a crash at the first use), and other
    # control characters (a newline, an escape) make a path that kubelet, systemd's unit files and the
    # log lines that name it would each read differently: refused here, where the key can be named.
    bad = next((c for c in value if c < " " or "\x7f" <= c <= "\x9f"), None)
    if bad is not None:
        raise ConfigError(
            f"{where}: {value!r} holds the control character {bad!r}",
            "give the path without control characters (a quoting or copy-paste mistake?)",
        )
    return value.rstrip("/") or "/"


def _resource_name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {value!r} is not a string")
    problem = resource_name_problem(value)
    if problem:
        raise ConfigError(f"{where}: {problem}", "use a name such as nvidia.com/gpu")
    return value


def _strategies(value: Any, where: str) -> tuple[str, ...]:
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(s, str) for s in items):
        raise ConfigError(f"{where}: expected one strategy or a list of them, got {value!r}")
    bad = [s for s in items if s not in DEVICE_LIST_STRATEGIES]
    if bad:
        raise ConfigError(
            f"{where}: unknown device-list strategy {', '.join(map(repr, bad))}",
            f"use any of: {', '.join(DEVICE_LIST_STRATEGIES)}",
        )
    return tuple(dict.fromkeys(items))


def _xids(value: Any, where: str) -> frozenset[int]:
    items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ConfigError(f"{where}: expected a list of Xid numbers, got {value!r}")
    out: set[int] = set()
    for item in items:
        number = _digits(item) if isinstance(item, str) else item
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ConfigError(f"{where}: {_quoted(item)} is not an Xid number")
        out.add(number)
    return frozenset(out)


def _json_list(value: Any, where: str) -> list[Any]:
    # The environment and flags hold these lists as JSON text; the file holds TOML arrays.
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError as err:  # a syntax error, or a number of over 4,300 digits
            raise ConfigError(
                f"{where}: not a JSON list ({_quoted(str(err))})", "write it as JSON: [...]"
            ) from None
        except RecursionError:
            raise ConfigError(
                f"{where}: JSON nested too deeply to read", "write it as a list of tables: [{...}]"
            ) from None
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list, got {_quoted(value)}")
    return value


def _table(item: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a table with {', '.join(required)}, got {item!r}")
    unknown = [k for k in item if k not in required + optional]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}",
            f"use only {', '.join(required + optional)}",
        )
    missing = [k for k in required if k not in item]
    if missing:
        raise ConfigError(f"{where}: {', '.join(missing)} missing", f"each entry needs {', '.join(required)}")
    return dict(item)


def _short_or_full_name(value: Any, where: str) -> str:
    # NVIDIA's names may leave the domain out ("a100" is nvidia.com/a100): checked with a placeholder one.
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {value!r} is not a resource name")
    problem = resource_name_problem(value if "/" in value else f"nvidia.com/{value}")
    if problem:
        raise ConfigError(f"{where}: {problem}", "use a name such as nvidia.com/gpu, or a100")
    return value


_DEVICE_REF = re.compile(r"^(\d+|\d+:\d+|(GPU|MIG)-[0-9A-Za-z/-]+)$")


def _shared_resources(value: Any, where: str) -> tuple[SharedResource, ...]:
    out: list[SharedResource] = []
    for n, item in enumerate(_json_list(value, where)):
        at = f"{where}[{n}]"
        entry = _table(item, at, ("name", "replicas"), ("rename", "devices"))
        name = _short_or_full_name(entry["name"], f"{at}.name")
        rename = _short_or_full_name(entry["rename"], f"{at}.rename") if "rename" in entry else ""
        devices = entry.get("devices", "all")
        if isinstance(devices, bool) or not (
            devices == "all" or (isinstance(devices, int) and devices > 0) or isinstance(devices, list)
        ):
            raise ConfigError(
                f"{at}.devices: {devices!r} is not 'all', a count of at least 1, or a list of devices",
                "list GPU indexes (0), MIG indexes (0:1) or UUIDs",
            )
        if isinstance(devices, list):
            refs = [str(d) if isinstance(d, int) and not isinstance(d, bool) else d for d in devices]
            bad = [d for d in refs if not isinstance(d, str) or not _DEVICE_REF.match(d)]
            if bad:
                raise ConfigError(
                    f"{at}.devices: {', '.join(map(repr, bad))} is not a GPU index, MIG index or UUID",
                    "list GPU indexes (0), MIG indexes (0:1) or UUIDs (GPU-..., MIG-...)",
                )
            devices = tuple(refs)
        out.append(SharedResource(name, _replicas(entry["replicas"], f"{at}.replicas"), rename, devices))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: a resource is named twice", "give each resource one entry")
    return tuple(out)


def _named_resources(value: Any, where: str) -> tuple[NamedResource, ...]:
    out: list[NamedResource] = []
    for n, item in enumerate(_json_list(value, where)):
        at = f"{where}[{n}]"
        entry = _table(item, at, ("pattern", "name"), ())
        if not isinstance(entry["pattern"], str) or not entry["pattern"]:
            raise ConfigError(f"{at}.pattern: {entry['pattern']!r} is not a pattern such as '*A100*'")
        out.append(NamedResource(entry["pattern"], _short_or_full_name(entry["name"], f"{at}.name")))
    return tuple(out)


def _channel_ids(value: Any, where: str) -> tuple[int, ...]:
    items: Any = value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") or not text:
            items = _json_list(text, where)
        else:
            items = [_digits(p) if _digits(p) is not None else p.strip() for p in text.split(",")]
    # NVIDIA's plugin takes only [] or [0] (api/config/v1/imex.go, AssertChannelIDsValid).
    if not isinstance(items, list) or items not in ([], [0]) or any(isinstance(i, bool) for i in items):
        from gpunode.safeyaml import shorten  # a 5,000-digit value is quoted short, not whole

        raise ConfigError(
            f"{where}: {shorten(repr(value))}: IMEX channel IDs must be [] or [0]", "use [0], or leave it out"
        )
    return tuple(items)


def _percentage(value: Any, where: str) -> int:
    if isinstance(value, str) and _digits(value) is not None:
        value = _digits(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise ConfigError(
            f"{where}: {_quoted(value)} is not a percentage from 1 to 100",
            "give e.g. 25; 0 means 100 / replicas",
        )
    return value


# ASCII digits, at most 18 (int() refuses past 4,300 digits, and \d takes every script's digits).
_SIZE = re.compile(r"^\s*([0-9]{1,18})\s*(|m|mi|mib|mb|g|gi|gib|gb)\s*$", re.IGNORECASE)


def _mebibytes(value: Any, where: str) -> int:
    """A memory size in MiB: a whole number (MiB) or a string with M/Mi/MiB or G/Gi/GiB (as MPS's own
    set_default_device_pinned_mem_limit takes them, in binary units). 0 or "" is "derived"."""
    if value == "":
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(
            f"{where}: {_quoted(value)} is not a memory size",
            'give MiB (10240) or a size such as "10G" or "512M"',
        )
    number, unit = int(match.group(1)), match.group(2).lower()
    return number * 1024 if unit.startswith("g") else number


def _path_or_empty(value: Any, where: str) -> str:
    return "" if value == "" else _absolute_path(value, where)


def _listen_address(value: Any, where: str) -> str:
    """Off ("") or HOST:PORT, [V6]:PORT; checked here so that a typo stops the start, not the scrape."""
    if value == "":
        return ""
    text = value if isinstance(value, str) else ""
    host, colon, port = text.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not bare or (":" in bare and not host.startswith("[")) or _digits(port) is None:
        raise ConfigError(
            f"{where}: {_quoted(value)} is not HOST:PORT",
            'write e.g. "127.0.0.1:9402", "0.0.0.0:9402" or "[::1]:9402"; "" turns metrics off',
        )
    if not 0 < int(port) < 65536:  # plain digits, checked just above
        raise ConfigError(f"{where}: port {port} is not between 1 and 65535")
    return text


def _node_name(value: Any, where: str) -> str:
    if value == "":
        return ""
    if not isinstance(value, str) or len(value) > 253 or not _NODE.fullmatch(value):
        raise ConfigError(f"{where}: {value!r} is not a node name", "use the name `kubectl get nodes` shows")
    return value


def _annotation_prefix(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.endswith("/") or resource_name_problem(value + "x"):
        raise ConfigError(f"{where}: {value!r} is not an annotation prefix such as cdi.k8s.io/")
    return value


def _cdi_kind(value: Any, where: str) -> str:
    if not isinstance(value, str) or resource_name_problem(value):
        raise ConfigError(f"{where}: {value!r} is not a CDI kind such as nvidia.com/gpu")
    return value


OPTIONS: tuple[Option, ...] = (
    Option("resource_name", "resource-name", "GPUNODE_RESOURCE_NAME", "--resource-name", _resource_name),
    Option("mig_strategy", "mig-strategy", "GPUNODE_MIG_STRATEGY", "--mig-strategy",
           _str_choice(MIG_STRATEGIES)),
    Option("device_list_strategy", "device-list-strategy", "GPUNODE_DEVICE_LIST_STRATEGY",
           "--device-list-strategy", _strategies),
    Option("device_id_strategy", "device-id-strategy", "GPUNODE_DEVICE_ID_STRATEGY", "--device-id-strategy",
           _str_choice(DEVICE_ID_STRATEGIES)),
    Option("pass_device_specs", "pass-device-specs", "GPUNODE_PASS_DEVICE_SPECS", "--pass-device-specs",
           _bool),
    Option("pre_start_required", "pre-start-required", "GPUNODE_PRE_START_REQUIRED", "--pre-start-required",
           _bool),
    Option("fail_on_init_error", "fail-on-init-error", "GPUNODE_FAIL_ON_INIT_ERROR", "--fail-on-init-error",
           _bool),
    Option("driver_root", "driver-root", "GPUNODE_DRIVER_ROOT", "--driver-root", _absolute_path),
    Option("socket_dir", "socket-dir", "GPUNODE_SOCKET_DIR", "--socket-dir", _absolute_path),
    Option("cdi_kind", "cdi-kind", "GPUNODE_CDI_KIND", "--cdi-kind", _cdi_kind),
    Option("replicas", "time-slicing.replicas", "GPUNODE_REPLICAS", "--replicas", _replicas),
    Option("rename_by_default", "time-slicing.rename-by-default", "GPUNODE_RENAME_BY_DEFAULT",
           "--rename-by-default", _bool),
    Option("fail_requests_greater_than_one", "time-slicing.fail-requests-greater-than-one",
           "GPUNODE_FAIL_REQUESTS_GREATER_THAN_ONE", "--fail-requests-greater-than-one", _bool),
    Option("placement", "time-slicing.placement", "GPUNODE_PLACEMENT", "--placement",
           _str_choice(PLACEMENTS)),
    Option("shared_resources", "time-slicing.resources", "GPUNODE_TIME_SLICING_RESOURCES",
           "--time-slicing-resources", _shared_resources),
    Option("gpu_resources", "resources.gpus", "GPUNODE_GPU_RESOURCES", "--gpu-resources", _named_resources),
    Option("mig_resources", "resources.mig", "GPUNODE_MIG_RESOURCES", "--mig-resources", _named_resources),
    Option("dev_root", "dev-root", "GPUNODE_DEV_ROOT", "--dev-root", _path_or_empty),
    Option("cdi_annotation_prefix", "cdi-annotation-prefix", "GPUNODE_CDI_ANNOTATION_PREFIX",
           "--cdi-annotation-prefix", _annotation_prefix),
    Option("gds_enabled", "gds-enabled", "GPUNODE_GDS_ENABLED", "--gds-enabled", _bool),
    Option("mofed_enabled", "mofed-enabled", "GPUNODE_MOFED_ENABLED", "--mofed-enabled", _bool),
    Option("gdrcopy_enabled", "gdrcopy-enabled", "GPUNODE_GDRCOPY_ENABLED", "--gdrcopy-enabled", _bool),
    Option("imex_channel_ids", "imex.channel-ids", "GPUNODE_IMEX_CHANNEL_IDS", "--imex-channel-ids",
           _channel_ids),
    Option("imex_required", "imex.required", "GPUNODE_IMEX_REQUIRED", "--imex-required", _bool),
    Option("mps_resources", "mps.resources", "GPUNODE_MPS_RESOURCES", "--mps-resources", _shared_resources),
    Option("mps_root", "mps.root", "GPUNODE_MPS_ROOT", "--mps-root", _absolute_path),
    Option("mps_active_thread_percentage", "mps.active-thread-percentage",
           "GPUNODE_MPS_ACTIVE_THREAD_PERCENTAGE", "--mps-active-thread-percentage", _percentage),
    Option("mps_pinned_memory_limit", "mps.pinned-memory-limit", "GPUNODE_MPS_PINNED_MEMORY_LIMIT",
           "--mps-pinned-memory-limit", _mebibytes),
    Option("health.enabled", "health.enabled", "GPUNODE_HEALTH_ENABLED", "--health-checks", _bool),
    Option("health.ignored_xids", "health.ignored-xids", "GPUNODE_HEALTH_IGNORED_XIDS", "--ignored-xids",
           _xids),
    Option("health.critical_xids", "health.critical-xids", "GPUNODE_HEALTH_CRITICAL_XIDS", "--critical-xids",
           _xids),
    Option("health.recovery_quiet_period", "health.recovery-quiet-period",
           "GPUNODE_HEALTH_RECOVERY_QUIET_PERIOD", "--recovery-quiet-period", _seconds),
    Option("metrics_address", "metrics.address", "GPUNODE_METRICS_ADDRESS", "--metrics-address",
           _listen_address),
    Option("events_enabled", "events.enabled", "GPUNODE_EVENTS_ENABLED", "--events", _bool),
    Option("events_kubeconfig", "events.kubeconfig", "GPUNODE_EVENTS_KUBECONFIG", "--events-kubeconfig",
           _path_or_empty),
    Option("node_name", "node-name", "GPUNODE_NODE_NAME", "--node-name", _node_name),
)  # fmt: skip

BY_KEY = {o.key: o for o in OPTIONS}

BY_NAME = {o.name: o for o in OPTIONS}


def is_switch(option: Option) -> bool:
    """A true/false option: `--x` / `--no-x` on the command line."""
    return option.parse is _bool


def resource_name_problem(name: str) -> str | None:
    """Why kubelet would refuse this extended resource name, or None if it is valid."""
    domain, slash, short = name.partition("/")
    if not slash or not domain or not short:
        return f"resource name {name!r} must be <domain>/<name>, e.g. nvidia.com/gpu"
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io") or domain.startswith("requests."):
        return f"resource name {name!r} uses a domain reserved by Kubernetes"
    if len(domain) > 253 or not all(_DNS_LABEL.match(label) for label in domain.split(".")):
        return (
            f"resource name {name!r}: {domain!r} is not a DNS subdomain (lower-case letters, digits, - and .)"
        )
    if len(short) > 63 or not _NAME.match(short):
        return (
            f"resource name {name!r}: {short!r} must be at most 63 characters of letters, digits, "
            "'-', '_' and '.', starting and ending with a letter or digit"
        )
    return None
