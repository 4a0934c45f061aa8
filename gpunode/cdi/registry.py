"""Every CDI spec the node's runtimes read: /etc/cdi (static) and /var/run/cdi (dynamic), *.yaml and *.json.

The runtimes' CDI library reads both directories; a device defined in the dynamic one wins over the same
device in the static one, and two files in the same directory defining the same device are a conflict
that makes the runtime drop that device ("unresolvable CDI devices" for every pod asking for it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from gpunode.cdi import spec as cdispec
from gpunode.cdi.generate import SPEC_DIRS
from gpunode.errors import GpunodeError
from gpunode.host import Host

log = logging.getLogger("gpunode.cdi")


@dataclass(frozen=True)
class SpecFile:
    path: str
    priority: int  # the index of its directory in SPEC_DIRS: higher wins
    kind: str | None
    devices: tuple[str, ...]
    document: dict[str, Any] | None
    problems: tuple[str, ...] = field(default=())  # why a runtime would drop the whole file


@dataclass(frozen=True)
class ListedDevice:
    name: str  # fully qualified: vendor/class=name
    path: str  # the file that defines it
    state: str  # "ok", "shadowed" (a later directory wins), "conflict" (dropped by the runtime)
    detail: str | None = None


# The spec directories, in rising priority, where the runtime is configured to read others (containerd's
# cdi_spec_dirs, CRI-O's cdi_spec_dirs): colon-separated, as the runtime's own list.
SPEC_DIRS_ENV = "GPUNODE_CDI_SPEC_DIRS"


def spec_dirs(host: Host) -> tuple[str, ...]:
    value = host.env.get(SPEC_DIRS_ENV, "")
    dirs = tuple(d.rstrip("/") or "/" for d in value.split(":") if d.startswith("/"))
    return dirs or SPEC_DIRS


def read_specs(host: Host, directories: tuple[str, ...] | None = None) -> list[SpecFile]:
    files: list[SpecFile] = []
    seen: set[str] = set()
    for priority, directory in enumerate(directories or spec_dirs(host)):
        try:
            names = host.listdir(directory)
        except GpunodeError:
            continue
        for name in names:
            if not name.endswith((".yaml", ".json")) or name.startswith("."):
                continue  # gpunode's own temp files start with a dot; runtimes read only these suffixes
            path = f"{directory.rstrip('/')}/{name}"
            try:
                canonical = host.canonical(path)
            except (GpunodeError, OSError, ValueError):  # a link loop: _read_one says what it is
                canonical = path
            if canonical in seen:  # /var/run is /run: one file, read once
                continue
            seen.add(canonical)
            files.append(_read_one(host, path, priority))
    return files


def _read_one(host: Host, path: str, priority: int) -> SpecFile:
    """One file as the runtimes see it. Any file can be here (another tool's, a broken one, a FIFO, a huge
    one): whatever it is, it becomes a SpecFile, with problems when the runtimes would skip it. The Host's
    reader refuses what is not a regular file, more than 8 MiB or not UTF-8; parse() bounds the rest."""
    try:
        text = host.read_text(path)
        doc = cdispec.parse(text, path)
    except GpunodeError as err:
        return SpecFile(path, priority, None, (), None, (err.message,))
    problems = tuple(cdispec.structure_problems(doc))
    kind = doc.get("kind") if isinstance(doc.get("kind"), str) else None
    listed: list[Any] = doc["devices"] if isinstance(doc.get("devices"), list) else []
    devices = tuple(d["name"] for d in listed if isinstance(d, dict) and isinstance(d.get("name"), str))
    return SpecFile(path, priority, kind, devices, doc, problems)


_warned: set[tuple[str, str, tuple[str, ...]]] = set()  # (root, path, problems) already logged


def warn_skipped(host: Host, files: list[SpecFile]) -> None:
    """One warning line for each file the runtimes skip, as containerd and CRI-O log one: the plugin reads
    the directories at start and on every re-discovery, and says it again only when the problem changes."""
    for f in files:
        key = (str(host.root), f.path, f.problems)
        if f.problems and key not in _warned:
            _warned.add(key)
            more = f" (and {len(f.problems) - 3} more problems)" if len(f.problems) > 3 else ""
            log.warning(
                "CDI spec %s is skipped, as the runtimes skip it: %s%s",
                cdispec.one_line(f.path),
                cdispec.one_line("; ".join(f.problems[:3]), 600),
                more,
            )


def list_devices(files: list[SpecFile]) -> list[ListedDevice]:
    """Each device of each readable file, with what the runtime makes of it."""
    by_name: dict[str, list[SpecFile]] = {}
    for f in files:
        if f.problems or f.kind is None:
            continue
        for device in f.devices:
            by_name.setdefault(cdispec.qualified(f.kind, device), []).append(f)
    listed: list[ListedDevice] = []
    for name, holders in by_name.items():
        top = max(h.priority for h in holders)
        winners = [h for h in holders if h.priority == top]
        for holder in holders:
            if holder.priority < top:
                listed.append(
                    ListedDevice(name, holder.path, "shadowed", f"{winners[0].path} defines it too and wins")
                )
            elif len(winners) > 1:
                others = ", ".join(w.path for w in winners if w is not holder)
                listed.append(ListedDevice(name, holder.path, "conflict", f"also defined in {others}"))
            else:
                listed.append(ListedDevice(name, holder.path, "ok"))
    return listed


def unresolvable(host: Host, kind: str, names: list[str]) -> list[str]:
    """Those of `names` (device names of `kind`) that no valid spec defines, or that only a conflict
    defines: what a runtime would answer with "unresolvable CDI devices"."""
    files = read_specs(host)
    warn_skipped(host, files)
    resolved = {d.name for d in list_devices(files) if d.state == "ok"}
    return [n for n in names if cdispec.qualified(kind, n) not in resolved]
