"""`gpunode doctor`: wiring and rendering.

A terminal gets a table with colour (rich, imported only then); anything else — a file, a pipe, a CI log —
gets plain lines: one finding per line, never wrapped, no padding at the end of a line, no box drawing, so
`gpunode doctor > file; grep FAIL file` finds every failed check and nothing else.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from gpunode.cli.common import Command, complete_simulate, exit_codes
from gpunode.errors import ExitCode

if TYPE_CHECKING:
    from gpunode.doctor import Finding, Report

_STYLE = {
    "ok": ("ok", "green"),
    "warn": ("warn", "yellow"),
    "fail": ("FAIL", "bold red"),
    "skip": ("skip", "dim"),
}


@click.command(
    "doctor",
    cls=Command,
    epilog=exit_codes("0    nothing failed (warnings do not fail)", "1    a check failed"),
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the findings as JSON (schema gpunode.doctor/v1)."
)
@click.option(
    "--prometheus",
    metavar="FILE",
    callback=lambda ctx, param, value: _check_textfile(value),
    help="Also write the findings as Prometheus metrics to FILE, atomically, for node_exporter's textfile "
    "collector (e.g. /var/lib/node_exporter/textfile_collector/gpunode_doctor.prom).",
)
@click.option(
    "--simulate",
    metavar="NAME",
    shell_complete=complete_simulate,
    help="Diagnose a built-in simulated node's driver and GPUs instead of NVML's (dgx-a100, pcie-4, pairs-4, "
    "mig, h100, ...); the rest (runtimes, kubelet, plugin) is this host's. Try gpunode without a GPU.",
)
@click.pass_context
def doctor(ctx: click.Context, as_json: bool, prometheus: str | None, simulate: str | None) -> None:
    """Diagnose this node: driver, GPUs, container toolkit and runtimes, kubelet, device plugin.

    Read-only. Each check is a finding (ok, warn, FAIL, skip) with what it saw and the fix.
    """
    from gpunode.cli.state import state
    from gpunode.doctor import run_doctor

    app_state = state(ctx)
    if as_json:
        from gpunode import jsonout

        jsonout.request("doctor")  # an error that stops doctor is a document too
    if simulate is not None:
        from gpunode.errors import UsageError
        from gpunode.plugin.simulate import check_profile

        check_profile(simulate)  # an unknown name is a usage error, not a failed finding
        if prometheus is not None:
            # node_exporter would publish the simulated GPUs' findings as this node's.
            raise UsageError(
                "--simulate writes nothing: --prometheus would publish a simulated node's findings as this "
                "node's metrics",
                "drop --prometheus (or --simulate)",
            )
    report = run_doctor(app_state.host, raise_bugs=app_state.debug, simulate=simulate)
    if prometheus is not None:
        import os
        import time

        from gpunode.doctor import prometheus as textfile

        # Written whatever the findings: a failed check is what the metrics are for (the exit code stays).
        textfile.write(app_state.host, os.path.abspath(prometheus), report, time.time())
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    elif sys.stdout.isatty():
        render(report, color=app_state.color)
    else:
        sys.stdout.write(render_plain(report))
    raise click.exceptions.Exit(int(ExitCode.OK if report.healthy else ExitCode.UNHEALTHY))


def _check_textfile(path: str | None) -> str | None:
    # Said while parsing: otherwise every check would run first, and only the write would find it.
    if path is not None and (not path or path.endswith("/") or path.rsplit("/", 1)[-1] in (".", "..")):
        raise click.BadParameter(
            f"{path!r} is not a file name; give the file to write, e.g. "
            "/var/lib/node_exporter/textfile_collector/gpunode_doctor.prom"
        )
    return path


def _problems(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.status.value in ("fail", "warn")]


def _verdict(report: Report) -> str:
    return "node is healthy" if report.healthy else "node is NOT ready for GPU workloads"


def _counts(report: Report) -> str:
    counts = report.counts()
    return f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} skip"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def render_plain(report: Report) -> str:
    """The findings for a file or a pipe: a finding's status, id and summary on one line; then the detail
    and fix of each problem under its id (no status word there, so a grep for FAIL counts each failed
    check once); then the counts."""
    rows = [("status", "check", "result")] + [
        (_STYLE[f.status.value][0], f.id, _one_line(f.summary)) for f in report.findings
    ]
    status_width = max(len(r[0]) for r in rows)
    id_width = max(len(r[1]) for r in rows)
    lines = [f"{s:<{status_width}}  {i:<{id_width}}  {text}".rstrip() for s, i, text in rows]
    for f in _problems(report):
        lines.append("")
        lines.append(f"{f.id}:")
        for line in (f.detail or "").splitlines():
            lines.append(f"    {line}".rstrip())
        if f.fix:
            lines.append(f"    fix: {_one_line(f.fix)}")
    lines += ["", f"{_counts(report)}: {_verdict(report)}"]
    return "\n".join(lines) + "\n"


def render(report: Report, *, color: bool = True) -> None:
    """The findings for a terminal: a table that fits its width, colour unless --no-color / NO_COLOR."""
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False, no_color=not color)
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("result")
    for f in report.findings:
        label, style = _STYLE[f.status.value]
        table.add_row(Text(label, style=style), f.id, f.summary)
    console.print(table)
    problems = _problems(report)
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
    verdict = Text(_verdict(report), style="green" if report.healthy else "bold red")
    console.print()
    console.print(Text.assemble(f"{_counts(report)}: ", verdict))
