"""`gpunode configure-runtime containerd --restart` against a real systemd and a real containerd.service.

Each test boots its own systemd container (tests/integration/nspawn.py) whose containerd.service is the
test bed's containerd 1.6 (tests/testbed.py: bookworm's package unpacked into the checkout, never installed
on the host): the package's own unit, written into the container's /etc with ExecStart pointing at the
unpacked program and a PATH on which its shim and the test bed's runc come first. The default config
path and the default restart all apply, as on a real node; gpunode, run inside with the same PATH, finds
that containerd and ctr as it would find installed ones. gpunode runs from this checkout's venv, which the
container sees at the same path (and the test bed with it).

Needs root, systemd-nspawn (Debian: systemd-container), nsenter, the test bed's containerd, ctr and runc,
and a venv made from the host's /usr/bin/python3 (the container has only the host's /usr). In CI (the CI
variable is set) a missing one is a failure: these checks must not silently stop running there.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.errors import ExitCode
from tests import testbed, tomlread
from tests.integration import nspawn

REPO = Path(__file__).resolve().parents[2]
CONFIG = "/etc/containerd/config.toml"
UNIT = "containerd.service"
# gpunode of the venv running the tests; the container sees it at the same path (see the fixture).
GPUNODE = str(Path(sys.executable).parent / "gpunode")
RESTARTED = f"restarted {UNIT}: containerd answers and its CRI plugin is ok"
# containerd refuses to start exactly while its config mentions nvidia: gpunode's change cannot come back.
FAIL_WITH_NVIDIA = (
    "[Service]\nExecStartPre=/bin/sh -c 'grep -q nvidia /etc/containerd/config.toml && exit 1 || exit 0'\n"
)


# The test bed's trees containerd.service runs from: containerd (and its shim), runc.
DAEMON = ("containerd-1.6", "runc")


def prerequisites() -> list[nspawn.Bind]:
    testbed.bin_dirs(*DAEMON)  # a failure under CI, a skip elsewhere, when they are not unpacked
    binds = nspawn.checkout_binds()
    if not testbed.BED.resolve().is_relative_to(REPO):
        binds.append(nspawn.Bind(testbed.BED, str(testbed.BED)))
    return binds


def unit_text() -> str:
    """The package's own containerd.service, for the unpacked program: ExecStart at the test bed's
    containerd, and a PATH on which its shim and runc come first (containerd execs them by name)."""
    tree = testbed.BED / "containerd-1.6"
    units = ("lib/systemd/system/containerd.service", "usr/lib/systemd/system/containerd.service")
    (packaged,) = [tree / u for u in units if (tree / u).is_file()]
    text = packaged.read_text()
    assert text.count("\nExecStart=/usr/bin/containerd\n") == 1, f"{packaged} has changed:\n{text}"
    program = testbed.binary("containerd-1.6")
    path = testbed.path_with(*DAEMON, rest=nspawn.ENV["PATH"])
    return text.replace(
        "\nExecStart=/usr/bin/containerd\n", f"\nEnvironment=PATH={path}\nExecStart={program}\n"
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[nspawn.Container]:
    """A booted systemd with the stock containerd config (systemd cgroups, as kubeadm wants) and
    containerd.service running on it."""
    with nspawn.boot(tmp_path / "nspawn", binds=prerequisites()) as box:
        # gpunode and the tests find containerd and ctr by name, as on a node where they are installed.
        box.env["PATH"] = testbed.path_with(*DAEMON, rest=nspawn.ENV["PATH"])
        gpunode_help = box.run([GPUNODE, "--help"])
        assert gpunode_help.returncode == 0, f"gpunode does not run inside the container:\n{gpunode_help}"
        config = box.path(CONFIG)
        config.parent.mkdir(parents=True)
        config.write_bytes(stock_config())
        unit = box.path(f"/etc/systemd/system/{UNIT}")
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(unit_text())
        reloaded = box.systemctl("daemon-reload")
        assert reloaded.returncode == 0, reloaded.stderr
        started = box.systemctl("start", UNIT)
        assert started.returncode == 0, f"{started.stderr}\n{box.journal(UNIT)}"
        assert cri_state(box) == "ok"
        yield box


def stock_config() -> bytes:
    result = subprocess.run(
        [testbed.binary("containerd-1.6"), "config", "default"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.count("SystemdCgroup = false") == 1, "containerd's default config has changed"
    return result.stdout.replace("SystemdCgroup = false", "SystemdCgroup = true").encode()


def gpunode(box: nspawn.Container, *args: str) -> subprocess.CompletedProcess[str]:
    # No --config and no --root: the node's standard path, on the real root, where --restart is the default.
    return box.run([GPUNODE, "configure-runtime", "containerd", *args])


def cri_state(box: nspawn.Container) -> str:
    """The CRI plugin's state as `ctr plugins ls` reports it ("ok", "error", ...)."""
    result = box.run([str(testbed.binary("containerd-1.6", "ctr")), "plugins", "ls"], timeout=60)
    assert result.returncode == 0, f"ctr plugins ls: {result.stderr}"
    for line in result.stdout.splitlines():
        words = line.split()
        if words[:2] == ["io.containerd.grpc.v1", "cri"]:
            return words[-1]
    return "missing"


def invocation(box: nspawn.Container) -> tuple[str, str]:
    """Which start of containerd.service this is: a real restart changes both its ID and main PID."""
    props = box.unit_properties(UNIT, "InvocationID", "MainPID")
    assert props["InvocationID"] and props["MainPID"] not in ("", "0"), props
    return props["InvocationID"], props["MainPID"]


def explain(result: subprocess.CompletedProcess[str], box: nspawn.Container) -> str:
    return (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}\n{box.journal(UNIT)}"
    )


def test_configure_restarts_containerd_and_revert_restarts_it_back(node: nspawn.Container) -> None:
    original = node.path(CONFIG).read_bytes()
    first = invocation(node)

    result = gpunode(node, "--set-as-default", "--restart", "--yes", "--runtime-path", "/usr/bin/true")
    assert result.returncode == ExitCode.OK, explain(result, node)
    assert RESTARTED in result.stdout.splitlines(), explain(result, node)
    assert f"wrote {CONFIG}" in result.stdout.splitlines()
    second = invocation(node)
    assert second[0] != first[0] and second[1] != first[1], "containerd.service was not restarted"
    assert node.systemctl("is-active", UNIT).stdout.strip() == "active"
    assert cri_state(node) == "ok"
    cri = tomlread.loads(node.path(CONFIG).read_text())["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["default_runtime_name"] == "nvidia"
    assert cri["runtimes"]["nvidia"]["options"]["BinaryName"] == "/usr/bin/true"

    result = gpunode(node, "--revert", "--restart", "--yes")
    assert result.returncode == ExitCode.OK, explain(result, node)
    assert f"restored {CONFIG}" in result.stdout.splitlines()
    assert RESTARTED in result.stdout.splitlines(), explain(result, node)
    assert node.path(CONFIG).read_bytes() == original
    third = invocation(node)
    assert third[0] != second[0] and third[1] != second[1], "containerd.service was not restarted"
    assert node.systemctl("is-active", UNIT).stdout.strip() == "active"
    assert cri_state(node) == "ok"


def test_a_config_containerd_cannot_start_on_is_rolled_back_and_containerd_restarted(
    node: nspawn.Container,
) -> None:
    dropin = node.path(f"/etc/systemd/system/{UNIT}.d/fail-with-nvidia.conf")
    dropin.parent.mkdir(parents=True)
    dropin.write_text(FAIL_WITH_NVIDIA)
    assert node.systemctl("daemon-reload").returncode == 0
    # The drop-in must let containerd start on the original config, or the rollback proves nothing.
    assert node.systemctl("restart", UNIT).returncode == 0, node.journal(UNIT)
    original = node.path(CONFIG).read_bytes()
    before = invocation(node)

    result = gpunode(node, "--set-as-default", "--restart", "--yes", "--runtime-path", "/usr/bin/true")
    assert result.returncode == ExitCode.COMMAND_FAILED, explain(result, node)  # 8
    # systemctl's own complaint and the unit's log, so that the user sees why without digging.
    assert f"gpunode: error: `systemctl restart {UNIT}` failed: Job for {UNIT} failed" in result.stderr
    assert f"{UNIT}'s last log lines:" in result.stderr
    assert "Control process exited, code=exited, status=1/FAILURE" in result.stderr
    assert (
        f"gpunode put back the previous content of {CONFIG}, and restarted containerd.service with it."
        in (result.stderr)
    )
    assert "failed too" not in result.stderr, result.stderr
    assert node.path(CONFIG).read_bytes() == original
    # Back on the old config, and by a start of its own after the failed one.
    after = invocation(node)
    assert after[0] != before[0] and after[1] != before[1], "containerd.service was not started again"
    assert node.systemctl("is-active", UNIT).stdout.strip() == "active", node.journal(UNIT)
    assert cri_state(node) == "ok"
    # Nothing recorded: a later --revert has nothing to undo and must not touch the file.
    assert not node.path("/var/lib/gpunode/runtime-changes.json").exists()
