"""`gpunode dra run`'s refusals at start, as a process: a clear message and its exit code, no traceback,
nothing served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integration.pluginproc import REPO


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPUNODE_") and k not in ("KUBECONFIG", "NODE_NAME")
    }
    dirs = {
        "GPUNODE_DRA_PLUGINS_DIR": str(tmp_path / "plugins"),
        "GPUNODE_DRA_REGISTRY_DIR": str(tmp_path / "registry"),
        "GPUNODE_DRA_STATUS_FILE": str(tmp_path / "status.json"),
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run(
        [sys.executable, "-m", "gpunode", "dra", "run", *args],
        check=False,
        capture_output=True,
        text=True,
        env={**base, **dirs, **(env or {})},
        cwd=REPO,
        timeout=120,
    )


def test_a_node_name_kubernetes_refuses_is_a_usage_error(tmp_path: Path) -> None:
    done = run(tmp_path, "--simulate", "pcie-4", env={"NODE_NAME": "GPU_Node"})
    assert done.returncode == 2, done.stderr
    assert "not a Kubernetes node name" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "registry").exists()


def test_a_bad_driver_name_is_a_usage_error(tmp_path: Path) -> None:
    done = run(tmp_path, "--simulate", "pcie-4", "--node-name", "n1", env={"GPUNODE_DRA_DRIVER": "GPU!"})
    assert done.returncode == 2, done.stderr
    assert "not a valid DRA driver name" in done.stderr


def test_missing_credentials_stop_the_start_before_anything_is_served(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.conf"
    done = run(tmp_path, "--simulate", "pcie-4", "--node-name", "n1", env={"KUBECONFIG": str(missing)})
    assert done.returncode == 6, done.stderr
    assert str(missing) in done.stderr and "--kubeconfig" not in done.stderr.split("fix:")[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "registry" / "gpu.nvidia.com-reg.sock").exists()
    assert not (tmp_path / "status.json").exists()
