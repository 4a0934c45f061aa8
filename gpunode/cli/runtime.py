"""`gpunode configure-runtime`: wiring and rendering."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import click

from gpunode.cli.common import Command, checked, complete_runtime, exit_codes
from gpunode.errors import UsageError
from gpunode.runtimes.plan import DEFAULT_RUNTIME_PATH, RUNTIMES, ConfigureOptions

if TYPE_CHECKING:
    from gpunode.host import Host
    from gpunode.runtimes.configure import Outcome
    from gpunode.runtimes.plan import RuntimePlan


def _runtime(name: str) -> None:
    # choose_runtime's own refusal, made while parsing: before kubelet's files are read to pick one.
    if name not in RUNTIMES:
        raise UsageError(f"unknown runtime {name!r}", f"name one of: {', '.join(RUNTIMES)}")


def _options_check(field: str) -> Callable[[str], None]:
    """The check the plan makes (configure.check_options) of one option: runtime_name or runtime_path."""

    def check(value: str) -> None:
        from gpunode.runtimes.configure import check_options

        check_options(ConfigureOptions(**{field: value}))  # type: ignore[arg-type]

    return check


def _host_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # A relative path is the shell's on the real root (made absolute below); under --root it means
    # nothing in DIR, which the plan would refuse only after reading kubelet's files to pick the runtime.
    host = getattr(ctx.find_root().obj, "host", None)  # the root command's (None while completing)
    root = getattr(host, "root", None)
    if value is not None and not value.startswith("/") and host is not None and not host.is_real_root:
        raise click.BadParameter(
            f"{value!r} is not an absolute path; under --root give the path as the system in {root} sees it "
            "(e.g. /etc/containerd/config.toml)",
            ctx=ctx,
            param=param,
        )
    return value


check_runtime = checked(_runtime)  # also `up --runtime`


@click.command(
    "configure-runtime",
    cls=Command,
    epilog=exit_codes(
        "0    configured, reverted or removed (or already so: nothing changed)",
        "1    the restart was not confirmed (nothing changed)",
    ),
)
@click.argument(
    "runtime",
    required=False,
    metavar="[RUNTIME]",
    shell_complete=complete_runtime,
    callback=check_runtime,
)
@click.option(
    "--config",
    metavar="PATH",
    callback=_host_path,
    help="The configuration file. Default: the runtime's standard one (k3s/RKE2/microk8s: the template).",
)
@click.option("--set-as-default", is_flag=True, help="Make it the default runtime.")
@click.option("--cdi", is_flag=True, help="Enable CDI where the runtime supports it.")
@click.option(
    "--runtime-path",
    default=DEFAULT_RUNTIME_PATH,
    show_default=True,
    metavar="PATH",
    callback=checked(_options_check("runtime_path")),
    help="The nvidia-container-runtime binary.",
)
@click.option(
    "--runtime-name",
    default="nvidia",
    show_default=True,
    metavar="NAME",
    callback=checked(_options_check("runtime_name")),
    help="The runtime's name.",
)
@click.option(
    "--drop-in",
    metavar="PATH",
    callback=_host_path,
    help="containerd: put the runtime in this drop-in, imported by the main file. "
    "CRI-O: the drop-in to write (default /etc/crio/crio.conf.d/99-nvidia.toml).",
)
@click.option(
    "--in-place", is_flag=True, help="Edit the main file itself (containerd's default; CRI-O: crio.conf)."
)
@click.option(
    "--effective",
    is_flag=True,
    help="Decide from the runtime's own view of its configuration (containerd: `config dump`; CRI-O: "
    "`crio config`) instead of gpunode's merge of the files, and check the result before writing.",
)
@click.option("--dry-run", is_flag=True, help="Print the diff of every file; change nothing.")
@click.option(
    "--restart/--no-restart",
    default=None,
    help="Restart the runtime and check it came back. Default: on, unless --config points elsewhere.",
)
@click.option(
    "--revert", is_flag=True, help="Put back the configuration as it was before gpunode changed it."
)
@click.option(
    "--remove",
    is_flag=True,
    help="Take the runtime (--runtime-name) out of configuration gpunode did not write; "
    "the default goes back to runc (undo with --revert).",
)
@click.option("--yes", "-y", is_flag=True, help="Restart the runtime without asking (unattended use).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (schema gpunode.configure-runtime/v1): the plan with --dry-run, the "
    "result otherwise; a restart then needs --yes.",
)
@click.pass_context
def configure_runtime(
    ctx: click.Context,
    runtime: str | None,
    config: str | None,
    set_as_default: bool,
    cdi: bool,
    runtime_path: str,
    runtime_name: str,
    drop_in: str | None,
    in_place: bool,
    effective: bool,
    dry_run: bool,
    restart: bool | None,
    revert: bool,
    remove: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Add the NVIDIA runtime to docker, containerd or CRI-O: atomically, with a backup and a way back.

    RUNTIME is docker, containerd or crio. Default: the one kubelet uses, else the one installed.
    """
    from gpunode.cli.state import state
    from gpunode.runtimes import configure, records
    from gpunode.runtimes.plan import ConfigureOptions

    host = state(ctx).host
    if as_json:
        from gpunode import jsonout

        jsonout.request("configure-runtime", dry_run=dry_run)
    if revert and (set_as_default or cdi):
        raise UsageError("--revert undoes what gpunode did; it takes no --set-as-default or --cdi")
    if remove and (revert or set_as_default or cdi or drop_in or in_place):
        raise UsageError(
            "--remove takes the runtime out; it cannot be combined with --revert, --set-as-default, --cdi, "
            "--drop-in or --in-place",
            "run them one after the other",
        )
    opts = ConfigureOptions(
        runtime_name=runtime_name,
        runtime_path=runtime_path,
        set_as_default=set_as_default,
        cdi=cdi,
        config=_absolute(config, host.is_real_root),
        drop_in=_absolute(drop_in, host.is_real_root),
        in_place=in_place,
        effective=effective,
    )
    chosen, why = configure.choose_runtime(host, runtime)
    if why and not as_json:
        click.echo(why)
    hint = ["gpunode"] + ([f"--root {host.root}"] if not host.is_real_root else [])
    hint += ["configure-runtime", chosen, "--revert"]  # the record is per runtime: no file needed
    if dry_run:
        plan = _planner(configure, revert=revert, remove=remove)(host, chosen, opts)
        do_restart = restart if restart is not None else host.is_real_root and plan.standard_location
        restarts = configure.will_restart(host, plan, do_restart)
        plan = _with_restart_note(configure, host, plan, do_restart)
        if as_json:
            _emit_json(host, plan, None, restarts=restarts, dry_run=True, why=why, undo=None)
            return
        _render_plan(plan, dry_run=True)
        if restarts:
            _render_restart(host, plan, dry_run=True)
        return
    with host.lock(records.LOCK):
        plan = _planner(configure, revert=revert, remove=remove)(host, chosen, opts)
        do_restart = restart if restart is not None else host.is_real_root and plan.standard_location
        restarts = configure.will_restart(host, plan, do_restart)
        plan = _with_restart_note(configure, host, plan, do_restart)
        if not as_json:
            _render_plan(plan, dry_run=False)
        if restarts:
            from gpunode.cli.common import confirm
            from gpunode.runtimes import service

            if as_json and not yes:
                raise UsageError(
                    f"restarting {plan.runtime} needs a confirmation, which --json cannot ask for",
                    "add --yes (or --no-restart)",
                )
            if not as_json:
                _render_restart(host, plan, dry_run=False)
            confirm(yes, f"restarting {plan.runtime}", service.disruption(host, plan))
        outcome = configure.apply(host, plan, restart=do_restart)
    if as_json:
        undo = " ".join(hint) if outcome.changed and not plan.revert else None
        _emit_json(host, plan, outcome, restarts=restarts, dry_run=False, why=why, undo=undo)
        return
    _render_outcome(outcome, restarts, " ".join(hint), elsewhere=not host.commands_reach_root)


def _with_restart_note(configure: ModuleType, host: Host, plan: RuntimePlan, asked: bool) -> RuntimePlan:
    from dataclasses import replace

    note = configure.restart_elsewhere(host, plan) if asked else None
    return plan if note is None else replace(plan, messages=(*plan.messages, note))


def _emit_json(
    host: Host,
    plan: RuntimePlan,
    outcome: Outcome | None,
    *,
    restarts: bool,
    dry_run: bool,
    why: str | None,
    undo: str | None,
) -> None:
    from gpunode import jsonout
    from gpunode.runtimes import service

    files = [
        {
            "path": c.path,
            "action": "unchanged" if not c.changed else "remove" if c.after is None else "write",
            "diff": c.diff() if c.changed else "",
        }
        for c in plan.changes
    ]
    commands = service.restart_commands(host, plan) if restarts else []
    doc = jsonout.document(
        "configure-runtime",
        changed=bool(outcome and outcome.changed) or bool(outcome and outcome.restarted),
        dry_run=dry_run,
        runtime=plan.runtime,
        operation="revert" if plan.revert else "remove" if plan.expect is None else "configure",
        chosen_because=why,
        files=files,
        commands=commands,
        restart=service.disruption(host, plan) if restarts else None,
        messages=list(plan.messages),
        backups=outcome.backups if outcome else [],
        verified=outcome.verified if outcome else None,
        restarted=outcome.restarted if outcome else None,
        restart_pending=outcome.restart_pending if outcome else None,
        undo=undo,
        kept=list(plan.kept),
    )
    jsonout.emit(doc)


def _planner(configure: ModuleType, *, revert: bool, remove: bool) -> Callable[..., RuntimePlan]:
    planner: Callable[..., RuntimePlan] = (
        configure.plan_revert if revert else configure.plan_remove if remove else configure.plan_configure
    )
    return planner


def _absolute(path: str | None, real_root: bool) -> str | None:
    # On the real root a relative path means what the shell means; under --root only host paths make sense.
    if path is None or path.startswith("/") or not real_root:
        return path
    return os.path.abspath(path)


def _render_plan(plan: RuntimePlan, *, dry_run: bool) -> None:
    for change in plan.pending:
        sys.stdout.write(change.diff())
    for message in plan.messages:
        click.echo(f"note: {message}")
    for path in plan.kept:
        click.echo(f"kept {path} (not what gpunode wrote: see the note above)")
    if not plan.pending:
        files = ", ".join(c.path for c in plan.changes if c.path not in plan.kept)
        as_before = f" ({files} already as before gpunode)" if files else ""
        click.echo(
            f"{plan.runtime}: nothing to revert{as_before}"
            if plan.revert
            else f"{plan.runtime} is already configured: nothing to change ({files} untouched)"
        )
    elif dry_run:
        click.echo(f"dry run: {len(plan.pending)} file(s) would change; nothing was changed")


def _render_restart(host: Host, plan: RuntimePlan, *, dry_run: bool) -> None:
    from gpunode.runtimes import service

    commands = service.restart_commands(host, plan)
    click.echo(f"{'would run' if dry_run else 'will run'}: {' '.join(commands[0])}")
    click.echo(f"then wait until {plan.runtime} answers: {' '.join(commands[1])}")
    if dry_run:
        click.echo(f"note: {service.disruption(host, plan)}")


def _render_outcome(outcome: Outcome, restarted: bool, revert_hint: str, *, elsewhere: bool) -> None:
    plan = outcome.plan
    for path in outcome.written:
        click.echo(f"{'restored' if plan.revert else 'wrote'} {path}")
    for path in outcome.removed:
        click.echo(f"removed {path}")
    for backup in outcome.backups:
        click.echo(f"the original is kept in {backup}")
    if outcome.verified:
        click.echo(f"verified: {outcome.verified}")
    # A restart is owed only for a file the service reads (standard_location): never for a scratch --config.
    owed = outcome.restart_pending or (outcome.changed and not restarted and plan.standard_location)
    if outcome.restarted:
        click.echo(f"restarted {plan.unit}: {outcome.restarted}")
    elif owed and elsewhere:
        click.echo(
            f"restart {plan.runtime} where these files are the running system's for the change to take "
            f"effect (systemctl restart {plan.unit} there; never run from here under --root)"
        )
    elif owed:
        click.echo(
            f"restart {plan.runtime} for the change to take effect (systemctl restart {plan.unit}, or run "
            "this command again with --restart)"
        )
    if outcome.changed and not plan.revert:
        click.echo(f"undo with: {revert_hint}")
