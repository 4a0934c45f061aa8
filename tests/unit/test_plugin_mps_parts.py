"""MPS sharing's pure parts and the daemon against the stand-in control program (tests/fakemps): the
daemon specs derived from the resources, the control commands, what Allocate hands a container, the
registry's resource-wide down mark, and MpsDaemon/MpsSupervisor on real processes."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.host import Host
from gpunode.plugin.allocate import AllocateSettings, MpsMounts, allocate
from gpunode.plugin.devices import DeviceRegistry, SharedResource, Sharing, build_resources
from gpunode.plugin.mps import (
    DaemonSpec,
    MpsDaemon,
    MpsError,
    MpsSupervisor,
    daemon_specs,
    find_control_program,
    read_records,
)
from gpunode.plugin.simulate import simulated_inventory
from tests import fakemps
from tests.integration.pluginproc import short_tempdir

GPU = "nvidia.com/gpu"
MIB = 1024 * 1024


def mps_resources(profile: str = "pcie-4", replicas: int = 4, devices: object = "all") -> tuple:  # type: ignore[type-arg]
    share = SharedResource(GPU, replicas, devices=devices)  # type: ignore[arg-type]
    return build_resources(simulated_inventory(profile), sharing=Sharing(resources=(share,), strategy="mps"))


def test_a_spec_per_mps_resource_with_derived_defaults() -> None:
    inventory = simulated_inventory("pcie-4")
    [spec] = daemon_specs(mps_resources(), inventory, root="/run/nvidia/mps")
    assert spec.resource == GPU and spec.root == "/run/nvidia/mps/nvidia.com/gpu"
    assert spec.gpu_uuids == tuple(g.uuid for g in inventory.gpus)
    assert spec.active_thread_percentage == 25
    memory = inventory.gpus[0].memory_total
    assert memory is not None
    assert spec.pinned_limits_mib == (memory // 4 // MIB,) * 4
    assert spec.commands() == ["set_default_active_thread_percentage 25"] + [
        f"set_default_device_pinned_mem_limit {n} {memory // 4 // MIB}M" for n in range(4)
    ]
    root = "/run/nvidia/mps/nvidia.com/gpu"
    limits = dict.fromkeys(spec.gpu_uuids, memory // 4 // MIB)
    assert spec.mounts() == MpsMounts(f"{root}/pipe", f"{root}/shm", "/mps/nvidia.com/gpu/pipe", 25, limits)


def test_overrides_and_selected_devices() -> None:
    inventory = simulated_inventory("pcie-4")
    resources = mps_resources(replicas=3, devices=("1", "2"))
    specs = daemon_specs(
        resources, inventory, root="/m", active_thread_percentage=40, pinned_memory_limit_mib=2048
    )
    [spec] = specs
    # Only the selected GPUs share through MPS; the rest stay plain nvidia.com/gpu, with no daemon.
    assert spec.gpu_uuids == (inventory.gpus[1].uuid, inventory.gpus[2].uuid)
    assert (spec.active_thread_percentage, spec.pinned_limits_mib, spec.replicas) == (40, (2048, 2048), 3)
    assert {r.name: r.sharing for r in resources} == {GPU: "mps"}
    # Many replicas: never a 0 % share.
    [spec] = daemon_specs(mps_resources(replicas=200), inventory, root="/m")
    assert spec.active_thread_percentage == 1


def test_no_spec_without_mps_and_mig_is_refused() -> None:
    inventory = simulated_inventory("pcie-4")
    sliced = build_resources(inventory, sharing=Sharing(replicas=4))
    assert daemon_specs(sliced, inventory, root="/m") == ()
    from gpunode.errors import ConfigError

    with pytest.raises(ConfigError, match="MPS shares whole GPUs only"):
        build_resources(
            simulated_inventory("mig"),
            mig_strategy="mixed",
            sharing=Sharing(resources=(SharedResource("mig-1g.5gb", 2),), strategy="mps"),
        )


def test_allocate_hands_the_container_the_pipe_directory_and_shm() -> None:
    [resource] = mps_resources()
    registry = DeviceRegistry([resource])
    mounts = MpsMounts("/r/pipe", "/r/shm", "/mps/nvidia.com/gpu/pipe")
    settings = AllocateSettings(device_list_strategy=("cdi-cri",), mps={GPU: mounts})
    [answer] = allocate(resource, [[resource.devices[0].id]], registry.health_of, settings)
    assert answer.envs == {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe"}
    assert answer.mounts == (("/mps/nvidia.com/gpu/pipe", "/r/pipe", False), ("/dev/shm", "/r/shm", False))
    assert answer.cdi_devices == (f"nvidia.com/gpu={resource.devices[0].uuid}",)
    # The client's share said in its environment too; the memory limit by the container's own ordinals.
    two = [d for d in resource.devices if d.replica == 0][:2]
    limits = {d.gpu_uuid: 5000 for d in two}
    said = MpsMounts("/r/pipe", "/r/shm", "/mps/nvidia.com/gpu/pipe", 25, limits)
    settings = AllocateSettings(mps={GPU: said})
    [answer] = allocate(resource, [[d.id for d in two]], registry.health_of, settings)
    assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert answer.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5000M,1=5000M"
    # GPUs with different limits: no ordinal is guessed.
    said = MpsMounts("/r/pipe", "/r/shm", "/p", 25, {two[0].gpu_uuid: 5000, two[1].gpu_uuid: 6000})
    settings = AllocateSettings(mps={GPU: said})
    [answer] = allocate(resource, [[d.id for d in two]], registry.health_of, settings)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in answer.envs
    # A GPU the entry left unshared gets nothing of it, nor do other resources' containers.
    [partly] = mps_resources(devices=("1",))
    plain = next(d for d in partly.devices if d.replica is None)
    [answer] = allocate(partly, [[plain.id]], registry.health_of, settings)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in answer.envs and answer.mounts == ()
    [answer] = allocate(resource, [[resource.devices[0].id]], registry.health_of, AllocateSettings())
    assert "CUDA_MPS_PIPE_DIRECTORY" not in answer.envs and answer.mounts == ()


def test_a_resource_down_mark_covers_its_devices_only() -> None:
    inventory = simulated_inventory("pcie-4")
    share = SharedResource(GPU, 2, devices=("0",))
    resources = build_resources(inventory, sharing=Sharing(resources=(share,), strategy="mps"))
    changes: list[int] = []
    registry = DeviceRegistry(resources, on_health_change=lambda: changes.append(1))
    assert {r.name for r in resources} == {GPU}
    version, _ = registry.snapshot(GPU)
    assert registry.set_resource_down(GPU, "its MPS control daemon exited")
    assert not registry.set_resource_down(GPU, "its MPS control daemon exited")  # said already
    new_version, states = registry.snapshot(GPU)
    assert new_version > version and changes == [1]
    assert all(not s.healthy and s.reason == "its MPS control daemon exited" for s in states)
    device = states[0].device
    assert registry.health_of(device).healthy  # the GPU itself is fine
    assert not registry.health_of(device, GPU).healthy
    registry.replace(resources)  # a reload keeps the mark: only the supervisor clears it
    assert not registry.health_of(device, GPU).healthy
    assert registry.set_resource_down(GPU, None)
    assert all(s.healthy for s in registry.snapshot(GPU)[1])


# -- real processes: the stand-in control program ----------------------------------------------------


@pytest.fixture
def base() -> Iterator[Path]:
    with short_tempdir("mpsu-") as path:
        try:
            yield path
        finally:
            fakemps.kill_all(path)


def gone(pid: int | None) -> bool:
    """Exited: no such process, or a zombie (the stand-in daemon's parent is whatever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def spec_in(base: Path, *, percentage: int = 25) -> DaemonSpec:
    return DaemonSpec(GPU, str(base / "mps" / GPU), ("GPU-a", "GPU-b"), 4, percentage, (5000, 0))


def test_daemon_start_configure_check_and_stop(base: Path) -> None:
    program = str(fakemps.install(base / "bin"))
    host = Host()
    daemon = MpsDaemon(host, spec_in(base), program)
    daemon.start()
    assert daemon.pid is not None and daemon.running_pid() == daemon.pid
    assert daemon.command("get_default_active_thread_percentage") == "25.0"
    assert daemon.command("get_default_device_pinned_mem_limit 0") == "5000M"
    assert daemon.command("get_default_device_pinned_mem_limit 1") == "none"  # memory unknown: no limit
    assert daemon.check() is None
    assert [s.resource for s in read_records(host, str(base / "mps"))] == [GPU]
    # A second daemon on the same pipe directory is refused by the program itself, and said so.
    with pytest.raises(MpsError, match="already running"):
        MpsDaemon(host, spec_in(base), program).start()
    # Adopted only with the same settings.
    assert MpsDaemon(host, spec_in(base), program).adopt()
    assert not MpsDaemon(host, spec_in(base, percentage=50), program).adopt()
    with pytest.raises(MpsError, match="Unrecognized command"):
        daemon.command("no_such_command")
    pid = daemon.pid
    daemon.stop()
    assert daemon.running_pid() is None and daemon.pid is None
    assert daemon.check() is not None and "Cannot find MPS control daemon" in (daemon.check() or "")
    assert gone(pid)


def test_find_control_program(tmp_path: Path) -> None:
    host = Host(root=tmp_path, env={"PATH": "/opt/bin"})
    assert find_control_program(host, "/") is None
    fakemps.install(tmp_path / "run/nvidia/driver/usr/bin")
    assert find_control_program(host, "/run/nvidia/driver") == str(
        tmp_path / "run/nvidia/driver/usr/bin/nvidia-cuda-mps-control"
    )
    fakemps.install(tmp_path / "opt/bin")
    assert find_control_program(host, "/run/nvidia/driver") == str(
        tmp_path / "opt/bin/nvidia-cuda-mps-control"
    )


class States:
    """on_state's calls, with a wait for the next one that matches."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.cond = threading.Condition()

    def __call__(self, resource: str, reason: str | None) -> None:
        with self.cond:
            self.calls.append((resource, reason))
            self.cond.notify_all()

    def wait(self, up: bool, after: int = 0, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for n, (_, reason) in enumerate(self.calls[after:], after):
                    if (reason is None) == up:
                        return n + 1
                left = deadline - time.monotonic()
                assert left > 0, f"no {'up' if up else 'down'} state after {after}: {self.calls}"
                self.cond.wait(left)


def test_supervisor_restarts_a_dead_daemon_and_a_hung_one(
    base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    program = str(fakemps.install(base / "bin"))
    states = States()
    supervisor = MpsSupervisor(
        Host(), str(base / "mps"), states, find_program=lambda: program, check_interval=0.2
    )
    try:
        with caplog.at_level(logging.INFO, logger="gpunode.plugin"):
            supervisor.apply([spec_in(base)])
            assert states.calls[0] == (GPU, "its MPS control daemon is starting")
            seen = states.wait(up=True)
            [pid] = fakemps.daemon_pids(base / "mps").values()
            os.kill(pid, signal.SIGKILL)  # dead: the pidfd says so at once
            seen = states.wait(up=False, after=seen)
            assert states.calls[seen - 1] == (GPU, "its MPS control daemon exited")
            seen = states.wait(up=True, after=seen)
            [second] = fakemps.daemon_pids(base / "mps").values()
            assert second != pid
            os.kill(second, signal.SIGSTOP)  # hung: alive, but it answers nothing
            try:
                seen = states.wait(up=False, after=seen)
                assert "does not answer" in (states.calls[seen - 1][1] or "")
            finally:
                os.kill(second, signal.SIGCONT)
            states.wait(up=True, after=seen)
            assert "MPS control daemon started" in caplog.text
            # Not wanted any more: stopped, and nothing is down for it.
            supervisor.apply([])
            assert states.calls[-1] == (GPU, None)
            deadline = time.monotonic() + 30
            while fakemps.daemon_pids(base / "mps"):
                assert time.monotonic() < deadline
                time.sleep(0.02)
    finally:
        supervisor.stop()
