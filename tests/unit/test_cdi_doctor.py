"""doctor's cdi checks: run when CDI is in use (gpunode's spec exists, or the plugin's config asks for a
cdi-* strategy); otherwise one skip, and the NVIDIA_VISIBLE_DEVICES exposure, which matters either way."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gpunode.cdi.generate import GenerateOptions, generate, write_spec
from gpunode.doctor.cdi import check_cdi
from gpunode.doctor.checks import Context
from gpunode.doctor.model import Status
from gpunode.host import Host, ScriptedRunner
from gpunode.nvml import discover
from tests import cdinode


def context(root: Path) -> Context:
    return Context(host=Host(root=root, runner=ScriptedRunner(), env={"PATH": "/usr/bin"}), discover=discover)


def statuses(ctx: Context) -> dict[str, Status]:
    return {f.id: f.status for f in check_cdi(ctx)}


def test_no_cdi_in_use_is_one_skip(tmp_path: Path) -> None:
    assert statuses(context(tmp_path)) == {"cdi": Status.SKIP, "cdi.envvar": Status.SKIP}


def test_a_cdi_strategy_without_a_spec_fails(tmp_path: Path, fake_nvml: Callable[..., None]) -> None:
    fake_nvml(profile="pcie-4")
    cdinode.make_driver(tmp_path, "550.54.15", gpus=range(4))
    plugin = tmp_path / "etc/gpunode/plugin.toml"
    plugin.parent.mkdir(parents=True)
    plugin.write_text('device-list-strategy = ["cdi-cri"]\ncdi-kind = "example.com/gpu"\n')
    ctx = context(tmp_path)
    found = {f.id: f for f in check_cdi(ctx)}
    assert found["cdi.spec"].status is Status.FAIL
    assert "/var/run/cdi/gpunode-example.com-gpu.yaml" in found["cdi.spec"].summary
    # Generated with the plugin's kind, every check passes.
    options = GenerateOptions(kind="example.com/gpu")
    write_spec(ctx.host, generate(ctx.host, discover(ctx.host), options))
    assert {k: v for k, v in statuses(context(tmp_path)).items() if v is not Status.OK} == {
        "cdi.envvar": Status.SKIP
    }


def test_a_runtime_without_cdi_fails_with_the_fix(tmp_path: Path, fake_nvml: Callable[..., None]) -> None:
    fake_nvml(profile="pcie-4")
    cdinode.make_driver(tmp_path, "550.54.15", gpus=range(4))
    ctx = context(tmp_path)
    write_spec(ctx.host, generate(ctx.host, discover(ctx.host), GenerateOptions()))
    containerd = tmp_path / "usr/bin/containerd"
    containerd.write_text("#!/bin/sh\n")
    containerd.chmod(0o755)
    config = tmp_path / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = false\n')
    found = {f.id: f for f in check_cdi(context(tmp_path))}
    assert found["cdi.runtime.containerd"].status is Status.FAIL
    assert found["cdi.runtime.containerd"].fix == "`gpunode configure-runtime containerd --cdi`"
    config.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = true\n')
    assert statuses(context(tmp_path))["cdi.runtime.containerd"] is Status.OK


def test_without_a_plugin_config_doctor_does_not_import_the_plugins_config_module(tmp_path: Path) -> None:
    """issue 24: doctor's time. In a process of its own, so no other test's import counts."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from gpunode.doctor.cdi import check_cdi\n"
        "from gpunode.doctor.checks import Context\n"
        "from gpunode.host import Host, ScriptedRunner\n"
        "from gpunode.nvml import discover\n"
        f"ctx = Context(host=Host(root=Path({str(tmp_path)!r}), runner=ScriptedRunner(), env={{}}), "
        "discover=discover)\n"
        "print(sorted(f.id for f in check_cdi(ctx)), 'gpunode.plugin.config' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['cdi', 'cdi.envvar'] False"


def test_doctors_plugin_config_path_is_the_plugins() -> None:
    from gpunode.doctor.cdi import PLUGIN_CONFIG
    from gpunode.plugin.config import DEFAULT_CONFIG

    assert PLUGIN_CONFIG == DEFAULT_CONFIG
