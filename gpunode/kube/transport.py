"""HTTP requests with an overall deadline and an answer of bounded size, on top of requests.

requests' `timeout=(connect, read)` bounds each socket operation, not the request: a server that sends one
byte every few seconds never trips a read timeout and keeps the client waiting for ever, and a server that
sends a gigabyte fills the client's memory. Here every request gets a watchdog timer that shuts the
connection's socket down when the deadline passes — that ends a read blocked in the headers or the body —
and the body is read in chunks, counted against a size limit (the declared Content-Length is refused at
once when it is already over). Connecting, TLS handshake included (Python's ssl applies a socket's
timeout to the whole handshake), is bounded by the connect timeout, which is never longer than the
deadline; only a name lookup that hangs is out of reach (getaddrinfo cannot be interrupted).

Used by the Kubernetes client and by toolkit's key download; imported only when a request is sent
(requests is a heavy import; gpunode's start-up does not pay for it). Redirects are followed here, when
at all, never by requests' Session.send, which reads a redirect's body whole before anything else. The
watchdog finds the connection a request uses through connection pools that report each connection they
hand out, for the request running in the current context.
"""

from __future__ import annotations

import contextlib
import contextvars
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urljoin

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

CHUNK = 64 * 1024


class DeadlineExceeded(requests.exceptions.RequestException):
    """The answer did not arrive whole within the request's deadline."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no complete answer within {seconds:g} s")
        self.seconds = seconds


class TooLarge(requests.exceptions.RequestException):
    """The answer is larger than the limit (declared so, or found so while reading it)."""

    def __init__(self, limit: int, declared: int | None = None) -> None:
        super().__init__(f"the answer is larger than {limit} bytes")
        self.limit = limit
        self.declared = declared


@dataclass(frozen=True)
class Answer:
    """A complete answer: its status, headers (case-insensitive) and whole body."""

    status_code: int
    reason: str
    headers: Mapping[str, str]
    url: str
    body: bytes

    def json(self) -> Any:
        """The body as JSON (ValueError when it is not, or nests deeper than Python's recursion limit)."""
        import json

        try:
            return json.loads(self.body)
        except RecursionError:
            # `[[[[…` a few MiB deep: the decoder recurses once per level. Not a Kubernetes object either.
            raise ValueError("JSON nested too deeply") from None


class _Watchdog:
    """Shuts down the sockets of the connections one request uses once its deadline has passed. No
    deadline (`seconds` None, kubectl's --request-timeout 0): it only keeps the books."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds if seconds is not None else float("inf")
        self._ends = time.monotonic() + self.seconds
        self._lock = threading.Lock()
        self._connections: list[Any] = []
        self._expired = False
        self._timer: threading.Timer | None = None
        if seconds is not None:
            self._timer = threading.Timer(seconds, self._expire)
            self._timer.daemon = True  # a pending timer must never keep the process alive
            self._timer.start()

    @property
    def expired(self) -> bool:
        with self._lock:
            return self._expired

    def track(self, connection: Any) -> None:
        with self._lock:
            self._connections.append(connection)
            expired = self._expired
        if expired:
            _shut(connection)

    def remaining(self) -> float:
        return self._ends - time.monotonic()

    @property
    def passed(self) -> bool:
        """The deadline has passed, whether or not the timer has fired yet. A socket timeout capped at the
        time left (see _send_once) can fire before the timer thread runs on a loaded machine: that timeout
        is the deadline's, not the connect or read timeout's."""
        return self.expired or self.remaining() <= 0

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            connections = list(self._connections)
        for connection in connections:
            _shut(connection)


def _shut(connection: Any) -> None:
    sock = getattr(connection, "sock", None)
    if sock is None:
        return  # still connecting: the connect timeout (capped at the deadline) ends that
    # socket.socket's own shutdown, not SSLSocket's: that one would also drop the TLS object under a thread
    # that is reading from it. Shutting the descriptor down wakes the blocked read with EOF. OSError: the
    # socket is closed already.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


_current: contextvars.ContextVar[_Watchdog | None] = contextvars.ContextVar(
    "gpunode_http_watchdog", default=None
)


def _track(connection: Any) -> None:
    watchdog = _current.get()
    if watchdog is not None:
        watchdog.track(connection)


class _TrackedHTTPPool(HTTPConnectionPool):
    def _get_conn(self, timeout: float | None = None) -> Any:
        connection = super()._get_conn(timeout)
        _track(connection)  # a kept-alive connection is reused without a new socket
        return connection


class _TrackedHTTPSPool(HTTPSConnectionPool):
    def _get_conn(self, timeout: float | None = None) -> Any:
        connection = super()._get_conn(timeout)
        _track(connection)
        return connection


_POOLS: dict[str, type[HTTPConnectionPool]] = {"http": _TrackedHTTPPool, "https": _TrackedHTTPSPool}


class _DeadlineAdapter(HTTPAdapter):
    """requests' adapter, with pools (direct and through a proxy) that report their connections."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = dict(_POOLS)

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        manager.pool_classes_by_scheme = dict(_POOLS)
        return manager


def session() -> requests.Session:
    """A requests session whose requests `request` can bound."""
    new = requests.Session()
    adapter = _DeadlineAdapter()
    new.mount("http://", adapter)
    new.mount("https://", adapter)
    return new


REDIRECTS = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class Options:
    """What a request carries besides its method and URL (requests' arguments of the same names)."""

    headers: Mapping[str, str] = field(default_factory=dict)
    data: bytes | None = None
    verify: str | bool = True
    cert: tuple[str, str] | None = None
    proxies: Mapping[str, str] = field(default_factory=dict)


def request(
    http: requests.Session,
    method: str,
    url: str,
    *,
    connect: float,
    read: float | None,
    deadline: float | None,
    max_bytes: int,
    max_redirects: int = 0,
    options: Options | None = None,
) -> Answer:
    """Send one request and read its whole answer, within `deadline` seconds (None: no deadline, and
    `read` None: no read timeout either) and `max_bytes` bytes.

    Redirects (up to `max_redirects`; 0: a redirect is the answer) are followed here, each bounded the
    same way, all within the one deadline. Raises DeadlineExceeded or TooLarge, and requests' own
    exceptions for everything else (a connect timeout stays a ConnectTimeout: nothing was sent yet, so
    it may be tried again)."""
    opts = options or Options()
    watchdog = _Watchdog(deadline)
    context = _current.set(watchdog)
    try:
        for _ in range(max_redirects + 1):
            answer = _send_once(
                http,
                method,
                url,
                watchdog=watchdog,
                connect=connect,
                read=read,
                max_bytes=max_bytes,
                opts=opts,
            )
            location = answer.headers.get("Location")
            if max_redirects == 0 or answer.status_code not in REDIRECTS or not location:
                return answer
            url = urljoin(answer.url, location)
            if answer.status_code == 303 or (answer.status_code in (301, 302) and method == "POST"):
                method = "GET"  # what browsers and requests do: the body is not sent again
                opts = replace(opts, data=None)
        raise requests.exceptions.TooManyRedirects(f"more than {max_redirects} redirects, the last to {url}")
    finally:
        watchdog.cancel()
        _current.reset(context)


def _send_once(
    http: requests.Session,
    method: str,
    url: str,
    *,
    watchdog: _Watchdog,
    connect: float,
    read: float | None,
    max_bytes: int,
    opts: Options,
) -> Answer:
    left = max(watchdog.remaining(), 0.001)
    timeout: tuple[float, float] | tuple[float, None] = (
        (min(connect, left), None) if read is None else (min(connect, left), min(read, left))
    )
    try:
        # The session prepares the request (its headers, the environment's proxies and CAs when it
        # trusts the environment), but its adapter sends it: Session.send, even with
        # allow_redirects=False, reads a redirect's whole body, unbounded, to work out where it leads.
        prepared = http.prepare_request(
            requests.Request(method, url, headers=dict(opts.headers), data=opts.data)
        )
        settings = http.merge_environment_settings(
            prepared.url, dict(opts.proxies), True, opts.verify, opts.cert
        )
        response = http.get_adapter(prepared.url or url).send(
            prepared,
            stream=True,
            timeout=timeout,
            verify=True if settings["verify"] is None else settings["verify"],
            cert=settings["cert"],
            proxies=settings["proxies"],
        )
    except requests.exceptions.RequestException as exc:
        # A connect timeout stays a ConnectTimeout (nothing was sent, it may be tried again) unless it was the
        # deadline's: min(connect, left) above.
        if watchdog.passed:
            raise DeadlineExceeded(watchdog.seconds) from exc
        raise
    with response:
        body = _read_body(response, watchdog, max_bytes)
    return Answer(response.status_code, response.reason or "", response.headers, response.url, body)


def _read_body(response: requests.Response, watchdog: _Watchdog, max_bytes: int) -> bytes:
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(max_bytes, int(declared))
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in response.iter_content(CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise TooLarge(max_bytes)
            chunks.append(chunk)
            if watchdog.expired:
                break
    except (TooLarge, DeadlineExceeded):
        raise
    except requests.exceptions.RequestException as exc:
        if watchdog.passed:
            raise DeadlineExceeded(watchdog.seconds) from exc
        raise
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        # What requests does not wrap itself, as requests' own kind: the callers handle those.
        if watchdog.passed:
            raise DeadlineExceeded(watchdog.seconds) from exc
        raise requests.exceptions.ConnectionError(exc) from exc
    # A body without a length ends at EOF, which is also what the watchdog's shutdown looks like: once the
    # deadline has passed, what was read cannot be trusted to be whole.
    if watchdog.expired:
        raise DeadlineExceeded(watchdog.seconds)
    return b"".join(chunks)
