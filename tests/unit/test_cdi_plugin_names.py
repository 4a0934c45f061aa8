"""Every name the plugin's cdi-cri / cdi-annotations answers carry is one gpunode's spec defines: GPUs and
MIG devices, by index and by UUID, whatever the MIG strategy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.cdi.generate import GenerateOptions, generate
from gpunode.cdi.spec import parse_qualified
from gpunode.host import Host, ScriptedRunner
from gpunode.nvml import discover
from gpunode.plugin.allocate import AllocateSettings, allocate
from gpunode.plugin.devices import DeviceHealth, PluginDevice, build_resources
from tests import cdinode


def healthy(device: PluginDevice) -> DeviceHealth:
    return DeviceHealth(device, True, None)


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
@pytest.mark.parametrize("mig_strategy", ["none", "mixed"])
def test_the_plugins_cdi_names_are_in_the_spec(
    tmp_path: Path, fake_nvml: Callable[..., None], id_strategy: str, mig_strategy: str
) -> None:
    fake_nvml(profile="mig")
    caps = {7: (66, 67), 8: (75, 76), 3: (30, 31)}
    cdinode.make_driver(tmp_path, "550.54.15", gpus=range(2), mig_caps=[m for p in caps.values() for m in p])
    for gi, minors in caps.items():
        cdinode.mig_proc(tmp_path, 0, gi, 0, minors=minors)
    host = Host(root=tmp_path, runner=ScriptedRunner(), env={"PATH": "/usr/bin"})
    inventory = discover(host)
    defined = set(generate(host, inventory, GenerateOptions()).qualified_names)
    settings = AllocateSettings(device_list_strategy=("cdi-cri", "cdi-annotations"))
    answered: list[str] = []
    for resource in build_resources(inventory, mig_strategy=mig_strategy, device_id_strategy=id_strategy):
        for device in resource.devices:
            (answer,) = allocate(resource, [[device.id]], healthy, settings)
            answered += [*answer.cdi_devices, *answer.annotations.values()]
            for key in answer.annotations:
                name = key.removeprefix("cdi.k8s.io/")
                assert key.startswith("cdi.k8s.io/gpunode_") and len(name) <= 63
    assert answered and set(answered) <= defined
    assert all(parse_qualified(n) for n in answered)
    if mig_strategy == "mixed":
        assert any(":" in n.split("=", 1)[1] or "MIG-" in n for n in answered)  # MIG devices answered
