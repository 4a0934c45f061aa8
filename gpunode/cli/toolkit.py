"""`gpunode toolkit install|uninstall|status`: wiring and rendering; the work is in gpunode.toolkit."""

from __future__ import annotations

import difflib
import json
import sys
from typing import TYPE_CHECKING, Optional

import typer

from gpunode.cli.common import confirm, refuse_foreign_root
from gpunode.toolkit.managers import DEFAULT_REPO_URL

if TYPE_CHECKING:
    from gpunode.toolkit.install import Outcome, Progress, ToolkitPlan, ToolkitStatus

app = typer.Typer(
    help="Install nvidia-container-toolkit from NVIDIA's signed repositories (apt, dnf/yum, zypper).",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.command("install")
def install(
    ctx: typer.Context,
    version: Optional[str] = typer.Option(  # noqa: UP045 (typer reads the annotation at runtime)
        None,
        "--version",
        metavar="X.Y.Z",
        help="Pin all four packages to this version (default: the newest; an installed one is kept).",
        show_default=False,
    ),
    repo_url: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--repo-url",
        metavar="URL",
        help=f"The repositories' base URL: a mirror for air-gapped nodes (default: the one the last install "
        f"used, else {DEFAULT_REPO_URL}).",
        show_default=False,
    ),
    key_file: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--key-file",
        metavar="PATH",
        help="Read the signing key from this file instead of downloading URL/gpgkey.",
        show_default=False,
    ),
    key_fingerprint: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--key-fingerprint",
        metavar="FPR",
        help="Trust the key with this fingerprint instead of NVIDIA's (a mirror signed with its own key).",
        show_default=False,
    ),
    experimental: bool = typer.Option(
        False, "--experimental", help="Also enable the experimental repository."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every file and command; change nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (unattended use)."),
) -> None:
    """Add NVIDIA's repository (its key checked) and install the toolkit's four packages, pinned together."""
    from gpunode.cli.main import state
    from gpunode.toolkit import install as toolkit

    host = state(ctx).host
    refuse_foreign_root(host, dry_run)
    if not dry_run:
        toolkit.require_root(host, "toolkit install")
    opts = toolkit.InstallOptions(
        version=version,
        repo_url=repo_url,
        key_file=key_file,
        key_fingerprint=key_fingerprint,
        experimental=experimental,
    )
    if dry_run:
        _print_plan(toolkit.plan_install(host, opts), dry_run=True)
        return
    with host.lock(toolkit.LOCK):
        plan = toolkit.plan_install(host, opts)
        _print_plan(plan, dry_run=False)
        if plan.changes_nothing:
            return
        confirm(yes, "toolkit install")
        outcome = toolkit.apply_install(host, plan, _progress())
    _print_outcome(outcome)
    typer.echo(f"nvidia-container-toolkit {toolkit.consistent_version(outcome.installed)} is installed")
    typer.echo("next: gpunode configure-runtime (the packages configure no container runtime themselves)")


@app.command("uninstall")
def uninstall(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be removed; change nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (unattended use)."),
) -> None:
    """Remove the four packages and the repository files `toolkit install` added (nothing else)."""
    from gpunode.cli.main import state
    from gpunode.toolkit import install as toolkit

    host = state(ctx).host
    refuse_foreign_root(host, dry_run)
    if not dry_run:
        toolkit.require_root(host, "toolkit uninstall")
    if dry_run:
        _print_plan(toolkit.plan_uninstall(host), dry_run=True)
        return
    with host.lock(toolkit.LOCK):
        plan = toolkit.plan_uninstall(host)
        _print_plan(plan, dry_run=False)
        if plan.changes_nothing:
            return
        confirm(yes, "toolkit uninstall")
        outcome = toolkit.apply_uninstall(host, plan, _progress())
    _print_outcome(outcome)


@app.command("status")
def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Installed versions, the repository files and whose key they trust. Exit 1 when not installed."""
    from gpunode.cli.main import state
    from gpunode.errors import ExitCode
    from gpunode.toolkit import install as toolkit

    current = toolkit.status(state(ctx).host)
    if as_json:
        sys.stdout.write(json.dumps(current.to_json(), indent=2) + "\n")
    else:
        _print_status(current)
    if not current.healthy:
        raise typer.Exit(int(ExitCode.UNHEALTHY))


def _progress() -> Progress:
    from gpunode.toolkit.install import Progress

    return Progress(
        step=lambda n, total, what: typer.echo(f"==> [{n}/{total}] {what}"),
        line=lambda line: typer.echo(f"    {line}"),
    )


def _print_plan(plan: ToolkitPlan, *, dry_run: bool) -> None:
    from gpunode.toolkit import install as toolkit
    from gpunode.toolkit.keys import NVIDIA_FINGERPRINTS

    have = toolkit.consistent_version(plan.installed)
    for warning in plan.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if plan.changes_nothing:
        if have is None:
            typer.echo(
                "nvidia-container-toolkit is not installed and gpunode added no repository files: "
                "nothing to do"
            )
        else:
            typer.echo(
                f"nvidia-container-toolkit {have} is already installed "
                f"({plan.manager.name}, {plan.distribution.pretty}): nothing to do"
            )
        for note in plan.notes:
            typer.echo(f"note: {note}")
        return
    typer.echo(f"{plan.distribution.pretty or plan.distribution.id}: packages through {plan.manager.name}")
    for problem in plan.drift:
        typer.echo(f"repair: {problem}")
    if plan.key is not None:
        whose = "NVIDIA's" if all(f in NVIDIA_FINGERPRINTS for f in plan.key.fingerprints) else "as given"
        typer.echo(f"signing key {', '.join(plan.key.fingerprints)} ({whose}) from {plan.key.source}")
    would = "would " if dry_run else ""
    for planned in plan.files:
        path, content = planned.file.path, planned.file.content
        if not planned.changed:
            typer.echo(f"unchanged {path}")
        elif planned.file.binary:
            verb = "create" if planned.before is None else "replace"
            typer.echo(
                f"{would}{verb} {path} (binary keyring, {len(content)} bytes, mode {planned.file.mode:o})"
            )
        elif planned.before is None:
            typer.echo(f"{would}create {path} (mode {planned.file.mode:o}):")
            typer.echo("".join(f"    {line}\n" for line in content.decode("utf-8").splitlines()), nl=False)
        else:
            typer.echo(f"{would}replace {path} (the original is kept in gpunode's backups):")
            diff = difflib.unified_diff(
                planned.before.decode("utf-8", "replace").splitlines(keepends=True),
                content.decode("utf-8").splitlines(keepends=True),
                fromfile=f"{path} (now)",
                tofile=f"{path} (gpunode)",
            )
            typer.echo("".join(f"    {line}" for line in diff), nl=False)
    for path in plan.remove:
        typer.echo(f"{would}remove {path}")
    for path, backup in plan.restore:
        typer.echo(f"{would}restore {path} from {backup}")
    for command in plan.commands:
        typer.echo(f"{would}run: {command}")
    for note in plan.notes:
        typer.echo(f"note: {note}")
    if dry_run:
        typer.echo("dry run: nothing was changed")


def _print_outcome(outcome: Outcome) -> None:
    for path in outcome.written:
        typer.echo(f"wrote {path}")
    for path in outcome.restored:
        typer.echo(f"restored {path}")
    for path in outcome.removed:
        typer.echo(f"removed {path}")


def _print_status(current: ToolkitStatus) -> None:
    typer.echo(f"distribution: {current.distribution} ({current.manager})")
    if current.version:
        typer.echo(f"nvidia-container-toolkit: {current.version}")
    else:
        typer.echo("nvidia-container-toolkit: not installed (or its packages are at different versions)")
    for package, version in current.installed.items():
        typer.echo(f"  {package}: {version or 'not installed'}")
    for path, present in current.files.items():
        typer.echo(f"{path}: {'present' if present else 'absent'}")
    if current.key_fingerprints:
        whose = "NVIDIA's key" if current.key_trusted else "NOT NVIDIA's key"
        typer.echo(f"signing key: {', '.join(current.key_fingerprints)} ({whose})")
    if current.repo_url:
        typer.echo(f"repository: {current.repo_url}")
    for problem in current.drift:
        typer.echo(f"DRIFT: {problem}")
    if current.drift:
        typer.echo(
            "fix: `sudo gpunode toolkit install` writes the repository files again as gpunode writes them"
        )
