"""What `configure-runtime` intends to do, as plain data: the dry run prints it, tests assert on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # edits imports tomlkit; `gpunode --help` imports this module for a default value
    from gpunode.runtimes.edits import Edit

DEFAULT_RUNTIME_PATH = "/usr/bin/nvidia-container-runtime"
RUNTIMES = ("docker", "containerd", "crio")


@dataclass(frozen=True)
class ConfigureOptions:
    runtime_name: str = "nvidia"
    runtime_path: str = DEFAULT_RUNTIME_PATH
    set_as_default: bool = False
    cdi: bool = False
    config: str | None = None  # the main configuration file; None: the runtime's standard place
    drop_in: str | None = None  # containerd: write a drop-in here; CRI-O: the drop-in to write
    in_place: bool = False  # CRI-O: edit crio.conf itself instead of writing a drop-in
    # Ask the runtime itself for its effective configuration (CRI-O: `crio config`) to decide what to change
    # and to check the result before anything is written, instead of relying on gpunode's own merge alone.
    effective: bool = False


@dataclass(frozen=True)
class FileChange:
    """One file's new content. before/after None: the file does not exist before / is removed."""

    path: str
    before: str | None
    after: str | None
    edits: tuple[Edit, ...] = ()
    mode: int = 0o644
    # True for a file that exists only for gpunode (a drop-in): reverting removes it whole.
    owned: bool = False
    # Where the temp file is made: for a drop-in, the parent of its directory, which runtimes do not read.
    temp_dir: str | None = None
    # Directories to create (mode 0755, outermost first) before the file is written; reverted when empty.
    make_dirs: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        import difflib

        old = [] if self.before is None else self.before.splitlines(keepends=True)
        new = [] if self.after is None else self.after.splitlines(keepends=True)
        lines = difflib.unified_diff(
            old,
            new,
            fromfile="/dev/null" if self.before is None else f"a{self.path}",
            tofile="/dev/null" if self.after is None else f"b{self.path}",
        )
        missing_newline = "\n\\ No newline at end of file\n"
        return "".join(line if line.endswith("\n") else line + missing_newline for line in lines)


@dataclass(frozen=True)
class RuntimePlan:
    runtime: str  # "docker", "containerd" or "crio"
    changes: tuple[FileChange, ...]
    messages: tuple[str, ...] = ()  # what gpunode chose and why, for the operator
    unit: str | None = None  # the systemd unit that runs the runtime
    socket: str | None = None  # where the restarted runtime answers
    flavour: str = ""  # containerd: "containerd", "k3s", "rke2" or "microk8s"
    standard_location: bool = True  # False when --config points elsewhere: no restart by default
    revert: bool = False
    expect: tuple[str, bool] | None = None  # (runtime name, is default) the runtime should show once up
    # A revert's files that gpunode leaves where they are although it made them: they are no longer (or
    # cannot be shown to be) what gpunode wrote, so they are the operator's now. The messages say why.
    kept: tuple[str, ...] = ()

    @property
    def pending(self) -> tuple[FileChange, ...]:
        return tuple(c for c in self.changes if c.changed)
