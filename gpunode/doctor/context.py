"""What every doctor check shares: the Context (the host, NVML discovered once, service states read once)
and the small helpers more than one area uses."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from gpunode import paths
from gpunode.errors import NvmlError
from gpunode.host import Host
from gpunode.nvml.model import Inventory
from gpunode.services import service_states

VERSION_TIMEOUT = 5.0

GIB = 1024**3

# (name shown, binary, systemd unit)
RUNTIMES: tuple[tuple[str, str, str], ...] = (
    ("containerd", "containerd", "containerd.service"),
    ("docker", "dockerd", "docker.service"),
    ("crio", "crio", "crio.service"),
)

KUBELET_UNIT = "kubelet.service"


@dataclass
class Context:
    host: Host
    discover: Callable[[Host], Inventory]
    _inventory: Inventory | NvmlError | None = None
    _discovery_bug: Exception | None = None
    _services: dict[str, str | None] = field(default_factory=dict)
    # The built-in simulated node (`--simulate`) whose GPUs and driver stand in for NVML's, or None.
    simulated: str | None = None

    def inventory(self) -> Inventory | NvmlError:
        if self._discovery_bug is not None:
            raise self._discovery_bug  # discover once, even when it fails unexpectedly
        if self._inventory is None:
            try:
                self._inventory = self.discover(self.host)
            except NvmlError as exc:
                self._inventory = exc
            except Exception as exc:
                self._discovery_bug = exc
                raise
        return self._inventory

    def service(self, unit: str) -> str | None:
        if not self._services:
            units = [unit for _, _, unit in RUNTIMES] + [KUBELET_UNIT, paths.PLUGIN_SERVICE]
            self._services = service_states(self.host, units)
        return self._services.get(unit)

    @cached_property
    def embedded_containerd(self) -> str | None:
        return _embedded_containerd(self.host)

    @cached_property
    def has_kubelet(self) -> bool:
        return kubelet_present(self.host)

    def driver_module_loaded(self) -> bool:
        if self.simulated:
            from gpunode.plugin.simulate import driver_loaded

            # The host's own module says nothing about the simulated node's (a GPU-less box has none).
            return driver_loaded(self.simulated)
        return self.host.exists(paths.NVIDIA_MODULE) or self.host.exists(paths.NVIDIA_DRIVER_VERSION)


def simulated_tag(name: str) -> str:
    """What each finding made from a simulated node says, so none is taken for this host's."""
    return f"(simulated: {name})"


# -- operating system ----------------------------------------------------------------------------

_VERSION = re.compile(r"version\s+v?(\d+\.\d+\.\d+\S*)", re.IGNORECASE)


def program_version(host: Host, program: str) -> tuple[str | None, str | None]:
    """(host path, version) of a program; (None, None) when it is not installed."""
    path, version, _ = program_probe(host, program)
    return path, version


def program_probe(host: Host, program: str) -> tuple[str | None, str | None, str]:
    """(host path, version, where the version was asked) of a program; the path None when not installed.

    The rule of gpunode.runtimes.probe: on the real root the installed program is asked. Under --root R
    no program runs (neither this machine's, another release or absent, nor R's own, which may be
    untrusted): the version is what R's package database says, else unknown."""
    from gpunode.runtimes import probe

    path = host.which(program)
    if path is None:
        return None, None, f"no {program} in {host.root}"
    result, where = probe.run(host, path, ["--version"], timeout=VERSION_TIMEOUT)
    if result is None:
        return path, None, where
    match = _VERSION.search(result.stdout + "\n" + result.stderr)
    return path, match.group(1) if match else None, where


def _embedded_containerd(host: Host) -> str | None:
    """The service ("k3s", "rke2", "microk8s") whose own containerd runs here, or None."""
    from gpunode.runtimes.containerd import detect_location

    flavour = detect_location(host).flavour
    return None if flavour == "containerd" else flavour


def kubelet_present(host: Host) -> bool:
    """kubelet as a program, or embedded in k3s / RKE2 (which keep the usual /var/lib/kubelet)."""
    return any(host.which(p) for p in ("kubelet", "k3s", "rke2"))
