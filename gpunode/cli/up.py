"""`gpunode up`: wiring and rendering; the steps are in gpunode.up."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpunode.cli.common import Command, complete_runtime, complete_simulate, exit_codes
from gpunode.cli.node import check_node, kube_options
from gpunode.cli.runtime import check_runtime
from gpunode.cli.toolkit import check_fingerprint, check_repo_url, check_version

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpunode.host import Host
    from gpunode.nvml.model import Inventory
    from gpunode.up import Step


@click.command(
    "up",
    cls=Command,
    epilog=exit_codes(
        "0    the node is set up (or already was: nothing changed)",
        "1    preflight found the node not ready, or the confirmation was declined (nothing changed)",
    ),
)
@click.option(
    "--toolkit-version", metavar="X.Y.Z", callback=check_version, help="Pin nvidia-container-toolkit."
)
@click.option("--repo-url", metavar="URL", callback=check_repo_url, help="Mirror of NVIDIA's repositories.")
@click.option("--key-file", metavar="PATH", help="The repositories' signing key, from a file.")
@click.option(
    "--key-fingerprint", metavar="FPR", callback=check_fingerprint, help="Trust this key instead of NVIDIA's."
)
@click.option(
    "--runtime",
    metavar="RUNTIME",
    shell_complete=complete_runtime,
    callback=check_runtime,
    help="Container runtime to configure: docker, containerd or crio (default: the one kubelet uses).",
)
@click.option("--plugin-config", metavar="FILE", help="Device plugin TOML config to install.")
@click.option("--labels/--no-labels", default=True, help="Set the GPU labels (needs API credentials).")
@click.option("--node", metavar="NAME", callback=check_node, help="Node name for the labels.")
@click.option(
    "--cdi",
    is_flag=True,
    help="Also turn CDI on in the runtime and write gpunode's CDI spec, kept true (`gpunode cdi install`).",
)
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (unattended use).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (schema gpunode.up/v1): the plan, then each step's result.",
)
@click.option(
    "--simulate",
    metavar="NAME",
    shell_complete=complete_simulate,
    help="Plan for a built-in simulated node's driver and GPUs (dgx-a100, pcie-4, pairs-4, mig, h100, ...) "
    "instead of NVML's; the rest is this host's. Needs --dry-run.",
)
@kube_options
@click.pass_context
def up(
    ctx: click.Context,
    toolkit_version: str | None,
    repo_url: str | None,
    key_file: str | None,
    key_fingerprint: str | None,
    runtime: str | None,
    plugin_config: str | None,
    labels: bool,
    node: str | None,
    cdi: bool,
    dry_run: bool,
    yes: bool,
    as_json: bool,
    kubeconfig: str | None,
    context: str | None,
    server: str | None,
    request_timeout: float | None,
    simulate: str | None,
) -> None:
    """Make this a working GPU node: preflight, toolkit, container runtime, device plugin, labels.

    Idempotent: prints the plan first, then each step's result; a configured node changes nothing.
    A failed step stops it with that step's exit status, naming the steps not done.
    """
    from dataclasses import replace

    from gpunode.cli.common import refuse_foreign_root
    from gpunode.cli.state import state
    from gpunode.cli.waitline import WaitLine
    from gpunode.errors import ExitCode, GpunodeError
    from gpunode.up import UpOptions, plan_up

    if as_json:
        from gpunode import jsonout

        jsonout.request("up", dry_run=dry_run)
    discover = _discover(simulate, dry_run)
    host = state(ctx).host
    refuse_foreign_root(
        host,
        dry_run,
        "its toolkit step installs nvidia-container-toolkit, and this machine's package manager would "
        f"install it here, not in {host.root}",
    )
    opts = UpOptions(
        toolkit_version=toolkit_version,
        repo_url=repo_url,
        key_file=key_file,
        key_fingerprint=key_fingerprint,
        runtime=runtime,
        plugin_config=plugin_config,
        labels=labels,
        node=node,
        kubeconfig=kubeconfig,
        context=context,
        server=server,
        request_timeout=request_timeout,
        cdi=cdi,
        simulate=simulate,
        on_output=lambda line: click.echo(f"    | {line}"),
    )
    if as_json:
        opts = replace(opts, on_output=None)  # the package manager's lines would break the document
    if simulate and not as_json:
        click.echo(
            f"simulated node {simulate}: its driver and GPUs stand in for NVML's; the rest is this host's"
        )
    # The plugin step waits up to 120 s for the service to register: its progress goes to stderr (never
    # into the --json document), cleared before the step's result or an error is printed.
    waiting = WaitLine()
    opts = replace(opts, on_wait=waiting)
    steps = plan_up(host, opts, discover)
    blocked = next((s for s in steps if s.blocked), None)
    if blocked is not None and blocked.error is None:
        blocked.error = GpunodeError(
            blocked.blocked or "preflight failed",  # never empty here: the step was picked for it
            blocked.fix or "run `gpunode doctor` for the details",
            exit_code=ExitCode.UNHEALTHY,
        )
    with waiting:
        run_plan(
            "up",
            steps,
            dry_run=dry_run,
            yes=yes,
            as_json=as_json,
            nothing="the node is already set up: nothing to change",
            finished="the node is set up; `gpunode doctor` checks it",
        )


def _discover(simulate: str | None, dry_run: bool) -> Callable[[Host], Inventory]:
    """NVML's discovery, or the simulated node's (a usage error, said first, unless it is a dry run)."""
    if simulate is None:
        from gpunode.nvml.discovery import discover

        return discover
    from gpunode.doctor import simulated_discover
    from gpunode.errors import UsageError
    from gpunode.plugin.simulate import check_profile

    check_profile(simulate)
    if not dry_run:
        raise UsageError(
            "--simulate plans for a node that is not this one: gpunode up never applies that plan",
            "add --dry-run to see it",
        )
    return simulated_discover(simulate)


def run_plan(
    command: str,
    steps: list[Step],
    *,
    dry_run: bool,
    yes: bool,
    as_json: bool,
    nothing: str,
    finished: str,
) -> None:
    """The flow `up` and `down` share: print the plan (or keep it for the JSON document), stop at a step
    that cannot be planned, stop after a dry run, ask (--yes), run the steps in order."""
    from gpunode import jsonout
    from gpunode.cli.common import confirm
    from gpunode.errors import UsageError
    from gpunode.up import run_steps

    if not as_json:
        print_plan(steps, verbose=dry_run)
    else:
        jsonout.update(steps=[_step_json(s) for s in steps])
    blocked = next((s for s in steps if s.blocked and s.error is not None), None)
    if blocked is not None and blocked.error is not None:
        blocked.error.message = (
            f"step {blocked.name}: {blocked.error.message}; gpunode {command} changed nothing"
        )
        raise blocked.error
    needed = any(s.needed for s in steps)
    if not needed or dry_run:
        if as_json:
            doc = jsonout.document(
                command, changed=False, dry_run=dry_run, steps=[_step_json(s) for s in steps]
            )
            jsonout.emit(doc)
        else:
            click.echo(nothing if not needed else "dry run: nothing was changed")
        return
    warnings = [w for s in steps if s.needed for w in s.warnings]
    if as_json and not yes:
        raise UsageError(
            f"gpunode {command} asks before it changes the node, which --json cannot", "add --yes"
        )
    confirm(yes, command, None if as_json else "; ".join(warnings) or None)  # the document carries them
    results: dict[str, str] = {}

    def on_step(n: int, total: int, step: Step) -> None:
        if as_json:
            jsonout.update(steps=[_step_json(s, results.get(s.name)) for s in steps])
        else:
            click.echo(f"==> [{n}/{total}] {step.name}: {step.summary}")

    # Each step's apply plans it again itself, just before it runs (an earlier step may have changed what
    # it sees), so the plan printed above is not re-made here.
    for step, result in run_steps(steps, on_step):
        results[step.name] = result
        if not as_json:
            click.echo(f"    {step.name}: {result}")
    if as_json:
        doc = jsonout.document(
            command, changed=True, dry_run=False, steps=[_step_json(s, results.get(s.name)) for s in steps]
        )
        jsonout.emit(doc)
    else:
        click.echo(finished)


def _step_json(step: Step, result: str | None = None) -> dict[str, object]:
    status = "blocked" if step.blocked else "to do" if step.needed else "skipped" if step.skipped else "done"
    if result is not None:
        status = "done now"
    return {
        "name": step.name,
        "status": status,
        "summary": step.summary,
        "details": step.details,
        "warnings": step.warnings,
        "fix": step.fix,
        "result": result,
    }


def print_plan(steps: list[Step], *, verbose: bool) -> None:
    click.echo("plan:")
    for step in steps:
        mark = (
            "blocked" if step.blocked else "to do" if step.needed else "skipped" if step.skipped else "done"
        )
        click.echo(f"  [{mark:>7}] {step.name}: {step.summary}")
        if verbose:
            for line in step.details:
                click.echo(
                    "".join(f"            {text}\n" for text in line.rstrip("\n").splitlines()), nl=False
                )
        if step.fix and (step.blocked or not step.needed):
            click.echo(f"            fix: {step.fix}")
