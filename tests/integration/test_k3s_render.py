"""What k3s would hand containerd after gpunode's change, read by the real containerd of that k3s's major.

k3s cannot run here. Its rendering of gpunode's template is reproduced (tests/gotemplate.py, with the
generated config as the base output), or, for the drop-in layout, containerd itself merges the drop-in
the generated config imports. containerd 1.7 reads the version 2 configs (k3s before containerd 2.0),
containerd 2.x the version 3 ones; both come unpacked from Debian (tests/testbed.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import containerd, k3s
from gpunode.runtimes.configure import apply, plan_configure
from gpunode.runtimes.plan import ConfigureOptions
from tests import testbed, tomlread
from tests.gotemplate import render_like_k3s

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "containerd" / "k3s"
NVIDIA = "/usr/bin/nvidia-container-runtime"
K3S_1_28 = "k3s version v1.28.5+k3s1 (5b2d1271)\n"
K3S_1_32 = "k3s version v1.32.2+k3s1 (381620ef)\n"
K3S_1_35 = "k3s version v1.35.3+k3s1 (0f6e2f1c)\n"
CRI = {2: ("plugins", "io.containerd.grpc.v1.cri"), 3: ("plugins", "io.containerd.cri.v1.runtime")}
CONTAINERD = {2: "containerd-1.7", 3: "containerd-2"}


def k3s_node(root: Path, generated: str, version: str) -> Host:
    target = root / containerd.K3S_CONFIG.lstrip("/")
    target.parent.mkdir(parents=True)
    target.write_text(generated)
    runner = ScriptedRunner()
    runner.answer(["k3s", "--version"], version)
    return Host(root=root, runner=runner)


def configure(host: Host, **options: Any) -> None:
    apply(host, plan_configure(host, "containerd", ConfigureOptions(**options)), restart=False)


def dump(binary: Path, config: Path) -> dict[str, Any]:
    result = subprocess.run(
        [str(binary), "--config", str(config), "config", "dump"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=config.parent,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return tomlread.loads(result.stdout)


def dig(doc: Any, *keys: str) -> Any:
    for key in keys:
        doc = doc[key]
    return doc


@pytest.mark.parametrize(
    ("fixture", "version", "template"),
    [
        ("v2-k3s-v1.28.toml", K3S_1_28, containerd.K3S_TEMPLATE),
        ("v3-k3s-v1.32.toml", K3S_1_32, containerd.K3S_TEMPLATE_V3),
    ],
)
def test_rendered_template_has_the_runtime_for_the_real_containerd(
    tmp_path: Path, fixture: str, version: str, template: str
) -> None:
    generated = (FIXTURES / fixture).read_text()
    host = k3s_node(tmp_path / "root", generated, version)
    configure(host)
    written = (tmp_path / "root" / template.lstrip("/")).read_text()
    config_version = containerd.detect_version(containerd.parse_toml(generated, fixture), None)
    rendered = tmp_path / "config.toml"
    rendered.write_text(render_like_k3s(written, generated))

    effective = dump(testbed.binary(CONTAINERD[config_version]), rendered)
    runtimes = dig(effective, *CRI[config_version], "containerd", "runtimes")
    assert runtimes["nvidia"]["runtime_type"] == "io.containerd.runc.v2"
    assert runtimes["nvidia"]["options"]["BinaryName"] == NVIDIA
    assert runtimes["nvidia"]["options"]["SystemdCgroup"] is True
    assert runtimes["runc"]["options"]["SystemdCgroup"] is True  # k3s's own runtime is still there


def test_template_after_k3s_found_the_runtime_still_starts_containerd(tmp_path: Path) -> None:
    # The binary was installed after gpunode wrote the template: k3s's base output now has its own
    # "nvidia" and "nvidia-experimental"; the template's runtime is left out and containerd reads the file.
    host = k3s_node(tmp_path / "root", (FIXTURES / "v2-k3s-v1.28.toml").read_text(), K3S_1_28)
    configure(host)
    written = (tmp_path / "root" / containerd.K3S_TEMPLATE.lstrip("/")).read_text()
    rendered = tmp_path / "config.toml"
    found = frozenset({"nvidia", "nvidia-experimental"})
    rendered.write_text(render_like_k3s(written, (FIXTURES / "v2-k3s-v1.28-nvidia.toml").read_text(), found))
    runtimes = dig(dump(testbed.binary("containerd-1.7"), rendered), *CRI[2], "containerd", "runtimes")
    assert runtimes["nvidia"]["options"]["BinaryName"] == NVIDIA
    assert "nvidia-experimental" in runtimes


def test_drop_in_is_merged_by_the_real_containerd_2(tmp_path: Path) -> None:
    root = tmp_path / "root"
    generated = (FIXTURES / "v3-k3s-v1.35-dropin.toml").read_text()
    host = k3s_node(root, generated, K3S_1_35)
    configure(host, set_as_default=True)
    dropin = root / containerd.K3S_DIR.lstrip("/") / "config-v3.toml.d" / k3s.DROPIN_NAME
    assert dropin.is_file()
    # The generated config as containerd reads it on this machine: its import points at the temp root.
    config = root / containerd.K3S_CONFIG.lstrip("/")
    local = tmp_path / "config.toml"
    local.write_text(config.read_text().replace(containerd.K3S_DIR, str(config.parent)))

    effective = dump(testbed.binary("containerd-2"), local)
    cri = dig(effective, *CRI[3])
    assert cri["containerd"]["default_runtime_name"] == "nvidia"
    assert cri["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == NVIDIA
    assert cri["containerd"]["runtimes"]["nvidia"]["options"]["SystemdCgroup"] is True
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    # Merged, not replaced: k3s's CRI settings outside the drop-in are still there.
    assert cri["enable_unprivileged_ports"] is True
    images = dig(effective, "plugins", "io.containerd.cri.v1.images")
    assert images["pinned_images"]["sandbox"] == "rancher/mirrored-pause:3.6"
