"""A small Kubernetes API client for what gpunode does to its Node: read it, patch it, patch its status.

Built on requests (imported here, never at gpunode's import). Every call has a connect timeout, a read
timeout, and an overall deadline for the whole answer, whose size is bounded too (gpunode.kube.transport):
a server that trickles its answer or sends without end is cut off with a clear error.

Only an answer that says "try again" is retried, a bounded number of times with exponential backoff and
jitter: 429 and 500/502/503/504 (Retry-After honoured), and, for a GET (safe to send twice), a connection
the server reset or closed after the request was sent. A server that cannot be reached at all (connection
refused, a name that does not resolve, no route, no connection within the connect timeout) is final at
once, as kubectl gives up: trying again would only make the user wait, in a dry run too. A read timeout or
a missed deadline is not retried either, since a hung server would make the user wait the timeout again.
Read-modify-write operations (`update_node_status`, `update_node`) carry the resourceVersion they read,
so a concurrent writer makes the server answer 409, and the read, the computation and the write are then
done again.

Every failure is an ApiError whose message is one sentence naming what failed and why; the bearer token
never appears in a message, a log line or a repr — nor in the exceptions a message was made from, which
`--debug` prints: an error whose cause mentions a secret is raised without that cause.
"""

from __future__ import annotations

import copy
import email.utils
import http.client
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import socket
import ssl
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlsplit

import requests
import urllib3

from gpunode import __version__
from gpunode.errors import ApiError, CommandFailed, ConfigError, GpunodeError, UsageError
from gpunode.host import Host
from gpunode.kube import execplugin, transport
from gpunode.kube.credentials import Credentials, Pem, resolve_credentials
from gpunode.kube.redact import scrub as _scrub
from gpunode.kube.redact import secret_forms as _secret_forms
from gpunode.kube.transport import Answer

log = logging.getLogger("gpunode.kube")

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
# A Node object is a few KiB to a few hundred (kubelet lists at most 50 images in its status); an answer
# this large is not one, and reading it whole would only fill the memory.
MAX_ANSWER_BYTES = 16 * 2**20
# RFC 1123 subdomain, the rule for node names: also keeps "..", "/" and "?" out of the URL path.
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_FORBIDDEN = re.compile(r'User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<resource>[^"]*)"')
# NodeRestriction's refusal (an admission plugin, not RBAC): a kubelet writing another node.
_NODE_RESTRICTED = re.compile(r'node "(?P<own>[^"]*)" is not allowed to modify node "(?P<other>[^"]*)"')

_NODE_REFUSED = re.compile(r"node ['\"](?P<own>[^'\"]+)['\"] is not allowed to")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DRA_GROUP = "resource.k8s.io"
DRA_PATH = f"/apis/{DRA_GROUP}/v1"
# A page of a list: a node's slices fit in one (a few, up to 128 devices each). The page bound keeps a server
# that sends `continue` for ever from holding gpunode for ever.
LIST_PAGE = 500
MAX_LIST_PAGES = 20

JsonPatch = list[dict[str, Any]]


@dataclass(frozen=True)
class Timeouts:
    """Seconds to wait for the TCP/TLS connection, for each read of the answer, and for the whole request
    (connecting, the headers and the last byte of the body). `total` None is connect + read: a server
    that answers every read in time but never finishes is still cut off then. `read` and `total` both
    None: no limit but the connect timeout (kubectl's --request-timeout 0)."""

    connect: float = 5.0
    read: float | None = 30.0
    total: float | None = None

    @property
    def deadline(self) -> float | None:
        if self.total is not None:
            return self.total
        return None if self.read is None else self.connect + self.read

    @classmethod
    def for_request_timeout(cls, seconds: float | None) -> Timeouts:
        """The timeouts for kubectl's --request-timeout: None (not given) keeps the defaults, 0 means no
        timeout, else the whole request gets that long (and no single step longer)."""
        if seconds is None:
            return cls()
        if seconds == 0:
            return cls(read=None, total=None)
        return cls(connect=min(cls.connect, seconds), read=seconds, total=seconds)


@dataclass(frozen=True)
class RetryPolicy:
    """attempts: tries in all for one request (connection errors, 429, 5xx). backoff: the first wait,
    doubled after each try up to max_backoff, each wait drawn between half and all of it (jitter, so that
    many nodes do not retry in step). A Retry-After is waited instead, up to max_retry_after.
    conflict_attempts: read-modify-write rounds before a 409 is given up."""

    attempts: int = 5
    backoff: float = 0.5
    max_backoff: float = 8.0
    max_retry_after: float = 30.0
    conflict_attempts: int = 5


@dataclass(frozen=True)
class _Op:
    """What a request does, in RBAC's words, for messages: `patch` `nodes/status` of node `name`."""

    verb: str
    resource: str
    name: str
    group: str = ""  # "" for the core API (nodes, events); "resource.k8s.io" for DRA's objects
    namespace: str = ""

    @property
    def what(self) -> str:
        """The object for messages: `resourceslice "n1-gpu"`, `resourceclaim "ns/claim"`."""
        kind = self.resource.split("/")[0].removesuffix("es" if self.resource.endswith("sses") else "s")
        name = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f'{kind} "{name}"' if name else kind + "s"


class _Retry(Exception):
    """A transport failure worth another try, and what to say if it was the last one."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix


class KubeClient:
    """A session with one API server. Use as a context manager: closing it removes the private copies of
    inline certificates and keys (requests can only load them from files)."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        env: Mapping[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        host: Host | None = None,
    ) -> None:
        self.credentials = credentials
        self.server = credentials.server
        self.timeouts = timeouts or Timeouts()
        self.retry = retry or RetryPolicy()
        self._sleep = sleep
        self._token = credentials.token
        # An exec plugin runs through the host's runner (the real machine's when none is given), at the
        # first request that needs credentials.
        self._host = host
        self._plugin: execplugin.Authenticator | None = None
        self._plugin_credential: execplugin.PluginCredential | None = None
        self._plugin_files = 0
        self._tempdir: str | None = None
        self._session = transport.session()
        self._finalizer = weakref.finalize(self, _cleanup, self._session, None)
        # requests' environment handling would let ~/.netrc replace our Authorization header and
        # REQUESTS_CA_BUNDLE replace the cluster's CA; proxies are taken from the environment below instead.
        self._session.trust_env = False
        self._session.headers.update({"Accept": "application/json", "User-Agent": f"gpunode/{__version__}"})
        if credentials.impersonate_user:
            self._session.headers["Impersonate-User"] = credentials.impersonate_user
        if credentials.impersonate_groups:
            (self._session.headers["Impersonate-Group"],) = credentials.impersonate_groups
        self._verify: str | bool = True
        self._cert: tuple[str, str] | None = None
        if not credentials.plain_http:
            self._setup_tls()
        self._proxies = _proxies(self.server, credentials.proxy, os.environ if env is None else env)

    @classmethod
    def from_host(
        cls,
        host: Host,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        server: str | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
    ) -> KubeClient:
        """Credentials found the way kubectl finds them (gpunode.kube.credentials), env from the host."""
        credentials = resolve_credentials(host, kubeconfig=kubeconfig, context=context, server=server)
        return cls(credentials, timeouts=timeouts, retry=retry, env=host.env, host=host)

    def __repr__(self) -> str:
        return f"KubeClient({self.credentials!r})"

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()

    # -- the API ----------------------------------------------------------------------------------

    def get_node(self, name: str) -> dict[str, Any]:
        op = _Op("get", "nodes", name)
        return self._json(self._request("GET", _node_path(name), op), op)

    def patch_node_status(self, name: str, json_patch_ops: JsonPatch) -> dict[str, Any]:
        """Apply a JSON patch (RFC 6902) to the node's status subresource; the node as it is afterwards."""
        op = _Op("patch", "nodes/status", name)
        return self._json(
            self._request("PATCH", f"{_node_path(name)}/status", op, JSON_PATCH, _dumps(json_patch_ops)), op
        )

    def patch_node(self, name: str, merge_patch: dict[str, Any]) -> dict[str, Any]:
        """Apply a JSON merge patch (RFC 7386: null deletes) to the node; the node as it is afterwards."""
        op = _Op("patch", "nodes", name)
        return self._json(self._request("PATCH", _node_path(name), op, MERGE_PATCH, _dumps(merge_patch)), op)

    def create_event(self, namespace: str, event: dict[str, Any]) -> dict[str, Any]:
        """Create a core v1 Event (POST /api/v1/namespaces/NS/events); the Event as stored."""
        name = str(event.get("metadata", {}).get("name", ""))
        op = _Op("create", "events", name)
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/events"
        return self._json(self._request("POST", path, op, "application/json", _dumps(event)), op)

    def update_node_status(
        self, name: str, compute: Callable[[dict[str, Any]], JsonPatch | None]
    ) -> dict[str, Any]:
        """Read the node, let `compute` turn it into JSON patch operations for its status (None or [] when
        there is nothing to change), and send them, guarded by the resourceVersion that was read; when
        someone else wrote the node in between (409), do it all again with a fresh read."""
        op = _Op("patch", "nodes/status", name)

        def send(node: dict[str, Any], resource_version: str) -> Answer | None:
            ops = compute(node)
            if not ops:
                return None
            # The resourceVersion read, written back: the server answers 409 when the node has moved on
            # since. (A `test` op would fail with a 422 that cannot be told from a bad patch.)
            guarded = [
                {"op": "replace", "path": "/metadata/resourceVersion", "value": resource_version},
                *ops,
            ]
            return self._request("PATCH", f"{_node_path(name)}/status", op, JSON_PATCH, _dumps(guarded))

        return self._read_modify_write(op, send)

    def update_node(
        self, name: str, compute: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> dict[str, Any]:
        """`update_node_status` for a merge patch of the node itself (labels, annotations, taints: a merge
        patch replaces a whole list, which the resourceVersion guard makes safe)."""
        op = _Op("patch", "nodes", name)

        def send(node: dict[str, Any], resource_version: str) -> Answer | None:
            patch = compute(node)
            if not patch:
                return None
            metadata = patch.get("metadata")
            guarded = {**patch, "metadata": {**(metadata if isinstance(metadata, dict) else {})}}
            guarded["metadata"]["resourceVersion"] = resource_version
            return self._request("PATCH", _node_path(name), op, MERGE_PATCH, _dumps(guarded))

        return self._read_modify_write(op, send)

    # -- resource.k8s.io/v1: what a DRA driver does with the node's credentials ----------------------

    def list_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        """The ResourceSlices of `node` published by `driver`, every page of them. The field selector on
        spec.nodeName is what the Node authorizer requires of a kubelet's credentials for a list."""
        query = _slice_selector(node, driver)
        op = _Op("list", "resourceslices", "", DRA_GROUP)
        items: list[dict[str, Any]] = []
        token = ""
        for _ in range(MAX_LIST_PAGES):
            page = f"{query}&limit={LIST_PAGE}" + (f"&continue={quote(token, safe='')}" if token else "")
            response = self._request("GET", f"{DRA_PATH}/resourceslices?{page}", op)
            body = self._object(response, op, _slice_list_problem)
            items.extend(body["items"])
            token = str((body.get("metadata") or {}).get("continue") or "")
            if not token:
                return items
        raise ApiError(
            f'the server at {self.server} kept sending pages of ResourceSlices for node "{node}" after '
            f"{MAX_LIST_PAGES * LIST_PAGE} of them: a node has a few",
            f"check the server URL ({self.credentials.source}) and any proxy on the way",
        )

    def create_resource_slice(self, resource_slice: Mapping[str, Any]) -> dict[str, Any]:
        """Create a ResourceSlice (metadata.name, or metadata.generateName for the server to complete);
        the slice as stored."""
        name = str((resource_slice.get("metadata") or {}).get("name") or "")
        if name:
            _check_name(name, "ResourceSlice")
        op = _Op("create", "resourceslices", name, DRA_GROUP)
        body = _dumps(_typed(resource_slice, "ResourceSlice"))
        response = self._request("POST", f"{DRA_PATH}/resourceslices", op, "application/json", body)
        return self._object(response, op, _slice_problem)

    def update_resource_slice(self, resource_slice: Mapping[str, Any]) -> dict[str, Any]:
        """Replace a ResourceSlice (PUT) with this one, which carries the metadata.resourceVersion it was
        read with: a slice changed or deleted since is an ApiError (409 or 404), for the caller to list
        again, never overwritten. The slice as stored."""
        metadata = resource_slice.get("metadata") or {}
        name = _check_name(str(metadata.get("name") or ""), "ResourceSlice")
        if not metadata.get("resourceVersion"):
            raise UsageError(f'resourceslice "{name}" has no metadata.resourceVersion to update it from')
        op = _Op("update", "resourceslices", name, DRA_GROUP)
        body = _dumps(_typed(resource_slice, "ResourceSlice"))
        path = f"{DRA_PATH}/resourceslices/{quote(name, safe='')}"
        return self._object(self._request("PUT", path, op, "application/json", body), op, _slice_problem)

    def delete_resource_slice(self, name: str, uid: str | None = None) -> bool:
        """Delete one ResourceSlice; with `uid`, only if it is still that object (a slice of the same name
        made since by someone else stays). False when it was already gone."""
        _check_name(name, "ResourceSlice")
        op = _Op("delete", "resourceslices", name, DRA_GROUP)
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        path = f"{DRA_PATH}/resourceslices/{quote(name, safe='')}"
        response = self._request("DELETE", path, op, "application/json", _dumps(options))
        if response.status_code == 404 and _names_object(response, name):
            return False
        self._json(response, op)
        return True

    def delete_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        """Delete every ResourceSlice of `node` published by `driver` (deletecollection, with the field
        selector a kubelet's credentials need); the slices deleted."""
        op = _Op("deletecollection", "resourceslices", "", DRA_GROUP)
        path = f"{DRA_PATH}/resourceslices?{_slice_selector(node, driver)}"
        return list(self._object(self._request("DELETE", path, op), op, _slice_list_problem)["items"])

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A ResourceClaim, its allocation included (a node may read those of its own pods)."""
        _check_label(namespace, "namespace")
        _check_name(name, "ResourceClaim")
        op = _Op("get", "resourceclaims", name, DRA_GROUP, namespace)
        path = f"{DRA_PATH}/namespaces/{quote(namespace, safe='')}/resourceclaims/{quote(name, safe='')}"
        return self._object(self._request("GET", path, op), op, _claim_problem)

    def plan_device_class(
        self, device_class: Mapping[str, Any]
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """What apply_device_class would do now, with nothing written (`--dry-run`, and apply's own first
        step): (the DeviceClass there, or None when there is none; the object apply would send — the
        create's body, or the update's with the resourceVersion read — or None when the one there already
        carries this spec, these labels and annotations)."""
        metadata = device_class.get("metadata") or {}
        name = _check_name(str(metadata.get("name") or ""), "DeviceClass")
        wanted = _typed(device_class, "DeviceClass")
        read = _Op("get", "deviceclasses", name, DRA_GROUP)
        response = self._request("GET", f"{DRA_PATH}/deviceclasses/{quote(name, safe='')}", read)
        if response.status_code == 404 and _names_object(response, name):
            return None, wanted
        current = self._object(response, read, _class_problem)
        return current, _class_update(current, wanted)

    def apply_device_class(self, device_class: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create the DeviceClass, or make the one there carry this spec (and these labels and
        annotations; others it has are kept). Returns it as stored and whether anything was written.
        Read-modify-write: an update carries the resourceVersion read, and a 409 reads it again."""
        name = _check_name(str((device_class.get("metadata") or {}).get("name") or ""), "DeviceClass")
        attempts = max(1, self.retry.conflict_attempts)
        for attempt in range(1, attempts + 1):
            current, body = self.plan_device_class(device_class)
            if current is not None and body is None:
                return current, False
            if current is None:
                op = _Op("create", "deviceclasses", name, DRA_GROUP)
                response = self._request(
                    "POST", f"{DRA_PATH}/deviceclasses", op, "application/json", _dumps(body)
                )
            else:
                op = _Op("update", "deviceclasses", name, DRA_GROUP)
                path = f"{DRA_PATH}/deviceclasses/{quote(name, safe='')}"
                response = self._request("PUT", path, op, "application/json", _dumps(body))
            # 409: created by someone else since the read, or changed since it (a stale resourceVersion).
            if response.status_code != 409:
                return self._object(response, op, _class_problem), True
            log.info(
                "deviceclass %s changed while gpunode wrote it (409); reading it again (%d of %d)",
                name,
                attempt,
                attempts,
            )
        raise ApiError(
            f'deviceclass "{name}" kept changing while gpunode wrote it: all {attempts} attempts met a 409 '
            "Conflict from the Kubernetes API",
            "another controller is writing this DeviceClass; find it (`kubectl get deviceclass "
            f"{name} -o yaml --show-managed-fields`) and run gpunode again",
        )

    # -- internals --------------------------------------------------------------------------------

    def _object(
        self, response: Answer, op: _Op, problem: Callable[[Mapping[str, Any]], str | None]
    ) -> dict[str, Any]:
        """_json, and the answer's shape checked by `problem` (what it names, or None): a wrong one is an
        ApiError (exit 9) here, never a crash in the code that reads it."""
        body = self._json(response, op)
        found = problem(body)
        if found is not None:
            raise ApiError(
                f"the server at {_redact(response.url)} answered {found}, which no Kubernetes API server "
                "sends: is it one (or a proxy that changes answers)?",
                f"check the server URL ({self.credentials.source})",
            )
        return body

    def _read_modify_write(
        self, op: _Op, send: Callable[[dict[str, Any], str], Answer | None]
    ) -> dict[str, Any]:
        name = op.name
        attempts = max(1, self.retry.conflict_attempts)
        for attempt in range(1, attempts + 1):
            node = self.get_node(name)
            # compute() gets its own copy: what it changes in place must not leak into the next round.
            resource_version = str(node.get("metadata", {}).get("resourceVersion", ""))
            response = send(copy.deepcopy(node), resource_version)
            if response is None:
                return node
            if response.status_code != 409:
                return self._json(response, op)
            log.info(
                "node %s changed while gpunode updated it (409 Conflict); reading it again (%d of %d)",
                name,
                attempt,
                attempts,
            )
        raise ApiError(
            f'node "{name}" kept changing while gpunode updated it: all {attempts} attempts met a 409 '
            "Conflict from the Kubernetes API",
            "another controller is writing this node continuously; find it (`kubectl get node "
            f"{name} -o yaml --show-managed-fields`) and run gpunode again",
        )

    def _json(self, response: Answer, op: _Op) -> dict[str, Any]:
        """The object a successful answer carries; any other answer as an ApiError."""
        if response.status_code >= 300:
            # The server's own words are quoted: should they echo a credential, it is hidden there too.
            raise _scrubbed(self._status_error(response, op), self._secrets())
        try:
            body = response.json()
        except (ValueError, RecursionError):  # not JSON, or JSON nested thousands deep
            body = None
        if not isinstance(body, dict):
            raise ApiError(
                f"the server at {_redact(response.url)} answered {response.status_code} with something other "
                "than a Kubernetes object: is it a Kubernetes API server?",
                f"check the server URL ({self.credentials.source})",
            )
        if op.resource.startswith("nodes"):
            problem = _node_problem(body)
            if problem is not None:
                raise ApiError(
                    f"the server at {_redact(response.url)} answered a Node whose {problem}, which no "
                    "Kubernetes API server sends: is it one (or a proxy that changes answers)?",
                    f"check the server URL ({self.credentials.source})",
                )
        return body

    def _request(
        self, method: str, path: str, op: _Op, content_type: str | None = None, body: bytes | None = None
    ) -> Answer:
        """Send one request, retried as the module docstring says. Returns the final answer, whatever its
        status (_json turns an error status into an ApiError); raises ApiError when there is none."""
        url = self.server + path
        attempts = max(1, self.retry.attempts)
        reloaded_token = False
        attempt = 0
        while True:
            attempt += 1
            wait: float | None = None
            try:
                response = self._send_once(method, url, content_type, body)
            except _Retry as failure:
                if attempt >= attempts:
                    times = "" if attempts == 1 else f" (tried {attempts} times)"
                    raise ApiError(failure.message + times, failure.fix) from failure.__cause__
                what = failure.message
            else:
                if response.status_code == 401 and not reloaded_token and self._reload_token():
                    reloaded_token = True
                    attempt -= 1  # a rotated token is no failure of the server's
                    continue
                if response.status_code not in RETRIED_STATUSES or attempt >= attempts:
                    return response
                wait = _retry_after(response, self.retry.max_retry_after)
                what = f"{method} {_redact(url)} answered {response.status_code} {response.reason}"
            delay = wait if wait is not None else self._backoff(attempt)
            log.info("%s; trying again in %.2g s (attempt %d of %d)", what, delay, attempt + 1, attempts)
            self._sleep(delay)

    def _send_once(self, method: str, url: str, content_type: str | None, body: bytes | None) -> Answer:
        if self.credentials.exec_plugin is not None and not self.credentials.plain_http:
            self._use_plugin_credential(self._authenticator().credential())
        headers = {}
        if content_type is not None:
            headers["Content-Type"] = content_type
        if self._token is not None and not self.credentials.plain_http:
            headers["Authorization"] = f"Bearer {self._token}"
        start = time.monotonic()
        shown = _redact(url)
        deadline = self.timeouts.deadline
        failure: Exception
        cause: BaseException
        try:
            with warnings.catch_warnings():
                if self._verify is False:
                    # The kubeconfig asked for it, and resolution already warned once: not on every request.
                    warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                answer = transport.request(
                    self._session,
                    method,
                    url,
                    connect=self.timeouts.connect,
                    read=self.timeouts.read,
                    deadline=deadline,
                    max_bytes=MAX_ANSWER_BYTES,
                    options=transport.Options(
                        headers=headers,
                        data=body,
                        verify=self._verify,
                        cert=self._cert,
                        proxies=self._proxies,
                    ),
                )
        except transport.DeadlineExceeded as exc:
            cause = exc
            failure = ApiError(
                f"the Kubernetes API at {shown} did not send its whole answer within {exc.seconds:g} s",
                "check that the API server is healthy (`kubectl get --raw /readyz`) and that no proxy or "
                "load balancer between it and this node stalls its answers, then try again",
            )
        except transport.TooLarge as exc:
            cause = exc
            size = f" ({exc.declared} bytes)" if exc.declared is not None else ""
            failure = ApiError(
                f"the answer from {shown} is larger than {exc.limit // 2**20} MiB{size}, far larger than any "
                "Node object: it is not the Kubernetes API answering",
                f"check the server URL ({self.credentials.source}) and any proxy on the way",
            )
        except requests.exceptions.SSLError as exc:
            cause = exc
            failure = self._tls_error(shown, exc)
        except requests.exceptions.ConnectTimeout as exc:
            cause = exc
            failure = ApiError(
                f"cannot reach the Kubernetes API at {shown}: "
                f"no connection within {min(self.timeouts.connect, deadline or self.timeouts.connect):g} s",
                self._unreachable_fix(),
            )
        except requests.exceptions.ReadTimeout as exc:
            cause = exc
            failure = ApiError(
                f"the Kubernetes API at {shown} did not answer within {self.timeouts.read or 0:g} s",
                "check that the API server is healthy (`kubectl get --raw /readyz`), then try again",
            )
        except requests.exceptions.InvalidHeader as exc:
            # requests quotes the offending header value, which may be the bearer token: name it instead.
            cause = exc
            failure = ApiError(
                f"cannot send the request to the Kubernetes API at {shown}: a header value holds a line "
                "break or control character (the token or an impersonated name)",
                f"check the credentials from {self.credentials.source}",
            )
        except (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
            cause = exc
            message = f"cannot reach the Kubernetes API at {shown}: {_reason(exc)}"
            # Only a connection cut after the request went out may be a server in the middle of restarting;
            # a PATCH is not sent twice (the first may have been applied).
            if method == "GET" and _cut_after_sending(exc):
                failure = _Retry(message, self._unreachable_fix())
            else:
                failure = ApiError(message, self._unreachable_fix())
        except requests.exceptions.RequestException as exc:
            cause = exc
            failure = ApiError(f"cannot send the request to the Kubernetes API at {shown}: {_reason(exc)}")
        else:
            log.debug("%s %s -> %d (%.3f s)", method, shown, answer.status_code, time.monotonic() - start)
            return answer
        # Raised here, after the except clauses: an exception raised inside one would carry the caught
        # exception as its __context__ even without `from`, and --debug prints that chain.
        secrets = self._secrets()
        if _mentions(cause, secrets):
            _scrub_error(failure, secrets)
            raise failure
        raise failure from cause

    def _secrets(self) -> list[str]:
        """What must never be shown: the token (as it is now: it may have been re-read), the password of
        the server's or the proxy's URL."""
        found = [self._token or "", self.credentials.token or ""]
        if self._plugin_credential is not None:
            found.extend(self._plugin_credential.secrets())
        for url in (self.server, *self._proxies.values()):
            found.append(urlsplit(url).password or "")
        return [s for s in found if s]

    def _reload_token(self) -> bool:
        """Read a token file again after a 401: service account tokens are rotated under a running process.
        With an exec plugin: run it again, as client-go does after a 401."""
        if self.credentials.exec_plugin is not None:
            return self._refresh_plugin_credential()
        if self.credentials.reload_token is None:
            return False
        fresh = self.credentials.reload_token()
        if fresh is None or fresh == self._token:
            return False
        log.info(
            "the token from %s was rejected; using the token now in the file", self.credentials.token_file
        )
        self._token = fresh
        return True

    # -- exec plugins ---------------------------------------------------------------------------------

    def _authenticator(self) -> execplugin.Authenticator:
        if self._plugin is None:
            config = self.credentials.exec_plugin
            assert config is not None  # noqa: S101 (only called with a plugin)
            self._plugin = execplugin.authenticator(self._host or Host(), config)
        return self._plugin

    def _use_plugin_credential(self, credential: execplugin.PluginCredential) -> None:
        """Send what the plugin gave from now on: its token, its client certificate (written to this
        client's private directory, as inline kubeconfig keys are: requests loads certificates from files)."""
        if credential is self._plugin_credential:
            return
        cert: tuple[str, str] | None = None
        if credential.cert_pem is not None and credential.key_pem is not None:
            self._plugin_files += 1
            n = self._plugin_files
            cert = (
                self._file(Pem(origin=credential.origin, data=credential.cert_pem), f"exec-{n}.crt"),
                self._file(Pem(origin=credential.origin, data=credential.key_pem), f"exec-{n}.key"),
            )
            reason: str | None = None
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(*cert, password=lambda: b"")
            except (ssl.SSLError, OSError) as exc:
                reason = _ssl_reason(exc)
            if reason is not None:
                raise CommandFailed(
                    f"the client certificate and key from {credential.origin} cannot be used: {reason}",
                    "check the plugin's configuration; run it by hand to see what it prints",
                )
        if self._cert is not None and cert != self._cert:
            # Kept-alive connections were made with the old certificate: client-go closes them too.
            self._session.close()
        self._cert = cert
        self._token = credential.token
        self._plugin_credential = credential

    def _refresh_plugin_credential(self) -> bool:
        rejected = self._plugin_credential
        if rejected is None:
            return False
        failed: str | None = None
        try:
            fresh = self._authenticator().refresh(rejected)
        except GpunodeError as exc:
            failed = exc.message
        if failed is not None:
            # client-go logs this and returns the 401; so does gpunode, the 401 saying which credentials.
            log.warning("after a 401, running the exec plugin again failed: %s", failed)
            return False
        same = (fresh.token, fresh.cert_pem) == (rejected.token, rejected.cert_pem)
        self._use_plugin_credential(fresh)
        if same:
            return False
        log.info("the credentials from %s were rejected; using the ones it gave now", fresh.origin)
        return True

    def _backoff(self, attempt: int) -> float:
        delay = min(self.retry.max_backoff, self.retry.backoff * 2 ** (attempt - 1))
        jitter: float = random.uniform(0.5, 1.0)  # noqa: S311 (jitter, not cryptography)
        return float(delay) * jitter

    def _unreachable_fix(self) -> str:
        return (
            f"check that the API server is running and that {self.server} is its address "
            f"({self.credentials.source})"
        )

    # -- TLS --------------------------------------------------------------------------------------

    def _setup_tls(self) -> None:
        """requests wants file paths: inline PEM data goes to a private directory removed by close(). Both
        are loaded once here, so that a bad CA or a key that does not match its certificate is reported
        as such, not as an obscure handshake failure."""
        verify = self.credentials.verify
        self._verify = self._file(verify, "ca.crt") if isinstance(verify, Pem) else verify
        if self.credentials.cert is not None:
            cert, key = self.credentials.cert
            self._cert = (self._file(cert, "client.crt"), self._file(key, "client.key"))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if isinstance(verify, Pem) and isinstance(self._verify, str):
            try:
                context.load_verify_locations(cafile=self._verify)
            except (ssl.SSLError, OSError) as exc:
                self.close()
                raise ConfigError(
                    f"the certificate authority from {verify.origin} cannot be loaded: {_ssl_reason(exc)}"
                ) from exc
        if self._cert is not None and self.credentials.cert is not None:
            try:
                # An encrypted key would make OpenSSL prompt on the terminal; a password callback that gives
                # nothing makes it fail instead.
                context.load_cert_chain(self._cert[0], self._cert[1], password=lambda: b"")
            except (ssl.SSLError, OSError) as exc:
                self.close()
                cert, key = self.credentials.cert
                raise ConfigError(
                    f"the client certificate from {cert.origin} and key from {key.origin} cannot be used: "
                    f"{_ssl_reason(exc)}"
                ) from exc

    def _file(self, pem: Pem, name: str) -> str:
        if pem.path is not None:
            return str(pem.path)
        assert pem.data is not None  # noqa: S101 (a Pem has one or the other)
        if self._tempdir is None:
            self._tempdir = tempfile.mkdtemp(prefix="gpunode-kube-")  # mode 0700
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _cleanup, self._session, self._tempdir)
        path = os.path.join(self._tempdir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem.data)
        return path

    def _tls_error(self, url: str, exc: requests.exceptions.SSLError) -> ApiError:
        verification = _find_cause(exc, ssl.SSLCertVerificationError)
        verify = self.credentials.verify
        if verification is not None or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            detail = getattr(verification, "verify_message", None) or "the certificate is not trusted"
            if isinstance(verify, Pem):
                fix = (
                    f"the server's certificate must be signed by the CA from {verify.origin}: check that the "
                    f"kubeconfig belongs to the cluster at {self.server}"
                )
            else:
                fix = (
                    "give the cluster's CA (certificate-authority in the kubeconfig; kubeadm: "
                    "/etc/kubernetes/pki/ca.crt)"
                )
            return ApiError(
                f"cannot connect securely to the Kubernetes API at {url}: certificate verification failed "
                f"({detail})",
                fix,
            )
        return ApiError(
            f"cannot connect securely to the Kubernetes API at {url}: TLS handshake failed ({_reason(exc)})",
            f"check that {self.server} is the API server and that the credentials from "
            f"{self.credentials.source} belong to it",
        )

    # -- error statuses ---------------------------------------------------------------------------

    def _status_error(self, response: Answer, op: _Op) -> ApiError:
        status = _status_body(response)
        message = _one_line(str(status.get("message") or ""))
        details = status.get("details")
        details_name = details.get("name") if isinstance(details, dict) else None
        said = f": {message}" if message else ""
        code = response.status_code
        url = _redact(response.url)
        source = self.credentials.source

        if code == 401:
            return ApiError(
                f"the Kubernetes API at {self.server} rejected the credentials ({self.credentials.auth} from "
                f"{source}): 401 Unauthorized",
                "check that they belong to this cluster and have not expired or been revoked",
            )
        if op.group and code in (403, 404, 409, 422):
            return self._dra_status_error(response, op, status, message)
        if code == 403:
            return self._forbidden(op, message)
        if code == 404:
            if op.name and details_name == op.name:
                return ApiError(
                    f'node "{op.name}" does not exist in the cluster at {self.server}',
                    "check the name with `kubectl get nodes` (a node appears once its kubelet registered it)",
                )
            return ApiError(
                f"the server at {self.server} has no {urlsplit(url).path} (404 Not Found): "
                "is it a Kubernetes API server?",
                f"check the server URL ({source})",
            )
        if code == 422:
            return ApiError(
                f'the Kubernetes API rejected the change to node "{op.name}" as invalid: '
                f"{_causes(status, message)}"
            )
        if code == 409:
            return ApiError(
                f'the Kubernetes API refused the change to node "{op.name}": {message or "409 Conflict"}'
            )
        if code in RETRIED_STATUSES:
            return ApiError(
                f"the Kubernetes API at {url} answered {code} {response.reason} "
                f"{self.retry.attempts} times in a row{said}",
                "the API server is overloaded or unhealthy; try again later",
            )
        return ApiError(f"the Kubernetes API at {url} answered {code} {response.reason}{said}")

    def _dra_status_error(
        self, response: Answer, op: _Op, status: Mapping[str, Any], message: str
    ) -> ApiError:
        """403, 404, 409 and 422 about a resource.k8s.io object, in its own words."""
        code = response.status_code
        what = op.what
        if code == 403:
            return self._dra_forbidden(op, message)
        if code == 404:
            if op.name and _names_object(response, op.name):
                return ApiError(
                    f"{what} does not exist in the cluster at {self.server}",
                    "it was deleted meanwhile (kubelet deletes its node's ResourceSlices when it starts; a "
                    "claim goes with its pod): read it again"
                    if op.resource == "resourceslices"
                    else f"check it with `kubectl get {op.resource.split('/')[0]}"
                    + (f" -n {op.namespace}" if op.namespace else "")
                    + f" {op.name}`",
                )
            return ApiError(
                f"the Kubernetes API at {self.server} does not serve {op.group}/v1 {op.resource} (404 Not "
                "Found): Dynamic Resource Allocation needs Kubernetes 1.34 or later",
                "check `kubectl api-versions | grep resource.k8s.io` and the server URL "
                f"({self.credentials.source})",
            )
        if code == 409:
            if status.get("reason") == "AlreadyExists":
                return ApiError(
                    f"{what} already exists in the cluster at {self.server}",
                    "another writer created it: read it and update it instead",
                )
            return ApiError(
                f"the Kubernetes API refused to {op.verb} {what}: it changed since it was read "
                f"({message or '409 Conflict'})",
                "read it again and retry",
            )
        return ApiError(f"the Kubernetes API rejected {what} as invalid: {_causes(status, message)}")

    def _dra_forbidden(self, op: _Op, message: str) -> ApiError:
        """A 403 about a resource.k8s.io object: which credentials, and what they lack."""
        found = _FORBIDDEN.search(message)
        user, verb, resource = (
            (found["user"], found["verb"], found["resource"]) if found else ("", op.verb, op.resource)
        )
        reason = (
            message.split(" at the cluster scope: ", 1)[-1] if " at the cluster scope: " in message else ""
        )
        if not reason and '": ' in message.rsplit(" in the namespace ", 1)[-1]:
            reason = message.rsplit('": ', 1)[-1]
        who = f'user "{user}"' if user else "the credentials"
        sentence = (
            f"the Kubernetes API refused: {who} may not {verb} {resource}"
            f" ({op.what}; credentials from {self.credentials.source})"
            + (f": {reason}" if reason else (f": {message}" if not found and message else ""))
        )
        own = user.removeprefix("system:node:")
        restricted = _NODE_REFUSED.search(message)
        if restricted is not None:  # NodeRestriction: a node writing another node's slice
            own, user = restricted["own"], f"system:node:{restricted['own']}"
        if user == "system:anonymous":
            return ApiError(
                sentence, "the request carried no credentials the server accepts: pass --kubeconfig PATH"
            )
        if user and own != user:  # a kubelet's credentials: the Node authorizer decided
            if op.resource == "resourceslices":
                fix = (
                    f'a node\'s credentials manage only ResourceSlices with spec.nodeName "{own}" (and list '
                    f"or delete them only with the field selector spec.nodeName={own}): publish each node's "
                    "slices on that node, or use an admin kubeconfig"
                )
            elif op.resource.startswith("resourceclaims"):
                fix = (
                    "a node's credentials read only claims of pods bound to it: check that the pod using "
                    f'this claim is scheduled to node "{own}" '
                    f"(`kubectl get pods -n {op.namespace or 'NS'} -o wide`)"
                )
            else:
                fix = (
                    "a node's credentials cannot read or write DeviceClasses: apply them with an admin "
                    "kubeconfig (--kubeconfig PATH)"
                )
            return ApiError(sentence, fix)
        account = user.removeprefix("system:serviceaccount:")
        subject = f"--serviceaccount={account}" if account != user else f"--user={user or 'USER'}"
        plain = resource.split("/")[0]
        return ApiError(
            sentence,
            f"grant it: `kubectl create clusterrole gpunode-dra --verb={verb} --resource={plain}.{op.group}` "
            f"and `kubectl create clusterrolebinding gpunode-dra --clusterrole=gpunode-dra {subject}`",
        )

    def _forbidden(self, op: _Op, message: str) -> ApiError:
        restricted = _NODE_RESTRICTED.search(message)
        if restricted is not None:
            own, other = restricted["own"], restricted["other"]
            return ApiError(
                f'the Kubernetes API refused: node "{own}"\'s kubelet credentials (from '
                f'{self.credentials.source}) may not modify node "{other}" (NodeRestriction)',
                f"a kubelet's credentials may change only their own node (\"{own}\"): give the node's name "
                f'as "{own}" (--node, node-name), run gpunode on node "{other}", or use an admin kubeconfig',
            )
        found = _FORBIDDEN.search(message)
        if found is None:
            return ApiError(
                f'the Kubernetes API refused to {op.verb} {op.resource} "{op.name}" for the credentials from '
                f"{self.credentials.source}{': ' + message if message else ''}"
            )
        user, verb, resource = found["user"], found["verb"], found["resource"]
        sentence = (
            f'the Kubernetes API refused: user "{user}" may not {verb} {resource} (node "{op.name}"; '
            f"credentials from {self.credentials.source})"
        )
        if user == "system:anonymous":
            return ApiError(
                sentence, "the request carried no credentials the server accepts: pass --kubeconfig PATH"
            )
        own = user.removeprefix("system:node:")
        if own not in (user, op.name):  # a kubelet identity, of another node
            return ApiError(
                sentence,
                f'a kubelet\'s credentials may change only their own node ("{own}"): '
                "run gpunode on that node, or use an admin kubeconfig",
            )
        account = user.removeprefix("system:serviceaccount:")
        subject = f"--serviceaccount={account}" if account != user else f"--user={user}"
        if not resource.startswith("nodes"):  # e.g. impersonate users, for a kubeconfig's `as`
            return ApiError(sentence, f"grant {user} the verb {verb} on {resource}, or use other credentials")
        return ApiError(
            sentence,
            "grant it: `kubectl create clusterrole gpunode-node --verb=get,patch "
            "--resource=nodes,nodes/status` and `kubectl create clusterrolebinding gpunode-node "
            f"--clusterrole=gpunode-node {subject}`",
        )


def _mentions(exc: BaseException, secrets: list[str]) -> bool:
    """Whether any exception in exc's chain (causes, contexts, reasons, arguments) shows a secret."""
    forms = [form for secret in secrets for form in _secret_forms(secret)]
    if not forms:
        return False
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        try:
            text = f"{current}\n{current.args!r}"
        except Exception:  # an exception whose str() fails: assume the worst
            return True
        if any(form in text for form in forms):
            return True
        nested = [current.__cause__, current.__context__, getattr(current, "reason", None), *current.args]
        pending.extend(e for e in nested if isinstance(e, BaseException))
    return False


def _scrub_error(error: Exception, secrets: list[str]) -> None:
    if isinstance(error, _Retry):
        error.message, error.fix = _scrub(error.message, secrets), _scrub(error.fix, secrets)
        error.args = (error.message,)
    elif isinstance(error, GpunodeError):
        error.message = _scrub(error.message, secrets)
        error.fix = _scrub(error.fix, secrets) if error.fix is not None else None
        error.args = (error.message,)


def _scrubbed(error: ApiError, secrets: list[str]) -> ApiError:
    _scrub_error(error, secrets)
    return error


def _cleanup(session: requests.Session, tempdir: str | None) -> None:
    session.close()
    if tempdir is not None:
        shutil.rmtree(tempdir, ignore_errors=True)


def _check_name(name: str, kind: str) -> str:
    """An object name as the API requires it (RFC 1123 subdomain): also keeps "..", "/" and "?" out of
    the URL path."""
    if not name or len(name) > 253 or not _NODE_NAME.match(name):
        raise UsageError(f"{name!r} is not a valid {kind} name (lower-case letters, digits, '-' and '.')")
    return name


def _check_label(name: str, what: str) -> str:
    if not name or len(name) > 63 or not _DNS_LABEL.match(name):
        raise UsageError(f"{name!r} is not a valid {what} (lower-case letters, digits and '-', at most 63)")
    return name


def _slice_selector(node: str, driver: str) -> str:
    _check_name(node, "node")
    if len(driver) > 63:
        raise UsageError(
            f"{driver!r} is not a valid DRA driver name (a DNS subdomain of at most 63 characters)"
        )
    _check_name(driver, "DRA driver")
    return "fieldSelector=" + quote(f"spec.nodeName={node},spec.driver={driver}", safe="")


def _typed(obj: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The object with its apiVersion and kind, as the server decodes a body."""
    return {**copy.deepcopy(dict(obj)), "apiVersion": f"{DRA_GROUP}/v1", "kind": kind}


def _names_object(response: Answer, name: str) -> bool:
    """Whether a 404 is about that object (details.name), not about a path the server does not serve."""
    details = _status_body(response).get("details")
    return isinstance(details, dict) and details.get("name") == name


def _class_update(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any] | None:
    """The DeviceClass to PUT so that `current` carries `wanted`'s spec, labels and annotations (others
    kept); None when it already does."""
    merged = copy.deepcopy(dict(current))
    metadata = merged.setdefault("metadata", {})
    wanted_metadata = wanted.get("metadata") or {}
    for field in ("labels", "annotations"):
        extra = wanted_metadata.get(field) or {}
        if extra:
            metadata[field] = {**(metadata.get(field) or {}), **extra}
    merged["spec"] = copy.deepcopy(wanted.get("spec") or {})
    merged["apiVersion"], merged["kind"] = f"{DRA_GROUP}/v1", "DeviceClass"
    return (
        None if merged == {**current, "apiVersion": merged["apiVersion"], "kind": "DeviceClass"} else merged
    )


def _metadata_problem(obj: Mapping[str, Any], kind: str) -> str | None:
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict):
        return f"a {kind} without a metadata object"
    for field in ("name", "uid", "resourceVersion"):
        if not isinstance(metadata.get(field), str) or not metadata[field]:
            return f"a {kind} whose metadata.{field} is not a string"
    if not isinstance(obj.get("spec"), dict):
        return f"a {kind} whose spec is not an object"
    return None


def _slice_problem(obj: Mapping[str, Any]) -> str | None:
    """What makes this no ResourceSlice a driver can read (the fields it compares); None if nothing."""
    problem = _metadata_problem(obj, "ResourceSlice")
    if problem is not None:
        return problem
    spec = obj["spec"]
    if not isinstance(spec.get("driver"), str):
        return "a ResourceSlice whose spec.driver is not a string"
    pool = spec.get("pool")
    if not isinstance(pool, dict) or not isinstance(pool.get("name"), str):
        return "a ResourceSlice whose spec.pool.name is not a string"
    for field in ("generation", "resourceSliceCount"):
        value = pool.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"a ResourceSlice whose spec.pool.{field} is not an integer"
    devices = spec.get("devices")
    if devices is not None and not (
        isinstance(devices, list)
        and all(isinstance(d, dict) and isinstance(d.get("name"), str) for d in devices)
    ):
        return "a ResourceSlice whose spec.devices is not a list of named devices"
    return None


def _slice_list_problem(body: Mapping[str, Any]) -> str | None:
    items = body.get("items")
    if not isinstance(items, list):
        return "a ResourceSliceList whose items is not a list"
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return "a ResourceSliceList whose metadata is not an object"
    if not isinstance((metadata or {}).get("continue", ""), str):
        return "a ResourceSliceList whose metadata.continue is not a string"
    for index, item in enumerate(items):
        problem = _slice_problem(item) if isinstance(item, dict) else "a ResourceSlice that is not an object"
        if problem is not None:
            return f"items[{index}]: {problem}"
    return None


def _claim_problem(claim: Mapping[str, Any]) -> str | None:
    """What makes this no ResourceClaim Prepare can read (metadata, the allocation's results and config,
    reservedFor); None if nothing."""
    problem = _metadata_problem(claim, "ResourceClaim")
    if problem is not None:
        return problem
    claim_status = claim.get("status")
    if claim_status is None:
        return None
    if not isinstance(claim_status, dict):
        return "a ResourceClaim whose status is not an object"
    reserved = claim_status.get("reservedFor")
    if reserved is not None and not (
        isinstance(reserved, list) and all(isinstance(r, dict) for r in reserved)
    ):
        return "a ResourceClaim whose status.reservedFor is not a list of objects"
    allocation = claim_status.get("allocation")
    if allocation is None:
        return None
    devices = allocation.get("devices") if isinstance(allocation, dict) else None
    if not isinstance(devices, dict):
        return "a ResourceClaim whose status.allocation.devices is not an object"
    results = devices.get("results")
    if results is not None:
        if not isinstance(results, list):
            return "a ResourceClaim whose status.allocation.devices.results is not a list"
        for index, result in enumerate(results):
            if not isinstance(result, dict) or not all(
                isinstance(result.get(f), str) for f in ("request", "driver", "pool", "device")
            ):
                return (
                    f"a ResourceClaim whose status.allocation.devices.results[{index}] lacks request, "
                    "driver, pool or device strings"
                )
    config = devices.get("config")
    if config is not None:
        if not isinstance(config, list):
            return "a ResourceClaim whose status.allocation.devices.config is not a list"
        for index, entry in enumerate(config):
            opaque = entry.get("opaque") if isinstance(entry, dict) else None
            requests_ = entry.get("requests") if isinstance(entry, dict) else None
            if (
                not isinstance(entry, dict)
                or (
                    opaque is not None
                    and not (isinstance(opaque, dict) and isinstance(opaque.get("driver"), str))
                )
                or (
                    requests_ is not None
                    and not (isinstance(requests_, list) and all(isinstance(r, str) for r in requests_))
                )
            ):
                return f"a ResourceClaim whose status.allocation.devices.config[{index}] is malformed"
    return None


def _class_problem(device_class: Mapping[str, Any]) -> str | None:
    return _metadata_problem(device_class, "DeviceClass")


def _node_path(name: str) -> str:
    if len(name) > 253 or not _NODE_NAME.match(name):
        raise UsageError(f"{name!r} is not a valid node name (lower-case letters, digits, '-' and '.')")
    return f"/api/v1/nodes/{quote(name, safe='')}"


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _redact(url: str) -> str:
    """A URL for messages: without user:password@, should a server URL carry one."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _node_problem(node: Mapping[str, Any]) -> str | None:
    """What makes this answer no Node gpunode can read (the API's schema: metadata and status objects,
    labels, annotations, capacity and allocatable maps of strings, conditions a list); None if nothing.
    Checked here once, so that a bad answer is an API error (exit 9), not a crash in each reader."""
    for part in ("metadata", "status"):
        value = node.get(part)
        if value is not None and not isinstance(value, dict):
            return f"{part} is not an object"
    for part, field in (
        ("metadata", "labels"),
        ("metadata", "annotations"),
        ("status", "capacity"),
        ("status", "allocatable"),
    ):
        value = (node.get(part) or {}).get(field)
        if value is None:
            continue
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            return f"{part}.{field} is not a map of strings"
    conditions = (node.get("status") or {}).get("conditions")
    if conditions is not None and not (
        isinstance(conditions, list) and all(isinstance(c, dict) for c in conditions)
    ):
        return "status.conditions is not a list of objects"
    return None


def _status_body(response: Answer) -> dict[str, Any]:
    """The Kubernetes Status an error answer carries; {} for anything else (a proxy's HTML page)."""
    try:
        body = response.json()
    except (ValueError, RecursionError):  # not JSON, or JSON nested thousands deep
        return {}
    return body if isinstance(body, dict) else {}


def _causes(status: Mapping[str, Any], message: str) -> str:
    details = status.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    described = []
    for cause in causes if isinstance(causes, list) else []:
        if not isinstance(cause, dict) or not cause.get("message"):
            continue
        field = cause.get("field")
        described.append(f"{field}: {cause['message']}" if field else str(cause["message"]))
    # The generic "the server rejected our request…" says nothing the causes do not; a specific message
    # ("Node "n1" is invalid: …") already quotes them.
    if described and (not message or message.startswith("the server rejected our request")):
        return _one_line("; ".join(described))
    return message or "422 Unprocessable Entity"


def _retry_after(response: Answer, cap: float) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), cap)


def _find_cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of `kind` in exc's chain: requests wraps urllib3's, which wraps the socket's."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        nested = [current.__cause__, current.__context__, getattr(current, "reason", None), *current.args]
        pending.extend(e for e in nested if isinstance(e, BaseException))
    return None


def _cut_after_sending(exc: BaseException) -> bool:
    """Whether a transport failure is the server resetting or closing a connection it had accepted (the
    request sent, no whole answer back), rather than no connection at all (refused, DNS, no route)."""
    if isinstance(exc, requests.exceptions.ChunkedEncodingError):
        return True
    if _find_cause(exc, ConnectionRefusedError) is not None or _find_cause(exc, socket.gaierror) is not None:
        return False
    if isinstance(exc, requests.exceptions.ProxyError):
        return False
    if _find_cause(exc, ConnectionResetError) is not None:
        return True
    if _find_cause(exc, http.client.RemoteDisconnected) is not None:
        return True
    text = str(exc)
    return "RemoteDisconnected" in text or "Connection aborted" in text


def _reason(exc: BaseException) -> str:
    """The underlying reason for a transport failure, in a few words."""
    if _find_cause(exc, ConnectionRefusedError) is not None:
        return "connection refused"
    if _find_cause(exc, socket.gaierror) is not None:
        return "the host name does not resolve"
    if _find_cause(exc, ConnectionResetError) is not None:
        return "connection reset by the server"
    ssl_error = _find_cause(exc, ssl.SSLError)
    if ssl_error is not None:
        return _ssl_reason(ssl_error)
    os_error = _find_cause(exc, OSError)
    if os_error is not None and isinstance(os_error, OSError) and os_error.strerror:
        return os_error.strerror[0].lower() + os_error.strerror[1:]
    text = str(exc)
    if "RemoteDisconnected" in text or "Connection aborted" in text:
        return "the server closed the connection without answering"
    return _one_line(text, 160)


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return _one_line(str(exc), 160)


# -- proxies ------------------------------------------------------------------------------------


def _proxies(server: str, proxy_url: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """The proxy to reach `server` through, as client-go picks it: the cluster's proxy-url, else
    HTTPS_PROXY / HTTP_PROXY less NO_PROXY; never for localhost or a loopback address."""
    parts = urlsplit(server)
    scheme = parts.scheme
    if proxy_url:
        return {scheme: proxy_url}
    chosen = env.get(f"{scheme}_proxy") or env.get(f"{scheme.upper()}_PROXY")
    if not chosen or _bypasses_proxy(parts.hostname or "", parts.port, env):
        return {}
    return {scheme: chosen}


def _bypasses_proxy(hostname: str, port: int | None, env: Mapping[str, str]) -> bool:
    host = hostname.lower()
    address: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if host == "localhost" or (address is not None and address.is_loopback):
        return True
    for raw in (env.get("no_proxy") or env.get("NO_PROXY") or "").split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            network = None
        if network is not None:
            if address is not None and address in network:
                return True
            continue
        name, _, entry_port = entry.partition(":") if entry.count(":") == 1 else (entry, "", "")
        if entry_port and str(port) != entry_port:
            continue
        name = name.lstrip("*")
        if name.startswith("."):
            if host.endswith(name):
                return True
        elif host == name or host.endswith("." + name):
            return True
    return False
