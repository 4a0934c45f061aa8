"""MPS sharing end to end: `gpunode plugin run` with the stand-in nvidia-cuda-mps-control (tests/fakemps),
the fake NVML and the fake kubelet. The daemons are real processes; each test stops what it started."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import fakemps
from tests.integration.kubelet import HEALTHY, UNHEALTHY, DeviceInfo, FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"
L4_MIB = 23034  # the pcie-4 profile's GPUs (tests/fakenvml)


@pytest.fixture
def base() -> Iterator[Path]:
    with short_tempdir("mps-") as path:
        try:
            yield path
        finally:
            fakemps.kill_all(path / "mps")


@pytest.fixture
def kubelet(base: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(base / "device-plugins") as k:
        yield k


def plugin(base: Path, replicas: int = 4, *extra: str, program: bool = True) -> PluginProcess:
    bin_dir = base / "bin"
    if program:
        fakemps.install(bin_dir)
    resources = json.dumps([{"name": GPU, "replicas": replicas}])
    args = ["--mps-resources", resources, "--mps-root", str(base / "mps"), *extra]
    env = fakemps.env(bin_dir)
    return PluginProcess(base / "device-plugins", args, profile="pcie-4", env=env)


def all_health(health: str, count: int) -> Callable[[list[DeviceInfo]], bool]:
    return lambda d: len(d) == count and all(x.health == health for x in d)


def control(base: Path, *commands: str) -> list[str]:
    """Ask the daemon through the stand-in control client, as an operator would."""
    import subprocess

    pipe = base / "mps" / GPU / "pipe"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    out = []
    for command in commands:
        done = subprocess.run(
            [str(base / "bin" / fakemps.PROGRAM)],
            input=command + "\n",
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        out.append(done.stdout.strip())
    return out


def status_of(proc: PluginProcess) -> dict[str, Any]:
    try:
        document: dict[str, Any] = json.loads(proc.status_path.read_text())
    except (FileNotFoundError, ValueError):  # not written yet, or read while it was replaced
        return {}
    return document


def daemon_pid(base: Path) -> int:
    [pid] = fakemps.daemon_pids(base / "mps").values()
    return pid


def test_a_daemon_per_shared_resource_serves_the_replicas(kubelet: FakeKubelet, base: Path) -> None:
    with plugin(base):
        devices = kubelet.wait_for_devices(GPU, all_health(HEALTHY, 16), timeout=60)
        pid = daemon_pid(base)
        environ = dict(
            e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e
        )
        uuids = sorted({d.id.split("::")[0] for d in devices})
        assert sorted(environ["CUDA_VISIBLE_DEVICES"].split(",")) == uuids
        assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(base / "mps" / GPU / "pipe")
        # The defaults derived from the replica count: 100 / 4 and the GPU's memory / 4, per GPU.
        limits = control(base, *(f"get_default_device_pinned_mem_limit {n}" for n in range(4)))
        assert control(base, "get_default_active_thread_percentage") == ["25.0"]
        assert limits == [f"{L4_MIB // 4}M"] * 4
        # Its own /dev/shm: what its servers put there is in the resource's shm directory, not the host's.
        shm = base / "mps" / GPU / "shm"
        assert (shm / f"mps-standin.{pid}").exists()
        assert not Path(f"/dev/shm/mps-standin.{pid}").exists()
        assert oct(shm.stat().st_mode & 0o7777) == "0o1777"

        [container] = kubelet.allocate(GPU, [[devices[0].id]]).container_responses
        assert container.envs["CUDA_MPS_PIPE_DIRECTORY"] == f"/mps/{GPU}/pipe"
        assert container.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in container.envs  # the daemon's default applies
        # A container gets one replica: two would still get one replica's share.
        import grpc

        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [[devices[0].id, devices[1].id]])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ask for 1" in err.value.details()
        mounts = {m.container_path: (m.host_path, m.read_only) for m in container.mounts}
        assert mounts[f"/mps/{GPU}/pipe"] == (str(base / "mps" / GPU / "pipe"), False)
        assert mounts["/dev/shm"] == (str(shm), False)
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == devices[0].id.split("::")[0]
    # The plugin's stop ends its daemon.
    assert fakemps.daemon_pids(base / "mps") == {}
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_dead_daemon_makes_its_replicas_unhealthy_until_it_is_back(
    kubelet: FakeKubelet, base: Path
) -> None:
    with plugin(base) as proc:
        kubelet.wait_for_devices(GPU, all_health(HEALTHY, 16), timeout=60)
        pid = daemon_pid(base)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        down = kubelet.wait_for_update(GPU, all_health(UNHEALTHY, 16), after=killed, timeout=60)
        back = kubelet.wait_for_update(GPU, all_health(HEALTHY, 16), after=down.time, timeout=60)
        assert back.time > down.time
        assert daemon_pid(base) != pid
        proc.wait_for_log("the MPS control daemon (pid")
        proc.wait_for_log("MPS control daemon started")


def test_a_missing_control_program_keeps_the_replicas_unhealthy(kubelet: FakeKubelet, base: Path) -> None:
    with plugin(base, program=False) as proc:
        kubelet.wait_registered(GPU, timeout=60)
        kubelet.wait_for_devices(GPU, all_health(UNHEALTHY, 16), timeout=60)
        proc.wait_for_log("nvidia-cuda-mps-control is not on the host's PATH")
        # `plugin status` says why: the status file names the reason per resource.
        deadline = time.monotonic() + 30
        while "not on the host's PATH" not in str(status_of(proc).get("resources")):
            assert time.monotonic() < deadline, status_of(proc)
            time.sleep(0.05)
        [status] = status_of(proc)["resources"]
        assert status["sharing"] == "mps" and status["healthy"] == 0
        # Installed later: found on the next try, and the replicas turn healthy.
        fakemps.install(base / "bin")
        kubelet.wait_for_devices(GPU, all_health(HEALTHY, 16), timeout=90)


def test_a_reload_keeps_an_unchanged_daemon_and_replaces_a_changed_one(
    kubelet: FakeKubelet, base: Path
) -> None:
    config = base / "plugin.toml"
    config.write_text(f'[mps]\nroot = "{base / "mps"}"\nresources = [{{name = "{GPU}", replicas = 4}}]\n')
    fakemps.install(base / "bin")
    proc = PluginProcess(
        base / "device-plugins", ["--config", str(config)], profile="pcie-4", env=fakemps.env(base / "bin")
    )
    with proc:
        kubelet.wait_for_devices(GPU, all_health(HEALTHY, 16), timeout=60)
        first = daemon_pid(base)
        proc.signal(signal.SIGHUP)
        proc.wait_for_log("reloading configuration")
        kubelet.wait_registered(GPU, count=2, timeout=60)
        assert daemon_pid(base) == first
        config.write_text(config.read_text().replace("replicas = 4", "replicas = 2"))
        proc.signal(signal.SIGHUP)
        kubelet.wait_for_devices(GPU, all_health(HEALTHY, 8), timeout=60)
        deadline = time.monotonic() + 60
        while control(base, "get_default_active_thread_percentage") != ["50.0"]:
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.05)
        assert daemon_pid(base) != first


def test_a_daemon_left_by_a_killed_plugin_is_adopted(kubelet: FakeKubelet, base: Path) -> None:
    first = plugin(base).start()
    try:
        kubelet.wait_for_devices(GPU, all_health(HEALTHY, 16), timeout=60)
        pid = daemon_pid(base)
    finally:
        first.signal(signal.SIGKILL)
        first.wait()
        first.log_path.unlink(missing_ok=True)
    with plugin(base) as second:
        second.wait_for_log("MPS control daemon adopted", timeout=60)
        assert daemon_pid(base) == pid
