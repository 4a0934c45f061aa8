"""NVML discovery: the node's GPUs, MIG devices and topology as plain immutable data."""

from gpunode.nvml.discovery import discover, nvml_session, sysfs_pci_address, translate_nvml_error
from gpunode.nvml.model import Gpu, GpuPair, Inventory, MigDevice, MigMode, TopologyLevel

__all__ = [
    "Gpu",
    "GpuPair",
    "Inventory",
    "MigDevice",
    "MigMode",
    "TopologyLevel",
    "discover",
    "nvml_session",
    "sysfs_pci_address",
    "translate_nvml_error",
]
