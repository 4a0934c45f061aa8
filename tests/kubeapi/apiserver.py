"""A test API server that behaves like kube-apiserver for what gpunode uses: Nodes and their status.

- HTTPS with a certificate from a test CA (tests/kubeapi/pki.py), bearer-token and client-certificate
  authentication (the certificate's CN is the user, verified against the CA; optional, so token clients
  work), checked in kube-apiserver's order: a valid client certificate wins, then the token. Bad or
  missing credentials: 401 Unauthorized (or the user system:anonymous with `anonymous=True`).
  Impersonate-User is honoured for users allowed (user, "impersonate", "users").
- Or plain HTTP, like `kubectl proxy`: no authentication, every request runs as `proxy_user`.
- An RBAC-like table of (user, verb, resource) that are allowed ("*" matches anything); anything else is
  403 Forbidden with the apiserver's message, `User "x" cannot patch resource "nodes/status" …`.
- GET /api/v1/nodes/NAME (and …/status); PATCH /api/v1/nodes/NAME with a merge patch (RFC 7386) and
  PATCH /api/v1/nodes/NAME/status with a JSON patch (RFC 6902, applied by the `jsonpatch` library).
  As with the real server: the status subresource keeps the spec and the main resource keeps the status;
  a JSON patch that does not apply is 422 "the server rejected our request due to an error in our
  request" with the reason in details.causes; invalid label values and quantities are 422 Invalid; a
  patched object carrying a stale metadata.resourceVersion is 409 Conflict; every write that changes the
  node bumps its resourceVersion, and a patch that changes nothing writes nothing; an unknown node is 404,
  an unknown path 404, another Content-Type 415, another method 405.
- POST /api/v1/namespaces/NS/events creates a core v1 Event, validated as kube-apiserver's legacy
  validation does for what gpunode sends: metadata.name, the namespace of the URL, an involvedObject
  whose namespace matches (a cluster-scoped object's events in "default"), type Normal or Warning, a
  reason, reportingComponent a qualified name; stored in `events`.
- `node_identity(name)` grants what the Node authorizer gives a kubelet (system:node:NAME): get nodes,
  patch nodes and nodes/status, create events; NodeRestriction's rule is enforced for every system:node:
  user: it may change only its own Node (403 with the admission plugin's message).
- Every error is a Kubernetes `Status` object.
- Faults for tests: `fail_next(status, count, retry_after)` answers the next requests with an error;
  `delay_next(seconds, count)` sleeps before answering; `modify_node` changes a node as another writer.
  Hostile servers, bounded so that a test never waits or sends for ever: `trickle_next(interval)` sends
  the next answer one byte every `interval` seconds (its status line and headers, or its body after
  complete headers), until the client hangs up or `limit` seconds have passed; `flood_next()` announces a
  huge body (Content-Length 1 GiB, or chunked without a length) and streams it until the client hangs
  up or `cap` bytes are sent; `raw_next(body)` answers with exactly these bytes. `streamed` counts the bytes
  those sent.
- resource.k8s.io/v1 (ResourceSlices, ResourceClaims, DeviceClasses, the Node authorizer's DRA rules):
  tests/kubeapi/dra.py, reached as `server.dra`.
- `requests` logs each request (method, path, content type, user, status; never a token).

Runs on 127.0.0.1, port 0, in a daemon thread; use it as a context manager.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import re
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

from tests.kubeapi.pki import CertPair, Pki

# jsonpatch has no type stubs; going through Any keeps mypy --strict quiet about its calls.
jsonpatch: Any = importlib.import_module("jsonpatch")
jsonpointer: Any = importlib.import_module("jsonpointer")

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
UNSUPPORTED_MEDIA = (
    "the body of the request was in an unknown format - accepted media types include: "
    "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
)
NODE_PATH = re.compile(r"^/api/v1/nodes/(?P<name>[^/]+)(?P<status>/status)?$")
EVENTS_PATH = re.compile(r"^/api/v1/namespaces/(?P<namespace>[^/]+)/events$")
EVENT_TYPES = ("Normal", "Warning")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
LABEL_VALUE_ERROR = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
    "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex "
    "used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
QUANTITY_ERROR = f"quantities must match the regular expression '{QUANTITY.pattern}'"


@dataclass(frozen=True)
class Stream:
    """A hostile answer: "trickle" (one byte per `interval`, in the `phase` "headers" or "body"),
    "flood" (`announce` bytes declared, None for chunked; at most `cap` sent), "raw" (exactly `body`) or
    "reset" (no answer: the connection reset)."""

    kind: str
    interval: float = 2.0
    body: bytes = b""
    code: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    phase: str = "body"
    limit: float = 30.0
    announce: int | None = 2**30
    cap: int = 256 * 2**20


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str
    content_type: str | None
    user: str | None  # None: not authenticated
    authenticated_by: str | None  # "certificate", "token", "anonymous", "proxy" or None
    sent_authorization: bool  # an Authorization header was present (whatever it held)
    status: int
    body: Any  # the request's JSON body, parsed; None when it had none


class _Answer(Exception):
    """The answer to a request, raised from anywhere in its handling."""

    def __init__(self, code: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(code)
        self.code = code
        self.body = body
        self.headers = dict(headers or {})


def status(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> _Answer:
    """A Kubernetes Status (metav1.Status) error answer."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = dict(details)
    return _Answer(code, body)


GENERIC = {
    400: ("BadRequest", "the server rejected our request for an unknown reason"),
    429: ("TooManyRequests", "the server has received too many requests and has asked us to try again later"),
    500: ("InternalError", "an error on the server has prevented the request from succeeding"),
    502: ("InternalError", "an error on the server has prevented the request from succeeding"),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    504: ("Timeout", "the server was unable to return a response in the time allotted"),
}


class ApiServer:
    """See the module docstring. `pki` None is plain HTTP (kubectl proxy); `server_cert` overrides the
    serving certificate (e.g. one for another host name)."""

    def __init__(
        self,
        pki: Pki | None = None,
        *,
        tokens: Mapping[str, str] | None = None,
        allow: Iterable[tuple[str, str, str]] = (),
        anonymous: bool = False,
        proxy_user: str = "admin",
        server_cert: CertPair | None = None,
    ) -> None:
        self.pki = pki
        self.tokens = dict(tokens or {})
        self.rules: set[tuple[str, str, str]] = set(allow)
        self.anonymous = anonymous
        self.proxy_user = proxy_user
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[str, Any]] = {}
        self._revision = itertools.count(1000)
        self._faults: list[tuple[int, float | None]] = []
        self._delays: list[float] = []
        self._streams: list[Stream] = []
        self.streamed = 0  # bytes sent by trickled and flooded answers
        self._log: list[LoggedRequest] = []
        self._events: list[dict[str, Any]] = []
        self._stopping = threading.Event()
        self._context: ssl.SSLContext | None = None
        if pki is not None:
            serving = server_cert or pki.server()
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(serving.cert), str(serving.key))
            context.load_verify_locations(cafile=str(pki.ca.cert))
            context.verify_mode = ssl.CERT_OPTIONAL  # client certificates are one way to log in, not the only
            self._context = context
        self._httpd = _HTTPServer(("127.0.0.1", 0), _handler_for(self), self._context)
        # Imported here: tests.kubeapi.dra builds on this module's helpers.
        from tests.kubeapi.dra import DraStore

        self.dra = DraStore(self)  # resource.k8s.io/v1: ResourceSlices, ResourceClaims, DeviceClasses
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"{'https' if self._context else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> ApiServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="kubeapi", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes delayed answers first
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the test's controls ----------------------------------------------------------------------

    def allow(self, user: str, verb: str, resource: str) -> None:
        with self._lock:
            self.rules.add((user, verb, resource))

    def node_identity(self, name: str) -> str:
        """Allow what the Node authorizer allows kubelet `name`; its user name."""
        user = f"system:node:{name}"
        for verb, resource in (
            ("get", "nodes"),
            ("patch", "nodes"),
            ("patch", "nodes/status"),
            ("create", "events"),
        ):
            self.allow(user, verb, resource)
        return user

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(self._events)

    def add_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        capacity: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """A node as kubelet registers it: labels, capacity = allocatable, a Ready condition."""
        resources = dict(capacity or {"cpu": "8", "memory": "32Gi", "pods": "110"})
        node = {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {"podCIDR": "10.244.0.0/24"},
            "status": {
                "capacity": resources,
                "allocatable": dict(resources),
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                "nodeInfo": {"kubeletVersion": "v1.30.2", "containerRuntimeVersion": "containerd://1.7.12"},
            },
        }
        with self._lock:
            self._store(name, node)
            return copy.deepcopy(node)

    def node(self, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._nodes[name])

    def modify_node(self, name: str, change: Callable[[dict[str, Any]], None] | None = None) -> str:
        """Change a node as another writer would (`change` edits it in place; None only bumps the
        resourceVersion); returns the new resourceVersion."""
        with self._lock:
            node = copy.deepcopy(self._nodes[name])
            if change is not None:
                change(node)
            return self._store(name, node)

    def fail_next(self, code: int, count: int = 1, retry_after: float | None = None) -> None:
        """Answer the next `count` requests with `code` (a Status of the usual reason), before anything
        else is looked at; with a Retry-After header when `retry_after` is given."""
        with self._lock:
            self._faults.extend([(code, retry_after)] * count)

    def delay_next(self, seconds: float, count: int = 1) -> None:
        """Sleep `seconds` before handling each of the next `count` requests."""
        with self._lock:
            self._delays.extend([seconds] * count)

    def trickle_next(
        self, interval: float = 2.0, *, phase: str = "body", limit: float = 30.0, count: int = 1
    ) -> None:
        """Send each of the next `count` answers one byte every `interval` seconds: from its status line
        (phase "headers") or after whole headers announcing a 1 MiB body ("body"). Ends when the client
        hangs up, after `limit` seconds, or when the server stops."""
        if phase not in ("headers", "body"):
            raise ValueError(f"phase is headers or body, not {phase!r}")
        with self._lock:
            self._streams.extend([Stream("trickle", interval=interval, phase=phase, limit=limit)] * count)

    def flood_next(
        self,
        *,
        announce: int | None = 2**30,
        cap: int = 256 * 2**20,
        code: int = 200,
        headers: Mapping[str, str] | None = None,
        count: int = 1,
    ) -> None:
        """Answer each of the next `count` requests with `code` (and `headers`) and a body of `announce`
        bytes (None: chunked, no length), streamed as fast as the client reads until it hangs up or `cap`
        bytes are sent."""
        extra = tuple((headers or {}).items())
        with self._lock:
            self._streams.extend(
                [Stream("flood", announce=announce, cap=cap, code=code, headers=extra)] * count
            )

    def raw_next(
        self, body: bytes, *, code: int = 200, headers: Mapping[str, str] | None = None, count: int = 1
    ) -> None:
        """Answer each of the next `count` requests with `code`, `headers` and exactly `body`."""
        extra = tuple((headers or {}).items())
        with self._lock:
            self._streams.extend([Stream("raw", body=body, code=code, headers=extra)] * count)

    def reset_next(self, count: int = 1) -> None:
        """Read each of the next `count` requests whole, then reset the connection (RST) unanswered: a
        server cut off after the request was sent, as a restarting API server or load balancer does."""
        with self._lock:
            self._streams.extend([Stream("reset")] * count)

    def next_stream(self, method: str, raw_path: str, headers: Mapping[str, str]) -> Stream | None:
        """The hostile answer for this request, if one is pending (it is logged as a 200)."""
        with self._lock:
            if not self._streams:
                return None
            stream = self._streams.pop(0)
            self._log.append(
                LoggedRequest(
                    method=method,
                    path=urlsplit(raw_path).path,
                    content_type=headers.get("Content-Type"),
                    user=None,
                    authenticated_by=None,
                    sent_authorization="Authorization" in headers,
                    status=200,
                    body=None,
                )
            )
        return stream

    def count_streamed(self, size: int) -> None:
        with self._lock:
            self.streamed += size

    @property
    def stopping(self) -> threading.Event:
        return self._stopping

    @property
    def requests(self) -> list[LoggedRequest]:
        with self._lock:
            return list(self._log)

    # -- handling ---------------------------------------------------------------------------------

    def revision(self) -> int:
        """The next resourceVersion, shared by every kind of object as etcd's revision is."""
        return next(self._revision)

    def _store(self, name: str, node: dict[str, Any]) -> str:
        revision = str(self.revision())
        node["metadata"]["resourceVersion"] = revision
        self._nodes[name] = node
        return revision

    def handle(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: bytes, peer_cert: Any
    ) -> _Answer:
        """One request's answer (never raises), logged."""
        with self._lock:
            delay = self._delays.pop(0) if self._delays else None
            fault = self._faults.pop(0) if self._faults else None
        if delay is not None:
            self._stopping.wait(delay)
        user: tuple[str | None, str | None] = (None, None)
        if fault is not None:
            code, retry_after = fault
            reason, message = GENERIC.get(code, ("InternalError", f"injected {code}"))
            answer = status(code, reason, message)
            if retry_after is not None:
                answer.headers["Retry-After"] = f"{retry_after:g}"
        else:
            try:
                user = authenticated = self._authenticate(headers, peer_cert)
                parts = urlsplit(raw_path)
                if parts.path.startswith("/apis/resource.k8s.io/"):
                    answer = self.dra.route(method, parts.path, parts.query, headers, body, authenticated[0])
                else:
                    answer = self._route(method, parts.path, headers, body, authenticated)
            except _Answer as raised:
                answer = raised
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        entry = LoggedRequest(
            method=method,
            path=urlsplit(raw_path).path,
            content_type=headers.get("Content-Type"),
            user=user[0],
            authenticated_by=user[1],
            sent_authorization="Authorization" in headers,
            status=answer.code,
            body=parsed,
        )
        with self._lock:
            self._log.append(entry)
        return answer

    def _authenticate(self, headers: Mapping[str, str], peer_cert: Any) -> tuple[str, str]:
        user, how = self._credentials(headers, peer_cert)
        target = headers.get("Impersonate-User")
        if target is None:
            return user, how
        # Impersonation is authorized like any request: the verb "impersonate" on the resource "users".
        if not self._allowed(user, "impersonate", "users"):
            raise status(
                403,
                "Forbidden",
                f'users "{target}" is forbidden: User "{user}" cannot impersonate resource "users" '
                'in API group "" at the cluster scope',
                {"name": target, "kind": "users"},
            )
        return target, f"{how}, impersonating"

    def _credentials(self, headers: Mapping[str, str], peer_cert: Any) -> tuple[str, str]:
        if self._context is None:
            return self.proxy_user, "proxy"
        if peer_cert:
            for rdn in peer_cert.get("subject", ()):
                for key, value in rdn:
                    if key == "commonName":
                        return value, "certificate"
        authorization = headers.get("Authorization")
        if authorization is not None:
            scheme, _, token = authorization.partition(" ")
            user = self.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
            if user is None:
                raise status(401, "Unauthorized", "Unauthorized")
            return user, "token"
        if self.anonymous:
            return "system:anonymous", "anonymous"
        raise status(401, "Unauthorized", "Unauthorized")

    def _allowed(self, user: str, verb: str, resource: str) -> bool:
        with self._lock:
            rules = set(self.rules)
        return any(
            all(want in ("*", got) for want, got in zip(rule, (user, verb, resource), strict=True))
            for rule in rules
        )

    def _route(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes, user: tuple[str, str]
    ) -> _Answer:
        events = EVENTS_PATH.match(path)
        if events is not None:
            return self._create_event(method, unquote(events["namespace"]), headers, body, user[0])
        match = NODE_PATH.match(path)
        if match is None:
            raise status(404, "NotFound", "the server could not find the requested resource")
        name = unquote(match["name"])
        resource = "nodes/status" if match["status"] else "nodes"
        verb = {"GET": "get", "PATCH": "patch"}.get(method)
        if verb is None:
            raise status(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        if not self._allowed(user[0], verb, resource):
            raise status(
                403,
                "Forbidden",
                f'nodes "{name}" is forbidden: User "{user[0]}" cannot {verb} resource "{resource}" '
                'in API group "" at the cluster scope',
                {"name": name, "kind": "nodes"},
            )
        own = user[0].removeprefix("system:node:")
        if verb == "patch" and own != user[0] and own != name:
            # NodeRestriction: a kubelet may modify only its own Node object.
            raise status(
                403,
                "Forbidden",
                f'nodes "{name}" is forbidden: node "{own}" is not allowed to modify node "{name}"',
                {"name": name, "kind": "nodes"},
            )
        if verb == "get":
            with self._lock:
                node = self._nodes.get(name)
                if node is None:
                    raise _not_found(name)
                return _Answer(200, copy.deepcopy(node))
        return self._patch(name, resource, headers.get("Content-Type", ""), body)

    def _patch(self, name: str, resource: str, content_type: str, body: bytes) -> _Answer:
        media = content_type.split(";", maxsplit=1)[0].strip().lower()
        if media not in (JSON_PATCH, MERGE_PATCH):
            raise status(415, "UnsupportedMediaType", UNSUPPORTED_MEDIA)
        try:
            patch = json.loads(body)
        except ValueError as exc:
            raise status(400, "BadRequest", f"error decoding patch: {exc}") from None
        with self._lock:
            old = self._nodes.get(name)
            if old is None:
                raise _not_found(name)
            new = _apply_json_patch(old, patch) if media == JSON_PATCH else _apply_merge_patch(old, patch)
            if not isinstance(new, dict):
                raise status(400, "BadRequest", "the patched object is not a JSON object")
            # What the subresource may not change, kept as it was (the real strategies' PrepareForUpdate).
            if resource == "nodes/status":
                new["spec"] = copy.deepcopy(old.get("spec", {}))
            else:
                new["status"] = copy.deepcopy(old.get("status", {}))
            metadata = new.get("metadata")
            if not isinstance(metadata, dict):
                raise status(400, "BadRequest", "metadata is not a JSON object")
            for key in ("name", "uid", "creationTimestamp"):
                metadata[key] = old["metadata"][key]
            new["kind"], new["apiVersion"] = "Node", "v1"
            wanted = metadata.get("resourceVersion")
            current = old["metadata"]["resourceVersion"]
            if wanted not in (None, "") and wanted != current:
                raise status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on nodes "{name}": the object has been modified; please '
                    "apply your changes to the latest version and try again",
                    {"name": name, "kind": "nodes"},
                )
            _validate(name, new)
            metadata["resourceVersion"] = current
            if new == old:
                return _Answer(200, copy.deepcopy(old))  # no change, no write: the resourceVersion stays
            self._store(name, new)
            return _Answer(200, copy.deepcopy(new))

    def _create_event(
        self, method: str, namespace: str, headers: Mapping[str, str], body: bytes, user: str
    ) -> _Answer:
        if method != "POST":
            raise status(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        if not self._allowed(user, "create", "events"):
            raise status(
                403,
                "Forbidden",
                f'events is forbidden: User "{user}" cannot create resource "events" in API group "" in the '
                f'namespace "{namespace}"',
                {"kind": "events"},
            )
        if headers.get("Content-Type", "").split(";")[0].strip().lower() != "application/json":
            raise status(415, "UnsupportedMediaType", UNSUPPORTED_MEDIA)
        try:
            event = json.loads(body)
        except ValueError as exc:
            raise status(400, "BadRequest", f"error decoding event: {exc}") from None
        if not isinstance(event, dict) or (event.get("apiVersion"), event.get("kind")) != ("v1", "Event"):
            raise status(400, "BadRequest", "the body is not a v1 Event")
        problems = _event_problems(namespace, event)
        if problems:
            raise status(
                422,
                "Invalid",
                f'Event "{event.get("metadata", {}).get("name", "")}" is invalid: ' + ", ".join(problems),
                {"kind": "Event", "causes": [{"message": p} for p in problems]},
            )
        stored = copy.deepcopy(event)
        stored["metadata"].update(
            {"namespace": namespace, "uid": str(uuid.uuid4()), "resourceVersion": str(next(self._revision))}
        )
        with self._lock:
            if any(e["metadata"]["name"] == stored["metadata"]["name"] for e in self._events):
                raise status(409, "AlreadyExists", f'events "{stored["metadata"]["name"]}" already exists')
            self._events.append(stored)
        return _Answer(201, stored)


def _event_problems(namespace: str, event: Mapping[str, Any]) -> list[str]:
    """kube-apiserver's checks of a core v1 Event (ValidateEventCreate, legacy rules) that gpunode meets."""
    problems = []
    metadata = event.get("metadata")
    if not isinstance(metadata, dict) or not metadata.get("name"):
        problems.append("metadata.name: Required value: name or generateName is required")
        metadata = {}
    elif not DNS_SUBDOMAIN.match(str(metadata["name"])):
        problems.append(f"metadata.name: Invalid value: {metadata['name']!r}")
    if metadata.get("namespace", namespace) != namespace:
        problems.append("metadata.namespace: Invalid value: does not match the namespace of the request")
    involved = event.get("involvedObject")
    if not isinstance(involved, dict) or not involved.get("kind") or not involved.get("name"):
        problems.append("involvedObject: Required value: kind and name")
    else:
        object_namespace = involved.get("namespace", "")
        if object_namespace and object_namespace != namespace:
            problems.append("involvedObject.namespace: Invalid value: does not match event.namespace")
        if not object_namespace and namespace not in ("", "default"):
            problems.append("involvedObject.namespace: Invalid value: not allowed for cluster-scoped objects")
    if event.get("type") not in EVENT_TYPES:
        problems.append(f"type: Unsupported value: {event.get('type')!r}: supported values: Normal, Warning")
    if not event.get("reason"):
        problems.append("reason: Required value")
    component = event.get("reportingComponent", "")
    if component and not re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", component):
        problems.append(f"reportingComponent: Invalid value: {component!r}")
    if len(str(event.get("reportingInstance", ""))) > 128:
        problems.append("reportingInstance: Too long: must have at most 128 bytes")
    return problems


def _not_found(name: str) -> _Answer:
    return status(404, "NotFound", f'nodes "{name}" not found', {"name": name, "kind": "nodes"})


def _unprocessable(cause: str) -> _Answer:
    """How kube-apiserver answers a JSON patch that does not apply (NewGenericServerResponse, 422)."""
    return status(
        422,
        "Invalid",
        "the server rejected our request due to an error in our request",
        {"causes": [{"reason": "UnexpectedServerResponse", "message": cause}]},
    )


def _apply_json_patch(document: dict[str, Any], patch: Any) -> Any:
    if not isinstance(patch, list):
        raise status(400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    result: Any = copy.deepcopy(document)
    # One operation at a time, to say which one failed (the whole patch still applies or nothing does).
    for operation in patch:
        kind = operation.get("op") if isinstance(operation, dict) else None
        path = operation.get("path") if isinstance(operation, dict) else None
        try:
            result = jsonpatch.apply_patch(result, [operation])
        except jsonpatch.JsonPatchTestFailed:
            raise _unprocessable(f"testing value {path} failed: test failed") from None
        except jsonpatch.InvalidJsonPatch:
            raise _unprocessable(f"Unexpected kind: {kind}") from None
        except (
            jsonpatch.JsonPatchConflict,
            jsonpointer.JsonPointerException,
            KeyError,
            IndexError,
            TypeError,
        ):
            raise _unprocessable(
                f'{kind} operation does not apply: doc is missing path: "{path}": missing value'
            ) from None
    return result


def _apply_merge_patch(document: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(document) if isinstance(document, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _apply_merge_patch(result.get(key), value)
    return result


def _validate(name: str, node: Mapping[str, Any]) -> None:
    """The checks kube-apiserver's validation makes on what gpunode writes: labels and quantities."""
    causes: list[tuple[str, str]] = []
    labels = node["metadata"].get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise status(
            400,
            "BadRequest",
            "json: cannot unmarshal into Go struct field ObjectMeta.metadata.labels of type string",
        )
    for key, value in labels.items():
        prefix, _, label = key.rpartition("/")
        if not LABEL_NAME.match(label) or len(label) > 63 or (prefix and not DNS_SUBDOMAIN.match(prefix)):
            causes.append(
                (
                    "metadata.labels",
                    f'Invalid value: "{key}": name part must consist of alphanumeric characters',
                )
            )
        if len(value) > 63 or not LABEL_VALUE.match(value):
            causes.append(("metadata.labels", f'Invalid value: "{value}": {LABEL_VALUE_ERROR}'))
    for field in ("capacity", "allocatable"):
        for resource, quantity in (node.get("status", {}).get(field) or {}).items():
            text = str(quantity)
            if isinstance(quantity, bool) or not QUANTITY.match(text):
                causes.append((f"status.{field}[{resource}]", f'Invalid value: "{text}": {QUANTITY_ERROR}'))
    if not causes:
        return
    described = [f"{f}: {m}" for f, m in causes]
    summary = described[0] if len(described) == 1 else "[" + ", ".join(described) + "]"
    raise status(
        422,
        "Invalid",
        f'Node "{name}" is invalid: {summary}',
        {
            "name": name,
            "kind": "Node",
            "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes],
        },
    )


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], context: ssl.SSLContext | None
    ) -> None:
        self.ssl_context = context
        super().__init__(address, handler)

    def get_request(self) -> tuple[Any, Any]:
        sock, address = self.socket.accept()
        # http.server writes the headers and the body separately: without this, Nagle's algorithm holds the
        # body until the client's delayed ACK, 40 ms a request.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ssl_context is not None:
            # The handshake happens in the request's own thread: a client that never completes it must not
            # stall the accept loop.
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up (a timeout test) is no error of the server's


def _handler_for(server: ApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 10  # idle keep-alive connections end, so threads do not pile up

        def handle(self) -> None:
            if isinstance(self.connection, ssl.SSLSocket):
                try:
                    self.connection.do_handshake()
                except (ssl.SSLError, OSError):
                    return  # e.g. a client that does not trust our CA: it gave up, nothing to answer
            super().handle()

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            stream = server.next_stream(method, self.path, dict(self.headers.items()))
            if stream is not None:
                self.close_connection = True
                try:
                    if stream.kind == "reset":
                        # SO_LINGER 0: close() sends a RST, not an orderly FIN.
                        linger = struct.pack("ii", 1, 0)
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                        self.connection.close()
                    elif stream.kind == "trickle":
                        self._trickle(stream)
                    elif stream.kind == "raw":
                        self._raw(stream)
                    else:
                        self._flood(stream)
                except OSError:
                    pass  # the client hung up: what a hostile answer waits for
                return
            peer = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
            answer = server.handle(method, self.path, dict(self.headers.items()), body, peer)
            data = json.dumps(answer.body).encode()
            try:
                self.send_response(answer.code, HTTPStatus(answer.code).phrase)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-cache, private")
                for key, value in answer.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                self.close_connection = True  # the client is gone (it timed out)

        def _send(self, data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()
            server.count_streamed(len(data))

        def _trickle(self, stream: Stream) -> None:
            body_size = 2**20
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {body_size}\r\n\r\n".encode()
            if stream.phase == "headers":
                data = head
            else:
                self._send(head)
                data = b" " * body_size
            ends = time.monotonic() + stream.limit
            for index in range(len(data)):
                if time.monotonic() >= ends or server.stopping.is_set():
                    return
                self._send(data[index : index + 1])
                server.stopping.wait(stream.interval)

        def _status_line(self, stream: Stream) -> bytes:
            head = f"HTTP/1.1 {stream.code} {HTTPStatus(stream.code).phrase}\r\n"
            # Connection: close: the connection is closed after these answers, the client must not reuse it.
            head += "Content-Type: application/json\r\nConnection: close\r\n"
            head += "".join(f"{key}: {value}\r\n" for key, value in stream.headers)
            return head.encode()

        def _raw(self, stream: Stream) -> None:
            head = self._status_line(stream) + f"Content-Length: {len(stream.body)}\r\n\r\n".encode()
            self._send(head + stream.body)

        def _flood(self, stream: Stream) -> None:
            head = self._status_line(stream)
            if stream.announce is None:
                head += b"Transfer-Encoding: chunked\r\n\r\n"
            else:
                head += f"Content-Length: {stream.announce}\r\n\r\n".encode()
            self._send(head)
            chunk = b" " * 65536  # whitespace: valid JSON so far, so only its size can stop a client
            sent = 0
            while sent < stream.cap and not server.stopping.is_set():
                if stream.announce is None:
                    self._send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                else:
                    self._send(chunk)
                sent += len(chunk)

    return Handler
