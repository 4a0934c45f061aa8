"""`gpunode down`: wiring and rendering; the steps are in gpunode.down."""

from __future__ import annotations

import click

from gpunode.cli.common import Command, exit_codes
from gpunode.cli.node import check_node, kube_options


@click.command(
    "down",
    cls=Command,
    epilog=exit_codes(
        "0    done (or nothing of gpunode's to undo)",
        "1    the confirmation was declined (nothing changed)",
    ),
)
@click.option(
    "--toolkit", is_flag=True, help="Also remove nvidia-container-toolkit and its repository files."
)
@click.option("--node", metavar="NAME", callback=check_node, help="Node name to withdraw from.")
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (unattended use).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (schema gpunode.down/v1): the plan, then each step's result.",
)
@kube_options
@click.pass_context
def down(
    ctx: click.Context,
    toolkit: bool,
    node: str | None,
    dry_run: bool,
    yes: bool,
    as_json: bool,
    kubeconfig: str | None,
    context: str | None,
    server: str | None,
    request_timeout: float | None,
) -> None:
    """Undo `gpunode up` in reverse: plugin service, node capacity and labels, runtime configuration, and
    with --toolkit the toolkit.

    Prints the plan first; only what gpunode recorded doing is undone. Without a terminal it needs --yes.
    A failed step stops it with that step's exit status.
    """
    from dataclasses import replace

    from gpunode.cli.common import refuse_foreign_root
    from gpunode.cli.state import state
    from gpunode.cli.up import run_plan
    from gpunode.down import DownOptions, plan_down

    host = state(ctx).host
    # No package manager runs without --toolkit; what still acts outside the root is the node step.
    refuse_foreign_root(
        host,
        dry_run,
        f"--toolkit would remove the packages with this machine's package manager, here, not in {host.root}"
        if toolkit
        else "its node step withdraws capacity and labels through the Kubernetes API: a change to the live "
        f"cluster, not to the files in {host.root}",
    )
    opts = DownOptions(
        toolkit=toolkit,
        node=node,
        kubeconfig=kubeconfig,
        context=context,
        server=server,
        request_timeout=request_timeout,
        on_output=lambda line: click.echo(f"    | {line}"),
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
