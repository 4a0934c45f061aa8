"""A package manager for tests, for what cannot run here (dnf, yum, zypper) and for apt on a temp root:
it answers the commands gpunode runs and keeps the installed state where the real one would (dpkg's status
file under the root, `rpm -q` answers), installing the toolkit's programs too."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpunode.errors import CommandFailed
from gpunode.host import CommandResult
from gpunode.toolkit.managers import PACKAGES


@dataclass
class FakePackages:
    """A package manager that behaves like the real one for what gpunode does: refresh, install (pinned or
    newest), remove; the installed state is read back the real way (dpkg's status file, `rpm -q`)."""

    root: Path
    manager: str  # apt | dnf | yum | zypper
    newest: str = "1.17.8-1"
    installed: dict[str, str] = field(default_factory=dict)
    fail: dict[str, tuple[int, str]] = field(default_factory=dict)  # verb → (exit status, output)
    calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._write_dpkg_status()

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult:
        key = tuple(argv)
        if key[0] not in ("rpm", "apt-get", "dnf", "yum", "zypper"):
            # any other program is not installed on this node, as ScriptedRunner answers too
            raise CommandFailed(f"`{key[0]}` is not installed (not found on PATH)")
        if key[0] == "rpm":
            lines = [
                f"{p}\t{self.installed[p]}" if p in self.installed else f"package {p} is not installed"
                for p in PACKAGES
            ]
            missing = sum(p not in self.installed for p in PACKAGES)
            return CommandResult(key, missing, "\n".join(lines) + "\n", "")
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        self.calls.append(f"{prefix + ' ' if prefix else ''}{shlex.join(key)}")
        verb = next(a for a in key[1:] if not a.startswith("-") and a not in ("-y",))
        if verb in self.fail:
            status, output = self.fail[verb]
            return CommandResult(key, status, output, "")
        if verb in ("install", "downgrade"):
            for spec in (a for a in key if a.startswith(("nvidia-", "libnvidia-"))):
                name, version = self._split(spec)
                self.installed[name] = version or self.newest
        elif verb == "remove":
            for name in key[key.index("remove") + 1 :]:
                self.installed.pop(name, None)
        self._write_dpkg_status()
        self._write_programs()
        return CommandResult(key, 0, f"{verb}: done\n", "")

    def _split(self, spec: str) -> tuple[str, str | None]:
        if "=" in spec:
            name, _, version = spec.partition("=")
            return name, version
        for name in sorted(PACKAGES, key=len, reverse=True):
            if spec == name:
                return name, None
            if spec.startswith(name + "-"):
                return name, spec[len(name) + 1 :]
        raise AssertionError(spec)

    def _write_programs(self) -> None:
        # What nvidia-container-toolkit-base installs, so that doctor and `gpunode up` see it as real.
        version = self.installed.get("nvidia-container-toolkit-base", "").split("-")[0]
        for program, what in (
            ("nvidia-ctk", "NVIDIA Container Toolkit CLI"),
            ("nvidia-container-runtime", "NVIDIA Container Runtime"),
        ):
            path = self.root / "usr/bin" / program
            if version:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"#!/bin/sh\necho '{what} version {version}'\n")
                path.chmod(0o755)
            elif path.exists():
                path.unlink()

    def _write_dpkg_status(self) -> None:
        if self.manager != "apt":
            return
        other = "Package: bash\nStatus: install ok installed\nVersion: 5.2.15-2+b7\n"
        gone = "Package: libnvidia-container1\nStatus: deinstall ok config-files\nVersion: 1.10.0-1\n"
        paragraphs = [other] + [
            f"Package: {p}\nStatus: install ok installed\nArchitecture: amd64\nVersion: {v}\n"
            f"Description: test\n a continuation line: Version: 0\n"
            for p, v in self.installed.items()
        ]
        if "libnvidia-container1" not in self.installed:
            paragraphs.append(gone)  # removed, config files kept: not installed
        status = self.root / "var/lib/dpkg/status"
        status.parent.mkdir(parents=True, exist_ok=True)
        status.write_text("\n".join(paragraphs))
