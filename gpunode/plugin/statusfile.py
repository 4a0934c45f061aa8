"""Where a running plugin leaves its status file, and finding it again for `gpunode plugin status`.

The plugin writes the file it was told to (`plugin run --status-file PATH`, else $GPUNODE_PLUGIN_STATUS_FILE,
else /run/gpunode/plugin-status.json). A plugin started by hand or in a container may have been told anything,
so `plugin status` looks where it is told to, or else where the systemd unit tells the service to write, then
at the default; it reports the file it read, or every place it looked.

Kept free of grpc and the plugin's other modules: `plugin status` imports this and nothing heavy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpunode import paths
from gpunode.errors import GpunodeError, UsageError
from gpunode.host import Host

DEFAULT = paths.PLUGIN_STATUS_FILE
ENV = "GPUNODE_PLUGIN_STATUS_FILE"
FLAG = "--status-file"


def plugin_path(flag: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """(path, where it came from) of the file a plugin writes: the flag, the environment, the default."""
    if flag:
        return flag, f"flag {FLAG}"
    if env.get(ENV):
        return env[ENV], f"env {ENV}"
    return DEFAULT, "default"


def in_socket_dir(host: Host, path: str, socket_dir: str) -> bool:
    """Whether the status file `path` is in kubelet's socket directory or below it (links resolved).

    The plugin holds a flock on that directory while it serves (lifecycle: one plugin per directory), and
    every atomic write takes a flock on its file's directory: each status update there waited out the
    lock's 30 s for a lock its own process held (READY 30 s late, a stop past systemd's 15 s). And kubelet
    deletes what is in that directory when it restarts. So the file is refused there, not worked around."""
    real_file = os.path.realpath(host.path(path))
    real_dir = os.path.realpath(host.path(socket_dir))
    return real_file == real_dir or real_file.startswith(real_dir.rstrip("/") + "/")


def socket_dir_error(path: str, source: str, socket_dir: str) -> GpunodeError:
    from gpunode.errors import UsageError

    return UsageError(
        f"plugin run: the status file {path} ({source}) is inside the socket directory {socket_dir}: the "
        "plugin locks that directory while it serves, and kubelet empties it when it restarts",
        f"put the status file elsewhere with {FLAG} or ${ENV} (default {DEFAULT})",
    )


@dataclass(frozen=True)
class Place:
    path: str
    source: str  # "flag --status-file", "env GPUNODE_PLUGIN_STATUS_FILE", "unit ... Environment=", "default"


@dataclass
class Lookup:
    """What `plugin status` found: the file read (or None) and every place it looked, in order."""

    looked: list[Place] = field(default_factory=list)
    found: Place | None = None
    document: dict[str, Any] | None = None
    problem: str | None = None  # the file exists but is not a status document
    pid_running: bool | None = None  # None: no document, or no pid in it

    @property
    def ready(self) -> bool:
        return bool(self.document and self.document.get("ready")) and self.pid_running is not False


def _unit_environment(
    host: Host, unit: str, properties: Mapping[str, str], env_name: str = ENV
) -> list[Place]:
    """GPUNODE_PLUGIN_STATUS_FILE as the unit sets it: its EnvironmentFile= files win over Environment=,
    as systemd applies them (systemd.exec, EnvironmentFile=)."""
    places: list[Place] = []
    for word in _split(properties.get("Environment", "")):
        name, eq, value = word.partition("=")
        if eq and name == env_name and value:
            places = [Place(value, f"{unit} Environment=")]
    for line in properties.get("EnvironmentFiles", "").splitlines():
        # systemctl show: "/etc/default/gpunode-device-plugin (ignore_errors=yes)", one line per file.
        env_file = line.rsplit(" (", 1)[0].strip()
        if not env_file.startswith("/"):
            continue
        from_file = environment_file(host, env_file).get(env_name)
        if from_file:
            places = [Place(from_file, f"{unit} EnvironmentFile={env_file}")]
    return places


def environment_file(host: Host, path: str) -> dict[str, str]:
    """The variables a unit's EnvironmentFile= sets, as systemd reads it: KEY=VALUE a line, `export ` and
    `#` comments allowed, shell-like quoting (a line with an unbalanced quote is skipped); the last
    assignment of a name wins. A missing file sets nothing."""
    env: dict[str, str] = {}
    for raw in (host.read_text_if_exists(path) or "").splitlines():
        name, eq, value = raw.strip().removeprefix("export ").partition("=")
        if not eq or not name.strip() or name.lstrip().startswith("#"):
            continue
        words = _split(value)
        env[name.strip()] = words[0] if words else ""
    return env


def _split(text: str) -> list[str]:
    import shlex  # only `plugin status` reads a unit's settings; the plugin imports this module too

    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote: systemd would not have loaded it either
        return []


PID_MAX = 4194304  # the kernel's largest pid_max (2^22): a larger pid was never a process's


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(kind: type) -> Any:
    return lambda v: v is None or isinstance(v, kind)


# The document the plugin writes (runner.StatusWriter): each key's check, when the key is there. A file of
# another shape (hand-edited, another program's) is "not a plugin status document", never a crash.
_TOP: dict[str, Any] = {
    "pid": lambda v: _is_int(v) and 1 <= v <= PID_MAX,
    "ready": lambda v: isinstance(v, bool),
    "waiting_for": _optional(str),
    "nvml_error": _optional(str),
    "summary": _optional(str),
}
_RESOURCE: dict[str, Any] = {
    "name": _optional(str),
    "socket": _optional(str),
    "devices": _is_int,
    "healthy": _is_int,
    "registered": lambda v: isinstance(v, bool),
    "refused": _optional(str),
    "unmonitored": _is_int,
    "sharing": _optional(str),
    "down": _optional(str),
}
_UNMONITORED: dict[str, Any] = {"index": _is_int, "uuid": _optional(str), "reason": _optional(str)}


def shape_problem(document: dict[str, Any]) -> str | None:
    """What is wrong with a status document's shape (the key named), or None."""
    for key, ok in _TOP.items():
        if key in document and not ok(document[key]):
            return f"its {key!r} is {_shown(document[key])}" + (
                f" (a pid is an integer from 1 to {PID_MAX})" if key == "pid" else ""
            )
    for key, fields in (("resources", _RESOURCE), ("unmonitored", _UNMONITORED)):
        items = document.get(key, [])
        if not isinstance(items, list):
            return f"its {key!r} is not a list"
        for n, item in enumerate(items):
            if not isinstance(item, dict):
                return f"{key}[{n}] is {_shown(item)}, not an object"
            for field_name, ok in fields.items():
                if field_name in item and not ok(item[field_name]):
                    return f"{key}[{n}].{field_name} is {_shown(item[field_name])}"
    return None


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _pid_running(pid: object) -> bool | None:
    # The pid is of the plugin's PID namespace: run `plugin status` where the plugin runs (its container).
    if not isinstance(pid, int) or isinstance(pid, bool) or not 1 <= pid <= PID_MAX:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def find(
    host: Host,
    *,
    flag: str | None,
    env: Mapping[str, str],
    unit: str,
    unit_properties: Mapping[str, str],
    env_name: str = ENV,
    default: str = DEFAULT,
) -> Lookup:
    """Read the plugin's status file. An explicit place (the flag, else $GPUNODE_PLUGIN_STATUS_FILE) is the
    only one looked at; otherwise the unit's setting, then the default. `env_name` and `default`: another
    service's (the DRA driver's GPUNODE_DRA_STATUS_FILE, /run/gpunode/dra.json)."""
    if flag:
        places = [Place(flag, f"flag {FLAG}")]
    elif env.get(env_name):
        if not env[env_name].startswith("/"):
            # Host paths are absolute (a relative one would be read relative to gpunode's own directory).
            raise UsageError(
                f"{env_name}={env[env_name][:80]!r} is not an absolute path",
                f"set {env_name} to the absolute path the {'plugin' if env_name == ENV else 'driver'} was "
                "started with (or unset it), then run again",
            )
        places = [Place(env[env_name], f"env {env_name}")]
    else:
        places = _unit_environment(host, unit, unit_properties, env_name)
        if all(p.path != default for p in places):
            places.append(Place(default, "default"))
    lookup = Lookup()
    for place in places:
        lookup.looked.append(place)
        try:
            text = host.read_text_if_exists(place.path)
        except GpunodeError as err:  # unreadable (permission): say so, do not look further
            lookup.found, lookup.problem = place, err.message
            return lookup
        if text is None:
            continue
        lookup.found = place
        try:
            loaded = json.loads(text)
        except (ValueError, RecursionError) as err:  # RecursionError: JSON nested thousands deep
            lookup.problem = f"{place.path} is not JSON ({str(err)[:200]})"
            return lookup
        if not isinstance(loaded, dict):
            lookup.problem = f"{place.path} is not a plugin status document"
            return lookup
        problem = shape_problem(loaded)
        if problem is not None:
            lookup.problem = f"{place.path} is not a plugin status document: {problem}"
            return lookup
        lookup.document = loaded
        lookup.pid_running = _pid_running(loaded.get("pid"))
        return lookup
    return lookup
