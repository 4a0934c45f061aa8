"""The device plugin on a production node: it cannot be starved or made to lie (issue 13).

`gpunode plugin run` as a real process against the fake kubelet, real gRPC clients over unix sockets,
the real pynvml on the fake libnvidia-ml.so.1. Every wait has a generous deadline and ends on the event
it waits for; nothing here measures time.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.kubelet import HEALTHY, DeviceInfo, FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"
SOCKET = "gpunode-nvidia.com-gpu.sock"
DEADLINE = 60.0  # a shared 2-core machine under other engineers' test runs


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_dir) as k:
        yield k


def wait_status(plugin: PluginProcess, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The plugin's status file once it satisfies the predicate (it is rewritten on every change)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            status: dict[str, Any] = json.loads(plugin.status_path.read_text())
        except (FileNotFoundError, ValueError):  # not written yet, or caught mid-rename
            status = {}
        if status and predicate(status):
            return status
        assert time.monotonic() < deadline, f"status never matched; last: {status}\n{plugin.log()}"
        time.sleep(0.02)


def healthy(devices: list[DeviceInfo], count: int) -> bool:
    return len(devices) == count and all(d.health == HEALTHY for d in devices)


# -- "cannot monitor" is not "unhealthy" -------------------------------------------------------------


def test_nvml_without_uuid_lookup_still_advertises_every_gpu(kubelet: FakeKubelet, socket_dir: Path) -> None:
    config = socket_dir.parent / "machine.ini"
    config.write_text("[system]\nmissing = nvmlDeviceGetHandleByUUID\n" + "[gpu]\n" * 4)
    with PluginProcess(socket_dir, nvml_config=config, profile=None) as plugin:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
        plugin.wait_for_log("health monitor armed", timeout=DEADLINE)
        status = wait_status(plugin, lambda s: s["ready"])
        assert status["resources"][0]["healthy"] == 4
        assert status["unmonitored"] == []
        assert kubelet.allocatable(GPU) == 4
        assert "unhealthy" not in plugin.log()


def test_refused_event_registration_is_reported_unmonitored_and_stays_schedulable(
    kubelet: FakeKubelet, socket_dir: Path
) -> None:
    config = socket_dir.parent / "machine.ini"
    config.write_text("[system]\nmissing = nvmlDeviceRegisterEvents\n" + "[gpu]\n" * 2)
    with PluginProcess(socket_dir, nvml_config=config, profile=None) as plugin:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        devices = kubelet.wait_for_devices(GPU, lambda d: healthy(d, 2), timeout=DEADLINE)
        status = wait_status(plugin, lambda s: s["ready"] and len(s["unmonitored"]) == 2)
        assert [g["uuid"] for g in status["unmonitored"]] == [d.id for d in devices]
        assert all("registering its Xid/ECC events" in g["reason"] for g in status["unmonitored"])
        assert status["resources"][0]["healthy"] == 2 and status["resources"][0]["unmonitored"] == 2
        assert "2 unmonitored" in status["summary"]
        assert kubelet.allocatable(GPU) == 2
        # The warning is logged after the status update is queued, by the log's writer thread: wait for it.
        plugin.wait_for_log("is not monitored")
        assert "unhealthy" not in plugin.log()


# -- idle or abusive clients on the socket -------------------------------------------------------------


class Watcher:
    """A ListAndWatch stream of our own on the plugin's socket, opened and then left idle."""

    def __init__(self, channel: Any) -> None:
        from gpunode.plugin.api import deviceplugin_pb2 as pb
        from gpunode.plugin.api import deviceplugin_pb2_grpc

        pb_grpc: Any = deviceplugin_pb2_grpc  # generated, untyped
        self.call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        self.first: Any = None
        self.error: Any = None

    def settle(self) -> None:
        """Block until the plugin answered the stream: its first device list, or a refusal."""
        import grpc

        try:
            self.first = next(self.call)
        except grpc.RpcError as err:
            self.error = err


def test_idle_streams_cannot_starve_kubelets_allocate(kubelet: FakeKubelet, socket_dir: Path) -> None:
    import grpc

    from gpunode.plugin.server import MAX_STREAMS

    with PluginProcess(socket_dir, profile="pcie-4") as plugin:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        devices = kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
        # 15 more streams: with kubelet's one, that was every one of the 16 workers.
        with grpc.insecure_channel(f"unix://{socket_dir / SOCKET}") as channel:
            watchers = [Watcher(channel) for _ in range(15)]
            for w in watchers:
                w.settle()
            # kubelet still gets its answers (a generous deadline: only a starved server reaches it).
            answer = kubelet.allocate(GPU, [[devices[0].id]], timeout=DEADLINE)
            assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == devices[0].id
            assert kubelet.options(GPU, timeout=DEADLINE).get_preferred_allocation_available
            admitted = [w for w in watchers if w.first is not None]
            refused = [w for w in watchers if w.error is not None]
            assert len(admitted) == MAX_STREAMS - 1  # kubelet holds one
            assert len(refused) == 15 - len(admitted)
            assert {w.error.code() for w in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            for w in admitted:
                w.call.cancel()
        # A stream slot is free again once a watcher leaves: kubelet re-registering gets its stream.
        plugin.signal(signal.SIGHUP)
        kubelet.wait_registered(GPU, count=2, timeout=DEADLINE)
        kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
        # The refusals are logged in one line, not fifteen. Counted once the reload's line is in the log:
        # the log's writer thread writes in order, so every refusal logged before it is there too.
        plugin.wait_for_log("re-reading the GPUs (SIGHUP)")
        assert plugin.log().count("refused a ListAndWatch stream") == 1


def test_watchers_holding_every_slot_never_keep_kubelets_stream_out(
    kubelet: FakeKubelet, socket_dir: Path
) -> None:
    """While kubelet is away (restarting), other clients take every ListAndWatch slot. When kubelet is back
    and the plugin registers again, the stream kubelet opens in answer is admitted — the oldest watcher is
    ended to make room — and kubelet sees its devices; a watcher opening a stream at another moment is still
    refused."""
    import grpc

    from gpunode.plugin.server import MAX_STREAMS

    with PluginProcess(socket_dir, profile="pcie-4") as plugin:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
        kubelet.stop()  # its stream ends with it; the plugin's socket stays
        kubelet.wait_stream_ended(GPU, timeout=DEADLINE)
        with grpc.insecure_channel(f"unix://{socket_dir / SOCKET}") as channel:
            # The plugin frees kubelet's slot when it sees the call end, a moment after kubelet did.
            watchers: list[Watcher] = []
            deadline = time.monotonic() + DEADLINE
            while len(watchers) < MAX_STREAMS:
                assert time.monotonic() < deadline, "the slots kubelet left were never free"
                w = Watcher(channel)
                w.settle()
                if w.first is not None:
                    watchers.append(w)
                else:
                    time.sleep(0.05)
            late = Watcher(channel)
            late.settle()
            assert late.error is not None and late.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            kubelet.start()
            kubelet.wait_registered(GPU, count=2, timeout=DEADLINE)
            kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
            plugin.wait_for_log("to admit kubelet's", timeout=DEADLINE)
            for w in watchers:
                w.call.cancel()


def test_request_content_never_forges_or_floods_a_log_line(kubelet: FakeKubelet, socket_dir: Path) -> None:
    import grpc

    with PluginProcess(socket_dir, ["--pre-start-required"], profile="pcie-4") as plugin:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
        forged = "GPU-0\n2026-01-01 00:00:00,000 INFO nvidia.com/gpu: allocated GPU-everything"
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [[forged]], timeout=DEADLINE)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        huge = "GPU-" + "9" * 1_000_000
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [[huge]], timeout=DEADLINE)
        assert len(err.value.details() or "") < 300
        kubelet.pre_start_container(GPU, [forged], timeout=DEADLINE)
        plugin.wait_for_log("PreStartContainer for", timeout=DEADLINE)
        lines = plugin.log().splitlines()
        assert not [line for line in lines if "allocated GPU-everything" in line and "\\n" not in line]
        assert any("GPU-0\\n2026-01-01" in line and "PreStartContainer" in line for line in lines)
        assert max(len(line) for line in lines) < 2000


# -- one plugin per socket directory, and what it writes ------------------------------------------------


def test_a_second_plugin_on_the_same_socket_directory_is_refused(
    kubelet: FakeKubelet, socket_dir: Path
) -> None:
    with PluginProcess(socket_dir, profile="pcie-4") as first:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
        inode = (socket_dir / SOCKET).stat().st_ino
        second = PluginProcess(socket_dir, profile="pcie-4").start()
        try:
            assert second.wait(DEADLINE) == 3  # ExitCode.ERROR, with the message and the fix
        finally:
            log = second.log()
            second.__exit__(None, None, None)
        assert "another gpunode device plugin is serving in" in log
        # The first one never noticed: same socket, one registration, still listing every GPU.
        assert (socket_dir / SOCKET).stat().st_ino == inode
        assert len(kubelet.registrations(GPU)) == 1
        assert kubelet.allocatable(GPU) == 4
        assert "serving again" not in first.log()


def test_a_status_file_that_cannot_be_written_is_a_warning(kubelet: FakeKubelet, socket_dir: Path) -> None:
    blocker = socket_dir.parent / "not-a-directory"
    blocker.write_text("a file where the status file's directory should be\n")
    env = {"GPUNODE_PLUGIN_STATUS_FILE": str(blocker / "status.json")}
    with PluginProcess(socket_dir, profile="pcie-4", env=env) as plugin:
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        kubelet.wait_for_devices(GPU, lambda d: healthy(d, 4), timeout=DEADLINE)
        plugin.wait_for_log("ready:", timeout=DEADLINE)
        assert plugin.proc is not None and plugin.proc.poll() is None
        assert plugin.log().count("cannot write the status file") == 1  # said once, not per update


def test_the_ready_line_is_logged_once(kubelet: FakeKubelet, socket_dir: Path) -> None:
    control = socket_dir.parent / "nvml-control"
    control.write_text("")
    from tests import fakenvml

    args = ["--mig-strategy", "mixed", "--recovery-quiet-period", "0"]
    with PluginProcess(socket_dir, args, profile="mig", control=control) as plugin:
        for resource in ("nvidia.com/gpu", "nvidia.com/mig-1g.5gb", "nvidia.com/mig-2g.10gb"):
            kubelet.wait_registered(resource, timeout=DEADLINE)
        plugin.wait_for_log("ready:", timeout=DEADLINE)
        plugin.wait_for_log("health monitor armed", timeout=DEADLINE)
        fakenvml.inject(control, "xid 1 79")  # a status update while ready
        wait_status(plugin, lambda s: any(r["healthy"] < r["devices"] for r in s["resources"]))
        assert plugin.log().count(" ready: ") == 1


def test_a_device_list_over_kubelets_limit_is_refused_at_start(socket_dir: Path) -> None:
    # 32 GPUs in MIG mode with 3 instances each, 1,024 replicas: 98,304 devices, about 7 MB of list.
    mig = "".join(
        f"[mig]\nname = NVIDIA A100-SXM4-40GB MIG 1g.5gb\ngpu_instance_id = {gi}\nslice_count = 1\n"
        for gi in (7, 8, 9)
    )
    gpu = "[gpu]\nname = NVIDIA A100-SXM4-40GB\nmig_capable = 1\nmig_mode = 1\n" + mig
    config = socket_dir.parent / "machine.ini"
    config.write_text(gpu * 32)
    socket_dir.mkdir(parents=True)
    args = ["--mig-strategy", "single", "--replicas", "1024"]
    with PluginProcess(socket_dir, args, nvml_config=config, profile=None) as plugin:
        assert plugin.wait(DEADLINE) == 4
        assert "over kubelet's 4 MiB limit" in plugin.log()
        assert "ready" not in plugin.log()
        assert not (socket_dir / SOCKET).exists()


def test_what_answers_on_kubelet_sock_cannot_forge_a_log_line(socket_dir: Path) -> None:
    from concurrent import futures

    import grpc

    from gpunode.plugin.api import deviceplugin_pb2 as pb
    from gpunode.plugin.api import deviceplugin_pb2_grpc

    services: Any = deviceplugin_pb2_grpc  # generated, untyped
    # Long, but under gRPC's own 8 KiB soft limit on the status text, which it enforces by chance.
    forged = "no\n2026-01-01 00:00:00,000 INFO nvidia.com/gpu: registered with kubelet" + "!" * 3_000

    class Refusing(services.RegistrationServicer):  # type: ignore[misc]
        def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
            context.abort(grpc.StatusCode.UNKNOWN, forged)
            raise AssertionError("abort raises")

    socket_dir.mkdir(parents=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    services.add_RegistrationServicer_to_server(Refusing(), server)
    server.add_insecure_port(f"unix://{socket_dir / 'kubelet.sock'}")
    server.start()
    try:
        with PluginProcess(socket_dir, profile="h100") as plugin:
            plugin.wait_for_log("kubelet refused the registration", timeout=DEADLINE)
            status = wait_status(plugin, lambda s: bool(s["resources"] and s["resources"][0]["refused"]))
            lines = plugin.log().splitlines()
            assert not [line for line in lines if line.endswith("registered with kubelet")]
            assert any("refused the registration: no\\n2026-01-01" in line for line in lines)
            assert max(len(line) for line in lines) < 1000
            assert len(status["resources"][0]["refused"]) < 400 and "\n" not in status["summary"]
    finally:
        server.stop(None)
