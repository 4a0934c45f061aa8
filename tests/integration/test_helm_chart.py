"""The Helm chart's own conventions: release namespace and names, standard labels, values, their schema.

Rendered by Helm's own engine (see tests/integration/test_daemonset.py's docstring: Helm v4's Go SDK through
helm_python, the code `helm template` runs), which checks values.schema.json before it renders, as
`helm install` and `helm template` do. Every rendered object is validated against the Kubernetes API
schemas. That the chart's objects are `gpunode plugin manifest`'s is test_daemonset.py's business.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import helm_python
import pytest
import tomlkit
import yaml

from gpunode.errors import ConfigError
from gpunode.host import Host
from gpunode.plugin import manifest as dm
from gpunode.plugin.config import OPTIONS, load_config
from tests.integration.test_daemonset import CHART, NODE_VALUES, REPO, render_chart, settings, validate

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding")
EVENTS = {"events": {"enabled": True}}  # every object the chart has: RBAC included


def daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == "DaemonSet"]
    return found


def refused(values: dict[str, Any]) -> str:
    """Helm's message for values its engine refuses before rendering."""
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render_chart(values)
    return str(caught.value)


def identity(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def check_references(objects: list[dict[str, Any]], namespace: str) -> None:
    """Every object in the release's namespace, and every reference between them resolving to an object
    of this release (not a name another release has)."""
    by_kind = {o["kind"]: o for o in objects}
    assert "Namespace" not in by_kind  # `helm install --create-namespace` makes it, not the chart
    for obj in objects:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], obj["kind"]
        else:
            assert obj["metadata"]["namespace"] == namespace, obj["kind"]
    ds = by_kind["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == by_kind["ServiceAccount"]["metadata"]["name"]
    [config] = [v for v in pod["volumes"] if v["name"] == "config"]
    assert config["configMap"]["name"] == by_kind["ConfigMap"]["metadata"]["name"]
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    if "ClusterRoleBinding" in by_kind:
        binding = by_kind["ClusterRoleBinding"]
        assert binding["roleRef"]["name"] == by_kind["ClusterRole"]["metadata"]["name"]
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": by_kind["ServiceAccount"]["metadata"]["name"],
                "namespace": namespace,
            }
        ]


# --- namespace and names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "releases",
    [
        [("gpunode-device-plugin", "gpu-a"), ("lab", "gpu-b")],
        # The same release name in two namespaces (Helm allows it): the cluster-wide RBAC must not be shared.
        [("gpunode-device-plugin", "gpu-a"), ("gpunode-device-plugin", "gpu-b")],
        # Two releases in one namespace.
        [("gpunode-device-plugin", "gpu-a"), ("lab", "gpu-a")],
    ],
)
def test_releases_share_no_object_and_stay_in_their_namespace(releases: list[tuple[str, str]]) -> None:
    seen: dict[tuple[str, str, str], str] = {}
    selectors = []
    for name, namespace in releases:
        objects = render_chart(EVENTS, name=name, namespace=namespace)
        validate(objects)
        assert sorted(o["kind"] for o in objects) == [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "ServiceAccount",
        ]
        check_references(objects, namespace)
        for obj in objects:
            assert identity(obj) not in seen, f"{identity(obj)}: {seen.get(identity(obj))} and {name}"
            seen[identity(obj)] = f"{name} in {namespace}"
        selectors.append(daemonset(objects)["spec"]["selector"]["matchLabels"])
    if len({namespace for _, namespace in releases}) == 1:
        # Two DaemonSets in one namespace selecting each other's pods would fight over them.
        assert selectors[0] != selectors[1]


def test_names_follow_helms_conventions() -> None:
    def names(values: dict[str, Any], release: str) -> set[str]:
        objects = render_chart({**EVENTS, **values}, name=release, namespace="gpu")
        return {o["metadata"]["name"] for o in objects}

    # The release name alone when it holds the chart's name; else the two joined.
    assert names({}, "gpunode-device-plugin") == {
        "gpunode-device-plugin",
        "gpunode-device-plugin-config",
        "gpunode-device-plugin-gpu",
    }
    assert names({}, "lab") == {
        "lab-gpunode-device-plugin",
        "lab-gpunode-device-plugin-config",
        "lab-gpunode-device-plugin-gpu",
    }
    assert names({"nameOverride": "dp"}, "lab") == {"lab-dp", "lab-dp-config", "lab-dp-gpu"}
    assert names({"fullnameOverride": "gpu-plugin"}, "lab") == {
        "gpu-plugin",
        "gpu-plugin-config",
        "gpu-plugin-gpu",
    }
    # Helm's longest release name (53 characters): the DaemonSet's name is cut to 63, without a final "-".
    long_release = "r" * 52 + "x"
    ds_name = daemonset(render_chart({}, name=long_release, namespace="gpu"))["metadata"]["name"]
    assert len(ds_name) == 63 and not ds_name.endswith("-")
    name_label = daemonset(render_chart({"nameOverride": "dp"}, name="lab"))["metadata"]["labels"]
    assert name_label["app.kubernetes.io/name"] == "dp"


def test_standard_labels_on_every_object_and_a_stable_selector(tmp_path: Path) -> None:
    objects = render_chart(EVENTS, name="lab", namespace="gpu")
    expected = {
        "app.kubernetes.io/name": "gpunode-device-plugin",
        "app.kubernetes.io/instance": "lab",
        "app.kubernetes.io/version": CHART_META["appVersion"],
        "app.kubernetes.io/managed-by": "Helm",
        "helm.sh/chart": f"gpunode-device-plugin-{CHART_META['version']}",
        "app.kubernetes.io/part-of": "gpunode",
    }
    template = daemonset(objects)["spec"]["template"]["metadata"]
    for labels in [o["metadata"]["labels"] for o in objects] + [template["labels"]]:
        assert expected.items() <= labels.items(), labels
    selector = daemonset(objects)["spec"]["selector"]["matchLabels"]
    assert selector == {
        "app.kubernetes.io/name": "gpunode-device-plugin",
        "app.kubernetes.io/instance": "lab",
    }
    # A DaemonSet's selector cannot change: what an upgrade may change (the config, the image, pod labels,
    # the chart's version) leaves it as it was.
    changed = {
        "config": {"time-slicing": {"replicas": 2}},
        "image": {"repository": "registry.example/gpunode-device-plugin", "tag": "9.9.9"},
        "podLabels": {"team": "ml"},
    }
    assert daemonset(render_chart(changed, name="lab", namespace="gpu"))["spec"]["selector"] == {
        "matchLabels": selector
    }
    with helm_python.Chart.load(str(CHART)) as chart:
        copy = Path(chart.save_dir(tmp_path))
    meta = yaml.safe_load((copy / "Chart.yaml").read_text())
    (copy / "Chart.yaml").write_text(yaml.safe_dump({**meta, "version": "9.0.0", "appVersion": "9.0.0"}))
    with helm_python.Chart.load(str(copy)) as newer:
        rendered = newer.render({}, name="lab", namespace="gpu", is_install=False, is_upgrade=True)
    upgraded = yaml.safe_load(rendered["gpunode-device-plugin/templates/daemonset.yaml"])
    assert upgraded["spec"]["selector"] == {"matchLabels": selector}
    assert upgraded["metadata"]["labels"]["helm.sh/chart"] == "gpunode-device-plugin-9.0.0"


# --- the values NVIDIA's chart has -----------------------------------------------------------------------

OPERATOR_VALUES: dict[str, Any] = {
    "runtimeClassName": "nvidia",
    "priorityClassName": "gpu-critical",
    "imagePullSecrets": [{"name": "registry-creds"}],
    "nodeSelector": {"node-role.example/gpu": "yes"},
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "feature.node.kubernetes.io/pci-10de.present",
                                "operator": "In",
                                "values": ["true"],
                            }
                        ]
                    }
                ]
            }
        }
    },
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}],
    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
    "podLabels": {"team": "ml"},
    "podAnnotations": {"prometheus.io/scrape": "true"},
    "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
    "podSecurityContext": {"fsGroup": 0},
    "securityContext": {"readOnlyRootFilesystem": False},
}


def test_each_operator_value_is_in_the_daemonset() -> None:
    objects = render_chart(OPERATOR_VALUES)
    validate(objects)
    ds = daemonset(objects)
    template = ds["spec"]["template"]
    pod = template["spec"]
    [container] = pod["containers"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "gpu-critical"
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["affinity"] == OPERATOR_VALUES["affinity"]
    assert pod["securityContext"] == {"fsGroup": 0}
    # Lists and maps of plain values: Helm replaces a list, and merges a map with the default's keys.
    assert pod["tolerations"] == OPERATOR_VALUES["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true", "node-role.example/gpu": "yes"}
    assert container["resources"] == OPERATOR_VALUES["resources"]
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "gpunode.io/config-sha256" in template["metadata"]["annotations"]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "10%"},
    }
    # The container's securityContext: the given key changed, the chart's hardening kept.
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and security["allowPrivilegeEscalation"] is False


def test_defaults_and_what_turns_a_value_off() -> None:
    pod = daemonset(render_chart({}))["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    for absent in ("runtimeClassName", "imagePullSecrets", "affinity", "securityContext"):
        assert absent not in pod, absent
    off = render_chart(
        {"priorityClassName": "", "nodeSelector": None, "tolerations": [], "securityContext": None}
    )
    validate(off)
    ds = daemonset(off)
    pod = ds["spec"]["template"]["spec"]
    for absent in ("priorityClassName", "nodeSelector", "tolerations"):
        assert absent not in pod, absent
    assert "securityContext" not in pod["containers"][0]
    # OnDelete takes no rollingUpdate (the API refuses one): the default's, merged in by Helm, is dropped.
    on_delete = render_chart({"updateStrategy": {"type": "OnDelete"}})
    validate(on_delete)
    assert daemonset(on_delete)["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_pod_labels_and_annotations_cannot_replace_the_charts_own() -> None:
    for values, message in (
        ({"podLabels": {"app.kubernetes.io/instance": "other"}}, "app.kubernetes.io/instance"),
        ({"podLabels": {"app.kubernetes.io/component": "x"}}, "app.kubernetes.io/component"),
        ({"podAnnotations": {"gpunode.io/config-sha256": "0"}}, "gpunode.io/config-sha256"),
    ):
        with pytest.raises(helm_python.HelmRenderError) as caught:
            render_chart(values)
        assert message in str(caught.value) and "remove it from pod" in str(caught.value)


# --- values.schema.json ----------------------------------------------------------------------------------


def test_schema_is_draft_07_and_strict() -> None:
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"

    def objects(node: Any, where: str) -> list[str]:
        # Every table of keys the schema names (an object with properties) refuses the others.
        found = []
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                found.append(where)
            for key, value in node.items():
                found += objects(value, f"{where}.{key}")
        elif isinstance(node, list):
            for n, value in enumerate(node):
                found += objects(value, f"{where}[{n}]")
        return found

    assert objects(SCHEMA, "") == []
    # Every value of values.yaml has its entry (Helm checks the merged values: a key the schema lacks
    # would refuse the defaults; this says which).
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults) <= set(SCHEMA["properties"])


def schema_config_keys() -> set[str]:
    keys = set()
    for key, node in SCHEMA["properties"]["config"]["properties"].items():
        if node.get("type") == "object":
            keys |= {f"{key}.{sub}" for sub in node["properties"]}
        else:
            keys.add(key)
    return keys


def test_schema_config_keys_are_the_plugins_options() -> None:
    # Host paths and the pod's own settings are the chart's (the container's environment would override
    # the file's value silently); MPS is refused in the DaemonSet form (`plugin manifest` refuses it too).
    set_by_the_chart = {o.key for o in OPTIONS if o.name in dm.HOST_PATH_OPTIONS}
    mps = {o.key for o in OPTIONS if o.key.startswith("mps.")}
    assert set_by_the_chart == {"driver-root", "dev-root", "socket-dir", "events.kubeconfig", "node-name"}
    assert schema_config_keys() == {o.key for o in OPTIONS} - set_by_the_chart - mps


# Every option the schema takes, set to a value other than its default: the plugin must read back each.
EVERY_OPTION: dict[str, Any] = {
    "resource-name": "example.com/gpu",
    "mig-strategy": "single",
    "device-list-strategy": ["volume-mounts", "cdi-annotations"],
    "device-id-strategy": "index",
    "pass-device-specs": True,
    "pre-start-required": True,
    "fail-on-init-error": False,
    "cdi-kind": "example.com/gpu",
    "cdi-annotation-prefix": "cdi.example.com/",
    "gds-enabled": True,
    "mofed-enabled": True,
    "gdrcopy-enabled": True,
    "time-slicing": {
        "replicas": 3,
        "rename-by-default": True,
        "fail-requests-greater-than-one": True,
        "placement": "packed",
        "resources": [
            {
                "name": "example.com/gpu",
                "replicas": 2,
                "rename": "example.com/shared",
                "devices": [0, "1", "0:1"],
            },
            {"name": "a100", "replicas": 4, "devices": 2},
        ],
    },
    "resources": {
        "gpus": [{"pattern": "*A100*", "name": "a100"}],
        "mig": [{"pattern": "1g.10gb", "name": "example.com/mig-small"}],
    },
    "imex": {"channel-ids": [0], "required": True},
    "health": {
        "enabled": False,
        "ignored-xids": [13, 31],
        "critical-xids": [79],
        "recovery-quiet-period": 12.5,
    },
    "metrics": {"address": "0.0.0.0:9400"},
    "events": {"enabled": True},
}


def flat(config: dict[str, Any]) -> dict[str, Any]:
    return {
        f"{key}.{sub}" if isinstance(value, dict) else key: v
        for key, value in config.items()
        for sub, v in (value.items() if isinstance(value, dict) else [(None, value)])
    }


def test_schema_takes_every_option_and_the_plugin_reads_each_back() -> None:
    assert set(flat(EVERY_OPTION)) == schema_config_keys()
    objects = render_chart({"config": EVERY_OPTION})
    validate(objects)
    [configmap] = [o for o in objects if o["kind"] == "ConfigMap"]
    resolved = settings(configmap["data"]["plugin.toml"])
    for key, given in flat(EVERY_OPTION).items():
        if key == "time-slicing.resources":
            # The plugin's form: device indexes as text (0 and "0" alike), a count as given; no rename: "".
            expected = [
                {**e, "devices": [str(d) for d in e["devices"]]} if isinstance(e["devices"], list) else e
                for e in given
            ]
            got = [{k: v for k, v in e.items() if v != ""} for e in resolved[key]]
            assert got == expected, key
        else:
            assert resolved[key] == given, key


def test_schema_accepts_the_defaults_and_the_documented_examples() -> None:
    validate(render_chart({}))
    # values.yaml's own example, the node's settings test_daemonset.py renders, docs/fleets.md's values and
    # the operator values above.
    example = {"config": {"time-slicing": {"replicas": 4, "rename-by-default": True}}}
    for values in (example, NODE_VALUES, OPERATOR_VALUES, fleets_values(), {"runtimeClassName": None}):
        validate(render_chart(values))


def fleets_values() -> dict[str, Any]:
    text = (REPO / "docs/fleets.md").read_text().split("## DaemonSet", 1)[1]
    body = text.split("cat > values.yaml <<'EOF'\n", 1)[1].split("\n   EOF\n", 1)[0]
    values: dict[str, Any] = yaml.safe_load("\n".join(line.removeprefix("   ") for line in body.splitlines()))
    return values


def plugin_refuses(config: dict[str, Any]) -> bool:
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "plugin.toml").write_text(tomlkit.dumps(config))
        try:
            load_config(Host(root=Path(root), env={}), config_path="/plugin.toml", env={})
        except ConfigError:
            return True
    return False


# Values the plugin refuses (it would crash-loop on its ConfigMap): the schema refuses them first. The
# message Helm prints names where.
PLUGIN_REFUSES = [
    ({"time-slicing": {"replicaz": 4}}, "/config/time-slicing", "replicaz"),
    ({"time-slicing": {"replicas": 0}}, "/config/time-slicing/replicas", "minimum"),
    ({"time-slicing": {"replicas": 2000}}, "/config/time-slicing/replicas", "maximum"),
    ({"time-slicing": {"replicas": 4.5}}, "/config/time-slicing/replicas", "want integer"),
    ({"time-slicing": {"placement": "pack"}}, "/config/time-slicing/placement", "must be one of"),
    ({"time-slicing": {"resources": [{"name": "nvidia.com/gpu"}]}},
     "/config/time-slicing/resources/0", "replicas"),
    ({"time-slicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "device": [0]}]}},
     "/config/time-slicing/resources/0", "device"),
    ({"time-slicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": ["gpu0"]}]}},
     "/config/time-slicing/resources/0/devices", ""),
    ({"mig-strategy": "mixd"}, "/config/mig-strategy", "must be one of"),
    ({"device-list-strategy": ["envvar", "cdi"]}, "/config/device-list-strategy", ""),
    ({"resource-name": "gpu"}, "/config/resource-name", "pattern"),
    ({"pass-device-specs": "maybe"}, "/config/pass-device-specs", "want boolean"),
    ({"imex": {"channel-ids": [1]}}, "/config/imex/channel-ids/0", ""),
    ({"health": {"ignored-xids": [-1]}}, "/config/health/ignored-xids/0", "minimum"),
    ({"health": {"ignored-xid": [13]}}, "/config/health", "ignored-xid"),
    ({"health": {"recovery-quiet-period": -1}}, "/config/health/recovery-quiet-period", "minimum"),
    ({"metrics": {"address": "9400"}}, "/config/metrics/address", "pattern"),
    ({"events": {"enabled": "sometimes"}}, "/config/events/enabled", "want boolean"),
    ({"replicas": 4}, "/config", "replicas"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "where", "what"), PLUGIN_REFUSES)
def test_schema_refuses_what_the_plugin_refuses(config: dict[str, Any], where: str, what: str) -> None:
    assert plugin_refuses(config), config
    message = refused({"config": config})
    assert f"at '{where}'" in message and what in message, message


@pytest.mark.parametrize(
    ("values", "where", "what"),
    [
        # A key the chart sets itself: in the file, the container's environment would override it silently.
        ({"config": {"driver-root": "/run/nvidia/driver"}}, "/config", "driver-root"),
        ({"config": {"events": {"kubeconfig": "/etc/k.conf"}}}, "/config/events", "kubeconfig"),
        ({"config": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}, "/config", "mps"),
        # 0.1.0's value: the release's namespace now (helm install -n).
        ({"namespace": "gpu"}, "", "namespace"),
        ({"nodeSelecter": {"a": "b"}}, "", "nodeSelecter"),
        (
            {"nodeSelector": {"nvidia.com/gpu.present": True}},
            "/nodeSelector/nvidia.com~1gpu.present",
            "want string",
        ),
        ({"tolerations": {"key": "x"}}, "/tolerations", "want array"),
        ({"tolerations": [{"key": "x", "opertor": "Exists"}]}, "/tolerations/0", "opertor"),
        ({"image": {"tag": 1.10}}, "/image/tag", "want string"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", "must be one of"),
        ({"imagePullSecrets": ["creds"]}, "/imagePullSecrets/0", "want object"),
        ({"resources": {"limit": {"memory": "1Gi"}}}, "/resources", "limit"),
        ({"updateStrategy": {"type": "Recreate"}}, "/updateStrategy/type", "must be one of"),
        ({"podLabels": {"team": 1}}, "/podLabels/team", "want string"),
        ({"runtimeClassName": "Nvidia_RT"}, "/runtimeClassName", "pattern"),
        ({"statusFile": "/status.json"}, "/statusFile", "pattern"),
        ({"driverRoot": "run/nvidia/driver"}, "/driverRoot", "pattern"),
        ({"events": {"enable": True}}, "/events", "enable"),
        ({"fullnameOverride": "Not_A_Name"}, "/fullnameOverride", "pattern"),
        # null deletes a default in Helm: what the templates need is refused by name, not a nil pointer.
        ({"updateStrategy": None}, "", "updateStrategy"),
        ({"config": None}, "", "config"),
        ({"image": None}, "", "image"),
    ],
)
def test_schema_refuses_typos_and_wrong_types(values: dict[str, Any], where: str, what: str) -> None:
    message = refused(values)
    assert f"at '{where}'" in message and what in message, message


def chart_section() -> str:
    text = (REPO / "docs/fleets.md").read_text()
    return text.split("### The Helm chart", 1)[1].split("\n**From chart", 1)[0]


def test_docs_table_names_every_value_and_its_example_renders() -> None:
    section = chart_section()
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = {name.split(".")[0] for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert documented == set(defaults)
    [example] = re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)
    values = yaml.safe_load(example)
    objects = render_chart(values)
    validate(objects)
    pod = daemonset(objects)["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia" and pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["affinity"] == values["affinity"]
    assert "nodeSelector" not in pod  # null drops the default's one key, as the table says
