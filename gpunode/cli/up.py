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
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON document (schema gpunode.up/v1): the plan, then each step's result.",
    ),
    kubeconfig: Optional[str] = _KUBE["kubeconfig"],  # noqa: UP045
    context: Optional[str] = _KUBE["context"],  # noqa: UP045
    server: Optional[str] = _KUBE["server"],  # noqa: UP045
) -> None:
    """Make this a working GPU node: preflight, toolkit, container runtime, device plugin, labels.

    Idempotent: prints the plan first, then each step's result; a configured node changes nothing.
    """
    from dataclasses import replace

    from gpunode.cli.common import refuse_foreign_root
    from gpunode.cli.main import state
    from gpunode.errors import ExitCode, GpunodeError
    from gpunode.nvml.discovery import discover
    from gpunode.up import UpOptions, plan_up

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
    if as_json:
        from gpunode import jsonout

        jsonout.request("up", dry_run=dry_run)
        opts = replace(opts, on_output=None)  # the package manager's lines would break the document
    steps = plan_up(host, opts, discover)
    blocked = next((s for s in steps if s.blocked), None)
    if blocked is not None and blocked.error is None:
        blocked.error = GpunodeError(
            blocked.blocked,
            blocked.fix or "run `gpunode doctor` for the details",
            exit_code=ExitCode.UNHEALTHY,
        )
    run_plan(
        "up",
        steps,
        dry_run=dry_run,
        yes=yes,
        as_json=as_json,
        nothing="the node is already set up: nothing to change",
        finished="the node is set up; `gpunode doctor` checks it",
    )


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
            typer.echo(nothing if not needed else "dry run: nothing was changed")
        return
    warnings = [w for s in steps if s.needed for w in s.warnings]
    if as_json and not yes:
        raise UsageError(
            f"gpunode {command} asks before it changes the node, which --json cannot", "add --yes"
        )
    confirm(yes, command, "; ".join(warnings) or None)
    results: dict[str, str] = {}

    def on_step(n: int, total: int, step: Step) -> None:
        if as_json:
            jsonout.update(steps=[_step_json(s, results.get(s.name)) for s in steps])
        else:
            typer.echo(f"==> [{n}/{total}] {step.name}: {step.summary}")

    # Each step's apply plans it again itself, just before it runs (an earlier step may have changed what
    # it sees), so the plan printed above is not re-made here.
    for step, result in run_steps(steps, on_step):
        results[step.name] = result
        if not as_json:
            typer.echo(f"    {step.name}: {result}")
    if as_json:
        doc = jsonout.document(
            command, changed=True, dry_run=False, steps=[_step_json(s, results.get(s.name)) for s in steps]
        )
        jsonout.emit(doc)
    else:
        typer.echo(finished)


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
