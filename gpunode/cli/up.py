"""`gpunode up`: wiring and rendering; the steps are in gpunode.up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import typer

from gpunode.cli.node import kube_options

if TYPE_CHECKING:
    from gpunode.up import Step

_KUBE = kube_options()


def up(
    ctx: typer.Context,
    toolkit_version: Optional[str] = typer.Option(  # noqa: UP045 (typer reads the annotation at runtime)
        None, "--toolkit-version", metavar="X.Y.Z", help="Pin nvidia-container-toolkit.", show_default=False
    ),
    repo_url: Optional[str] = typer.Option(  # noqa: UP045
        None, "--repo-url", metavar="URL", help="Mirror of NVIDIA's repositories.", show_default=False
    ),
    key_file: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--key-file",
        metavar="PATH",
        help="The repositories' signing key, from a file.",
        show_default=False,
    ),
    key_fingerprint: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--key-fingerprint",
        metavar="FPR",
        help="Trust this key instead of NVIDIA's.",
        show_default=False,
    ),
    runtime: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--runtime",
        metavar="docker|containerd|crio",
        help="Container runtime to configure (default: the one kubelet uses).",
        show_default=False,
    ),
    plugin_config: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--plugin-config",
        metavar="FILE",
        help="Device plugin TOML config to install.",
        show_default=False,
    ),
    labels: bool = typer.Option(
        True, "--labels/--no-labels", help="Set the GPU labels (needs API credentials)."
    ),
    node: Optional[str] = typer.Option(  # noqa: UP045
        None, "--node", metavar="NAME", help="Node name for the labels.", show_default=False
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; change nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (unattended use)."),
    kubeconfig: Optional[str] = _KUBE["kubeconfig"],  # noqa: UP045
    context: Optional[str] = _KUBE["context"],  # noqa: UP045
    server: Optional[str] = _KUBE["server"],  # noqa: UP045
) -> None:
    """Make this a working GPU node: preflight, toolkit, container runtime, device plugin, labels.

    Idempotent: prints the plan first, then each step's result; a configured node changes nothing.
    """
    from gpunode.cli.common import confirm, refuse_foreign_root
    from gpunode.cli.main import state
    from gpunode.errors import ExitCode, GpunodeError
    from gpunode.nvml.discovery import discover
    from gpunode.up import UpOptions, plan_up, run_steps

    host = state(ctx).host
    refuse_foreign_root(host, dry_run)
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
        on_output=lambda line: typer.echo(f"    | {line}"),
    )
    steps = plan_up(host, opts, discover)
    print_plan(steps, verbose=dry_run)
    blocked = next((s for s in steps if s.blocked), None)
    if blocked is not None and blocked.error is not None:
        blocked.error.message = f"step {blocked.name}: {blocked.error.message}; gpunode up changed nothing"
        raise blocked.error
    if blocked is not None:
        raise GpunodeError(
            f"preflight: {blocked.blocked}; gpunode up changed nothing",
            blocked.fix or "run `gpunode doctor` for the details",
            exit_code=ExitCode.UNHEALTHY,
        )
    if not any(s.needed for s in steps):
        typer.echo("the node is already set up: nothing to change")
        return
    if dry_run:
        typer.echo("dry run: nothing was changed")
        return
    warnings = [w for s in steps if s.needed for w in s.warnings]
    confirm(yes, "up", "; ".join(warnings) or None)

    def on_step(n: int, total: int, step: Step) -> None:
        typer.echo(f"==> [{n}/{total}] {step.name}: {step.summary}")

    # Each step's apply plans it again itself, just before it runs (an earlier step may have changed what
    # it sees), so the plan printed above is not re-made here.
    for step, result in run_steps(steps, on_step):
        typer.echo(f"    {step.name}: {result}")
    typer.echo("the node is set up; `gpunode doctor` checks it")


def print_plan(steps: list[Step], *, verbose: bool) -> None:
    typer.echo("plan:")
    for step in steps:
        mark = (
            "blocked" if step.blocked else "to do" if step.needed else "skipped" if step.skipped else "done"
        )
        typer.echo(f"  [{mark:>7}] {step.name}: {step.summary}")
        if verbose:
            for line in step.details:
                typer.echo(
                    "".join(f"            {text}\n" for text in line.rstrip("\n").splitlines()), nl=False
                )
        if step.fix and (step.blocked or not step.needed):
            typer.echo(f"            fix: {step.fix}")
