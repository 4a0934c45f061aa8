"""The fake kubelet (tests/integration/kubelet.py) against a tiny in-test device plugin with two devices.

The device plugin's own tests trust this fake to refuse, dial back, watch and restart like kubelet, so the
fake's behaviour is pinned here first.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.api import deviceplugin_pb2_grpc as pb_grpc
from tests.integration.kubelet import (
    CHECKPOINT,
    FAILED,
    HEALTHY,
    KUBELET_STOPPED,
    REPLACED,
    RETURNED,
    UNHEALTHY,
    VERSION,
    DeviceInfo,
    FakeKubelet,
    grpc,
    is_valid_extended_resource_name,
)

_services: Any = pb_grpc  # untyped generated module
RESOURCE = "example.com/tiny"
SOCKET = "tiny.sock"
ALL_OPTIONS = pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)


class TinyPlugin(pb_grpc.DevicePluginServicer):
    """A minimal device plugin: devices dev-0 (NUMA 0) and dev-1 (NUMA 1), health settable by the test."""

    def __init__(self, name: str = "tiny", options: pb.DevicePluginOptions = ALL_OPTIONS) -> None:
        self.name = name
        self.plugin_options = options
        self.health = {"dev-0": HEALTHY, "dev-1": HEALTHY}
        self.registering = False
        self.options_calls: list[bool] = []  # for each GetDevicePluginOptions: was Register in flight?
        self.pre_started: list[list[str]] = []
        self.open_streams = 0
        self.server: Any = None
        self._cond = threading.Condition()
        self._version = 0  # bumped on every change; each stream sends when it has not sent this one
        self._end_streams = False

    def serve(self, path: Path, workers: int = 4) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        _services.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{path}")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(None).wait(30)
            self.server = None

    def register(
        self,
        kubelet: FakeKubelet,
        resource: str = RESOURCE,
        endpoint: str = SOCKET,
        version: str = VERSION,
        options: pb.DevicePluginOptions | None = None,
    ) -> None:
        """Register with kubelet; the request carries `options`, or the options this plugin answers."""
        channel = grpc.insecure_channel(f"unix:{kubelet.kubelet_socket}")
        self.registering = True
        try:
            request = pb.RegisterRequest(
                version=version,
                endpoint=endpoint,
                resource_name=resource,
                options=options or self.plugin_options,
            )
            _services.RegistrationStub(channel).Register(request, timeout=60)
        finally:
            self.registering = False
            channel.close()

    def set_health(self, device: str, health: str) -> None:
        with self._cond:
            self.health[device] = health
            self._version += 1
            self._cond.notify_all()

    def end_streams(self) -> None:
        with self._cond:
            self._end_streams = True
            self._cond.notify_all()

    def wait_open_streams(self, count: int, timeout: float = 30.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.open_streams == count, timeout)

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        self.options_calls.append(self.registering)
        return self.plugin_options

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        def wake() -> None:
            with self._cond:
                self._cond.notify_all()

        context.add_callback(wake)  # the RPC ending (kubelet cancelled) wakes the wait below
        with self._cond:
            self.open_streams += 1
            self._cond.notify_all()
        try:
            sent = -1

            def news() -> bool:
                return self._version != sent or self._end_streams or not context.is_active()

            while True:
                with self._cond:
                    self._cond.wait_for(news)
                    if self._end_streams or not context.is_active():
                        return
                    sent = self._version
                    message = pb.ListAndWatchResponse(
                        devices=[
                            pb.Device(ID=i, health=h, topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=n)]))
                            for n, (i, h) in enumerate(sorted(self.health.items()))
                        ]
                    )
                yield message
        finally:
            with self._cond:
                self.open_streams -= 1
                self._cond.notify_all()

    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        responses = []
        for container in request.container_requests:
            unknown = [i for i in container.devices_ids if i not in self.health]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices {unknown}")
            env = {"TINY_DEVICES": ",".join(container.devices_ids), "TINY_PLUGIN": self.name}
            responses.append(pb.ContainerAllocateResponse(envs=env))
        return pb.AllocateResponse(container_responses=responses)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for r in request.container_requests:
            rest = [i for i in r.available_deviceIDs if i not in r.must_include_deviceIDs]
            chosen = [*r.must_include_deviceIDs, *rest][: r.allocation_size]
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        self.pre_started.append(list(request.devices_ids))
        return pb.PreStartContainerResponse()


@pytest.fixture
def socket_dir(tmp_path: Path) -> Iterator[Path]:
    # A unix socket path must fit in 107 bytes, and pytest's tmp_path grows with the test's name.
    if len(os.fsencode(tmp_path)) <= 60:
        yield tmp_path / "dp"
        return
    short = Path(tempfile.mkdtemp(prefix="fk-", dir="/tmp"))
    try:
        yield short / "dp"
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_dir) as k:
        yield k


@pytest.fixture
def plugin(kubelet: FakeKubelet) -> Iterator[TinyPlugin]:
    p = TinyPlugin()
    p.serve(kubelet.socket_dir / SOCKET)
    yield p
    p.stop()


def refused(call: Any) -> Any:
    """The gRPC error a Register call fails with (kubelet's plain Go errors arrive as UNKNOWN)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == grpc.StatusCode.UNKNOWN, err
    return err


# -- resource names ------------------------------------------------------------------------------------------

DOMAIN_244 = ".".join(["a" * 60] * 3 + ["a" * 61])  # "requests." + it is 253 characters, the limit
DOMAIN_245 = ".".join(["a" * 60] * 3 + ["a" * 62])


@pytest.mark.parametrize(
    "name",
    [
        "nvidia.com/gpu",
        "example.com/a_b.c-d",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/gpu.shared",
        "example.com/MyName",
        "a/b",
        "123.example/0",
        "example.com/" + "a" * 63,
        DOMAIN_244 + "/gpu",
    ],
)
def test_valid_extended_resource_names(name: str) -> None:
    assert is_valid_extended_resource_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "gpu",  # no domain: a native resource
        "kubernetes.io/gpu",
        "gpu.kubernetes.io/x",  # anything with "kubernetes.io/" in it is native
        "requests.nvidia.com/gpu",  # quota's prefix
        "nvidia.com/",
        "/gpu",
        "nvidia.com/a/b",
        "Nvidia.com/gpu",  # the domain is a DNS-1123 subdomain: lower case
        "nvidia..com/gpu",
        "-nvidia.com/gpu",
        "nvidia.com/-gpu",
        "nvidia.com/gpu-",
        "nvidia.com/_gpu",
        "nvidia.com/g pu",
        "nvidia.com/gpu\n",
        "example.com/" + "a" * 64,
        DOMAIN_245 + "/gpu",
    ],
)
def test_invalid_extended_resource_names(name: str) -> None:
    assert not is_valid_extended_resource_name(name)


# -- Register ------------------------------------------------------------------------------------------------


def test_register_dials_back_for_options_while_in_flight_then_watches(
    kubelet: FakeKubelet, plugin: TinyPlugin
) -> None:
    assert kubelet.kubelet_socket.is_socket()
    assert kubelet.checkpoint.is_file()

    plugin.register(kubelet)

    reg = kubelet.wait_registered(RESOURCE)
    assert (reg.resource_name, reg.endpoint, reg.version, reg.kubelet_generation) == (
        RESOURCE,
        SOCKET,
        VERSION,
        0,
    )
    assert reg.options == ALL_OPTIONS and reg.request_options == ALL_OPTIONS
    assert plugin.options_calls[:1] == [True], "GetDevicePluginOptions must come while Register is in flight"
    assert kubelet.registered(RESOURCE) == reg
    devices = kubelet.wait_for_devices(RESOURCE, lambda d: len(d) == 2)
    assert devices == [("dev-0", HEALTHY, (0,)), ("dev-1", HEALTHY, (1,))]
    assert devices[1] == DeviceInfo(id="dev-1", health=HEALTHY, numa_nodes=(1,))
    assert kubelet.allocatable(RESOURCE) == 2
    assert plugin.wait_open_streams(1)
    assert kubelet.rejections() == [] and kubelet.stream_ends() == [] and kubelet.violations == []


def test_the_options_kubelet_uses_are_the_plugins_answer(kubelet: FakeKubelet) -> None:
    answered = pb.DevicePluginOptions(pre_start_required=True)
    plugin = TinyPlugin(options=answered)
    plugin.serve(kubelet.socket_dir / SOCKET)
    try:
        plugin.register(kubelet, options=ALL_OPTIONS)  # the request claims more than the plugin answers
        reg = kubelet.wait_registered(RESOURCE)
        assert reg.request_options == ALL_OPTIONS
        assert reg.options == answered
        with pytest.raises(LookupError, match="get_preferred_allocation_available"):
            kubelet.get_preferred_allocation(RESOURCE, ["dev-0", "dev-1"], size=1)
    finally:
        plugin.stop()


def test_list_and_watch_messages_are_recorded_in_order(kubelet: FakeKubelet, plugin: TinyPlugin) -> None:
    plugin.register(kubelet)
    first = kubelet.wait_for_update(RESOURCE)

    plugin.set_health("dev-1", UNHEALTHY)

    devices = kubelet.wait_for_devices(RESOURCE, lambda d: ("dev-1", UNHEALTHY, (1,)) in d)
    assert devices == [("dev-0", HEALTHY, (0,)), ("dev-1", UNHEALTHY, (1,))]
    updates = kubelet.updates(RESOURCE)
    assert [u.devices for u in updates] == [first.devices, tuple(devices)]
    assert updates[0].time <= updates[1].time and updates[1].endpoint == SOCKET
    changed = kubelet.wait_for_update(RESOURCE, lambda d: d[1].health == UNHEALTHY, after=first.time)
    assert changed == updates[1]
    assert kubelet.latest_devices(RESOURCE) == devices
    assert kubelet.node_devices(RESOURCE) == devices
    assert kubelet.allocatable(RESOURCE) == 1
    assert kubelet.latest_devices("example.com/other") is None


def test_protocol_violations_in_device_lists_are_recorded(kubelet: FakeKubelet, plugin: TinyPlugin) -> None:
    plugin.register(kubelet)
    plugin.set_health("dev-1", "ok")

    kubelet.wait_for_devices(RESOURCE, lambda d: d[1].health == "ok")
    assert kubelet.violations == [f"{RESOURCE}: device 'dev-1' has health 'ok'"]
    assert kubelet.allocatable(RESOURCE) == 1  # kubelet counts only "Healthy"


@pytest.mark.parametrize("version", ["v1alpha", "v1beta2", ""])
def test_other_versions_are_refused(kubelet: FakeKubelet, plugin: TinyPlugin, version: str) -> None:
    err = refused(lambda: plugin.register(kubelet, version=version))
    assert f"requested API version {version!r} is not supported by kubelet" in err.details()
    assert [r.version for r in kubelet.rejections()] == [version]
    assert kubelet.registrations() == [] and plugin.options_calls == []


@pytest.mark.parametrize(
    "name",
    ["kubernetes.io/gpu", "nvidia.com/", "/gpu", "gpu", "requests.nvidia.com/gpu", "a.com/" + "x" * 64],
)
def test_invalid_resource_names_are_refused(kubelet: FakeKubelet, plugin: TinyPlugin, name: str) -> None:
    err = refused(lambda: plugin.register(kubelet, resource=name))
    assert err.details() == f"the ResourceName {name!r} is invalid"
    assert [r.resource_name for r in kubelet.rejections()] == [name]
    assert kubelet.registrations() == [] and plugin.options_calls == []


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("", "must be a socket file name"),
        ("../tiny.sock", "must be a socket file name"),
        ("sub/tiny.sock", "must be a socket file name"),
        ("missing.sock", "does not exist"),
        ("regular-file", "is not a socket"),
    ],
)
def test_endpoints_that_are_not_a_socket_in_the_directory_are_refused(
    kubelet: FakeKubelet, plugin: TinyPlugin, endpoint: str, problem: str
) -> None:
    (kubelet.socket_dir / "regular-file").write_text("")
    (kubelet.socket_dir / "sub").mkdir()
    os.symlink(kubelet.socket_dir / SOCKET, kubelet.socket_dir / "sub" / SOCKET)

    err = refused(lambda: plugin.register(kubelet, endpoint=endpoint))
    assert problem in err.details()
    assert kubelet.registrations() == [] and plugin.options_calls == []


def test_a_socket_nobody_serves_fails_register(socket_dir: Path) -> None:
    with FakeKubelet(socket_dir, dial_timeout=1.0) as kubelet:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(socket_dir / SOCKET))  # a socket file, but nothing listens: connect is refused
        try:
            err = refused(lambda: TinyPlugin().register(kubelet))
        finally:
            stale.close()
        assert "failed to dial device plugin" in err.details()
        assert kubelet.registrations() == []
        assert [r.message for r in kubelet.rejections()] == [err.details()]


def test_a_server_without_the_device_plugin_service_fails_register(kubelet: FakeKubelet) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_insecure_port(f"unix:{kubelet.socket_dir / SOCKET}")
    server.start()
    try:
        err = refused(lambda: TinyPlugin().register(kubelet))
    finally:
        server.stop(None).wait(30)
    assert err.details().startswith("failed to get device plugin options: rpc error: code = UNIMPLEMENTED")
    assert kubelet.registrations() == []


def test_a_plugin_without_a_free_worker_fails_register(socket_dir: Path) -> None:
    # kubelet waits for GetDevicePluginOptions forever; the fake gives up after options_timeout.
    with FakeKubelet(socket_dir, options_timeout=1.0) as kubelet:
        plugin = TinyPlugin()
        plugin.serve(socket_dir / SOCKET, workers=1)
        busy = grpc.insecure_channel(f"unix:{socket_dir / SOCKET}")
        stream = _services.DevicePluginStub(busy).ListAndWatch(pb.Empty())  # holds the only worker
        try:
            next(stream)
            err = refused(lambda: plugin.register(kubelet))
        finally:
            busy.close()
            plugin.stop()
        assert "failed to get device plugin options: rpc error: code = DEADLINE_EXCEEDED" in err.details()
        assert kubelet.registrations() == []


def test_registering_again_replaces_the_endpoint_and_closes_the_old_stream(
    kubelet: FakeKubelet, plugin: TinyPlugin
) -> None:
    plugin.register(kubelet)
    kubelet.wait_for_devices(RESOURCE)
    assert plugin.wait_open_streams(1)
    second = TinyPlugin(name="second")
    second.serve(kubelet.socket_dir / "second.sock")
    try:
        second.register(kubelet, endpoint="second.sock")

        end = kubelet.wait_stream_ended(RESOURCE)
        assert (end.endpoint, end.reason, end.by_plugin) == (SOCKET, REPLACED, False)
        assert plugin.wait_open_streams(0), "kubelet must close the replaced endpoint's stream"
        assert [r.endpoint for r in kubelet.registrations(RESOURCE)] == [SOCKET, "second.sock"]
        assert kubelet.registered(RESOURCE) == kubelet.wait_registered(RESOURCE, count=2)
        response = kubelet.allocate(RESOURCE, [["dev-0"]])
        assert response.container_responses[0].envs["TINY_PLUGIN"] == "second"
        assert kubelet.stream_ends(by_plugin_only=True) == []
    finally:
        second.stop()


# -- streams that end ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("how", "reason"), [("return", RETURNED), ("die", FAILED)])
def test_a_stream_the_plugin_ends_is_recorded_and_turns_the_devices_unhealthy(
    kubelet: FakeKubelet, plugin: TinyPlugin, how: str, reason: str
) -> None:
    plugin.register(kubelet)
    devices = kubelet.wait_for_devices(RESOURCE, lambda d: len(d) == 2)

    if how == "return":
        plugin.end_streams()
    else:
        plugin.stop()

    end = kubelet.wait_stream_ended(RESOURCE)
    assert (end.resource_name, end.endpoint, end.reason, end.by_plugin) == (RESOURCE, SOCKET, reason, True)
    assert (end.code == "OK") == (how == "return")
    assert kubelet.stream_ends(RESOURCE, by_plugin_only=True) == [end]
    assert kubelet.latest_devices(RESOURCE) == devices  # what the plugin said last
    assert kubelet.node_devices(RESOURCE) == [d._replace(health=UNHEALTHY) for d in devices]
    assert kubelet.allocatable(RESOURCE) == 0


# -- restart and stop ----------------------------------------------------------------------------------------


def test_restart_deletes_the_sockets_but_not_the_checkpoint_and_serves_a_new_socket(
    kubelet: FakeKubelet, plugin: TinyPlugin
) -> None:
    plugin.register(kubelet)
    kubelet.wait_for_devices(RESOURCE)
    directory = kubelet.socket_dir
    (directory / "notes.txt").write_text("x")
    (directory / "subdir").mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(directory / "stale.sock"))
    stale.close()
    first_inode = kubelet.kubelet_socket.stat().st_ino

    restarted = kubelet.restart()

    assert sorted(os.listdir(directory)) == sorted([CHECKPOINT, "kubelet.sock", "notes.txt", "subdir"])
    assert kubelet.checkpoint_intact()
    new_inode = kubelet.kubelet_socket.stat().st_ino
    assert new_inode != first_inode
    assert kubelet.socket_inodes == [first_inode, new_inode]
    assert kubelet.generation == 1 and kubelet.starts[-1] == restarted
    end = kubelet.wait_stream_ended(RESOURCE)
    assert (end.reason, end.by_plugin) == (KUBELET_STOPPED, False)
    assert plugin.wait_open_streams(0), "a dying kubelet drops its streams"
    assert kubelet.registered(RESOURCE) is None and kubelet.allocatable(RESOURCE) == 0
    # What the old stream said must not satisfy a wait after the restart.
    assert kubelet.latest_devices(RESOURCE) is None
    with pytest.raises(TimeoutError, match="for a device list of"):
        kubelet.wait_for_devices(RESOURCE, timeout=0.1)
    with pytest.raises(LookupError):
        kubelet.allocate(RESOURCE, [["dev-0"]])

    # The plugin's socket is gone: it serves a new one and registers again; the history is kept.
    plugin.stop()
    plugin.serve(directory / SOCKET)
    plugin.register(kubelet)
    again = kubelet.wait_registered(RESOURCE, after=restarted)
    assert again.kubelet_generation == 1 and again.time > restarted
    assert [r.kubelet_generation for r in kubelet.registrations(RESOURCE)] == [0, 1]
    assert kubelet.wait_for_devices(RESOURCE) == kubelet.node_devices(RESOURCE)
    assert kubelet.allocatable(RESOURCE) == 2
    assert kubelet.checkpoint_intact()


def test_restart_may_let_the_socket_keep_its_inode_number(kubelet: FakeKubelet, plugin: TinyPlugin) -> None:
    plugin.register(kubelet)
    kubelet.wait_for_devices(RESOURCE)

    kubelet.restart(new_inode=False)

    # Whether the number comes back is up to the filesystem (ext4: yes); what a plugin sees for sure is its
    # own socket gone and its stream closed.
    assert kubelet.socket_inodes[-1] == kubelet.kubelet_socket.stat().st_ino
    assert not (kubelet.socket_dir / SOCKET).exists()
    assert kubelet.wait_stream_ended(RESOURCE).reason == KUBELET_STOPPED
    assert kubelet.checkpoint_intact()


def test_stop_leaves_only_the_checkpoint_and_no_threads(socket_dir: Path) -> None:
    kubelet = FakeKubelet(socket_dir)
    kubelet.start()
    plugin = TinyPlugin()
    plugin.serve(socket_dir / SOCKET)
    try:
        plugin.register(kubelet)
        kubelet.wait_for_devices(RESOURCE)
        content = kubelet.checkpoint.read_bytes()
    finally:
        kubelet.stop()
        plugin.stop()

    assert os.listdir(socket_dir) == [CHECKPOINT]
    assert kubelet.checkpoint.read_bytes() == content and kubelet.checkpoint_intact()
    assert [t.name for t in threading.enumerate() if t.name.startswith("fake-kubelet")] == []
    assert kubelet.stream_ends(RESOURCE)[0].reason == KUBELET_STOPPED
    kubelet.stop()  # stopping twice is harmless


def test_a_socket_directory_too_long_for_unix_sockets_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="longer than a unix socket path"):
        FakeKubelet(Path("/tmp") / ("x" * 100))


# -- calling the plugin --------------------------------------------------------------------------------------


def test_client_helpers_round_trip(kubelet: FakeKubelet, plugin: TinyPlugin) -> None:
    plugin.register(kubelet)
    kubelet.wait_registered(RESOURCE)

    response = kubelet.allocate(RESOURCE, [["dev-0"], ["dev-0", "dev-1"]])
    assert [dict(c.envs)["TINY_DEVICES"] for c in response.container_responses] == ["dev-0", "dev-0,dev-1"]
    with pytest.raises(grpc.RpcError) as info:
        kubelet.allocate(RESOURCE, [["dev-9"]])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    preferred = kubelet.get_preferred_allocation(RESOURCE, ["dev-0", "dev-1"], must_include=["dev-1"], size=1)
    assert list(preferred.container_responses[0].deviceIDs) == ["dev-1"]

    assert kubelet.pre_start_container(RESOURCE, ["dev-1"]) == pb.PreStartContainerResponse()
    assert plugin.pre_started == [["dev-1"]]
    assert kubelet.options(RESOURCE) == ALL_OPTIONS
    assert plugin.options_calls == [True, False]

    with pytest.raises(LookupError, match="not registered"):
        kubelet.options("example.com/other")


def test_helpers_skip_what_the_options_do_not_advertise_like_kubelet(kubelet: FakeKubelet) -> None:
    plugin = TinyPlugin(options=pb.DevicePluginOptions())
    plugin.serve(kubelet.socket_dir / SOCKET)
    try:
        plugin.register(kubelet)
        kubelet.wait_registered(RESOURCE)
        with pytest.raises(LookupError, match="pre_start_required"):
            kubelet.pre_start_container(RESOURCE, ["dev-0"])
        with pytest.raises(LookupError, match="get_preferred_allocation_available"):
            kubelet.get_preferred_allocation(RESOURCE, ["dev-0"])
        # A test may still call them on purpose.
        kubelet.pre_start_container(RESOURCE, ["dev-0"], check_options=False)
        assert plugin.pre_started == [["dev-0"]]
    finally:
        plugin.stop()
