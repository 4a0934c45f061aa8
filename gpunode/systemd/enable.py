"""Units enabled and disabled in a root that is not this machine's (`--root DIR`): by their links.

Under --root, nothing that acts runs on this machine (`Host.offline`): this machine's `systemctl` would
enable, start or reload units of this machine, and `systemctl --root=DIR` is still this machine's systemctl
(its version, its presets). Enabling a unit is a link, and only that: `systemctl enable` reads the unit's
[Install] section and links `/etc/systemd/system/<target>.wants/<unit>` to the unit file, so gpunode makes
exactly those links in DIR through the Host. Disabling removes the links that point at the unit file, as
`systemctl disable` does — only those, identified by their target, so an operator's own links to other
units are never touched. What only the running system can do (daemon-reload, start, stop) is returned as
next steps for the operator to run there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpunode.errors import GpunodeError, NotFound
from gpunode.host import Host

UNIT_DIR = "/etc/systemd/system"
# [Install] settings that make links, and the directory suffix each makes them in.
_LINKING = {"WantedBy": ".wants", "RequiredBy": ".requires"}


@dataclass(frozen=True)
class Link:
    path: str  # /etc/systemd/system/multi-user.target.wants/gpunode-cdi.path
    target: str  # /etc/systemd/system/gpunode-cdi.path
    action: str  # "create", "remove" or "unchanged"

    @property
    def changed(self) -> bool:
        return self.action != "unchanged"

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "target": self.target, "action": self.action}


def install_targets(unit_text: str) -> list[tuple[str, str]]:
    """(setting, target) of the unit's [Install] WantedBy= / RequiredBy= (space-separated, repeatable;
    an empty assignment resets the list, as in systemd)."""
    found: list[tuple[str, str]] = []
    section = ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if section != "Install" or not sep or key not in _LINKING:
            continue
        if not value.strip():
            found = [f for f in found if f[0] != key]
        found += [(key, target) for target in value.split()]
    return found


def enable_links(host: Host, unit: str, unit_text: str) -> list[Link]:
    """The links `systemctl enable UNIT` makes for this unit text, each marked create or unchanged."""
    target = f"{UNIT_DIR}/{unit}"
    links = []
    for key, wanted_by in install_targets(unit_text):
        path = f"{UNIT_DIR}/{wanted_by}{_LINKING[key]}/{unit}"
        action = "unchanged" if host.link_target(path) == target else "create"
        links.append(Link(path, target, action))
    return links


def is_enabled(host: Host, unit: str, unit_text: str) -> bool:
    links = enable_links(host, unit, unit_text)
    return bool(links) and not any(link.changed for link in links)


def disable_links(host: Host, unit: str) -> list[Link]:
    """The links in /etc/systemd/system/*.wants and *.requires that point at the unit file (what
    `systemctl disable UNIT` removes)."""
    target = f"{UNIT_DIR}/{unit}"
    if not host.is_dir(UNIT_DIR):
        return []
    links = []
    for directory in sorted(host.listdir(UNIT_DIR)):
        if not directory.endswith(tuple(_LINKING.values())):
            continue
        path = f"{UNIT_DIR}/{directory}/{unit}"
        if host.link_target(path) == target:
            links.append(Link(path, target, "remove"))
    return links


def apply(host: Host, links: Sequence[Link]) -> None:
    for link in links:
        if link.action == "create":
            host.make_symlink(link.path, link.target)
        elif link.action == "remove":
            host.remove_symlink(link.path, link.target)


def describe(root: str, links: Sequence[Link], steps: Sequence[Sequence[str]], *, done: bool) -> list[str]:
    """The lines that tell the operator which links were made or removed (or would be, `done` False) and
    what is left to run on the system in the root."""
    verbs = {"create": ("would link", "linked"), "remove": ("would remove", "removed")}
    lines = [f"{verbs[link.action][done]} {link.path} -> {link.target}" for link in links if link.changed]
    if steps:
        commands = " && ".join(" ".join(argv) for argv in steps)
        lines.append(
            f"next, on the system in {root} (nothing is run on this machine under --root; a boot of that "
            f"system starts what is enabled): {commands}"
        )
    return lines


def require_program(host: Host, executable: str, what: str) -> None:
    """Under --root, a unit's `ExecStart=` must name a program the system in the root has: the path is this
    machine's gpunode, which the root need not hold (a unit naming nothing fails there with 203/EXEC)."""
    if not host.offline:
        return
    import stat

    try:
        st = host.path(executable).stat()
        runnable = stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)
    except (OSError, GpunodeError):  # missing, a link loop, a link leaving the root
        runnable = False
    if not runnable:
        raise NotFound(
            f"{what} would write ExecStart={executable} into {host.root}, but {host.root}{executable} is not "
            "an executable file: the unit would fail there",
            f"install gpunode inside {host.root} at {executable} (./install.sh on that system), or run "
            f"`{what}` on the system in {host.root} itself; then run this again",
        )
