"""The plugin's issue-15 figures, side by side: this tree against baseline commits, in one run.

Usage: python bench/plugin_ab.py [--baseline REV ...] [--runs N] [--allocates N] [--only start,rss,allocate]

Each baseline is `git archive REV` unpacked into a private directory under /tmp (the working tree and
.git are left alone) and run with the same interpreter, the same fake kubelet and the same fake NVML.
Runs alternate between the trees (A, B, A, B, ...), so the machine's load falls on all of them alike.

- start: Popen of `python -m gpunode plugin run` → the fake kubelet accepts its registration (median and
  best of N, after a warm-up run of each tree).
- rss: VmRSS of /proc/<pid>/status after registration, then after every 5,000 Allocates up to --allocates
  (20,000), and VmHWM (the peak).
- allocate: Allocate p50 / p99 over gRPC against `bench/bare_server.py` (a bare grpcio server answering
  the same message): one client process (this one), a channel to each server, calls alternating
  plugin / bare, the same request; and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.plugin import dur, percentile, table, vm_kib  # noqa: E402
from gpunode.plugin.api import deviceplugin_pb2 as pb  # noqa: E402
from gpunode.plugin.api import deviceplugin_pb2_grpc  # noqa: E402
from tests import fakenvml  # noqa: E402
from tests.integration.kubelet import FakeKubelet  # noqa: E402

GPU = "nvidia.com/gpu"
SOCKET = "gpunode-nvidia.com-gpu.sock"
pb_grpc: Any = deviceplugin_pb2_grpc
EXTRA_ENV: dict[str, str] = {}  # --env: for every plugin started (a variable older trees ignore)


@dataclass(frozen=True)
class Tree:
    label: str
    path: Path


@contextmanager
def trees(baselines: Sequence[str], others: Sequence[str] = ()) -> Iterator[list[Tree]]:
    base = Path(tempfile.mkdtemp(prefix="dpab-", dir="/tmp"))
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "gpunode"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        found = [Tree(f"this tree ({head}{' + uncommitted' if dirty else ''})", REPO)]
        for rev in baselines:
            short = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", rev],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            target = base / short
            target.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", rev, "gpunode"], capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
            found.append(Tree(f"baseline {short} ({rev})" if rev != short else f"baseline {short}", target))
        found += [Tree(f"tree {path}", Path(path).resolve()) for path in others]
        for tree in found:
            # Bytecode for every tree alike (compileall writes it whatever PYTHONDONTWRITEBYTECODE says).
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree.path / "gpunode")], check=True)
        yield found
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Plugin:
    """`python -m gpunode plugin run` from a given tree (its cwd and PYTHONPATH: `-m` looks in the cwd
    first), fake NVML `pcie-4`, the log in a file as the journal would get it."""

    def __init__(self, tree: Tree, socket_dir: Path, args: Sequence[str] = ()) -> None:
        # Not PYTHONDONTWRITEBYTECODE (set on the project's machines): every tree is compiled beforehand
        # (`prepared`), as an installed gpunode is; with the variable, a tree without bytecode would compile
        # its sources on every start, ~40 ms the others do not pay.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GPUNODE_", "DP_")) and k != "PYTHONDONTWRITEBYTECODE"
        }
        env.update(fakenvml.env("pcie-4", None, None))
        env.update(
            PYTHONPATH=str(tree.path), GPUNODE_PLUGIN_STATUS_FILE=str(socket_dir.parent / "status.json")
        )
        env.update(EXTRA_ENV)
        self.log = socket_dir.parent / "plugin.log"
        argv = [sys.executable, "-m", "gpunode", "plugin", "run", "--socket-dir", str(socket_dir), *args]
        self.started = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree.path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@contextmanager
def session(tree: Tree, args: Sequence[str] = ()) -> Iterator[tuple[FakeKubelet, Plugin]]:
    base = Path(tempfile.mkdtemp(prefix="dpab-", dir="/tmp"))
    socket_dir = base / "device-plugins"
    try:
        with FakeKubelet(socket_dir) as kubelet:
            plugin = Plugin(tree, socket_dir, args)
            try:
                yield kubelet, plugin
            except Exception:
                print(
                    f"--- {tree.label}: plugin log ---\n{plugin.log.read_text(errors='replace')}",
                    file=sys.stderr,
                )
                raise
            finally:
                plugin.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def bench_start(all_trees: list[Tree], runs: int, extra: Sequence[str] = ()) -> None:
    print("### Start → registered\n")
    cases = [("fake NVML `pcie-4`", ()), ("`--simulate pcie-4`", ("--simulate", "pcie-4"))]
    rows = []
    for label, args in cases:
        samples: dict[str, list[float]] = {t.label: [] for t in all_trees}
        for run in range(runs + 1):
            for tree in all_trees:
                with session(tree, [*args, *extra]) as (kubelet, plugin):
                    registration = kubelet.wait_registered(GPU, timeout=60)
                    if run > 0:  # the first run of each warms the page cache
                        samples[tree.label].append(registration.time - plugin.started)
        for tree in all_trees:
            s = samples[tree.label]
            rows.append([label, tree.label, dur(statistics.median(s)), dur(min(s))])
    table(["plugin", "tree", f"registered, median of {runs}", "best"], rows)


def _stub(path: Path) -> tuple[Any, Any]:
    channel = grpc.insecure_channel(f"unix:{path}", options=[("grpc.default_authority", "localhost")])
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel, pb_grpc.DevicePluginStub(channel)


def _request(device: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[device])])


def bench_rss_and_allocate(
    all_trees: list[Tree], allocates: int, rss: bool, latency: bool, args: Sequence[str] = ()
) -> None:
    """RSS along 20,000 Allocates, and Allocate against the bare server, one plugin per tree at a time."""
    rss_rows: list[list[str]] = []
    lat_rows: list[list[str]] = []
    for tree in all_trees:
        with session(tree, args) as (kubelet, plugin):
            kubelet.wait_registered(GPU, timeout=60)
            devices = kubelet.wait_for_update(GPU, lambda d: len(d) == 4, timeout=60).devices
            ids = [d.id for d in devices]
            pid = plugin.proc.pid
            time.sleep(0.5)  # let the start's transient work (threads, the first stream message) settle
            marks = [("after registration", vm_kib(pid, "VmRSS"))]
            bare_dir = Path(tempfile.mkdtemp(prefix="dpab-bare-", dir="/tmp"))
            bare_socket = bare_dir / "bare.sock"
            bare = subprocess.Popen(
                [sys.executable, str(REPO / "bench" / "bare_server.py"), str(bare_socket)],
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            try:
                assert bare.stdout is not None and bare.stdout.readline().strip() == b"ready"
                plugin_channel, plugin_stub = _stub(kubelet.socket_dir / SOCKET)
                bare_channel, bare_stub = _stub(bare_socket)
                requests = [_request(i) for i in ids]
                for i in range(200):  # warm-up of both channels and servers
                    plugin_stub.Allocate(requests[i % 4], timeout=30)
                    bare_stub.Allocate(requests[i % 4], timeout=30)
                mine: list[float] = []
                floor: list[float] = []
                for i in range(allocates):
                    request = requests[i % 4]
                    t0 = time.perf_counter()
                    answer = plugin_stub.Allocate(request, timeout=30)
                    t1 = time.perf_counter()
                    reference = bare_stub.Allocate(request, timeout=30)
                    t2 = time.perf_counter()
                    mine.append(t1 - t0)
                    floor.append(t2 - t1)
                    if i == 0 and answer != reference:
                        raise AssertionError(f"the bare server answers differently: {answer} vs {reference}")
                    if (i + 1) % 5000 == 0:
                        marks.append((f"after {i + 1:,} Allocates", vm_kib(pid, "VmRSS")))
                marks.append(("peak (VmHWM)", vm_kib(pid, "VmHWM")))
                plugin_channel.close()
                bare_channel.close()
            finally:
                bare.send_signal(signal.SIGTERM)
                bare.wait(30)
                shutil.rmtree(bare_dir, ignore_errors=True)
        rss_rows.append([tree.label, *(f"{kib * 1024 / 1e6:.1f} MB" for _, kib in marks)])
        header = ["tree", *(name for name, _ in marks)]
        ratio = statistics.median(mine) / statistics.median(floor)
        lat_rows.append(
            [
                tree.label,
                f"{dur(statistics.median(mine))} / {dur(percentile(mine, 99))}",
                f"{dur(statistics.median(floor))} / {dur(percentile(floor, 99))}",
                f"{ratio:.2f}x",
            ]
        )
    if rss:
        print(f"### RSS along {allocates:,} Allocates (MB = 10^6 bytes)\n")
        table(header, rss_rows)
    if latency:
        print(f"### Allocate over gRPC, {allocates:,} calls alternating plugin / bare server\n")
        table(["tree", "plugin p50 / p99", "bare grpcio server p50 / p99", "plugin / bare (p50)"], lat_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--baseline", action="append", default=[], help="a commit to compare with (repeatable)"
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        help="another source tree to compare (a directory holding gpunode/)",
    )
    parser.add_argument("--runs", type=int, default=10, help="plugin starts per tree and case")
    parser.add_argument("--allocates", type=int, default=20_000)
    parser.add_argument("--only", default="start,rss,allocate")
    parser.add_argument(
        "--plugin-args",
        default="",
        help="extra `plugin run` arguments for every plugin started, space-separated",
    )
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every plugin (repeatable)")
    parser.add_argument("--no-worktree", action="store_true", help="only the baselines (and --tree)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    EXTRA_ENV.update(item.split("=", 1) for item in args.env)
    fakenvml.build()
    print(
        f"Plugin A/B, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, {platform.platform()}, load average "
        f"{os.getloadavg()[0]:.1f} at the start\n"
    )
    with trees(args.baseline, args.tree) as found:
        all_trees = found[1:] if args.no_worktree else found
        if "start" in only:
            bench_start(all_trees, args.runs, args.plugin_args.split())
        if only & {"rss", "allocate"}:
            bench_rss_and_allocate(
                all_trees, args.allocates, "rss" in only, "allocate" in only, args.plugin_args.split()
            )
    print(f"Load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
