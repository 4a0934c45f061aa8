"""`gpunode plugin run` as a real process against the fake kubelet, with the real pynvml and fake NVML.

Every test gets its own socket directory under /tmp and its own plugin process, stopped by PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import fakenvml
from tests.integration.kubelet import HEALTHY, UNHEALTHY, DeviceInfo, FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"
SOCKET = "gpunode-nvidia.com-gpu.sock"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_dir) as k:
        yield k


def all_health(devices: list[DeviceInfo], health: str) -> bool:
    return bool(devices) and all(d.health == health for d in devices)


def test_registers_and_lists_every_gpu_with_numa(kubelet: FakeKubelet, socket_dir: Path) -> None:
    with PluginProcess(socket_dir, profile="pcie-4"):
        reg = kubelet.wait_registered(GPU)
        assert reg.endpoint == SOCKET and reg.version == "v1beta1"
        assert reg.options.get_preferred_allocation_available and not reg.options.pre_start_required
        devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        assert [d.health for d in devices] == [HEALTHY] * 4
        assert [d.numa_nodes for d in devices] == [(0,), (0,), (1,), (1,)]
        assert all(d.id.startswith("GPU-") for d in devices)
        assert kubelet.violations == []
    assert kubelet.checkpoint_intact()


def test_allocate_and_its_refusals_over_grpc(kubelet: FakeKubelet, socket_dir: Path) -> None:
    import grpc

    from tests import cdinode
    from tests.integration.test_cdi_plugin import uuids

    # cdi-cri needs a CDI spec that holds the devices, or the plugin refuses to start (test_cdi_plugin).
    specs = socket_dir.parent / "cdi"
    cdinode.write_spec(specs, uuids("pcie-4"))
    env = {"GPUNODE_CDI_SPEC_DIRS": str(specs)}
    with PluginProcess(socket_dir, ["--device-list-strategy", "envvar,cdi-cri"], profile="pcie-4", env=env):
        kubelet.wait_registered(GPU)
        ids = [d.id for d in kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)]
        answer = kubelet.allocate(GPU, [[ids[1], ids[3]]])
        [container] = answer.container_responses
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{ids[1]},{ids[3]}"}
        assert [c.name for c in container.cdi_devices] == [
            f"nvidia.com/gpu={ids[1]}",
            f"nvidia.com/gpu={ids[3]}",
        ]
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [[ids[0], "GPU-not-here"]])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-not-here" in err.value.details()
        # Preferred allocation: the two GPUs behind one PCIe switch, never an error.
        preferred = kubelet.get_preferred_allocation(GPU, ids, [ids[2]], 2)
        assert sorted(preferred.container_responses[0].deviceIDs) == sorted([ids[2], ids[3]])
        odd = kubelet.get_preferred_allocation(GPU, ["GPU-x", *ids], ["GPU-y"], 9)
        assert "GPU-y" in odd.container_responses[0].deviceIDs


def test_kubelet_absent_at_start(socket_dir: Path) -> None:
    # Neither kubelet nor its directory exist yet: the plugin waits (inotify), then registers at once.
    with PluginProcess(socket_dir, profile="h100") as plugin:
        plugin.wait_for_log("waiting for")
        with FakeKubelet(socket_dir) as kubelet:
            reg = kubelet.wait_registered(GPU)
            assert len(kubelet.wait_for_devices(GPU, lambda d: len(d) == 1)) == 1
            assert reg.time >= kubelet.starts[0]


def test_stale_kubelet_socket_is_retried_then_registered(socket_dir: Path) -> None:
    socket_dir.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(socket_dir / "kubelet.sock"))  # exists, nobody accepts: Register fails UNAVAILABLE
    stale.close()
    with PluginProcess(socket_dir, profile="h100") as plugin:
        plugin.wait_for_log("retrying in")
        with FakeKubelet(socket_dir) as kubelet:  # replaces the stale socket: a new kubelet.sock
            kubelet.wait_registered(GPU)


def test_kubelet_restarted_fifty_times(kubelet: FakeKubelet, socket_dir: Path) -> None:
    with PluginProcess(socket_dir, profile="pcie-4"):
        kubelet.wait_registered(GPU)
        for n in range(2, 52):
            restarted = kubelet.restart()
            reg = kubelet.wait_registered(GPU, after=restarted)
            assert reg.kubelet_generation == n - 1
            kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        assert len(kubelet.registrations(GPU)) == 51
        assert kubelet.stream_ends(GPU, by_plugin_only=True) == []
        assert kubelet.allocatable(GPU) == 4
    assert kubelet.checkpoint_intact()


def test_sigterm_removes_our_socket_and_exits_zero(kubelet: FakeKubelet, socket_dir: Path) -> None:
    plugin = PluginProcess(socket_dir, profile="pcie-4").start()
    try:
        kubelet.wait_registered(GPU)
        assert (socket_dir / SOCKET).exists()
        plugin.signal(signal.SIGTERM)
        assert plugin.wait() == 0
        assert not (socket_dir / SOCKET).exists()
        assert (socket_dir / "kubelet.sock").exists() and kubelet.checkpoint_intact()
        assert "stopped" in plugin.log()
    finally:
        plugin.stop()


def test_sigint_also_stops_cleanly(kubelet: FakeKubelet, socket_dir: Path) -> None:
    plugin = PluginProcess(socket_dir, profile="h100").start()
    try:
        kubelet.wait_registered(GPU)
        plugin.signal(signal.SIGINT)
        assert plugin.wait() == 0
        assert not (socket_dir / SOCKET).exists()
    finally:
        plugin.stop()


def test_sighup_reloads_config_and_registers_again(kubelet: FakeKubelet, socket_dir: Path) -> None:
    config = socket_dir.parent / "plugin.toml"
    config.write_text("[time-slicing]\nreplicas = 1\n")
    with PluginProcess(socket_dir, ["--config", str(config)], profile="pcie-4") as plugin:
        kubelet.wait_registered(GPU)
        kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        config.write_text("[time-slicing]\nreplicas = 3\n")
        plugin.signal(signal.SIGHUP)
        kubelet.wait_registered(GPU, count=2)
        devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 12)
        assert all("::" in d.id for d in devices)
        # The same socket keeps serving: kubelet replaced the stream, the plugin never ended one.
        assert kubelet.stream_ends(GPU, by_plugin_only=True) == []
        # A broken edit is refused and the running configuration stays.
        config.write_text("[time-slicing]\nreplica = 3\n")
        plugin.signal(signal.SIGHUP)
        plugin.wait_for_log("reload refused")
        assert "time-slicing.replica" in plugin.log()
        assert len(kubelet.latest_devices(GPU) or []) == 12


# tgkill's system call number, for a C library older than glibc 2.30 (which has no tgkill wrapper).
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}


def _tgkill(pid: int, tid: int, signum: int) -> bool:
    """Send the signal to one thread of the process; False if the thread is gone."""
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "tgkill"):
        return bool(libc.tgkill(pid, tid, signum) == 0)
    return bool(libc.syscall(SYS_TGKILL[platform.machine()], pid, tid, signum) == 0)


def _blocks(pid: int, tid: int, signum: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except FileNotFoundError:
        return True  # gone: nothing to send to
    blocked = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(blocked >> (signum - 1) & 1)


def test_sighup_acts_at_once_whichever_thread_receives_it(kubelet: FakeKubelet, socket_dir: Path) -> None:
    """The kernel may hand a process-directed signal to any thread. One that landed on a gRPC or NVML
    thread used to wait until something else woke the main thread (CI: a SIGHUP acted on 30 s late)."""
    with PluginProcess(socket_dir, [], profile="pcie-4") as plugin:
        kubelet.wait_registered(GPU)
        plugin.wait_for_log("health monitor armed")
        assert plugin.proc is not None
        pid = plugin.proc.pid
        threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        reloads = 0
        for tid in threads:
            if _blocks(pid, tid, signal.SIGHUP) or not _tgkill(pid, tid, signal.SIGHUP):
                continue
            reloads += 1
            deadline = time.monotonic() + 30
            while plugin.log().count("re-reading the GPUs (SIGHUP)") < reloads:
                if not Path(f"/proc/{pid}/task/{tid}").exists():
                    # An idle gRPC worker that ended takes its pending signal with it (the kernel's
                    # rule): nothing the plugin could have acted on.
                    reloads -= 1
                    break
                assert time.monotonic() < deadline, (
                    f"a SIGHUP to thread {tid} was not acted on\n{plugin.log()}"
                )
                time.sleep(0.02)
        assert reloads >= 3, threads  # gRPC's, the health monitor's, the log writer's, ... at least
        kubelet.wait_registered(GPU, count=reloads + 1)


def test_xid_makes_the_gpu_unhealthy_then_it_recovers(kubelet: FakeKubelet, socket_dir: Path) -> None:
    control = socket_dir.parent / "nvml-control"
    control.write_text("")
    # Long enough for the status file and the refused Allocate below to see the GPU unhealthy before it
    # recovers, on a busy machine.
    args = ["--replicas", "2", "--recovery-quiet-period", "3"]
    with PluginProcess(socket_dir, args, profile="pcie-4", control=control) as plugin:
        kubelet.wait_registered(GPU)
        devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 8)
        plugin.wait_for_log("health monitor armed")
        uuid1 = devices[2].id.split("::")[0]
        fakenvml.inject(control, "xid 1 13")  # an application error: ignored
        fakenvml.inject(control, "xid 1 79")
        after = kubelet.wait_for_devices(GPU, lambda d: any(x.health == UNHEALTHY for x in d))
        bad = {d.id for d in after if d.health == UNHEALTHY}
        assert bad == {f"{uuid1}::0", f"{uuid1}::1"}  # both replicas of GPU 1, nothing else
        # `gpunode plugin status` reads the same, without waiting for another event.
        # The file is first written once the plugin's Register call returns, which may be after kubelet
        # has already listed the devices: wait for it to exist too.
        deadline = time.monotonic() + 30
        while _healthy_in_status(plugin) != 6:
            assert time.monotonic() < deadline, plugin.log()
            time.sleep(0.02)
        import grpc

        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [[f"{uuid1}::0"]])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "79" in err.value.details()
        # NVML says the GPU is fine; after the quiet period it is healthy again.
        kubelet.wait_for_devices(GPU, lambda d: all_health(d, HEALTHY) and len(d) == 8)
        assert kubelet.allocatable(GPU) == 8


def _healthy_in_status(plugin: PluginProcess) -> int | None:
    try:
        healthy: int = json.loads(plugin.status_path.read_text())["resources"][0]["healthy"]
    except (FileNotFoundError, ValueError, LookupError):  # not written yet
        return None
    return healthy


def test_lost_gpu_is_unhealthy(kubelet: FakeKubelet, socket_dir: Path) -> None:
    control = socket_dir.parent / "nvml-control"
    control.write_text("")
    with PluginProcess(
        socket_dir, ["--recovery-quiet-period", "0"], profile="pcie-4", control=control
    ) as plugin:
        kubelet.wait_registered(GPU)
        devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        plugin.wait_for_log("health monitor armed")
        fakenvml.inject(control, "lost 3")
        after = kubelet.wait_for_devices(GPU, lambda d: d[3].health == UNHEALTHY)
        assert [d.health for d in after[:3]] == [HEALTHY] * 3 and after[3].id == devices[3].id


@pytest.mark.parametrize(
    ("args", "env"),
    [(["--mig-strategy", "mixed"], {}), ([], {"MIG_STRATEGY": "mixed"})],
    ids=["flag", "nvidia-env"],
)
def test_mig_mixed_serves_one_socket_per_profile(
    kubelet: FakeKubelet, socket_dir: Path, args: list[str], env: dict[str, str]
) -> None:
    # NVIDIA's own variable, as its Helm chart sets it, works as gpunode's flag does.
    with PluginProcess(socket_dir, args, profile="mig", env=env):
        small = kubelet.wait_registered("nvidia.com/mig-1g.5gb")
        big = kubelet.wait_registered("nvidia.com/mig-2g.10gb")
        whole = kubelet.wait_registered(GPU)
        assert {small.endpoint, big.endpoint, whole.endpoint} == {
            "gpunode-nvidia.com-mig-1g.5gb.sock",
            "gpunode-nvidia.com-mig-2g.10gb.sock",
            SOCKET,
        }
        migs = kubelet.wait_for_devices("nvidia.com/mig-1g.5gb", lambda d: len(d) == 2)
        assert all(d.id.startswith("MIG-") for d in migs)
        answer = kubelet.allocate("nvidia.com/mig-1g.5gb", [[migs[0].id]])
        assert dict(answer.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": migs[0].id}
        assert len(kubelet.wait_for_devices(GPU, lambda d: len(d) == 1)) == 1


def test_mig_single_on_a_mixed_node_is_a_clear_error(socket_dir: Path) -> None:
    plugin = PluginProcess(socket_dir, ["--mig-strategy", "single"], profile="mig").start()
    try:
        assert plugin.wait() == 4
        assert "one MIG profile" in plugin.log() or "every GPU in MIG mode" in plugin.log()
        assert "Traceback" not in plugin.log()
    finally:
        plugin.stop()


def test_renamed_shared_resource_and_packed_placement(kubelet: FakeKubelet, socket_dir: Path) -> None:
    args = ["--replicas", "4", "--rename-by-default", "--placement", "packed"]
    with PluginProcess(socket_dir, args, profile="pairs-4"):
        kubelet.wait_registered("nvidia.com/gpu.shared")
        ids = [d.id for d in kubelet.wait_for_devices("nvidia.com/gpu.shared", lambda d: len(d) == 16)]
        chosen = kubelet.get_preferred_allocation("nvidia.com/gpu.shared", ids, [], 3).container_responses[0]
        assert len({i.split("::")[0] for i in chosen.deviceIDs}) == 1  # packed: one GPU


def test_pre_start_option(kubelet: FakeKubelet, socket_dir: Path) -> None:
    with PluginProcess(socket_dir, ["--pre-start-required"], profile="h100") as plugin:
        reg = kubelet.wait_registered(GPU)
        assert reg.options.pre_start_required
        [device] = kubelet.wait_for_devices(GPU, lambda d: len(d) == 1)
        kubelet.pre_start_container(GPU, [device.id])
        plugin.wait_for_log("PreStartContainer")


def test_fail_on_init_error_exits_with_the_nvml_error(socket_dir: Path) -> None:
    plugin = PluginProcess(socket_dir, profile="no-driver").start()
    try:
        assert plugin.wait() == 7
        assert "Driver Not Loaded" in plugin.log() and "modprobe nvidia" in plugin.log()
        assert not (socket_dir / SOCKET).exists()
    finally:
        plugin.stop()


def test_without_fail_on_init_error_it_waits_for_nvml(kubelet: FakeKubelet, socket_dir: Path) -> None:
    nvml = socket_dir.parent / "nvml.conf"
    nvml.write_text("[system]\ninit_error = 9\n")
    with PluginProcess(socket_dir, ["--no-fail-on-init-error"], profile=None, nvml_config=nvml) as plugin:
        plugin.wait_for_log("retrying")
        assert kubelet.registrations() == [] and not (socket_dir / SOCKET).exists()
        nvml.write_text("[system]\n[gpu]\nname = NVIDIA H100 80GB HBM3\nmemory_total = 80 GiB\n")
        kubelet.wait_registered(GPU, timeout=60)
        assert len(kubelet.wait_for_devices(GPU, lambda d: len(d) == 1)) == 1


def test_invalid_resource_name_is_caught_before_serving(socket_dir: Path, kubelet: FakeKubelet) -> None:
    plugin = PluginProcess(socket_dir, ["--resource-name", "kubernetes.io/gpu"], profile="h100").start()
    try:
        assert plugin.wait() == 2  # a bad flag value is a usage error, as in every command (issue 24)
        assert "reserved by Kubernetes" in plugin.log()
        assert kubelet.rejections() == [] and not any(
            p.name.startswith("gpunode") for p in socket_dir.iterdir()
        )
    finally:
        plugin.stop()


def test_simulated_node_without_nvml(kubelet: FakeKubelet, socket_dir: Path) -> None:
    # No fake library on the path at all: --simulate needs no NVML.
    env: dict[str, Any] = {"LD_LIBRARY_PATH": ""}
    with PluginProcess(socket_dir, ["--simulate", "dgx-a100"], profile=None, env=env):
        kubelet.wait_registered(GPU)
        ids = [d.id for d in kubelet.wait_for_devices(GPU, lambda d: len(d) == 8)]
        chosen = kubelet.get_preferred_allocation(GPU, ids, [], 4).container_responses[0].deviceIDs
        assert len(chosen) == 4


def test_driver_root_loads_nvml_from_there(kubelet: FakeKubelet, socket_dir: Path) -> None:
    driver_root = socket_dir.parent / "driver"
    lib = driver_root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    os.link(fakenvml.build() / fakenvml.LIBNAME, lib / fakenvml.LIBNAME)
    (driver_root / "dev").mkdir()
    (driver_root / "dev/nvidiactl").write_text("")
    env = {"LD_LIBRARY_PATH": "", "FAKE_NVML_PROFILE": "h100"}
    args = ["--driver-root", str(driver_root), "--pass-device-specs"]
    with PluginProcess(socket_dir, args, profile=None, env=env) as plugin:
        kubelet.wait_registered(GPU)
        [device] = kubelet.wait_for_devices(GPU, lambda d: len(d) == 1)
        answer = kubelet.allocate(GPU, [[device.id]]).container_responses[0]
        assert [(d.container_path, d.host_path) for d in answer.devices] == [
            ("/dev/nvidiactl", f"{driver_root}/dev/nvidiactl"),
            ("/dev/nvidia0", f"{driver_root}/dev/nvidia0"),
        ]
        plugin.wait_for_log(f"NVML loaded from {lib / fakenvml.LIBNAME}")  # the log's writer may lag kubelet


def test_driver_root_without_nvml_is_a_clear_error(socket_dir: Path, tmp_path: Path) -> None:
    plugin = PluginProcess(socket_dir, ["--driver-root", str(tmp_path)], profile=None).start()
    try:
        assert plugin.wait() == 7
        assert "no libnvidia-ml.so.1 under it" in plugin.log() and "Traceback" not in plugin.log()
    finally:
        plugin.stop()


def test_plugin_socket_deleted_alone_is_served_again(kubelet: FakeKubelet, socket_dir: Path) -> None:
    with PluginProcess(socket_dir, profile="h100"):
        kubelet.wait_registered(GPU)
        (socket_dir / SOCKET).unlink()
        reg = kubelet.wait_registered(GPU, count=2)
        assert reg.endpoint == SOCKET
        deadline = time.monotonic() + 30
        while not (socket_dir / SOCKET).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (socket_dir / SOCKET).exists()


def test_registration_refused_by_kubelet_waits_for_a_new_kubelet(socket_dir: Path) -> None:
    import grpc

    from gpunode.plugin.api import deviceplugin_pb2 as pb
    from gpunode.plugin.api import deviceplugin_pb2_grpc as pb_grpc

    calls: list[str] = []
    services: Any = pb_grpc  # generated, untyped

    class Refusing(pb_grpc.RegistrationServicer):
        def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
            calls.append(request.resource_name)
            context.abort(grpc.StatusCode.UNKNOWN, 'the ResourceName "nvidia.com/gpu" is invalid')
            raise AssertionError("abort raises")

    def refusing_kubelet() -> Any:
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        services.add_RegistrationServicer_to_server(Refusing(), server)
        server.add_insecure_port(f"unix://{socket_dir / 'kubelet.sock'}")
        server.start()
        return server

    socket_dir.mkdir(parents=True)
    server = refusing_kubelet()
    try:
        with PluginProcess(socket_dir, profile="h100") as plugin:
            plugin.wait_for_log("kubelet refused the registration")
            assert "is invalid" in plugin.log() and "retrying" not in plugin.log()
            # Refused is final for this kubelet; a new kubelet (a new kubelet.sock) is asked again.
            server.stop(None).wait()
            (socket_dir / "kubelet.sock").unlink(missing_ok=True)
            with FakeKubelet(socket_dir) as kubelet:
                kubelet.wait_registered(GPU)
            assert calls == [GPU]
    finally:
        server.stop(None)


def test_a_socket_it_cannot_serve_is_a_clear_error(socket_dir: Path) -> None:
    # A unix socket path longer than 107 bytes cannot be bound: gRPC's bare "failed to bind" must become
    # a sentence that names the path.
    deep = socket_dir / ("d" * 100)
    deep.mkdir(parents=True)
    plugin = PluginProcess(deep, profile="h100", log_dir=socket_dir).start()
    try:
        assert plugin.wait() == 3
        log = plugin.log()
        assert f"cannot serve on {deep}/gpunode-nvidia.com-gpu.sock" in log and "Traceback" not in log
    finally:
        plugin.stop()


def test_simulated_driver_failure_follows_fail_on_init_error(socket_dir: Path) -> None:
    plugin = PluginProcess(socket_dir, ["--simulate", "no-driver"], profile=None).start()
    try:
        assert plugin.wait() == 7 and "Driver Not Loaded" in plugin.log()
    finally:
        plugin.stop()
    args = ["--simulate", "no-driver", "--no-fail-on-init-error"]
    with PluginProcess(socket_dir, args, profile=None) as waiting:
        waiting.wait_for_log("retrying")
        assert waiting.proc is not None and waiting.proc.poll() is None


class NotifySocket:
    """What systemd's notification socket would receive from the plugin (a real datagram socket)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[dict[str, str]] = []

    def receive(self, key: str, timeout: float = 30.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            for message in self.messages:
                if key in message:
                    self.messages.remove(message)
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key} notification within {timeout} s; got {self.messages}")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))

    def close(self) -> None:
        self.sock.close()


def test_sd_notify_ready_only_after_registration_and_watchdog(socket_dir: Path) -> None:
    notify = NotifySocket(socket_dir.parent / "notify.sock")
    socket_dir.mkdir()
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"}
    try:
        with PluginProcess(socket_dir, profile="pcie-4", env=env) as plugin:
            notify.receive("WATCHDOG")  # fed by the event loop (every 0.2 s here) before kubelet exists
            plugin.wait_for_log("waiting for kubelet")
            assert not any("READY" in m for m in notify.messages)  # cannot register: never ready
            with FakeKubelet(socket_dir) as kubelet:
                kubelet.wait_registered(GPU)
                ready = notify.receive("READY")
                assert ready["READY"] == "1" and "nvidia.com/gpu: 4/4 healthy, registered" in ready["STATUS"]
                notify.receive("WATCHDOG")
                status = json.loads(plugin.status_path.read_text())
                assert status["ready"] and status["pid"] == plugin.pid
                assert status["resources"][0]["name"] == GPU and status["resources"][0]["registered"]
            plugin.signal(signal.SIGTERM)
            assert plugin.wait() == 0
            notify.receive("STOPPING")
            assert not plugin.status_path.exists()
    finally:
        notify.close()
