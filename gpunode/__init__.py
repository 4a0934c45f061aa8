"""gpunode: turn a Linux machine with NVIDIA GPUs into a working Kubernetes GPU node."""

__version__ = "0.1.0"
