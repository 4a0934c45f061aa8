"""`gpunode cdi install` against a real systemd (tests/integration/nspawn.py): the oneshot writes the spec
when started, and the path unit regenerates it when a driver upgrade replaces the linker cache; a start on
an unchanged node leaves the file alone.

The driver root is a host directory the container sees read-write at /drv: device nodes made with mknod,
stand-in libraries and their ld.so.cache (tests/cdinode.py). The fake NVML library and its config reach
the service through /etc/default/gpunode-cdi, the unit's EnvironmentFile. gpunode runs from this
checkout's venv, which the container sees at the same path.

Needs root, systemd-nspawn, nsenter, gcc and a venv made from the host's /usr/bin/python3; in CI (CI set)
a missing one is a failure.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from gpunode.errors import ExitCode
from tests import cdinode, fakenvml
from tests.integration import nspawn
from tests.integration.pluginproc import short_tempdir

REPO = Path(__file__).resolve().parents[2]
GPUNODE = str(Path(sys.executable).parent / "gpunode")
SPEC = "/var/run/cdi/gpunode-nvidia.com-gpu.yaml"
WAIT = 120.0  # generous: the shared 2-core machines are slow; nothing here measures time


def machine(path: Path, version: str) -> None:
    path.write_text(f"[system]\ndriver_version = {version}\n" + "[gpu]\nname = NVIDIA L4\n" * 2)


def wait_for(box: nspawn.Container, text: str) -> str:
    deadline = time.monotonic() + WAIT
    while True:
        spec = box.path(SPEC)
        content = spec.read_text() if spec.exists() else ""
        if text in content:
            return content
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{SPEC} never held {text!r} ({len(content)} bytes);\n"
                f"{box.journal('gpunode-cdi.service')}\n{box.journal('gpunode-cdi.path')}"
            )
        time.sleep(0.1)


def test_the_spec_is_written_and_regenerated_after_a_driver_upgrade() -> None:
    binds = nspawn.checkout_binds(["gcc is not installed"] if shutil.which("gcc") is None else [])
    nvml = fakenvml.build()
    if not nvml.resolve().is_relative_to(REPO):
        binds.append(nspawn.Bind(nvml, str(nvml)))
    with short_tempdir("gpunode-cdi-") as base:
        driver = base / "drv"
        cdinode.make_driver(driver, "550.54.15", gpus=range(2))
        config = driver / "nvml.ini"
        machine(config, "550.54.15")
        binds.append(nspawn.Bind(driver, "/drv", read_only=False))
        with nspawn.boot(base / "nspawn", binds=binds) as box:
            env = box.path("/etc/default/gpunode-cdi")
            env.parent.mkdir(parents=True, exist_ok=True)
            env.write_text(f"LD_LIBRARY_PATH={nvml}\nFAKE_NVML_CONFIG=/drv/nvml.ini\n")
            result = box.run([GPUNODE, "cdi", "install", "--driver-root", "/drv"], timeout=WAIT + 60)
            assert result.returncode == ExitCode.OK, f"{result.stdout}\n{result.stderr}"
            assert "nvidia-container-runtime/config.toml does not exist" in result.stdout
            first = wait_for(box, "libcuda.so.550.54.15")
            assert "hostPath: /drv/dev/nvidia1" in first
            state = box.unit_properties("gpunode-cdi.path", "ActiveState", "UnitFileState")
            assert state == {"ActiveState": "active", "UnitFileState": "enabled"}, state

            # Started again on an unchanged node: the file is left as it is.
            before = box.path(SPEC).stat().st_mtime_ns
            assert box.systemctl("start", "gpunode-cdi.service").returncode == 0
            assert box.path(SPEC).stat().st_mtime_ns == before

            # A driver upgrade: NVML reports 560, the package replaces the libraries and runs ldconfig.
            machine(config, "560.35.03")
            cdinode.set_driver_version(driver, "560.35.03")
            upgraded = wait_for(box, "libcuda.so.560.35.03")
            assert "550.54.15" not in upgraded
            fake = [f"LD_LIBRARY_PATH={nvml}", "FAKE_NVML_CONFIG=/drv/nvml.ini"]
            result = box.run(["env", *fake, GPUNODE, "cdi", "check", "--driver-root", "/drv"], timeout=WAIT)
            assert "the CDI spec matches the node: driver 560.35.03" in result.stdout, result.stdout
