"""`gpunode dra classes` end to end: the whole CLI in this process, a kubeconfig under a temp root, and the
test API server (tests/kubeapi) over real TLS serving resource.k8s.io/v1 DeviceClasses with the Node
authorizer's rules. What the server holds afterwards, and the requests it logged, are what is checked."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from tests.cli.test_cli_surface import completions
from tests.cli.test_json_contract import run_json
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.dra import CLASSES
from tests.kubeapi.pki import Pki

TOKEN = "admin-token-5e0b-never-shown"  # noqa: S105 (a test token)
NODE = "gpu-node-1"
KUBELET_CONF = "/etc/kubernetes/kubelet.conf"
# NVIDIA's chart's selectors (dra-driver-nvidia-gpu deployments/helm/.../deviceclass-*.yaml), word for word.
GPU_CEL = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
MIG_CEL = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(pki, tokens={TOKEN: "admin"}, allow=[("admin", "*", "*")]) as server:
        server.add_node(NODE)
        yield server


@pytest.fixture(autouse=True)
def token_never_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    assert TOKEN not in caplog.text


def kubeconfig(root: Path, path: str, server: str, user: dict[str, Any], ca: Path) -> None:
    cluster = {"server": server, "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "test", "user": "u"}}],
        "current-context": "c",
    }
    file = root / path.lstrip("/")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(yaml.safe_dump(document))


@pytest.fixture
def root(tmp_path: Path, api: ApiServer, pki: Pki) -> Path:
    """A machine with an admin kubeconfig in /root/.kube/config and its kubelet's in kubelet.conf."""
    kubeconfig(tmp_path, "/root/.kube/config", api.url, {"token": TOKEN}, pki.ca.cert)
    cert = pki.client(f"system:node:{NODE}", ["system:nodes"])
    b64 = {
        name: base64.b64encode(path.read_bytes()).decode()
        for name, path in (("c", cert.cert), ("k", cert.key))
    }
    user = {"client-certificate-data": b64["c"], "client-key-data": b64["k"]}
    kubeconfig(tmp_path, KUBELET_CONF, api.url, user, pki.ca.cert)
    return tmp_path


def host(root: Path) -> Host:
    return Host(root=root, runner=ScriptedRunner(), env={"HOME": "/root", "PATH": "/usr/bin"}, euid=0)


def run(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`gpunode dra classes ARGS`: the exit code, stdout and stderr; never a traceback or the token."""
    code = main(["dra", "classes", *args], host=host(root))
    out, err = capsys.readouterr()
    for text in (out, err):
        assert TOKEN not in text and "Traceback" not in text
    return code, out, err


def writes(api: ApiServer, since: int = 0) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in api.requests[since:] if r.method != "GET"]


def stored(api: ApiServer, name: str) -> dict[str, Any]:
    found = api.dra.get(CLASSES, name)
    assert found is not None, name
    return found


# -- printing ---------------------------------------------------------------------------------------------


def test_the_yaml_parses_and_the_server_accepts_it(
    root: Path, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(root, capsys)
    assert code == ExitCode.OK and err == ""
    assert api.requests == []  # printing asks nothing of the API
    documents = list(yaml.safe_load_all(out))
    assert [(d["apiVersion"], d["kind"], d["metadata"]["name"]) for d in documents] == [
        ("resource.k8s.io/v1", "DeviceClass", "gpu.nvidia.com"),
        ("resource.k8s.io/v1", "DeviceClass", "mig.nvidia.com"),
    ]
    gpu, mig = documents
    assert gpu["spec"] == {
        "selectors": [{"cel": {"expression": GPU_CEL}}],
        "extendedResourceName": "nvidia.com/gpu",
    }
    assert mig["spec"] == {"selectors": [{"cel": {"expression": MIG_CEL}}]}
    # As `kubectl apply -f -` sends them: the server's validation (selectors, extendedResourceName) passes.
    import requests

    for document in documents:
        answer = requests.post(
            api.url + "/apis/resource.k8s.io/v1/deviceclasses",
            json=document,
            headers={"Authorization": f"Bearer {TOKEN}"},
            verify=str(api.pki.ca.cert) if api.pki else False,
            timeout=10,
        )
        assert answer.status_code == 201, answer.text
    assert stored(api, "gpu.nvidia.com")["spec"] == gpu["spec"]


def test_another_driver_and_no_extended_resource(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(root, capsys, "--driver", "gpu.example.com", "--no-extended-resource")
    assert code == ExitCode.OK
    gpu, mig = yaml.safe_load_all(out)
    assert (gpu["metadata"]["name"], mig["metadata"]["name"]) == ("gpu.example.com", "mig.example.com")
    assert gpu["spec"] == {
        "selectors": [
            {
                "cel": {
                    "expression": "device.driver == 'gpu.example.com' && "
                    "device.attributes['gpu.example.com'].type == 'gpu'"
                }
            }
        ]
    }
    code, out, _ = run(root, capsys, "--driver", "dra.example.com")
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(out)]
    assert code == ExitCode.OK and names == ["dra.example.com", "mig.dra.example.com"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--driver", "GPU.nvidia.com"], "'GPU.nvidia.com' is not a valid DRA driver name"),
        (["--driver", "gpu.nvidia.com' || true || '"], "is not a valid DRA driver name"),
        (["--driver", "a" * 64], "is not a valid DRA driver name"),
        (["--driver", ""], "'' is not a valid DRA driver name"),
        (["--apply", "--driver", "gpu_nvidia"], "'gpu_nvidia' is not a valid DRA driver name"),
        (["--dry-run"], "--dry-run is for --apply"),
        (["--kubeconfig", KUBELET_CONF], "--kubeconfig is for --apply"),
        (["--server", "https://x", "--context", "c"], "--context, --server are for --apply"),
        (["--apply", "--request-timeout", "soon"], "--request-timeout"),
    ],
)
def test_usage_errors_come_first(
    root: Path, api: ApiServer, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(root, capsys, *args)
    assert code == ExitCode.USAGE, err
    assert out == "" and message in err.splitlines()[0]
    assert err.splitlines()[1].startswith("  fix: ")
    assert api.requests == []  # refused before the API was asked anything


# -- applying ---------------------------------------------------------------------------------------------


def test_node_credentials_are_refused_with_a_clear_message(
    root: Path, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(root, capsys, "--apply", "--kubeconfig", KUBELET_CONF)
    assert code == ExitCode.API and out == ""
    assert err == (
        f'gpunode: error: the Kubernetes API refused: user "system:node:{NODE}" may not get deviceclasses '
        f'(deviceclass "gpu.nvidia.com"; credentials from kubeconfig {KUBELET_CONF}, context "c")\n'
        "  fix: a node's credentials cannot read or write DeviceClasses: apply them with an admin kubeconfig "
        "(--kubeconfig PATH)\n"
    )
    assert [(r.method, r.status) for r in api.requests] == [("GET", 403)]
    assert api.dra.items(CLASSES) == []


def test_admin_applies_and_a_second_apply_changes_nothing(
    root: Path, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(root, capsys, "--apply")
    assert code == ExitCode.OK, err
    assert out == "deviceclass gpu.nvidia.com: created\ndeviceclass mig.nvidia.com: created\n"
    printed = list(yaml.safe_load_all(run(root, capsys)[1]))
    for wanted in printed:
        there = stored(api, wanted["metadata"]["name"])
        assert there["spec"] == wanted["spec"]
        assert there["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gpunode"}
    versions = {c["metadata"]["name"]: c["metadata"]["resourceVersion"] for c in api.dra.items(CLASSES)}

    since = len(api.requests)
    code, out, _ = run(root, capsys, "--apply")
    assert code == ExitCode.OK
    assert out == (
        "deviceclass gpu.nvidia.com: already as wanted, nothing to change\n"
        "deviceclass mig.nvidia.com: already as wanted, nothing to change\n"
    )
    assert writes(api, since) == [] and len(api.requests) - since == 2  # one GET each, nothing written
    assert versions == {
        c["metadata"]["name"]: c["metadata"]["resourceVersion"] for c in api.dra.items(CLASSES)
    }


def test_dry_run_shows_the_change_and_writes_nothing(
    root: Path, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # NVIDIA's chart rendered before v1 had extendedResourceName, with a label another tool set.
    api.dra.put(
        CLASSES,
        {
            "metadata": {"name": "gpu.nvidia.com", "labels": {"team": "ml"}},
            "spec": {"selectors": [{"cel": {"expression": GPU_CEL}}]},
        },
    )
    code, out, err = run(root, capsys, "--apply", "--dry-run")
    assert code == ExitCode.OK, err
    lines = out.splitlines()
    assert lines[0] == "deviceclass gpu.nvidia.com: would update"
    assert "+  extendedResourceName: nvidia.com/gpu" in lines
    assert "+    app.kubernetes.io/managed-by: gpunode" in lines
    assert "     team: ml" in lines  # kept: shown as context, not removed
    assert lines[-2:] == ["deviceclass mig.nvidia.com: would create", "dry run: nothing was changed"]
    assert writes(api) == []
    assert api.dra.get(CLASSES, "mig.nvidia.com") is None

    code, out, _ = run(root, capsys, "--apply")
    assert code == ExitCode.OK
    assert out.splitlines()[0] == "deviceclass gpu.nvidia.com: updated"
    gpu = stored(api, "gpu.nvidia.com")
    assert gpu["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert gpu["metadata"]["labels"] == {"team": "ml", "app.kubernetes.io/managed-by": "gpunode"}
    assert [method for method, _ in writes(api)] == ["PUT", "POST"]


# -- --json ------------------------------------------------------------------------------------------------


def test_json_documents(root: Path, api: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["dra", "classes", "--json"]
    code, printed = run_json("dra-classes", base, host(root), capsys)
    assert code == ExitCode.OK and not printed["changed"] and printed["applied"] == []
    assert [c["metadata"]["name"] for c in printed["classes"]] == ["gpu.nvidia.com", "mig.nvidia.com"]
    assert printed["driver"] == "gpu.nvidia.com"

    code, plan = run_json("dra-classes", [*base, "--apply", "--dry-run"], host(root), capsys)
    assert code == ExitCode.OK and plan["dry_run"] and not plan["changed"]
    assert [(a["action"], a["written"]) for a in plan["applied"]] == [("create", False)] * 2
    assert writes(api) == []

    code, done = run_json("dra-classes", [*base, "--apply"], host(root), capsys)
    assert code == ExitCode.OK and done["changed"]
    assert [(a["action"], a["written"]) for a in done["applied"]] == [("create", True)] * 2

    code, again = run_json("dra-classes", [*base, "--apply"], host(root), capsys)
    assert code == ExitCode.OK and not again["changed"]
    assert [a["action"] for a in again["applied"]] == ["unchanged"] * 2

    code, refused = run_json(
        "dra-classes", [*base, "--apply", "--kubeconfig", KUBELET_CONF], host(root), capsys
    )
    assert code == ExitCode.API and not refused["changed"]
    assert "may not get deviceclasses" in refused["error"]["message"]

    code, usage = run_json("dra-classes", [*base, "--dry-run"], host(root), capsys)
    assert code == ExitCode.USAGE and not usage["changed"] and "add --apply" in usage["error"]["fix"]


# -- the command line --------------------------------------------------------------------------------------


def test_shell_completion() -> None:
    assert completions(["gpunode", "dr"]) == ["dra"]
    assert completions(["gpunode", "dra", ""]) == [
        "classes",
        "run",
        "install",
        "uninstall",
        "status",
        "manifest",
    ]
    assert completions(["gpunode", "dra", "classes", "--driver", "g"]) == ["gpu.nvidia.com"]
    assert completions(["gpunode", "dra", "classes", "--no-e"]) == ["--no-extended-resource"]
    assert "--dry-run" in completions(["gpunode", "dra", "classes", "--d"])
