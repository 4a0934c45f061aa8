"""Whole-process wall time of `gpunode configure-runtime containerd` on the stock default config.

Usage: python bench/configure_runtime.py [--runs N]   (from the repo root, gpunode installed in the venv)

Each run starts from a fresh copy of the real `containerd config default` output (version 2, ~240 lines)
under a temp root, and configures it with --set-as-default --no-restart: parse, plan, backup, record,
atomic write. A second figure is the no-op run on the already configured file ("already configured"),
and a third the --dry-run (diff only).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STOCK = REPO / "tests/fixtures/containerd/default-v2.toml"  # `containerd config default` of 1.6


def stock_config() -> str:
    if shutil.which("containerd"):
        out = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True, check=True)
        return out.stdout
    return STOCK.read_text()


def measure(argv: list[str], runs: int, before_each: Callable[[], None]) -> tuple[float, float]:
    samples = []
    for _ in range(runs + 1):  # the first run warms the page cache and is dropped
        before_each()
        start = time.perf_counter()
        result = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
        samples.append(time.perf_counter() - start)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed: {result.stderr.decode()}")
    samples = samples[1:]
    return statistics.median(samples), min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    gpunode = str(Path(sys.executable).parent / "gpunode")
    text = stock_config()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "etc/containerd/config.toml"

        def fresh() -> None:
            shutil.rmtree(root / "var", ignore_errors=True)
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(text)

        def nothing() -> None:
            pass

        base = [gpunode, "--root", tmp, "configure-runtime", "containerd", "--set-as-default"]
        rows = [
            (
                "configure (stock default config → nvidia default)",
                measure([*base, "--no-restart"], args.runs, fresh),
            ),
            ("already configured (no write)", measure([*base, "--no-restart"], args.runs, nothing)),
            ("`--dry-run` (diff only)", measure([*base, "--dry-run"], args.runs, fresh)),
            (
                "`python -c pass` (interpreter floor)",
                measure([sys.executable, "-c", "pass"], args.runs, nothing),
            ),
        ]
    print(f"Python {platform.python_version()}, {os.cpu_count()} CPUs, {args.runs} runs each\n")
    print("| `gpunode configure-runtime containerd` | median | best |")
    print("|---|---|---|")
    for name, (median, best) in rows:
        print(f"| {name} | {median * 1000:.0f} ms | {best * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
