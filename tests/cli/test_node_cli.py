"""`gpunode node advertise|withdraw` end to end: the whole CLI in this process, the real pynvml on the fake
libnvidia-ml.so.1, a node's files under a temp root, and the test API server (tests/kubeapi) over real TLS
with a kubeconfig written under that root, or over plain HTTP as `kubectl proxy` serves it. What the
server holds afterwards, and the requests it logged, are what is checked."""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpunode import schemas
from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from gpunode.kube.labels import CAPACITY_ANNOTATION, MANAGED_ANNOTATION
from tests.kubeapi.apiserver import ApiServer, LoggedRequest
from tests.kubeapi.pki import Pki

TOKEN = "admin-token-7d2c41f0-never-shown"  # noqa: S105 (test tokens)
VIEWER_TOKEN = "viewer-token-19be-never-shown"  # noqa: S105
NODE = "gpu-node-1"
GPU = "nvidia.com/gpu"
JSON_PATCH, MERGE_PATCH = "application/json-patch+json", "application/merge-patch+json"

# What NVIDIA's GPU feature discovery labels an 8 x A100 node with (driver 550.54.15, CUDA 12.4).
DGX_LABELS: dict[str, str] = json.loads(
    (Path(__file__).resolve().parent.parent / "fixtures/labels/dgx-a100.json").read_text()
)
CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(
        pki,
        tokens={TOKEN: "admin", VIEWER_TOKEN: "viewer"},
        allow=[("admin", "*", "*"), ("viewer", "get", "nodes")],
    ) as server:
        server.add_node(NODE)
        yield server


@dataclass
class Node:
    """This node's files under a temp root, and the CLI run against them."""

    root: Path
    env: dict[str, str]
    capsys: pytest.CaptureFixture[str]

    def file(self, host_path: str, text: str) -> Path:
        path = self.root / host_path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def socket(self, host_path: str) -> None:
        path = self.root / host_path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, stat.S_IFSOCK | 0o600)

    def kubeconfig(
        self,
        server: str,
        user: dict[str, Any],
        *,
        ca: Path | None = None,
        path: str = "/root/.kube/config",
        context: str = "admin@test",
    ) -> None:
        cluster: dict[str, Any] = {"server": server}
        if ca is not None:
            cluster["certificate-authority-data"] = base64.b64encode(ca.read_bytes()).decode()
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": "u", "user": user}],
            "contexts": [{"name": context, "context": {"cluster": "test", "user": "u"}}],
            "current-context": context,
        }
        self.file(path, yaml.safe_dump(document))

    def run(self, *args: str) -> tuple[int, str, str]:
        """`gpunode ARGS`: the exit code, stdout and stderr; never a traceback or a token."""
        host = Host(root=self.root, runner=ScriptedRunner(), env=dict(self.env), euid=0)
        code = main(list(args), host=host)
        out, err = self.capsys.readouterr()
        for text in (out, err):
            assert TOKEN not in text and VIEWER_TOKEN not in text
            assert "Traceback" not in text
        return code, out, err

    def advertise(self, *args: str) -> tuple[int, str, str]:
        return self.run("node", "advertise", *args)

    def withdraw(self, *args: str) -> tuple[int, str, str]:
        return self.run("node", "withdraw", *args)


@pytest.fixture(autouse=True)
def token_never_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    assert TOKEN not in caplog.text and VIEWER_TOKEN not in caplog.text


@pytest.fixture
def node(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_nvml: Callable[..., None]) -> Node:
    """A DGX A100 (8 GPUs) named gpu-node-1 in /etc/hostname, no credentials yet."""
    fake_nvml("dgx-a100")
    n = Node(root=tmp_path / "root", env={"HOME": "/root", "PATH": "/usr/sbin:/usr/bin"}, capsys=capsys)
    n.file("/etc/hostname", f"{NODE}\n")
    return n


@pytest.fixture
def admin(node: Node, api: ApiServer, pki: Pki) -> Node:
    """The node with an admin kubeconfig (token, the cluster's CA inline) in /root/.kube/config."""
    node.kubeconfig(api.url, {"token": TOKEN}, ca=pki.ca.cert)
    return node


def calls(api: ApiServer, since: int = 0) -> list[tuple[str, str, str | None, int]]:
    return [(r.method, r.path, r.content_type, r.status) for r in api.requests[since:]]


def patches(requests: list[LoggedRequest]) -> list[LoggedRequest]:
    return [r for r in requests if r.method == "PATCH"]


def without_version(node: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(node)
    del result["metadata"]["resourceVersion"]
    return result


def set_capacity(api: ApiServer, resource: str, value: str) -> None:
    """The node's capacity and allocatable of `resource`, as someone else (kubelet, a person) sets them."""

    def change(node: dict[str, Any]) -> None:
        for kind in ("capacity", "allocatable"):
            node["status"][kind][resource] = value

    api.modify_node(NODE, change)


# -- advertise --------------------------------------------------------------------------------------


def test_advertise_sets_capacity_allocatable_and_labels(admin: Node, api: ApiServer) -> None:
    before = api.node(NODE)
    code, out, err = admin.advertise()
    assert code == ExitCode.OK, err
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == f"node {NODE} (from /etc/hostname)"
    assert "set /status/capacity/nvidia.com~1gpu = 8" in lines
    assert "set /status/allocatable/nvidia.com~1gpu = 8" in lines
    assert "label nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB" in lines
    assert sum(line.startswith("label ") for line in lines) == len(DGX_LABELS)

    after = api.node(NODE)
    status = after["status"]
    assert status["capacity"] == {**before["status"]["capacity"], GPU: "8"}
    assert status["allocatable"] == {**before["status"]["allocatable"], GPU: "8"}
    assert after["metadata"]["labels"] == {**before["metadata"]["labels"], **DGX_LABELS}
    assert after["metadata"]["annotations"] == {
        **before["metadata"]["annotations"],
        MANAGED_ANNOTATION: ",".join(sorted(DGX_LABELS)),
        CAPACITY_ANNOTATION: GPU,
    }
    assert after["spec"] == before["spec"]

    # Read, JSON patch of the status subresource; read, merge patch of the node. All as the token's user.
    assert calls(api) == [
        ("GET", f"/api/v1/nodes/{NODE}", None, 200),
        ("PATCH", f"/api/v1/nodes/{NODE}/status", JSON_PATCH, 200),
        ("GET", f"/api/v1/nodes/{NODE}", None, 200),
        ("PATCH", f"/api/v1/nodes/{NODE}", MERGE_PATCH, 200),
    ]
    assert {(r.user, r.authenticated_by) for r in api.requests} == {("admin", "token")}
    status_patch = api.requests[1].body
    # Quantities are strings, guarded by the resourceVersion that was read.
    assert status_patch == [
        {
            "op": "replace",
            "path": "/metadata/resourceVersion",
            "value": before["metadata"]["resourceVersion"],
        },
        {"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": "8"},
        {"op": "add", "path": "/status/allocatable/nvidia.com~1gpu", "value": "8"},
    ]


def test_second_advertise_changes_nothing_and_sends_no_patch(admin: Node, api: ApiServer) -> None:
    assert admin.advertise()[0] == ExitCode.OK
    version = api.node(NODE)["metadata"]["resourceVersion"]
    seen = len(api.requests)

    code, out, _ = admin.advertise()
    assert code == ExitCode.OK
    assert out == f"node {NODE} (from /etc/hostname)\nalready advertised as wanted: nothing to change\n"
    assert [r.method for r in api.requests[seen:]] == ["GET", "GET"]
    assert api.node(NODE)["metadata"]["resourceVersion"] == version


def test_a_status_without_allocatable_gets_one(admin: Node, api: ApiServer) -> None:
    api.modify_node(NODE, lambda n: n["status"].pop("allocatable"))
    code, out, err = admin.advertise("--no-labels")
    assert code == ExitCode.OK, err
    assert out.splitlines()[1:] == [
        "set /status/capacity/nvidia.com~1gpu = 8",
        "set /status/allocatable/nvidia.com~1gpu = 8",
    ]
    assert api.node(NODE)["status"]["allocatable"] == {GPU: "8"}


def test_client_certificate_from_the_kubeconfig(node: Node, api: ApiServer, pki: Pki) -> None:
    # A kubelet's own identity, with the certificate and key as files next to the kubeconfig.
    user = pki.client(f"system:node:{NODE}", ["system:nodes"])
    api.allow(f"system:node:{NODE}", "*", "*")
    node.file("/etc/kubernetes/pki/client.crt", user.cert.read_text())
    node.file("/etc/kubernetes/pki/client.key", user.key.read_text())
    node.file("/etc/kubernetes/pki/ca.crt", pki.ca.cert.read_text())
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "k",
                "cluster": {"server": api.url, "certificate-authority": "/etc/kubernetes/pki/ca.crt"},
            }
        ],
        "users": [
            {
                "name": "kubelet",
                "user": {"client-certificate": "pki/client.crt", "client-key": "pki/client.key"},
            }
        ],
        "contexts": [{"name": "kubelet", "context": {"cluster": "k", "user": "kubelet"}}],
        "current-context": "kubelet",
    }
    node.file("/etc/kubernetes/kubelet.conf", yaml.safe_dump(document))

    code, _, err = node.advertise()
    assert code == ExitCode.OK, err
    assert api.node(NODE)["status"]["capacity"][GPU] == "8"
    assert {(r.user, r.authenticated_by, r.sent_authorization) for r in api.requests} == {
        (f"system:node:{NODE}", "certificate", False)
    }


def test_kubeconfig_and_context_options(node: Node, api: ApiServer, pki: Pki) -> None:
    # --kubeconfig names a file (under the root) and --context a context that is not the current one.
    node.kubeconfig(api.url, {"token": VIEWER_TOKEN}, ca=pki.ca.cert, path="/etc/gpunode/kube.yaml")
    document = yaml.safe_load((node.root / "etc/gpunode/kube.yaml").read_text())
    document["users"].append({"name": "admin", "user": {"token": TOKEN}})
    document["contexts"].append({"name": "as-admin", "context": {"cluster": "test", "user": "admin"}})
    node.file("/etc/gpunode/kube.yaml", yaml.safe_dump(document))

    code, _, err = node.advertise("--kubeconfig", "/etc/gpunode/kube.yaml", "--context", "as-admin")
    assert code == ExitCode.OK, err
    assert {r.user for r in api.requests} == {"admin"}
    assert api.node(NODE)["status"]["allocatable"][GPU] == "8"


def test_kubeconfig_from_the_environment(node: Node, api: ApiServer, pki: Pki) -> None:
    node.kubeconfig(api.url, {"token": TOKEN}, ca=pki.ca.cert, path="/etc/gpunode/admin.conf")
    node.env["KUBECONFIG"] = "/nonexistent.conf:/etc/gpunode/admin.conf"
    code, _, err = node.advertise()
    assert code == ExitCode.OK, err
    assert api.node(NODE)["metadata"]["labels"]["nvidia.com/gpu.count"] == "8"


def test_plain_http_server_like_kubectl_proxy(node: Node, pki: Pki) -> None:
    # A kubeconfig with a token is there too: over plain http it must not be sent.
    node.kubeconfig("https://127.0.0.1:1", {"token": TOKEN}, ca=pki.ca.cert)
    with ApiServer(None, proxy_user="proxied") as proxy:
        proxy.allow("proxied", "*", "*")
        proxy.add_node(NODE)
        code, out, err = node.advertise("--server", proxy.url)
        assert code == ExitCode.OK, err
        assert "set /status/capacity/nvidia.com~1gpu = 8" in out
        held = proxy.node(NODE)
        assert held["status"]["capacity"][GPU] == held["status"]["allocatable"][GPU] == "8"
        assert held["metadata"]["labels"]["nvidia.com/gpu.family"] == "ampere"
        assert [r.method for r in proxy.requests] == ["GET", "PATCH", "GET", "PATCH"]
        assert not any(r.sent_authorization for r in proxy.requests)

        code, out, _ = node.withdraw("--server", f"{proxy.url}/")
        assert code == ExitCode.OK
        assert GPU not in proxy.node(NODE)["status"]["capacity"]


def test_count_overrides_what_nvml_reports(admin: Node, api: ApiServer) -> None:
    code, out, _ = admin.advertise("--count", "3")
    assert code == ExitCode.OK
    assert "set /status/capacity/nvidia.com~1gpu = 3" in out
    held = api.node(NODE)
    assert held["status"]["capacity"][GPU] == held["status"]["allocatable"][GPU] == "3"
    assert held["metadata"]["labels"]["nvidia.com/gpu.count"] == "8"  # the labels still say what is there

    code, _, err = admin.advertise("--count", "-1")
    assert code == ExitCode.USAGE
    assert "cannot be negative" in err
    assert api.node(NODE)["status"]["capacity"][GPU] == "3"


def test_custom_resource_name(admin: Node, api: ApiServer) -> None:
    code, out, _ = admin.advertise("--resource", "example.com/accel", "--count", "2", "--no-labels")
    assert code == ExitCode.OK
    assert "set /status/capacity/example.com~1accel = 2" in out
    held = api.node(NODE)
    assert held["status"]["capacity"]["example.com/accel"] == "2" and GPU not in held["status"]["capacity"]
    assert held["metadata"]["annotations"][CAPACITY_ANNOTATION] == "example.com/accel"

    assert admin.advertise()[0] == ExitCode.OK  # both are recorded, so withdraw takes both back
    assert api.node(NODE)["metadata"]["annotations"][CAPACITY_ANNOTATION] == f"example.com/accel,{GPU}"
    assert admin.withdraw()[0] == ExitCode.OK
    capacity = api.node(NODE)["status"]["capacity"]
    assert "example.com/accel" not in capacity and GPU not in capacity


def test_no_labels_needs_no_nvml_with_a_count(
    admin: Node, api: ApiServer, fake_nvml: Callable[..., None]
) -> None:
    fake_nvml("no-driver")
    before = api.node(NODE)
    code, out, err = admin.advertise("--no-labels", "--count", "4")
    assert code == ExitCode.OK, err
    assert "label" not in out
    after = api.node(NODE)
    assert after["status"]["capacity"][GPU] == "4"
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    assert MANAGED_ANNOTATION not in after["metadata"]["annotations"]
    assert after["metadata"]["annotations"][CAPACITY_ANNOTATION] == GPU

    # Without --count the GPUs must be counted, and NVML cannot: exit 7, no request at all.
    seen = len(api.requests)
    code, _, err = admin.advertise("--no-labels")
    assert code == ExitCode.NVML
    assert err.startswith("gpunode: error: ")
    assert len(api.requests) == seen


def test_no_capacity_sets_only_the_labels(admin: Node, api: ApiServer) -> None:
    before = api.node(NODE)
    code, out, _ = admin.advertise("--no-capacity")
    assert code == ExitCode.OK
    assert "/status/" not in out
    after = api.node(NODE)
    assert after["status"] == before["status"]
    assert after["metadata"]["labels"] == {**before["metadata"]["labels"], **DGX_LABELS}
    assert CAPACITY_ANNOTATION not in after["metadata"]["annotations"]
    assert [r.method for r in api.requests] == ["GET", "GET", "PATCH"]
    assert patches(api.requests)[0].path == f"/api/v1/nodes/{NODE}"


def test_no_labels_and_no_capacity_is_a_usage_error(admin: Node, api: ApiServer) -> None:
    code, _, err = admin.advertise("--no-labels", "--no-capacity")
    assert code == ExitCode.USAGE
    assert "leaves nothing to advertise" in err
    assert api.requests == []


def test_only_extended_resources_are_touched(admin: Node, api: ApiServer) -> None:
    # kubelet's own resources are never gpunode's to set or remove.
    before = api.node(NODE)
    for args in (["advertise", "--resource", "memory", "--count", "0"], ["withdraw", "--resource", "cpu"]):
        code, _, err = admin.run("node", *args)
        assert code == ExitCode.USAGE
        assert "must be <domain>/<name>" in error_line(err)
    code, _, err = admin.advertise("--resource", "kubernetes.io/gpu", "--no-labels")
    assert code == ExitCode.USAGE and "reserved by Kubernetes" in err
    assert api.requests == []

    # Nor when the record names them: the annotation is anyone's to edit.
    assert admin.advertise()[0] == ExitCode.OK
    api.modify_node(
        NODE, lambda n: n["metadata"]["annotations"].update({CAPACITY_ANNOTATION: f"cpu,{GPU},pods"})
    )
    code, out, _ = admin.withdraw()
    assert code == ExitCode.OK
    assert [line for line in out.splitlines() if line.startswith("remove /")] == [
        "remove /status/capacity/nvidia.com~1gpu",
        "remove /status/allocatable/nvidia.com~1gpu",
    ]
    assert api.node(NODE)["status"] == before["status"]


# -- stale labels and withdraw ------------------------------------------------------------------------


def test_stale_labels_go_when_the_gpus_change_and_others_stay(
    admin: Node, api: ApiServer, fake_nvml: Callable[..., None]
) -> None:
    assert admin.advertise()[0] == ExitCode.OK

    def someone_else(node: dict[str, Any]) -> None:
        node["metadata"]["labels"]["nvidia.com/gpu.deploy.dcgm"] = "true"  # ours by name, not by record
        node["metadata"]["labels"]["team"] = "ml"

    api.modify_node(NODE, someone_else)

    # The GPUs changed: four L4s, no MIG.
    fake_nvml("pcie-4")
    code, out, _ = admin.advertise()
    assert code == ExitCode.OK
    assert "label nvidia.com/gpu.product=NVIDIA-L4" in out
    labels = api.node(NODE)["metadata"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-L4"
    assert labels["nvidia.com/gpu.count"] == "4"
    assert labels["nvidia.com/mig.capable"] == "false"
    assert api.node(NODE)["status"]["capacity"][GPU] == "4"

    # Then none at all: every GPU label but presence and count is stale.
    fake_nvml("no-gpu")
    code, out, _ = admin.advertise()
    assert code == ExitCode.OK
    assert "remove label nvidia.com/gpu.product" in out
    assert "remove label nvidia.com/cuda.driver-version.full" in out
    held = api.node(NODE)
    assert {k: v for k, v in held["metadata"]["labels"].items() if k.startswith("nvidia.com/")} == {
        "nvidia.com/gpu.present": "false",
        "nvidia.com/gpu.count": "0",
        "nvidia.com/gpu.deploy.dcgm": "true",
    }
    assert held["metadata"]["labels"]["team"] == "ml"
    assert (
        held["metadata"]["annotations"][MANAGED_ANNOTATION] == "nvidia.com/gpu.count,nvidia.com/gpu.present"
    )
    assert held["status"]["capacity"][GPU] == held["status"]["allocatable"][GPU] == "0"


def test_withdraw_removes_exactly_what_gpunode_set(admin: Node, api: ApiServer) -> None:
    def others(node: dict[str, Any]) -> None:
        node["metadata"]["labels"].update({"team": "ml", "nvidia.com/gpu.deploy.dcgm": "true"})
        node["metadata"]["annotations"]["example.com/owner"] = "alice"
        for kind in ("capacity", "allocatable"):
            node["status"][kind]["example.com/fpga"] = "2"

    api.modify_node(NODE, others)
    before = without_version(api.node(NODE))
    assert admin.advertise()[0] == ExitCode.OK
    # Someone labels the node the way GFD would, after gpunode: it is theirs, not gpunode's.
    api.modify_node(NODE, lambda n: n["metadata"]["labels"].update({"nvidia.com/gpu.machine": "DGX-A100"}))
    seen = len(api.requests)

    code, out, err = admin.withdraw()
    assert code == ExitCode.OK, err
    lines = out.splitlines()
    assert lines[0] == f"node {NODE} (from /etc/hostname)"
    assert "remove /status/capacity/nvidia.com~1gpu" in lines
    assert "remove /status/allocatable/nvidia.com~1gpu" in lines
    assert sorted(line for line in lines if line.startswith("remove label ")) == [
        f"remove label {k}" for k in sorted(DGX_LABELS)
    ]
    after = without_version(api.node(NODE))
    before["metadata"]["labels"]["nvidia.com/gpu.machine"] = "DGX-A100"
    assert after == before
    assert [r.method for r in api.requests[seen:]] == ["GET", "PATCH", "GET", "PATCH"]

    code, out, _ = admin.withdraw()
    assert code == ExitCode.OK
    assert out.endswith("nothing gpunode advertised is left on it: nothing to change\n")
    assert not patches(api.requests[seen + 4 :])


def test_withdraw_an_explicit_resource(admin: Node, api: ApiServer) -> None:
    # A capacity set by hand before gpunode: withdraw takes it back only when named.
    set_capacity(api, GPU, "8")
    code, out, _ = admin.withdraw()
    assert code == ExitCode.OK and "nothing to change" in out
    assert api.node(NODE)["status"]["capacity"][GPU] == "8"

    code, out, _ = admin.withdraw("--resource", GPU)
    assert code == ExitCode.OK
    assert "remove /status/capacity/nvidia.com~1gpu" in out
    assert GPU not in api.node(NODE)["status"]["capacity"]
    assert GPU not in api.node(NODE)["status"]["allocatable"]


# -- dry run and JSON ---------------------------------------------------------------------------------


def test_dry_run_reads_only(admin: Node, api: ApiServer) -> None:
    before = api.node(NODE)
    code, out, _ = admin.advertise("--dry-run")
    assert code == ExitCode.OK
    lines = out.splitlines()
    assert "would set /status/capacity/nvidia.com~1gpu = 8" in lines
    assert "would label nvidia.com/gpu.count=8" in lines
    assert lines[-1] == "dry run: nothing was changed"
    assert [r.method for r in api.requests] == ["GET"]
    assert api.node(NODE) == before

    assert admin.advertise()[0] == ExitCode.OK
    seen = len(api.requests)
    code, out, _ = admin.withdraw("--dry-run")
    assert code == ExitCode.OK
    assert "would remove /status/allocatable/nvidia.com~1gpu" in out
    assert "would remove label nvidia.com/gpu.product" in out
    assert [r.method for r in api.requests[seen:]] == ["GET"]
    assert api.node(NODE)["status"]["capacity"][GPU] == "8"


def test_json_output(admin: Node, api: ApiServer) -> None:
    code, out, _ = admin.advertise("--json", "--dry-run")
    assert code == ExitCode.OK
    planned = json.loads(out)
    assert planned["changed"] is False and planned["dry_run"] is True
    assert not patches(api.requests)

    code, out, _ = admin.advertise("--json")
    assert code == ExitCode.OK
    result = json.loads(out)
    jsonschema.validate(result, schemas.load("node-advertise"))
    assert set(result) == {
        "schema",
        "node",
        "node_source",
        "resource",
        "count",
        "capacity_before",
        "status_patch",
        "node_patch",
        "labels_set",
        "labels_removed",
        "changed",
        "dry_run",
        "warnings",
        "error",
    }
    assert result["schema"] == "gpunode.node-advertise/v1" and result["error"] is None
    assert result["node"] == NODE and result["node_source"] == "/etc/hostname"
    assert result["resource"] == GPU and result["count"] == 8 and result["capacity_before"] is None
    assert result["status_patch"] == [
        {"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": "8"},
        {"op": "add", "path": "/status/allocatable/nvidia.com~1gpu", "value": "8"},
    ]
    assert result["status_patch"] == planned["status_patch"]
    assert result["node_patch"]["metadata"]["labels"] == DGX_LABELS
    assert result["changed"] is True and result["dry_run"] is False and result["warnings"] == []

    code, out, _ = admin.advertise("--json", "--count", "6")
    again = json.loads(out)
    assert again["capacity_before"] == "8" and again["node_patch"] is None and again["changed"] is True

    code, out, _ = admin.withdraw("--json")
    withdrawn = json.loads(out)
    jsonschema.validate(withdrawn, schemas.load("node-withdraw"))
    assert withdrawn["resource"] == GPU and withdrawn["changed"] is True
    assert withdrawn["status_patch"] == [
        {"op": "remove", "path": "/status/capacity/nvidia.com~1gpu"},
        {"op": "remove", "path": "/status/allocatable/nvidia.com~1gpu"},
    ]
    assert withdrawn["node_patch"]["metadata"]["annotations"] == {
        MANAGED_ANNOTATION: None,
        CAPACITY_ANNOTATION: None,
    }

    code, out, _ = admin.withdraw("--json")
    assert json.loads(out)["changed"] is False

    # A failure is one document too: the error with its exit code, nothing changed.
    code, out, _ = admin.advertise("--json", "--node", "no-such-node")
    failed = json.loads(out)
    jsonschema.validate(failed, schemas.load("node-advertise"))
    assert code == ExitCode.API and failed["error"]["exit_code"] == code and failed["changed"] is False


# -- a device plugin that owns the resource -------------------------------------------------------------


def test_warning_when_kubelet_has_a_plugin_for_the_resource(admin: Node, api: ApiServer) -> None:
    checkpoint = {
        "Data": {"PodDeviceEntries": None, "RegisteredDevices": {GPU: [f"GPU-{i}" for i in range(8)]}},
        "Checksum": 1234,
    }
    admin.file(CHECKPOINT, json.dumps(checkpoint))
    code, out, _ = admin.advertise()
    assert code == ExitCode.OK
    warning = next(line for line in out.splitlines() if line.startswith("warning: "))
    assert f"a device plugin has registered {GPU} with kubelet" in warning
    assert "--no-capacity" in warning
    assert api.node(NODE)["status"]["capacity"][GPU] == "8"  # a warning: it still did what it was asked

    code, out, _ = admin.advertise("--no-capacity", "--json")
    assert json.loads(out)["warnings"] == []  # the labels are no plugin's business

    code, out, _ = admin.advertise("--resource", "example.com/other", "--no-labels")
    assert "warning" not in out


@pytest.mark.parametrize(
    "socket_name", ["nvidia-gpu.sock", "gpunode-nvidia.com-gpu.sock"], ids=["nvidia", "gpunode"]
)
def test_warning_when_a_plugin_socket_serves_the_resource(
    admin: Node, api: ApiServer, socket_name: str
) -> None:
    admin.socket(f"/var/lib/kubelet/device-plugins/{socket_name}")
    code, out, _ = admin.advertise("--json")
    assert code == ExitCode.OK
    (warning,) = json.loads(out)["warnings"]
    assert f"/var/lib/kubelet/device-plugins/{socket_name}" in warning


def test_a_checkpoint_that_is_not_json_is_no_plugin(admin: Node, api: ApiServer) -> None:
    admin.file(CHECKPOINT, "\x00garbage")
    code, out, _ = admin.advertise("--json")
    assert code == ExitCode.OK and json.loads(out)["warnings"] == []


# -- the node's name ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Naming:
    """Files under the root, $NODE_NAME and arguments; the node name gpunode must come to, and from where."""

    files: dict[str, str]
    name: str
    source: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()


OVERRIDE = "kubelet's --hostname-override"
KUBEADM_FLAGS = "/var/lib/kubelet/kubeadm-flags.env"
NAMINGS = {
    "hostname": Naming({"/etc/hostname": "GPU-Node-1\n"}, "gpu-node-1", "/etc/hostname"),
    "kubeadm-flags": Naming(
        {
            "/etc/hostname": "wrong\n",
            KUBEADM_FLAGS: 'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint='
            'unix:///run/containerd/containerd.sock --hostname-override=Override-1 --v=2"\n',
        },
        "override-1",
        OVERRIDE,
    ),
    "etc-default-kubelet": Naming(
        {
            "/etc/hostname": "wrong\n",
            "/etc/default/kubelet": "# KUBELET_EXTRA_ARGS=--hostname-override=commented\n"
            "KUBELET_EXTRA_ARGS='--hostname-override override-2'\n",
        },
        "override-2",
        OVERRIDE,
    ),
    "config-yaml": Naming(
        {
            "/etc/hostname": "wrong\n",
            "/var/lib/kubelet/config.yaml": "apiVersion: kubelet.config.k8s.io/v1beta1\n"
            "kind: KubeletConfiguration\nhostnameOverride: Override-3\n",
        },
        "override-3",
        OVERRIDE,
    ),
    # The flag wins over the config file, as in kubelet.
    "flag-over-config": Naming(
        {
            KUBEADM_FLAGS: 'KUBELET_KUBEADM_ARGS="--hostname-override=override-1"\n',
            "/var/lib/kubelet/config.yaml": "hostnameOverride: override-3\n",
        },
        "override-1",
        OVERRIDE,
    ),
    # kubeadm's drop-in passes $KUBELET_EXTRA_ARGS (/etc/default/kubelet) last, and the last flag counts.
    "extra-args-over-kubeadm": Naming(
        {
            KUBEADM_FLAGS: 'KUBELET_KUBEADM_ARGS="--hostname-override=override-1"\n',
            "/etc/default/kubelet": "KUBELET_EXTRA_ARGS=--hostname-override=first --hostname-override=last\n",
        },
        "last",
        OVERRIDE,
    ),
    "env": Naming(
        {KUBEADM_FLAGS: 'KUBELET_KUBEADM_ARGS="--hostname-override=override-1"\n'},
        "from-env",
        "$NODE_NAME",
        env={"NODE_NAME": "from-env"},
    ),
    "flag": Naming(
        {"/etc/hostname": "wrong\n"},
        "explicit",
        "--node",
        env={"NODE_NAME": "from-env"},
        args=("--node", "explicit"),
    ),
}


@pytest.mark.parametrize("case", NAMINGS.values(), ids=NAMINGS.keys())
def test_node_name_resolution_order(admin: Node, api: ApiServer, case: Naming) -> None:
    (admin.root / "etc/hostname").unlink()
    for path, text in case.files.items():
        admin.file(path, text)
    admin.env.update(case.env)
    api.add_node(case.name)
    code, out, err = admin.advertise("--json", *case.args)
    assert code == ExitCode.OK, err
    result = json.loads(out)
    assert (result["node"], result["node_source"]) == (case.name, case.source)
    name = case.name
    assert {r.path for r in api.requests} == {f"/api/v1/nodes/{name}", f"/api/v1/nodes/{name}/status"}
    assert api.node(name)["status"]["capacity"][GPU] == "8"


def test_no_node_name_at_all(admin: Node, api: ApiServer) -> None:
    (admin.root / "etc/hostname").unlink()
    code, _, err = admin.advertise()
    assert code == ExitCode.USAGE
    assert err.splitlines()[0].startswith("gpunode: error: cannot tell this node's name")
    assert "--node NAME" in err
    assert api.requests == []


# -- errors: one clear line, exit 9 (6 for no credentials), no traceback, no token --------------------


def error_line(err: str) -> str:
    lines = err.splitlines()
    assert lines[0].startswith("gpunode: error: ")
    assert all(line.startswith("  fix: ") for line in lines[1:]) and len(lines) <= 2, err
    return lines[0]


def test_403_names_the_verb_and_resource(node: Node, api: ApiServer, pki: Pki) -> None:
    node.kubeconfig(api.url, {"token": VIEWER_TOKEN}, ca=pki.ca.cert)
    before = api.node(NODE)
    code, out, err = node.advertise()
    assert code == ExitCode.API
    line = error_line(err)
    assert 'user "viewer" may not patch nodes/status' in line and f'node "{NODE}"' in line
    assert "clusterrole" in err  # the fix says how to grant it
    assert out == ""
    assert api.node(NODE) == before

    api.modify_node(NODE, lambda n: n["status"]["capacity"].update({GPU: "8"}))
    code, _, err = node.withdraw("--resource", GPU)
    assert code == ExitCode.API and "may not patch nodes/status" in error_line(err)


def test_404_names_the_node(admin: Node, api: ApiServer) -> None:
    code, out, err = admin.advertise("--node", "no-such-node")
    assert code == ExitCode.API
    assert error_line(err) == (
        f'gpunode: error: node "no-such-node" does not exist in the cluster at {api.url}'
    )
    assert "kubectl get nodes" in err and out == ""

    code, _, err = admin.withdraw("--node", "no-such-node", "--dry-run")
    assert code == ExitCode.API and '"no-such-node" does not exist' in err


def test_401_names_where_the_credentials_came_from(node: Node, api: ApiServer, pki: Pki) -> None:
    node.kubeconfig(api.url, {"token": "revoked-token-3e1"}, ca=pki.ca.cert)
    code, _, err = node.advertise()
    assert code == ExitCode.API
    line = error_line(err)
    assert "rejected the credentials" in line and "/root/.kube/config" in line
    assert "revoked-token-3e1" not in err


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends: nothing listens there


def test_unreachable_server_names_the_url(node: Node, pki: Pki) -> None:
    # The CLI's own retry policy: a refused connection is final at once (no "tried 5 times").
    url = f"https://127.0.0.1:{closed_port()}"
    node.kubeconfig(url, {"token": TOKEN}, ca=pki.ca.cert)
    code, _, err = node.advertise()
    assert code == ExitCode.API
    assert error_line(err) == (
        f"gpunode: error: cannot reach the Kubernetes API at {url}/api/v1/nodes/{NODE}: connection refused"
    )

    code, _, err = node.withdraw("--server", f"http://127.0.0.1:{closed_port()}")
    assert code == ExitCode.API and "cannot reach the Kubernetes API at http://127.0.0.1:" in err


def test_untrusted_server_certificate(node: Node, api: ApiServer, tmp_path: Path) -> None:
    other = Pki.create(tmp_path / "other-ca", name="someone-else")
    node.kubeconfig(api.url, {"token": TOKEN}, ca=other.ca.cert)
    code, _, err = node.advertise()
    assert code == ExitCode.API
    assert "certificate verification failed" in error_line(err)
    assert not patches(api.requests)


def test_no_credentials_lists_where_it_looked(node: Node) -> None:
    code, out, err = node.advertise()
    assert code == ExitCode.NOT_FOUND
    line = error_line(err)
    assert line.startswith("gpunode: error: no Kubernetes API credentials were found; looked at: ")
    for place in (
        "/root/.kube/config (does not exist)",
        "/etc/kubernetes/kubelet.conf (does not exist)",
        "/etc/rancher/k3s/k3s.yaml (does not exist)",
        "the in-cluster service account",
    ):
        assert place in line
    assert "--kubeconfig" in err and out == ""

    node.env["KUBECONFIG"] = "/etc/missing.conf"
    code, _, err = node.withdraw()
    assert code == ExitCode.NOT_FOUND and "$KUBECONFIG=/etc/missing.conf (no such file)" in err


# -- hostile servers and secrets --------------------------------------------------------------------------


def test_a_server_that_trickles_its_answer_ends_in_exit_9(admin: Node, api: ApiServer) -> None:
    # The deadline shortened with kubectl's flag, so that the test takes a second, not 35.
    before = api.node(NODE)
    api.trickle_next(0.25, limit=20.0)  # each byte well within the read timeout
    code, out, err = admin.advertise("--request-timeout", "1s")
    assert code == ExitCode.API
    assert error_line(err) == (
        f"gpunode: error: the Kubernetes API at {api.url}/api/v1/nodes/{NODE} did not send its whole answer "
        "within 1 s"
    )
    assert out == "" and api.node(NODE) == before
    assert api.streamed < 200  # cut off, not read for the 20 s the server would go on


def test_a_server_that_sends_a_gigabyte_ends_in_exit_9(admin: Node, api: ApiServer) -> None:
    before = api.node(NODE)
    api.flood_next(announce=2**30)
    code, _, err = admin.advertise()
    assert code == ExitCode.API
    assert error_line(err).startswith(
        f"gpunode: error: the answer from {api.url}/api/v1/nodes/{NODE} is larger than 16 MiB"
    )
    api.flood_next(announce=None)  # chunked, no length: stopped by counting
    code, _, err = admin.withdraw()
    assert code == ExitCode.API and "is larger than 16 MiB," in error_line(err)
    assert api.node(NODE) == before
    assert api.streamed < 2 * 64 * 2**20


def test_a_token_with_a_line_break_is_never_shown_not_even_with_debug(
    node: Node, api: ApiServer, pki: Pki
) -> None:
    halves = ("first-half-0b7e-never-shown", "second-half-4d4d-never-shown")
    node.kubeconfig(api.url, {"token": f"{halves[0]}\n{halves[1]}"}, ca=pki.ca.cert)
    host = Host(root=node.root, runner=ScriptedRunner(), env=dict(node.env), euid=0)
    code = main(["--debug", "node", "advertise"], host=host)
    out, err = node.capsys.readouterr()
    assert code == ExitCode.CONFIG
    assert "holds a space, line break, control or non-ASCII character" in err
    assert "Traceback" in err  # --debug printed the chain: and not a piece of the token is in it
    for half in halves:
        assert half not in err and half not in out
    assert api.requests == []


def test_withdraw_removes_the_plugins_gpuhealthy_condition_only(admin: Node, api: ApiServer) -> None:
    """The plugin's GPUHealthy condition (issue 18) goes with the GPUs; kubelet's conditions stay."""

    def plugin_wrote(node: dict[str, Any]) -> None:
        node["status"]["conditions"].append(
            {"type": "GPUHealthy", "status": "False", "reason": "GPUUnhealthy", "message": "1 unhealthy: ..."}
        )
        node["status"]["conditions"].append({"type": "MemoryPressure", "status": "False"})

    api.modify_node(NODE, plugin_wrote)
    code, out, err = admin.withdraw()
    assert code == ExitCode.OK, err
    assert "remove condition GPUHealthy" in out.splitlines()
    assert [c["type"] for c in api.node(NODE)["status"]["conditions"]] == ["Ready", "MemoryPressure"]
    patch = next(r for r in api.requests if r.method == "PATCH" and r.path.endswith("/status"))
    assert patch.content_type == JSON_PATCH
    assert {"op": "test", "path": "/status/conditions/1/type", "value": "GPUHealthy"} in patch.body
    code, out, _ = admin.withdraw()
    assert code == ExitCode.OK and "nothing to change" in out
