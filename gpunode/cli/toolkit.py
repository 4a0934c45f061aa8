"""`gpunode toolkit install|uninstall|status`: wiring and rendering; the work is in gpunode.toolkit."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

import click

from gpunode.cli.common import Group, checked, confirm, exit_codes, refuse_foreign_root
from gpunode.toolkit.managers import DEFAULT_REPO_URL, package_version

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


def _repo_url(url: str) -> None:
    from gpunode.toolkit.install import check_repo_url

    check_repo_url(url)


def _fingerprint(text: str) -> None:
    from gpunode.toolkit.keys import normalize_fingerprint

    normalize_fingerprint(text)


# The checks `toolkit install` makes when it plans, made while parsing (also for `up`'s same options).
check_version = checked(package_version)
check_repo_url = checked(_repo_url)
check_fingerprint = checked(_fingerprint)


@app.command("install", epilog=exit_codes("0    installed (or already so)", _DECLINED))
@click.option(
    "--version",
    metavar="X.Y.Z",
    callback=check_version,
    help="Pin all four packages to this version (default: the newest; an installed one is kept).",
)
@click.option(
    "--repo-url",
    metavar="URL",
    callback=check_repo_url,
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
    callback=check_fingerprint,
    help="Trust the key with this fingerprint instead of NVIDIA's (a mirror signed with its own key).",
)
@click.option("--experimental", is_flag=True, help="Also enable the experimental repository.")
@click.option("--dry-run", is_flag=True, help="Print every file and command; change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (unattended use).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (schema gpunode.toolkit-install/v1): the plan with --dry-run, the result "
    "otherwise; needs --yes to change anything.",
)
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
    as_json: bool,
) -> None:
    """Add NVIDIA's repository (its key checked) and install the toolkit's four packages, pinned together."""
    from gpunode.cli.state import state
    from gpunode.toolkit import install as toolkit

    host = state(ctx).host
    _json_request("toolkit-install", as_json, dry_run)
    refuse_foreign_root(
        host, dry_run, f"this machine's package manager would install the packages here, not in {host.root}"
    )
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
        plan = toolkit.plan_install(host, opts)
        _emit_json("toolkit-install", plan, None, dry_run=True) if as_json else _print_plan(
            plan, dry_run=True
        )
        return
    with host.lock(toolkit.LOCK):
        plan = toolkit.plan_install(host, opts)
        if not as_json:
            _print_plan(plan, dry_run=False)
        if plan.changes_nothing:
            if as_json:
                _emit_json("toolkit-install", plan, None, dry_run=False)
            return
        _confirm_json(as_json, yes)
        confirm(yes, "toolkit install")
        outcome = toolkit.apply_install(host, plan, None if as_json else _progress())
    if as_json:
        _emit_json("toolkit-install", plan, outcome, dry_run=False)
        return
    _print_outcome(outcome)
    click.echo(f"nvidia-container-toolkit {toolkit.consistent_version(outcome.installed)} is installed")
    click.echo("next: gpunode configure-runtime (the packages configure no container runtime themselves)")


@app.command("uninstall", epilog=exit_codes("0    removed (or nothing to remove)", _DECLINED))
@click.option("--dry-run", is_flag=True, help="Print what would be removed; change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (unattended use).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (schema gpunode.toolkit-uninstall/v1); needs --yes to change anything.",
)
@click.pass_context
def uninstall(ctx: click.Context, dry_run: bool, yes: bool, as_json: bool) -> None:
    """Remove the four packages and the repository files `toolkit install` added (nothing else)."""
    from gpunode.cli.state import state
    from gpunode.toolkit import install as toolkit

    host = state(ctx).host
    _json_request("toolkit-uninstall", as_json, dry_run)
    refuse_foreign_root(
        host, dry_run, f"this machine's package manager would remove the packages here, not in {host.root}"
    )
    if not dry_run:
        toolkit.require_root(host, "toolkit uninstall")
    if dry_run:
        plan = toolkit.plan_uninstall(host)
        if as_json:
            _emit_json("toolkit-uninstall", plan, None, dry_run=True)
        else:
            _print_plan(plan, dry_run=True)
        return
    with host.lock(toolkit.LOCK):
        plan = toolkit.plan_uninstall(host)
        if not as_json:
            _print_plan(plan, dry_run=False)
        if plan.changes_nothing:
            if as_json:
                _emit_json("toolkit-uninstall", plan, None, dry_run=False)
            return
        _confirm_json(as_json, yes)
        confirm(yes, "toolkit uninstall")
        outcome = toolkit.apply_uninstall(host, plan, None if as_json else _progress())
    if as_json:
        _emit_json("toolkit-uninstall", plan, outcome, dry_run=False)
        return
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

    if as_json:
        from gpunode import jsonout

        jsonout.request("toolkit-status")
    current = toolkit.status(state(ctx).host)
    if as_json:
        from gpunode import jsonout

        doc = jsonout.document("toolkit-status", changed=False)
        doc.update(current.to_json())
        doc["error"] = doc.pop("error")  # last, as in every document
        jsonout.emit(doc)
    else:
        _print_status(current)
    if not current.healthy:
        raise click.exceptions.Exit(int(ExitCode.UNHEALTHY))


def _json_request(command: str, as_json: bool, dry_run: bool) -> None:
    if as_json:
        from gpunode import jsonout

        jsonout.request(command, dry_run=dry_run)


def _confirm_json(as_json: bool, yes: bool) -> None:
    from gpunode.errors import UsageError

    if as_json and not yes:
        raise UsageError(
            "changing the packages needs a confirmation, which --json cannot ask for", "add --yes"
        )


def _emit_json(command: str, plan: ToolkitPlan, outcome: Outcome | None, *, dry_run: bool) -> None:
    """The plan (files, their diffs, every command) and, after a run, what was done: one document."""
    from gpunode import jsonout
    from gpunode.toolkit import install as toolkit

    files: list[dict[str, str | None]] = []
    for planned in plan.files:
        path, content = planned.file.path, planned.file.content
        action = "unchanged" if not planned.changed else "write"
        if planned.file.binary or not planned.changed:
            diff = ""
        else:
            diff = "".join(
                difflib.unified_diff(
                    []
                    if planned.before is None
                    else planned.before.decode("utf-8", "replace").splitlines(True),
                    content.decode("utf-8").splitlines(keepends=True),
                    fromfile="/dev/null" if planned.before is None else f"a{path}",
                    tofile=f"b{path}",
                )
            )
        files.append({"path": path, "action": action, "diff": diff, "mode": f"{planned.file.mode:o}"})
    files += [{"path": p, "action": "remove", "diff": "", "mode": None} for p in plan.remove]
    files += [{"path": p, "action": "restore", "diff": "", "mode": None} for p, _ in plan.restore]
    installed = outcome.installed if outcome is not None else plan.installed
    doc = jsonout.document(
        command,
        changed=outcome is not None and not plan.changes_nothing,
        dry_run=dry_run,
        distribution=plan.distribution.pretty or plan.distribution.id,
        package_manager=plan.manager.name,
        packages=dict(installed),
        version=toolkit.consistent_version(installed),
        wanted=plan.wanted,
        key_fingerprints=list(plan.key.fingerprints) if plan.key is not None else [],
        files=files,
        commands=[{"argv": list(c.argv), "env": dict(c.env), "title": c.title} for c in plan.commands],
        drift=list(plan.drift),
        warnings=list(plan.warnings),
        notes=list(plan.notes),
    )
    jsonout.emit(doc)


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
