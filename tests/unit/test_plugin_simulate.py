"""`--simulate` inventories equal what discovery reads through the REAL pynvml from the fake library."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.errors import GpunodeError, UsageError
from gpunode.host import Host
from gpunode.nvml import discover
from gpunode.plugin.simulate import PROFILES, simulated_inventory
from tests import fakenvml

REPO = Path(__file__).resolve().parents[2]


def test_profiles_are_the_fake_librarys() -> None:
    assert PROFILES == fakenvml.PROFILES


@pytest.mark.parametrize("profile", fakenvml.PROFILES)
def test_simulation_equals_discovery(profile: str, fake_nvml: Callable[..., None], tmp_path: Path) -> None:
    fake_nvml(profile)
    # An empty root has no /sys, so discovery takes NUMA nodes from NVML, as the simulation does.
    try:
        expected = discover(Host(root=tmp_path))
    except GpunodeError as exc:
        with pytest.raises(type(exc)) as info:
            simulated_inventory(profile)
        assert type(info.value) is type(exc)
        assert (info.value.message, info.value.fix) == (exc.message, exc.fix)
        return
    assert simulated_inventory(profile) == expected


def test_simulation_is_not_trivially_empty() -> None:
    # Guards the equality test above against both sides degrading together.
    inv = simulated_inventory("mig")
    assert [m.profile for m in inv.gpus[0].mig_devices] == ["1g.5gb", "1g.5gb", "2g.10gb"]
    assert all(m.uuid.startswith("MIG-") for m in inv.gpus[0].mig_devices)
    assert len(simulated_inventory("dgx-a100").pairs) == 28
    assert [g.lost for g in simulated_inventory("lost-gpu").gpus] == [False, False, True, False]


def test_unknown_profile_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as info:
        simulated_inventory("dgx-h200")
    assert "'dgx-h200'" in info.value.message
    assert all(name in info.value.message for name in PROFILES)


def test_import_needs_no_nvml() -> None:
    # A simulated plugin runs where there is no libnvidia-ml: it must not even import pynvml.
    code = (
        "import sys\n"
        "import gpunode.plugin.simulate as s\n"
        "s.simulated_inventory('dgx-a100')\n"
        "print(sorted(m for m in ('pynvml', 'ctypes') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
