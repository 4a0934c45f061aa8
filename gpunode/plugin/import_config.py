"""`gpunode plugin import-config`: NVIDIA's device-plugin config file as the equivalent gpunode TOML.

The plugin reads NVIDIA's file as it is (nvidia_config); this prints what that file means in gpunode's own
keys, each followed by a comment naming the NVIDIA key (and line) it came from, so a move can be reviewed and
the result kept as /etc/gpunode/plugin.toml. Keys with no gpunode equivalent are comments saying why. The
output reads back (tomllib, the plugin) to the same settings as the NVIDIA file.
"""

from __future__ import annotations

from typing import Any

from gpunode.errors import ConfigError


def _plain(value: Any) -> Any:
    """A parsed option value as TOML holds it (config.value_of's rules, for one value)."""
    from gpunode.plugin.devices import NamedResource, SharedResource

    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple):
        return [v.as_dict() if isinstance(v, (SharedResource, NamedResource)) else v for v in value]
    return value


def render(text: str, path: str) -> str:
    """The gpunode TOML for NVIDIA's config `text` (read from `path`); ConfigError as `plugin run` would
    refuse the file."""
    from gpunode.plugin.config import (
        BY_NAME,
        PluginConfig,
        _check_combination,
        _comment,
        _toml_value,
    )
    from gpunode.plugin.nvidia_config import is_nvidia_config, translate

    if not is_nvidia_config(text, path):
        raise ConfigError(
            f"{path} is not NVIDIA's device-plugin config (a YAML or JSON mapping with version: v1)",
            "give the file NVIDIA's plugin reads (--config-file, or the ConfigMap's content)",
        )
    top: list[str] = []
    tables: dict[str, list[str]] = {}
    notes: list[str] = []
    values: dict[str, Any] = {}
    for setting in translate(text, path):
        origin = _comment(f"{setting.key} (line {setting.line})")
        if setting.option is None:
            notes.append(f"# {origin}: {_comment(setting.note)}")
            continue
        option = BY_NAME[setting.option]
        where = f"{setting.key} ({path}, line {setting.line})"
        parsed = option.parse(setting.value, where)
        values[option.name] = parsed
        value = _plain(parsed)
        table, dot, key = option.key.rpartition(".")
        line = f"{key} = {_toml_value(value)}  # from NVIDIA's {origin}"
        (tables.setdefault(table, []) if dot else top).append(line)
    # What the plugin refuses as a whole (MPS with MIG, MPS and time-slicing at once) is refused here too:
    # printing TOML for it would hand the operator a file the plugin does not start with.
    _check_combination(PluginConfig(**values))
    header = [
        f"# gpunode device-plugin config, translated from NVIDIA's {_comment(path)}",
        "# by `gpunode plugin import-config`; keys not set here keep gpunode's defaults",
        "# (`gpunode plugin run --config FILE --show-config` lists them all).",
        *notes,
    ]
    parts = ["\n".join(header + top)]
    parts += [f"[{name}]\n" + "\n".join(lines) for name, lines in tables.items()]
    return "\n\n".join(parts) + "\n"
