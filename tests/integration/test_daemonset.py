"""The DaemonSet form of the plugin: `gpunode plugin manifest`, deploy/ and the Helm chart in deploy/helm.

- Every object is validated against the Kubernetes API's own schemas (the OpenAPI documents of each
  release, as JSON Schema, shipped in the `kubernetes-validate` package), strict: an unknown field is an
  error, for every Kubernetes version the README names.
- The chart is rendered by Helm's own engine (Helm v4's Go SDK, through `helm-python-sdk`'s libhelm_c: the
  code `helm template` runs; not the `helm` CLI binary, which no PyPI or Debian package ships) and linted.
- The three forms are the same objects: deploy/ is `plugin manifest` with no config, and the chart rendered
  with values equal to a node's config gives what `plugin manifest` prints for that node, but for what Helm
  does its own way: the chart creates no Namespace (`helm install --create-namespace`), adds Helm's standard
  labels (the instance label in the selector too) and names its cluster-wide objects per namespace.
  The chart's own conventions and its values schema: tests/integration/test_helm_chart.py.
- The ConfigMap's plugin.toml, read by the plugin's own loader, gives the node's settings: one config
  serves the systemd service and the DaemonSet.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from gpunode.cli.main import main
from gpunode.host import Host
from gpunode.plugin import manifest as dm
from gpunode.plugin.config import OPTIONS, load_config, value_of
from tests import tomlread

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy/helm/gpunode-device-plugin"
DEPLOY = REPO / "deploy/gpunode-device-plugin.yaml"
README = REPO / "README.md"
# The Kubernetes versions the README names (its DaemonSet paragraph); test_readme_names_these keeps them so.
VERSIONS = [f"1.{minor}" for minor in range(28, 38)]
# What Helm adds to every object's labels, beyond `plugin manifest`'s.
HELM_LABELS = (
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
)
# The release `plugin manifest`'s objects correspond to: the same names, in the same namespace.
RELEASE = "gpunode-device-plugin"
NAMESPACE = "gpunode-system"

NODE_CONFIG = """\
mig-strategy = "mixed"
device-list-strategy = ["envvar", "cdi-annotations"]
driver-root = "/run/nvidia/driver"

[time-slicing]
rename-by-default = true
resources = [{name = "nvidia.com/gpu", replicas = 4, devices = [0, 1]}]

[health]
ignored-xids = [13, 31, 43]
recovery-quiet-period = 30.5
"""
# The same settings as chart values (GPUNODE_PLACEMENT comes from the node's environment in the CLI case).
NODE_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example/gpunode-device-plugin", "tag": "0.1.0-test"},
    "driverRoot": "/run/nvidia/driver",
    "events": {"enabled": True},
    "statusFile": "/run/dp/status.json",
    "config": {
        "mig-strategy": "mixed",
        "device-list-strategy": ["envvar", "cdi-annotations"],
        "time-slicing": {
            "rename-by-default": True,
            "placement": "packed",
            "resources": [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [0, 1]}],
        },
        "health": {"ignored-xids": [13, 31, 43], "recovery-quiet-period": 30.5},
    },
}


def plugin_manifest(root: Path, capsys: pytest.CaptureFixture[str], *args: str, **env: str) -> str:
    code = main(["plugin", "manifest", *args], host=Host(root=root, env=env))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def render_chart(
    values: dict[str, Any], *, name: str = RELEASE, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """The chart's objects as `helm template NAME CHART -n NAMESPACE` prints them (its values schema
    checked first, as there)."""
    with helm_python.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name=name, namespace=namespace, is_install=True)
    order = ["serviceaccount", "rbac", "configmap", "daemonset"]
    names = sorted(rendered, key=lambda p: order.index(Path(p).stem) if Path(p).stem in order else 99)
    return [d for path in names if path.endswith(".yaml") for d in documents(rendered[path])]


def validate(objects: list[dict[str, Any]]) -> None:
    for version in VERSIONS:
        for item in objects:
            try:
                kubernetes_validate.validate(item, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                where = ".".join(str(p) for p in err.path)
                raise AssertionError(
                    f"{item['kind']} on Kubernetes {version}: {where}: {err.message}"
                ) from None


def settings(toml_text: str) -> dict[str, Any]:
    """What the plugin makes of a config file: every option's value, by key (devices [0] and ["0"] alike)."""
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "plugin.toml").write_text(toml_text)
        config = load_config(Host(root=Path(root), env={}), config_path="/plugin.toml", env={})
    return {option.key: value_of(config, option) for option in OPTIONS}


def comparable(objects: list[dict[str, Any]], namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """The objects less what legitimately differs: the Namespace `plugin manifest` prints (Helm's
    --create-namespace makes it; test_helm_chart.py checks the chart has none), Helm's labels (in the
    selector too), the cluster-wide objects' names (the chart's carry the namespace), the TOML's layout
    (compared parsed), and the config digest (checked to be the digest of that same object's ConfigMap
    text)."""
    texts = [o["data"]["plugin.toml"] for o in objects if o["kind"] == "ConfigMap"]
    out = []
    for original in objects:
        if original["kind"] == "Namespace":
            assert original["metadata"]["name"] == namespace
            continue
        item = yaml.safe_load(yaml.safe_dump(original))  # a deep copy
        for meta in (item["metadata"], item.get("spec", {}).get("template", {}).get("metadata", {})):
            for label in HELM_LABELS:
                meta.get("labels", {}).pop(label, None)
        if item["kind"] == "DaemonSet":
            for label in HELM_LABELS:
                item["spec"]["selector"]["matchLabels"].pop(label, None)
        if item["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            item["metadata"]["name"] = item["metadata"]["name"].removesuffix(f"-{namespace}")
        if item["kind"] == "ClusterRoleBinding":
            item["roleRef"]["name"] = item["roleRef"]["name"].removesuffix(f"-{namespace}")
        if item["kind"] == "ConfigMap":
            item["data"]["plugin.toml"] = settings(item["data"]["plugin.toml"])
        if item["kind"] == "DaemonSet":
            annotations = item["spec"]["template"]["metadata"]["annotations"]
            digest = annotations.pop("gpunode.io/config-sha256")
            assert [digest] == [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        out.append(item)
    return out


def test_deploy_is_plugin_manifest_without_a_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # tmp_path as the root: no /etc/gpunode/plugin.toml, no GPUNODE_* variables.
    assert plugin_manifest(tmp_path, capsys) == DEPLOY.read_text()


def test_deploy_validates_against_the_api_schemas() -> None:
    objects = documents(DEPLOY.read_text())
    assert [o["kind"] for o in objects] == ["Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"]
    validate(objects)


def test_schema_validation_catches_a_misspelt_field() -> None:
    # The check is real: the strict schemas refuse what kube-apiserver would drop or refuse.
    daemonset = documents(DEPLOY.read_text())[-1]
    daemonset["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 30
    with pytest.raises(AssertionError, match="periodSecond"):
        validate([daemonset])


def test_the_daemonset_is_a_device_plugins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemonset = documents(plugin_manifest(tmp_path, capsys))[-1]
    pod = daemonset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert volumes["device-plugins"]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    assert mounts["device-plugins"]["mountPath"] == "/var/lib/kubelet/device-plugins"
    assert volumes["driver-root"]["hostPath"]["path"] == "/"
    assert mounts["driver-root"] == {"name": "driver-root", "mountPath": "/driver-root", "readOnly": True}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUNODE_PLUGIN_CONFIG"] == "/etc/gpunode/plugin.toml"
    assert env["GPUNODE_DRIVER_ROOT"] == "/driver-root"
    assert container["livenessProbe"]["exec"]["command"] == [
        "gpunode",
        "plugin",
        "status",
        "--status-file",
        env["GPUNODE_PLUGIN_STATUS_FILE"],
    ]
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]} and security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
    assert container["resources"]["limits"]["memory"]


def test_node_config_becomes_the_configmap_and_host_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "etc/gpunode").mkdir(parents=True)
    (tmp_path / "etc/gpunode/plugin.toml").write_text(NODE_CONFIG)
    text = plugin_manifest(tmp_path, capsys, "--events", GPUNODE_PLACEMENT="packed")
    objects = documents(text)
    validate(objects)
    kinds = [o["kind"] for o in objects]
    assert kinds == [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
    ]
    daemonset = objects[-1]
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["driver-root"]["hostPath"]["path"] == "/run/nvidia/driver"
    # The ConfigMap's file, read by the plugin's own loader with the container's environment, gives every
    # setting the node's plugin resolves, host paths aside (the DaemonSet maps those to its mounts).
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    (tmp_path / "cm.toml").write_text(configmap["data"]["plugin.toml"])
    container_env = {
        e["name"]: e["value"]
        for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    in_pod = load_config(Host(root=tmp_path, env={}), config_path="/cm.toml", env=container_env)
    on_node = load_config(Host(root=tmp_path, env={}), env={"GPUNODE_PLACEMENT": "packed"})
    for option in OPTIONS:
        if option.name not in dm.HOST_PATH_OPTIONS:
            assert value_of(in_pod, option) == value_of(on_node, option), option.key
    assert in_pod.driver_root == "/driver-root" and in_pod.dev_root == "/"
    assert in_pod.socket_dir == "/var/lib/kubelet/device-plugins"


def test_rbac_grants_only_events_and_the_node_condition(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = documents(plugin_manifest(tmp_path, capsys, "--events"))
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # What gpunode/kube/events.py sends: POST of a core v1 Event, GET of the Node, PATCH of nodes/status.
    assert granted == {("", "events", "create"), ("", "nodes", "get"), ("", "nodes/status", "patch")}
    assert objects[1]["automountServiceAccountToken"] is True
    # The reporter reads a kubeconfig: the ServiceAccount's, from the ConfigMap; the node is the pod's.
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    kubeconfig = yaml.safe_load(configmap["data"]["kubeconfig"])
    assert kubeconfig["users"][0]["user"] == {
        "tokenFile": "/var/run/secrets/kubernetes.io/serviceaccount/token"
    }
    container = objects[-1]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["GPUNODE_EVENTS_ENABLED"]["value"] == "true"
    assert env["GPUNODE_EVENTS_KUBECONFIG"]["value"] == "/etc/gpunode/kubeconfig"
    assert env["GPUNODE_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    binding = next(o for o in objects if o["kind"] == "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpunode-device-plugin", "namespace": "gpunode-system"}
    ]


def test_events_turned_on_by_the_config_get_their_rbac(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # On a node events are on by default (kubelet's credentials); in a pod only when asked for.
    assert "ClusterRole" not in [o["kind"] for o in documents(plugin_manifest(tmp_path, capsys))]
    (tmp_path / "plugin.toml").write_text("[events]\nenabled = true\n")
    printed = documents(plugin_manifest(tmp_path, capsys, "--config", "/plugin.toml"))
    assert "ClusterRole" in [o["kind"] for o in printed]
    rendered = render_chart({"config": {"events": {"enabled": True}}})
    validate(rendered)
    assert comparable(rendered) == comparable(printed)


def test_chart_with_default_values_renders_deploy() -> None:
    rendered = render_chart({})
    validate(rendered)
    assert comparable(rendered) == comparable(documents(DEPLOY.read_text()))


def test_chart_with_a_nodes_settings_renders_what_plugin_manifest_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plugin.toml").write_text(NODE_CONFIG)
    printed = plugin_manifest(
        tmp_path,
        capsys,
        "--config",
        "/plugin.toml",
        "--events",
        "--namespace",
        "gpu-plugins",
        "--image",
        "registry.example/gpunode-device-plugin:0.1.0-test",
        "--status-file",
        "/run/dp/status.json",
        GPUNODE_PLACEMENT="packed",
    )
    rendered = render_chart(NODE_VALUES, namespace="gpu-plugins")
    validate(rendered)
    assert comparable(rendered, "gpu-plugins") == comparable(documents(printed), "gpu-plugins")


def test_chart_numbers_stay_whole_in_the_toml() -> None:
    # Helm reads every number of a values file as a float; replicas 4 must not become 4.0 (refused).
    rendered = render_chart(
        {"config": {"time-slicing": {"replicas": 4}, "health": {"recovery-quiet-period": 60}}}
    )
    text = next(o for o in rendered if o["kind"] == "ConfigMap")["data"]["plugin.toml"]
    assert re.search(r"^replicas = 4$", text, re.MULTILINE), text
    assert tomlread.loads(text) == {"time-slicing": {"replicas": 4}, "health": {"recovery-quiet-period": 60}}


def test_chart_lints_clean() -> None:
    # Helm's severities: 1 info (e.g. "icon is recommended"), 2 warning, 3 error.
    result = helm_python.lint(str(CHART))
    assert result["total_charts_linted"] == 1 and not result["errors"], result
    assert [m for m in result["messages"] if m["severity"] >= 2] == [], result


def test_readme_names_these_versions() -> None:
    text = (REPO / "docs/fleets.md").read_text()
    assert f"Kubernetes {VERSIONS[0]} to {VERSIONS[-1]}" in text


def test_bad_options_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = Host(root=tmp_path, env={})
    assert main(["plugin", "manifest", "--namespace", "Not_A_Name"], host=host) == 2
    assert "--namespace" in capsys.readouterr().err
    assert main(["plugin", "manifest", "--status-file", "relative"], host=host) == 2
    assert main(["plugin", "manifest", "--config", "/missing.toml"], host=host) == 6
    (tmp_path / "bad.toml").write_text("replica = 4\n")
    assert main(["plugin", "manifest", "--config", "/bad.toml"], host=host) == 4
    assert "replica" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("status_file", "said"),
    [
        # Issue 23: each of these printed a DaemonSet with two volumes on one path, or an emptyDir over
        # the socket directory, the config, the image's root or its programs, and exited 0.
        ("/var/lib/kubelet/device-plugins/status.json", "is /var/lib/kubelet/device-plugins, the socket"),
        ("/var/lib/kubelet/device-plugins/x/status.json", "is inside /var/lib/kubelet/device-plugins"),
        ("/var/lib/kubelet/status.json", "covers /var/lib/kubelet/device-plugins"),
        ("/etc/gpunode/status.json", "is /etc/gpunode, the config directory"),
        ("/driver-root/status.json", "is /driver-root, the driver root"),
        ("/var/run/secrets/status.json", "covers /var/run/secrets/kubernetes.io/serviceaccount"),
        ("/status.json", "covers /var/lib/kubelet/device-plugins"),
        ("/usr/local/status.json", "mounted over the image's own files"),
        ("/opt/status.json", "mounted over the image's own files"),
        ("/", "not an absolute file path without '..'"),
        ("/run/../etc/gpunode/status.json", "not an absolute file path without '..'"),
        ("/run/gpunode/../status.json", "not an absolute file path without '..'"),
        ("run/gpunode/status.json", "not an absolute file path"),
        ("/run/gpunode/", "not an absolute file path"),
    ],
)
def test_a_status_file_that_would_clash_with_a_mount_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], status_file: str, said: str
) -> None:
    code = main(["plugin", "manifest", "--status-file", status_file], host=Host(root=tmp_path, env={}))
    out, err = capsys.readouterr()
    assert code == 2, out
    assert out == ""
    assert f"plugin manifest: Invalid value for '--status-file': {status_file!r}" in err and said in err
    assert "; give a file in a directory of its own" in err  # the check's fix, then its help


def test_the_status_file_is_normalised_and_its_volume_is_the_only_one_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = documents(plugin_manifest(tmp_path, capsys, "--status-file", "/run//gpunode/./dp.json"))
    validate(objects)
    [container] = objects[-1]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUNODE_PLUGIN_STATUS_FILE"] == "/run/gpunode/dp.json"
    assert container["livenessProbe"]["exec"]["command"][-1] == "/run/gpunode/dp.json"
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    assert "/run/gpunode" in paths
    for path in paths:  # no mount on, inside or above another
        assert not any(o == path or o.startswith(path + "/") for o in paths if o is not path), paths


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"GPUNODE_SOCKET_DIR": "/"},
            "socket-dir (env GPUNODE_SOCKET_DIR): '/' would mount the host's whole",
        ),
        ({"GPUNODE_SOCKET_DIR": "/var/lib/kubelet/../device-plugins"}, "socket-dir (env GPUNODE_SOCKET_DIR)"),
        ({"GPUNODE_DRIVER_ROOT": "/run/nvidia/../driver"}, "driver-root (env GPUNODE_DRIVER_ROOT)"),
    ],
)
def test_host_path_settings_a_hostpath_volume_cannot_take_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], env: dict[str, str], said: str
) -> None:
    code = main(["plugin", "manifest"], host=Host(root=tmp_path, env=env))
    out, err = capsys.readouterr()
    assert code == 4, out
    assert out == "" and said in err and "fix:" in err


def test_host_path_settings_are_normalised_for_the_volumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = plugin_manifest(
        tmp_path,
        capsys,
        GPUNODE_SOCKET_DIR="/var/lib//kubelet/./device-plugins",
        GPUNODE_DRIVER_ROOT="/run//nvidia/driver",
    )
    volumes = {v["name"]: v for v in documents(text)[-1]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["device-plugins"]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    assert volumes["driver-root"]["hostPath"]["path"] == "/run/nvidia/driver"


def fleets_commands() -> tuple[str, list[str]]:
    """docs/fleets.md's values.yaml (the heredoc) and its command lines, as written there."""
    text = (REPO / "docs/fleets.md").read_text()
    section = text.split("## DaemonSet", 1)[1]
    blocks = [textwrap.dedent(b) for b in re.findall(r"```bash\n(.*?)```", section, re.DOTALL)]
    script = "\n".join(blocks)
    values = re.search(r"cat > values.yaml <<'EOF'\n(.*?)\nEOF\n", script, re.DOTALL)
    assert values, "docs/fleets.md: no values.yaml heredoc"
    lines = [line.strip() for line in script.splitlines() if line.strip()]
    return values.group(1), lines


def test_fleets_values_render_as_documented() -> None:
    values_text, lines = fleets_commands()
    [install] = [shlex.split(line) for line in lines if line.startswith("helm install ")]
    # The release's namespace, created by Helm (the chart creates no Namespace).
    assert install == [
        "helm",
        "install",
        RELEASE,
        "deploy/helm/gpunode-device-plugin",
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "-f",
        "values.yaml",
    ]
    values = yaml.safe_load(values_text)
    rendered = render_chart(values, name=install[2], namespace=install[5])
    validate(rendered)
    daemonset = next(o for o in rendered if o["kind"] == "DaemonSet")
    # The page's kubectl lines name the DaemonSet this release made, where it is.
    where = f"kubectl -n {daemonset['metadata']['namespace']} "
    assert f"{where}rollout status daemonset/{daemonset['metadata']['name']}" in lines
    assert any(line.startswith(f"{where}exec daemonset/{daemonset['metadata']['name']} --") for line in lines)
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{values['image']['repository']}:0.1.0"
    plugin_toml = next(o for o in rendered if o["kind"] == "ConfigMap")["data"]["plugin.toml"]
    resolved = settings(plugin_toml)
    assert resolved["time-slicing.replicas"] == 4 and resolved["time-slicing.rename-by-default"] is True
    # The probe and the status command the page shows are the DaemonSet's own.
    probe = " ".join(container["livenessProbe"]["exec"]["command"])
    assert any(line.endswith(f"-- {probe}") for line in lines), probe


def test_fleets_plugin_manifest_line_runs_as_documented(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, lines = fleets_commands()
    [line] = [line for line in lines if line.startswith("gpunode plugin manifest ")]
    command, _, consumer = line.partition(" | ")
    assert consumer == "kubectl apply -f -"  # not run: no cluster here
    objects = documents(plugin_manifest(tmp_path, capsys, *shlex.split(command)[3:]))
    validate(objects)
    daemonset = objects[-1]
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"] == shlex.split(command)[-1]


def test_mps_is_refused_in_the_daemonset_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "etc/gpunode").mkdir(parents=True)
    (tmp_path / "etc/gpunode/plugin.toml").write_text(
        '[mps]\nresources = [{name = "nvidia.com/gpu", replicas = 4}]\n'
    )
    code = main(["plugin", "manifest"], host=Host(root=tmp_path, env={}))
    err = capsys.readouterr().err
    assert code == 4
    assert "the DaemonSet form does not run MPS control daemons" in err and "gpunode plugin install" in err
