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
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON document (schema gpunode.down/v1): the plan, then each step's result.",
    ),
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
    from dataclasses import replace

    from gpunode.cli.common import refuse_foreign_root
    from gpunode.cli.main import state
    from gpunode.cli.up import run_plan
    from gpunode.down import DownOptions, plan_down

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
    if as_json:
        from gpunode import jsonout

        jsonout.request("down", dry_run=dry_run)
        opts = replace(opts, on_output=None)
    run_plan(
        "down",
        plan_down(host, opts),
        dry_run=dry_run,
        yes=yes,
        as_json=as_json,
        nothing="nothing of gpunode's is left to undo",
        finished="gpunode's changes are undone; `gpunode doctor` shows the node as it is now",
    )
