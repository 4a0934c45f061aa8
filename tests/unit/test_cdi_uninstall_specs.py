"""`cdi uninstall` takes away every spec gpunode wrote — its YAML (known by its header) and its JSON (known by
the record: JSON has no comments) — puts back the file a `cdi generate --force` replaced, from its backup,
and never deletes a spec whose content is not what gpunode wrote."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.cdi import ownership
from gpunode.cdi.generate import GenerateOptions
from gpunode.cdi.install import apply_uninstall, plan_uninstall
from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from tests import cdinode

NVIDIA_CTK_SPEC = b"---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n"


@pytest.fixture
def node(tmp_path: Path, fake_nvml: Callable[..., None]) -> Host:
    fake_nvml(profile="pcie-4")
    cdinode.make_driver(tmp_path, "550.54.15", gpus=range(4))
    return Host(root=tmp_path, runner=ScriptedRunner(), env={"PATH": "/usr/bin:/usr/sbin"}, euid=0)


def generate(host: Host, capsys: pytest.CaptureFixture[str], *args: str) -> None:
    code = main(["cdi", "generate", *args], host=host)
    _, err = capsys.readouterr()
    assert code == ExitCode.OK, err


def uninstall(host: Host) -> None:
    apply_uninstall(host, plan_uninstall(host, GenerateOptions()))


def test_gpunodes_json_spec_is_removed(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    generate(node, capsys, "--output", "/etc/cdi/gpunode.json")
    spec = node.root / "etc/cdi/gpunode.json"
    assert json.loads(spec.read_text())["kind"] == "nvidia.com/gpu"
    plan = plan_uninstall(node, GenerateOptions())
    assert "/etc/cdi/gpunode.json" in plan.remove
    uninstall(node)
    assert not spec.exists()
    assert ownership.recorded(node) == []


def test_a_json_spec_edited_since_is_kept(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    generate(node, capsys, "--output", "/etc/cdi/gpunode.json")
    spec = node.root / "etc/cdi/gpunode.json"
    spec.write_text(spec.read_text().replace("nvidia.com/gpu", "example.com/gpu"))
    edited = spec.read_text()
    plan = plan_uninstall(node, GenerateOptions())
    assert "/etc/cdi/gpunode.json" not in plan.remove
    assert "/etc/cdi/gpunode.json was not written by gpunode: left in place" in plan.notes
    uninstall(node)
    assert spec.read_text() == edited


def test_the_file_a_forced_generate_replaced_is_put_back(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    theirs = node.root / "etc/cdi/nvidia.yaml"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(NVIDIA_CTK_SPEC)
    generate(node, capsys, "--output", "/etc/cdi/nvidia.yaml", "--force")
    [backup] = ownership.backups(node, "/etc/cdi/nvidia.yaml")
    assert theirs.read_text().startswith(ownership.MARKER)

    plan = plan_uninstall(node, GenerateOptions())
    assert plan.restore == (("/etc/cdi/nvidia.yaml", NVIDIA_CTK_SPEC.decode()),)
    assert "/etc/cdi/nvidia.yaml" not in plan.remove
    uninstall(node)
    assert theirs.read_bytes() == NVIDIA_CTK_SPEC  # nvidia-ctk's spec back, byte for byte
    assert not node.path(backup).exists()  # no longer the only copy: it is in place
    assert ownership.recorded(node) == []
    # A second uninstall finds nothing of gpunode's, and leaves nvidia-ctk's spec alone.
    again = plan_uninstall(node, GenerateOptions())
    assert again.changes_nothing
    uninstall(node)
    assert theirs.read_bytes() == NVIDIA_CTK_SPEC


def test_a_forced_spec_changed_before_apply_keeps_the_backup(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    theirs = node.root / "etc/cdi/nvidia.yaml"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(NVIDIA_CTK_SPEC)
    generate(node, capsys, "--output", "/etc/cdi/nvidia.yaml", "--force")
    [backup] = ownership.backups(node, "/etc/cdi/nvidia.yaml")
    plan = plan_uninstall(node, GenerateOptions())
    theirs.write_bytes(b"# the operator's own\n")
    with pytest.raises(Exception, match="no longer the spec gpunode wrote"):
        apply_uninstall(node, plan)
    assert theirs.read_bytes() == b"# the operator's own\n"
    assert node.path(backup).read_bytes() == NVIDIA_CTK_SPEC
