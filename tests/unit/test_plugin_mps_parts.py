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
    assert spec.mounts() == MpsMounts(f"{root}/pipe", f"{root}/shm", "/mps/nvidia.com/gpu/pipe", 25)


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
    # A GPU in MIG mode served whole (mig-strategy none) cannot be shared through MPS either: its server
    # would not start, and every replica of the daemon would be advertised and useless.
    mig = simulated_inventory("mig")
    in_mig_mode = [g.index for g in mig.gpus if g.mig_mode is not None and g.mig_mode.current]
    assert in_mig_mode
    with pytest.raises(ConfigError, match=rf"GPU {in_mig_mode[0]}\b.* in MIG mode") as err:
        build_resources(mig, sharing=Sharing(resources=(SharedResource(GPU, 2),), strategy="mps"))
    assert f"nvidia-smi -i {in_mig_mode[0]} -mig 0" in (err.value.fix or "")
    # GPUs not in MIG mode on that node may still be MPS-shared, and so may every GPU under
    # mig-strategy single on a node without MIG (GPU Operator's default strategy).
    others = [str(g.index) for g in mig.gpus if g.index not in in_mig_mode]
    if others:
        share = SharedResource(GPU, 2, devices=tuple(others))
        build_resources(mig, sharing=Sharing(resources=(share,), strategy="mps"))
    [single] = build_resources(
        simulated_inventory("pcie-4"),
        mig_strategy="single",
        sharing=Sharing(resources=(SharedResource(GPU, 2),), strategy="mps"),
    )
    assert (single.sharing, len(single.devices)) == ("mps", 8)


def test_allocate_hands_the_container_the_pipe_directory_and_shm() -> None:
    [resource] = mps_resources()
    registry = DeviceRegistry([resource])
    mounts = MpsMounts("/r/pipe", "/r/shm", "/mps/nvidia.com/gpu/pipe")
    settings = AllocateSettings(device_list_strategy=("cdi-cri",), mps={GPU: mounts})
    [answer] = allocate(resource, [[resource.devices[0].id]], registry.health_of, settings)
    assert answer.envs == {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe"}
    assert answer.mounts == (("/mps/nvidia.com/gpu/pipe", "/r/pipe", False), ("/dev/shm", "/r/shm", False))
    assert answer.cdi_devices == (f"nvidia.com/gpu={resource.devices[0].uuid}",)
    # The client's thread share said in its environment too (not the memory limit: its ordinals are the
    # server's); and one replica per container.
    said = MpsMounts("/r/pipe", "/r/shm", "/mps/nvidia.com/gpu/pipe", 25)
    settings = AllocateSettings(mps={GPU: said})
    [answer] = allocate(resource, [[resource.devices[0].id]], registry.health_of, settings)
    assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in answer.envs
    from gpunode.plugin.allocate import Refused

    with pytest.raises(Refused, match="a container gets one replica"):
        allocate(resource, [[d.id for d in resource.devices[:2]]], registry.health_of, settings)
    # A GPU the entry left unshared gets nothing of it, nor do other resources' containers.
    [partly] = mps_resources(devices=("1",))
    plain = next(d for d in partly.devices if d.replica is None)
    [answer] = allocate(partly, [[plain.id]], registry.health_of, settings)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in answer.envs and answer.mounts == ()
    # Whole GPUs of that resource may be asked for together (only replicas are one per container).
    whole = [d.id for d in partly.devices if d.replica is None]
    assert len(whole) >= 2
    [answer] = allocate(partly, [whole[:2]], registry.health_of, settings)
    replica = next(d.id for d in partly.devices if d.replica is not None)
    with pytest.raises(Refused, match="a container gets one replica"):
        allocate(partly, [[whole[0], replica]], registry.health_of, settings)
    [answer] = allocate(resource, [[resource.devices[0].id]], registry.health_of, AllocateSettings())
    assert "CUDA_MPS_PIPE_DIRECTORY" not in answer.envs and answer.mounts == ()


def test_a_resource_down_mark_covers_its_replicas_only() -> None:
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
    replicas = [s for s in states if s.device.replica is not None]
    unshared = [s for s in states if s.device.replica is None]
    assert len(replicas) == 2 and len(unshared) == 3  # GPU 0 shared, the other three left whole
    assert all(not s.healthy and s.reason == "its MPS control daemon exited" for s in replicas)
    assert all(s.healthy for s in unshared)  # they do not depend on the daemon
    device = replicas[0].device
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
    # Adopted only with the same settings (and the PID its record names).
    other = MpsDaemon(host, spec_in(base), program)
    assert other.adopt() and other.pid == daemon.pid
    other.close()
    assert not MpsDaemon(host, spec_in(base, percentage=50), program).adopt()
    # A second daemon on the same pipe directory is refused by the program itself, and said so; the
    # failed start took the record away, so nothing adopts that daemon as configured any more.
    with pytest.raises(MpsError, match="already running"):
        MpsDaemon(host, spec_in(base), program).start()
    assert not MpsDaemon(host, spec_in(base), program).adopt()
    with pytest.raises(MpsError, match="Unrecognized command"):
        daemon.command("no_such_command")
    pid = daemon.pid
    daemon.stop()
    assert daemon.running_pid() is None and daemon.pid is None
    assert daemon.check() is not None and "Cannot find MPS control daemon" in (daemon.check() or "")
    assert gone(pid)


def test_find_control_program(tmp_path: Path) -> None:
    host = Host(root=tmp_path, env={"PATH": "/opt/bin"})
    assert find_control_program(host) is None
    # A driver container's copy is not taken: outside its root its servers could not start.
    fakemps.install(tmp_path / "run/nvidia/driver/usr/bin")
    assert find_control_program(host) is None
    fakemps.install(tmp_path / "opt/bin")
    assert find_control_program(host) == str(tmp_path / "opt/bin/nvidia-cuda-mps-control")


def test_a_stale_pid_file_is_never_believed(base: Path) -> None:
    """A pid file a killed daemon left may name a PID reused by another program: that process is never
    taken for the daemon (held, signalled), and a start removes the file before the new daemon writes its
    own."""
    import subprocess

    program = str(fakemps.install(base / "bin"))
    host = Host()
    spec = spec_in(base)
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        pipe = Path(spec.pipe_dir)
        pipe.mkdir(parents=True)
        (pipe / "nvidia-cuda-mps-control.pid").write_text(f"{stranger.pid}\n")
        daemon = MpsDaemon(host, spec, program)
        assert daemon.running_pid() is None  # nothing answers on the socket
        daemon.start()
        assert daemon.pid is not None and daemon.pid != stranger.pid
        assert (pipe / "nvidia-cuda-mps-control.pid").read_text().strip() == str(daemon.pid)
        # The file rewritten to name the stranger while the daemon answers: the socket's live owner wins.
        (pipe / "nvidia-cuda-mps-control.pid").write_text(f"{stranger.pid}\n")
        assert daemon.running_pid() == daemon.pid
        daemon.stop()
        assert stranger.poll() is None  # never signalled
        # A socket that answers but whose owner does not run the control program (here: this test), and a
        # pid file naming a stranger: neither is taken for the daemon.
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(daemon.socket_path)
            listener.listen(1)
            assert daemon.running_pid() is None
    finally:
        stranger.kill()
        stranger.wait()


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


def slow_program(base: Path, seconds: float) -> str:
    """The stand-in behind a wrapper whose `-d` takes `seconds` before it starts the daemon: a start in
    flight for that long."""
    real = fakemps.install(base / "bin")
    wrapper = base / "bin" / "slow-mps-control"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = -d ] && sleep {seconds}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_report_for_a_spec_no_longer_wanted_is_dropped(base: Path) -> None:
    states = States()
    program = slow_program(base, 1.0)
    supervisor = MpsSupervisor(Host(), str(base / "mps"), states, find_program=lambda: program)
    try:
        supervisor.apply([spec_in(base)])
        time.sleep(0.3)  # its start is in flight
        changed = spec_in(base, percentage=50)
        supervisor.apply([changed])  # a reload with other settings
        seen = states.wait(up=True)
        # No "up" for the old spec in between: the only up is the new daemon's, set to 50 %.
        assert [r for _, r in states.calls[:seen]].count(None) == 1
        assert MpsDaemon(Host(), changed, program).command("get_default_active_thread_percentage") == "50.0"
        # MPS turned off while a start fails: nothing is left marked down.
        supervisor.apply([])
        assert states.calls[-1] == (GPU, None)
    finally:
        supervisor.stop()
    assert states.calls[-1] == (GPU, None)
    assert fakemps.daemon_pids(base / "mps") == {}


def test_turning_mps_off_while_its_program_is_missing_leaves_nothing_down(base: Path) -> None:
    states = States()
    supervisor = MpsSupervisor(Host(), str(base / "mps"), states, find_program=lambda: None)
    try:
        supervisor.apply([spec_in(base)])
        deadline = time.monotonic() + 30
        while not any("not on the host's PATH" in (r or "") for _, r in states.calls):
            assert time.monotonic() < deadline, states.calls
            time.sleep(0.02)
        supervisor.apply([])
        time.sleep(1.0)  # a retry that would fail again, had the supervisor kept trying
        assert states.calls[-1] == (GPU, None)
    finally:
        supervisor.stop()
    assert states.calls[-1] == (GPU, None)


def test_stop_during_a_start_leaves_no_daemon(base: Path) -> None:
    program = slow_program(base, 0.5)
    supervisor = MpsSupervisor(Host(), str(base / "mps"), States(), find_program=lambda: program)
    supervisor.apply([spec_in(base)])
    time.sleep(0.2)
    supervisor.stop()
    time.sleep(1.0)  # what the wrapper started after the stop would be up by now
    assert fakemps.daemon_pids(base / "mps") == {}


def test_stopping_hung_daemons_is_bounded(base: Path) -> None:
    program = str(fakemps.install(base / "bin"))
    host = Host()
    daemons = []
    for n in range(3):
        spec = DaemonSpec(
            f"example.com/gpu{n}", str(base / "mps" / f"example.com/gpu{n}"), ("GPU-a",), 2, 50, (0,)
        )
        daemon = MpsDaemon(host, spec, program)
        daemon.start()
        daemons.append(daemon)
    pids = [d.pid for d in daemons]
    for pid in pids:
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # hung: answers nothing, not even quit
    from gpunode.plugin.mps import stop_daemons

    started = time.monotonic()
    stop_daemons(daemons, 4.0)
    took = time.monotonic() - started
    assert all(gone(pid) for pid in pids), took
    assert all(d.pidfd is None for d in daemons)


@pytest.mark.parametrize(
    "stray",
    [
        "nvidia.com/other",  # another resource's directory: nothing to do with this one's daemon
        "nvidia.com/gpu",  # this resource's directory
        "nvidia.com/gpu/pipe",  # its pipe directory
    ],
)
def test_a_stray_file_under_the_mps_root_is_reported_and_retried_until_it_is_gone(
    base: Path, stray: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 23: a file where the supervisor expected a directory made its reconcile fail once, and it never
    reconciled again: the daemon stayed unstarted (and its replicas "starting") until a plugin restart."""
    program = str(fakemps.install(base / "bin"))
    path = base / "mps" / stray
    path.parent.mkdir(parents=True)
    path.write_text("not a directory\n")
    states = States()
    supervisor = MpsSupervisor(Host(), str(base / "mps"), states, find_program=lambda: program)
    try:
        with caplog.at_level(logging.INFO, logger="gpunode.plugin"):
            supervisor.apply([spec_in(base)])
            if stray.startswith(GPU):  # in this daemon's way: down, saying why, until it is removed
                deadline = time.monotonic() + 60
                with states.cond:
                    while not any(str(base / "mps" / GPU) in (r or "") for _, r in states.calls):
                        assert time.monotonic() < deadline, states.calls
                        states.cond.wait(deadline - time.monotonic())
                    reason = next(r for _, r in states.calls if str(base / "mps" / GPU) in (r or ""))
                assert reason is not None and reason.startswith("its MPS control daemon is not running (")
                assert all(r is not None for _, r in states.calls)  # never up with the file there
                path.unlink()
            states.wait(up=True, timeout=90)  # no restart: the next try finds the way clear
            assert fakemps.daemon_pids(base / "mps")
            assert "MPS control daemon started" in caplog.text
            if not stray.startswith(GPU):
                assert f"skipping {stray} under {base / 'mps'}" in caplog.text
    finally:
        supervisor.stop()
    assert fakemps.daemon_pids(base / "mps") == {}
