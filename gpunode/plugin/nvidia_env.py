"""NVIDIA's device-plugin environment variables (its command line's EnvVars), read as its plugin reads them.

Each stands for a key of NVIDIA's config file and is checked and translated by the same code as that key
(nvidia_config.key_setting). Kept apart from the file's reader so that `plugin run` with none of them set
pays for one dictionary scan, not for importing the reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpunode.errors import ConfigError
from gpunode.plugin.options import BY_NAME

# NVIDIA's environment variables (its command line's EnvVars) -> the key of its file each stands for: a
# value is checked and translated as that key's. CONFIG_FILE is read by config.load_config;
# RESOURCE_NAME_PREFIX is taken only at its default (environment_options).
ENVIRONMENT = {
    "MIG_STRATEGY": "flags.migStrategy",
    "FAIL_ON_INIT_ERROR": "flags.failOnInitError",
    "NVIDIA_DRIVER_ROOT": "flags.nvidiaDriverRoot",
    "NVIDIA_DEV_ROOT": "flags.nvidiaDevRoot",
    "PASS_DEVICE_SPECS": "flags.plugin.passDeviceSpecs",
    "DEVICE_LIST_STRATEGY": "flags.plugin.deviceListStrategy",
    "DEVICE_ID_STRATEGY": "flags.plugin.deviceIDStrategy",
    "GDS_ENABLED": "flags.gdsEnabled",
    "MOFED_ENABLED": "flags.mofedEnabled",
    "GDRCOPY_ENABLED": "flags.gdrcopyEnabled",
    "KUBELET_SOCKET": "flags.plugin.kubeletSocket",
    "CDI_ANNOTATION_PREFIX": "flags.plugin.cdiAnnotationPrefix",
    "NVIDIA_CDI_HOOK_PATH": "flags.plugin.nvidiaCTKPath",
    "NVIDIA_CTK_PATH": "flags.plugin.nvidiaCTKPath",
    "DRIVER_ROOT_CTR_PATH": "flags.plugin.containerDriverRoot",
    "CONTAINER_DRIVER_ROOT": "flags.plugin.containerDriverRoot",
    "MPS_ROOT": "flags.mpsRoot",
    "DEVICE_DISCOVERY_STRATEGY": "flags.deviceDiscoveryStrategy",
    "IMEX_CHANNEL_IDS": "imex.channelIDs",
    "IMEX_REQUIRED": "imex.required",
    "CDI_FEATURE_FLAGS": "flags.plugin.cdiFeatureFlags",
    "RESTART_ON_DEVICE_UNHEALTHY": "flags.restartOnDeviceUnhealthy",
}
# Every NVIDIA variable gpunode reads (config.load_config reads CONFIG_FILE and the health ones).
VARIABLES = (
    *ENVIRONMENT,
    "CONFIG_FILE",
    "RESOURCE_NAME_PREFIX",
    "DP_DISABLE_HEALTHCHECKS",
    "DP_ENABLE_HEALTHCHECKS",
)
# Keys NVIDIA's command line declares as BoolFlag: their variables take Go's strconv.ParseBool spellings.
_GO_BOOLEANS = {
    "flags.failOnInitError",
    "flags.plugin.passDeviceSpecs",
    "flags.gdsEnabled",
    "flags.mofedEnabled",
    "flags.gdrcopyEnabled",
    "imex.required",
    "flags.restartOnDeviceUnhealthy",
}


def environment_options(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """The options NVIDIA's environment variables set (its plugin's flags' EnvVars), by option name, with
    their origin. Each is read as NVIDIA's command line reads it (Go booleans, comma-separated lists) and
    then checked as the same key of NVIDIA's file; an empty variable is unset."""
    prefix = env.get("RESOURCE_NAME_PREFIX")
    if not prefix and not any(env.get(name) for name in ENVIRONMENT):
        return {}  # the usual case: the file's reader (nvidia_config) is not even imported
    from gpunode.plugin.nvidia_config import key_setting

    found: dict[str, tuple[Any, str]] = {}
    if prefix and prefix != "nvidia.com":
        raise ConfigError(
            f"env RESOURCE_NAME_PREFIX: {prefix!r}: gpunode names resources in full, not by a prefix",
            f'unset it and name the resources: resource-name = "{prefix}/gpu" (and resources.gpus / '
            "resources.mig names for the others)",
        )
    taken: set[str] = set()
    for name, key in ENVIRONMENT.items():
        raw = env.get(name)
        if not raw or key in taken:
            continue  # of two names for one flag, the first one set wins, as in urfave/cli
        taken.add(key)
        where = f"env {name}"
        setting = key_setting(key, _from_environment(key, raw, where), where)
        if setting.option is None:
            continue
        option = BY_NAME[setting.option]
        found[option.name] = (option.parse(setting.value, f"{where} ({key})"), where)
    return found


def _go_int(text: str) -> int:
    """An IntSlice item as urfave/cli reads it, with Go's strconv.ParseInt(text, 0, 64): 0x.., 0o.., 0b..,
    and a leading 0 for octal. ValueError for anything else (an empty item, a non-ASCII digit)."""
    text = text.strip()
    if not text.isascii():
        raise ValueError(text)  # Python's int() takes other scripts' digits; Go's ParseInt does not
    if len(text) > 1 and text[0] == "0" and text[1:].isascii() and text[1:].isdigit():
        return int(text, 8)
    return int(text, 0)


def _from_environment(key: str, raw: str, where: str) -> Any:
    """The value NVIDIA's urfave/cli flag would hold for this variable, typed as its YAML key is."""
    if key in _GO_BOOLEANS:
        value = raw.strip()
        if value in ("1", "t", "T", "TRUE", "true", "True"):
            return True
        if value in ("0", "f", "F", "FALSE", "false", "False"):
            return False
        raise ConfigError(f"{where}: {raw!r} is not a boolean", "use true or false (or 1 / 0)")
    if key == "imex.channelIDs":
        try:
            return [_go_int(p) for p in raw.split(",")]
        except ValueError:
            raise ConfigError(
                f"{where}: {raw!r} is not a comma-separated list of channel numbers", "use 0"
            ) from None
    if key == "flags.plugin.deviceListStrategy":
        return [p.strip() for p in raw.split(",")]
    return raw
