"""A TCP relay that is slow one way: the client's bytes go to the server at once, the server's come back
one byte every `interval` seconds. In front of the test API server it makes a server that is slow from
the first byte of its TLS handshake on, which no per-read timeout notices.

Runs on 127.0.0.1 (the test certificates name that address), port 0, in daemon threads; each relayed
connection ends when either side hangs up, after `limit` seconds, or when the relay stops.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType


class SlowRelay:
    def __init__(self, target_port: int, *, interval: float = 0.25, limit: float = 30.0) -> None:
        self.target_port = target_port
        self.interval = interval
        self.limit = limit
        self.relayed = 0  # bytes passed from the server to the client
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> SlowRelay:
        self._spawn(self._accept)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._spawn(self._forward, client, server)
            self._spawn(self._trickle, server, client)

    def _forward(self, source: socket.socket, sink: socket.socket) -> None:
        source.settimeout(0.1)
        with contextlib.suppress(OSError):
            while not self._stopping.is_set():
                try:
                    data = source.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    return
                sink.sendall(data)

    def _trickle(self, source: socket.socket, sink: socket.socket) -> None:
        ends = time.monotonic() + self.limit
        source.settimeout(0.1)
        pending = b""
        with contextlib.suppress(OSError):
            while not self._stopping.is_set() and time.monotonic() < ends:
                if not pending:
                    try:
                        pending = source.recv(65536)
                    except TimeoutError:
                        continue
                    if not pending:
                        break
                sink.sendall(pending[:1])
                pending = pending[1:]
                with self._lock:
                    self.relayed += 1
                self._stopping.wait(self.interval)
        for sock in (source, sink):
            sock.close()
