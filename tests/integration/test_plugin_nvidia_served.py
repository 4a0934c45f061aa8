"""`gpunode plugin run --config <NVIDIA's config>` against the fake kubelet and the fake NVML: NVIDIA's
example configs (tests/fixtures/nvidia-plugin) served as NVIDIA documents them, and those gpunode refuses."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.kubelet import HEALTHY, FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-plugin"
GPU = "nvidia.com/gpu"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_dir) as k:
        yield k


def config(name: str) -> list[str]:
    return ["--config", str(FIXTURES / name)]


def test_time_slicing_renamed_with_fail_requests_greater_than_one(
    kubelet: FakeKubelet, socket_dir: Path
) -> None:
    import grpc

    with PluginProcess(socket_dir, config("time-slicing-rename.yaml"), profile="pcie-4"):
        reg = kubelet.wait_registered(f"{GPU}.shared")
        assert reg.endpoint == "gpunode-nvidia.com-gpu.shared.sock"
        devices = kubelet.wait_for_devices(f"{GPU}.shared", lambda d: len(d) == 40)
        assert all(d.health == HEALTHY for d in devices)
        assert kubelet.registered(GPU) is None  # renamed: the plain resource is not advertised
        first = devices[0].id
        uuid = first.split("::")[0]
        [container] = kubelet.allocate(f"{GPU}.shared", [[first]]).container_responses
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": uuid}
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(f"{GPU}.shared", [[devices[0].id, devices[1].id]])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "fail-requests-greater-than-one" in err.value.details()
        assert kubelet.violations == []


def test_rename_and_devices_make_two_resources_with_their_own_sockets(
    kubelet: FakeKubelet, socket_dir: Path
) -> None:
    with PluginProcess(socket_dir, config("time-slicing-devices.json"), profile="pcie-4"):
        shared = kubelet.wait_for_devices("nvidia.com/shared-gpu", lambda d: len(d) == 8)
        whole = kubelet.wait_for_devices(GPU, lambda d: len(d) == 2)
        assert (
            kubelet.wait_registered("nvidia.com/shared-gpu").endpoint == "gpunode-nvidia.com-shared-gpu.sock"
        )
        assert kubelet.wait_registered(GPU).endpoint == "gpunode-nvidia.com-gpu.sock"
        assert {d.id.split("::")[0] for d in shared}.isdisjoint(d.id for d in whole)
        # Two replicas of one GPU: the runtime sees that GPU once; volume-mounts as the file asks.
        same_gpu = [d.id for d in shared if d.id.startswith(shared[0].id.split("::")[0])][:2]
        [container] = kubelet.allocate("nvidia.com/shared-gpu", [same_gpu]).container_responses
        uuid = same_gpu[0].split("::")[0]
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
        assert [m.container_path for m in container.mounts] == [f"/var/run/nvidia-container-devices/{uuid}"]
        assert kubelet.violations == []


def test_mig_mixed_sharing_per_profile(kubelet: FakeKubelet, socket_dir: Path) -> None:
    with PluginProcess(socket_dir, config("mig-mixed-sharing.yaml"), profile="mig"):
        assert len(kubelet.wait_for_devices("nvidia.com/mig-1g.5gb", lambda d: len(d) == 4)) == 4
        assert len(kubelet.wait_for_devices("nvidia.com/mig-2g.10gb", lambda d: len(d) == 3)) == 3
        assert len(kubelet.wait_for_devices(GPU, lambda d: len(d) == 2)) == 2
        assert kubelet.violations == []


def test_per_model_resource_names(kubelet: FakeKubelet, socket_dir: Path) -> None:
    with PluginProcess(socket_dir, config("per-model.yaml"), profile="mig"):
        a100 = kubelet.wait_for_devices("nvidia.com/a100", lambda d: len(d) == 1)
        small = kubelet.wait_for_devices("nvidia.com/mig-small", lambda d: len(d) == 4)
        kubelet.wait_for_devices("nvidia.com/mig-large", lambda d: len(d) == 1)
        assert kubelet.registered(GPU) is None
        [container] = kubelet.allocate("nvidia.com/a100", [[a100[0].id]]).container_responses
        assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": a100[0].id}
        [container] = kubelet.allocate("nvidia.com/mig-small", [[small[0].id]]).container_responses
        assert container.envs["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-")
        assert kubelet.violations == []


def test_gds_mofed_gdrcopy_and_imex(kubelet: FakeKubelet, socket_dir: Path) -> None:
    # The IMEX channel under a device root of the test's own: a character device, as the driver makes it.
    dev_root = socket_dir.parent / "devroot"
    channel = dev_root / "dev/nvidia-caps-imex-channels/channel0"
    channel.parent.mkdir(parents=True)
    os.mknod(channel, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    args = [*config("extras.yaml"), "--dev-root", str(dev_root)]
    with PluginProcess(socket_dir, args, profile="pcie-4"):
        [device, *_] = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        [container] = kubelet.allocate(GPU, [[device.id]]).container_responses
        envs = dict(container.envs)
        assert {k: envs[k] for k in ("NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_GDRCOPY")} == dict.fromkeys(
            ("NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_GDRCOPY"), "enabled"
        )
        assert envs["NVIDIA_IMEX_CHANNELS"] == "0"
        assert "/var/run/nvidia-container-devices/imex/0" in [m.container_path for m in container.mounts]
        specs = {d.container_path: d.host_path for d in container.devices}
        assert specs["/dev/nvidia-caps-imex-channels/channel0"] == str(channel)


def test_a_missing_imex_channel_is_skipped_unless_required(kubelet: FakeKubelet, socket_dir: Path) -> None:
    with PluginProcess(socket_dir, config("extras.yaml"), profile="pcie-4") as plugin:
        [device, *_] = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        [container] = kubelet.allocate(GPU, [[device.id]]).container_responses
        assert "NVIDIA_IMEX_CHANNELS" not in container.envs
        plugin.wait_for_log("channel0 does not exist")  # the log is written by a thread of its own
    with PluginProcess(socket_dir, [*config("extras.yaml"), "--imex-required"], profile="pcie-4") as plugin:
        assert plugin.wait(60) == 4
        assert "imex.required is set" in plugin.log()


def test_mps_example_runs_a_control_daemon(kubelet: FakeKubelet, socket_dir: Path) -> None:
    from tests import fakemps

    bin_dir, root = socket_dir.parent / "bin", socket_dir.parent / "mps"
    fakemps.install(bin_dir)
    try:
        args = [*config("mps.yaml"), "--mps-root", str(root)]
        with PluginProcess(socket_dir, args, profile="pcie-4", env=fakemps.env(bin_dir)):
            devices = kubelet.wait_for_devices(
                GPU, lambda d: len(d) == 40 and all(x.health == HEALTHY for x in d), timeout=60
            )
            [container] = kubelet.allocate(GPU, [[devices[0].id]]).container_responses
            assert container.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu/pipe"
            assert len(fakemps.daemon_pids(root)) == 1
    finally:
        fakemps.kill_all(root)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("unknown-key.yaml", "line 6: unknown key sharing.timeSlicing.resources[0].replica "),
    ],
)
def test_refused_configs_stop_the_plugin_with_the_reason(
    kubelet: FakeKubelet, socket_dir: Path, name: str, message: str
) -> None:
    with PluginProcess(socket_dir, config(name), profile="pcie-4") as plugin:
        assert plugin.wait(60) == 4
        assert message in plugin.log()
    assert kubelet.registrations() == []


@pytest.mark.parametrize("with_spec", [False, True])
def test_imex_channel_as_a_cdi_device_when_a_spec_defines_it(
    kubelet: FakeKubelet, socket_dir: Path, with_spec: bool
) -> None:
    from tests import cdinode
    from tests.integration.test_cdi_plugin import uuids

    dev_root = socket_dir.parent / "devroot"
    channel = dev_root / "dev/nvidia-caps-imex-channels/channel0"
    channel.parent.mkdir(parents=True)
    os.mknod(channel, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    specs = socket_dir.parent / "cdi"
    cdinode.write_spec(specs, uuids("pcie-4"))
    if with_spec:
        cdinode.write_spec(specs, ["0"], kind="nvidia.com/imex-channel")
    args = [*config("extras.yaml"), "--dev-root", str(dev_root), "--device-list-strategy", "cdi-cri"]
    with PluginProcess(
        socket_dir, args, profile="pcie-4", env={"GPUNODE_CDI_SPEC_DIRS": str(specs)}
    ) as plugin:
        [device, *_] = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)
        [container] = kubelet.allocate(GPU, [[device.id]]).container_responses
        names = [c.name for c in container.cdi_devices]
        if with_spec:
            assert names == [f"nvidia.com/gpu={device.id}", "nvidia.com/imex-channel=0"]
        else:  # a name no spec defines would fail the pod: the GPUs only, and the log says why
            assert names == [f"nvidia.com/gpu={device.id}"]
            plugin.wait_for_log("no CDI spec defines nvidia.com/imex-channel=0")
