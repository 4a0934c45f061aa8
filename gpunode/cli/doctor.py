"""`gpunode doctor`: wiring and rendering."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from gpunode.errors import ExitCode

if TYPE_CHECKING:
    from gpunode.doctor import Report

_STYLE = {
    "ok": ("ok", "green"),
    "warn": ("warn", "yellow"),
    "fail": ("FAIL", "bold red"),
    "skip": ("skip", "dim"),
}


def doctor(
    ctx: typer.Context,
    as_json: bool = typer.Option(
        False, "--json", help="Print the findings as JSON (schema gpunode.doctor/v1)."
    ),
) -> None:
    """Diagnose this node: driver, GPUs, container toolkit and runtimes, kubelet, device plugin.

    Exit status 0 when nothing fails, 1 when a check fails (warnings do not fail).
    """
    from gpunode.cli.main import state
    from gpunode.doctor import run_doctor

    app_state = state(ctx)
    report = run_doctor(app_state.host, raise_bugs=app_state.debug)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        render(report)
    raise typer.Exit(int(ExitCode.OK if report.healthy else ExitCode.UNHEALTHY))


def render(report: Report) -> None:
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("result")
    for f in report.findings:
        label, style = _STYLE[f.status.value]
        table.add_row(Text(label, style=style), f.id, f.summary)
    console.print(table)
    problems = [f for f in report.findings if f.status.value in ("fail", "warn")]
    if problems:
        console.print()
        for f in problems:
            label, style = _STYLE[f.status.value]
            console.print(Text.assemble((f"{label} ", style), (f.id, "bold"), f": {f.summary}"))
            # Padding keeps wrapped lines indented under their finding.
            if f.detail:
                console.print(Padding(Text(f.detail, style="dim"), (0, 0, 0, 4)))
            if f.fix:
                console.print(Padding(Text(f"fix: {f.fix}"), (0, 0, 0, 4)))
    counts = report.counts()
    verdict = (
        Text("node is healthy", style="green")
        if report.healthy
        else Text("node is NOT ready for GPU workloads", style="bold red")
    )
    console.print()
    console.print(
        Text.assemble(
            f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} skip: ",
            verdict,
        )
    )
