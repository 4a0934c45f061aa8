"""Read-only probes of a runtime's own program (`--version`, `dockerd --validate`): which binary, and where.

The rule, with and without --root: the program that answers is the one that reads the files, and under
--root gpunode executes no program at all. On the real root a probe runs the installed program. Under
--root R, this machine's programs do not read R's files, and R's own binaries are not to be run here (an
image being inspected may be untrusted: running its binaries as root on this machine is a door). So a
version is read from what R's files say where that is cheap and safe — Debian's package database,
R/var/lib/dpkg/status, read through the Host (regular file, size cap) — and is otherwise "version unknown
(--root: gpunode runs no program of the image)"; the caller then decides the way its docstring says
(the conservative choice), never by asking a program.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpunode.errors import CommandFailed, GpunodeError
from gpunode.host import CommandResult, Host

DPKG_STATUS = "/var/lib/dpkg/status"
NOT_RUN = "--root: gpunode runs no program of the image"
# The Debian packages that install each program (the first one installed wins).
PACKAGES: dict[str, tuple[str, ...]] = {
    "containerd": ("containerd", "containerd.io"),
    "dockerd": ("docker-ce", "docker.io", "moby-engine"),
    "crio": ("cri-o",),
    "k3s": ("k3s",),
    "rke2": ("rke2",),
    "nvidia-ctk": ("nvidia-container-toolkit",),
    "nvidia-container-runtime": ("nvidia-container-toolkit",),
    "nvidia-container-toolkit": ("nvidia-container-toolkit",),
}


@dataclass(frozen=True)
class Probe:
    argv: tuple[str, ...] | None  # what runs; None: nothing to run (under --root, never anything)
    where: str  # where gpunode looked, for the operator


def locate(host: Host, program: str) -> Probe:
    """How to run `program` as the system under the Host's root has it. `program` is a name looked up on
    PATH, or an absolute host path (k3s's embedded containerd)."""
    if host.commands_reach_root:
        if program.startswith("/"):
            found = program if host.is_file(program) else None
            where = "this machine" if host.is_real_root else f"{host.root}"
            return Probe((program,) if found else None, f"{program} on {where}" if found else f"no {program}")
        # The runner finds the program as Host.which would (PATH, then the sbin directories).
        return Probe((program,), f"{program} on this machine" if host.is_real_root else program)
    name = program.rsplit("/", 1)[-1]
    known = package_version(host, name)
    if known is not None:
        package, version = known
        return Probe(
            None, f"{name} {version} per {DPKG_STATUS} in {host.root} (package {package}; {NOT_RUN})"
        )
    found = program if program.startswith("/") and host.is_file(program) else None
    if not program.startswith("/"):
        found = host.which(program)
    if found is None:
        return Probe(None, f"no {name} in {host.root}")
    return Probe(None, f"{found} in {host.root}: version unknown ({NOT_RUN})")


def run(host: Host, program: str, args: Sequence[str], *, timeout: float) -> tuple[CommandResult | None, str]:
    """(the result, or None when there is nothing to run or it could not start; where it looked).

    Under --root nothing runs: a `--version` probe is answered from R's package database when it knows the
    program's package, as `<program> version <upstream version>` (what the callers' parsers read); any other
    probe (`dockerd --validate`) has no answer."""
    probe = locate(host, program)
    if probe.argv is None:
        if not host.commands_reach_root and list(args) == ["--version"]:
            known = package_version(host, program.rsplit("/", 1)[-1])
            if known is not None:
                text = f"{program.rsplit('/', 1)[-1]} version {upstream(known[1])}\n"
                return CommandResult((DPKG_STATUS,), 0, text, ""), probe.where
        return None, probe.where
    try:
        return host.run([*probe.argv, *args], timeout=timeout), probe.where
    except CommandFailed:
        return None, probe.where


def upstream(version: str) -> str:
    """A Debian version's upstream part: `5:28.0.1-1~debian.12` → `28.0.1`, `1.6.20~ds1-1+deb12u3` →
    `1.6.20~ds1`."""
    version = version.split(":", 1)[1] if re.match(r"[0-9]+:", version) else version
    return version.rsplit("-", 1)[0] if "-" in version else version


def package_version(host: Host, program: str) -> tuple[str, str] | None:
    """(package, version) of the installed Debian package that provides `program`, from R's dpkg status
    file; None when there is no such file, package or version (another distribution: unknown)."""
    packages = PACKAGES.get(program)
    if not packages:
        return None
    try:
        text = host.read_text_if_exists(DPKG_STATUS)
    except GpunodeError:  # unreadable, too large, not UTF-8: unknown, as with no database
        return None
    if not text:
        return None
    found: dict[str, str] = {}
    for stanza in text.split("\n\n"):
        fields = dict(_fields(stanza))
        name = fields.get("package")
        if name in packages and fields.get("status", "").endswith(" installed") and fields.get("version"):
            found[name] = fields["version"]
    for package in packages:
        if package in found and re.fullmatch(r"[0-9A-Za-z.+~:-]{1,100}", found[package]):
            return package, found[package]
    return None


def _fields(stanza: str) -> list[tuple[str, str]]:
    out = []
    for line in stanza.splitlines():
        if line[:1] in (" ", "\t") or ":" not in line:
            continue  # a continuation line (Description, Conffiles)
        key, value = line.split(":", 1)
        out.append((key.strip().lower(), value.strip()))
    return out
