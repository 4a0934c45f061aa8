"""The collection's modules run by real ansible-playbook (local connection) against a stand-in gpunode that
prints recorded --json documents, each valid against gpunode's own schema (gpunode/schemas/).

For the modules and cases the fleet test (tests/integration/test_ansible_fleet.py) cannot reach without a
GPU, kubelet, an API server or NVIDIA's repositories: toolkit, plugin, node, up, down, doctor's
fail_on_unhealthy, gpunode failing or printing no document. The stand-in records each argument list it
was given (the module's command line is part of what is checked) and, for --kubeconfig, what the file held
and its mode, so the kubeconfig_content secret can be followed: on the target in a 0600 file, gone after
the run, and nowhere in the results.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpunode import schemas

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SECRET = "token-ab12cd34ef56-never-in-a-result"  # noqa: S105 - made up, followed through the results
KUBECONFIG = f"""\
apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "https://127.0.0.1:6443"}}}}]
users: [{{name: u, user: {{token: {SECRET}}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
"""
ERROR_9 = {
    "message": "the Kubernetes API at https://127.0.0.1:6443 refused the request: 403 Forbidden",
    "fix": "give the credentials permission to patch nodes/status",
    "exit_code": 9,
}
TOOLKIT_DIFF = (
    "--- /dev/null\n+++ b/etc/apt/sources.list.d/nvidia-container-toolkit.list\n@@ -0,0 +1 @@\n+deb x /\n"
)
PLUGIN_TOML = "[time-slicing]\nreplicas = 4\n"
UNIT_PATH = "/etc/systemd/system/gpunode-device-plugin.service"
UNIT_TEXT = "[Service]\nExecStart=/usr/local/bin/gpunode plugin run\n"
TOOLKIT_PACKAGES = ["nvidia-container-toolkit", "nvidia-container-toolkit-base"]


def toolkit(*, dry_run: bool, changed: bool, installed: str | None) -> dict[str, Any]:
    todo = installed is None
    return {
        "schema": "gpunode.toolkit-install/v1",
        "changed": changed,
        "dry_run": dry_run,
        "error": None,
        "distribution": "debian 12",
        "package_manager": "apt",
        "packages": dict.fromkeys(TOOLKIT_PACKAGES, installed),
        "version": installed,
        "wanted": "1.17.8",
        "key_fingerprints": [],
        "files": [
            {
                "path": "/etc/apt/sources.list.d/nvidia-container-toolkit.list",
                "action": "write" if todo else "unchanged",
                "diff": TOOLKIT_DIFF if todo else "",
                "mode": "0644",
            }
        ],
        "commands": [
            {
                "argv": ["apt-get", "install", "-y", "nvidia-container-toolkit=1.17.8-1"],
                "env": {},
                "title": "install",
            }
        ]
        if todo
        else [],
        "drift": [],
        "warnings": [],
        "notes": [],
    }


def plugin_install(*, dry_run: bool, action: str) -> dict[str, Any]:
    return {
        "schema": "gpunode.plugin-install/v1",
        "changed": not dry_run and action != "unchanged",
        "dry_run": dry_run,
        "error": None,
        "files": [
            {
                "path": "/etc/systemd/system/gpunode-device-plugin.service",
                "action": action,
                "content": "[Service]\nExecStart=/opt/gpunode/bin/gpunode plugin run\n",
            }
        ],
        "commands": [
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", "gpunode-device-plugin.service"],
        ],
        "remove": [],
        "wait_ready": False,
        "notes": [],
    }


def advertise(*, dry_run: bool, capacity_before: int | None, count: int) -> dict[str, Any]:
    todo = capacity_before != count
    return {
        "schema": "gpunode.node-advertise/v1",
        "changed": not dry_run and todo,
        "dry_run": dry_run,
        "error": None,
        "node": "gpu-1",
        "node_source": "--node",
        "resource": "nvidia.com/gpu",
        "count": count,
        "capacity_before": capacity_before,
        "status_patch": [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(count)}]
        if todo
        else [],
        "node_patch": {"metadata": {"labels": {"nvidia.com/gpu.count": str(count)}}} if todo else None,
        "labels_set": {"nvidia.com/gpu.count": str(count)} if todo else {},
        "labels_removed": [],
        "warnings": [],
    }


def step(name: str, status: str, details: list[str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "status": status,
        "summary": f"{name}: {status}",
        "details": details or [],
        "warnings": [],
        "fix": None,
        "result": None,
    }


def check(id_: str, status: str, fix: str | None = None) -> dict[str, Any]:
    return {"id": id_, "status": status, "summary": f"{id_} is {status}", "detail": None, "fix": fix}


# name -> (the document gpunode prints, its exit status). Each is validated against its schema first.
RESPONSES: dict[str, tuple[dict[str, Any], int]] = {
    "toolkit-plan": (toolkit(dry_run=True, changed=False, installed=None), 0),
    "toolkit-installed": (toolkit(dry_run=False, changed=False, installed="1.17.8"), 0),
    "plugin-plan": (plugin_install(dry_run=True, action="create"), 0),
    "plugin-unchanged": (plugin_install(dry_run=False, action="unchanged"), 0),
    "plugin-uninstall": (
        {
            "schema": "gpunode.plugin-uninstall/v1",
            "changed": True,
            "dry_run": False,
            "error": None,
            "files": [],
            "commands": [["systemctl", "disable", "--now", "gpunode-device-plugin.service"]],
            "remove": ["/etc/systemd/system/gpunode-device-plugin.service"],
            "wait_ready": False,
            "notes": [],
        },
        0,
    ),
    "advertise-plan": (advertise(dry_run=True, capacity_before=None, count=8), 0),
    "advertise-done": (advertise(dry_run=False, capacity_before=8, count=8), 0),
    "advertise-forbidden": (
        {"schema": "gpunode.node-advertise/v1", "changed": False, "dry_run": False, "error": ERROR_9},
        9,
    ),
    "up-plan": (
        {
            "schema": "gpunode.up/v1",
            "changed": False,
            "dry_run": True,
            "error": None,
            "steps": [
                step("preflight", "done"),
                step("runtime", "to do", ["--- a/etc/containerd/config.toml", "+runtimes.nvidia"]),
                step("plugin", "to do", ["write /etc/systemd/system/gpunode-device-plugin.service"]),
            ],
        },
        0,
    ),
    "up-done": (
        {
            "schema": "gpunode.up/v1",
            "changed": True,
            "dry_run": False,
            "error": None,
            "steps": [step("preflight", "done"), step("runtime", "done now"), step("plugin", "done")],
        },
        0,
    ),
    "down-nothing": (
        {
            "schema": "gpunode.down/v1",
            "changed": False,
            "dry_run": False,
            "error": None,
            "steps": [step("plugin", "skipped"), step("runtime", "done")],
        },
        0,
    ),
    "doctor-unhealthy": (
        {
            "schema": "gpunode.doctor/v1",
            "changed": False,
            "dry_run": False,
            "error": None,
            "healthy": False,
            "counts": {"ok": 1, "warn": 0, "fail": 1, "skip": 0},
            "checks": [
                check("os.distribution", "ok"),
                check("nvml.init", "fail", "install the NVIDIA driver"),
            ],
        },
        1,
    ),
}

# The stand-in gpunode: records its arguments (and a --kubeconfig file's content and mode), then prints the
# response the task named in FAKE_GPUNODE_RESPONSE, or crashes without a document when told to.
FAKE = """#!{python}
import json, os, stat, sys
argv = sys.argv[1:]
record = {{"argv": argv}}
path = argv[argv.index("--kubeconfig") + 1] if "--kubeconfig" in argv else None
if path and os.path.exists(path):
    record["kubeconfig"] = open(path).read()
    record["kubeconfig_mode"] = stat.S_IMODE(os.stat(path).st_mode)
root = argv[argv.index("--root") + 1] if "--root" in argv else ""
config = argv[argv.index("--config") + 1] if "--config" in argv else None
if config and config.startswith("/run/gpunode-ansible/"):
    record["config"] = open(root + config).read()
    record["config_mode"] = stat.S_IMODE(os.stat(root + config).st_mode)
with open(os.environ["FAKE_GPUNODE_LOG"], "a") as log:
    log.write(json.dumps(record) + "\\n")
name = os.environ["FAKE_GPUNODE_RESPONSE"]
if name == "crash":
    sys.stderr.write("Traceback (most recent call last):\\nRuntimeError: boom\\n")
    sys.exit(70)
document, rc = json.load(open(os.environ["FAKE_GPUNODE_RESPONSES"]))[name]
print(json.dumps(document))
sys.exit(rc)
"""

# (task name, module, arguments, check mode, response). Run in one play, in this order.
TASKS: list[tuple[str, str, dict[str, Any], bool, str]] = [
    ("toolkit_check", "gpunode_toolkit", {"version": "1.17.8"}, True, "toolkit-plan"),
    ("toolkit_again", "gpunode_toolkit", {"version": "1.17.8"}, False, "toolkit-installed"),
    (
        "plugin_check",
        "gpunode_plugin",
        {"config": "/etc/gpunode/p.toml", "start": False},
        True,
        "plugin-plan",
    ),
    ("plugin_again", "gpunode_plugin", {}, False, "plugin-unchanged"),
    (
        "plugin_content",
        "gpunode_plugin",
        {"config_content": PLUGIN_TOML, "root": "{{ target_root }}"},
        True,
        "plugin-plan",
    ),
    (
        "plugin_absent",
        "gpunode_plugin",
        {"state": "absent", "root": "{{ target_root }}"},
        False,
        "plugin-uninstall",
    ),
    (
        "node_check",
        "gpunode_node",
        {"node": "gpu-1", "kubeconfig_content": KUBECONFIG},
        True,
        "advertise-plan",
    ),
    (
        "node_again",
        "gpunode_node",
        {"node": "gpu-1", "kubeconfig_content": KUBECONFIG},
        False,
        "advertise-done",
    ),
    (
        "node_denied",
        "gpunode_node",
        {"kubeconfig": "/etc/kubernetes/kubelet.conf"},
        False,
        "advertise-forbidden",
    ),
    ("up_check", "gpunode_up", {"runtime": "containerd", "toolkit_version": "1.17.8"}, True, "up-plan"),
    ("up_apply", "gpunode_up", {"runtime": "containerd", "labels": False}, False, "up-done"),
    ("down_nothing", "gpunode_down", {"toolkit": True}, False, "down-nothing"),
    ("doctor_facts", "gpunode_doctor", {}, False, "doctor-unhealthy"),
    ("doctor_strict", "gpunode_doctor", {"fail_on_unhealthy": True}, False, "doctor-unhealthy"),
    ("crash", "gpunode_runtime", {"runtime": "containerd"}, False, "crash"),
]


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    playbook_tool = BIN / "ansible-playbook"
    if not os.access(playbook_tool, os.X_OK):
        why = f"{playbook_tool} is missing: ansible-core is in the [dev] extras (./install.sh --dev)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    top = tmp_path_factory.mktemp("modules")
    # The collection straight from the source tree, where Ansible looks for gpunode.gpunode.
    namespace = top / "collections" / "ansible_collections" / "gpunode"
    namespace.mkdir(parents=True)
    (namespace / "gpunode").symlink_to(REPO / "ansible")
    (top / "root" / "run").mkdir(parents=True)  # an image gpunode is given with --root
    # The unit plugin_absent's recorded document removes, as it is on the target: the diff's "before".
    unit = top / "root" / UNIT_PATH.lstrip("/")
    unit.parent.mkdir(parents=True)
    unit.write_text(UNIT_TEXT)
    fake = top / "gpunode"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    responses = top / "responses.json"
    responses.write_text(json.dumps(RESPONSES))
    tasks: list[dict[str, Any]] = []
    for name, module, args, check_mode, response in TASKS:
        tasks.append(
            {
                "name": name,
                f"gpunode.gpunode.{module}": {**args, "gpunode_path": str(fake)},
                "check_mode": check_mode,
                "diff": True,
                "environment": {"FAKE_GPUNODE_RESPONSE": response},
                "register": name,
                "ignore_errors": True,
            }
        )
    results = top / "results.json"
    everything = "{" + ", ".join(f"'{name}': {name}" for name, *_ in TASKS) + "}"
    tasks.append(
        {
            "name": "results",
            "ansible.builtin.copy": {"content": "{{ " + everything + " | to_json }}", "dest": str(results)},
            "check_mode": False,
            "diff": False,
        }
    )
    play = [{"name": "modules", "hosts": "localhost", "gather_facts": False, "tasks": tasks}]
    (top / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    log = top / "calls.jsonl"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": str(top),
        "ANSIBLE_HOME": str(top / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(top / "ansible-tmp"),
        "ANSIBLE_COLLECTIONS_PATH": str(top / "collections"),
        "ANSIBLE_NOCOLOR": "1",
        "FAKE_GPUNODE_LOG": str(log),
        "FAKE_GPUNODE_RESPONSES": str(responses),
    }
    run = subprocess.run(
        [
            str(playbook_tool),
            "-v",  # every result printed: the secret must not be in any of them
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            "-e",
            f"target_root={top / 'root'}",
            str(top / "play.yml"),
        ],
        cwd=top,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return {
        "results": json.loads(results.read_text()),
        "calls": dict(zip([name for name, *_ in TASKS], calls, strict=True)),
        "stdout": run.stdout,
        "root": top / "root",
    }


@pytest.mark.parametrize("name", sorted(RESPONSES))
def test_recorded_documents_are_valid(name: str) -> None:
    document, _ = RESPONSES[name]
    command = document["schema"].removeprefix("gpunode.").removesuffix("/v1")
    jsonschema.validate(document, schemas.load(command))


def test_check_mode_runs_dry_run_and_reports_what_would_change(ran: dict[str, Any]) -> None:
    results, calls = ran["results"], ran["calls"]
    toolkit_check = results["toolkit_check"]
    assert calls["toolkit_check"]["argv"] == [
        "toolkit", "install", "--version", "1.17.8", "--yes", "--json", "--dry-run",
    ]  # fmt: skip
    assert toolkit_check["changed"] is True and not toolkit_check.get("failed")
    assert toolkit_check["msg"] == "nvidia-container-toolkit would be installed (1.17.8)"
    prepared = [d["prepared"] for d in toolkit_check["diff"] if "prepared" in d]
    assert prepared == [TOOLKIT_DIFF]
    packages = next(d for d in toolkit_check["diff"] if d.get("before_header") == "packages")
    assert packages["before"] == "nvidia-container-toolkit None\nnvidia-container-toolkit-base None\n"
    assert packages["after"] == "nvidia-container-toolkit 1.17.8\nnvidia-container-toolkit-base 1.17.8\n"

    plugin_check = results["plugin_check"]
    assert calls["plugin_check"]["argv"] == [
        "plugin", "install", "--no-start", "--config", "/etc/gpunode/p.toml", "--json", "--dry-run",
    ]  # fmt: skip
    assert plugin_check["changed"] is True
    (unit,) = plugin_check["diff"]
    assert unit["before"] == "" and unit["after"].startswith("[Service]\nExecStart=")

    # A config's text reaches gpunode as a file it can plan with, in check mode too: inside the root gpunode
    # is given (it reads every path there), at a name that is the same on every run (gpunode names the
    # file in the plugin.toml it translates from NVIDIA's YAML), private to root.
    content_call = calls["plugin_content"]
    root = str(ran["root"])
    assert content_call["argv"] == [
        "--root", root, "plugin", "install", "--config", "/run/gpunode-ansible/config_content",
        "--json", "--dry-run",
    ]  # fmt: skip
    assert content_call["config"] == PLUGIN_TOML
    assert content_call["config_mode"] == stat.S_IRUSR | stat.S_IWUSR
    assert not (ran["root"] / "run" / "gpunode-ansible").exists(), "the config's file outlived the run"
    assert results["plugin_content"]["changed"] is True

    up_check = results["up_check"]
    assert calls["up_check"]["argv"] == [
        "up", "--toolkit-version", "1.17.8", "--runtime", "containerd", "--yes", "--json", "--dry-run",
    ]  # fmt: skip
    assert up_check["changed"] is True and up_check["msg"] == "would do: runtime, plugin"
    assert [d["prepared"].splitlines()[0] for d in up_check["diff"]] == [
        "# runtime: runtime: to do (to do)",
        "# plugin: plugin: to do (to do)",
    ]
    assert "+runtimes.nvidia" in up_check["diff"][0]["prepared"]


def test_changed_is_gpunodes_own_outside_check_mode(ran: dict[str, Any]) -> None:
    results, calls = ran["results"], ran["calls"]
    for name in ("toolkit_again", "plugin_again", "node_again", "down_nothing"):
        assert results[name]["changed"] is False, (name, results[name])
        assert not results[name].get("failed"), (name, results[name])
        assert "--dry-run" not in calls[name]["argv"], name
    assert results["toolkit_again"]["msg"] == "nvidia-container-toolkit is already installed (1.17.8)"
    assert results["down_nothing"]["msg"] == "nothing to undo"
    assert calls["down_nothing"]["argv"] == ["down", "--toolkit", "--yes", "--json"]
    assert results["plugin_absent"]["changed"] is True
    assert calls["plugin_absent"]["argv"] == ["--root", str(ran["root"]), "plugin", "uninstall", "--json"]
    # The real content the file had before the run (read under the root), not a placeholder.
    assert results["plugin_absent"]["diff"] == [
        {
            "before_header": UNIT_PATH,
            "after_header": f"{UNIT_PATH} (removed)",
            "before": UNIT_TEXT,
            "after": "",
        }
    ]
    up_apply = results["up_apply"]
    assert up_apply["changed"] is True and up_apply["msg"] == "done: runtime"
    assert calls["up_apply"]["argv"] == ["up", "--runtime", "containerd", "--no-labels", "--yes", "--json"]
    assert up_apply["steps"] == [
        {"name": "preflight", "status": "done"},
        {"name": "runtime", "status": "done now"},
        {"name": "plugin", "status": "done"},
    ]


def test_node_diff_and_the_kubeconfig_secret(ran: dict[str, Any]) -> None:
    results, calls = ran["results"], ran["calls"]
    node_check = results["node_check"]
    assert node_check["changed"] is True
    assert node_check["diff"] == {
        "before": {"capacity": {"nvidia.com/gpu": None}},
        "after": {
            "capacity": {"nvidia.com/gpu": 8},
            "labels_set": {"nvidia.com/gpu.count": "8"},
            "labels_removed": [],
        },
    }
    for name in ("node_check", "node_again"):
        argv = calls[name]["argv"]
        # gpunode got the kubeconfig as a private file, never as an argument.
        assert argv[:5] == ["node", "advertise", "--node", "gpu-1", "--kubeconfig"], argv
        assert argv[5] == "/run/gpunode-ansible/kubeconfig_content", argv
        assert calls[name]["kubeconfig"] == KUBECONFIG
        assert calls[name]["kubeconfig_mode"] == stat.S_IRUSR | stat.S_IWUSR
        assert not Path(argv[5]).exists(), "the kubeconfig file outlived the run"
    # Not in any result, nor in anything ansible-playbook printed (the diffs included).
    assert SECRET not in json.dumps(results)
    assert SECRET not in ran["stdout"]


def test_failures_carry_gpunodes_error(ran: dict[str, Any]) -> None:
    results, calls = ran["results"], ran["calls"]
    denied = results["node_denied"]
    assert denied["failed"] is True
    assert denied["msg"] == ERROR_9["message"]
    assert denied["fix"] == ERROR_9["fix"]
    assert denied["exit_code"] == 9 and denied["rc"] == 9
    assert calls["node_denied"]["argv"] == [
        "node", "advertise", "--kubeconfig", "/etc/kubernetes/kubelet.conf", "--json",
    ]  # fmt: skip

    crash = results["crash"]
    assert crash["failed"] is True and crash["rc"] == 70
    assert crash["msg"].startswith("gpunode printed no JSON document (exit status 70): Traceback")


def test_doctor_facts_and_fail_on_unhealthy(ran: dict[str, Any]) -> None:
    results = ran["results"]
    facts = results["doctor_facts"]
    # Unhealthy is a finding: the task succeeds (rc 1 notwithstanding) and the facts say why.
    assert not facts["failed"] and facts["changed"] is False and facts["rc"] == 1
    assert facts["ansible_facts"]["gpunode_doctor"]["healthy"] is False
    assert [c["id"] for c in facts["ansible_facts"]["gpunode_doctor"]["checks"]] == [
        "os.distribution",
        "nvml.init",
    ]
    assert facts["failed_checks"] == ["nvml.init"]
    assert facts["msg"] == "unhealthy: 1 ok, 0 warn, 1 fail, 0 skip"
    strict = results["doctor_strict"]
    assert strict["failed"] is True
    assert strict["msg"] == (
        "gpunode doctor: unhealthy; failed: nvml.init (nvml.init is fail) fix: install the NVIDIA driver"
    )


MODULE_NAMES = ("doctor", "down", "dra", "node", "plugin", "runtime", "toolkit", "up")
# What an option's documentation may say; `required` for gpunode_dra's state, which has no default so
# that the states to come add choices without changing what an existing task does.
OPTION_KEYS = {"description", "type", "default", "choices", "required"}


def test_every_module_is_documented_for_ansible_doc(tmp_path: Path) -> None:
    """ansible-doc parses each module's DOCUMENTATION and RETURN (YAML in the module: a stray comma in a
    flow mapping silently makes a key of its own, or breaks the whole page)."""
    tool = BIN / "ansible-doc"
    if not os.access(tool, os.X_OK):
        why = f"{tool} is missing: ansible-core is in the [dev] extras (./install.sh --dev)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    namespace = tmp_path / "collections" / "ansible_collections" / "gpunode"
    namespace.mkdir(parents=True)
    (namespace / "gpunode").symlink_to(REPO / "ansible")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "ANSIBLE_HOME": str(tmp_path / "ansible-home"),
        "ANSIBLE_COLLECTIONS_PATH": str(tmp_path / "collections"),
    }
    names = [f"gpunode.gpunode.gpunode_{m}" for m in MODULE_NAMES]
    run = subprocess.run(
        [str(tool), "--json", *names], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr
    docs = json.loads(run.stdout)
    assert sorted(docs) == names
    for name, page in docs.items():
        options = page["doc"]["options"]
        assert {"gpunode_path", "root"} <= set(options), name
        for option, spec in options.items():
            assert set(spec) <= OPTION_KEYS, (name, option, spec)
            assert isinstance(spec["description"], (str, list)) and spec["description"], (name, option)
        assert all(set(r) == {"description", "returned", "type"} for r in page["return"].values()), name
    for name in ("gpunode_node", "gpunode_up", "gpunode_down", "gpunode_dra"):
        assert "kubeconfig_content" in docs[f"gpunode.gpunode.{name}"]["doc"]["options"]
    for name, page in docs.items():
        # Ansible's module conventions: what check and diff mode do, the platform, what the target needs.
        attributes = page["doc"]["attributes"]
        assert attributes["check_mode"]["support"] == "full", name
        assert attributes["diff_mode"]["support"] == ("none" if name.endswith("_doctor") else "full"), name
        assert attributes["platform"]["platforms"] == "posix", name
        assert page["doc"]["requirements"] and page["doc"]["notes"], name
    # The role's variables, from meta/argument_specs.yml, each with the default defaults/main.yml sets.
    role = subprocess.run(
        [str(tool), "-t", "role", "--json", "gpunode.gpunode.gpu_node"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert role.returncode == 0, role.stderr
    options = json.loads(role.stdout)["gpunode.gpunode.gpu_node"]["entry_points"]["main"]["options"]
    defaults = yaml.safe_load((REPO / "ansible/roles/gpu_node/defaults/main.yml").read_text())
    assert set(options) == set(defaults)
    for variable, value in defaults.items():
        assert options[variable].get("default") == value, variable
    assert options["gpunode_kubeconfig_content"]["no_log"] is True


# The real gpunode, through the modules, on a node under a temp root (the modules' `root`): containerd's
# stock config there, systemctl a stand-in that keeps which units are enabled (gpunode runs commands on this
# machine, also under --root), no GPU. Each play runs twice: the second run of every task must report
# changed=false and write nothing (no file under the root gets a new mtime).
FAKE_SYSTEMCTL = """#!/bin/sh
state="$(dirname "$0")/enabled-units"
touch "$state"
case "$1" in
  is-active) for u in "$@"; do [ "$u" = is-active ] || echo inactive; done; exit 3;;
  show)
    if grep -qx "$2" "$state"; then enabled=enabled; else enabled=disabled; fi
    printf 'LoadState=loaded\\nActiveState=inactive\\nSubState=dead\\nUnitFileState=%s\\n' "$enabled"
    printf 'MainPID=0\\nNRestarts=0\\nResult=success\\n';;
  enable) shift; for u in "$@"; do grep -qx "$u" "$state" || echo "$u" >> "$state"; done;;
  disable) shift; for u in "$@"; do [ "$u" = --now ] || sed -i "/^$u\\$/d" "$state"; done;;
  daemon-reload) ;;
  *) echo "unexpected systemctl $*" >&2; exit 1;;
esac
"""
# NVIDIA's device-plugin config as a template would give it: gpunode installs it translated to its TOML.
NVIDIA_YAML = """\
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
OLD_PLUGIN_TOML = "# an earlier plugin.toml, replaced by the play\n[time-slicing]\nreplicas = 2\n"
CONFIG = "/etc/containerd/config.toml"
PLUGIN_CONFIG = "/etc/gpunode/plugin.toml"
# name -> (module, arguments). The plays below name them in order.
REAL_TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "runtime": ("gpunode_runtime", {"runtime": "containerd", "set_as_default": True, "restart": False}),
    "plugin": ("gpunode_plugin", {"config_content": NVIDIA_YAML, "start": False}),
    "doctor": ("gpunode_doctor", {}),
    "plugin_absent": ("gpunode_plugin", {"state": "absent"}),
    "runtime_reverted": (
        "gpunode_runtime",
        {"runtime": "containerd", "state": "reverted", "restart": False},
    ),
    "runtime_absent": ("gpunode_runtime", {"runtime": "containerd", "state": "absent", "restart": False}),
}
APPLY = ("runtime", "plugin", "doctor")
UNDO = ("plugin_absent", "runtime_reverted")
NOTHING_TO_UNDO = ("plugin_absent", "runtime_reverted", "runtime_absent")


@dataclass
class RealNode:
    top: Path
    root: Path
    env: dict[str, str]

    def play(self, names: tuple[str, ...], *, check: bool = False) -> dict[str, Any]:
        """Run the named tasks in one play (diff mode on); return each one's registered result."""
        tasks: list[dict[str, Any]] = []
        for name in names:
            module, args = REAL_TASKS[name]
            tasks.append(
                {
                    "name": name,
                    f"gpunode.gpunode.{module}": {
                        **args,
                        "root": str(self.root),
                        "gpunode_path": str(GPUNODE),
                    },
                    "diff": True,
                    "check_mode": check,
                    "register": name,
                    "ignore_errors": True,
                }
            )
        results = self.top / "results.json"
        everything = "{" + ", ".join(f"'{name}': {name}" for name in names) + "}"
        tasks.append(
            {
                "name": "results",
                "ansible.builtin.copy": {
                    "content": "{{ " + everything + " | to_json }}",
                    "dest": str(results),
                },
                "check_mode": False,
                "diff": False,
            }
        )
        playbook = self.top / "play.yml"
        play = [{"name": "real", "hosts": "localhost", "gather_facts": False, "tasks": tasks}]
        playbook.write_text(yaml.safe_dump(play, sort_keys=False))
        run = subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local",
             "-e", f"ansible_python_interpreter={sys.executable}", str(playbook)],
            cwd=self.top, env=self.env, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        found: dict[str, Any] = json.loads(results.read_text())
        results.unlink()
        return found

    def files(self) -> dict[str, tuple[int, bytes]]:
        """Every file under the root with its mtime (ns) and content."""
        return {
            str(p.relative_to(self.root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(self.root.rglob("*"))
            if p.is_file()
        }


GPUNODE = BIN / "gpunode"


@pytest.fixture
def real_node(tmp_path: Path) -> RealNode:
    if not os.access(BIN / "ansible-playbook", os.X_OK):
        why = "ansible-playbook is missing: ansible-core is in the [dev] extras (./install.sh --dev)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (root / "etc/containerd").mkdir(parents=True)
    (root / CONFIG.lstrip("/")).write_bytes((REPO / "tests/fixtures/containerd/default-v2.toml").read_bytes())
    (root / PLUGIN_CONFIG.lstrip("/")).parent.mkdir(parents=True)
    (root / PLUGIN_CONFIG.lstrip("/")).write_text(OLD_PLUGIN_TOML)
    # gpunode installed in the image at the path its unit names: install under --root refuses a unit whose
    # ExecStart names a program the root lacks.
    program = root / str(GPUNODE).lstrip("/")
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "systemctl").write_text(FAKE_SYSTEMCTL)
    (fakebin / "systemctl").chmod(0o755)
    namespace = tmp_path / "collections" / "ansible_collections" / "gpunode"
    namespace.mkdir(parents=True)
    (namespace / "gpunode").symlink_to(REPO / "ansible")
    env = {
        # The stand-in systemctl first: gpunode runs commands on this machine even under --root.
        "PATH": f"{fakebin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "LANG": "C.UTF-8",
        "HOME": str(tmp_path),
        "ANSIBLE_HOME": str(tmp_path / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
        "ANSIBLE_COLLECTIONS_PATH": str(tmp_path / "collections"),
        "ANSIBLE_NOCOLOR": "1",
    }
    return RealNode(top=tmp_path, root=root, env=env)


def test_every_module_run_twice_changes_nothing_the_second_time(real_node: RealNode) -> None:
    planned = real_node.play(APPLY, check=True)
    assert [planned[n]["changed"] for n in APPLY] == [True, True, False], planned
    # Diff mode: the file's real text before (read under the root), and what gpunode would write.
    (unit_diff, config_diff) = planned["plugin"]["diff"]
    assert unit_diff["before"] == "" and "ExecStart=" in unit_diff["after"]
    assert config_diff["before_header"] == PLUGIN_CONFIG
    assert config_diff["before"] == OLD_PLUGIN_TOML
    assert "replicas = 4" in config_diff["after"]
    assert (real_node.root / PLUGIN_CONFIG.lstrip("/")).read_text() == OLD_PLUGIN_TOML

    first = real_node.play(APPLY)
    assert [first[n]["changed"] for n in APPLY] == [True, True, False], first
    assert not any(first[n].get("failed") for n in APPLY), first
    installed = (real_node.root / PLUGIN_CONFIG.lstrip("/")).read_text()
    # The YAML was given to gpunode as a file inside the root, and that file is gone after the run.
    assert installed.startswith(
        "# gpunode device-plugin config, translated from NVIDIA's /run/gpunode-ansible/config_content\n"
    ), installed
    assert not (real_node.root / "run/gpunode-ansible").exists()
    after_first = real_node.files()

    second = real_node.play(APPLY)
    for name in APPLY:
        assert second[name]["changed"] is False and not second[name].get("failed"), (name, second[name])
    assert real_node.files() == after_first, "the second run wrote a file"

    undone = real_node.play(UNDO)
    for name in UNDO:
        assert undone[name]["changed"] is True and not undone[name].get("failed"), (name, undone[name])
    # The removed unit's real text as the diff's before.
    removed = {d["before_header"]: d for d in undone["plugin_absent"]["diff"]}
    unit = "/etc/systemd/system/gpunode-device-plugin.service"
    assert removed[unit]["before"] == after_first[unit.lstrip("/")][1].decode()
    assert removed[unit]["after"] == ""
    config = (real_node.root / CONFIG.lstrip("/")).read_bytes()
    assert config == (REPO / "tests/fixtures/containerd/default-v2.toml").read_bytes()
    after_undo = real_node.files()

    # Nothing left to undo: the wanted state is there, so each is ok and changed=false, in check mode too.
    for check in (True, False):
        again = real_node.play(NOTHING_TO_UNDO, check=check)
        for name in NOTHING_TO_UNDO:
            assert again[name]["changed"] is False, (name, again[name])
            assert not again[name].get("failed"), (name, again[name])
        assert again["runtime_reverted"]["msg"].startswith("already reverted: "), again["runtime_reverted"]
        assert again["runtime_absent"]["msg"].startswith("already absent: "), again["runtime_absent"]
        assert real_node.files() == after_undo, "a run with nothing to undo wrote a file"


# ansible-test sanity, as Ansible's own collections run it: the tests that need no network but PyPI. Not
# pylint (its pinned requirements are large and it judges style ruff already judges), pslint and shellcheck
# (no PowerShell or shell code here), changelog (no changelog fragments: the collection has none).
SANITY_TESTS = (
    "validate-modules", "ansible-doc", "yamllint", "pep8", "import", "runtime-metadata", "compile",
    "shebang", "line-endings", "no-assert", "empty-init", "symlinks", "no-smart-quotes",
    "use-argspec-type-path", "action-plugin-docs", "no-illegal-filenames", "use-compat-six",
    "replace-urlopen", "no-get-exception", "ignores",
)  # fmt: skip
# ansible-test installs each test's pinned requirements (from PyPI) in a virtualenv of its own, bootstrapping
# pip there with a get-pip script it downloads from ci-files.testing.ansible.com, which is not reachable
# here. It reads that script from its cache first (its own message says to put it there); this stand-in
# does what get-pip does with the pip that Python ships (ensurepip), offline.
GET_PIP = "import ensurepip\n\nensurepip.bootstrap(upgrade=True)\n"


def test_ansible_test_sanity(tmp_path: Path) -> None:
    tool = BIN / "ansible-test"
    if not os.access(tool, os.X_OK):
        why = f"{tool} is missing: ansible-core is in the [dev] extras (./install.sh --dev)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    spec = importlib.util.find_spec("ansible_test")
    assert spec is not None and spec.origin is not None
    requirements = Path(spec.origin).parent / "_internal" / "python_requirements.py"
    match = re.search(r"pip='([0-9.]+)'", requirements.read_text())
    assert match, f"no pip version in {requirements}"
    home = tmp_path / "home"
    cache = home / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True)
    (cache / f"get_pip_{match[1].replace('.', '_')}.py").write_text(GET_PIP)
    # ansible-test runs in a collection's own tree: ansible_collections/<namespace>/<name>/, a copy (it
    # refuses a tree reached through a link, and writes tests/output there).
    collection = tmp_path / "ansible_collections" / "gpunode" / "gpunode"
    shutil.copytree(
        REPO / "ansible", collection, ignore=shutil.ignore_patterns("__pycache__", "tests/output")
    )
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    tests = [arg for name in SANITY_TESTS for arg in ("--test", name)]
    env = {"PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(home), "LANG": "C.UTF-8"}
    run = subprocess.run(
        [str(tool), "sanity", "--local", "--python", version, "--color", "no", *tests],
        cwd=collection, env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    for name in SANITY_TESTS:
        assert f'Running sanity test "{name}"' in run.stdout, (name, run.stdout)
    assert "Skipping" not in run.stdout + run.stderr, run.stdout + run.stderr
    # Every ignored check says why, and only the licence header is ignored.
    for line in (collection / "tests/sanity" / f"ignore-{_ansible_version()}.txt").read_text().splitlines():
        entry, _, why = line.partition(" # ")
        assert entry.endswith("validate-modules:missing-gplv3-license") and why, line


def _ansible_version() -> str:
    from ansible.release import __version__

    major, minor, *_ = __version__.split(".")
    return f"{major}.{minor}"
