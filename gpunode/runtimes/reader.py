"""Which service reads a configuration file gpunode changed: the one a restart is for.

A restart is pending (and planned by `--revert` and `down`) only for a file a running service reads. A
`--config` file elsewhere (a scratch copy, an image being prepared) is read by nobody: restarting docker for
it stops every container for nothing. The service is told from the file itself, not from what is installed
now: a k3s drop-in is k3s's even once k3s is gone, and then there is nothing to restart.

What each runtime reads, as doctor and the editors read it: dockerd its default /etc/docker/daemon.json;
containerd /etc/containerd/config.toml and the files it imports; CRI-O /etc/crio/crio.conf and every file in
/etc/crio/crio.conf.d; k3s / RKE2 / microk8s the files in their own directory (config, templates, drop-ins).
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.runtimes import containerd as ctd
from gpunode.runtimes import crio, docker, docker_editor
from gpunode.runtimes.containerd_units import SOCKETS, UNIT_DIRS, UNITS, unit_for

# The directory of each distribution that embeds containerd: its files are that distribution's alone.
_FLAVOUR_DIRS = (
    ("k3s", posixpath.dirname(ctd.K3S_DIR.rstrip("/"))),
    ("rke2", posixpath.dirname(ctd.RKE2_DIR.rstrip("/"))),
    ("microk8s", ctd.MICROK8S_DIR),
)


@dataclass(frozen=True)
class Reader:
    unit: str
    socket: str
    flavour: str = ""  # containerd: "containerd", "k3s", "rke2" or "microk8s"


def reader(host: Host, runtime: str, paths: Iterable[str]) -> tuple[Reader | None, str | None]:
    """The service that reads one of `paths` (host paths, canonical), or None and why no restart is needed."""
    paths = sorted(set(paths))
    named = ", ".join(paths) or "no file"
    if runtime == "docker":
        if host.canonical(docker.DAEMON_JSON) in paths:
            return Reader(docker_editor.UNIT, docker_editor.SOCKET), None
        return None, (
            f"{docker_editor.UNIT} does not read {named} (dockerd reads {docker.DAEMON_JSON}): no restart "
            "is needed for it"
        )
    if runtime == "crio":
        from gpunode.runtimes import crio_editor

        dropins = host.canonical(crio.DROPIN_DIR)
        if any(p == host.canonical(crio.CRIO_CONF) or posixpath.dirname(p) == dropins for p in paths):
            return Reader(crio_editor.UNIT, crio_editor.SOCKET), None
        return None, (
            f"{crio_editor.UNIT} does not read {named} (CRI-O reads {crio.CRIO_CONF} and "
            f"{crio.DROPIN_DIR}/*): no restart is needed for it"
        )
    return _containerd(host, paths, named)


def _containerd(host: Host, paths: list[str], named: str) -> tuple[Reader | None, str | None]:
    for flavour, directory in _FLAVOUR_DIRS:
        if any(p.startswith(host.canonical(directory) + "/") for p in paths):
            unit = _installed_unit(host, flavour)
            if unit is None:
                return None, (
                    f"{named} belongs to {flavour}, which is no longer installed (no "
                    f"{' or '.join(UNITS[flavour])}): there is nothing to restart"
                )
            return Reader(unit, SOCKETS[flavour], flavour), None
    if any(p in _read_by_containerd(host) or _imported(host, p) for p in paths):
        return Reader(unit_for(host, "containerd"), SOCKETS["containerd"], "containerd"), None
    return None, (
        f"containerd.service does not read {named} (containerd reads {ctd.DEFAULT_CONFIG} and the files "
        "it imports): no restart is needed for it"
    )


def _installed_unit(host: Host, flavour: str) -> str | None:
    """The distribution's unit when it is still installed: its unit file, else its directory (a node set
    up without a unit file of its own, as under --root)."""
    for unit in UNITS[flavour]:
        if any(host.is_file(f"{directory}/{unit}") for directory in UNIT_DIRS):
            return unit
    directory = dict(_FLAVOUR_DIRS)[flavour]
    config = {"k3s": ctd.K3S_CONFIG, "rke2": ctd.RKE2_CONFIG, "microk8s": ctd.MICROK8S_TEMPLATE}[flavour]
    if host.is_dir(directory) and host.exists(config):
        return UNITS[flavour][0]
    return None


def _read_by_containerd(host: Host) -> set[str]:
    return {host.canonical(ctd.DEFAULT_CONFIG)}


def _imported(host: Host, path: str) -> bool:
    """Whether containerd's own config.toml imports `path` (also once the file is gone)."""
    text = host.read_text_if_exists(ctd.DEFAULT_CONFIG)
    if not text:
        return False
    try:
        imports = ctd.parse_toml(text, ctd.DEFAULT_CONFIG).get("imports")
    except GpunodeError:
        return False
    if not isinstance(imports, list):
        return False
    base = posixpath.dirname(ctd.DEFAULT_CONFIG)
    for entry in imports:
        if not isinstance(entry, str):
            continue
        pattern = posixpath.normpath(posixpath.join(base, entry))
        if path == host.canonical(pattern) or ("*" in entry and fnmatch.fnmatchcase(path, pattern)):
            return True
    return False
