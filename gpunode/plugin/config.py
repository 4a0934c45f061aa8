"""The plugin's settings: one table of options, each a TOML key, an environment variable and a flag.

Precedence is flag > environment > file > default, resolved per option. NVIDIA's variables (`MIG_STRATEGY`,
..., `CONFIG_FILE`; `DP_DISABLE_HEALTHCHECKS` and `DP_ENABLE_HEALTHCHECKS`) count as environment, below
gpunode's own. Unknown keys, wrong types and bad values are errors
that name the key and where it came from; nothing is ignored silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpunode import paths
from gpunode.errors import ConfigError, NotFound
from gpunode.host import Host
from gpunode.plugin.devices import DEVICE_ID_STRATEGIES, MIG_STRATEGIES, NamedResource, SharedResource
from gpunode.plugin.health import APPLICATION_XIDS, HealthSettings, apply_dp_environment

DEFAULT_CONFIG = "/etc/gpunode/plugin.toml"
CONFIG_ENV = "GPUNODE_PLUGIN_CONFIG"
NVIDIA_CONFIG_ENV = "CONFIG_FILE"  # NVIDIA's plugin's --config-file variable
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-cri", "cdi-annotations")
PLACEMENTS = ("spread", "packed")

# kubelet's rule for extended resource names (see deviceplugin-v1beta1.md, "What kubelet does" 1).
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NODE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # RFC 1123 subdomain


@dataclass(frozen=True)
class PluginConfig:
    resource_name: str = "nvidia.com/gpu"
    mig_strategy: str = "none"
    device_list_strategy: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    pass_device_specs: bool = False
    pre_start_required: bool = False
    fail_on_init_error: bool = True
    driver_root: str = "/"
    socket_dir: str = paths.DEVICE_PLUGIN_DIR
    cdi_kind: str = "nvidia.com/gpu"
    replicas: int = 1
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    placement: str = "spread"
    shared_resources: tuple[SharedResource, ...] = ()
    gpu_resources: tuple[NamedResource, ...] = ()
    mig_resources: tuple[NamedResource, ...] = ()
    dev_root: str = ""  # where the device nodes are on the host; "" : the driver root
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    gds_enabled: bool = False
    mofed_enabled: bool = False
    gdrcopy_enabled: bool = False
    imex_channel_ids: tuple[int, ...] = ()
    imex_required: bool = False
    # MPS sharing: per-resource replicas (as time-slicing.resources), each shared resource served by its
    # own control daemon with its pipe, log and shm directories under mps_root.
    mps_resources: tuple[SharedResource, ...] = ()
    mps_root: str = "/run/nvidia/mps"
    mps_active_thread_percentage: int = 0  # per client; 0: 100 / replicas
    mps_pinned_memory_limit: int = 0  # MiB of device memory per client; 0: the GPU's memory / replicas
    health: HealthSettings = field(default_factory=HealthSettings)
    # Prometheus metrics: "" is off (the default: an unauthenticated HTTP listener on every GPU node is the
    # operator's choice, and a scraper off the node needs an address only they can pick); "HOST:PORT" on.
    metrics_address: str = ""
    # Events and the GPUHealthy condition on the Node, written with the node's own credentials.
    events_enabled: bool = True
    events_kubeconfig: str = ""  # "": kubelet's kubeconfig (/etc/kubernetes/kubelet.conf)
    node_name: str = ""  # "": kubelet's way ($NODE_NAME, --hostname-override, the host name)
    # Where each setting came from ("default", "file <path>", "env NAME", "flag --x"), for `--show-config`.
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Option:
    name: str  # the PluginConfig field (health options: "health.<field>")
    key: str  # dotted TOML key
    env: str
    flag: str
    parse: Callable[[Any, str], Any]  # (raw value, where it came from) -> value; raises ConfigError


def _where(origin: str, key: str) -> str:
    return f"{key} ({origin})"


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
        raise ConfigError(
            f"{where}: {value!r}: IMEX channel IDs must be [] or [0]", "use [0], or leave it out"
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

_BY_KEY = {o.key: o for o in OPTIONS}

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


def read_config_file(
    host: Host, path: str, *, required: bool, named_by: str = "--config"
) -> dict[str, tuple[Any, str]]:
    """The options set in a TOML file, by option name, with their origin. Unknown keys are errors.
    `named_by` is what gave the path (a flag or a variable), for the error when it does not exist."""
    text = host.read_text_if_exists(path)
    if text is None:
        if required:
            raise NotFound(
                f"plugin config {path} does not exist (given by {named_by})",
                f"create it, or unset {named_by[1:]}"
                if named_by.startswith("$")
                else f"create it, or drop {named_by} {path}",
            )
        return {}
    from gpunode.runtimes.edits import read_toml  # tomlkit: only when there is a file

    try:
        doc = read_toml(text, path)
    except ConfigError:
        # Not TOML: NVIDIA's device-plugin config (YAML or JSON, version v1) is taken as it is.
        from gpunode.plugin.nvidia_config import is_nvidia_config, read_options

        if not is_nvidia_config(text, path):
            raise
        return read_options(text, path)
    found: dict[str, tuple[Any, str]] = {}
    unknown: list[str] = []
    sections = {k.split(".", 1)[0] for k in _BY_KEY if "." in k}

    def walk(table: Mapping[str, Any], prefix: str) -> None:
        for key, value in table.items():
            dotted = f"{prefix}{key}"
            if dotted in _BY_KEY:
                option = _BY_KEY[dotted]
                origin = f"file {path}"
                found[option.name] = (option.parse(value, _where(origin, dotted)), origin)
            elif isinstance(value, dict) and not prefix and key in sections:
                walk(value, f"{dotted}.")
            else:
                unknown.append(dotted)

    walk(doc, "")
    if unknown:
        raise ConfigError(
            f"{path}: unknown or unsupported key{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
            "remove or correct them; `gpunode plugin run --help` lists every option "
            f"(known keys: {', '.join(sorted(_BY_KEY))})",
        )
    return found


def config_file_named(env: Mapping[str, str], config_path: str | None = None) -> tuple[str, str | None]:
    """(what named it, path) of the config file named explicitly: --config, else $GPUNODE_PLUGIN_CONFIG,
    else NVIDIA's $CONFIG_FILE (environment too, below gpunode's own variable); path None: none was, and
    the default is read if it exists."""
    sources = (
        ("--config", config_path),
        (f"${CONFIG_ENV}", env.get(CONFIG_ENV)),
        (f"${NVIDIA_CONFIG_ENV}", env.get(NVIDIA_CONFIG_ENV)),
    )
    return next(((by, given) for by, given in sources if given), ("--config", None))


def load_config(
    host: Host,
    *,
    config_path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> PluginConfig:
    """Resolve every option: flag > environment > file > default.

    `flags` maps option names (PluginConfig fields, "health.<field>") to values already typed by the CLI,
    or None where the flag was not given. `config_path` None means $GPUNODE_PLUGIN_CONFIG, else
    $CONFIG_FILE, else /etc/gpunode/plugin.toml if it exists.
    """
    env = host.env if env is None else env
    named_by, explicit = config_file_named(env, config_path)
    if explicit is not None and not explicit.startswith("/"):
        # `--config plugin.yaml`: relative to where the command runs, as any command-line path.
        import os

        explicit = os.path.abspath(explicit)
    from gpunode.plugin.nvidia_env import environment_options

    # Each level wins over the one before: the file, NVIDIA's variables, gpunode's, flags.
    levels: list[dict[str, tuple[Any, str]]] = [
        read_config_file(host, explicit or DEFAULT_CONFIG, required=bool(explicit), named_by=named_by),
        environment_options(env),
        {},
        {},
    ]
    for option in OPTIONS:
        raw = env.get(option.env)
        if raw is not None and raw != "":
            origin = f"env {option.env}"
            levels[2][option.name] = (option.parse(raw, _where(origin, option.env)), origin)
    for name, value in (flags or {}).items():
        if value is not None:
            option = BY_NAME[name]
            origin = f"flag {option.flag}"
            levels[3][name] = (option.parse(value, _where(origin, option.flag)), origin)

    top: dict[str, Any] = {}
    origins: dict[str, str] = {o.name: "default" for o in OPTIONS}
    health = HealthSettings()
    dp_env = {
        k: v for k, v in env.items() if k in ("DP_DISABLE_HEALTHCHECKS", "DP_ENABLE_HEALTHCHECKS") and v
    }
    for level, values in enumerate(levels):
        if level == 1 and dp_env:
            # NVIDIA's variables are environment: above the file, below our own variables and flags.
            before = health
            health = apply_dp_environment(health, dp_env)
            for name in ("enabled", "ignored_xids", "critical_xids", "all_xids_critical"):
                if getattr(before, name) != getattr(health, name) and f"health.{name}" in origins:
                    origins[f"health.{name}"] = "env " + " ".join(sorted(dp_env))
        health_values = {}
        for name, (value, origin) in values.items():
            origins[name] = origin
            if name.startswith("health."):
                health_values[name.removeprefix("health.")] = value
            else:
                top[name] = value
        health = replace(health, **health_values)
    config = PluginConfig(**top, health=health, origins=origins)
    _check_combination(config)
    return config


def _check_combination(config: PluginConfig) -> None:
    mps = [e for e in config.mps_resources if e.replicas > 1]
    if mps:
        sliced = config.replicas > 1 or any(e.replicas > 1 for e in config.shared_resources)
        if sliced:
            # NVIDIA's plugin silently takes MPS and drops time-slicing; one strategy per node, said aloud.
            raise ConfigError(
                "mps.resources and time-slicing (time-slicing.replicas or time-slicing.resources) are both "
                "set: a node shares its GPUs one way",
                "keep either the MPS or the time-slicing settings",
            )
        # mixed is about MIG devices by definition (NVIDIA's plugin refuses it with MPS too); single serves
        # whole GPUs on a node without MIG (GPU Operator's default strategy), and a MIG device chosen for
        # MPS is refused when the devices are read (devices.build_resources).
        if config.mig_strategy == "mixed":
            raise ConfigError(
                f"mps.resources with mig-strategy {config.mig_strategy}: MPS shares whole GPUs only, not MIG "
                "devices",
                "use mig-strategy none on MPS nodes, or share MIG devices with time-slicing.resources",
            )
    if (config.replicas > 1 or mps) and config.rename_by_default:
        shared = config.resource_name + ".shared"
        problem = resource_name_problem(shared)
        if problem:
            raise ConfigError(f"time-slicing.rename-by-default: {problem}", "use a shorter resource-name")
    if config.mig_strategy == "mixed":
        domain = config.resource_name.split("/", 1)[0]
        if resource_name_problem(f"{domain}/mig-1g.10gb"):
            raise ConfigError(f"mig-strategy mixed: {domain!r} cannot prefix MIG resource names")


def value_of(config: PluginConfig, option: Option) -> Any:
    """The option's resolved value as TOML and JSON hold it: lists for tuples and sets (Xids sorted)."""
    if option.name.startswith("health."):
        value: Any = getattr(config.health, option.name.removeprefix("health."))
    else:
        value = getattr(config, option.name)
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple):
        # Per-resource entries (time-slicing.resources, resources.gpus) as the tables the file holds.
        return [v.as_dict() if isinstance(v, (SharedResource, NamedResource)) else v for v in value]
    return value


def _toml_string(text: str) -> str:
    # A TOML basic string: `"` and `\` escaped, and every control character (TOML forbids them raw, DEL
    # included) as \uXXXX. json.dumps would do nearly this but writes astral characters as surrogate pairs,
    # which TOML refuses.
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # floats as 60.0, so they read back as floats
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, Mapping):  # an inline table: {name = "nvidia.com/gpu", replicas = 4}
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def _comment(text: str) -> str:
    # An origin names a file path, which may hold anything: a newline would end the comment and start a key.
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def to_toml(config: PluginConfig) -> str:
    """The resolved config as a TOML document the plugin reads back to the same values (`--show-config`),
    each key followed by a comment saying where its value came from."""
    top: list[str] = []
    tables: dict[str, list[str]] = {}
    for option in OPTIONS:
        table, dot, key = option.key.rpartition(".")
        line = f"{key} = {_toml_value(value_of(config, option))}"
        origin = _comment(config.origins.get(option.name, "default"))
        (tables.setdefault(table, []) if dot else top).append(f"{line}  # from: {origin}")
    if config.health.all_xids_critical:
        # Not a key of the file: only NVIDIA's DP_ENABLE_HEALTHCHECKS=all sets it.
        tables["health"].insert(0, "# every Xid is critical (DP_ENABLE_HEALTHCHECKS=all; no key sets this)")
    parts = ["\n".join(top)]
    parts += [f"[{name}]\n" + "\n".join(lines) for name, lines in tables.items()]
    return "\n\n".join(parts) + "\n"


def describe(config: PluginConfig) -> list[tuple[str, str, str]]:
    """(key, value, origin) for every option: what `gpunode plugin run --show-config` prints."""
    rows: list[tuple[str, str, str]] = []
    for option in OPTIONS:
        if option.name.startswith("health."):
            value: Any = getattr(config.health, option.name.removeprefix("health."))
        else:
            value = getattr(config, option.name)
        if isinstance(value, (tuple, frozenset)):
            value = ",".join(str(v) for v in (sorted(value) if isinstance(value, frozenset) else value))
        elif isinstance(value, bool):
            value = "true" if value else "false"
        rows.append((option.key, str(value), config.origins.get(option.name, "default")))
    return rows


__all__ = [
    "APPLICATION_XIDS",
    "CONFIG_ENV",
    "DEFAULT_CONFIG",
    "DEVICE_LIST_STRATEGIES",
    "OPTIONS",
    "PLACEMENTS",
    "PluginConfig",
    "describe",
    "is_switch",
    "load_config",
    "read_config_file",
    "resource_name_problem",
    "to_toml",
    "value_of",
]
