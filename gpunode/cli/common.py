"""What several commands share: the checks before a command changes the host."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from gpunode.host import Host


def refuse_foreign_root(host: Host, dry_run: bool) -> None:
    from gpunode.errors import UsageError
    from gpunode.host import SubprocessRunner

    # The package manager would change THIS machine, not the tree under --root.
    if not dry_run and not host.is_real_root and isinstance(host.runner, SubprocessRunner):
        raise UsageError(
            f"--root {host.root} works with --dry-run only: the package manager would change this machine",
            "add --dry-run, or run gpunode inside that system (chroot, systemd-nspawn)",
        )


def confirm(yes: bool, what: str, warning: str | None = None) -> None:
    """Ask before a change that disrupts; --yes answers for automation. Declining exits 1 (the operator's
    choice, not an interruption)."""
    from gpunode.errors import ExitCode, UsageError

    if warning:
        typer.echo(f"warning: {warning}")
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(
            f"{what} changes this system (packages, configuration or services) and there is no terminal "
            "to confirm on",
            "add --yes to run it unattended (or --dry-run to see the plan)",
        )
    if not typer.confirm("Go ahead?", default=False):
        typer.echo("nothing was changed")
        raise typer.Exit(int(ExitCode.DECLINED))
