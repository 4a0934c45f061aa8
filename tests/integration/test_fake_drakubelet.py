"""The fake kubelet DRA side (tests/integration/drakubelet.py) against a tiny DRA plugin on gpunode's stubs.

Real gRPC over unix sockets in a temp dir: the plugin serves Registration on `<registry>/<driver>-reg.sock`
and DRAPlugin v1, v1beta1 and the v1alpha1 health stream on `<plugins>/<driver>/dra.sock`, as the Go
kubeletplugin library does (shared/specs/dra-kubelet-plugin.md §8).
"""

from __future__ import annotations

import importlib
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from gpunode.dra.api import dra_health_v1alpha1_pb2 as health_pb
from gpunode.dra.api import dra_health_v1alpha1_pb2_grpc as health_grpc
from gpunode.dra.api import dra_v1_pb2 as v1_pb
from gpunode.dra.api import dra_v1_pb2_grpc as v1_grpc
from gpunode.dra.api import dra_v1beta1_pb2 as v1beta1_pb
from gpunode.dra.api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from gpunode.dra.api import pluginregistration_pb2 as reg_pb
from gpunode.dra.api import pluginregistration_pb2_grpc as reg_grpc
from tests.integration.drakubelet import Claim, DraCallError, FakeDraKubelet, PreparedDevice

grpc: Any = importlib.import_module("grpc")
_reg: Any = reg_grpc
_v1: Any = v1_grpc
_v1beta1: Any = v1beta1_grpc
_health: Any = health_grpc

DRIVER = "gpu.example.com"
BOTH = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
CLAIM_A = Claim("default", "uid-a", "claim-a")
CLAIM_B = Claim("team", "uid-b", "claim-b")

# What a test's plugin answers for a claim: (devices as keyword dicts, error).
Answer = Callable[[Any], tuple[list[dict[str, Any]], str]]


def _gpu_answer(claim: Any) -> tuple[list[dict[str, Any]], str]:
    return [
        {
            "request_names": ["gpu"],
            "pool_name": "node-1",
            "device_name": "gpu-0",
            "cdi_device_ids": [f"k8s.{DRIVER}/claim={claim.uid}-gpu-0"],
        }
    ], ""


class TinyDraPlugin:
    """A DRA plugin as small as the protocol allows, with knobs for what each test needs to go wrong."""

    def __init__(
        self,
        registry: Path,
        plugins: Path,
        *,
        driver: str = DRIVER,
        versions: tuple[str, ...] = BOTH,
        plugin_type: str = "DRAPlugin",
        endpoint: str | None = None,
    ) -> None:
        self.driver = driver
        self.versions = versions
        self.plugin_type = plugin_type
        self.reg_socket = registry / f"{driver}-reg.sock"
        self.dra_socket = plugins / driver / "dra.sock"
        self.endpoint = str(self.dra_socket) if endpoint is None else endpoint
        self.answer: Answer = _gpu_answer
        self.share_id: str | None = None
        self.rewrite: Callable[[Any], None] = lambda response: None  # edits Prepare's response last
        self.hold_getinfo = threading.Event()  # set: the next GetInfo waits for release_getinfo
        self.release_getinfo = threading.Event()
        self.getinfo_calls = 0
        self.notifications: list[tuple[bool, str]] = []
        self.requests: list[tuple[str, str, tuple[str, ...]]] = []  # (service, method, claim UIDs)
        self.health: queue.Queue[list[tuple[str, health_pb.HealthStatus, str]] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._servers: list[Any] = []

    def start(self) -> None:
        """DRA first, then the registration socket, as kubelet expects."""
        self.dra_socket.parent.mkdir(parents=True, exist_ok=True)
        self.reg_socket.parent.mkdir(parents=True, exist_ok=True)
        dra = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        _v1.add_DRAPluginServicer_to_server(_DraService(self, "v1", v1_pb), dra)
        _v1beta1.add_DRAPluginServicer_to_server(_DraService(self, "v1beta1", v1beta1_pb), dra)
        _health.add_DRAResourceHealthServicer_to_server(_Health(self), dra)
        assert dra.add_insecure_port(f"unix:{self.dra_socket}") != 0
        dra.start()
        reg = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        _reg.add_RegistrationServicer_to_server(_Registration(self), reg)
        assert reg.add_insecure_port(f"unix:{self.reg_socket}") != 0
        reg.start()
        self._servers = [reg, dra]

    def stop(self) -> None:
        self.release_getinfo.set()
        self.health.put(None)
        for server in self._servers:
            server.stop(None).wait()
        self._servers = []

    def wait_notified(self, count: int = 1) -> tuple[bool, str]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.notifications) >= count, 30.0), self.notifications
            return self.notifications[count - 1]


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: TinyDraPlugin) -> None:
        self.plugin = plugin

    def GetInfo(self, request: Any, context: Any) -> reg_pb.PluginInfo:
        plugin = self.plugin
        with plugin._cond:
            plugin.getinfo_calls += 1
        if plugin.hold_getinfo.is_set():
            plugin.hold_getinfo.clear()
            plugin.release_getinfo.wait(30.0)
        return reg_pb.PluginInfo(
            type=plugin.plugin_type,
            name=plugin.driver,
            endpoint=plugin.endpoint,
            supported_versions=list(plugin.versions),
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> reg_pb.RegistrationStatusResponse:
        with self.plugin._cond:
            self.plugin.notifications.append((request.plugin_registered, request.error))
            self.plugin._cond.notify_all()
        return reg_pb.RegistrationStatusResponse()


class _DraService:
    """NodePrepareResources / NodeUnprepareResources of one API version (both share the message shapes)."""

    def __init__(self, plugin: TinyDraPlugin, version: str, pb: Any) -> None:
        self.plugin, self.version, self.pb = plugin, version, pb

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        self.plugin.requests.append((self.version, "prepare", tuple(c.uid for c in request.claims)))
        response = self.pb.NodePrepareResourcesResponse()
        for claim in request.claims:
            devices, error = self.plugin.answer(claim)
            result = response.claims[claim.uid]
            result.error = error
            for device in devices:
                added = result.devices.add(**device)
                if self.version == "v1" and self.plugin.share_id is not None:
                    added.share_id = self.plugin.share_id
        self.plugin.rewrite(response)
        return response

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        self.plugin.requests.append((self.version, "unprepare", tuple(c.uid for c in request.claims)))
        response = self.pb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].error = ""
        return response


class _Health(health_grpc.DRAResourceHealthServicer):
    """Sends each list put on plugin.health; None ends the stream."""

    def __init__(self, plugin: TinyDraPlugin) -> None:
        self.plugin = plugin

    def NodeWatchResources(
        self, request: Any, context: Any
    ) -> Iterator[health_pb.NodeWatchResourcesResponse]:
        while context.is_active():
            try:
                devices = self.plugin.health.get(timeout=0.1)  # a stop flag check, not synchronisation
            except queue.Empty:
                continue
            if devices is None:
                return
            yield health_pb.NodeWatchResourcesResponse(
                devices=[
                    health_pb.DeviceHealth(
                        device=health_pb.DeviceIdentifier(pool_name="node-1", device_name=name),
                        health=status,
                        last_updated_time=1_700_000_000,
                        health_check_timeout_seconds=60,
                        message=message,
                    )
                    for name, status, message in devices
                ]
            )


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    # Short paths: a unix socket path must fit in 107 bytes.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="drak-") as tmp:
        yield Path(tmp) / "plugins_registry", Path(tmp) / "plugins"


@pytest.fixture
def wipes() -> list[tuple[str, str | None]]:
    return []


@pytest.fixture
def kubelet(dirs: tuple[Path, Path], wipes: list[tuple[str, str | None]]) -> Iterator[FakeDraKubelet]:
    fake = FakeDraKubelet(
        dirs[0],
        wipe_slices=lambda node, driver: wipes.append((node, driver)),
        backoff_initial=0.05,
        health_retry=0.05,
    )
    with fake:
        yield fake


@pytest.fixture
def make_plugin(dirs: tuple[Path, Path]) -> Iterator[Callable[..., TinyDraPlugin]]:
    plugins: list[TinyDraPlugin] = []

    def make(**kwargs: Any) -> TinyDraPlugin:
        plugin = TinyDraPlugin(dirs[0], dirs[1], **kwargs)
        plugins.append(plugin)
        return plugin

    yield make
    for plugin in plugins:
        plugin.stop()


def test_registration_happy_path(kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin]) -> None:
    plugin = make_plugin()
    plugin.start()
    registration = kubelet.wait_registered(DRIVER)
    assert registration.endpoint == str(plugin.dra_socket)
    assert registration.version == "v1.DRAPlugin"
    assert registration.socket == plugin.reg_socket
    assert plugin.wait_notified() == (True, "")
    kubelet.wait_connected(DRIVER)
    assert [r.driver for r in kubelet.registered(DRIVER)] == [DRIVER]
    assert kubelet.rejections() == []


def test_sockets_present_at_start_are_found_and_dotfiles_ignored(
    dirs: tuple[Path, Path], make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    plugin = make_plugin()
    plugin.start()
    hidden = make_plugin(driver=".hidden.example.com")
    hidden.start()
    with FakeDraKubelet(dirs[0], backoff_initial=0.05) as kubelet:
        kubelet.wait_registered(DRIVER)
        assert hidden.getinfo_calls == 0
        assert [r.driver for r in kubelet.registrations()] == [DRIVER]


def test_getinfo_slower_than_a_second_is_rejected_and_retried(
    kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    plugin = make_plugin()
    plugin.hold_getinfo.set()
    plugin.start()
    rejection = kubelet.wait_rejected(plugin.reg_socket)
    assert rejection.stage == "getinfo"
    assert "DEADLINE_EXCEEDED" in rejection.message
    assert not rejection.notified
    assert kubelet.registrations() == []
    plugin.release_getinfo.set()
    registration = kubelet.wait_registered(DRIVER)
    assert registration.time > rejection.time
    assert plugin.getinfo_calls >= 2
    assert plugin.notifications == [(True, "")]


@pytest.mark.parametrize(
    ("versions", "chosen"),
    [
        (BOTH, "v1.DRAPlugin"),
        (("v1beta1.DRAPlugin", "v1.DRAPlugin"), "v1beta1.DRAPlugin"),  # the plugin's order decides
        (("v1beta1.DRAPlugin",), "v1beta1.DRAPlugin"),
        (("v9.DRAPlugin", "v1beta1.DRAPlugin"), "v1beta1.DRAPlugin"),  # unknown entries are skipped
    ],
)
def test_the_first_known_version_wins(
    kubelet: FakeDraKubelet,
    make_plugin: Callable[..., TinyDraPlugin],
    versions: tuple[str, ...],
    chosen: str,
) -> None:
    make_plugin(versions=versions).start()
    assert kubelet.wait_registered(DRIVER).version == chosen


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"versions": ("v9.DRAPlugin",)}, "none of the versions"),
        ({"versions": ()}, "none of the versions"),
        ({"plugin_type": "CSIPlugin"}, "plugin type: CSIPlugin"),
        ({"endpoint": "plugins/dra.sock"}, "not an absolute path"),
    ],
)
def test_invalid_plugin_info_is_rejected_told_and_retried(
    kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin], knobs: dict[str, Any], words: str
) -> None:
    plugin = make_plugin(**knobs)
    plugin.start()
    second = kubelet.wait_rejected(plugin.reg_socket, count=2)  # retried with backoff
    first = kubelet.rejections(plugin.reg_socket)[0]
    assert first.stage == second.stage == "validate"
    assert words in first.message
    registered, reason = plugin.wait_notified()
    assert not registered
    assert reason == first.message
    assert kubelet.registrations() == []


def test_socket_removed_deregisters_and_recreated_registers_again(
    kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    plugin = make_plugin()
    plugin.start()
    first = kubelet.wait_registered(DRIVER)
    plugin.stop()  # gRPC unlinks the sockets on shutdown
    if plugin.reg_socket.exists():
        plugin.reg_socket.unlink()
    gone = kubelet.wait_deregistered(DRIVER)
    assert gone.reason == "socket-removed"
    assert kubelet.registered(DRIVER) == []
    again = make_plugin()
    again.start()
    assert kubelet.wait_registered(DRIVER, count=2).time > first.time


def test_restart_wipes_the_nodes_slices_and_registers_existing_sockets_again(
    kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin], wipes: list[tuple[str, str | None]]
) -> None:
    make_plugin().start()
    kubelet.wait_registered(DRIVER)
    kubelet.wait_wiped(None)
    restarted = kubelet.restart()
    assert kubelet.wait_wiped(None, after=restarted).node_name == "node-1"
    assert kubelet.wait_registered(DRIVER, after=restarted).generation == 1
    assert wipes.count(("node-1", None)) == 2


def test_a_start_up_wipe_that_fails_is_retried_until_done(dirs: tuple[Path, Path]) -> None:
    attempts: list[str | None] = []

    def wipe(node: str, driver: str | None) -> None:
        attempts.append(driver)
        if len(attempts) < 3:
            raise ConnectionError("the API server is not there yet")

    with FakeDraKubelet(dirs[0], wipe_slices=wipe, backoff_initial=0.01) as kubelet:
        done = kubelet.wait_wiped(None)
    failed = [w for w in kubelet.wipes() if w.error is not None]
    assert [w.error for w in failed] == ["ConnectionError: the API server is not there yet"] * 2
    assert done.time > failed[-1].time
    assert attempts == [None, None, None]


def test_a_driver_gone_for_the_wipe_delay_has_its_slices_wiped(
    dirs: tuple[Path, Path], make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    wiped: list[tuple[str, str | None]] = []
    with FakeDraKubelet(
        dirs[0],
        node_name="gpu-7",
        wipe_slices=lambda node, driver: wiped.append((node, driver)),
        wipe_slices_at_start=False,
        wipe_delay=0.2,
        backoff_initial=0.05,
    ) as kubelet:
        plugin = make_plugin()
        plugin.start()
        kubelet.wait_registered(DRIVER)
        kubelet.wait_connected(DRIVER)
        plugin.stop()
        gone = kubelet.wait_deregistered(DRIVER)
        wipe = kubelet.wait_wiped(DRIVER)
        assert wipe.time >= gone.time + 0.2
        assert wiped == [("gpu-7", DRIVER)]  # once per loss, and no start-up wipe


def test_a_driver_back_within_the_wipe_delay_keeps_its_slices(
    dirs: tuple[Path, Path], make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    wiped: list[tuple[str, str | None]] = []
    # A delay no test run reaches: the point is that the reconnection cancels it, seen in the state.
    with FakeDraKubelet(
        dirs[0], wipe_slices=lambda n, d: wiped.append((n, d)), wipe_slices_at_start=False, wipe_delay=3600
    ) as kubelet:
        plugin = make_plugin()
        plugin.start()
        kubelet.wait_registered(DRIVER)  # connected comes before Notify(true): wait for both
        kubelet.wait_connected(DRIVER)
        assert DRIVER not in kubelet._disconnected_since
        plugin.stop()
        kubelet.wait_deregistered(DRIVER)
        assert DRIVER in kubelet._disconnected_since
        make_plugin().start()
        kubelet.wait_registered(DRIVER, count=2)
        kubelet.wait_connected(DRIVER)
        assert DRIVER not in kubelet._disconnected_since
    assert wiped == []


@pytest.mark.parametrize(("versions", "share_id"), [(BOTH, "share-1"), (("v1beta1.DRAPlugin",), None)])
def test_prepare_and_unprepare_round_trip(
    kubelet: FakeDraKubelet,
    make_plugin: Callable[..., TinyDraPlugin],
    versions: tuple[str, ...],
    share_id: str | None,
) -> None:
    plugin = make_plugin(versions=versions)
    plugin.share_id = "share-1"  # v1beta1 has no field for it: kubelet must see None there
    plugin.start()
    registration = kubelet.wait_registered(DRIVER)
    service = registration.version.split(".")[0]
    prepared = kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_B])
    assert prepared == {
        claim.uid: (
            PreparedDevice(("gpu",), "node-1", "gpu-0", (f"k8s.{DRIVER}/claim={claim.uid}-gpu-0",), share_id),
        )
        for claim in (CLAIM_A, CLAIM_B)
    }
    kubelet.unprepare(DRIVER, [CLAIM_A, CLAIM_B])
    assert plugin.requests == [
        (service, "prepare", ("uid-a", "uid-b")),
        (service, "unprepare", ("uid-a", "uid-b")),
    ]
    calls = kubelet.calls(DRIVER)
    assert [(c.method, c.version, c.error) for c in calls] == [
        ("NodePrepareResources", registration.version, None),
        ("NodeUnprepareResources", registration.version, None),
    ]
    assert calls[0].end >= calls[0].start


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            lambda c: ([], "no such GPU" if c.uid == "uid-b" else ""),
            "failed for claim team/claim-b: no such GPU",
        ),
    ],
)
def test_a_claim_error_fails_the_whole_prepare(
    kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin], answer: Answer, message: str
) -> None:
    plugin = make_plugin()
    plugin.answer = answer
    plugin.start()
    kubelet.wait_registered(DRIVER)
    with pytest.raises(DraCallError, match=message):
        kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_B])
    assert kubelet.calls()[-1].error == f"NodePrepareResources {message}"


def test_a_left_out_or_unknown_claim_fails_the_call(
    kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    plugin = make_plugin()
    plugin.start()
    kubelet.wait_registered(DRIVER)

    def answer_another(response: Any) -> None:
        response.claims["uid-x"].CopyFrom(response.claims.pop("uid-a"))  # a claim nobody asked for

    plugin.rewrite = answer_another
    with pytest.raises(DraCallError, match="returned result for unknown claim UID uid-x"):
        kubelet.prepare(DRIVER, [CLAIM_A])

    def leave_out(response: Any) -> None:
        del response.claims["uid-b"]

    plugin.rewrite = leave_out
    with pytest.raises(DraCallError, match="NodePrepareResources left out 1 claims"):
        kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_B])
    assert [c.error is not None for c in kubelet.calls(DRIVER)] == [True, True]


def test_a_grpc_error_or_an_unregistered_driver_fails_the_call(
    kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    with pytest.raises(DraCallError, match="not found in the list of registered DRA plugins"):
        kubelet.prepare(DRIVER, [CLAIM_A])
    plugin = make_plugin()

    def boom(claim: Any) -> tuple[list[dict[str, Any]], str]:
        raise RuntimeError("driver bug")

    plugin.answer = boom
    plugin.start()
    kubelet.wait_registered(DRIVER)
    with pytest.raises(DraCallError, match="NodePrepareResources failed: rpc error: code = UNKNOWN"):
        kubelet.prepare(DRIVER, [CLAIM_A])


def test_health_messages_are_recorded_and_a_lost_stream_reopened(
    kubelet: FakeDraKubelet, make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    plugin = make_plugin()
    plugin.start()
    kubelet.wait_registered(DRIVER)
    plugin.health.put([("gpu-0", health_pb.HEALTHY, ""), ("gpu-1", health_pb.HEALTHY, "")])
    kubelet.wait_health(DRIVER, lambda h: len(h) == 2)
    plugin.health.put(
        [("gpu-0", health_pb.HEALTHY, ""), ("gpu-1", health_pb.UNHEALTHY, "Xid 79 " + "x" * 2000)]
    )
    health = kubelet.wait_health(
        DRIVER,
        lambda h: (
            h.get(("node-1", "gpu-1"), None) is not None and h[("node-1", "gpu-1")].health == "UNHEALTHY"
        ),
    )
    gpu1 = health[("node-1", "gpu-1")]
    assert gpu1.message.startswith("Xid 79 ")
    assert len(gpu1.message.encode()) == 1024  # kubelet cuts longer messages
    assert (gpu1.last_updated_time, gpu1.health_check_timeout_seconds) == (1_700_000_000, 60)
    updates = kubelet.health_updates(DRIVER)
    assert [[d.health for d in u.devices] for u in updates] == [
        ["HEALTHY", "HEALTHY"],
        ["HEALTHY", "UNHEALTHY"],
    ]
    plugin.health.put(None)  # the plugin ends the stream: kubelet forgets, then opens it again
    end = kubelet.wait_health_stream_ended(DRIVER)
    assert end.code == "OK"
    plugin.health.put([("gpu-0", health_pb.UNHEALTHY, "lost")])
    after = kubelet.wait_health(DRIVER, lambda h: len(h) == 1)
    assert after[("node-1", "gpu-0")].health == "UNHEALTHY"
    assert kubelet.health_updates(DRIVER)[-1].time > end.time


def test_stop_leaves_the_plugins_sockets_and_no_threads(
    dirs: tuple[Path, Path], make_plugin: Callable[..., TinyDraPlugin]
) -> None:
    before = {t.ident for t in threading.enumerate()}
    plugin = make_plugin()
    plugin.start()
    with FakeDraKubelet(dirs[0], backoff_initial=0.05) as kubelet:
        kubelet.wait_registered(DRIVER)
        plugin.health.put([("gpu-0", health_pb.HEALTHY, "")])
        kubelet.wait_health(DRIVER)
    assert plugin.reg_socket.exists() and plugin.dra_socket.exists()
    assert kubelet.deregistrations(DRIVER)[-1].reason == "kubelet-stopped"
    left = [
        t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("dra-kubelet")
    ]
    assert left == []
