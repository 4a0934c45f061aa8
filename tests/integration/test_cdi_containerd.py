"""gpunode's CDI spec applied by a real consumer: containerd 1.7 (CDI on with enable_cdi) through the CRI.

The node: the fake NVML library's `pcie-4` machine (4 GPUs, minors 0-3), device nodes made with mknod in a
private driver root (so majors and minors are read from real character devices), stand-in library files
named as driver 550.54.15 names them and listed in a real-format ld.so.cache, and a stand-in hook program.
`gpunode cdi generate` writes the spec into a private spec directory that containerd is told to read;
`gpunode configure-runtime containerd --cdi` turns CDI on. The device plugin's own Allocate code gives the
device names (the cdi-cri answer, and the cdi-annotations answer), and a container created with them must
reach the OCI runtime with exactly that GPU's device node, the common nodes, the driver's files mounted
read-only from the driver root, NVIDIA_VISIBLE_DEVICES=void and the ldcache hook. The OCI runtime is a
stand-in for nvidia-container-runtime that records the config.json it is handed, then runs runc. A name
the spec does not define must fail the container's creation.

Needs the test bed's containerd 1.7, its ctr and runc (tests/testbed.py), gcc (with static glibc) and
grpcio-tools; in CI (CI set) a missing one is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tomlkit

from gpunode.cdi.spec import annotation_key
from gpunode.nvml import discover
from gpunode.plugin.allocate import AllocateSettings, allocate
from gpunode.plugin.devices import DeviceHealth, PluginDevice, build_resources
from tests import cdinode, fakenvml, testbed
from tests.integration.cri import client, daemon, oci
from tests.integration.cri.daemon import Containerd
from tests.integration.test_containerd_daemon import (
    CONFIG,
    CRI,
    PAUSE_IMAGE,
    missing,
    node_config,
    pod_sandbox_config,
    require_program,
    runc_options,
    table,
    write,
)

VERSION = "550.54.15"
KIND = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    import importlib.util

    if importlib.util.find_spec("grpc_tools") is None:
        missing("grpcio-tools is not installed")
    return client.compile_runtime_api(tmp_path_factory.mktemp("cri-api"))


@pytest.fixture(scope="module")
def pause(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_program("gcc")
    workdir = tmp_path_factory.mktemp("pause-image")
    return oci.write_image_archive(oci.build_pause(workdir), PAUSE_IMAGE, workdir / "pause.tar")


@pytest.fixture
def containerd_17(tmp_path: Path) -> Iterator[Callable[[Path], Containerd]]:
    binary = testbed.binary("containerd-1.7", "containerd")
    testbed.binary("containerd-1.7", "ctr")
    testbed.binary("runc")
    started: list[Containerd] = []

    def start(config: Path) -> Containerd:
        started.append(daemon.start_containerd(config, tmp_path / f"d{len(started)}", binary=binary))
        return started[-1]

    yield start
    for one in started:
        daemon.stop_containerd(one)
        assert not daemon.mounts_under(one.base), f"mounts left under {one.base}"


def recording_runtime(workdir: Path) -> tuple[Path, Path]:
    """A stand-in nvidia-container-runtime: copies the bundle's config.json of each `create` into
    records/<container id>.json, then is runc. Returns (wrapper, records directory)."""
    runc = testbed.binary("runc")
    records = workdir / "records"
    records.mkdir(parents=True, exist_ok=True)
    wrapper = workdir / "bin" / "nvidia-container-runtime"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(
        "#!/bin/sh\n"
        'prev=""; bundle=""; create=""\n'
        'for a in "$@"; do\n'
        '  if [ "$prev" = "--bundle" ] || [ "$prev" = "-b" ]; then bundle="$a"; fi\n'
        '  if [ "$a" = "create" ]; then create=1; fi\n'
        '  prev="$a"\n'
        "done\n"
        'if [ -n "$create" ] && [ -n "$bundle" ]; then\n'
        f'  cp "$bundle/config.json" "{records}/$(basename "$bundle").json"\n'
        "fi\n"
        f'exec "{runc}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper, records


def hook_program(workdir: Path) -> Path:
    """A stand-in for nvidia-ctk: the spec's createContainer hook runs it; it does nothing."""
    program = workdir / "bin" / "nvidia-ctk"
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    return program


def gpunode(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "gpunode", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, f"gpunode {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
    return result


def containerd_config(workdir: Path, spec_dir: Path) -> tomlkit.TOMLDocument:
    """containerd 1.7's own default config, its host paths moved under workdir, reading CDI specs from
    spec_dir only (never the host's /etc/cdi or /var/run/cdi)."""
    result = subprocess.run(
        [testbed.binary("containerd-1.7"), "config", "default"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    doc = tomlkit.parse(result.stdout)
    plugins = table(doc, "plugins")
    table(plugins, "io.containerd.internal.v1.opt")["path"] = str(workdir / "opt")
    cri = table(plugins, CRI)
    cni = table(cri, "cni")
    cni["conf_dir"] = str(workdir / "cni" / "net.d")
    cni["bin_dir"] = str(workdir / "cni" / "bin")
    cri["sandbox_image"] = PAUSE_IMAGE
    cri["restrict_oom_score_adj"] = True  # no CAP_SYS_RESOURCE here (see test_containerd_daemon)
    cri["cdi_spec_dirs"] = [str(spec_dir)]
    assert cri["enable_cdi"] is False  # gpunode's --cdi must turn it on
    runc_options(doc)["Root"] = str(workdir / "runc")
    return doc


def answers(strategy: str) -> dict[str, Any]:
    """What the device plugin's Allocate answers for GPU 1 (by index) and GPU 2 (by UUID) with `strategy`."""
    inventory = discover()
    settings = AllocateSettings(device_list_strategy=(strategy,), cdi_kind=KIND)
    out: dict[str, Any] = {}
    for id_strategy, index in (("index", 1), ("uuid", 2)):
        (resource,) = build_resources(inventory, device_id_strategy=id_strategy)
        device = resource.devices[index]

        def healthy(d: PluginDevice) -> DeviceHealth:
            return DeviceHealth(d, True, None)

        (answer,) = allocate(resource, [[device.id]], healthy, settings)
        out[id_strategy] = answer
    return out


def run_container(
    cri: client.RuntimeService, api: Any, sandbox: str, sandbox_config: Any, **config: Any
) -> str:
    request = api.CreateContainerRequest(
        pod_sandbox_id=sandbox,
        config=api.ContainerConfig(
            metadata=api.ContainerMetadata(name=f"c-{uuid.uuid4().hex[:8]}"),
            image=api.ImageSpec(image=PAUSE_IMAGE),
            **config,
        ),
        sandbox_config=sandbox_config,
    )
    container = str(cri.call("CreateContainer", request).container_id)
    cri.call("StartContainer", api.StartContainerRequest(container_id=container))
    return container


def recorded(records: Path, container: str) -> dict[str, Any]:
    path = records / f"{container}.json"
    assert path.exists(), f"the runtime was not asked to create {container}: {sorted(os.listdir(records))}"
    spec: dict[str, Any] = json.loads(path.read_text())
    return spec


def assert_gpu_applied(spec: dict[str, Any], driver: Path, minor: int) -> None:
    devices = {d["path"]: (d["type"], d["major"], d["minor"]) for d in spec["linux"]["devices"]}
    nvidia = {p: v for p, v in devices.items() if p.startswith("/dev/nvidia")}
    assert nvidia == {
        f"/dev/nvidia{minor}": ("c", cdinode.NVIDIA_MAJOR, minor),
        "/dev/nvidiactl": ("c", cdinode.NVIDIA_MAJOR, 255),
        "/dev/nvidia-uvm": ("c", cdinode.UVM_MAJOR, 0),
        "/dev/nvidia-uvm-tools": ("c", cdinode.UVM_MAJOR, 1),
    }
    allowed = {
        (r.get("type"), r.get("major"), r.get("minor"))
        for r in spec["linux"]["resources"]["devices"]
        if r.get("allow")
    }
    assert ("c", cdinode.NVIDIA_MAJOR, minor) in allowed
    mounts = {m["destination"]: m for m in spec["mounts"]}
    for _, file_pattern in cdinode.LIBRARIES:
        path = f"{cdinode.LIB_DIR}/{file_pattern.format(v=VERSION)}"
        assert mounts[path]["source"] == f"{driver}{path}"
        assert {"ro", "bind"} <= set(mounts[path]["options"])
    assert mounts["/usr/bin/nvidia-smi"]["source"] == f"{driver}/usr/bin/nvidia-smi"
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["process"]["env"]
    (hook,) = spec["hooks"]["createContainer"]
    assert hook["args"] == ["nvidia-ctk", "hook", "update-ldcache", "--folder", cdinode.LIB_DIR]


def test_containerd_17_applies_gpunodes_spec_to_the_plugins_cdi_names(
    tmp_path: Path,
    api: ModuleType,
    pause: Path,
    containerd_17: Callable[[Path], Containerd],
    fake_nvml: Callable[..., None],
) -> None:
    fake_nvml(profile="pcie-4")  # for the plugin's Allocate, in this process
    driver = tmp_path / "drv"
    cdinode.make_driver(driver, VERSION, gpus=range(4), hook=False)
    hook = hook_program(tmp_path)
    spec_dir = tmp_path / "cdi"
    spec_file = spec_dir / "gpunode-nvidia.com-gpu.yaml"
    gpunode(
        "cdi", "generate", "--driver-root", str(driver), "--output", str(spec_file),
        "--hook-program", str(hook), env=fakenvml.env(profile="pcie-4"),
    )  # fmt: skip
    wrapper, records = recording_runtime(tmp_path)
    write(containerd_config(tmp_path, spec_dir), node_config(tmp_path / "node"))
    gpunode(
        "--root", str(tmp_path / "node"), "configure-runtime", "containerd", "--config", CONFIG,
        "--runtime-path", str(wrapper), "--set-as-default", "--no-restart", "--cdi",
        # gpunode asks `containerd --version` by name: the 1.7 that reads the file comes first on PATH.
        env={"PATH": testbed.path_with("containerd-1.7")},
    )  # fmt: skip
    ctd = containerd_17(node_config(tmp_path / "node"))
    effective = client.cri_status(api, ctd.socket)
    assert effective["enableCDI"] is True and effective["cdiSpecDirs"] == [str(spec_dir)]
    daemon.ctr(ctd.socket, "images", "import", str(pause), namespace="k8s.io", program=ctd.ctr)

    cri_answers = answers("cdi-cri")
    annotation_answers = answers("cdi-annotations")
    assert list(cri_answers["index"].cdi_devices) == [f"{KIND}=1"]
    inventory = discover()
    gpu2 = inventory.gpus[2].uuid or ""
    assert annotation_answers["uuid"].annotations == {annotation_key("gpunode", gpu2): f"{KIND}={gpu2}"}

    with client.RuntimeService(api, ctd.socket) as cri:
        cri.wait_ready()
        sandbox_config = pod_sandbox_config(api, ctd.cgroup_parent)
        sandbox = cri.run_pod_sandbox(sandbox_config)
        try:
            # The cdi-cri answer: the CRI's CDI_devices field.
            by_field = run_container(
                cri,
                api,
                sandbox,
                sandbox_config,
                CDI_devices=[api.CDIDevice(name=n) for n in cri_answers["index"].cdi_devices],
            )
            assert_gpu_applied(recorded(records, by_field), driver, minor=1)
            # The cdi-annotations answer: the container's annotations.
            by_annotation = run_container(
                cri, api, sandbox, sandbox_config, annotations=dict(annotation_answers["uuid"].annotations)
            )
            assert_gpu_applied(recorded(records, by_annotation), driver, minor=2)
            # A name the spec does not define: the container is not created.
            grpc = __import__("grpc")
            with pytest.raises(grpc.RpcError) as err:
                run_container(
                    cri, api, sandbox, sandbox_config, CDI_devices=[api.CDIDevice(name=f"{KIND}=9")]
                )
            assert "unresolvable CDI devices" in (err.value.details() or ""), err.value.details()
        except Exception as exc:
            raise AssertionError(f"{exc}\ncontainerd log:\n{ctd.log_text()[-4000:]}") from exc
        finally:
            cri.stop_pod_sandbox(sandbox)
            cri.remove_pod_sandbox(sandbox)
