"""The device plugin with a cdi-* strategy and gpunode's CDI spec, as a real process (fake NVML, the fake
kubelet): it refuses to start while no spec the runtime reads holds its devices, names them and the fix,
and starts once `gpunode cdi generate` has written one; its answers are names that spec defines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.errors import ExitCode
from tests import cdinode, fakenvml
from tests.integration.kubelet import FakeKubelet
from tests.integration.pluginproc import PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"


def uuids(profile: str) -> list[str]:
    """The GPU UUIDs the fake NVML library gives `profile` (asked in a process of its own)."""
    code = (
        "from gpunode.nvml import discover; import json; print(json.dumps([g.uuid for g in discover().gpus]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, **fakenvml.env(profile)},
    )
    names: list[str] = json.loads(result.stdout)
    return names


@pytest.fixture
def base() -> Iterator[Path]:
    with short_tempdir() as path:
        yield path


def test_the_plugin_refuses_to_start_without_its_devices_in_a_spec(base: Path) -> None:
    specs = base / "cdi"
    cdinode.write_spec(specs, uuids("pcie-4")[:3])  # GPU 3 is missing
    env = {"GPUNODE_CDI_SPEC_DIRS": str(specs)}
    with FakeKubelet(base / "device-plugins") as kubelet:
        plugin = PluginProcess(
            base / "device-plugins", ["--device-list-strategy", "cdi-cri"], env=env
        ).start()
        try:
            assert plugin.wait(60) == ExitCode.CONFIG
        finally:
            plugin.stop()
        log = plugin.log()
        assert f"{GPU}={uuids('pcie-4')[3]}" in log and f"{GPU}={uuids('pcie-4')[0]}" not in log
        assert "gpunode cdi generate" in log
        assert kubelet.registrations(GPU) == []  # it never said ready


def test_the_plugin_skips_broken_third_party_specs_and_starts(base: Path) -> None:
    """Broken files of other tools in the spec directory (wrong types, not UTF-8, a FIFO, an alias bomb)
    are skipped as the runtimes skip them, each with one warning line: the plugin registers and serves,
    where it used to exit 70 at start (a crash loop under systemd, no GPU advertised)."""
    specs = base / "cdi"
    cdinode.write_spec(specs, uuids("pcie-4"))
    broken = {
        "devices.yaml": b'cdiVersion: "0.5.0"\nkind: nvidia.com/gpu\ndevices: 5\n',
        "edits.yaml": b'cdiVersion: "0.5.0"\nkind: nvidia.com/gpu\ndevices: []\ncontainerEdits: []\n',
        "latin1.yaml": b"kind: \xe9\n",
        "bomb.yaml": b"a: &a [x, x, x, x, x, x, x, x, x]\n"
        + b"".join(
            f"b{i}: &b{i} [{', '.join([f'*b{i - 1}' if i else '*a'] * 9)}]\n".encode() for i in range(8)
        ),
    }
    for name, content in broken.items():
        (specs / name).write_bytes(content)
    os.mkfifo(specs / "fifo.json")
    env = {"GPUNODE_CDI_SPEC_DIRS": str(specs)}
    with (
        FakeKubelet(base / "device-plugins") as kubelet,
        PluginProcess(base / "device-plugins", ["--device-list-strategy", "cdi-cri"], env=env) as plugin,
    ):
        kubelet.wait_registered(GPU)
        assert len(kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)) == 4
        log = plugin.log()
    for name in [*broken, "fifo.json"]:
        lines = [line for line in log.splitlines() if f"{specs / name} is skipped" in line]
        assert len(lines) == 1, (name, log)
    assert "Traceback" not in log


def test_the_plugin_answers_with_names_of_gpunodes_generated_spec(base: Path) -> None:
    driver = base / "drv"
    cdinode.make_driver(driver, "550.54.15", gpus=range(4))
    specs = base / "cdi"
    subprocess.run(
        [sys.executable, "-m", "gpunode", "cdi", "generate", "--driver-root", str(driver),
         "--output", str(specs / "gpunode.yaml"), "--hook-program", str(driver / "usr/bin/nvidia-ctk")],
        check=True, timeout=120, capture_output=True, env={**os.environ, **fakenvml.env("pcie-4")},
    )  # fmt: skip
    env = {"GPUNODE_CDI_SPEC_DIRS": str(specs)}
    args = ["--device-list-strategy", "cdi-cri,cdi-annotations", "--device-id-strategy", "index"]
    with (
        FakeKubelet(base / "device-plugins") as kubelet,
        PluginProcess(base / "device-plugins", args, env=env),
    ):
        kubelet.wait_registered(GPU)
        ids = [d.id for d in kubelet.wait_for_devices(GPU, lambda d: len(d) == 4)]
        assert ids == ["0", "1", "2", "3"]
        [container] = kubelet.allocate(GPU, [["2"]]).container_responses
        assert [c.name for c in container.cdi_devices] == [f"{GPU}=2"]
        assert dict(container.annotations) == {"cdi.k8s.io/gpunode_2": f"{GPU}=2"}


def stale_gpunode_spec(specs: Path, ours: Path, names: list[str]) -> None:
    """A spec gpunode wrote (its header) that holds only `names`: the plugin regenerates only gpunode's own
    spec, never another tool's file at that path (tests/unit/test_cdi_spec_ownership.py)."""
    from gpunode.cdi.ownership import MARKER

    made = cdinode.write_spec(specs, names)
    ours.write_text(f"{MARKER} (stale)\n{made.read_text()}")
    made.unlink()


def test_the_plugin_regenerates_gpunodes_spec_at_start_and_on_sighup(base: Path) -> None:
    """gpunode's own spec (its default name in the dynamic directory) is kept true by the plugin: a stale one
    (written for GPU 0 only, as after a repartitioning) is regenerated at start from what NVML reports, so the
    plugin starts; made stale again, it is regenerated on SIGHUP (what an operator sends after a MIG change)
    and left untouched when nothing changed. A spec by another name is never written."""
    import shutil
    import signal
    import time

    import yaml

    from gpunode.cdi.generate import default_output

    dev = base / "drv"
    cdinode.make_driver(dev, "550.54.15", gpus=range(4))
    # The plugin loads NVML from its driver root: there, the driver's NVML is the fake library.
    library = fakenvml.build() / fakenvml.LIBNAME
    shutil.copyfile(library, dev / cdinode.LIB_DIR.lstrip("/") / "libnvidia-ml.so.550.54.15")
    specs = base / "cdi"
    specs.mkdir()
    ours = specs / Path(default_output(GPU)).name  # gpunode-nvidia.com-gpu.yaml (JSON is YAML too)
    stale_gpunode_spec(specs, ours, uuids("pcie-4")[:1])
    env = {"GPUNODE_CDI_SPEC_DIRS": str(specs)}
    args = ["--device-list-strategy", "cdi-cri", "--driver-root", str(dev)]
    with (
        FakeKubelet(base / "device-plugins") as kubelet,
        PluginProcess(base / "device-plugins", args, env=env) as plugin,
    ):
        kubelet.wait_registered(GPU)
        spec = yaml.safe_load(ours.read_text())
        names = {d["name"] for d in spec["devices"]}
        assert set(uuids("pcie-4")) <= names and {"0", "1", "2", "3", "all"} <= names
        plugin.wait_for_log("regenerated")  # logged before serving, written by the log's writer thread

        def reload_and_wait() -> None:
            # After a SIGHUP the plugin re-reads the GPUs (and its spec), then registers again: the new
            # registration at kubelet is the sign the reload, spec included, is done.
            before = len(kubelet.registrations(GPU))
            plugin.signal(signal.SIGHUP)
            deadline = time.monotonic() + 60
            while len(kubelet.registrations(GPU)) <= before:
                assert time.monotonic() < deadline, f"no registration after SIGHUP:\n{plugin.log()}"
                time.sleep(0.05)

        mtime = ours.stat().st_mtime_ns
        reload_and_wait()
        assert ours.stat().st_mtime_ns == mtime  # nothing changed: not rewritten

        stale_gpunode_spec(specs, ours, uuids("pcie-4")[:1])  # stale again
        reload_and_wait()
        names = {d["name"] for d in yaml.safe_load(ours.read_text())["devices"]}
        assert set(uuids("pcie-4")) <= names, plugin.log()
    assert not (specs / "gpunode.yaml").exists()
