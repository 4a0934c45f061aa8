"""`gpunode dra manifest`: the DaemonSet form of `gpunode dra run` (and the chart's `dra.enabled`, in
tests/integration/test_helm_chart.py).

Every object is validated strictly against the Kubernetes API's schemas of 1.34 on (resource.k8s.io/v1 is
GA there; kubernetes-validate carries its DeviceClass schema), and the container's settings are checked
against what `gpunode dra run` itself reads: each variable is one of its options' (so the names cannot
drift), each path it is told is a mount of the same path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import helm_python
import kubernetes_validate
import pytest
import yaml

from gpunode.cli.dra import run as dra_run
from gpunode.cli.main import main
from gpunode.dra import manifest as dm
from gpunode.dra.classes import device_classes
from gpunode.host import Host

# The chart rendered by Helm's engine (values schema first), as test_daemonset.py renders it.
from tests.integration.test_daemonset import HELM_LABELS, render_chart

DRA_VERSIONS = [f"1.{minor}" for minor in range(34, 38)]


def dra_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    code = main(["dra", "manifest", *args], host=Host(root=tmp_path, env={}))
    out, err = capsys.readouterr()
    assert code == 0, err
    return [d for d in yaml.safe_load_all(out) if d]


def validate(objects: list[dict[str, Any]]) -> None:
    for version in DRA_VERSIONS:
        for item in objects:
            try:
                kubernetes_validate.validate(item, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                where = ".".join(str(p) for p in err.path)
                raise AssertionError(
                    f"{item['kind']} on Kubernetes {version}: {where}: {err.message}"
                ) from None


def container_of(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    [ds] = [o for o in objects if o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return pod, container


def check_pod_runs_dra(objects: list[dict[str, Any]], driver: str, driver_root: str) -> None:
    """The pod runs `dra run` with settings it reads, paths mounted where it is told they are."""
    pod, container = container_of(objects)
    assert container["command"] == ["gpunode", "dra", "run"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    options = {p.envvar: p for p in dra_run.params if isinstance(p, click.Option) and p.envvar}
    for name in env:
        assert name in options or name == "KUBECONFIG", f"{name}: no option of `dra run` reads it"
    assert env["GPUNODE_DRA_DRIVER"]["value"] == driver
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    told = {
        "GPUNODE_DRA_PLUGINS_DIR": "/var/lib/kubelet/plugins",
        "GPUNODE_DRA_REGISTRY_DIR": "/var/lib/kubelet/plugins_registry",
        "GPUNODE_DRA_CDI_DIR": "/var/run/cdi",
        "GPUNODE_DRA_DRIVER_ROOT": driver_root,
    }
    for variable, path in told.items():
        assert env[variable]["value"] == path
        # Mounted from the same host path: kubelet dials the sockets, and the runtime reads the CDI specs'
        # paths, as the host has them.
        assert volumes[mounts[path]["name"]]["hostPath"]["path"] == path
    assert mounts[driver_root].get("readOnly") is True
    kubeconfig = env["KUBECONFIG"]["value"]
    config_mount = mounts[str(Path(kubeconfig).parent)]
    assert "configMap" in volumes[config_mount["name"]]
    status = env["GPUNODE_DRA_STATUS_FILE"]["value"]
    assert (
        "emptyDir" in volumes[mounts[str(Path(status).parent)]["name"]]
    )  # the root file system is read-only
    assert pod["automountServiceAccountToken"] is True


def test_default_manifest_runs_dra_run_with_its_rbac_and_the_classes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = dra_manifest(tmp_path, capsys)
    validate(objects)
    assert [o["kind"] for o in objects] == [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "DeviceClass",
        "DeviceClass",
    ]
    check_pod_runs_dra(objects, "gpu.nvidia.com", "/run/nvidia/driver")
    by_kind = {o["kind"]: o for o in objects}
    assert by_kind["ClusterRole"]["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": ["create", "get", "list", "watch", "update", "patch", "delete", "deletecollection"],
        },
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    ]
    assert by_kind["ClusterRoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpunode-dra-driver", "namespace": "gpunode-system"}
    ]
    assert objects[-2:] == device_classes("gpu.nvidia.com")
    assert "kubeconfig" in by_kind["ConfigMap"]["data"]


def test_options_reach_the_objects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    objects = dra_manifest(
        tmp_path,
        capsys,
        "--namespace",
        "gpu",
        "--image",
        "registry.example/gpunode:1",
        "--driver",
        "gpu.example.com",
        "--driver-root",
        "/opt/nvidia-driver/",
        "--no-extended-resource",
    )
    validate(objects)
    check_pod_runs_dra(objects, "gpu.example.com", "/opt/nvidia-driver")
    _, container = container_of(objects)
    assert container["image"] == "registry.example/gpunode:1"
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] not in dm.CLUSTER_SCOPED} == {"gpu"}
    assert [o for o in objects if o["kind"] == "DeviceClass"] == device_classes(
        "gpu.example.com", extended_resource=False
    )


def test_no_classes_leaves_them_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    objects = dra_manifest(tmp_path, capsys, "--no-classes")
    assert "DeviceClass" not in {o["kind"] for o in objects}
    assert "DaemonSet" in {o["kind"] for o in objects}


@pytest.mark.parametrize(
    ("root", "words"),
    [
        ("/", "gpunode dra install"),  # the host's own driver: the container cannot mount / at /
        ("/usr", "hide the container's own"),
        ("/var/lib/kubelet", "another of its volumes"),  # around the plugins directory
        ("/var/run/cdi/x", "another of its volumes"),
        ("relative/path", "absolute path"),
        ("/run/../etc", "absolute path"),
    ],
)
def test_driver_roots_it_cannot_mount_at_their_own_path_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], root: str, words: str
) -> None:
    code = main(["dra", "manifest", "--driver-root", root], host=Host(root=tmp_path, env={}))
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert words in err
    assert "Traceback" not in err


def test_bad_driver_and_namespace_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for args in (["--driver", "Not_A_Name"], ["--namespace", "Bad_NS"], ["--image", "a b"]):
        code = main(["dra", "manifest", *args], host=Host(root=tmp_path, env={}))
        out, err = capsys.readouterr()
        assert code == 2, args
        assert out == "" and "Traceback" not in err


# --- the chart's dra.enabled ------------------------------------------------------------------------------

DRA = {"dra": {"enabled": True}}


def as_cli_names(objects: list[dict[str, Any]], names: dict[str, str]) -> list[dict[str, Any]]:
    """The chart's objects with `plugin manifest`'s names and without Helm's own labels, which is all that
    legitimately differs (test_daemonset.py's `comparable` for the plugin)."""
    text = yaml.safe_dump(objects, sort_keys=True)
    out = yaml.safe_load(text)
    for obj in out:
        if obj["kind"] == "DeviceClass":
            continue  # gpunode's labels, as `dra classes` writes them (managed-by gpunode, not Helm)
        for where in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata", {})):
            for label in HELM_LABELS:
                where.get("labels", {}).pop(label, None)
        if obj["kind"] == "DaemonSet":
            obj["spec"]["selector"]["matchLabels"].pop("app.kubernetes.io/instance")
    text = yaml.safe_dump(out, sort_keys=True)
    for chart_name, cli_name in names.items():
        text = text.replace(chart_name, cli_name)
    return sorted(yaml.safe_load(text), key=lambda o: (o["kind"], o["metadata"]["name"]))


@pytest.mark.parametrize(
    ("values", "args"),
    [
        ({}, []),
        (
            {
                "image": {"repository": "registry.example/gpunode", "tag": "1"},
                "dra": {
                    "driver": "gpu.example.com",
                    "driverRoot": "/opt/nvidia-driver",
                    "extendedResource": False,
                },
            },
            [
                "--image",
                "registry.example/gpunode:1",
                "--driver",
                "gpu.example.com",
                "--driver-root",
                "/opt/nvidia-driver",
                "--no-extended-resource",
            ],
        ),
        ({"dra": {"deviceClasses": False}}, ["--no-classes"]),
    ],
)
def test_chart_with_dra_enabled_renders_dra_manifests_objects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: dict[str, Any], args: list[str]
) -> None:
    merged = {**values, "dra": {"enabled": True, **values.get("dra", {})}}
    chart = render_chart(merged, name="gpunode-device-plugin", namespace="gpunode-system")
    validate(chart)
    kinds = [o["kind"] for o in chart]
    assert "Namespace" not in kinds  # Helm's --create-namespace makes it
    cli = [o for o in dra_manifest(tmp_path, capsys, *args) if o["kind"] != "Namespace"]
    names = {
        # The chart's cluster-wide RBAC carries the namespace; its other names are the release's.
        "gpunode-device-plugin-gpunode-system": "gpunode-dra-driver",
        "gpunode-device-plugin": "gpunode-dra-driver",
    }
    # The same replacement on both sides: the kubeconfig's user is named gpunode-device-plugin in both.
    cli_text = yaml.safe_dump(cli, sort_keys=True).replace("gpunode-device-plugin", "gpunode-dra-driver")
    want = sorted(yaml.safe_load(cli_text), key=lambda o: (o["kind"], o["metadata"]["name"]))
    assert as_cli_names(chart, names) == want


def test_chart_without_dra_renders_no_dra_object() -> None:
    objects = render_chart({})
    assert {o["kind"] for o in objects} == {"ServiceAccount", "ConfigMap", "DaemonSet"}
    [ds] = [o for o in objects if o["kind"] == "DaemonSet"]
    assert ds["spec"]["template"]["spec"]["containers"][0]["name"] == "device-plugin"


@pytest.mark.parametrize(
    ("dra", "words"),
    [
        ({"driverRoot": "/"}, "driverRoot"),
        ({"driverRoot": "relative"}, "driverRoot"),
        ({"driverRoot": "/run/../usr"}, "driverRoot"),
        ({"driver": "Not_A_Driver"}, "driver"),
        ({"enabeld": True}, "enabeld"),
    ],
)
def test_chart_schema_refuses_bad_dra_values(dra: dict[str, Any], words: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render_chart({"dra": {"enabled": True, **dra}})
    assert words in str(caught.value)


@pytest.mark.parametrize("root", ["/usr/local/nvidia", "/var/lib/kubelet", "/var/run/cdi/driver"])
def test_chart_refuses_a_driver_root_it_cannot_mount_at_its_own_path(root: str) -> None:
    with pytest.raises(helm_python.HelmError) as caught:
        render_chart({"dra": {"enabled": True, "driverRoot": root}})
    assert "dra.driverRoot" in str(caught.value)
    assert "gpunode dra install" in str(caught.value)
