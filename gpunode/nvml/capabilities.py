"""The NVIDIA driver's capability files (/proc/driver/nvidia/capabilities/...): which /dev/nvidia-caps node
a MIG instance (or IMEX channel) maps to. The plugin's Allocate and the CDI spec both read them."""

from __future__ import annotations

from gpunode.errors import GpunodeError
from gpunode.host import Host


def cap_minor(host: Host, path: str) -> int | None:
    """The `DeviceFileMinor` of a capability file (its /dev/nvidia-caps/nvidia-capN), None when unreadable."""
    try:
        text = host.read_text_if_exists(path)
    except GpunodeError:
        return None
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "DeviceFileMinor" and value.strip().isdigit():
            return int(value.strip())
    return None
