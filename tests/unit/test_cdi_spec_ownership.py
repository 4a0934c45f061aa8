"""`cdi generate` writes over no file gpunode did not write: `--output /etc/cdi/nvidia.yaml` must not replace
nvidia-ctk's spec silently, and a spec path that is a link to /etc/important.conf must not overwrite the
link's target. Another tool's file is replaced only with --force, which keeps it first (restorable byte for
byte); a link out of the spec directory is never written through."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.cdi import ownership
from gpunode.cdi.generate import GenerateOptions, default_output, generate, write_spec
from gpunode.cli.main import main
from gpunode.errors import ExitCode, GpunodeError
from gpunode.host import Host, ScriptedRunner
from gpunode.nvml import discover
from tests import cdinode

NVIDIA_CTK_SPEC = b"""---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
"""
SPEC = default_output()


@pytest.fixture
def node(tmp_path: Path, fake_nvml: Callable[..., None]) -> Host:
    fake_nvml(profile="pcie-4")
    cdinode.make_driver(tmp_path, "550.54.15", gpus=range(4))
    return Host(root=tmp_path, runner=ScriptedRunner(), env={"PATH": "/usr/bin:/usr/sbin"})


def run(host: Host, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["cdi", "generate", *args], host=host)
    out, err = capsys.readouterr()
    return code, out, err


def test_another_tools_spec_is_not_replaced_without_force(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    theirs = node.root / "etc/cdi/nvidia.yaml"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(NVIDIA_CTK_SPEC)
    for extra in ([], ["--dry-run"], ["--json"]):
        code, out, err = run(node, capsys, "--output", "/etc/cdi/nvidia.yaml", *extra)
        assert code == ExitCode.ERROR, (extra, out, err)
        assert theirs.read_bytes() == NVIDIA_CTK_SPEC
    assert "/etc/cdi/nvidia.yaml holds a file gpunode did not write" in err + out
    assert "--force" in err + out
    assert not node.path(ownership.RECORD).exists()


def test_force_keeps_the_original_and_records_it(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    theirs = node.root / "etc/cdi/nvidia.yaml"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(NVIDIA_CTK_SPEC)
    code, _, err = run(node, capsys, "--output", "/etc/cdi/nvidia.yaml", "--force")
    assert code == ExitCode.OK, err
    digest = hashlib.sha256(NVIDIA_CTK_SPEC).hexdigest()[:12]
    backup = f"/var/lib/gpunode/backups/etc/cdi/nvidia.yaml.{digest}"
    assert node.path(backup).read_bytes() == NVIDIA_CTK_SPEC  # restorable byte for byte
    assert f"kept in {backup}" in err
    assert ownership.backups(node, "/etc/cdi/nvidia.yaml") == [backup]
    assert theirs.read_text().startswith(ownership.MARKER)
    # gpunode's own now: regenerated without --force, and an unchanged node leaves it alone.
    code, out, err = run(node, capsys, "--output", "/etc/cdi/nvidia.yaml")
    assert code == ExitCode.OK and "already current" in out, err
    # Replaced again by the other tool and forced again: the first original is not overwritten.
    theirs.write_bytes(NVIDIA_CTK_SPEC + b"# v2\n")
    assert run(node, capsys, "--output", "/etc/cdi/nvidia.yaml", "--force")[0] == ExitCode.OK
    kept = ownership.backups(node, "/etc/cdi/nvidia.yaml")
    assert len(kept) == 2 and kept[0] == backup
    assert node.path(backup).read_bytes() == NVIDIA_CTK_SPEC
    assert node.path(kept[1]).read_bytes() == NVIDIA_CTK_SPEC + b"# v2\n"


@pytest.mark.parametrize("force", [False, True])
def test_a_link_out_of_the_spec_directory_is_never_written_through(
    node: Host, capsys: pytest.CaptureFixture[str], force: bool
) -> None:
    important = node.root / "etc/important.conf"
    important.write_text("keep me\n")
    link = node.path(SPEC, follow_last=False)
    link.parent.mkdir(parents=True)
    link.symlink_to("/etc/important.conf")
    code, out, err = run(node, capsys, *(["--force"] if force else []))
    assert code == ExitCode.CONFIG, out + err
    assert important.read_text() == "keep me\n" and link.is_symlink()
    assert f"{SPEC} is a symbolic link to /etc/important.conf, outside /var/run/cdi" in err
    assert "remove the link" in err
    # Relative or through `..`: the same.
    link.unlink()
    link.symlink_to("../../../etc/important.conf")
    assert run(node, capsys)[0] == ExitCode.CONFIG
    assert important.read_text() == "keep me\n"


def test_a_link_inside_the_spec_directory_is_written_through(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(node, capsys, "--output", "/var/run/cdi/gpunode-v2.yaml")[0] == ExitCode.OK
    link = node.path(SPEC, follow_last=False)
    link.symlink_to("gpunode-v2.yaml")
    code, out, err = run(node, capsys)
    assert code == ExitCode.OK and "already current" in out, err
    assert link.is_symlink()


def test_gpunodes_json_spec_is_known_by_the_record(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON has no comments: gpunode's JSON spec is recognised by the record of what it wrote."""
    assert run(node, capsys, "--output", "/etc/cdi/gpunode.json")[0] == ExitCode.OK
    path = node.root / "etc/cdi/gpunode.json"
    assert json.loads(path.read_text())["kind"] == "nvidia.com/gpu"
    # What gpunode wrote last is its own: regenerated after the node changed, with no --force.
    options = GenerateOptions(output="/etc/cdi/gpunode.json")
    generated = generate(node, discover(node), options)
    stale = json.loads(generated.text)
    stale["devices"] = stale["devices"][:1]
    gpunodes_stale = dataclasses.replace(generated, text=json.dumps(stale))
    assert write_spec(node, gpunodes_stale) is True  # gpunode's JSON (recorded) replaced by gpunode's
    assert write_spec(node, generated) is True
    # Edited by someone else (not what gpunode recorded): refused, as any file gpunode did not write.
    path.write_text(json.dumps(stale))
    code, _, err = run(node, capsys, "--output", "/etc/cdi/gpunode.json")
    assert code == ExitCode.ERROR and "did not write" in err
    assert path.read_text() == json.dumps(stale)


def test_what_is_not_a_regular_file_is_refused(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    spec_dir = node.root / "etc/cdi"
    spec_dir.mkdir(parents=True)
    os.mkfifo(spec_dir / "fifo.yaml")
    (spec_dir / "dir.yaml").mkdir()
    for name in ("fifo.yaml", "dir.yaml"):
        code, _, err = run(node, capsys, "--output", f"/etc/cdi/{name}", "--force")
        assert code == ExitCode.CONFIG and "not a regular file" in err, err


def test_an_empty_foreign_file_is_kept_too(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    empty = node.root / "etc/cdi/empty.yaml"
    empty.parent.mkdir(parents=True)
    empty.write_bytes(b"")
    assert run(node, capsys, "--output", "/etc/cdi/empty.yaml")[0] == ExitCode.ERROR
    assert run(node, capsys, "--output", "/etc/cdi/empty.yaml", "--force")[0] == ExitCode.OK
    [backup] = ownership.backups(node, "/etc/cdi/empty.yaml")
    assert node.path(backup).read_bytes() == b""


def test_the_plugins_regeneration_refuses_another_tools_file_at_gpunodes_path(node: Host) -> None:
    """The plugin regenerates the spec at gpunode's default path when a file is there: only one gpunode
    wrote (write_spec without force, as the plugin calls it)."""
    path = node.path(SPEC)
    path.parent.mkdir(parents=True)
    path.write_bytes(NVIDIA_CTK_SPEC)
    with pytest.raises(GpunodeError, match="did not write"):
        write_spec(node, generate(node, discover(node), GenerateOptions()))
    assert path.read_bytes() == NVIDIA_CTK_SPEC
    # gpunode's own (its header), however stale, is regenerated.
    path.write_bytes(ownership.MARKER.encode() + b" (stale)\n" + NVIDIA_CTK_SPEC)
    assert write_spec(node, generate(node, discover(node), GenerateOptions())) is True


def test_backups_an_older_gpunode_kept_in_backup_are_still_put_back(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before issue 23 the backups went to /var/lib/gpunode/backup/ (everything else: backups/).
    from gpunode.cdi.check import TOOLKIT_CONFIG
    from gpunode.cdi.install import _with_envvar_off

    spec = "/etc/cdi/nvidia.yaml"
    ours = ownership.MARKER.encode() + b"\ncdiVersion: 0.5.0\n"
    node.path(spec).parent.mkdir(parents=True)
    node.path(spec).write_bytes(ours)
    old_spec_backup = "/var/lib/gpunode/backup/cdi/etc/cdi/nvidia.yaml.0123456789ab"
    node.path(old_spec_backup).parent.mkdir(parents=True)
    node.path(old_spec_backup).write_bytes(NVIDIA_CTK_SPEC)
    ownership.record(node, spec, ours, old_spec_backup)
    original = "# the operator's\n[nvidia-container-runtime]\n"
    node.path(TOOLKIT_CONFIG).parent.mkdir(parents=True)
    node.path(TOOLKIT_CONFIG).write_text(_with_envvar_off(original))
    old_toolkit_backup = node.path(f"/var/lib/gpunode/backup{TOOLKIT_CONFIG}")
    old_toolkit_backup.parent.mkdir(parents=True)
    old_toolkit_backup.write_text(original)
    code = main(["cdi", "uninstall", "--output", spec], host=node)
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, out + err
    assert node.path(spec).read_bytes() == NVIDIA_CTK_SPEC
    assert node.path(TOOLKIT_CONFIG).read_text() == original
    assert not node.path(old_spec_backup).exists() and not old_toolkit_backup.exists()
