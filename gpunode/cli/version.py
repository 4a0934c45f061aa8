"""`gpunode version`: which gpunode this is, and what it runs on (for bug reports and automation)."""

from __future__ import annotations

from typing import Any

import click

from gpunode.cli.common import Command, exit_codes


@click.command(
    "version",
    cls=Command,
    epilog=exit_codes("0    printed"),
    short_help="Print gpunode's version and commit, and the versions of Python, pynvml and grpcio.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.version/v1).")
@click.pass_context
def version(ctx: click.Context, as_json: bool) -> None:
    """Print gpunode's version and commit, and the versions of Python, pynvml and grpcio.

    The commit is the one install.sh installed from (or $GPUNODE_BUILD at install time), or, run from a
    git checkout, what `git describe --always --dirty` says there.
    """
    import platform

    from gpunode.buildinfo import build, package_version
    from gpunode.cli.state import state

    info = build(state(ctx).host)
    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "pynvml": package_version("nvidia-ml-py"),  # the module pynvml comes from this distribution
        "grpcio": package_version("grpcio"),
        "protobuf": package_version("protobuf"),
        "click": package_version("click"),
    }
    if as_json:
        from gpunode import jsonout

        jsonout.emit(
            jsonout.document(
                "version",
                changed=False,
                version=info.version,
                commit=info.commit,
                commit_source=info.source,
                **versions,
            )
        )
        return
    click.echo(info.line())
    for name, value in versions.items():
        click.echo(f"{name} {value or 'not installed'}")
