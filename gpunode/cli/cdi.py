"""`gpunode cdi generate | list | check | install`: wiring and rendering; the work is in gpunode.cdi."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from gpunode.cli.common import Group, complete_simulate, exit_codes
from gpunode.errors import ExitCode

if TYPE_CHECKING:
    from gpunode.cdi.generate import GenerateOptions
    from gpunode.host import Host
    from gpunode.nvml.model import Inventory

F = TypeVar("F", bound=Callable[..., Any])


@click.group(
    "cdi",
    cls=Group,
    help="The CDI (Container Device Interface) spec of this node's GPUs: generate it, list what the "
    "runtimes see, check it is current.",
    epilog=exit_codes("0    done; each command's --help lists what else it exits with"),
)
def app() -> None:
    pass


def _check_kind(ctx: click.Context, param: click.Parameter, value: str) -> str:
    # In the option's callback: a bad value is a usage error said before NVML or a file is looked at.
    from gpunode.cdi.spec import kind_problem

    problem = kind_problem(value)
    if problem:
        raise click.BadParameter(problem if "e.g." in problem else f"{problem} (e.g. nvidia.com/gpu)")
    return value


def _check_absolute(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.startswith("/"):
        raise click.BadParameter(f"{value!r} is not an absolute path")
    return value


def _spec_options(func: F) -> F:
    for option in reversed(
        (
            click.option(
                "--kind",
                default="nvidia.com/gpu",
                show_default=True,
                metavar="VENDOR/CLASS",
                callback=_check_kind,
                help="The CDI kind: devices are named VENDOR/CLASS=<name>.",
            ),
            click.option(
                "--driver-root",
                default="/",
                show_default=True,
                metavar="DIR",
                callback=_check_absolute,
                help="Where the driver's files are (a driver container: /run/nvidia/driver).",
            ),
            click.option(
                "--dev-root",
                metavar="DIR",
                callback=_check_absolute,
                help="Where the driver's /dev is. Default: the driver root.",
            ),
            click.option(
                "--output",
                metavar="PATH",
                callback=_check_absolute,
                help="The spec file (.yaml or .json). Default: /var/run/cdi/gpunode-<vendor>-<class>.yaml.",
            ),
        )
    ):
        func = option(func)
    return func


def _options(
    kind: str, driver_root: str, dev_root: str | None, output: str | None, hook_program: str | None = None
) -> GenerateOptions:
    from gpunode.cdi.generate import GenerateOptions
    from gpunode.errors import UsageError

    for name, value in (("--driver-root", driver_root), ("--dev-root", dev_root), ("--output", output)):
        if value is not None and not value.startswith("/"):
            raise UsageError(f"{name} {value!r} is not an absolute path", f"give {name} as an absolute path")
    return GenerateOptions(
        kind=kind,
        driver_root=driver_root.rstrip("/") or "/",
        dev_root=(dev_root.rstrip("/") or "/") if dev_root else None,
        output=output,
        hook_program=hook_program,
    )


def _simulate_usage(simulate: str, dry_run: bool) -> None:
    from gpunode.errors import UsageError
    from gpunode.plugin.simulate import check_profile

    check_profile(simulate)
    # Refused rather than implied: a command that writes without --dry-run must not quietly not write.
    if not dry_run:
        raise UsageError(
            "--simulate makes the spec of a node that is not this one: it is never written",
            "add --dry-run to print it",
        )


def _simulated_inventory(name: str) -> Inventory:
    from gpunode.plugin.simulate import simulated_inventory

    return simulated_inventory(name)


def _inventory(host: Host) -> Inventory:
    from gpunode.nvml import discover

    return discover(host)


@app.command(
    "generate",
    epilog=exit_codes(
        "0    written (or already current: the file is left untouched)",
        "3    the output holds a file gpunode did not write (another tool's spec): see --force",
        "4    the output is a link out of its directory, or not a regular file: never written",
        "6    a device node or the driver's libraries were not found, or a device node is not the device "
        "its name says (a link, another major or minor)",
        "7    NVML cannot be used",
    ),
)
@_spec_options
@click.option(
    "--force",
    is_flag=True,
    help="Replace a file at the output that gpunode did not write (another tool's spec), after copying it "
    "to /var/lib/gpunode/backup/cdi/. Never writes through a link out of the spec directory.",
)
@click.option(
    "--hook-program",
    metavar="PATH",
    help="The ldcache hook's program (nvidia-cdi-hook or nvidia-ctk). Default: found on PATH.",
)
@click.option("--dry-run", is_flag=True, help="Print the spec; write nothing.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (schema gpunode.cdi-generate/v1) with the devices and the spec.",
)
@click.option(
    "--simulate",
    metavar="NAME",
    shell_complete=complete_simulate,
    help="The spec of a built-in simulated node (dgx-a100, pcie-4, pairs-4, mig, h100, ...) instead of "
    "NVML's GPUs, with the device nodes and driver files a real node of its shape has, unchecked. Needs "
    "--dry-run: a simulated spec is never written.",
)
@click.pass_context
def generate(
    ctx: click.Context,
    kind: str,
    driver_root: str,
    dev_root: str | None,
    output: str | None,
    force: bool,
    hook_program: str | None,
    dry_run: bool,
    as_json: bool,
    simulate: str | None,
) -> None:
    """Write the CDI spec of this node's GPUs, from NVML: each GPU by index and UUID, each MIG device as
    <gpu>:<mig> and by UUID, and `all`; a spec that is already current is not rewritten."""
    from dataclasses import replace

    from gpunode import jsonout
    from gpunode.cdi.generate import check_writable, write_spec_file
    from gpunode.cdi.generate import generate as make_spec
    from gpunode.cli.state import state
    from gpunode.errors import NotFound

    if as_json:
        jsonout.request("cdi-generate", dry_run=dry_run)
    if simulate is not None:
        _simulate_usage(simulate, dry_run)
    host = state(ctx).host
    options = replace(_options(kind, driver_root, dev_root, output, hook_program), simulate=simulate)
    inventory = _simulated_inventory(simulate) if simulate else _inventory(host)
    generated = make_spec(host, inventory, options)
    if not generated.spec["devices"]:
        raise NotFound(
            "NVML reports no usable GPU: there is nothing to put in a CDI spec",
            "check `nvidia-smi` and `gpunode doctor`",
        )
    if simulate:
        written = None  # never written, so what is at the output now does not matter
    elif dry_run:
        check_writable(host, generated, force=force)  # a dry run refuses what the run would refuse
        written = None
    else:
        written = write_spec_file(host, generated, force=force)
    changed = written is not None and written.changed
    if as_json:
        jsonout.emit(
            jsonout.document(
                "cdi-generate",
                changed=changed,
                dry_run=dry_run,
                path=generated.path,
                format=generated.fmt,
                kind=generated.spec["kind"],
                cdi_version=generated.spec["cdiVersion"],
                driver_version=generated.driver_version,
                gpus=generated.gpus,
                mig_devices=generated.mig_devices,
                devices=generated.qualified_names,
                warnings=list(generated.warnings),
                spec=generated.spec,
                simulated=simulate,
            )
        )
        return
    for warning in generated.warnings:
        click.echo(f"warning: {warning}", err=True)
    if written is not None and written.backup is not None:
        click.echo(f"note: the file gpunode replaced is kept in {written.backup}", err=True)
    if dry_run:
        sys.stdout.write(generated.text)
        return
    what = "written" if changed else "already current, left as it is"
    click.echo(
        f"{generated.path}: {what} ({len(generated.spec['devices'])} devices of {generated.spec['kind']}: "
        f"{generated.gpus} GPUs, {generated.mig_devices} MIG devices; driver {generated.driver_version}; "
        f"cdiVersion {generated.spec['cdiVersion']})"
    )


@app.command("list", epilog=exit_codes("0    listed (a conflict is shown, not an error)"))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.cdi-list/v1).")
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """The CDI devices the node's runtimes see, from /etc/cdi and /var/run/cdi, with the file each comes
    from; a device shadowed by a later directory or in conflict (dropped by the runtime) says so."""
    from gpunode import jsonout
    from gpunode.cdi.registry import list_devices, read_specs
    from gpunode.cli.state import state

    if as_json:
        jsonout.request("cdi-list")
    host = state(ctx).host
    files = read_specs(host)
    devices = list_devices(files)
    if as_json:
        jsonout.emit(
            jsonout.document(
                "cdi-list",
                changed=False,
                devices=[
                    {"name": d.name, "file": d.path, "state": d.state, "detail": d.detail} for d in devices
                ],
                files=[
                    {"path": f.path, "kind": f.kind, "devices": len(f.devices), "problems": list(f.problems)}
                    for f in files
                ],
            )
        )
        return
    if not files:
        click.echo("no CDI spec in /etc/cdi or /var/run/cdi (`gpunode cdi generate` writes one)")
        return
    width = max((len(d.name) for d in devices), default=0)
    for d in devices:
        note = "" if d.state == "ok" else f"  [{d.state}: {d.detail}]"
        click.echo(f"{d.name:<{width}}  {d.path}{note}")
    for f in files:
        if f.problems:
            click.echo(f"{f.path}: ignored by the runtimes: {'; '.join(f.problems)}")


@app.command(
    "check",
    epilog=exit_codes(
        "0    the spec is present, current and usable (warnings do not fail)", "1    a check failed"
    ),
)
@_spec_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.cdi-check/v1)."
)
@click.pass_context
def check(
    ctx: click.Context, kind: str, driver_root: str, dev_root: str | None, output: str | None, as_json: bool
) -> None:
    """Is gpunode's CDI spec there, true to the GPUs, MIG devices and driver NVML reports now, its device
    nodes and files present, alone in the spec directories, and CDI on in each runtime? Each failure has a
    fix."""
    from gpunode import jsonout
    from gpunode.cdi.check import check_cdi
    from gpunode.cli.doctor import render, render_plain
    from gpunode.cli.state import state
    from gpunode.doctor.model import Report
    from gpunode.errors import NvmlError

    if as_json:
        jsonout.request("cdi-check")
    app_state = state(ctx)
    host = app_state.host
    options = _options(kind, driver_root, dev_root, output)
    found: list[Inventory | NvmlError] = []

    def inventory() -> Inventory | NvmlError:
        if not found:
            try:
                found.append(_inventory(host))
            except NvmlError as err:
                found.append(err)
        return found[0]

    report = Report(tuple(check_cdi(host, inventory, options)))
    if as_json:
        jsonout.emit(
            jsonout.document(
                "cdi-check",
                changed=False,
                path=options.path,
                healthy=report.healthy,
                counts=report.counts(),
                checks=[f.to_json() for f in report.findings],
            )
        )
    elif sys.stdout.isatty():
        render(report, color=app_state.color)
    else:
        sys.stdout.write(render_plain(report))
    raise click.exceptions.Exit(int(ExitCode.OK if report.healthy else ExitCode.UNHEALTHY))


@app.command(
    "install",
    epilog=exit_codes("0    installed (or already so)", "8    systemctl failed"),
)
@_spec_options
@click.option(
    "--keep-envvar",
    is_flag=True,
    help="Leave nvidia-container-runtime honouring NVIDIA_VISIBLE_DEVICES from unprivileged containers.",
)
@click.option("--dry-run", is_flag=True, help="Print the units and changes; change nothing.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.cdi-install/v1)."
)
@click.pass_context
def install(
    ctx: click.Context,
    kind: str,
    driver_root: str,
    dev_root: str | None,
    output: str | None,
    keep_envvar: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Keep the spec true: a boot-time oneshot (gpunode-cdi.service) and a path unit that regenerates it when
    the driver's libraries change (gpunode-cdi.path); and stop unprivileged containers from selecting GPUs
    with NVIDIA_VISIBLE_DEVICES."""
    from gpunode.cdi.install import apply_install, plan_install
    from gpunode.cli.state import state
    from gpunode.systemd.service import gpunode_executable

    host = state(ctx).host
    if as_json:
        from gpunode import jsonout

        jsonout.request("cdi-install", dry_run=dry_run)
    options = _options(kind, driver_root, dev_root, output)
    plan = plan_install(host, options, gpunode_executable(), restrict_envvar=not keep_envvar)
    if as_json:
        from gpunode import jsonout

        if not dry_run:
            apply_install(host, plan)
        files = [
            {"path": c.path, "action": "write" if c.changed else "unchanged", "content": c.content}
            for c in plan.files
        ]
        doc = jsonout.document(
            "cdi-install",
            changed=plan.changed and not dry_run,
            dry_run=dry_run,
            files=files,
            commands=[list(c) for c in plan.commands],
            notes=list(plan.notes),
            links=[link.to_json() for link in plan.links],
            next_steps=[list(c) for c in plan.next_steps],
        )
        jsonout.emit(doc)
        return
    for change in plan.files:
        state_word = "unchanged" if not change.changed else ("new" if change.old is None else "changed")
        click.echo(f"{change.path}: {state_word}")
        if dry_run and change.changed:
            click.echo(change.content)
    for note in plan.notes:
        click.echo(f"note: {note}")
    if dry_run:
        for argv in plan.commands:
            click.echo(f"would run: {' '.join(argv)}")
        _print_links(host, plan.links, plan.next_steps, done=False)
        return
    apply_install(host, plan)
    _print_links(host, plan.links, plan.next_steps, done=True)
    click.echo("installed: the spec is regenerated at boot and when the driver's libraries change")


def _print_links(host: Host, links: Any, next_steps: Any, *, done: bool) -> None:
    from gpunode.systemd.enable import describe

    for line in describe(str(host.root), links, next_steps, done=done):
        click.echo(line)


@app.command(
    "uninstall",
    epilog=exit_codes("0    removed (or nothing of gpunode's to remove)", "8    systemctl failed"),
)
@_spec_options
@click.option("--dry-run", is_flag=True, help="Print what would be removed or put back; change nothing.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.cdi-uninstall/v1)."
)
@click.pass_context
def uninstall(
    ctx: click.Context,
    kind: str,
    driver_root: str,
    dev_root: str | None,
    output: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Undo `cdi install` and `cdi generate`: stop and remove gpunode's units and spec, and put the toolkit's
    NVIDIA_VISIBLE_DEVICES setting back (only files gpunode wrote, only while unchanged)."""
    from gpunode.cdi.install import apply_uninstall, plan_uninstall
    from gpunode.cli.state import state

    host = state(ctx).host
    if as_json:
        from gpunode import jsonout

        jsonout.request("cdi-uninstall", dry_run=dry_run)
    plan = plan_uninstall(host, _options(kind, driver_root, dev_root, output))
    if as_json:
        from gpunode import jsonout

        if not dry_run and not plan.changes_nothing:
            apply_uninstall(host, plan)
        doc = jsonout.document(
            "cdi-uninstall",
            changed=not plan.changes_nothing and not dry_run,
            dry_run=dry_run,
            remove=list(plan.remove),
            restore=[p for p, _ in plan.restore],
            commands=[list(c) for c in plan.commands],
            notes=list(plan.notes),
            links=[link.to_json() for link in plan.links],
            next_steps=[list(c) for c in plan.next_steps],
        )
        jsonout.emit(doc)
        return
    would = "would " if dry_run else ""
    for path in plan.remove:
        click.echo(f"{would}remove {path}")
    for path, _ in plan.restore:
        click.echo(f"{would}put back {path} (as it was before `gpunode cdi install`)")
    for argv in plan.commands:
        click.echo(f"{would}run: {' '.join(argv)}")
    for note in plan.notes:
        click.echo(f"note: {note}")
    if plan.changes_nothing:
        click.echo("nothing of gpunode's CDI setup is here: nothing to do")
        return
    if not dry_run:
        apply_uninstall(host, plan)
    _print_links(host, plan.links, plan.next_steps, done=not dry_run)
