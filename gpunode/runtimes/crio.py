"""Read CRI-O's configuration: crio.conf plus the crio.conf.d drop-ins, merged as CRI-O merges them.

CRI-O reads the main file, then every file under crio.conf.d (whatever its name, subdirectories too) in
lexical order; a later file overrides an earlier one option by option, but a runtime entry it defines
replaces the whole earlier entry of that name (its TOML decoder fills a fresh value for each map entry).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from gpunode.errors import ConfigError
from gpunode.host import Host
from gpunode.runtimes.containerd import parse_toml
from gpunode.runtimes.model import DEFAULT_NVIDIA_RUNTIME_NAME, RuntimeConfigState

CRIO_CONF = "/etc/crio/crio.conf"
DROPIN_DIR = "/etc/crio/crio.conf.d"
WRONG_DROPIN_DIR = (
    "/etc/crio/conf.d"  # where some nvidia-ctk releases wrote their drop-in; CRI-O never reads it
)
NVIDIA_RUNTIME_BINARY = "nvidia-container-runtime"
RUNTIMES_PATH = ("crio", "runtime", "runtimes")
# Go maps in CRI-O's config struct: their entries are replaced whole, everything else merges key by key.
MAP_TABLES = (RUNTIMES_PATH, ("crio", "runtime", "workloads"))
BACKUP_SUFFIXES = (".gpunode-bak", ".bak", "~", ".orig", ".rpmsave", ".rpmnew", ".dpkg-old", ".dpkg-dist")


def dropin_files(host: Host, directory: str = DROPIN_DIR) -> list[str]:
    """Every file under `directory` in the order CRI-O applies them (a depth-first walk, names sorted).

    Like CRI-O's own walk, a symlink to a directory is not descended into (which also ends link loops).
    """
    files: list[str] = []
    for name in host.listdir(directory):
        path = posixpath.join(directory, name)
        if host.is_dir(path) and not host.is_symlink(path):
            files.extend(dropin_files(host, path))
        elif host.is_file(path):
            files.append(path)
    return files


def merge_dropin(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    return _merge(base, overlay, ())


def _merge(base: Mapping[str, Any], overlay: Mapping[str, Any], at: tuple[str, ...]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        old = merged.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping) and at not in MAP_TABLES:
            merged[key] = _merge(old, value, (*at, key))
        else:
            merged[key] = value
    return merged


def configured_runtimes(doc: Mapping[str, Any], path: str) -> dict[str, Mapping[str, Any]]:
    current: Any = doc
    for key in RUNTIMES_PATH:
        current = current.get(key, {}) if isinstance(current, Mapping) else None
        if not isinstance(current, Mapping):
            raise ConfigError(f"{path}: {'.'.join(RUNTIMES_PATH)} must be a table of tables")
    runtimes: dict[str, Mapping[str, Any]] = {}
    for name, entry in current.items():
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{path}: crio.runtime.runtimes.{name} must be a table")
        runtimes[name] = entry
    return runtimes


def default_runtime(doc: Mapping[str, Any], runtimes: Mapping[str, Any]) -> str:
    """crio.runtime.default_runtime, else CRI-O's built-in default.

    The built-in default moved from runc to crun in CRI-O 1.31, and the version is not known from the
    files. Packaged CRI-O sets default_runtime explicitly (10-crio.conf), so this guess matters only for
    hand-written configs: a config that defines runc most likely comes from a runc-default CRI-O.
    """
    crio = doc.get("crio")
    runtime = crio.get("runtime") if isinstance(crio, Mapping) else None
    name = runtime.get("default_runtime") if isinstance(runtime, Mapping) else None
    if isinstance(name, str) and name:
        return name
    return "runc" if "runc" in runtimes else "crun"


def find_nvidia_runtime(runtimes: Mapping[str, Mapping[str, Any]], default: str) -> tuple[str, str] | None:
    """(name, runtime_path) of the entry running nvidia-container-runtime: the default one, else "nvidia",
    else the first."""
    found = {
        name: entry["runtime_path"]
        for name, entry in runtimes.items()
        if isinstance(entry.get("runtime_path"), str)
        and PurePosixPath(entry["runtime_path"]).name == NVIDIA_RUNTIME_BINARY
    }
    for preferred in (default, DEFAULT_NVIDIA_RUNTIME_NAME):
        if preferred in found:
            return preferred, found[preferred]
    return next(iter(found.items()), None)


def read_state(host: Host, path: str = CRIO_CONF, dropin_dir: str = DROPIN_DIR) -> RuntimeConfigState:
    files: list[str] = []
    merged: dict[str, Any] = {}
    for file in ([path] if host.is_file(path) else []) + dropin_files(host, dropin_dir):
        merged = merge_dropin(merged, parse_toml(host.read_text(file), file))
        files.append(file)
    runtimes = configured_runtimes(merged, path)
    default = default_runtime(merged, runtimes)
    nvidia = find_nvidia_runtime(runtimes, default)
    notes, problems = _notes(host, files, dropin_dir, runtimes, default)
    return RuntimeConfigState(
        runtime="crio",
        config_path=path,
        exists=bool(merged),
        runtimes=tuple(runtimes),
        default_runtime=default,
        nvidia_runtime=nvidia[0] if nvidia else None,
        nvidia_binary=nvidia[1] if nvidia else None,
        cdi_enabled=None,  # CRI-O has no switch: CDI is always on
        files=tuple(files),
        notes=tuple(notes),
        problems=tuple(problems),
    )


def _notes(
    host: Host, files: list[str], dropin_dir: str, runtimes: Mapping[str, Any], default: str
) -> tuple[list[str], list[str]]:
    """(notes, problems): problems are the notes that keep CRI-O from starting or change its config."""
    notes: list[str] = []
    problems: list[str] = []
    ignored = dropin_files(host, WRONG_DROPIN_DIR)
    if ignored:
        notes.append(
            f"CRI-O does not read {WRONG_DROPIN_DIR} (a known nvidia-ctk mistake): {', '.join(ignored)} "
            f"has no effect; drop-ins belong in {dropin_dir}"
        )
    backups = [f for f in files if f.startswith(f"{dropin_dir}/") and f.endswith(BACKUP_SUFFIXES)]
    if backups:
        problems.append(
            f"CRI-O applies every file in {dropin_dir}, backups included: {', '.join(backups)} "
            "override(s) the files sorted before them"
        )
    if default not in runtimes and default not in ("runc", "crun"):
        problems.append(
            f'default_runtime "{default}" has no [crio.runtime.runtimes.{default}] table: '
            "CRI-O refuses to start"
        )
    return notes + problems, problems
