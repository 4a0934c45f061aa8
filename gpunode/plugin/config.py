"""The plugin's settings: one table of options, each a TOML key, an environment variable and a flag.

Precedence is flag > environment > file > default, resolved per option. NVIDIA's variables (`MIG_STRATEGY`,
..., `CONFIG_FILE`; `DP_DISABLE_HEALTHCHECKS` and `DP_ENABLE_HEALTHCHECKS`) count as environment, below
gpunode's own. Unknown keys, wrong types and bad values are errors
that name the key and where it came from; nothing is ignored silently.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpunode import paths
from gpunode.errors import ConfigError, NotFound
from gpunode.host import Host
from gpunode.plugin.devices import NamedResource, SharedResource
from gpunode.plugin.health import APPLICATION_XIDS, HealthSettings, apply_dp_environment
from gpunode.plugin.options import (
    BY_KEY,
    BY_NAME,
    DEVICE_LIST_STRATEGIES,
    MAX_REPLICAS,
    OPTIONS,
    PLACEMENTS,
    Option,
    is_switch,
    resource_name_problem,
)

DEFAULT_CONFIG = "/etc/gpunode/plugin.toml"
CONFIG_ENV = "GPUNODE_PLUGIN_CONFIG"
NVIDIA_CONFIG_ENV = "CONFIG_FILE"  # NVIDIA's plugin's --config-file variable


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


def _where(origin: str, key: str) -> str:
    return f"{key} ({origin})"


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
    sections = {k.split(".", 1)[0] for k in BY_KEY if "." in k}

    def walk(table: Mapping[str, Any], prefix: str) -> None:
        for key, value in table.items():
            dotted = f"{prefix}{key}"
            if dotted in BY_KEY:
                option = BY_KEY[dotted]
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
            f"(known keys: {', '.join(sorted(BY_KEY))})",
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
    from gpunode.plugin.nvidia_env import environment_options  # small: its reader is imported only when used

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
            levels[2][option.name] = (option.parse(raw, origin), origin)
    for name, value in (flags or {}).items():
        if value is not None:
            option = BY_NAME[name]
            origin = f"flag {option.flag}"
            levels[3][name] = (option.parse(value, origin), origin)

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
    "BY_NAME",
    "CONFIG_ENV",
    "DEFAULT_CONFIG",
    "DEVICE_LIST_STRATEGIES",
    "MAX_REPLICAS",
    "OPTIONS",
    "PLACEMENTS",
    "Option",
    "PluginConfig",
    "describe",
    "is_switch",
    "load_config",
    "read_config_file",
    "resource_name_problem",
    "to_toml",
    "value_of",
]
