"""Watch kubelet's device-plugins directory with inotify: socket created, socket deleted, directory gone.

The plugin must notice a kubelet restart within milliseconds without polling: kubelet deletes every
socket in the directory and creates a new kubelet.sock. inotify (through libc, no extra dependency)
turns both into events. When the directory itself is missing or removed, the watch moves to its
nearest existing ancestor until the directory is back.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("gpunode.plugin.watch")

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len
_DIR_MASK = IN_CREATE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
_ANCESTOR_MASK = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR


@dataclass(frozen=True)
class DirEvent:
    kind: str  # "created" | "deleted" | "dir-ready" | "dir-gone"
    name: str  # file name inside the watched directory ("" for dir-ready/dir-gone)


class _Inotify:
    def __init__(self) -> None:
        # The process's own symbols, libc's among them: ctypes.util.find_library("c") ran `ldconfig -p`
        # in a subprocess at every start (and imported shutil and tempfile for it).
        libc = ctypes.CDLL(None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = (ctypes.c_int, ctypes.c_int)
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd: int = fd

    def add(self, path: str, mask: int) -> int:
        wd = int(self._add(self.fd, os.fsencode(path), mask))
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}", path)
        return wd

    def remove(self, wd: int) -> None:
        self._rm(self.fd, wd)  # fails harmlessly when the kernel already dropped the watch

    def read(self) -> list[tuple[int, int, str]]:
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        events = []
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            offset += _EVENT.size
            name = data[offset : offset + length].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            offset += length
            events.append((wd, mask, name))
        return events

    def close(self) -> None:
        os.close(self.fd)


class DirectoryWatch:
    """Calls `on_event(DirEvent)` from its own thread for changes in `directory`."""

    def __init__(self, directory: str, on_event: Callable[[DirEvent], None]) -> None:
        self.directory = os.path.abspath(directory)
        self.on_event = on_event
        self._inotify = _Inotify()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._dir_wd: int | None = None
        self._ancestor: tuple[int, str] | None = None  # (wd, path) while the directory is missing
        self._logged_ancestor: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ready = threading.Event()

    def start(self) -> None:
        self._arm()
        self._thread = threading.Thread(target=self._run, name="dp-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5.0)
        self._inotify.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    @property
    def watching_directory(self) -> bool:
        return self._dir_wd is not None

    def _arm(self) -> bool:
        """Watch the directory if it exists (True), else its nearest existing ancestor (False)."""
        if self._ancestor is not None:
            self._inotify.remove(self._ancestor[0])
            self._ancestor = None
        try:
            self._dir_wd = self._inotify.add(self.directory, _DIR_MASK)
            self.ready.set()
            return True
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
        self._dir_wd = None
        path = os.path.dirname(self.directory)
        while True:
            try:
                self._ancestor = (self._inotify.add(path, _ANCESTOR_MASK), path)
                break
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR) or path == "/":
                    raise
                path = os.path.dirname(path)
        # The next directory on the way down may have appeared between its failed add and this watch
        # (`mkdir -p` makes the levels one after the other, faster than the watch moves down): its
        # creation event is then lost, so look, and move down at once.
        step = os.path.relpath(self.directory, path).split(os.sep, 1)[0]
        if os.path.isdir(os.path.join(path, step)):
            return self._arm()
        if path != self._logged_ancestor:
            log.info("waiting for %s to exist (watching %s)", self.directory, path)
            self._logged_ancestor = path
        self.ready.set()
        return False

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._inotify.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            try:
                poller.poll()
            except InterruptedError:
                continue
            if self._stop.is_set():
                return
            try:
                self._handle(self._inotify.read())
            except Exception:  # the watch must outlive one bad event; the plugin depends on it
                log.exception("directory watch: handling an event failed")

    def _handle(self, events: list[tuple[int, int, str]]) -> None:
        for wd, mask, name in events:
            if wd == self._dir_wd:
                if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED):
                    self._inotify.remove(wd)
                    self._dir_wd = None
                    self.on_event(DirEvent("dir-gone", ""))
                    if self._arm():
                        self.on_event(DirEvent("dir-ready", ""))
                elif mask & (IN_CREATE | IN_MOVED_TO):
                    self.on_event(DirEvent("created", name))
                elif mask & (IN_DELETE | IN_MOVED_FROM):
                    self.on_event(DirEvent("deleted", name))
            # Only the next directory on the way down (or the ancestor itself going away) matters; other
            # files come and go there all the time.
            elif (
                self._ancestor is not None
                and wd == self._ancestor[0]
                and self._on_the_way(self._ancestor[1], mask, name)
                and self._arm()
            ):
                self.on_event(DirEvent("dir-ready", ""))

    def _on_the_way(self, ancestor: str, mask: int, name: str) -> bool:
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED):
            return True
        return name == os.path.relpath(self.directory, ancestor).split(os.sep, 1)[0]
