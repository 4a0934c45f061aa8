"""Shared fixtures: the fake NVML library in this process, and a node's files under a temp root."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpunode.host import Host, ScriptedRunner
from gpunode.plugin import nvidia_env
from tests import fakenvml

FIXTURES = Path(__file__).parent / "fixtures"
FAKE_KEYS = ("FAKE_NVML_PROFILE", "FAKE_NVML_CONFIG", "FAKE_NVML_CONTROL")


@pytest.fixture(autouse=True)
def _no_nvidia_plugin_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVIDIA's plugin variables gpunode reads are generic names (CONFIG_FILE, MIG_STRATEGY) a developer's
    shell or a CI runner may carry: kept out of every test (PluginProcess drops them too)."""
    for name in nvidia_env.VARIABLES:
        monkeypatch.delenv(name, raising=False)


UBUNTU_2204 = """PRETTY_NAME="Ubuntu 22.04.4 LTS"
NAME="Ubuntu"
VERSION_ID="22.04"
VERSION="22.04.4 LTS (Jammy Jellyfish)"
ID=ubuntu
ID_LIKE=debian
"""
NVRM_VERSION = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
)
# The order gpunode asks systemctl about its units (gpunode.doctor.checks).
UNITS = (
    "containerd.service",
    "docker.service",
    "crio.service",
    "kubelet.service",
    "gpunode-device-plugin.service",
)


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Select the simulated machine the real pynvml sees in this process (the next nvmlInit reads it)."""
    for key in FAKE_KEYS:
        monkeypatch.setenv(key, "")  # registers the restore; load_into_process sets the real values

    def select(profile: str | None = None, config: Path | None = None, control: Path | None = None) -> None:
        fakenvml.load_into_process(profile, config, control)

    return select


@dataclass
class Node:
    """A GPU node's files under a temp root, plus the answers its commands give."""

    root: Path
    runner: ScriptedRunner = field(default_factory=ScriptedRunner)
    euid: int = 0
    services: dict[str, str] = field(default_factory=dict)

    def host(self) -> Host:
        states = "".join(f"{self.services.get(u, 'inactive')}\n" for u in UNITS)
        if (self.root / "run/systemd/system").is_dir():
            self.runner.answer(["systemctl", "is-active", *UNITS], stdout=states, returncode=0)
        return Host(root=self.root, runner=self.runner, env={"PATH": "/usr/sbin:/usr/bin"}, euid=self.euid)

    def file(self, host_path: str, text: str = "", mode: int = 0o644) -> Path:
        p = self.root / host_path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        p.chmod(mode)
        return p

    def program(self, name: str, version_output: str | None = None) -> None:
        self.file(f"/usr/bin/{name}", "#!/bin/sh\n", mode=0o755)
        if version_output is not None:
            self.runner.answer([f"/usr/bin/{name}", "--version"], stdout=version_output)

    def remove(self, host_path: str) -> None:
        p = self.root / host_path.lstrip("/")
        if p.is_dir():
            for child in sorted(p.rglob("*"), reverse=True):
                child.rmdir() if child.is_dir() else child.unlink()
            p.rmdir()
        elif p.exists() or p.is_symlink():
            p.unlink()

    def char_device(self, host_path: str) -> None:
        p = self.root / host_path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(195, 0))

    def socket(self, host_path: str) -> None:
        p = self.root / host_path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(p, stat.S_IFSOCK | 0o600)

    def containerd_config(self, fixture: str) -> None:
        self.file("/etc/containerd/config.toml", (FIXTURES / "containerd" / fixture).read_text())


def healthy_node(root: Path) -> Node:
    """A healthy Kubernetes GPU node's files (pair it with a fake_nvml profile): Ubuntu 22.04, driver
    loaded, device nodes for 8 GPUs, toolkit, containerd configured with nvidia as default, kubelet and
    the gpunode plugin running."""
    n = Node(root=root)
    n.file("/etc/os-release", UBUNTU_2204)
    (n.root / "sys/module/nvidia").mkdir(parents=True)
    n.file("/proc/driver/nvidia/version", NVRM_VERSION)
    for dev in ["/dev/nvidiactl", "/dev/nvidia-uvm", *[f"/dev/nvidia{i}" for i in range(8)]]:
        n.char_device(dev)
    n.program("nvidia-ctk", "NVIDIA Container Toolkit CLI version 1.16.2\ncommit: a5a5833c\n")
    n.program("nvidia-container-runtime", "NVIDIA Container Runtime version 1.16.2\ncommit: a5a5833c\n")
    n.program("containerd")
    n.runner.answer(
        ["containerd", "--version"], stdout="containerd github.com/containerd/containerd v1.7.12 abc\n"
    )
    n.containerd_config("v2-nvidia-default.toml")
    n.program("kubelet")
    n.program("systemctl")
    (n.root / "run/systemd/system").mkdir(parents=True)
    n.services.update(
        {
            "containerd.service": "active",
            "kubelet.service": "active",
            "gpunode-device-plugin.service": "active",
        }
    )
    n.socket("/var/lib/kubelet/device-plugins/kubelet.sock")
    n.socket("/var/lib/kubelet/device-plugins/gpunode-nvidia.com-gpu.sock")
    return n


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return healthy_node(tmp_path / "root")
