"""`gpunode down`: wiring and rendering; the steps are in gpunode.down."""

from __future__ import annotations

from typing import Optional

import typer

from gpunode.cli.node import kube_options

_KUBE = kube_options()


def down(
    ctx: typer.Context,
    toolkit: bool = typer.Option(
        False, "--toolkit", help="Also remove nvidia-container-toolkit and its repository files."
    ),
    node: Optional[str] = typer.Option(  # noqa: UP045 (typer reads the annotation at runtime)
        None, "--node", metavar="NAME", help="Node name to withdraw from.", show_default=False
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; change nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (unattended use)."),
    kubeconfig: Optional[str] = _KUBE["kubeconfig"],  # noqa: UP045
    context: Optional[str] = _KUBE["context"],  # noqa: UP045
    server: Optional[str] = _KUBE["server"],  # noqa: UP045
) -> None:
    """Undo `gpunode up` in reverse: plugin service, node capacity and labels, runtime configuration, and
    with --toolkit the toolkit.

    Prints the plan first; only what gpunode recorded doing is undone. Exit 0 when done (or nothing to
    undo), 1 when the confirmation is declined, 2 on bad usage or no terminal without --yes; a failed step
    exits with its own code (see `gpunode --help`).
    """
    from gpunode.cli.common import confirm, refuse_foreign_root
    from gpunode.cli.main import state
    from gpunode.cli.up import print_plan
    from gpunode.down import DownOptions, plan_down
    from gpunode.up import Step, run_steps

    host = state(ctx).host
    refuse_foreign_root(host, dry_run)
    opts = DownOptions(
        toolkit=toolkit,
        node=node,
        kubeconfig=kubeconfig,
        context=context,
        server=server,
        on_output=lambda line: typer.echo(f"    | {line}"),
    )
    steps = plan_down(host, opts)
    print_plan(steps, verbose=dry_run)
    blocked = next((s for s in steps if s.blocked and s.error is not None), None)
    if blocked is not None and blocked.error is not None:
        blocked.error.message = f"step {blocked.name}: {blocked.error.message}; gpunode down changed nothing"
        raise blocked.error
    if not any(s.needed for s in steps):
        typer.echo("nothing of gpunode's is left to undo")
        return
    if dry_run:
        typer.echo("dry run: nothing was changed")
        return
    warnings = [w for s in steps if s.needed for w in s.warnings]
    confirm(yes, "down", "; ".join(warnings) or None)

    def on_step(n: int, total: int, step: Step) -> None:
        typer.echo(f"==> [{n}/{total}] {step.name}: {step.summary}")

    for step, result in run_steps(steps, on_step):
        typer.echo(f"    {step.name}: {result}")
    typer.echo("gpunode's changes are undone; `gpunode doctor` shows the node as it is now")
