"""The inotify watch on kubelet's device-plugins directory (real inotify, temp directories)."""

from __future__ import annotations

import os
import queue
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode.plugin.watch import DirectoryWatch, DirEvent

TIMEOUT = 10.0


class Recorder:
    def __init__(self) -> None:
        self.events: queue.SimpleQueue[DirEvent] = queue.SimpleQueue()

    def __call__(self, event: DirEvent) -> None:
        self.events.put(event)

    def expect(self, kind: str, name: str = "") -> None:
        """Wait for the event, skipping others (the kernel may report extra ones in between)."""
        seen: list[DirEvent] = []
        while True:
            try:
                event = self.events.get(timeout=TIMEOUT)
            except queue.Empty:
                raise AssertionError(f"no {kind} {name!r} event; saw {seen}") from None
            if event == DirEvent(kind, name):
                return
            seen.append(event)


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Path, Recorder, DirectoryWatch]]:
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    recorder = Recorder()
    watch = DirectoryWatch(str(directory), recorder)
    watch.start()
    yield directory, recorder, watch
    watch.stop()


def test_socket_created_and_deleted(watched: tuple[Path, Recorder, DirectoryWatch]) -> None:
    directory, recorder, _ = watched
    path = directory / "kubelet.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        recorder.expect("created", "kubelet.sock")
    path.unlink()
    recorder.expect("deleted", "kubelet.sock")


def test_rename_into_place_counts_as_created(watched: tuple[Path, Recorder, DirectoryWatch]) -> None:
    directory, recorder, _ = watched
    (directory / ".tmp").write_text("x")
    os.rename(directory / ".tmp", directory / "kubelet.sock")
    recorder.expect("created", "kubelet.sock")


def test_directory_removed_and_recreated(watched: tuple[Path, Recorder, DirectoryWatch]) -> None:
    directory, recorder, watch = watched
    shutil.rmtree(directory)
    recorder.expect("dir-gone")
    directory.mkdir()
    recorder.expect("dir-ready")
    assert watch.watching_directory
    (directory / "kubelet.sock").write_text("")
    recorder.expect("created", "kubelet.sock")


def test_directory_missing_at_start(tmp_path: Path) -> None:
    directory = tmp_path / "var/lib/kubelet/device-plugins"
    recorder = Recorder()
    watch = DirectoryWatch(str(directory), recorder)
    watch.start()
    try:
        assert watch.ready.wait(TIMEOUT) and not watch.watching_directory
        directory.mkdir(parents=True)  # three levels appear, one after the other
        recorder.expect("dir-ready")
        assert watch.watching_directory
        (directory / "kubelet.sock").write_text("")
        recorder.expect("created", "kubelet.sock")
    finally:
        watch.stop()


def test_stop_is_prompt_and_closes_the_descriptors(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    watch = DirectoryWatch(str(tmp_path), Recorder())
    watch.start()
    watch.stop()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_level_made_while_the_watch_moves_down_is_not_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mkdir -p` makes the levels faster than the watch follows: a level created after its own failed watch
    and before its parent's watch is in place sends its event to no one. Forced here: the moment the watch
    lands on var/, var/lib/kubelet already exists; the watch must see that and move down at once."""
    import threading

    from gpunode.plugin import watch as watch_module

    directory = tmp_path / "var/lib/kubelet/device-plugins"
    real_add = watch_module._Inotify.add
    raced = threading.Event()

    def racing_add(self: object, path: str, mask: int) -> int:
        if path == str(tmp_path / "var") and (tmp_path / "var").is_dir():  # not at start: var is not there
            (tmp_path / "var/lib/kubelet").mkdir(parents=True, exist_ok=True)
            raced.set()
        return real_add(self, path, mask)  # type: ignore[arg-type]

    monkeypatch.setattr(watch_module._Inotify, "add", racing_add)
    recorder = Recorder()
    watch = DirectoryWatch(str(directory), recorder)
    watch.start()
    try:
        assert watch.ready.wait(TIMEOUT) and not watch.watching_directory
        (tmp_path / "var").mkdir()
        assert raced.wait(TIMEOUT)
        # The watch moved on to var/lib/kubelet; the last level is seen as it appears.
        directory.mkdir()
        recorder.expect("dir-ready")
        assert watch.watching_directory
    finally:
        watch.stop()
