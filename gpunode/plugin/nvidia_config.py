"""NVIDIA's device-plugin config file (k8s-device-plugin api/config/v1), read as it is.

`plugin run --config FILE` takes either gpunode's TOML or this file (YAML or JSON, `version: v1`); which one
is decided by content (config.read_config_file: what is not TOML is tried as NVIDIA's). Each NVIDIA key is
translated into an option of gpunode's table (options.OPTIONS), so flags and the environment still win over
the file, as they do over NVIDIA's file in its own plugin.

Where gpunode differs from NVIDIA's reader, on purpose:
- an unknown key is an error naming the key and its line (NVIDIA's YAML reader drops it silently, so a typo
  such as `replica:` quietly turned sharing off);
- `resources.gpus`/`resources.mig` and the `rename`/`devices` of a sharing entry, which NVIDIA's plugin
  parses and then disables with a warning (DisableResourceNamingInConfig), work as their names say;
- MPS sharing runs the control daemons itself (gpunode.plugin.mps), one per shared resource, where
  NVIDIA's plugin needs a second DaemonSet for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.errors import ConfigError
from gpunode.plugin.options import BY_NAME

VERSION = "v1"

# Each level's keys: a nested dict is a table; a string names the gpunode option it becomes, "" : no option
# (the note in NOTES says why). "[]" marks a list of tables whose keys follow.
_SCHEMA: dict[str, Any] = {
    "version": "",
    "flags": {
        "migStrategy": "mig_strategy",
        "failOnInitError": "fail_on_init_error",
        "nvidiaDriverRoot": "driver_root",
        "nvidiaDevRoot": "dev_root",
        "mpsRoot": "mps_root",
        "gdsEnabled": "gds_enabled",
        "mofedEnabled": "mofed_enabled",
        "gdrcopyEnabled": "gdrcopy_enabled",
        "useNodeFeatureAPI": "",
        "deviceDiscoveryStrategy": "",
        "restartOnDeviceUnhealthy": "",
        "plugin": {
            "passDeviceSpecs": "pass_device_specs",
            "deviceListStrategy": "device_list_strategy",
            "deviceIDStrategy": "device_id_strategy",
            "cdiAnnotationPrefix": "cdi_annotation_prefix",
            "containerDriverRoot": "",
            "nvidiaCTKPath": "",
            "cdiFeatureFlags": "",
            "kubeletSocket": "socket_dir",
            "sharedDevicesAllocationPolicy": "placement",
        },
        # GPU feature discovery's own settings: NVIDIA's plugin and GFD read one file, so NVIDIA's example
        # configs carry this block (dp-example-config.yaml).
        "gfd": {
            "oneshot": "",
            "noTimestamp": "",
            "sleepInterval": "",
            "outputFile": "",
            "machineTypeFile": "",
        },
    },
    "sharing": {
        "timeSlicing": {
            "renameByDefault": "rename_by_default",
            "failRequestsGreaterThanOne": "fail_requests_greater_than_one",
            "resources": "shared_resources",
        },
        "mps": {
            "renameByDefault": "rename_by_default",
            "failRequestsGreaterThanOne": "fail_requests_greater_than_one",
            "resources": "mps_resources",
        },
    },
    "resources": {"gpus": "gpu_resources", "mig": "mig_resources"},
    "imex": {"channelIDs": "imex_channel_ids", "required": "imex_required"},
}
_ENTRY_KEYS = {
    "sharing.timeSlicing.resources": ("name", "rename", "devices", "replicas"),
    "sharing.mps.resources": ("name", "rename", "devices", "replicas"),
    "resources.gpus": ("pattern", "name"),
    "resources.mig": ("pattern", "name"),
}
NOTES = {
    "version": "the format's version; gpunode reads v1",
    "flags.plugin.containerDriverRoot": (
        "where NVIDIA's containerised plugin sees the driver root; gpunode runs on the host and reads the "
        "driver at driver-root (nvidiaDriverRoot)"
    ),
    "flags.plugin.nvidiaCTKPath": (
        "the nvidia-ctk NVIDIA's plugin runs to write CDI specs; gpunode writes its CDI spec itself "
        "(`gpunode cdi generate`)"
    ),
    "flags.plugin.cdiFeatureFlags": "nvidia-ctk's CDI feature flags; gpunode writes its CDI spec itself",
    "flags.useNodeFeatureAPI": (
        "GPU feature discovery's way of writing labels (NodeFeature objects); `gpunode node advertise` "
        "sets the labels"
    ),
    "flags.deviceDiscoveryStrategy": "gpunode finds the GPUs through NVML (nvml or auto)",
    "flags.restartOnDeviceUnhealthy": (
        "gpunode marks a device unhealthy and healthy again without a restart (health.recovery-quiet-period)"
    ),
    "flags.gfd": "GPU feature discovery's settings; `gpunode node advertise` sets GFD's labels",
}
# Keys whose only meaningful values here are these (others are refused: gpunode cannot do what they ask).
_ONLY = {"flags.deviceDiscoveryStrategy": ("auto", "nvml")}
# YAML's merge key (`<<: *defaults`): NVIDIA's reader resolves it, so the keys it brings are checked too.
_MERGE_TAG = "tag:yaml.org,2002:merge"
# NVIDIA's allocation policy names -> gpunode's placement.
_POLICIES = {"distributed": "spread", "packed": "packed"}


@dataclass(frozen=True)
class Setting:
    """One key of NVIDIA's file and what it becomes."""

    key: str  # NVIDIA's dotted key, e.g. flags.plugin.deviceIDStrategy
    line: int
    option: str | None  # the gpunode option (PluginConfig field), None : no option (see note)
    value: Any  # the option's value as gpunode's TOML file would hold it
    note: str = ""


def is_toml(text: str) -> bool:
    """Whether text is TOML (gpunode's own config), read as config.read_config_file reads it."""
    from gpunode.runtimes.edits import read_toml

    try:
        read_toml(text, "-")
    except ConfigError:
        return False
    return True


def _yaml_text(text: str) -> str:
    """The text as PyYAML should read it. JSON may be indented with tabs, which NVIDIA's reader
    (sigs.k8s.io/yaml) takes and PyYAML's scanner refuses; in valid JSON a raw tab is only ever
    whitespace (a tab inside a string must be escaped), so expanding tabs changes no value and keeps
    every line number."""
    if "\t" not in text:
        return text
    import json

    try:
        json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep (found by fuzzing)
        return text
    return text.expandtabs()


def is_nvidia_config(text: str, path: str = "the file") -> bool:
    """Whether text (already found not to be TOML) is NVIDIA's config: a YAML or JSON mapping with
    `version`, or with nothing but NVIDIA's top-level keys. A document refused for its size, depth or
    expansion is refused here (YamlRefused), not tried as something else."""
    from gpunode.safeyaml import YamlRefused, load_yaml

    try:
        data = load_yaml(_yaml_text(text), path)
    except YamlRefused:
        raise
    except ConfigError:
        return False
    return isinstance(data, dict) and ("version" in data or (bool(data) and set(data) <= set(_SCHEMA)))


def read_options(text: str, path: str) -> dict[str, tuple[Any, str]]:
    """The options the file sets, by option name, with their origin (as config.read_config_file returns)."""

    found: dict[str, tuple[Any, str]] = {}
    for setting in translate(text, path):
        if setting.option is None:
            continue
        option = BY_NAME[setting.option]
        where = f"{setting.key} ({path}, line {setting.line})"
        found[option.name] = (option.parse(setting.value, where), f"file {path} ({setting.key})")
    return found


def translate(text: str, path: str) -> list[Setting]:
    """Every key of the file with the gpunode option it becomes; ConfigError for anything gpunode cannot
    take as NVIDIA's plugin would (an unknown key, a bad value, MPS sharing)."""
    from gpunode.safeyaml import load_yaml_nodes

    # Duplicate keys are refused by the loader: NVIDIA's reader keeps the last silently, and the walk
    # below reads each key's value from the data by the name it has in the node tree.
    data, root = load_yaml_nodes(_yaml_text(text), path)
    if not isinstance(data, dict) or root is None:
        raise ConfigError(f"{path}: NVIDIA's config is a mapping of version, flags, ...", f"correct {path}")
    settings: list[Setting] = []
    _walk(root, data, _SCHEMA, "", path=path, out=settings)
    version = data.get("version") or VERSION  # NVIDIA's reader takes a missing version as v1
    if version != VERSION:
        raise ConfigError(
            f"{path}: unknown version {version!r} of NVIDIA's device-plugin config",
            f"gpunode reads version {VERSION}",
        )
    _check_one_sharing(data, path)
    return settings


def _walk(
    node: Any, data: Any, schema: Mapping[str, Any], prefix: str, *, path: str, out: list[Setting]
) -> None:
    import yaml

    if not isinstance(data, dict) or not isinstance(node, yaml.MappingNode):
        raise ConfigError(
            f"{path}, line {node.start_mark.line + 1}: {prefix.rstrip('.') or 'the file'} must be a mapping",
            f"correct {path}",
        )
    for key_node, value_node in _pairs(node):
        key = str(key_node.value)
        dotted = f"{prefix}{key}"
        line = key_node.start_mark.line + 1
        if key not in schema:
            raise ConfigError(
                f"{path}, line {line}: unknown key {dotted} in NVIDIA's device-plugin config",
                f"remove or correct it (NVIDIA's plugin would ignore it silently); keys here: "
                f"{', '.join(schema)}",
            )
        target = schema[key]
        value = data[key]
        if value is None:
            # `sharing:` with nothing under it, or `migStrategy: null`: NVIDIA's reader leaves the field
            # unset (its default), and so does gpunode.
            continue
        if isinstance(target, dict):
            _walk(value_node, value, target, f"{dotted}.", path=path, out=out)
            continue
        if dotted in _ENTRY_KEYS:
            _check_entries(value_node, value, dotted, path)
        setting = key_setting(dotted, value, f"{path}, line {line}: {dotted}", line)
        out.append(setting)


def key_setting(dotted: str, value: Any, where: str, line: int = 0) -> Setting:
    """What NVIDIA's key with this value becomes; ConfigError where gpunode cannot honour it. `where` names
    the key as the operator wrote it: the file and line, or the environment variable."""
    note = NOTES.get(dotted) or NOTES.get(dotted.rsplit(".", 1)[0], "")
    if dotted in _ONLY and value not in _ONLY[dotted]:
        raise ConfigError(
            f"{where}: {value!r} is not supported by gpunode", f"use {' or '.join(_ONLY[dotted])}: {note}"
        )
    if dotted == "flags.plugin.kubeletSocket":
        # NVIDIA's plugin takes kubelet.sock's path; gpunode takes the directory it is in (where the
        # plugin's own sockets go too, as kubelet requires).
        if not isinstance(value, str) or not value.startswith("/") or not value.endswith("/kubelet.sock"):
            raise ConfigError(
                f"{where}: {value!r} is not an absolute path to kubelet.sock",
                "give kubelet's socket, e.g. /var/lib/kubelet/device-plugins/kubelet.sock",
            )
        value = value.rsplit("/", 1)[0] or "/"
    if dotted == "sharing.mps.failRequestsGreaterThanOne" and value is not True:
        raise ConfigError(
            f"{where}: {value!r}: gpunode gives an MPS container one replica",
            "remove the key (or set it true): a replica is a fixed share of one GPU, set by its MPS "
            "daemon, and a container asking for two would still get one share",
        )
    if dotted == "flags.plugin.sharedDevicesAllocationPolicy":
        if value not in _POLICIES:
            raise ConfigError(
                f"{where}: {value!r} is not distributed or packed",
                "use distributed (gpunode's placement spread) or packed",
            )
        value = _POLICIES[value]
    if dotted in ("flags.mpsRoot", "flags.plugin.containerDriverRoot") and not (
        isinstance(value, str) and (value == "" or value.startswith("/"))
    ):
        raise ConfigError(f"{where}: {value!r} is not an absolute path", "give a path that starts with /")
    if dotted == "flags.mpsRoot" and value == "":
        return Setting(dotted, line, None, value, "empty: gpunode's default, /run/nvidia/mps")
    return Setting(dotted, line, _option_of(dotted) or None, value, note)


def _option_of(dotted: str) -> str:
    target: Any = _SCHEMA
    for part in dotted.split("."):
        target = target[part]
    assert isinstance(target, str)  # noqa: S101 (a leaf of the schema)
    return target


def _check_entries(node: Any, value: Any, key: str, path: str) -> None:
    """Lists of tables: each entry's keys, by line (the option's parser checks the values)."""
    import yaml

    if not isinstance(value, list) or not isinstance(node, yaml.SequenceNode):
        raise ConfigError(f"{path}, line {node.start_mark.line + 1}: {key} must be a list", f"correct {path}")
    allowed = _ENTRY_KEYS[key]
    for n, (item_node, item) in enumerate(zip(node.value, value, strict=True)):
        if not isinstance(item, dict) or not isinstance(item_node, yaml.MappingNode):
            raise ConfigError(
                f"{path}, line {item_node.start_mark.line + 1}: {key}[{n}] must be a mapping of "
                f"{', '.join(allowed)}",
                f"correct {path}",
            )
        for key_node, _ in _pairs(item_node):
            if key_node.value not in allowed:
                raise ConfigError(
                    f"{path}, line {key_node.start_mark.line + 1}: unknown key {key}[{n}].{key_node.value} "
                    "in NVIDIA's device-plugin config",
                    f"remove or correct it; an entry takes {', '.join(allowed)}",
                )


def _pairs(node: Any) -> list[tuple[Any, Any]]:
    """A mapping node's (key, value) nodes, the ones a merge key (`<<`) brings included: the mapping's own
    first, then each merged mapping's keys it does not set itself (YAML's rule: the mapping's own win)."""
    import yaml

    own = [(k, v) for k, v in node.value if k.tag != _MERGE_TAG]
    seen = {str(k.value) for k, _ in own}
    merged: list[tuple[Any, Any]] = []
    for key_node, value_node in node.value:
        if key_node.tag != _MERGE_TAG:
            continue
        sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                continue  # PyYAML has refused such a merge already
            for pair in _pairs(source):
                if str(pair[0].value) not in seen:
                    seen.add(str(pair[0].value))
                    merged.append(pair)
    return own + merged


def _check_one_sharing(data: Mapping[str, Any], path: str) -> None:
    """rename_by_default and fail_requests_greater_than_one are one option each for whichever sharing is on;
    a file setting them in both sections would have the later one win unseen. (Both sections sharing
    something is refused with the options, by config._check_combination.)"""
    sharing = data.get("sharing") or {}
    both = [
        key
        for key in ("renameByDefault", "failRequestsGreaterThanOne")
        if key in (sharing.get("timeSlicing") or {}) and key in (sharing.get("mps") or {})
    ]
    if both:
        raise ConfigError(
            f"{path}: sharing.timeSlicing and sharing.mps both set {', '.join(both)}",
            "keep one sharing section: a node shares its GPUs one way",
        )
