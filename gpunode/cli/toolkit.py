"""`gpunode toolkit install|uninstall|status`: wiring and rendering; the work is in gpunode.toolkit."""

from __future__ import annotations

import difflib
import json
import sys
from typing import TYPE_CHECKING

import click

from gpunode.cli.common import Group, confirm, exit_codes, refuse_foreign_root
from gpunode.toolkit.managers import DEFAULT_REPO_URL

if TYPE_CHECKING:
    from gpunode.toolkit.install import Outcome, Progress, ToolkitPlan, ToolkitStatus


@click.group(
    "toolkit",
    cls=Group,
    help="Install nvidia-container-toolkit from NVIDIA's signed repositories (apt, dnf/yum, zypper).",
    epilog=exit_codes("0    done; each command's --help lists what else it exits with"),
)
def app() -> None:
    pass


_DECLINED = "1    the confirmation was declined (nothing changed)"


@app.command("install", epilog=exit_codes("0    installed (or already so)", _DECLINED))
@click.option(
    "--version",
    metavar="X.Y.Z",
    help="Pin all four packages to this version (default: the newest; an installed one is kept).",
)
@click.option(
    "--repo-url",
    metavar="URL",
    help="The repositories' base URL: a mirror for air-gapped nodes (default: the one the last install "
    f"used, else {DEFAULT_REPO_URL}).",
)
@click.option(
    "--key-file",
    metavar="PATH",
    help="Read the signing key from this file instead of downloading URL/gpgkey.",
)
@click.option(
    "--key-fingerprint",
    metavar="FPR",
    help="Trust the key with this fingerprint instead of NVIDIA's (a mirror signed with its own key).",
)
@click.option("--experimental", is_flag=True, help="Also enable the experimental repository.")
@click.option("--dry-run", is_flag=True, help="Print every file and command; change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (unattended use).")
@click.pass_context
def install(
    ctx: click.Context,
    version: str | None,
    repo_url: str | None,
    key_file: str | None,
    key_fingerprint: str | None,
    experimental: bool,
    dry_run: bool,
    yes: bool,
) -> None:
    """Add NVIDIA's repository (its key checked) and install the toolkit's four packages, pinned together."""
    from gpunode.cli.state import state
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
    click.echo(f"nvidia-container-toolkit {toolkit.consistent_version(outcome.installed)} is installed")
    click.echo("next: gpunode configure-runtime (the packages configure no container runtime themselves)")


@app.command("uninstall", epilog=exit_codes("0    removed (or nothing to remove)", _DECLINED))
@click.option("--dry-run", is_flag=True, help="Print what would be removed; change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (unattended use).")
@click.pass_context
def uninstall(ctx: click.Context, dry_run: bool, yes: bool) -> None:
    """Remove the four packages and the repository files `toolkit install` added (nothing else)."""
    from gpunode.cli.state import state
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


@app.command(
    "status",
    epilog=exit_codes(
        "0    installed, all four packages at one version, repository files as gpunode wrote them",
        "1    not installed, or drift",
    ),
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Installed versions, the repository files and whose key they trust. Exit 1 when not installed."""
    from gpunode.cli.state import state
    from gpunode.errors import ExitCode
    from gpunode.toolkit import install as toolkit

    current = toolkit.status(state(ctx).host)
    if as_json:
        sys.stdout.write(json.dumps(current.to_json(), indent=2) + "\n")
    else:
        _print_status(current)
    if not current.healthy:
        raise click.exceptions.Exit(int(ExitCode.UNHEALTHY))


def _progress() -> Progress:
    from gpunode.toolkit.install import Progress

    return Progress(
        step=lambda n, total, what: click.echo(f"==> [{n}/{total}] {what}"),
        line=lambda line: click.echo(f"    {line}"),
    )


def _print_plan(plan: ToolkitPlan, *, dry_run: bool) -> None:
    from gpunode.toolkit import install as toolkit
    from gpunode.toolkit.keys import NVIDIA_FINGERPRINTS

    have = toolkit.consistent_version(plan.installed)
    for warning in plan.warnings:
        click.echo(f"warning: {warning}", err=True)
    if plan.changes_nothing:
        if have is None:
            click.echo(
                "nvidia-container-toolkit is not installed and gpunode added no repository files: "
                "nothing to do"
            )
        else:
            click.echo(
                f"nvidia-container-toolkit {have} is already installed "
                f"({plan.manager.name}, {plan.distribution.pretty}): nothing to do"
            )
        for note in plan.notes:
            click.echo(f"note: {note}")
        return
    click.echo(f"{plan.distribution.pretty or plan.distribution.id}: packages through {plan.manager.name}")
    for problem in plan.drift:
        click.echo(f"repair: {problem}")
    if plan.key is not None:
        whose = "NVIDIA's" if all(f in NVIDIA_FINGERPRINTS for f in plan.key.fingerprints) else "as given"
        click.echo(f"signing key {', '.join(plan.key.fingerprints)} ({whose}) from {plan.key.source}")
    would = "would " if dry_run else ""
    for planned in plan.files:
        path, content = planned.file.path, planned.file.content
        if not planned.changed:
            click.echo(f"unchanged {path}")
        elif planned.file.binary:
            verb = "create" if planned.before is None else "replace"
            click.echo(
                f"{would}{verb} {path} (binary keyring, {len(content)} bytes, mode {planned.file.mode:o})"
            )
        elif planned.before is None:
            click.echo(f"{would}create {path} (mode {planned.file.mode:o}):")
            click.echo("".join(f"    {line}\n" for line in content.decode("utf-8").splitlines()), nl=False)
        else:
            click.echo(f"{would}replace {path} (the original is kept in gpunode's backups):")
            diff = difflib.unified_diff(
                planned.before.decode("utf-8", "replace").splitlines(keepends=True),
                content.decode("utf-8").splitlines(keepends=True),
                fromfile=f"{path} (now)",
                tofile=f"{path} (gpunode)",
            )
            click.echo("".join(f"    {line}" for line in diff), nl=False)
    for path in plan.remove:
        click.echo(f"{would}remove {path}")
    for path, backup in plan.restore:
        click.echo(f"{would}restore {path} from {backup}")
    for command in plan.commands:
        click.echo(f"{would}run: {command}")
    for note in plan.notes:
        click.echo(f"note: {note}")
    if dry_run:
        click.echo("dry run: nothing was changed")


def _print_outcome(outcome: Outcome) -> None:
    for path in outcome.written:
        click.echo(f"wrote {path}")
    for path in outcome.restored:
        click.echo(f"restored {path}")
    for path in outcome.removed:
        click.echo(f"removed {path}")


def _print_status(current: ToolkitStatus) -> None:
    click.echo(f"distribution: {current.distribution} ({current.manager})")
    if current.version:
        click.echo(f"nvidia-container-toolkit: {current.version}")
    else:
        click.echo("nvidia-container-toolkit: not installed (or its packages are at different versions)")
    for package, version in current.installed.items():
        click.echo(f"  {package}: {version or 'not installed'}")
    for path, present in current.files.items():
        click.echo(f"{path}: {'present' if present else 'absent'}")
    if current.key_fingerprints:
        whose = "NVIDIA's key" if current.key_trusted else "NOT NVIDIA's key"
        click.echo(f"signing key: {', '.join(current.key_fingerprints)} ({whose})")
    if current.repo_url:
        click.echo(f"repository: {current.repo_url}")
    for problem in current.drift:
        click.echo(f"DRIFT: {problem}")
    if current.drift:
        click.echo(
            "fix: `sudo gpunode toolkit install` writes the repository files again as gpunode writes them"
        )
