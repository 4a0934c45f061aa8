"""Whole-process wall time of `gpunode --help` and `gpunode doctor` (median of several runs).

Usage: python bench/startup.py [--runs N]   (from the repo root, with gpunode installed in the venv)

`doctor` is measured twice: on this machine as it is (on a machine without a GPU: no driver), and with
the fake libnvidia-ml.so.1 from tests/fakenvml serving 8 simulated A100s, so the NVML path is included.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.timing import measure  # noqa: E402 (needs the repo on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()

    from tests import fakenvml

    gpunode = str(Path(sys.executable).parent / "gpunode")
    fake_env = {**os.environ, **fakenvml.env(profile="dgx-a100")}
    rows = [
        ("`gpunode --help`", measure([gpunode, "--help"], args.runs)),
        ("`gpunode doctor` (this machine, no GPU)", measure([gpunode, "doctor"], args.runs)),
        (
            "`gpunode doctor --json` (fake NVML, 8 x A100)",
            measure([gpunode, "doctor", "--json"], args.runs, env=fake_env),
        ),
        ("`python -c pass` (interpreter floor)", measure([sys.executable, "-c", "pass"], args.runs)),
    ]
    print(f"Python {platform.python_version()}, {os.cpu_count()} CPUs, {args.runs} runs each\n")
    print("| command | median | best |")
    print("|---|---|---|")
    for name, (median, best) in rows:
        print(f"| {name} | {median * 1000:.0f} ms | {best * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
