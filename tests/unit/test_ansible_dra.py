"""gpunode_dra, the collection's DRA module, run by real ansible-playbook (local connection) with the real
gpunode (`dra classes --apply --json`) against the test API server (tests/kubeapi) over TLS, serving
resource.k8s.io/v1 DeviceClasses with an admin token and the Node authorizer's rules for a kubelet.

One play, its tasks in order: a check-mode run, an apply, a second apply and a second check-mode run, and a
run with the node's own credentials. What the server holds and the requests it logged afterwards, and each
task's registered result, are what is checked: check mode writes nothing and says what would change, diff
mode shows the classes before and after, `changed` is true only for the run that wrote, and the kubeconfig
secret is in no result.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.dra import CLASSES
from tests.kubeapi.pki import Pki

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPUNODE = BIN / "gpunode"
TOKEN = "admin-token-7f3a-never-in-a-result"  # noqa: S105 (a test token, followed through the results)
NODE = "gpu-node-1"
KUBELET_CONF = "/etc/kubernetes/kubelet.conf"
# NVIDIA's chart's selector for full GPUs, as a class applied before v1 had extendedResourceName carries it.
GPU_CEL = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
MANAGED = {"app.kubernetes.io/managed-by": "gpunode"}

# (task name, arguments besides the kubeconfig's, check mode, the node's credentials instead of the admin's)
TASKS: list[tuple[str, dict[str, Any], bool, bool]] = [
    ("planned", {}, True, False),
    ("applied", {}, False, False),
    ("again", {}, False, False),
    ("again_check", {}, True, False),
    ("denied", {}, False, True),
]


def kubeconfig(server: str, user: dict[str, Any], ca: Path) -> str:
    cluster = {"server": server, "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": "u", "user": user}],
            "contexts": [{"name": "c", "context": {"cluster": "test", "user": "u"}}],
            "current-context": "c",
        }
    )


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ApiServer]:
    pki = Pki.create(tmp_path / "pki")
    with ApiServer(pki, tokens={TOKEN: "admin"}, allow=[("admin", "*", "*")]) as server:
        server.node_identity(NODE)
        server.add_node(NODE)
        yield server


def play(tmp_path: Path, api: ApiServer) -> tuple[dict[str, Any], str]:
    """Run TASKS in one play on a node under a temp root (the module's `root`); each task's result and
    what ansible-playbook printed."""
    assert api.pki is not None
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    cert = api.pki.client(f"system:node:{NODE}", ["system:nodes"])
    node_user = {
        "client-certificate-data": base64.b64encode(cert.cert.read_bytes()).decode(),
        "client-key-data": base64.b64encode(cert.key.read_bytes()).decode(),
    }
    kubelet_conf = root / KUBELET_CONF.lstrip("/")
    kubelet_conf.parent.mkdir(parents=True)
    kubelet_conf.write_text(kubeconfig(api.url, node_user, api.pki.ca.cert))
    admin = kubeconfig(api.url, {"token": TOKEN}, api.pki.ca.cert)
    namespace = tmp_path / "collections" / "ansible_collections" / "gpunode"
    namespace.mkdir(parents=True)
    (namespace / "gpunode").symlink_to(REPO / "ansible")
    tasks: list[dict[str, Any]] = []
    for name, args, check_mode, as_node in TASKS:
        credentials = {"kubeconfig": KUBELET_CONF} if as_node else {"kubeconfig_content": admin}
        tasks.append(
            {
                "name": name,
                "gpunode.gpunode.gpunode_dra": {
                    "state": "classes",
                    **args,
                    **credentials,
                    "root": str(root),
                    "gpunode_path": str(GPUNODE),
                },
                "check_mode": check_mode,
                "diff": True,
                "register": name,
                "ignore_errors": True,
            }
        )
    results = tmp_path / "results.json"
    everything = "{" + ", ".join(f"'{name}': {name}" for name, *_ in TASKS) + "}"
    tasks.append(
        {
            "name": "results",
            "ansible.builtin.copy": {"content": "{{ " + everything + " | to_json }}", "dest": str(results)},
            "check_mode": False,
            "diff": False,
        }
    )
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [{"name": "dra", "hosts": "localhost", "gather_facts": False, "tasks": tasks}], sort_keys=False
        )
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": str(tmp_path),
        "ANSIBLE_HOME": str(tmp_path / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
        "ANSIBLE_COLLECTIONS_PATH": str(tmp_path / "collections"),
        "ANSIBLE_NOCOLOR": "1",
    }
    if os.environ.get("PYTHONPATH"):  # gpunode from the checkout under test (docs/contributing/tests.md)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    run = subprocess.run(
        [str(BIN / "ansible-playbook"), "-v", "-i", "localhost,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", str(playbook)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert not (root / "run/gpunode-ansible").exists(), "the kubeconfig's file outlived the run"
    found: dict[str, Any] = json.loads(results.read_text())
    return found, run.stdout


@pytest.fixture
def ansible_playbook() -> None:
    if not os.access(BIN / "ansible-playbook", os.X_OK):
        why = "ansible-playbook is missing: ansible-core is in the [dev] extras (./install.sh --dev)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


@pytest.mark.usefixtures("ansible_playbook")
def test_classes_planned_applied_once_and_refused_to_a_node(tmp_path: Path, api: ApiServer) -> None:
    # NVIDIA's gpu class as applied before v1 had extendedResourceName, with a label another tool set.
    api.dra.put(
        CLASSES,
        {
            "metadata": {"name": "gpu.nvidia.com", "labels": {"team": "ml"}},
            "spec": {"selectors": [{"cel": {"expression": GPU_CEL}}]},
        },
    )
    results, printed = play(tmp_path, api)

    # Check mode: --apply --dry-run; it says what would change, and the diff shows it.
    planned = results["planned"]
    assert not planned.get("failed"), planned
    # The kubeconfig's text reached gpunode as a file inside the root, never as an argument.
    assert planned["cmd"][1:] == [
        "--root", str(tmp_path / "root"), "dra", "classes", "--apply",
        "--kubeconfig", "/run/gpunode-ansible/kubeconfig_content", "--json", "--dry-run",
    ]  # fmt: skip
    assert planned["changed"] is True
    assert planned["gpunode"]["changed"] is False and planned["gpunode"]["dry_run"] is True
    assert planned["applied"] == [
        {"name": "gpu.nvidia.com", "action": "update"},
        {"name": "mig.nvidia.com", "action": "create"},
    ]
    assert planned["msg"] == "deviceclasses: gpu.nvidia.com would be updated, mig.nvidia.com would be created"
    update, create = planned["diff"]
    lines = update["prepared"].splitlines()
    assert lines[0] == "--- deviceclass/gpu.nvidia.com (cluster)"
    assert "+  extendedResourceName: nvidia.com/gpu" in lines
    assert "+    app.kubernetes.io/managed-by: gpunode" in lines
    assert "     team: ml" in lines  # kept: context, not removed
    assert create["before_header"] == create["after_header"] == "deviceclass/mig.nvidia.com"
    assert create["before"] == ""
    mig = json.loads(create["after"])
    assert mig["metadata"] == {"name": "mig.nvidia.com", "labels": MANAGED}
    assert mig["spec"]["selectors"][0]["cel"]["expression"].endswith(".type == 'mig'")

    # The apply: what check mode said, done; changed.
    applied = results["applied"]
    assert not applied.get("failed"), applied
    assert applied["changed"] is True and applied["gpunode"]["changed"] is True
    assert "--dry-run" not in applied["cmd"]
    assert applied["msg"] == "deviceclasses: gpu.nvidia.com updated, mig.nvidia.com created"
    assert [d.get("before_header") for d in applied["diff"]] == [None, "deviceclass/mig.nvidia.com"]
    gpu = api.dra.get(CLASSES, "gpu.nvidia.com")
    assert gpu is not None and gpu["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert gpu["metadata"]["labels"] == {"team": "ml", **MANAGED}
    stored_mig = api.dra.get(CLASSES, "mig.nvidia.com")
    assert stored_mig is not None and stored_mig["spec"] == mig["spec"]

    # A second run, and a second check-mode run: nothing to do, changed false, no diff.
    for name in ("again", "again_check"):
        again = results[name]
        assert not again.get("failed"), again
        assert again["changed"] is False, again
        assert again["diff"] == [], again
        assert (
            again["msg"]
            == "deviceclasses: gpu.nvidia.com already as wanted, mig.nvidia.com already as wanted"
        )
    # Of all five runs, only the apply wrote: one update and one create.
    writes = [(r.method, r.path) for r in api.requests if r.method != "GET"]
    assert writes == [
        ("PUT", "/apis/resource.k8s.io/v1/deviceclasses/gpu.nvidia.com"),
        ("POST", "/apis/resource.k8s.io/v1/deviceclasses"),
    ]

    # A node's own credentials may not touch DeviceClasses: gpunode's message and fix, exit code 9.
    denied = results["denied"]
    assert denied["failed"] is True and denied["changed"] is False
    assert denied["exit_code"] == 9 and denied["rc"] == 9
    assert f'user "system:node:{NODE}" may not get deviceclasses' in denied["msg"]
    assert denied["fix"].startswith("a node's credentials cannot read or write DeviceClasses")
    assert denied["cmd"][-3:] == ["--kubeconfig", KUBELET_CONF, "--json"]

    # The admin token (kubeconfig_content) is in no result, nor in anything ansible-playbook printed.
    assert TOKEN not in json.dumps(results)
    assert TOKEN not in printed
