"""Whole-process wall time of gpunode's everyday commands next to the interpreter floor, in the same run.

Usage: python bench/startup.py [--runs N] [--baseline REV]   (from the repo root, gpunode in the venv)

Rows: `gpunode --help`; `gpunode doctor` on this machine as it is (without a GPU: no driver); `gpunode
doctor --json` with the fake libnvidia-ml.so.1 of tests/fakenvml serving 8 simulated A100s (the NVML path);
`gpunode configure-runtime containerd --set-as-default --no-restart` on a fresh copy of the stock
`containerd config default` output under a temp root; and `python -c pass`, the floor no Python CLI can go
under. The commands run interleaved — one run of each, N rounds after a warm-up round — so a burst of load
on this shared machine lands on all of them alike. Each figure is the median and best of N.

`gpunode doctor` with containerd installed (issue 24: its `--version` and `config dump` run side by side,
the TOML read with tomllib): the test bed's containerd 1.6 and its stock config, in a private mount
namespace (see `_containerd_doctor_row`).

`--baseline REV` also runs every gpunode row from `git archive REV gpunode` (through PYTHONPATH, the same
interpreter and packages) in the same rounds: before/after figures from one run.
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
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.configure_runtime import stock_config  # noqa: E402 (needs the repo on sys.path)


@dataclass
class Row:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    before_each: Callable[[], None] | None = None
    cwd: Path | None = None  # `python -m` puts the working directory first on sys.path
    seconds: list[float] = field(default_factory=list)

    def run_once(self) -> None:
        if self.before_each is not None:
            self.before_each()
        start = time.perf_counter()
        code = subprocess.call(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env, cwd=self.cwd
        )
        elapsed = time.perf_counter() - start
        if code not in (0, 1):  # doctor exits 1 on a node without a GPU
            raise SystemExit(f"{' '.join(self.argv)} exited {code}")
        self.seconds.append(elapsed)


def gpunode_rows(label: str, python_path: Path, tmp: Path, text: str) -> list[Row]:
    """The gpunode rows for the source tree at `python_path` (`python -m gpunode`, as the console script
    runs it, so a baseline tree is measured the same way)."""
    from tests import fakenvml

    env = {**os.environ, "PYTHONPATH": str(python_path)}
    # Bytecode cached, as an installed gpunode has it (pip compiles it): the warm-up round writes it.
    # Without it every run compiles gpunode's modules again (~50 ms of each command).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    fake_env = {**env, **fakenvml.env(profile="dgx-a100")}
    root = tmp / label
    config = root / "etc/containerd/config.toml"

    def fresh() -> None:
        shutil.rmtree(root / "var", ignore_errors=True)
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(text)

    gpunode = [sys.executable, "-m", "gpunode"]
    configure = [*gpunode, "--root", str(root), "configure-runtime", "containerd", "--set-as-default"]
    rows = [
        Row(f"{label}`gpunode --help`", [*gpunode, "--help"], env),
        Row(f"{label}`gpunode doctor` (this machine, no GPU)", [*gpunode, "doctor"], env),
        Row(
            f"{label}`gpunode doctor --json` (fake NVML, 8 x A100)", [*gpunode, "doctor", "--json"], fake_env
        ),
        Row(
            f"{label}`configure-runtime containerd` (stock config)",
            [*configure, "--no-restart"],
            env,
            before_each=fresh,
        ),
    ]
    containerd = _containerd_doctor_row(label, gpunode, env, tmp)
    rows += [containerd] if containerd is not None else []
    for row in rows:
        row.cwd = python_path
    return rows


def _containerd_doctor_row(label: str, gpunode: list[str], env: dict[str, str], tmp: Path) -> Row | None:
    """`gpunode doctor` with containerd installed: the test bed's containerd 1.6 first on PATH, its own
    `config default` as /etc/containerd/config.toml — a tmpfs over /etc/containerd in a private mount
    namespace (`unshare`, root), so this machine's /etc is never touched. doctor then runs `containerd
    --version` and `containerd config dump` and parses the file and the dump. None (no row) without root,
    an /etc/containerd to mount over or the test bed."""
    from tests import testbed

    program = testbed.location("containerd-1.6")
    if os.geteuid() != 0 or not Path("/etc/containerd").is_dir() or not os.access(program, os.X_OK):
        print(
            "(no `doctor` row with containerd: it needs root, an /etc/containerd directory and the test "
            "bed's containerd 1.6: ./install.sh --dev)",
            file=sys.stderr,
        )
        return None
    config = tmp / "containerd-config.toml"
    if not config.exists():
        config.write_text(
            subprocess.run(
                [str(program), "config", "default"], capture_output=True, text=True, check=True
            ).stdout
        )
    script = 'mount -t tmpfs tmpfs /etc/containerd && cp "$0" /etc/containerd/config.toml && exec "$@"'
    argv = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        str(config),
        *gpunode,
        "doctor",
    ]
    path_env = {**env, "PATH": testbed.path_with("containerd-1.6")}
    return Row(f"{label}`gpunode doctor` (containerd 1.6 installed, stock config)", argv, path_env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--baseline", metavar="REV", help="also measure gpunode as of this git revision")
    args = parser.parse_args()

    text = stock_config()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rows = gpunode_rows("", REPO, tmp, text)
        if args.baseline:
            tree = tmp / "baseline"
            tree.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", args.baseline, "gpunode"], capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
            rows += gpunode_rows(f"{args.baseline}: ", tree, tmp, text)
        floor_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        rows.append(Row("`python -c pass` (interpreter floor)", [sys.executable, "-c", "pass"], floor_env))
        for round_ in range(args.runs + 1):
            for row in rows:
                row.run_once()
            if round_ == 0:  # the warm-up round fills the page cache and is dropped
                for row in rows:
                    row.seconds.clear()

    print(f"Python {platform.python_version()}, {os.cpu_count()} CPUs, {args.runs} rounds\n")
    print("| command | median | best |")
    print("|---|---|---|")
    for row in rows:
        median = statistics.median(row.seconds)
        print(f"| {row.name} | {median * 1000:.0f} ms | {min(row.seconds) * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
