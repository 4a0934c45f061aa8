"""The `gpunode` console script. It imports nothing itself, so that Ctrl-C at any instant of start-up (while
click and the command's modules load) ends quietly with exit 130, as Ctrl-C does once the command runs."""

from __future__ import annotations

import sys


def run() -> None:
    try:
        if sys.argv[1:3] == ["plugin", "run"]:
            # The device plugin's service: parsed without click where it can be (gpunode/plugin/argv.py);
            # returns only for a command line that the CLI below must handle.
            from gpunode.plugin.argv import run as run_plugin

            run_plugin(sys.argv[3:])
        from gpunode.cli.main import run as run_cli
    except KeyboardInterrupt:
        sys.stderr.write("gpunode: interrupted\n")
        sys.exit(130)  # ExitCode.INTERRUPTED; gpunode.errors is not imported yet
    run_cli()
