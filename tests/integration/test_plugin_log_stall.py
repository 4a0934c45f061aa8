"""Health changes and Allocate never wait for the log (issue 13: "health reaches kubelet in milliseconds
even under load").

A write to the plugin's stderr can stall: journald busy, a reader gone, the kernel's dirty-page throttling of
a log file (a writer is paused up to 200 ms at a time under I/O load). The health thread logs "GPU n
unhealthy" before it publishes the change and Allocate logs before it answers, so a stalled write used to
hold both back - by as long as the write stalled. Forced here deterministically: the plugin's stdout and
stderr are a one-page pipe that the test fills and then stops reading. Nothing is timed.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import fakenvml
from tests.integration.kubelet import HEALTHY, UNHEALTHY, FakeKubelet
from tests.integration.pluginproc import REPO, PluginProcess, short_tempdir

GPU = "nvidia.com/gpu"
DEADLINE = 60.0  # a shared 2-core machine; only a plugin held back by its log gets near it


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with short_tempdir() as base:
        yield base / "device-plugins"


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_dir) as k:
        yield k


class PipedPlugin(PluginProcess):
    """The plugin with stdout and stderr into a pipe of one page that the test reads, or stops reading."""

    def __init__(self, socket_dir: Path, args: list[str], **kwargs: Any) -> None:
        super().__init__(socket_dir, args, **kwargs)
        self.read_end, self.write_end = os.pipe2(os.O_CLOEXEC)
        fcntl.fcntl(self.write_end, fcntl.F_SETPIPE_SZ, 4096)
        # A second open file description of the write end, non-blocking, for the test to fill the pipe
        # with; the plugin's own stays blocking, as stderr into journald's stream socket is.
        self.filler = os.open(f"/proc/self/fd/{self.write_end}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self.output = b""

    def start(self) -> PipedPlugin:
        argv = [sys.executable, "-m", "gpunode", "plugin", "run", "--socket-dir", str(self.socket_dir)]
        self.proc = subprocess.Popen(
            [*argv, *self.args], stdout=self.write_end, stderr=self.write_end, env=self.env, cwd=REPO
        )
        os.close(self.write_end)
        return self

    def read_until(self, text: str) -> None:
        """Read the plugin's output as it comes (select wakes on data) until `text` has appeared."""
        deadline = time.monotonic() + DEADLINE
        while text.encode() not in self.output:
            left = deadline - time.monotonic()
            assert left > 0, f"plugin did not print {text!r}:\n{self.output.decode(errors='replace')}"
            ready, _, _ = select.select([self.read_end], [], [], left)
            if ready:
                self.output += os.read(self.read_end, 65536)

    def fill(self) -> None:
        """Fill the pipe to the brim: from now on every write the plugin makes to it blocks. (A write of
        up to a page is all or nothing, so smaller and smaller ones take the last bytes.)"""
        for size in (512, 64, 8, 1):
            while True:
                try:
                    os.write(self.filler, b"~" * size)
                except BlockingIOError:
                    break

    def drain(self) -> None:
        """Read everything until the last writer is gone (the plugin exited)."""
        while chunk := os.read(self.read_end, 65536):
            self.output += chunk


def test_a_stalled_log_holds_back_neither_health_nor_allocate(kubelet: FakeKubelet, socket_dir: Path) -> None:
    control = socket_dir.parent / "nvml-control"
    control.write_text("")
    plugin = PipedPlugin(socket_dir, ["--recovery-quiet-period", "0"], profile="pcie-4", control=control)
    plugin.start()
    drainer = threading.Thread(target=plugin.drain, daemon=True)
    try:
        plugin.read_until("health monitor armed")
        kubelet.wait_registered(GPU, timeout=DEADLINE)
        devices = kubelet.wait_for_devices(GPU, lambda d: len(d) == 4, timeout=DEADLINE)
        plugin.fill()
        # Both log before they act: "allocated ...", then "GPU 1 (...) unhealthy: Xid 79".
        answer = kubelet.allocate(GPU, [[devices[0].id]], timeout=DEADLINE)
        assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == devices[0].id
        fakenvml.inject(control, "xid 1 79")
        after = kubelet.wait_for_devices(GPU, lambda d: d[1].health == UNHEALTHY, timeout=DEADLINE)
        assert [d.health for d in after] == [HEALTHY, UNHEALTHY, HEALTHY, HEALTHY]
    finally:
        os.close(plugin.filler)
        drainer.start()  # whatever happened: let the plugin write, so that it can stop
        status = plugin.stop(DEADLINE)
        drainer.join(DEADLINE)
        os.close(plugin.read_end)
    assert status == 0
    text = plugin.output.decode(errors="replace")
    # Nothing was lost: the lines queued while the pipe was full came out, in order, once it drained.
    assert text.index("nvidia.com/gpu: allocated") < text.index("unhealthy: Xid 79") < text.index(" stopped")
