"""Which gpunode this is: the version, and the commit or build it was made from.

An installed package carries its build in gpunode/_build.py, which install.sh writes next to the installed
modules (the commit of the checkout it installed from, or $GPUNODE_BUILD for a build without git); it is
not part of the source tree. Run from a git checkout (an editable install, `python -m gpunode`), the commit
comes from git - asked only for `--version` and `gpunode version`, never on an ordinary start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpunode import __version__

if TYPE_CHECKING:
    from gpunode.host import Host

_CHECKOUT = Path(__file__).resolve().parent.parent  # the checkout's top, when gpunode runs from one


@dataclass(frozen=True)
class Build:
    version: str
    commit: str | None  # None: neither a build stamp nor a git checkout says
    source: str  # "build" (gpunode/_build.py), "git" (the checkout), or "unknown"

    def line(self) -> str:
        """`gpunode --version`'s line."""
        if self.commit is None:
            return f"gpunode {self.version} (commit unknown)"
        return f"gpunode {self.version} ({'build' if self.source == 'build' else 'commit'} {self.commit})"


def build(host: Host, checkout: Path = _CHECKOUT) -> Build:
    try:
        from gpunode._build import BUILD  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        pass
    else:
        return Build(__version__, str(BUILD), "build")
    commit = _git_commit(host, checkout)
    return Build(__version__, commit, "git" if commit else "unknown")


def _git_commit(host: Host, checkout: Path) -> str | None:
    # gpunode's own files on this machine, as its modules are: not a host path, so not through the Host (and
    # the same under --root). .git is a directory in a clone, a file in a worktree.
    if not (checkout / ".git").exists():
        return None
    from gpunode.errors import GpunodeError

    try:
        result = host.run(
            ["git", "-C", str(checkout), "describe", "--always", "--dirty", "--abbrev=12"], timeout=10
        )
    except GpunodeError:  # no git here, or it did not answer in time: the version alone is still true
        return None
    text = result.stdout.strip()
    return text if result.ok and text else None


def package_version(distribution: str) -> str | None:
    """The installed version of a Python distribution gpunode depends on, or None when it is missing."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def write_stamp(package_dir: Path, build_name: str) -> Path:
    """Write gpunode/_build.py into an installed package (install.sh, after pip): the build `--version`
    names. Whole or not at all (temp file, then rename): a half-written module would break every start."""
    import os

    path = package_dir / "_build.py"
    tmp = package_dir / "._build.py.tmp"
    tmp.write_text(f"# Written by install.sh: the build `gpunode --version` names.\nBUILD = {build_name!r}\n")
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    # `python -I -m gpunode.buildinfo stamp BUILD`, run by install.sh with the installed gpunode.
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "stamp" or not sys.argv[2].isprintable():
        sys.exit("usage: python -m gpunode.buildinfo stamp BUILD")
    print(write_stamp(Path(__file__).resolve().parent, sys.argv[2]))
