"""`gpunode up --cdi`: CDI on in the runtime, gpunode's CDI spec written and the units that keep it true
installed, as one more step; a second run changes nothing."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from tests import cdinode
from tests.cli.test_up_cli import KEY, KEY_FPR, NodeRunner, fresh_node

SPEC = "/var/run/cdi/gpunode-nvidia.com-gpu.yaml"
TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"


@pytest.fixture
def node(tmp_path: Path, fake_nvml: Callable[..., None]) -> Host:
    fake_nvml(profile="dgx-a100")
    host = fresh_node(tmp_path / "root")
    cdinode.make_driver(host.root, "550.54.15", gpus=range(8))  # the driver's files and linker cache
    toolkit = host.root / TOOLKIT_CONFIG.lstrip("/")
    toolkit.parent.mkdir(parents=True)
    toolkit.write_text('[nvidia-container-cli]\nldconfig = "@/sbin/ldconfig"\n')
    return host


def up(host: Host, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(
        ["up", "--key-file", str(KEY), "--key-fingerprint", KEY_FPR, "--no-labels", *extra], host=host
    )
    out, err = capsys.readouterr()
    return code, out, err


def test_up_with_cdi(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = up(node, capsys, "--cdi", "--dry-run")
    assert code == ExitCode.OK, err
    assert f"[  to do] cdi: write the CDI spec {SPEC}" in out
    assert f"write {SPEC} (17 devices)" in out and "write /etc/systemd/system/gpunode-cdi.path" in out
    assert re.search(r"^ +\+ +enable_cdi = true$", out, re.MULTILINE)  # the runtime's diff
    assert not node.path(SPEC).exists()

    code, out, err = up(node, capsys, "--cdi", "--yes")
    assert code == ExitCode.OK, err
    assert "==> [3/4] cdi:" in out
    assert "kind: nvidia.com/gpu" in node.path(SPEC).read_text()
    assert "enable_cdi = true" in node.path("/etc/containerd/config.toml").read_text()
    assert node.path("/etc/systemd/system/gpunode-cdi.service").exists()
    runner = node.runner
    assert isinstance(runner, NodeRunner)
    assert ("systemctl", "enable", "gpunode-cdi.service", "gpunode-cdi.path") in runner.systemd.calls
    # The NVIDIA_VISIBLE_DEVICES exposure is closed in the toolkit's config, the rest of it kept.
    toolkit = node.path(TOOLKIT_CONFIG).read_text()
    assert toolkit.startswith("accept-nvidia-visible-devices-envvar-when-unprivileged = false\n")
    assert 'ldconfig = "@/sbin/ldconfig"' in toolkit

    files = {p: p.stat().st_mtime_ns for p in node.root.rglob("*") if p.is_file()}
    code, out, err = up(node, capsys, "--cdi", "--yes")
    assert code == ExitCode.OK, err
    assert f"[   done] cdi: the CDI spec {SPEC} is current, and kept so" in out
    assert {p: p.stat().st_mtime_ns for p in node.root.rglob("*") if p.is_file()} == files


def test_up_without_cdi_has_no_cdi_step(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = up(node, capsys, "--dry-run")
    assert code == ExitCode.OK, err
    assert "cdi:" not in out and "enable_cdi" not in out


def test_down_undoes_the_cdi_step(node: Host, capsys: pytest.CaptureFixture[str]) -> None:
    """`down` after `up --cdi`: the units are stopped, disabled and removed, gpunode's spec removed, and the
    toolkit's NVIDIA_VISIBLE_DEVICES setting put back byte for byte; a second `down` finds nothing."""
    toolkit_before = node.path(TOOLKIT_CONFIG).read_text() if node.path(TOOLKIT_CONFIG).exists() else None
    code, _, err = up(node, capsys, "--cdi", "--yes")
    assert code == ExitCode.OK, err
    assert node.path(SPEC).exists() and node.path("/etc/systemd/system/gpunode-cdi.path").exists()

    code = main(["down", "--dry-run"], host=node)
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    assert "[  to do] cdi: remove gpunode's CDI spec and the units that keep it current" in out
    assert (
        f"remove {SPEC}" in out and "run: systemctl disable --now gpunode-cdi.path gpunode-cdi.service" in out
    )
    assert node.path(SPEC).exists()

    code = main(["down", "--yes"], host=node)
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    assert not node.path(SPEC).exists()
    assert not node.path("/etc/systemd/system/gpunode-cdi.service").exists()
    assert not node.path("/etc/systemd/system/gpunode-cdi.path").exists()
    runner = node.runner
    assert isinstance(runner, NodeRunner)
    assert (
        "systemctl",
        "disable",
        "--now",
        "gpunode-cdi.path",
        "gpunode-cdi.service",
    ) in runner.systemd.calls
    if toolkit_before is not None:
        assert node.path(TOOLKIT_CONFIG).read_text() == toolkit_before

    code = main(["down", "--yes"], host=node)
    out, _ = capsys.readouterr()
    assert code == ExitCode.OK and "[skipped] cdi: gpunode has set up no CDI spec here" in out


def test_another_tools_spec_at_gpunodes_path_is_refused_in_the_plan(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused while planning: the dry run shows it, and a run changes nothing (no step before it)."""
    theirs = node.root / SPEC.lstrip("/")
    theirs.parent.mkdir(parents=True, exist_ok=True)
    theirs.write_text("---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n")
    before = {p: p.read_bytes() for p in node.root.rglob("*") if p.is_file()}
    code, out, err = up(node, capsys, "--cdi", "--dry-run")
    assert "cdi: cannot be planned" in out + err and "gpunode did not write" in out + err
    assert code != ExitCode.OK
    code, out, err = up(node, capsys, "--cdi", "--yes")
    assert code != ExitCode.OK and "gpunode did not write" in out + err
    assert {p: p.read_bytes() for p in node.root.rglob("*") if p.is_file()} == before
