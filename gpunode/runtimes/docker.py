"""Read Docker's daemon.json: is the nvidia runtime defined, is it the default, is CDI on (read-only).

Parsing is pure (text → dict → facts) so that `configure-runtime` can reuse it on the document it edits.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from gpunode.errors import ConfigError, GpunodeError
from gpunode.host import Host
from gpunode.runtimes.model import DEFAULT_NVIDIA_RUNTIME_NAME, RuntimeConfigState

DAEMON_JSON = "/etc/docker/daemon.json"
BUILTIN_DEFAULT_RUNTIME = "runc"
NVIDIA_RUNTIME_BINARY = "nvidia-container-runtime"
VERSION_TIMEOUT = 15.0

UTF8_BOM = "\ufeff"
# dockerd skips one UTF-8 byte order mark at the start of daemon.json from 23.0 on (moby#44770, backported
# to 23.0 as #44777; Windows' Notepad writes one). 20.10 stops on it: "invalid character 'ï' looking for
# beginning of value". Seen with the real 20.10, 26 and 28.
READS_BOM_SINCE = (23, 0)
# A runtimes entry is what dockerd's runtime type reads: `path` and `runtimeArgs` (a binary), and from 23.0
# on `runtimeType` and `options` instead (a containerd shim). Any other key (nvidia-ctk's `"args": []`) is
# ignored. dockerd 26 and 28 refuse to start when an entry has `path` next to a shim key ("cannot configure
# both path and runtimeType", "options cannot be used with a path runtime"), though `dockerd --validate`
# passes such a file; 20.10 does not know the shim keys and ignores them.
SHIM_RUNTIME_KEYS = ("runtimeType", "options")
SHIMS_SINCE = (23, 0)


def is_daemon_json(host: Host, config: str | None) -> bool:
    """Whether `--config` names the file dockerd reads, however spelled (`/etc/docker/./daemon.json`, a
    link): compared as canonical paths, as the restart's reader does (gpunode.runtimes.reader)."""
    if config is None:
        return True
    try:
        return host.canonical(config) == host.canonical(DAEMON_JSON)
    except (GpunodeError, OSError, ValueError):  # a link loop: not dockerd's file either
        return False


def split_bom(text: str) -> tuple[str, str]:
    """(the UTF-8 byte order mark the text starts with, or "", the rest)."""
    if text.startswith(UTF8_BOM):
        return UTF8_BOM, text[len(UTF8_BOM) :]
    return "", text


def parse_daemon_json(text: str, path: str) -> dict[str, Any]:
    """The top-level object of daemon.json; a blank file reads as {} (read_state says dockerd rejects it).

    One leading byte order mark is skipped, as dockerd 23+ skips it; whether the dockerd that reads the
    file accepts one is startup_problems' question, not the parser's.
    """
    _, body = split_bom(text)
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            f"correct line {exc.lineno} of {path}; dockerd refuses to start with the file as it is",
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{path} nests arrays or objects too deeply for gpunode to read",
            f"correct {path}: no daemon.json needs more than a few levels",
        ) from None
    except ValueError as exc:  # an integer of thousands of digits (Python's int conversion limit)
        raise ConfigError(f"{path} holds a value gpunode cannot read: {exc}", f"correct {path}") from None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        escape = f"\\u{ord(exc.object[exc.start]):04x}"
        raise ConfigError(
            f"{path} holds a lone UTF-16 surrogate escape ({escape}), which is not a character; dockerd "
            "would read it as U+FFFD",
            f"correct {path}: write the character itself, or a complete surrogate pair",
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} must hold a JSON object ({{...}}) at the top level, not {_json_kind(data)}",
            f"make {path} a JSON object, e.g. {{}}",
        )
    return data


def configured_runtimes(config: Mapping[str, Any], path: str) -> dict[str, Mapping[str, Any]]:
    """The `runtimes` entries, by name, in file order."""
    runtimes = config.get("runtimes", {})
    if not isinstance(runtimes, Mapping):
        raise ConfigError(f'{path}: "runtimes" must be an object, not {_json_kind(runtimes)}')
    for name, entry in runtimes.items():
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{path}: runtimes.{name} must be an object, not {_json_kind(entry)}")
        if "path" in entry and not isinstance(entry["path"], str):
            raise ConfigError(f"{path}: runtimes.{name}.path must be a string")
    return dict(runtimes)


def default_runtime(config: Mapping[str, Any], path: str) -> str:
    value = config.get("default-runtime")
    if value is None or value == "":
        return BUILTIN_DEFAULT_RUNTIME
    if not isinstance(value, str):
        raise ConfigError(f'{path}: "default-runtime" must be a string, not {_json_kind(value)}')
    return value


def cdi_enabled(config: Mapping[str, Any], path: str) -> bool | None:
    features = config.get("features")
    if features is None:
        return None
    if not isinstance(features, Mapping):
        raise ConfigError(f'{path}: "features" must be an object, not {_json_kind(features)}')
    cdi = features.get("cdi")
    if cdi is None:
        return None
    if not isinstance(cdi, bool):
        raise ConfigError(f"{path}: features.cdi must be true or false, not {_json_kind(cdi)}")
    return cdi


def find_nvidia_runtime(runtimes: Mapping[str, Mapping[str, Any]], default: str) -> tuple[str, str] | None:
    """(name, path) of the entry that runs nvidia-container-runtime, whatever it is called.

    With several, the default runtime wins (so that "is nvidia the default" is answered truthfully for a
    custom name), then the conventional name "nvidia", then the first in the file.
    """
    found = {
        name: entry["path"]
        for name, entry in runtimes.items()
        if isinstance(entry.get("path"), str) and PurePosixPath(entry["path"]).name == NVIDIA_RUNTIME_BINARY
    }
    for preferred in (default, DEFAULT_NVIDIA_RUNTIME_NAME):
        if preferred in found:
            return preferred, found[preferred]
    return next(iter(found.items()), None)


def parse_dockerd_version(output: str) -> tuple[int, int] | None:
    """(major, minor) from `dockerd --version`: "Docker version 28.5.2+dfsg4, build 3ef3c07"."""
    # ASCII digits, at most 9 each: \d takes every script's digits, and int() raises past 4,300 of them.
    found = re.search(r"\bversion v?([0-9]{1,9})\.([0-9]{1,9})(?![0-9])", output)
    return (int(found.group(1)), int(found.group(2))) if found else None


def installed_dockerd_version(host: Host) -> tuple[int, int] | None:
    """The version of the dockerd that reads daemon.json; None when there is none or it does not say.
    Under --root, what R's package database says, never a program run (gpunode.runtimes.probe)."""
    from gpunode.runtimes import probe

    if host.commands_reach_root and host.which("dockerd") is None:
        return None
    result, _ = probe.run(host, "dockerd", ["--version"], timeout=VERSION_TIMEOUT)
    return parse_dockerd_version(result.stdout) if result is not None and result.ok else None


def dockerd_unknown_under_root(host: Host) -> bool:
    """True under --root when R's package database does not say which dockerd it has (gpunode runs no
    program of R): its version is unknown. gpunode then
    judges the file as the newest dockerd it knows does (and says so), instead of refusing what a current
    dockerd accepts (a BOM, keys 20.10 does not know)."""
    return not host.commands_reach_root and installed_dockerd_version(host) is None


def bom_problem(text: str, path: str, dockerd: tuple[int, int] | None) -> str | None:
    """Why a file starting with a UTF-8 BOM stops the dockerd that reads it (None: it does not)."""
    if not split_bom(text)[0] or (dockerd is not None and dockerd >= READS_BOM_SINCE):
        return None
    since = ".".join(map(str, READS_BOM_SINCE))
    which = (
        f"which dockerd {dockerd[0]}.{dockerd[1]} refuses"
        if dockerd is not None
        else "and gpunode cannot tell which dockerd reads the file (no `dockerd --version` answered)"
    )
    return (
        f"{path} starts with a UTF-8 byte order mark (BOM), {which}: dockerd reads one only from {since} on "
        "and before that refuses to start (\"invalid character 'ï' looking for beginning of value\")"
    )


def path_and_shim(runtimes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The runtimes entries that name a binary (`path`) and a containerd shim's keys at once."""
    return [
        name
        for name, entry in runtimes.items()
        if entry.get("path") and any(key in entry for key in SHIM_RUNTIME_KEYS)
    ]


def startup_problems(
    text: str, config: Mapping[str, Any], path: str, dockerd: tuple[int, int] | None = None
) -> list[str]:
    """What in the file would stop dockerd from starting (it checks these itself at start and on SIGHUP).

    `dockerd` is the version of the daemon that reads the file, when known: a BOM and a runtime with both
    a path and shim keys depend on it (unknown counts as refused: gpunode never calls such a file fine).
    """
    problems: list[str] = []
    bom = bom_problem(text, path, dockerd)
    if bom is not None:
        problems.append(bom)
    _, body = split_bom(text)
    if not body.strip():
        problems.append(f"{path} is empty: dockerd refuses to start with an empty daemon.json (write {{}})")
    runtimes = configured_runtimes(config, path)
    for name in path_and_shim(runtimes) if dockerd is None or dockerd >= SHIMS_SINCE else ():
        shim = " and ".join(key for key in SHIM_RUNTIME_KEYS if key in runtimes[name])
        problems.append(
            f"{path}: runtimes.{name} has both path and {shim}: dockerd refuses to start (a runtime is "
            "either a binary or a containerd shim)"
        )
    if BUILTIN_DEFAULT_RUNTIME in runtimes:
        problems.append(
            f'{path} defines a runtime named "runc": dockerd refuses to start (the name is reserved)'
        )
    default = default_runtime(config, path)
    # A dotted name is a containerd shim (io.containerd.runc.v2), which dockerd accepts without an entry.
    if default != BUILTIN_DEFAULT_RUNTIME and default not in runtimes and "." not in default:
        problems.append(
            f'{path}: default-runtime "{default}" is not defined under "runtimes": dockerd refuses to start'
        )
    return problems


def read_state(host: Host, path: str = DAEMON_JSON) -> RuntimeConfigState:
    text = host.read_text_if_exists(path)
    if text is None:
        return RuntimeConfigState(
            runtime="docker",
            config_path=path,
            exists=False,
            runtimes=(),
            default_runtime=BUILTIN_DEFAULT_RUNTIME,
            nvidia_runtime=None,
            nvidia_binary=None,
            cdi_enabled=None,
        )
    config = parse_daemon_json(text, path)
    runtimes = configured_runtimes(config, path)
    default = default_runtime(config, path)
    nvidia = find_nvidia_runtime(runtimes, default)
    # dockerd is asked its version only when the answer matters: doctor runs read_state on every node.
    matters = bool(split_bom(text)[0]) or bool(path_and_shim(runtimes))
    dockerd = installed_dockerd_version(host) if matters else None
    problems = tuple(startup_problems(text, config, path, dockerd))
    return RuntimeConfigState(
        runtime="docker",
        config_path=path,
        exists=bool(split_bom(text)[1].strip()),
        runtimes=tuple(runtimes),
        default_runtime=default,
        nvidia_runtime=nvidia[0] if nvidia else None,
        nvidia_binary=nvidia[1] if nvidia else None,
        cdi_enabled=cdi_enabled(config, path),
        files=(path,),
        notes=problems,
        problems=problems,
    )


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if value is None:
        return "null"
    return "an object"
