"""`gpunode dra run` as a Kubernetes DaemonSet: the manifests `gpunode dra manifest` prints.

Built with the device plugin's DaemonSet parts (gpunode/plugin/manifest.py: labels, Namespace, the
container's security context, the in-cluster kubeconfig, YAML), so the two forms stay alike. What differs:

- kubelet reaches the driver through the paths it is told at registration, so kubelet's plugins and
  plugins_registry directories, and /var/run/cdi where the claims' CDI specs go (the runtime reads them
  there), are mounted at the same paths in the container as on the host;
- the CDI specs name the driver's files as the host has them, so the driver root too is mounted at its own
  path, which therefore cannot be the host's `/` (that is for `gpunode dra install`, on the host);
- the driver talks to the API (its ResourceSlices, the claims it prepares, its Node for the slices' owner):
  a ServiceAccount with exactly those verbs, as a kubeconfig in a ConfigMap (`KUBECONFIG`). A Node's own
  credentials would be narrower (the Node authorizer allows only its node's slices); RBAC cannot say "this
  pod's node", so the ClusterRole covers every node's slices;
- the DeviceClasses (gpunode/dra/classes.py) travel with it, unless left out.

The Helm chart (deploy/helm/gpunode-device-plugin, `dra.enabled`) renders the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpunode.dra import DEFAULT_DRIVER
from gpunode.dra.classes import check_driver, device_classes
from gpunode.errors import UsageError
from gpunode.plugin import manifest as pm

NAME = "gpunode-dra-driver"
CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding", "DeviceClass", "Namespace")
NAMESPACE = pm.NAMESPACE
IMAGE = pm.IMAGE  # the same image: its entry point is the plugin, so the DaemonSet names the command
COMMAND = ["gpunode", "dra", "run"]
# kubelet's directories, at the same paths in the container (the sockets' paths are what kubelet dials).
PLUGINS_DIR = "/var/lib/kubelet/plugins"
REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
CDI_DIR = "/var/run/cdi"
# The GPU Operator's driver container's root: a driver root a container can mount at its own path.
DRIVER_ROOT = "/run/nvidia/driver"
CONFIG_DIR = pm.CONFIG_DIR
KUBECONFIG_FILE = f"{CONFIG_DIR}/kubeconfig"
STATUS_DIR = "/run/gpunode"
STATUS_FILE = f"{STATUS_DIR}/dra.json"
# Exactly what `dra run` asks of the API (gpunode/dra/driver.py's publisher, prepare.py's claim GET, the
# Node read for the slices' owner reference).
RULES: tuple[dict[str, list[str]], ...] = (
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": ["create", "get", "list", "watch", "update", "patch", "delete", "deletecollection"],
    },
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
)


def driver_root_path(path: str) -> str:
    """--driver-root as the DaemonSet mounts it (at the same path); UsageError for what it cannot mount."""
    normal = pm.normalised(path)
    if normal is None:
        raise UsageError(
            f"dra manifest: --driver-root {path!r} is not an absolute path without '..'",
            f"give the driver's root as the host has it, e.g. {DRIVER_ROOT}",
        )
    mounts = (PLUGINS_DIR, REGISTRY_DIR, CDI_DIR, CONFIG_DIR, STATUS_DIR)
    if (
        normal == "/"
        or any(pm.under(normal, d) for d in (*pm.PROGRAM_DIRS, "/etc"))
        or any(pm.under(normal, m) or pm.under(m, normal) for m in mounts)
    ):
        # Mounted at its own path, "/" would cover the container's whole file system, a system
        # directory the image's own files (Python, gpunode), and one around or inside another volume
        # would share its path; the CDI specs must name host paths, so it cannot be mounted elsewhere.
        raise UsageError(
            f"dra manifest: --driver-root {normal}: the container mounts the driver root at the path the "
            "host has it (the claims' CDI specs name those paths), where it would hide the container's own "
            "files or another of its volumes",
            "with the driver installed on the host, run the driver there (`gpunode dra install`); with "
            f"the GPU Operator's driver container, give {DRIVER_ROOT}",
        )
    return normal


@dataclass(frozen=True)
class DraManifestOptions:
    namespace: str = NAMESPACE
    image: str = IMAGE
    driver: str = DEFAULT_DRIVER
    driver_root: str = DRIVER_ROOT
    classes: bool = True  # the DeviceClasses as objects of the output
    extended_resource: bool = True  # the gpu class's extendedResourceName: nvidia.com/gpu


def objects(options: DraManifestOptions) -> list[dict[str, Any]]:
    """Namespace, ServiceAccount, RBAC, ConfigMap, DaemonSet and the DeviceClasses, in the order
    `kubectl apply` needs."""
    check_driver(options.driver)
    driver_root = driver_root_path(options.driver_root)
    ns = options.namespace
    labels = pm.labels(NAME)
    out: list[dict[str, Any]] = [
        pm.namespace_object(ns, NAME),
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": NAME, "namespace": ns, "labels": labels},
            "automountServiceAccountToken": True,  # the driver's API credentials
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME, "labels": labels},
            "rules": [dict(rule) for rule in RULES],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": ns}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{NAME}-config", "namespace": ns, "labels": labels},
            "data": {"kubeconfig": pm.IN_CLUSTER_KUBECONFIG},
        },
        _daemonset(options, driver_root),
    ]
    if options.classes:
        out += device_classes(options.driver, extended_resource=options.extended_resource)
    return out


def _host_dir(name: str, path: str, type_: str = "DirectoryOrCreate") -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path, "type": type_}}


def _daemonset(options: DraManifestOptions, driver_root: str) -> dict[str, Any]:
    env = [
        # The pod's host name is the pod's: the pool and the slices' nodeName are the node's.
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "KUBECONFIG", "value": KUBECONFIG_FILE},
        {"name": "GPUNODE_DRA_DRIVER", "value": options.driver},
        {"name": "GPUNODE_DRA_DRIVER_ROOT", "value": driver_root},
        {"name": "GPUNODE_DRA_PLUGINS_DIR", "value": PLUGINS_DIR},
        {"name": "GPUNODE_DRA_REGISTRY_DIR", "value": REGISTRY_DIR},
        {"name": "GPUNODE_DRA_CDI_DIR", "value": CDI_DIR},
        {"name": "GPUNODE_DRA_STATUS_FILE", "value": STATUS_FILE},
    ]
    container = {
        "name": "dra-driver",
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(COMMAND),
        "env": env,
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": pm.security_context(),
        "volumeMounts": [
            {"name": "plugins", "mountPath": PLUGINS_DIR},
            {"name": "plugins-registry", "mountPath": REGISTRY_DIR},
            {"name": "cdi", "mountPath": CDI_DIR},
            {"name": "driver-root", "mountPath": driver_root, "readOnly": True},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "status", "mountPath": STATUS_DIR},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": NAME, "namespace": options.namespace, "labels": pm.labels(NAME, "dra-driver")},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": NAME}},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": pm.labels(NAME, "dra-driver")},
                "spec": {
                    "serviceAccountName": NAME,
                    "automountServiceAccountToken": True,
                    "priorityClassName": "system-node-critical",
                    "nodeSelector": dict(pm.NODE_SELECTOR),
                    "tolerations": [dict(t) for t in pm.TOLERATIONS],
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": [
                        _host_dir("plugins", PLUGINS_DIR),
                        _host_dir("plugins-registry", REGISTRY_DIR),
                        _host_dir("cdi", CDI_DIR),
                        _host_dir("driver-root", driver_root, "Directory"),
                        {"name": "config", "configMap": {"name": f"{NAME}-config"}},
                        {"name": "status", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                    ],
                },
            },
        },
    }


def manifests(options: DraManifestOptions) -> str:
    return pm.to_yaml(objects(options))
