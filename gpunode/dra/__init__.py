"""Dynamic Resource Allocation: gpunode as a kubelet DRA plugin (issue 25); `api/` holds the protocols."""

# NVIDIA's driver name: DeviceClasses and claims written for its driver select these devices. Here, in the
# package's light __init__, so that doctor can name it without importing the driver's modules.
DEFAULT_DRIVER = "gpu.nvidia.com"
