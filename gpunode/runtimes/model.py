"""What gpunode reads from a container runtime's configuration (read-only; doctor and editors share it)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NVIDIA_RUNTIME_NAME = "nvidia"


@dataclass(frozen=True)
class RuntimeConfigState:
    runtime: str  # "docker", "containerd" or "crio"
    config_path: str  # the host path of the main file that was read
    exists: bool  # False: the file is missing or empty, the runtime runs on its built-in defaults
    runtimes: tuple[str, ...]  # names of the runtimes the configuration defines (merged view)
    default_runtime: str | None  # the configured default, or the runtime's built-in default
    nvidia_runtime: str | None  # name of the runtime entry that runs nvidia-container-runtime, if any
    nvidia_binary: str | None  # the path/binary that entry runs
    cdi_enabled: bool | None  # None: this runtime/version has no such switch, or it is not set
    version: int | None = None  # containerd's config version; None for the others
    files: tuple[str, ...] = ()  # every file that contributed (drop-ins, imports), in merge order
    notes: tuple[str, ...] = ()  # things an operator should know (e.g. a k3s template is in charge)
    # The subset of notes that stops the runtime from starting or breaks GPU pods (doctor fails on these).
    problems: tuple[str, ...] = ()

    @property
    def nvidia_is_default(self) -> bool:
        return self.nvidia_runtime is not None and self.default_runtime == self.nvidia_runtime
