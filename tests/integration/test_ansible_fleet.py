"""Ansible (ansible-core from PyPI) drives a fleet of three machines through the gpunode collection.

Each machine is a real systemd booted with systemd-nspawn on a fresh tmpfs root with only the host's /usr
(tests/integration/nspawn.py), its own private network and no sshd: Ansible reaches it with the test tree's
connection plugin `gpunode_nsenter` (tests/integration/ansible_connection), which runs every command in the
namespaces of the machine's PID 1. Why not SSH: openssh-server would have to be installed on every
developer machine and in CI (a service package whose postinst enables and starts sshd on the host), and
every machine would need a network namespace, addresses and host keys; why not community.general's chroot:
it is only in the large `ansible` package (or Galaxy, which is not reachable here), and a chroot would see
neither the machine's mounts nor its systemd. The modules do not care how Ansible reached the host.

On each machine, as on a real node: gpunode where install.sh puts it (/opt/gpunode/bin/gpunode, a link to
this checkout's venv, which the machine sees at the same path), containerd.service running the test bed's
containerd 1.6 with the stock config (tests/integration/test_restart_systemd.py), and no GPU. The role
(ansible/roles/gpu_node) configures the NVIDIA runtime with the default restart and verifies with doctor,
and down.yml (gpunode_down) undoes it all;
the plugin service is installed and enabled but not started (it needs kubelet), the toolkit (needs NVIDIA's
repositories) and advertise (needs an API server) are off here, and those modules are tested against
gpunode's recorded JSON in tests/unit/test_ansible_modules.py.

The collection is built with `ansible-galaxy collection build` and installed from its tarball, and the
playbooks are ansible/examples/, the ones docs/fleets.md shows. Needs root, systemd-nspawn, nsenter, the
test bed's containerd and runc, and ansible-core ([dev] extras). Under CI a missing one fails the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import testbed, tomlread
from tests.integration import nspawn
from tests.integration.test_restart_systemd import (
    CONFIG,
    DAEMON,
    UNIT,
    cri_state,
    prerequisites,
    stock_config,
    unit_text,
)

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPUNODE = BIN / "gpunode"
EXAMPLES = REPO / "ansible" / "examples"
CONNECTION_PLUGINS = Path(__file__).resolve().parent / "ansible_connection"
HOSTS = ("node1", "node2", "node3")
# Ansible runs a few processes per task and host; three machines restarting containerd on 2 shared cores.
PLAYBOOK_TIMEOUT = 900
RECAP = re.compile(
    r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)"
    r"\s+failed=(?P<failed>\d+)\s+skipped=(?P<skipped>\d+)"
)
PLUGIN_SERVICE = "gpunode-device-plugin.service"
PLUGIN_UNIT = f"/etc/systemd/system/{PLUGIN_SERVICE}"
MODULES = ("doctor", "down", "dra", "node", "plugin", "runtime", "toolkit", "up")
# docs/fleets.md shows these exactly (test_docs_show_what_is_tested).
BUILD = (
    "ansible-galaxy collection build ansible/ --output-path dist",
    "ansible-galaxy collection install dist/gpunode-gpunode-0.1.0.tar.gz -p collections",
)
PLAN = "ansible-playbook -i inventory.ini site.yml --check --diff"
APPLY = "ansible-playbook -i inventory.ini site.yml --diff"
VERIFY = "ansible-playbook -i inventory.ini verify.yml"
DOWN_PLAN = "ansible-playbook -i inventory.ini down.yml --check --diff"
DOWN = "ansible-playbook -i inventory.ini down.yml --diff"
PLAYBOOKS = ("site.yml", "verify.yml", "down.yml")
ANSIBLE_CFG = """\
[defaults]
collections_path = collections
connection_plugins = tests/integration/ansible_connection
[connection]
pipelining = true
"""
# What the docs and the test use: the inventory's group variables for this fleet of machines without GPUs,
# kubelet or NVIDIA's repositories: no toolkit, the plugin service installed and enabled but not started
# (it would wait for kubelet's socket), doctor's facts without its verdict.
GROUP_VARS = """\
ansible_connection=gpunode_nsenter
ansible_python_interpreter=/usr/bin/python3
gpunode_runtime=containerd
gpunode_runtime_set_as_default=true
gpunode_toolkit_install=false
gpunode_plugin_start=false
gpunode_require_healthy=false
"""


def ansible_tool(name: str) -> Path:
    tool = BIN / name
    if not os.access(tool, os.X_OK):
        why = f"{tool} is missing: ansible-core is in the [dev] extras (./install.sh --dev)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return tool


@dataclass
class Fleet:
    workdir: Path  # ansible.cfg, inventory.ini, the playbooks; the commands run here
    machines: dict[str, nspawn.Container]
    env: dict[str, str]

    def playbook(self, command: str) -> Run:
        """Run one of the documented ansible-playbook command lines in the fleet's directory."""
        program, *args = shlex.split(command)
        assert program == "ansible-playbook"
        result = subprocess.run(
            [str(ansible_tool(program)), *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=PLAYBOOK_TIMEOUT,
            check=False,
        )
        return Run(result)


@dataclass(repr=False)
class Run:
    result: subprocess.CompletedProcess[str]

    @property
    def recap(self) -> dict[str, dict[str, int]]:
        found = {}
        for line in self.result.stdout.splitlines():
            match = RECAP.match(line)
            if match:
                found[match["host"]] = {k: int(v) for k, v in match.groupdict().items() if k != "host"}
        assert set(found) == set(HOSTS), f"no PLAY RECAP for every host:\n{self}"
        return found

    def __repr__(self) -> str:  # what an assertion prints: the whole run
        return f"exit {self.result.returncode}\n{self.result.stdout}\n{self.result.stderr}"


def boot_machine(stack: contextlib.ExitStack, workdir: Path, binds: list[nspawn.Bind]) -> nspawn.Container:
    box = stack.enter_context(nspawn.boot(workdir, binds=binds, name_prefix="gpunode-fleet"))
    box.env["PATH"] = testbed.path_with(*DAEMON, rest=nspawn.ENV["PATH"])
    # Where install.sh puts gpunode (its virtualenv under /opt/gpunode): the modules' default search finds
    # it there. /opt is the machine's own (its tmpfs root); the venv is this checkout's, bound in.
    link = box.path("/opt/gpunode/bin/gpunode")
    link.parent.mkdir(parents=True)
    link.symlink_to(GPUNODE)
    config = box.path(CONFIG)
    config.parent.mkdir(parents=True)
    config.write_bytes(stock_config())
    unit = box.path(f"/etc/systemd/system/{UNIT}")
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(unit_text())
    assert box.systemctl("daemon-reload").returncode == 0
    started = box.systemctl("start", UNIT)
    assert started.returncode == 0, f"{started.stderr}\n{box.journal(UNIT)}"
    return box


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    binds = prerequisites()
    galaxy = ansible_tool("ansible-galaxy")
    ansible_tool("ansible-playbook")
    with contextlib.ExitStack() as stack:
        machines = {host: boot_machine(stack, tmp_path / host, binds) for host in HOSTS}
        workdir = tmp_path / "fleet"
        workdir.mkdir()
        # The docs' commands run as written, from a directory where ansible/ and tests/ are the checkout's.
        (workdir / "ansible").symlink_to(REPO / "ansible")
        (workdir / "tests").symlink_to(REPO / "tests")
        for playbook in PLAYBOOKS:
            shutil.copy(EXAMPLES / playbook, workdir / playbook)
        (workdir / "ansible.cfg").write_text(ANSIBLE_CFG)
        # The machines' PATH: gpunode finds containerd and ctr there, as where they are installed.
        path = testbed.path_with(*DAEMON, rest=nspawn.ENV["PATH"])
        (workdir / "inventory.ini").write_text(
            "[gpu_nodes]\n"
            + "".join(f"{host} ansible_host={box.leader}\n" for host, box in machines.items())
            + "\n[gpu_nodes:vars]\n"
            + GROUP_VARS
            + f"ansible_nsenter_path={path}\n"
        )
        env = {
            "PATH": f"{BIN}:{os.environ.get('PATH', testbed.DEFAULT_PATH)}",
            "LANG": "C.UTF-8",
            "HOME": str(tmp_path / "home"),
            "ANSIBLE_CONFIG": str(workdir / "ansible.cfg"),
            "ANSIBLE_HOME": str(tmp_path / "ansible-home"),
            "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
            "ANSIBLE_NOCOLOR": "1",
        }
        # The collection built from ansible/ and installed from its tarball, as an operator would.
        for command in BUILD:
            argv = shlex.split(command)
            done = subprocess.run(
                [str(galaxy), *argv[1:]],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert done.returncode == 0, f"{command}:\n{done.stdout}{done.stderr}"
        modules = workdir / "collections/ansible_collections/gpunode/gpunode/plugins/modules"
        assert sorted(p.name for p in modules.glob("gpunode_*.py")) == [f"gpunode_{m}.py" for m in MODULES]
        yield Fleet(workdir=workdir, machines=machines, env=env)


def nvidia_runtime(box: nspawn.Container) -> dict[str, object] | None:
    config = tomlread.loads(box.path(CONFIG).read_text())
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    return cri.get("nvidia")  # type: ignore[no-any-return]


def test_check_mode_then_apply_then_nothing_to_do_then_down(fleet: Fleet) -> None:
    before = {host: box.path(CONFIG).read_bytes() for host, box in fleet.machines.items()}

    planned = fleet.playbook(PLAN)
    assert planned.result.returncode == 0, planned
    for host, counts in planned.recap.items():
        # Two tasks would change something: the runtime and the plugin service.
        assert counts["failed"] == 0 and counts["changed"] == 2, f"{host}: {counts}\n{planned}"
    # gpunode's own diff of the file, per host, and nothing written anywhere.
    assert (
        planned.result.stdout.count(
            '+        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]'
        )
        == 3
    )
    for host, box in fleet.machines.items():
        assert box.path(CONFIG).read_bytes() == before[host], f"check mode changed {host}"
        assert not box.path("/var/lib/gpunode/backups").exists(), f"check mode left a backup on {host}"
        assert not box.path(PLUGIN_UNIT).exists(), f"check mode installed the plugin unit on {host}"
    # The unit's content, as the diff of a new file.
    assert planned.result.stdout.count(f"+++ after: {PLUGIN_UNIT}") == 3, planned

    applied = fleet.playbook(APPLY)
    assert applied.result.returncode == 0, applied
    for host, counts in applied.recap.items():
        assert counts["failed"] == 0 and counts["changed"] == 2, f"{host}: {counts}\n{applied}"
    for host, box in fleet.machines.items():
        runtime = nvidia_runtime(box)
        assert runtime is not None, f"{host}: no nvidia runtime in {CONFIG}"
        assert runtime["options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"  # type: ignore[index]
        # The default restart happened and containerd came back with the new config.
        assert cri_state(box) == "ok", box.journal(UNIT)
        # The plugin's unit is installed and enabled in the machine's systemd; not started (no kubelet).
        assert box.systemctl("is-enabled", PLUGIN_SERVICE).stdout.strip() == "enabled"
        assert box.systemctl("is-active", PLUGIN_SERVICE).stdout.strip() == "inactive"

    verified = fleet.playbook(VERIFY)
    assert verified.result.returncode == 0, verified
    assert all(c["failed"] == 0 for c in verified.recap.values()), verified

    again = fleet.playbook(APPLY)
    assert again.result.returncode == 0, again
    for host, counts in again.recap.items():
        assert counts["changed"] == 0 and counts["failed"] == 0, f"{host}: {counts}\n{again}"

    # gpunode down through gpunode_down: planned, then done, then nothing left to do.
    down_planned = fleet.playbook(DOWN_PLAN)
    assert down_planned.result.returncode == 0, down_planned
    for host, counts in down_planned.recap.items():
        assert counts["changed"] == 1 and counts["failed"] == 0, f"{host}: {counts}\n{down_planned}"
    for host, box in fleet.machines.items():
        assert nvidia_runtime(box) is not None and box.path(PLUGIN_UNIT).exists(), f"check mode undid {host}"
    down = fleet.playbook(DOWN)
    assert down.result.returncode == 0, down
    for host, counts in down.recap.items():
        assert counts["changed"] == 1 and counts["failed"] == 0, f"{host}: {counts}\n{down}"
    for host, box in fleet.machines.items():
        assert box.path(CONFIG).read_bytes() == before[host], f"{host}: {CONFIG} not as it was"
        assert not box.path(PLUGIN_UNIT).exists(), f"{host}: the plugin unit is still there"
        assert cri_state(box) == "ok", box.journal(UNIT)
    down_again = fleet.playbook(DOWN)
    assert down_again.result.returncode == 0, down_again
    for host, counts in down_again.recap.items():
        assert counts["changed"] == 0 and counts["failed"] == 0, f"{host}: {counts}\n{down_again}"


def test_a_broken_config_fails_its_machine_alone(fleet: Fleet) -> None:
    broken = fleet.machines["node2"]
    # An operator's typo: an unterminated table header. containerd keeps running on what it read before.
    broken.path(CONFIG).write_text(broken.path(CONFIG).read_text() + "\n[plugins.broken\n")
    before = broken.path(CONFIG).read_bytes()

    run = fleet.playbook(APPLY)
    assert run.result.returncode == 2, run  # ansible-playbook: some host failed
    recap = run.recap
    assert recap["node2"]["failed"] == 1, run
    for host in ("node1", "node3"):
        assert recap[host]["failed"] == 0 and recap[host]["changed"] == 2, f"{host}: {recap[host]}\n{run}"
        assert nvidia_runtime(fleet.machines[host]) is not None
    # gpunode's own error, as gpunode itself states it on that machine (a dry run reads the same file).
    direct = broken.run([str(GPUNODE), "configure-runtime", "containerd", "--dry-run", "--json"])
    error = json.loads(direct.stdout)["error"]
    assert error["exit_code"] == 4 and error["message"].startswith(f"{CONFIG} is not valid TOML"), error
    failure = [line for line in run.result.stdout.splitlines() if line.startswith("fatal: [node2]")]
    assert len(failure) == 1, run
    # The module's msg is gpunode's message (its first words, before the parser's quoted detail), its fix
    # and exit status come along.
    assert f'"msg": "{CONFIG} is not valid TOML: ' in failure[0], failure[0]
    assert f'"fix": "{error["fix"]}"' in failure[0] and '"exit_code": 4' in failure[0], failure[0]
    assert broken.path(CONFIG).read_bytes() == before


def test_up_without_a_gpu_fails_with_gpunodes_preflight(fleet: Fleet) -> None:
    """gpunode_up against the real gpunode: without a driver its plan is blocked at preflight, and every
    machine's task fails with gpunode's own message and fix, in check mode as in a real run, changing
    nothing. (The steps of a real `up` are tested with recorded documents: tests/unit.)"""
    before = {host: box.path(CONFIG).read_bytes() for host, box in fleet.machines.items()}
    for check in (["--check"], []):
        result = subprocess.run(
            [str(ansible_tool("ansible")), "gpu_nodes", "-i", "inventory.ini", "-m",
             "gpunode.gpunode.gpunode_up", "-a", "runtime=containerd", "--one-line", *check],
            cwd=fleet.workdir, env=fleet.env, capture_output=True, text=True, timeout=PLAYBOOK_TIMEOUT,
            check=False,
        )  # fmt: skip
        assert result.returncode == 2, result.stdout + result.stderr  # ansible: a host failed
        lines = [line for line in result.stdout.splitlines() if " | FAILED! => " in line]
        assert sorted(line.split(" ", 1)[0] for line in lines) == sorted(HOSTS), result.stdout
        for line in lines:
            failure = json.loads(line.split(" | FAILED! => ", 1)[1])
            message = failure["msg"]
            assert message.startswith("step preflight: the nvidia kernel module is not loaded"), failure
            assert message.endswith("gpunode up changed nothing"), failure
            assert "install the NVIDIA driver" in failure["fix"] and failure["exit_code"] == 1, failure
            assert failure["changed"] is False and failure["gpunode"]["dry_run"] is bool(check), failure
    for host, box in fleet.machines.items():
        assert box.path(CONFIG).read_bytes() == before[host], host


def test_docs_show_what_is_tested() -> None:
    """docs/fleets.md's Ansible section: the commands, config, variables and playbooks of this test."""
    docs = (REPO / "docs" / "fleets.md").read_text()
    section = docs[docs.index("## Ansible\n") : docs.index("## DaemonSet\n")]
    for command in (*BUILD, PLAN, APPLY, VERIFY, DOWN_PLAN, DOWN):
        assert f"   {command}" in section, command
    assert _indented(ANSIBLE_CFG) in section
    assert _indented(GROUP_VARS) in section
    for playbook in PLAYBOOKS:
        # The files less their leading comment and document start, indented as in the list item.
        body = "".join(
            line
            for line in (EXAMPLES / playbook).read_text().splitlines(keepends=True)
            if not line.startswith(("#", "---"))
        )
        assert _indented(body) in section, playbook


def _indented(text: str) -> str:
    return "".join(f"   {line}" if line.strip() else line for line in text.splitlines(keepends=True))
