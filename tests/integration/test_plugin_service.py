"""`gpunode plugin install | status | uninstall` against a real systemd, with kubelet played by a fake.

One systemd container (tests/integration/nspawn.py) serves the whole module. A FakeKubelet runs in this
test process and serves kubelet.sock in a host directory that the container sees, read-write, as
/var/lib/kubelet/device-plugins (unix sockets work across the bind mount): the plugin that systemd runs
inside registers with the kubelet outside. The fake libnvidia-ml.so.1 (tests/fakenvml) stands in for the
driver; the unit gets it through /etc/default/gpunode-device-plugin, its EnvironmentFile. gpunode runs from
this checkout's venv, which the container sees at the same path, so the unit's ExecStart works there too.

Every test starts with the service not installed and leaves it so (the `node` fixture uninstalls).

Needs root, systemd-nspawn (Debian: systemd-container), nsenter, gcc (for the fake NVML) and a venv made
from the host's /usr/bin/python3. In CI (the CI variable is set) a missing one is a failure: these checks
must not silently stop running there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from gpunode.errors import ExitCode
from tests import fakenvml
from tests.integration import nspawn
from tests.integration.kubelet import HEALTHY, FakeKubelet
from tests.integration.pluginproc import short_tempdir

REPO = Path(__file__).resolve().parents[2]
# gpunode of the venv running the tests; the container sees it at the same path (see `bed`).
GPUNODE = str(Path(sys.executable).parent / "gpunode")
UNIT = "gpunode-device-plugin.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
CONFIG_PATH = "/etc/gpunode/plugin.toml"
RECORD_PATH = "/var/lib/gpunode/plugin-service.json"
ENV_FILE = "/etc/default/gpunode-device-plugin"
SOCKET_DIR = "/var/lib/kubelet/device-plugins"
PLUGIN_SOCKET = "gpunode-nvidia.com-gpu.sock"
RESOURCE = "nvidia.com/gpu"
GPUS = 4  # the fake NVML's pcie-4 machine
REGISTERED = f"{RESOURCE}: {GPUS}/{GPUS} healthy, registered"
# The file an admin hands to `install --config`; install copies it to CONFIG_PATH.
GIVEN_CONFIG = "/srv/gpunode/plugin.toml"
GIVEN_CONFIG_TEXT = "# handed to gpunode plugin install --config\n[health]\nrecovery-quiet-period = 5\n"
# Generous: the shared 2-core test machines are slow, and nothing here measures time.
WAIT = 120.0
POLL = 0.1
# How long a plugin without kubelet is watched to stay "activating" (an observation window, not a limit).
NOT_READY_WINDOW = 3.0
PROPERTIES = ("LoadState", "ActiveState", "SubState", "UnitFileState", "StatusText", "MainPID", "NRestarts")

T = TypeVar("T")


@dataclass(frozen=True)
class Bed:
    box: nspawn.Container
    kubelet: FakeKubelet
    socket_dir: Path  # the host's view of SOCKET_DIR


def prerequisites() -> list[nspawn.Bind]:
    return nspawn.checkout_binds(
        ["gcc is not installed (it builds the fake libnvidia-ml.so.1)"] if shutil.which("gcc") is None else []
    )


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    """A booted systemd whose /var/lib/kubelet/device-plugins is served by a FakeKubelet on the host, with
    the fake NVML in the unit's environment file and a plugin config file ready to be installed."""
    binds = prerequisites()
    nvml = fakenvml.build()
    if not nvml.resolve().is_relative_to(REPO):
        binds.append(nspawn.Bind(nvml, str(nvml)))
    with short_tempdir("gpunode-svc-") as base:
        sockets = base / "device-plugins"
        binds.append(nspawn.Bind(sockets, SOCKET_DIR, read_only=False))
        # Leaving the block stops the container first (SIGTERM reaches the plugin while kubelet still
        # serves), then the kubelet.
        with FakeKubelet(sockets) as kubelet, nspawn.boot(base / "nspawn", binds=binds) as box:
            help_ = box.run([GPUNODE, "--help"])
            assert help_.returncode == 0, f"gpunode does not run inside the container:\n{help_}"
            write(box, ENV_FILE, f"LD_LIBRARY_PATH={nvml}\nFAKE_NVML_PROFILE=pcie-4\n")
            write(box, GIVEN_CONFIG, GIVEN_CONFIG_TEXT)
            yield Bed(box, kubelet, sockets)


@pytest.fixture
def node(bed: Bed) -> Iterator[Bed]:
    """The module's container with the service not installed and kubelet serving; put back so after."""
    assert not bed.box.path(UNIT_PATH).exists(), "a previous test left the service installed"
    if not bed.kubelet.running:
        bed.kubelet.start()
    try:
        yield bed
    finally:
        if not bed.kubelet.running:
            bed.kubelet.start()
        if bed.box.path(UNIT_PATH).exists():
            result = gpunode(bed.box, "uninstall")
            assert result.returncode == ExitCode.OK, explain(result, bed.box)
        bed.box.systemctl("reset-failed", UNIT)


def write(box: nspawn.Container, path: str, text: str) -> None:
    target = box.path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def gpunode(box: nspawn.Container, *args: str) -> subprocess.CompletedProcess[str]:
    return box.run([GPUNODE, "plugin", *args], timeout=WAIT + 60)


def props(box: nspawn.Container) -> dict[str, str]:
    return box.unit_properties(UNIT, *PROPERTIES)


def explain(result: subprocess.CompletedProcess[str], box: nspawn.Container) -> str:
    return (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}\n"
        f"{props(box)}\njournal:\n{box.journal(UNIT)}"
    )


def wait_until(check: Callable[[], T | None], what: str, box: nspawn.Container, timeout: float = WAIT) -> T:
    deadline = time.monotonic() + timeout
    while (found := check()) is None:
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout} s for {what}; now {props(box)}\n{box.journal(UNIT)}")
        time.sleep(POLL)
    return found


def wait_for_props(
    box: nspawn.Container, what: str, check: Callable[[dict[str, str]], bool]
) -> dict[str, str]:
    def matching() -> dict[str, str] | None:
        now = props(box)
        return now if check(now) else None

    return wait_until(matching, what, box)


def monotonic_s(box: nspawn.Container, prop: str) -> float:
    """A unit's *TimestampMonotonic property in seconds. The container has no time namespace of its own,
    so this is the clock of the test's time.monotonic() and of the FakeKubelet's stamps."""
    value = box.unit_properties(UNIT, prop)[prop]
    assert value.isdigit() and int(value) > 0, f"{prop}={value!r}"
    return int(value) / 1e6


def test_a_config_with_an_unknown_key_is_refused_before_systemd_is_touched(node: Bed) -> None:
    box = node.box
    write(box, "/srv/gpunode/typo.toml", "[health]\nrecovery-quiet-periode = 5\n")
    registrations = len(node.kubelet.registrations(RESOURCE))

    result = gpunode(box, "install", "--config", "/srv/gpunode/typo.toml")

    assert result.returncode == ExitCode.CONFIG, explain(result, box)  # 4
    assert "unknown" in result.stderr and "recovery-quiet-periode" in result.stderr, result.stderr
    for path in (UNIT_PATH, CONFIG_PATH, RECORD_PATH):
        assert not box.path(path).exists(), f"{path} was written"
    state = props(box)
    assert state["LoadState"] == "not-found" and state["ActiveState"] == "inactive", state
    assert len(node.kubelet.registrations(RESOURCE)) == registrations


def test_install_registers_is_idempotent_restarts_after_kill_and_uninstall_removes_only_its_files(
    node: Bed,
) -> None:
    box, kubelet = node.box, node.kubelet
    env_file = box.path(ENV_FILE).read_bytes()

    # 1. Install: the unit runs, and install returned only once the plugin had registered.
    before = time.monotonic()
    result = gpunode(box, "install", "--config", GIVEN_CONFIG)
    assert result.returncode == ExitCode.OK, explain(result, box)
    lines = result.stdout.splitlines()
    for expected in (
        f"wrote {UNIT_PATH}",
        f"wrote {CONFIG_PATH}",
        "ran systemctl daemon-reload",
        f"ran systemctl enable {UNIT}",
        f"ran systemctl start --no-block {UNIT}",
        "service: active (running), enabled, restarts 0",
        f"  {REGISTERED} ({PLUGIN_SOCKET})",
    ):
        assert expected in lines, explain(result, box)
    state = props(box)
    running = (state["ActiveState"], state["SubState"], state["UnitFileState"])
    assert running == ("active", "running", "enabled"), state
    assert state["StatusText"] == REGISTERED, state
    registration = kubelet.wait_registered(RESOURCE, after=before, timeout=WAIT)
    assert registration.endpoint == PLUGIN_SOCKET
    # Type=notify: systemd called the unit active only after kubelet had accepted the registration.
    assert registration.time <= monotonic_s(box, "ActiveEnterTimestampMonotonic")
    devices = kubelet.wait_for_devices(RESOURCE, lambda d: len(d) == GPUS, timeout=WAIT)
    assert all(d.health == HEALTHY for d in devices), devices
    assert box.path(CONFIG_PATH).read_text() == GIVEN_CONFIG_TEXT
    # The installed config is the one the plugin runs with.
    # Logged by the health monitor's own thread when it arms, unordered with the registration: wait for it.
    armed = "a GPU is healthy again after 5s fine"
    wait_until(lambda: armed in box.journal(UNIT) or None, "the health monitor's arm line", box)
    status = gpunode(box, "status")
    assert status.returncode == ExitCode.OK, explain(status, box)
    assert f"  {REGISTERED} ({PLUGIN_SOCKET})" in status.stdout.splitlines(), status.stdout
    assert f"plugin: pid {state['MainPID']}, {REGISTERED}" in status.stdout.splitlines(), status.stdout

    # 2. The same install again changes nothing: no write, no restart.
    mtimes = {p: box.path(p).stat().st_mtime_ns for p in (UNIT_PATH, CONFIG_PATH)}
    invocation = box.unit_properties(UNIT, "InvocationID")["InvocationID"]
    registrations = len(kubelet.registrations(RESOURCE))
    again = gpunode(box, "install", "--config", GIVEN_CONFIG)
    assert again.returncode == ExitCode.OK, explain(again, box)
    assert again.stdout.splitlines()[0] == f"{UNIT} is installed and up to date; nothing to do", again.stdout
    assert "wrote" not in again.stdout and "ran " not in again.stdout, again.stdout
    assert {p: box.path(p).stat().st_mtime_ns for p in mtimes} == mtimes
    assert box.unit_properties(UNIT, "InvocationID")["InvocationID"] == invocation
    assert props(box)["MainPID"] == state["MainPID"]
    assert len(kubelet.registrations(RESOURCE)) == registrations

    # 3. kill -9: systemd starts a new plugin (Restart=always), which registers again.
    old_pid = state["MainPID"]
    killed_at = time.monotonic()
    kill = box.run(["kill", "-9", old_pid])
    assert kill.returncode == 0, kill.stderr

    after_kill = wait_for_props(
        box,
        "a restarted, active plugin",
        lambda p: (
            int(p["NRestarts"]) > 0 and p["MainPID"] not in ("0", old_pid) and p["ActiveState"] == "active"
        ),
    )
    assert after_kill["NRestarts"] == "1", after_kill
    again_registered = kubelet.wait_registered(RESOURCE, after=killed_at, timeout=WAIT)
    assert again_registered.time <= monotonic_s(box, "ActiveEnterTimestampMonotonic")
    assert len(kubelet.registrations(RESOURCE)) == registrations + 1
    assert "status=9/KILL" in box.journal(UNIT, lines=200)
    # The new process's status file (written right after READY=1, so wait for it).
    new_status = f"plugin: pid {after_kill['MainPID']}, {REGISTERED}"
    wait_until(
        lambda: new_status in gpunode(box, "status").stdout.splitlines() or None,
        "`plugin status` to show the new process",
        box,
    )

    # 5. Uninstall: stopped, and what install wrote is gone; what it did not write stays.
    removed = gpunode(box, "uninstall")
    assert removed.returncode == ExitCode.OK, explain(removed, box)
    lines = removed.stdout.splitlines()
    for expected in (
        f"ran systemctl disable --now {UNIT}",
        "ran systemctl daemon-reload",
        f"removed {UNIT_PATH}",
        f"removed {CONFIG_PATH}",
    ):
        assert expected in lines, explain(removed, box)
    for path in (UNIT_PATH, CONFIG_PATH, RECORD_PATH):
        assert not box.path(path).exists(), f"{path} is still there"
    state = props(box)
    assert state["LoadState"] == "not-found" and state["ActiveState"] == "inactive", state
    cat = box.systemctl("cat", UNIT)
    assert cat.returncode != 0, cat.stdout
    assert box.path(ENV_FILE).read_bytes() == env_file
    assert box.path(GIVEN_CONFIG).read_text() == GIVEN_CONFIG_TEXT
    # The plugin stopped cleanly (SIGTERM): it removed its socket from kubelet's directory.
    assert not (node.socket_dir / PLUGIN_SOCKET).exists()
    status = gpunode(box, "status")
    assert status.returncode == ExitCode.UNHEALTHY, explain(status, box)
    lines = status.stdout.splitlines()
    assert lines[:3] == [
        f"service: {UNIT} is not installed (or systemd does not answer)",
        "plugin: no status (not running); looked for its status file at:",
        "  /run/gpunode/plugin-status.json (default)",
    ], status.stdout
    nothing = gpunode(box, "uninstall")
    assert nothing.returncode == ExitCode.OK, explain(nothing, box)
    assert f"{UNIT} is not installed; nothing to do" in nothing.stdout.splitlines(), nothing.stdout


def test_the_unit_is_not_ready_until_the_plugin_has_registered_with_kubelet(node: Bed) -> None:
    box, kubelet = node.box, node.kubelet
    registrations = len(kubelet.registrations(RESOURCE))
    kubelet.stop()
    assert not kubelet.kubelet_socket.exists()

    installed = gpunode(box, "install", "--config", GIVEN_CONFIG, "--no-start")
    assert installed.returncode == ExitCode.OK, explain(installed, box)
    state = props(box)
    assert (state["ActiveState"], state["UnitFileState"]) == ("inactive", "enabled"), state
    started = box.systemctl("start", "--no-block", UNIT)
    assert started.returncode == 0, explain(started, box)

    waiting = f"waiting for kubelet ({SOCKET_DIR}/kubelet.sock does not exist)"
    state = wait_for_props(box, "the plugin to wait for kubelet", lambda p: p["StatusText"] == waiting)
    # Running, but not READY=1: systemd keeps the start job open and the unit "activating".
    seen = set()
    window_end = time.monotonic() + NOT_READY_WINDOW
    while time.monotonic() < window_end:
        now = props(box)
        seen.add((now["ActiveState"], now["SubState"], now["MainPID"], now["StatusText"]))
        time.sleep(POLL)
    assert seen == {("activating", "start", state["MainPID"], waiting)}, seen
    status = gpunode(box, "status")
    assert status.returncode == ExitCode.UNHEALTHY, explain(status, box)
    assert f"plugin: pid {state['MainPID']}, {waiting}" in status.stdout.splitlines(), status.stdout
    assert len(kubelet.registrations(RESOURCE)) == registrations

    kubelet_started = kubelet.start()
    active = wait_for_props(box, "the unit to turn active", lambda p: p["ActiveState"] == "active")
    # The same process that waited, no restart: waiting for kubelet is not a failure.
    assert (active["MainPID"], active["NRestarts"]) == (state["MainPID"], "0"), active
    assert active["StatusText"] == REGISTERED, active
    registration = kubelet.wait_registered(RESOURCE, after=kubelet_started, timeout=WAIT)
    # The order of events, on one clock: the plugin started, then kubelet, then the registration, and only
    # then did systemd call the unit active.
    plugin_started = monotonic_s(box, "ExecMainStartTimestampMonotonic")
    became_active = monotonic_s(box, "ActiveEnterTimestampMonotonic")
    assert plugin_started < kubelet_started < registration.time <= became_active
