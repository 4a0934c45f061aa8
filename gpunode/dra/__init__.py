"""Dynamic Resource Allocation: gpunode as a kubelet DRA plugin (issue 25); `api/` holds the protocols."""
