"""Allocate over gRPC, plugin against a bare grpcio server, with a client that is not Python (issue 24).

Usage: python bench/allocate_h2.py [--rounds N] [--calls N] [--baseline REV ...]

Needs `h2load` and `socat` (Debian: `apt-get install nghttp2-client socat`; not part of the tests, so
install.sh does not install them).

The plugin (`python -m gpunode plugin run`, fake NVML `pcie-4`, the fake kubelet; from this tree and from
each --baseline commit, as bench/plugin_ab.py runs them) and bench/bare_server.py (a bare grpcio server
answering the same message) serve on unix sockets. h2load cannot dial a unix socket, so each gets a socat
relay from a TCP port on 127.0.0.1 — the same relay for both, so its cost falls on both alike. h2load posts
one Allocate message (gRPC's 5-byte length prefix + the serialized AllocateRequest) with gRPC's headers,
one connection, one call at a time (`-c 1 -m 1`), --calls calls per round; rounds alternate between the
servers (plugin, bare, plugin, bare, ...) so the machine's load falls on all of them alike. Per-call
latency comes from h2load's --log-file (start of request → end of response, µs). Beside it, the Python
client of plugin_ab.py (grpcio, calls alternating call by call) over the same sockets, without the relay.

Prints, per server, p50 / p99 of each client and the plugin / bare ratio of the medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.plugin import dur, percentile, table  # noqa: E402
from bench.plugin_ab import GPU, SOCKET, Tree, _request, _stub, session, trees  # noqa: E402
from tests import fakenvml  # noqa: E402

PATH = "/v1beta1.DevicePlugin/Allocate"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def relay(unix_path: Path) -> Iterator[int]:
    """socat from a TCP port on 127.0.0.1 to the unix socket; yields the port."""
    port = free_port()
    proc = subprocess.Popen(
        ["socat", f"TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork", f"UNIX-CONNECT:{unix_path}"]
    )
    try:
        for _ in range(500):  # until socat listens (it prints nothing when it does)
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.01)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@contextmanager
def bare_server() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="dph2-bare-", dir="/tmp"))
    path = base / "bare.sock"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "bare_server.py"), str(path)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield path
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(base, ignore_errors=True)


def h2load(port: int, body: Path, calls: int, log: Path) -> list[float]:
    """One h2load run of `calls` Allocates; the seconds of each (all must have answered 200)."""
    log.unlink(missing_ok=True)  # h2load appends to its log file
    result = subprocess.run(
        [
            "h2load",
            *("-n", str(calls), "-c", "1", "-m", "1"),
            *("-H", "content-type: application/grpc", "-H", "te: trailers"),
            *("-d", str(body), f"--log-file={log}"),
            f"http://127.0.0.1:{port}{PATH}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line.split("\t") for line in log.read_text().splitlines() if line]
    if len(rows) != calls or any(r[1] != "200" for r in rows):
        raise SystemExit(f"h2load: not every call answered 200 ({len(rows)} rows):\n{result.stdout}")
    return [int(r[2]) / 1e6 for r in rows]


def grpc_status(port: int, body: Path) -> str:
    """gRPC's status trailer of one call through the relay (nghttp -v shows the trailers)."""
    out = subprocess.run(
        [
            "nghttp",
            "-v",
            *("-H", "content-type: application/grpc", "-H", "te: trailers"),
            *("-d", str(body)),
            f"http://127.0.0.1:{port}{PATH}",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    found = [line.split("grpc-status:")[1].strip() for line in out.splitlines() if "grpc-status:" in line]
    return found[0] if found else f"(none)\n{out}"


def measure(tree: Tree, rounds: int, calls: int, python_calls: int) -> list[str]:
    with ExitStack() as stack:
        kubelet, _plugin = stack.enter_context(session(tree))
        kubelet.wait_registered(GPU, timeout=60)
        ids = [d.id for d in kubelet.wait_for_update(GPU, lambda d: len(d) == 4, timeout=60).devices]
        plugin_socket = kubelet.socket_dir / SOCKET
        bare_socket = stack.enter_context(bare_server())
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dph2-")))
        request = _request(ids[0])
        body = work / "body.bin"
        message = request.SerializeToString()
        body.write_bytes(struct.pack(">BI", 0, len(message)) + message)
        ports = {
            "plugin": stack.enter_context(relay(plugin_socket)),
            "bare": stack.enter_context(relay(bare_socket)),
        }
        for name, port in ports.items():
            status = grpc_status(port, body)
            if status != "0":
                raise SystemExit(f"{name}: Allocate through the relay did not succeed: grpc-status {status}")
        h2: dict[str, list[float]] = {"plugin": [], "bare": []}
        for port in ports.values():  # warm-up of both
            h2load(port, body, 200, work / "log")
        for _ in range(rounds):
            for name, port in ports.items():
                h2[name] += h2load(port, body, calls, work / "log")
        # The Python client beside it: grpcio, no relay, calls alternating one by one.
        py: dict[str, list[float]] = {"plugin": [], "bare": []}
        stubs = {"plugin": _stub(plugin_socket), "bare": _stub(bare_socket)}
        for _ in range(200):
            for _channel, stub in stubs.values():
                stub.Allocate(request, timeout=30)
        answers = {name: stub.Allocate(request, timeout=30) for name, (_c, stub) in stubs.items()}
        if answers["plugin"] != answers["bare"]:
            raise SystemExit(f"the bare server answers differently: {answers}")
        for _ in range(python_calls):
            for name, (_channel, stub) in stubs.items():
                t0 = time.perf_counter()
                stub.Allocate(request, timeout=30)
                py[name].append(time.perf_counter() - t0)
        for channel, _ in stubs.values():
            channel.close()

    def cell(samples: list[float]) -> str:
        return f"{dur(statistics.median(samples))} / {dur(percentile(samples, 99))}"

    def ratio(d: dict[str, list[float]]) -> str:
        return f"{statistics.median(d['plugin']) / statistics.median(d['bare']):.2f}x"

    return [
        tree.label,
        cell(h2["plugin"]),
        cell(h2["bare"]),
        ratio(h2),
        cell(py["plugin"]),
        cell(py["bare"]),
        ratio(py),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10, help="h2load runs per server, alternating")
    parser.add_argument("--calls", type=int, default=1000, help="Allocates per h2load run")
    parser.add_argument("--python-calls", type=int, default=5000, help="Allocates per server, Python client")
    parser.add_argument("--baseline", action="append", default=[], help="a commit to compare (repeatable)")
    args = parser.parse_args()
    for tool in ("h2load", "nghttp", "socat"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install nghttp2-client socat")
    fakenvml.build()
    print(
        f"Allocate, h2load and grpcio clients, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        f"UTC: Python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.platform()}, load "
        f"average {os.getloadavg()[0]:.1f} at the start; {args.rounds} x {args.calls} h2load calls and "
        f"{args.python_calls} grpcio calls per server\n"
    )
    rows = []
    with trees(args.baseline) as found:
        for tree in found:
            rows.append(measure(tree, args.rounds, args.calls, args.python_calls))
    table(
        [
            "tree",
            "h2load: plugin p50 / p99",
            "h2load: bare p50 / p99",
            "h2load: plugin / bare (p50)",
            "grpcio: plugin p50 / p99",
            "grpcio: bare p50 / p99",
            "grpcio: plugin / bare (p50)",
        ],
        rows,
    )
    print(f"Load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
