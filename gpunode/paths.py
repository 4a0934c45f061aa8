"""Well-known host paths and names, in one place so doctor, the plugin and the service agree."""

DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = f"{DEVICE_PLUGIN_DIR}/kubelet.sock"
# gpunode serves one socket per resource, "gpunode-<resource with / as ->.sock" (gpunode.plugin.devices).
PLUGIN_SOCKET_PREFIX = "gpunode-"
PLUGIN_SOCKET_NAME = "gpunode-nvidia.com-gpu.sock"
PLUGIN_SOCKET = f"{DEVICE_PLUGIN_DIR}/{PLUGIN_SOCKET_NAME}"
PLUGIN_SERVICE = "gpunode-device-plugin.service"
# The running plugin's registration state, for `gpunode plugin status`.
PLUGIN_STATUS_FILE = "/run/gpunode/plugin-status.json"
# NVIDIA's own device plugin (k8s-device-plugin) serves on this socket name.
NVIDIA_PLUGIN_SOCKET = f"{DEVICE_PLUGIN_DIR}/nvidia-gpu.sock"

KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"
KUBEADM_FLAGS = "/var/lib/kubelet/kubeadm-flags.env"
KUBELET_DEFAULTS = ("/etc/default/kubelet", "/etc/sysconfig/kubelet")

NVIDIA_DRIVER_VERSION = "/proc/driver/nvidia/version"
NVIDIA_MODULE = "/sys/module/nvidia"
NOUVEAU_MODULE = "/sys/module/nouveau"
