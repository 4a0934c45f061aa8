"""Whole-process wall time of a command: median and best of N runs after one warm-up run."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable


def measure(
    argv: list[str],
    runs: int,
    *,
    env: dict[str, str] | None = None,
    before_each: Callable[[], None] | None = None,
    must_succeed: bool = False,
) -> tuple[float, float]:
    samples = []
    for _ in range(runs + 1):  # the first run warms the page cache and is dropped
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        result = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False)
        samples.append(time.perf_counter() - start)
        if must_succeed and result.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed: {result.stderr.decode()}")
    samples = samples[1:]
    return statistics.median(samples), min(samples)
