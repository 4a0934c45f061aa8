"""The device plugin as a Kubernetes DaemonSet: the manifests `gpunode plugin manifest` prints.

One option table serves both forms: the settings a node's plugin resolves (file, environment, flags) become
the ConfigMap's `plugin.toml`, which the container reads with `--config` semantics (GPUNODE_PLUGIN_CONFIG).
Settings that name host paths or one node are the DaemonSet's business instead: `driver-root` and
`socket-dir` become hostPath volumes, mounted at fixed paths in the container, and the container is told
those paths by environment (which wins over the file); `dev-root` is `/` there, so device specs name the
host's /dev, which is where kubelet and the runtime look; `node-name` is each pod's node (the downward
API); `events.kubeconfig` is a kubeconfig for the pod's ServiceAccount, kept in the ConfigMap.
deploy/ and the Helm chart in deploy/helm hold the same objects (tests/integration/test_daemonset.py keeps
the three equal).

PyYAML is imported only here, when the manifests are printed.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpunode import __version__
from gpunode.errors import ConfigError, UsageError
from gpunode.plugin.config import OPTIONS, PluginConfig, value_of

NAME = "gpunode-device-plugin"
NAMESPACE = "gpunode-system"
IMAGE = f"{NAME}:{__version__}"  # built from the checkout's Containerfile; no registry publishes it
# Where the container finds what the hostPath volumes bring in, and where it keeps its status.
CONTAINER_SOCKET_DIR = "/var/lib/kubelet/device-plugins"
CONTAINER_DRIVER_ROOT = "/driver-root"
CONFIG_DIR = "/etc/gpunode"
CONFIG_FILE = f"{CONFIG_DIR}/plugin.toml"
STATUS_DIR = "/run/gpunode"
STATUS_FILE = f"{STATUS_DIR}/plugin-status.json"
# Settings the DaemonSet sets itself: they name paths on the host (not in the container) or one node.
HOST_PATH_OPTIONS = ("driver_root", "dev_root", "socket_dir", "events_kubeconfig", "node_name")
KUBECONFIG_FILE = f"{CONFIG_DIR}/kubeconfig"
# The pod's ServiceAccount as a kubeconfig: the plugin's Event reporter reads a kubeconfig file (on a node,
# kubelet's own); in the pod it is this one, with the token and CA kubelet mounts for the ServiceAccount.
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
IN_CLUSTER_KUBECONFIG = f"""\
apiVersion: v1
kind: Config
clusters:
- name: in-cluster
  cluster:
    server: https://kubernetes.default.svc
    certificate-authority: {SERVICE_ACCOUNT}/ca.crt
users:
- name: gpunode-device-plugin
  user:
    tokenFile: {SERVICE_ACCOUNT}/token
contexts:
- name: gpunode-device-plugin
  context:
    cluster: in-cluster
    user: gpunode-device-plugin
current-context: gpunode-device-plugin
"""
# GPU feature discovery's label, which `gpunode node advertise` also sets.
NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
TOLERATIONS: tuple[dict[str, str], ...] = (
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "CriticalAddonsOnly", "operator": "Exists"},
)


# Directories of the image the status file's emptyDir must not be mounted on or above: the OS, Python and
# gpunode itself (/opt/gpunode, the Containerfile's), and the kernel's file systems. Below the first group
# it may go (/var/run/gpunode, /etc/gpunode-status); below the second it would hide what the plugin runs.
SYSTEM_DIRS = ("/etc", "/var", "/opt", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/proc", "/sys", "/dev")
PROGRAM_DIRS = ("/opt/gpunode", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/proc", "/sys", "/dev")


def under(path: str, directory: str) -> bool:
    """`path` is `directory` or below it (both normalised, absolute)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def normalised(path: str) -> str | None:
    """An absolute path without `..`, `.` and repeated slashes, or None for a relative one or one with `..`
    (which kubelet would resolve against whatever is mounted where, and the API refuses in a hostPath)."""
    parts = path.split("/")
    if not path.startswith("/") or ".." in parts:
        return None
    return "/" + "/".join(p for p in parts if p not in ("", "."))


def status_file_path(path: str) -> str:
    """--status-file, normalised; UsageError where its directory (an emptyDir mounted over whatever the
    image has there) would be `/`, would cover or sit inside another of the container's mounts (two
    volumes on one path, or the status volume hiding the socket directory), or would hide the system."""
    normal = normalised(path)
    fix = "give a file in a directory of its own, e.g. /run/gpunode/plugin-status.json"
    if normal is None or path.endswith("/") or normal == "/":
        raise UsageError(
            f"plugin manifest: --status-file {path!r} is not an absolute file path without '..'", fix
        )
    directory = posixpath.dirname(normal)
    mounts = {
        CONTAINER_SOCKET_DIR: "the socket directory",
        CONTAINER_DRIVER_ROOT: "the driver root",
        CONFIG_DIR: "the config directory",
        # kubelet's, with events on (here or in the config): refused either way, it would be with them.
        SERVICE_ACCOUNT: "the service account token",
    }
    for mount, what in mounts.items():
        if under(directory, mount) or under(mount, directory):
            raise UsageError(
                f"plugin manifest: --status-file {path!r}: its directory {directory} (a volume of its own) "
                f"{'is' if directory == mount else 'is inside' if under(directory, mount) else 'covers'} "
                f"{mount}, {what}'s mount",
                fix,
            )
    if (
        directory == "/"
        or any(under(d, directory) for d in SYSTEM_DIRS)
        or any(under(directory, d) for d in PROGRAM_DIRS)
    ):
        raise UsageError(
            f"plugin manifest: --status-file {path!r}: its directory {directory} would be an empty volume "
            "mounted over the image's own files",
            fix,
        )
    return normal


def host_paths(config: PluginConfig) -> tuple[str, str]:
    """The driver root and socket directory as hostPath volumes take them: normalised, without `..` (the
    API refuses it), and the socket directory (mounted writable) not the host's root; ConfigError naming
    the setting and where it came from."""
    out = []
    for name, value in (("driver_root", config.driver_root), ("socket_dir", config.socket_dir)):
        key = name.replace("_", "-")
        where = f"{key} ({config.origins.get(name, 'default')})"
        normal = normalised(value)
        if normal is None:
            raise ConfigError(
                f"{where}: {value!r} has a '..' component, which a hostPath volume may not have",
                f"give {key} as an absolute path without '..'",
            )
        if name == "socket_dir" and normal == "/":
            raise ConfigError(
                f"{where}: '/' would mount the host's whole file system, writable, as kubelet's socket "
                "directory",
                "give kubelet's device-plugins directory, e.g. /var/lib/kubelet/device-plugins",
            )
        out.append(normal)
    return out[0], out[1]


@dataclass(frozen=True)
class ManifestOptions:
    namespace: str = NAMESPACE
    image: str = IMAGE
    # Host paths: the node's own settings (driver-root, socket-dir) as the local config resolves them.
    driver_root: str = "/"
    socket_dir: str = CONTAINER_SOCKET_DIR
    status_file: str = STATUS_FILE  # in the container, on an emptyDir
    # Events on the Node and its GPUHealthy condition (issue 18): their RBAC and credentials, and the
    # reporter turned on; off: no API access at all (unless the config turns events on).
    events: bool = False


def config_toml(config: PluginConfig) -> str:
    """The settings that did not come from a default, as the TOML file the container reads; host paths
    left out (the DaemonSet sets them)."""
    import tomlkit

    document = tomlkit.document()
    document.add(tomlkit.comment("gpunode device plugin config (gpunode plugin run --config)"))
    tables: dict[str, Any] = {}
    for option in OPTIONS:
        if option.name in HOST_PATH_OPTIONS or config.origins.get(option.name, "default") == "default":
            continue
        table, dot, key = option.key.rpartition(".")
        value = value_of(config, option)
        if dot:
            if table not in tables:
                tables[table] = tomlkit.table()
            tables[table].add(key, value)
        else:
            document.add(key, value)
    for name, table_ in tables.items():
        document.add(name, table_)
    return tomlkit.dumps(document)


def labels(name: str, component: str | None = None) -> dict[str, str]:
    """The labels of every object of a gpunode DaemonSet form (the plugin's and `dra manifest`'s)."""
    out = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "gpunode"}
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def _labels(component: str | None = None) -> dict[str, str]:
    return labels(NAME, component)


def namespace_object(namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": namespace,
            "labels": {
                **labels(name),
                # hostPath volumes are refused by the baseline and restricted Pod Security levels.
                "pod-security.kubernetes.io/enforce": "privileged",
            },
        },
    }


def security_context() -> dict[str, Any]:
    """The container's: root owns kubelet's directories; nothing else of root's is kept."""
    return {
        "runAsUser": 0,
        "runAsGroup": 0,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def objects(options: ManifestOptions, toml_text: str) -> list[dict[str, Any]]:
    """Namespace, ServiceAccount, (RBAC), ConfigMap and DaemonSet, in the order `kubectl apply` needs."""
    ns = options.namespace
    data = {"plugin.toml": toml_text}
    if options.events:
        data["kubeconfig"] = IN_CLUSTER_KUBECONFIG
    meta = {"name": NAME, "namespace": ns, "labels": _labels()}
    out: list[dict[str, Any]] = [
        namespace_object(ns, NAME),
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta,
            # The plugin talks to kubelet over a unix socket, not to the API: no token unless events are on.
            "automountServiceAccountToken": options.events,
        },
    ]
    if options.events:
        out += _rbac(ns)
    out.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{NAME}-config", "namespace": ns, "labels": _labels()},
            "data": data,
        }
    )
    out.append(_daemonset(options, toml_text))
    return out


def _rbac(namespace: str) -> list[dict[str, Any]]:
    # Exactly what the plugin's reporter (gpunode/kube/events.py) sends: core v1 Events about the Node
    # (POST, namespace default) and the GPUHealthy condition (GET the Node, then a JSON patch of
    # nodes/status guarded by the resourceVersion read).
    rules = [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
    ]
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME, "labels": _labels()},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": _labels()},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
    ]


def liveness_command(status_file: str) -> list[str]:
    """`plugin status` exits 0 only while the plugin is registered and its process alive (1 otherwise)."""
    return ["gpunode", "plugin", "status", "--status-file", status_file]


def _daemonset(options: ManifestOptions, toml_text: str) -> dict[str, Any]:
    status_dir = options.status_file.rsplit("/", 1)[0] or "/"
    env = [
        {"name": "GPUNODE_PLUGIN_CONFIG", "value": CONFIG_FILE},
        {"name": "GPUNODE_PLUGIN_STATUS_FILE", "value": options.status_file},
        {"name": "GPUNODE_SOCKET_DIR", "value": CONTAINER_SOCKET_DIR},
        {"name": "GPUNODE_DRIVER_ROOT", "value": CONTAINER_DRIVER_ROOT},
        # Device nodes are named as the host has them: kubelet and the runtime read these paths there.
        {"name": "GPUNODE_DEV_ROOT", "value": "/"},
        # The pod's host name is the pod's; the node's name is what Events and the condition need.
        {"name": "GPUNODE_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    # Said either way: the plugin's own default is on, with kubelet's kubeconfig, which a pod has not.
    env.append({"name": "GPUNODE_EVENTS_ENABLED", "value": "true" if options.events else "false"})
    if options.events:
        env.append({"name": "GPUNODE_EVENTS_KUBECONFIG", "value": KUBECONFIG_FILE})
    container = {
        "name": "device-plugin",
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "env": env,
        "resources": {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"memory": "256Mi"},
        },
        "securityContext": security_context(),
        "livenessProbe": {
            "exec": {"command": liveness_command(options.status_file)},
            # kubelet runs the probe, so kubelet is up when it fails: 3 misses in 90 s is a plugin that
            # cannot register (a kubelet restart costs it milliseconds).
            "initialDelaySeconds": 30,
            "periodSeconds": 30,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
        },
        "volumeMounts": [
            {"name": "device-plugins", "mountPath": CONTAINER_SOCKET_DIR},
            {"name": "driver-root", "mountPath": CONTAINER_DRIVER_ROOT, "readOnly": True},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "status", "mountPath": status_dir},
        ],
    }
    pod_labels = _labels("device-plugin")
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": NAME, "namespace": options.namespace, "labels": _labels("device-plugin")},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": NAME}},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    # A changed config rolls the pods (the container reads its file at start and on SIGHUP).
                    "annotations": {"gpunode.io/config-sha256": config_digest(toml_text)},
                },
                "spec": {
                    "serviceAccountName": NAME,
                    "automountServiceAccountToken": options.events,
                    "priorityClassName": "system-node-critical",
                    "nodeSelector": dict(NODE_SELECTOR),
                    "tolerations": [dict(t) for t in TOLERATIONS],
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "device-plugins",
                            "hostPath": {"path": options.socket_dir, "type": "DirectoryOrCreate"},
                        },
                        {
                            "name": "driver-root",
                            "hostPath": {"path": options.driver_root, "type": "Directory"},
                        },
                        {"name": "config", "configMap": {"name": f"{NAME}-config"}},
                        {"name": "status", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                    ],
                },
            },
        },
    }


def config_digest(toml_text: str) -> str:
    return hashlib.sha256(toml_text.encode()).hexdigest()


def to_yaml(items: Sequence[dict[str, Any]]) -> str:
    """A multi-document YAML stream, keys in the order they were built (as people read manifests), the
    config file as a literal block (readable, and diffable line by line)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return "".join(
        "---\n" + yaml.dump(item, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=110)
        for item in items
    )


def manifests(config: PluginConfig, options: ManifestOptions) -> str:
    """The manifests as YAML; a config that turns events on (explicitly: on a node they are on by default,
    with kubelet's credentials) gets their RBAC and credentials too."""
    if any(e.replicas > 1 for e in config.mps_resources):
        # The daemons need the driver's MPS programs and libraries, a mount namespace (CAP_SYS_ADMIN) and
        # mps.root shared with the pods: none of which this unprivileged container has.
        raise ConfigError(
            "mps.resources: the DaemonSet form does not run MPS control daemons",
            "run the plugin on the host for MPS (`gpunode plugin install`), or share with time-slicing",
        )
    explicit = config.origins.get("events_enabled", "default") != "default"
    if config.events_enabled and explicit and not options.events:
        options = replace(options, events=True)
    return to_yaml(objects(options, config_toml(config)))
