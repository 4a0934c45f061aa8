"""What every command reads from the root of the command line: the host, --debug, colour.

A module of its own so that the command modules need not import `cli/main.py`, which imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import click

    from gpunode.host import Host

# click's completion protocol: the shell's script runs `gpunode` with this set to ask for candidates.
COMPLETE_VAR = "_GPUNODE_COMPLETE"

# Set only by main(host=...): lets tests run the whole CLI against a temp root and a scripted runner.
overrides: dict[str, Host] = {}


@dataclass(frozen=True)
class AppState:
    host: Host
    debug: bool
    color: bool = True  # False with --no-color or NO_COLOR; output that is not a terminal has none anyway


def state(ctx: click.Context) -> AppState:
    obj = ctx.find_root().obj
    if not isinstance(obj, AppState):  # the root command sets it before any subcommand runs
        raise RuntimeError("gpunode's root command did not run")
    return obj
