"""Cross-check gpunode's reading of containerd configs against containerd's own `config dump`.

Needs the test bed's containerd 1.6 (tests/testbed.py: unpacked, never installed); gpunode finds it first
on PATH, as it would find an installed one. In CI (the CI variable is set) a missing containerd is a
failure: the check must not silently stop running there.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpunode.host import Host
from gpunode.runtimes import containerd
from tests import testbed

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "containerd"

# Fixtures by config version; only the versions the installed containerd reads are checked.
FIXTURE_VERSIONS = {
    "default-v2.toml": 2,
    "v1-nvidia.toml": 1,
    "v2-nvidia-default.toml": 2,
    "v2-nvidia-no-systemdcgroup.toml": 2,
    "v3-nvidia.toml": 3,
    "k3s-config.toml": 2,
    "cri-disabled.toml": 1,
}
READABLE = {1: {1, 2}, 2: {2, 3}}


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """The test bed's containerd 1.6 first on PATH, where gpunode (Host() on the real root) looks."""
    monkeypatch.setenv("PATH", testbed.path_with("containerd-1.6"))
    version = containerd.installed_containerd_version(Host())
    assert version is not None, "cannot read `containerd --version`"
    return version


def dump(config: Path, cwd: Path) -> dict[str, Any]:
    result = subprocess.run(
        [testbed.binary("containerd-1.6"), "--config", str(config), "config", "dump"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=cwd,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return containerd.parse_toml(result.stdout, f"config dump of {config}")


def effective(doc: Mapping[str, Any]) -> tuple[set[str], str]:
    version = containerd.detect_version(doc, None)
    return set(containerd.configured_runtimes(doc, version)), containerd.default_runtime_name(doc, version)


@pytest.mark.parametrize("name", sorted(FIXTURE_VERSIONS))
def test_runtimes_and_default_agree_with_config_dump(
    name: str, installed: tuple[int, int], tmp_path: Path
) -> None:
    config = tmp_path / "config.toml"
    shutil.copyfile(FIXTURES / name, config)
    state = containerd.read_state(Host(), str(config))
    if installed[:2] == (1, 6) and FIXTURE_VERSIONS[name] == 3:
        # containerd 1.6 ignores a version 3 file without a word: it runs on defaults, and gpunode says so.
        assert effective(dump(config, tmp_path)) == ({"runc"}, "runc")
        assert any("version 3 file but containerd 1.6" in n for n in state.notes)
        return
    if FIXTURE_VERSIONS[name] not in READABLE.get(installed[0], {2, 3}):
        pytest.skip(
            f"containerd {installed[0]}.{installed[1]} does not read version {FIXTURE_VERSIONS[name]}"
        )
    dumped = dump(config, tmp_path)
    if containerd.cri_disabled(containerd.parse_toml(config.read_text(), str(config))):
        # A disabled plugin is not loaded, so the dump has no CRI table at all.
        assert containerd.cri_table(dumped, containerd.detect_version(dumped, None)) == {}
        assert any("disables the CRI plugin" in n for n in state.notes)
        return
    dumped_runtimes, dumped_default = effective(dumped)
    # Without a runtimes table the CRI plugin keeps its built-in runc, which the dump lists.
    expected = set(state.runtimes) or {"runc"}
    assert dumped_runtimes == expected
    assert dumped_default == state.default_runtime


def test_imports_agree_with_config_dump(installed: tuple[int, int], tmp_path: Path) -> None:
    dropins = tmp_path / "conf.d"
    dropins.mkdir()
    shutil.copyfile(FIXTURES / "imports-99-nvidia.toml", dropins / "99-nvidia.toml")
    (dropins / "99-nvidia.toml.gpunode-bak").write_text("not toml = [\n")
    main = (FIXTURES / "imports-main.toml").read_text().replace("/etc/containerd/conf.d", str(dropins))
    config = tmp_path / "config.toml"
    config.write_text(main)
    state = containerd.read_state(Host(), str(config))
    dumped = dump(config, Path("/"))
    assert set(dumped["imports"]) == set(state.files)
    dumped_runtimes, dumped_default = effective(dumped)
    assert dumped_runtimes == set(state.runtimes)
    assert dumped_default == state.default_runtime
