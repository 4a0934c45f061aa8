"""`python -m gpunode`."""

from gpunode.cli.entry import run

run()
