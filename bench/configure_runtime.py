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
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.timing import measure  # noqa: E402 (needs the repo on sys.path)

STOCK = REPO / "tests/fixtures/containerd/default-v2.toml"  # `containerd config default` of 1.6


def stock_config() -> str:
    if shutil.which("containerd"):
        out = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True, check=True)
        return out.stdout
    return STOCK.read_text()


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

        base = [gpunode, "--root", tmp, "configure-runtime", "containerd", "--set-as-default"]
        rows = [
            (
                "configure (stock default config → nvidia default)",
                measure([*base, "--no-restart"], args.runs, before_each=fresh, must_succeed=True),
            ),
            ("already configured (no write)", measure([*base, "--no-restart"], args.runs, must_succeed=True)),
            (
                "`--dry-run` (diff only)",
                measure([*base, "--dry-run"], args.runs, before_each=fresh, must_succeed=True),
            ),
            (
                "`python -c pass` (interpreter floor)",
                measure([sys.executable, "-c", "pass"], args.runs),
            ),
        ]
    print(f"Python {platform.python_version()}, {os.cpu_count()} CPUs, {args.runs} runs each\n")
    print("| `gpunode configure-runtime containerd` | median | best |")
    print("|---|---|---|")
    for name, (median, best) in rows:
        print(f"| {name} | {median * 1000:.0f} ms | {best * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
