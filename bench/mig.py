"""MIG re-advertisement (issue 17): a MIG change on the node → the new device list at kubelet.

Usage: python bench/mig.py [--quick]   (from the repo root; prints a markdown table)

A real `python -m gpunode plugin run --mig-strategy mixed` against tests/integration/kubelet.py's FakeKubelet,
the real pynvml over the fake libnvidia-ml.so.1 (tests/fakenvml). A change is a control line appended to the
fake's control file (`mig-destroy 0 8` / `mig-create 0 1g.5gb 8`: the nvidia.com/mig-1g.5gb list shrinks
and grows; `mig-create 0 3g.20gb 2`: a new resource); the time runs from the append to the fake kubelet
receiving the ListAndWatch message with the new list (for a new resource: the first message on the stream
kubelet opened after its Register). Three ways, in one run:

- event: the GPU sends nvmlEventMigConfigChange (the `mig` profile);
- periodic: the GPUs lack the event (`supported_events = 0x1f`): the watcher's read every 5 s;
- SIGHUP: the only way before issue 17, on the periodic node, the signal sent right after the change
  (a periodic read may come first now and then: that sample then measures it; the table counts them).
  A reload registers every resource again (kubelet opens new streams); the last column shows it.

The fake applies a control line at the first NVML call after the append (the watcher's own, or its wait
polling every 5 ms), so the event figures include up to 5 ms of that polling, which the real driver does
not have.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import fakenvml  # noqa: E402 (needs the repo on sys.path)
from tests.integration.kubelet import DeviceInfo, FakeKubelet  # noqa: E402
from tests.integration.pluginproc import PluginProcess, short_tempdir  # noqa: E402
from tests.integration.test_plugin_migchange import NO_EVENTS  # noqa: E402

SMALL = "nvidia.com/mig-1g.5gb"
LARGE = "nvidia.com/mig-3g.20gb"
GPU = "nvidia.com/gpu"
WAIT = 60.0
SETTLE_S = 0.5
POLL_S = 5.0  # gpunode.plugin.migwatch.POLL_INTERVAL_S


def _ms(samples: list[float]) -> str:
    if not samples:
        return "-"
    return (
        f"{statistics.median(samples) * 1000:.0f} / {min(samples) * 1000:.0f} / {max(samples) * 1000:.0f} ms"
    )


class Node:
    """A plugin on a fake MIG node, its fake kubelet and its control file."""

    def __init__(self, base: Path, machine: str | None) -> None:
        self.socket_dir = base / "device-plugins"
        base.mkdir(parents=True, exist_ok=True)
        self.control = base / "control"
        self.control.write_text("")
        config = None
        if machine is not None:
            config = base / "machine.ini"
            config.write_text(machine)
        self.kubelet = FakeKubelet(self.socket_dir)
        self.plugin = PluginProcess(
            self.socket_dir,
            ["--mig-strategy", "mixed"],
            profile="mig" if machine is None else None,
            nvml_config=config,
            control=self.control,
            log_dir=base,
        )

    def __enter__(self) -> Node:
        self.kubelet.start()
        self.plugin.start()
        self.kubelet.wait_for_devices(SMALL, lambda d: len(d) == 2, timeout=WAIT)
        self.plugin.wait_for_log("MIG watcher", timeout=WAIT)
        return self

    def __exit__(self, *exc: object) -> None:
        self.plugin.stop()
        self.kubelet.stop()

    def change(
        self, line: str, resource: str, want: Callable[[list[DeviceInfo]], bool], then: Callable[[], None]
    ) -> float:
        """Append the control line, run `then`, and return the seconds until kubelet has the wanted list."""
        start = time.monotonic()
        fakenvml.inject(self.control, line)
        then()
        update = self.kubelet.wait_for_update(resource, want, timeout=WAIT, after=start)
        # Off the clock: let the plugin finish the re-read (it restarts its health monitor after kubelet
        # has the list), so that every sample starts from a quiet plugin.
        time.sleep(SETTLE_S)
        return update.time - start


def run(samples: int, periodic_samples: int) -> list[list[str]]:
    rows: list[list[str]] = []
    nothing = lambda: None  # noqa: E731
    with short_tempdir("mig-") as base:
        with Node(base / "event", None) as node:
            shrink, grow, new = [], [], []
            for _ in range(samples):
                shrink.append(node.change("mig-destroy 0 8", SMALL, lambda d: len(d) == 1, nothing))
                grow.append(node.change("mig-create 0 1g.5gb 8", SMALL, lambda d: len(d) == 2, nothing))
                new.append(node.change("mig-create 0 3g.20gb 2", LARGE, lambda d: len(d) == 1, nothing))
                # The new resource is dropped again, off the clock.
                fakenvml.inject(node.control, "mig-destroy 0 2")
                wait_gone(node, LARGE)
            gpu_registrations = len(node.kubelet.registrations(GPU))
            rows.append(
                ["event (nvmlEventMigConfigChange)", _ms(shrink), _ms(grow), _ms(new), str(gpu_registrations)]
            )
        with Node(base / "periodic", NO_EVENTS) as node:
            shrink, grow = [], []
            phase = random.Random(17)  # noqa: S311 (a reproducible spread of phases, not a secret)
            for _ in range(periodic_samples):
                # At a random point of the 5 s period (off the clock): else every sample lands at one phase.
                time.sleep(phase.uniform(0, POLL_S))
                shrink.append(node.change("mig-destroy 0 8", SMALL, lambda d: len(d) == 1, nothing))
                time.sleep(phase.uniform(0, POLL_S))
                grow.append(node.change("mig-create 0 1g.5gb 8", SMALL, lambda d: len(d) == 2, nothing))
            time.sleep(phase.uniform(0, POLL_S))
            new = [node.change("mig-create 0 3g.20gb 2", LARGE, lambda d: len(d) == 1, nothing)]
            gpu_registrations = len(node.kubelet.registrations(GPU))
            rows.append(
                [
                    "periodic read (no event; every 5 s)",
                    _ms(shrink),
                    _ms(grow),
                    _ms(new) + " (1 sample)",
                    str(gpu_registrations),
                ]
            )
        with Node(base / "sighup", NO_EVENTS) as node:
            hup = lambda: node.plugin.signal(signal.SIGHUP)  # noqa: E731
            shrink, grow = [], []
            for _ in range(samples):
                shrink.append(node.change("mig-destroy 0 8", SMALL, lambda d: len(d) == 1, hup))
                grow.append(node.change("mig-create 0 1g.5gb 8", SMALL, lambda d: len(d) == 2, hup))
            gpu_registrations = len(node.kubelet.registrations(GPU))
            first = node.plugin.log().count("MIG geometry changed")
            label = (
                f"SIGHUP right after the change (before issue 17; {first} of {2 * samples} seen first "
                "by the read)"
            )
            rows.append([label, _ms(shrink), _ms(grow), "-", str(gpu_registrations)])
    return rows


def wait_gone(node: Node, resource: str) -> None:
    deadline = time.monotonic() + WAIT
    gone = f"{resource}: no longer served"
    while node.plugin.log().count(gone) < len(node.kubelet.registrations(resource)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{resource} still served:\n{node.plugin.log()}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = parser.parse_args()
    samples, periodic = (3, 2) if args.quick else (20, 10)
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())
    rows = run(samples, periodic)
    print(
        f"MIG re-advertisement, {datetime.date.today().isoformat()}: Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {platform.platform()}{' (--quick)' if args.quick else ''}; "
        f"{samples} changes each way ({periodic} periodic), fake NVML\n"
    )
    print(
        "| How the plugin learns of it | a 1g.5gb destroyed → list shrinks | … created → list grows "
        "| 3g.20gb created → new resource listed | nvidia.com/gpu registrations (1: never again) |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\nmedian / best / worst")


if __name__ == "__main__":
    main()
