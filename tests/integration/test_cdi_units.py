"""The units `gpunode cdi install` writes are ones systemd accepts: `systemd-analyze verify` with exit 0 and
nothing on stderr (many mistakes are only warnings). A missing systemd-analyze fails under CI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode.cdi.generate import GenerateOptions
from gpunode.cdi.install import PATH_UNIT, SERVICE, render_path_unit, render_service


def test_systemd_accepts_the_cdi_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is not installed, and CI must check the units")
        pytest.skip("systemd-analyze is not installed (CI fails instead of skipping)")
    gpunode = Path(sys.executable).parent / "gpunode"
    assert gpunode.exists(), "gpunode is not installed in this interpreter's environment"
    # Specifier, variable, escape and quote characters: written so that systemd warns about nothing (what
    # it then runs is checked in test_unit_escaping.py).
    options = GenerateOptions(driver_root='/run/nvidia 100%/$D/a\\b/"q"', output="/etc/cdi/nvidia gpu.json")
    (tmp_path / SERVICE).write_text(render_service(str(gpunode), options))
    (tmp_path / PATH_UNIT).write_text(render_path_unit(options))
    result = subprocess.run(
        [analyze, "verify", "--man=no", f"./{SERVICE}", f"./{PATH_UNIT}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert '--output "/etc/cdi/nvidia gpu.json"' in (tmp_path / SERVICE).read_text()
    assert '--driver-root "/run/nvidia 100%%/$$D/a\\\\b/\\"q\\""' in (tmp_path / SERVICE).read_text()
    assert 'PathChanged=/run/nvidia 100%%/$D/a\\b/"q"/etc/ld.so.cache\n' in (tmp_path / PATH_UNIT).read_text()
