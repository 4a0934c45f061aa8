"""A driver installed under another root (e.g. /run/nvidia/driver by NVIDIA's driver container).

pynvml loads `libnvidia-ml.so.1` by soname; loading the library from the driver root first, by absolute
path and with RTLD_GLOBAL, makes that later load resolve to it.
"""

from __future__ import annotations

import ctypes
import logging
import posixpath

from gpunode.errors import NvmlLibraryNotFound
from gpunode.host import Host

log = logging.getLogger("gpunode.plugin")

LIBRARY = "libnvidia-ml.so.1"
# Where distributions and NVIDIA's driver container put the library.
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib64",
    "/lib",
)

_preloaded: dict[str, ctypes.CDLL] = {}


def find_nvml_library(host: Host, driver_root: str) -> str | None:
    """The real path of libnvidia-ml.so.1 under the driver root, or None."""
    for directory in LIBRARY_DIRS:
        candidate = posixpath.join(driver_root, directory.lstrip("/"), LIBRARY)
        if host.exists(candidate):
            return str(host.path(candidate))
    return None


def preload_nvml(host: Host, driver_root: str) -> str | None:
    """Load NVML from the driver root (no-op for "/": the loader's normal search is right there)."""
    if driver_root == "/":
        return None
    path = find_nvml_library(host, driver_root)
    if path is None:
        raise NvmlLibraryNotFound(
            f"driver-root {driver_root}: no {LIBRARY} under it (looked in "
            + ", ".join(posixpath.join(driver_root, d.lstrip("/")) for d in LIBRARY_DIRS)
            + ")",
            "point driver-root at the directory the driver is installed under (NVIDIA's driver container "
            "uses /run/nvidia/driver), or leave it at / for a driver installed on the host",
        )
    if path not in _preloaded:
        try:
            _preloaded[path] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise NvmlLibraryNotFound(
                f"driver-root {driver_root}: {path} could not be loaded: {exc}",
                "check that the driver under driver-root matches this machine's architecture",
            ) from None
        log.info("NVML loaded from %s", path)
    return path
