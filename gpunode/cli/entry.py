"""The `gpunode` console script. It imports nothing itself, so that Ctrl-C at any instant of start-up (while
click and the command's modules load) ends quietly with exit 130, as Ctrl-C does once the command runs."""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from gpunode.cli.main import run as run_cli
    except KeyboardInterrupt:
        sys.stderr.write("gpunode: interrupted\n")
        sys.exit(130)  # ExitCode.INTERRUPTED; gpunode.errors is not imported yet
    run_cli()
