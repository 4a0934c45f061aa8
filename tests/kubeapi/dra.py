"""resource.k8s.io/v1 for the test API server (tests/kubeapi/apiserver.py): ResourceSlices, ResourceClaims,
DeviceClasses, and the Pods that tie claims to nodes — as kube-apiserver 1.36 serves them to a DRA driver
(../shared/specs/dra-kubelet-plugin.md, sections 4-7).

- ResourceSlices (cluster-scoped): create (name or generateName), get, list with a fieldSelector on
  `spec.nodeName` / `spec.driver` (=, ==, !=; another field is 400 as the real server says) and
  `limit`/`continue` paging, update (PUT), patch (merge or JSON patch), delete (with a `preconditions.uid`
  / `resourceVersion` in DeleteOptions: 409 when they do not hold), deletecollection with a fieldSelector.
  No watch (the test server watches nothing, Nodes neither): `?watch=1` is 405.
- Validation as pkg/apis/resource/validation does for what a driver sends (422 Invalid, a Status whose
  message and causes say `field: Invalid value: ...`): driver a DNS subdomain <= 63, pool name <= 253 made of
  DNS subdomains, generation >= 0, resourceSliceCount > 0, exactly one of nodeName / nodeSelector (one term) /
  allNodes / perDeviceNodeSelection, devices or sharedCounters (not both), <= 128 devices (<= 64 when any has
  taints or consumesCounters), device names DNS labels unique in the slice (uniqueness across the slices of
  a pool is the allocator's check, not the API's), <= 32 attribute and capacity keys with the key rules
  (C identifier <= 32, or `<DNS subdomain <= 63>/<identifier>`), an attribute exactly one of int / bool /
  string (<= 64) / version (semver <= 64), a capacity a quantity (requestPolicy only with
  allowMultipleAllocations), <= 16 taints with key, value and effect None | NoSchedule | NoExecute; driver,
  pool.name and nodeName immutable. A value of the wrong JSON type is 400, as Go's decoder refuses it.
- ResourceClaims (namespaced): create, get, list (admin), update of spec (PUT) and of status (PUT
  .../status). `allocate_claim` writes a claim as the scheduler leaves it: allocated (results, config,
  nodeSelector) and reserved for a pod bound to the node.
- DeviceClasses (cluster-scoped): create, get, list, update (PUT), patch; selectors <= 32 CEL expressions,
  config <= 32 opaque entries, extendedResourceName a qualified name.
- resourceVersion from the server's one counter, bumped on each write that changes the object (a write
  that changes nothing writes nothing); metadata.generation 1 at create, +1 when the spec changes; a stale
  resourceVersion is 409 Conflict, a missing one on update 422.
- Authorization: a `system:node:<name>` user is judged as the Node authorizer and NodeRestriction judge it
  (the RBAC table does not apply to it here, since no bootstrap role grants nodes anything in this group):
  slices only with `spec.nodeName` its own (create, get, update, patch, delete), list / deletecollection only
  with the field selector `spec.nodeName=<node>`; a claim `get` only when a pod bound to the node
  references it (`add_pod`, `bind_claim_to_node`, `allocate_claim`); no claim list or status; no
  DeviceClass at all. Everyone else through the server's RBAC-like table, resources named
  `resourceslices`, `resourceclaims`, `resourceclaims/status`, `deviceclasses`. Refusals are 403 Forbidden
  Statuses worded as the real authorizers word them.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

from tests.kubeapi.apiserver import (
    DNS_SUBDOMAIN,
    JSON_PATCH,
    LABEL_NAME,
    LABEL_VALUE,
    MERGE_PATCH,
    QUANTITY,
    UNSUPPORTED_MEDIA,
    _Answer,
    _apply_json_patch,
    _apply_merge_patch,
    status,
)

if TYPE_CHECKING:
    from tests.kubeapi.apiserver import ApiServer

GROUP = "resource.k8s.io"
VERSION = "v1"
PREFIX = f"/apis/{GROUP}/{VERSION}"
PATH = re.compile(
    rf"^{re.escape(PREFIX)}(?:/namespaces/(?P<namespace>[^/]+))?/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?P<sub>/status)?)?$"
)
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")
MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64
MAX_ATTRIBUTES = 32
MAX_TAINTS = 16
SLICE_FIELDS = ("spec.nodeName", "spec.driver")
DNS1123_SUBDOMAIN_ERROR = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
DNS1123_LABEL_ERROR = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
    "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)


@dataclass(frozen=True)
class Kind:
    resource: str  # the plural, as RBAC and URLs name it
    kind: str
    namespaced: bool


SLICES = Kind("resourceslices", "ResourceSlice", namespaced=False)
CLAIMS = Kind("resourceclaims", "ResourceClaim", namespaced=True)
CLASSES = Kind("deviceclasses", "DeviceClass", namespaced=False)
KINDS = {k.resource: k for k in (SLICES, CLAIMS, CLASSES)}

Key = tuple[str, str, str]  # (resource, namespace or "", name)


@dataclass(frozen=True)
class Request:
    """What one request asks, in the authorizer's words."""

    verb: str  # get list create update patch delete deletecollection
    kind: Kind
    namespace: str
    name: str
    sub: str  # "" or "status"
    selector: tuple[tuple[str, str, str], ...]  # (field, operator "=" or "!=", value)

    @property
    def rbac_resource(self) -> str:
        return f"{self.kind.resource}/{self.sub}" if self.sub else self.kind.resource


class DraStore:
    """The objects and their rules; `server` gives the RBAC table and the revision counter."""

    def __init__(self, server: ApiServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._objects: dict[Key, dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}

    # -- the test's controls ------------------------------------------------------------------------

    def add_pod(self, namespace: str, name: str, node: str | None, claims: tuple[str, ...] = ()) -> str:
        """A pod (bound to `node` when given) whose status names the ResourceClaims it uses, as the
        resourceclaim controller writes `status.resourceClaimStatuses`; the edge the Node authorizer
        follows. Returns its UID."""
        pod: dict[str, Any] = {
            "metadata": {"namespace": namespace, "name": name, "uid": str(uuid.uuid4())},
            "spec": {"nodeName": node} if node else {},
            "status": {
                "resourceClaimStatuses": [
                    {"name": f"claim-{i}", "resourceClaimName": claim} for i, claim in enumerate(claims)
                ]
            },
        }
        with self._lock:
            self._pods[(namespace, name)] = pod
            return str(pod["metadata"]["uid"])

    def bind_claim_to_node(self, namespace: str, claim: str, node: str, pod: str | None = None) -> str:
        """A pod bound to `node` that uses `claim` (pod name `pod`, or `<claim>-pod`); its UID."""
        return self.add_pod(namespace, pod or f"{claim}-pod", node, (claim,))

    def unbind_pod(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._pods.pop((namespace, pod), None)

    def allocate_claim(
        self,
        namespace: str,
        name: str,
        *,
        node: str,
        driver: str,
        devices: tuple[str, ...],
        pool: str | None = None,
        request: str = "gpu",
        device_class: str = "gpu.nvidia.com",
        config: tuple[Mapping[str, Any], ...] = (),
        admin_access: bool = False,
        pod: str | None = None,
    ) -> dict[str, Any]:
        """A ResourceClaim as it is when kubelet reads it: created, allocated by the scheduler (one result
        per device of `devices` in pool `pool` — the node's name by default — for request `request`;
        `config` the opaque parameters, each `{"driver": ..., "parameters": {...}}`, class entries first as
        the scheduler copies them), reserved for a pod bound to `node`, which this creates."""
        pod_name = pod or f"{name}-pod"
        pod_uid = self.bind_claim_to_node(namespace, name, node, pod_name)
        results = [
            {"request": request, "driver": driver, "pool": pool or node, "device": device}
            | ({"adminAccess": True} if admin_access else {})
            for device in devices
        ]
        claim = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": request,
                            "exactly": {
                                "deviceClassName": device_class,
                                "allocationMode": "ExactCount",
                                "count": len(devices),
                            }
                            | ({"adminAccess": True} if admin_access else {}),
                        }
                    ]
                }
            },
            "status": {
                "allocation": {
                    "devices": {
                        "results": results,
                        "config": [
                            {"source": "FromClass", "requests": [], "opaque": dict(entry)} for entry in config
                        ],
                    },
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                        ]
                    },
                },
                "reservedFor": [{"resource": "pods", "name": pod_name, "uid": pod_uid}],
            },
        }
        with self._lock:
            return self._create(CLAIMS, namespace, claim)

    def put(self, kind: Kind, obj: Mapping[str, Any], namespace: str = "") -> dict[str, Any]:
        """Store an object as an admin would create it (validated; 422 raises ValueError here)."""
        with self._lock:
            try:
                return self._create(kind, namespace, copy.deepcopy(dict(obj)))
            except _Answer as refused:
                raise ValueError(refused.body.get("message")) from None

    def get(self, kind: Kind, name: str, namespace: str = "") -> dict[str, Any] | None:
        with self._lock:
            found = self._objects.get((kind.resource, namespace, name))
            return copy.deepcopy(found) if found is not None else None

    def items(self, kind: Kind) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(o) for (r, _, _), o in sorted(self._objects.items()) if r == kind.resource]

    def remove(self, kind: Kind, name: str, namespace: str = "") -> None:
        """Delete as another client would (kubelet wiping the node's slices)."""
        with self._lock:
            self._objects.pop((kind.resource, namespace, name), None)

    # -- handling -----------------------------------------------------------------------------------

    def route(  # noqa: PLR0917 (the request's parts, as ApiServer._route takes them)
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes, user: str
    ) -> _Answer:
        match = PATH.match(path)
        kind = KINDS.get(unquote(match["resource"])) if match else None
        if match is None or kind is None:
            raise status(404, "NotFound", "the server could not find the requested resource")
        namespace = unquote(match["namespace"] or "")
        if kind.namespaced != bool(namespace) and not (
            kind.namespaced and method == "GET" and not match["name"]
        ):
            raise status(404, "NotFound", "the server could not find the requested resource")
        name = unquote(match["name"] or "")
        sub = "status" if match["sub"] else ""
        if sub and kind is not CLAIMS:
            raise status(404, "NotFound", "the server could not find the requested resource")
        params = parse_qs(query, keep_blank_values=True)
        if params.get("watch", ["false"])[-1] not in ("false", "0", ""):
            raise status(405, "MethodNotAllowed", "this test API server does not serve watches")
        verbs = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
        verb = verbs.get(method)
        if verb is None or (verb == "create" and name):
            raise status(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        if not name and verb == "get":
            verb = "list"
        if not name and verb == "delete":
            verb = "deletecollection"
        if not name and verb in ("update", "patch"):
            raise status(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        selector = _field_selector(kind, params.get("fieldSelector", [""])[-1])
        request = Request(verb, kind, namespace, name, sub, selector)
        document = _decode(method, headers, body) if verb in ("create", "update", "patch") else None
        self._authorize(user, request, document)
        if verb == "get":
            return _Answer(200, self._read(request))
        if verb == "list":
            return _Answer(200, self._list(request, params))
        if verb == "create":
            with self._lock:
                return _Answer(201, self._create(kind, namespace, document))
        if verb in ("update", "patch"):
            return _Answer(200, self._write(request, headers, document))
        if verb == "delete":
            return _Answer(200, self._delete(request, body))
        return _Answer(200, self._delete_collection(request))

    # -- authorization -------------------------------------------------------------------------------

    def _authorize(self, user: str, request: Request, document: Any) -> None:
        own = user.removeprefix("system:node:")
        if own == user:
            if not self._server._allowed(user, request.verb, request.rbac_resource):
                raise _forbidden(user, request, "")
            return
        if request.kind is CLASSES:
            raise _forbidden(user, request, "")
        if request.kind is CLAIMS:
            if request.sub:
                raise _forbidden(user, request, "cannot get subresource")  # the authorizer's own words
            if request.verb != "get":
                raise _forbidden(user, request, "can only get individual resources of this type")
            if not self._claim_used_on(own, request.namespace, request.name):
                raise _forbidden(user, request, f"no relationship found between node '{own}' and this object")
            return
        if request.verb in ("list", "deletecollection"):
            if ("spec.nodeName", "=", own) not in request.selector:
                raise _forbidden(
                    user,
                    request,
                    "can only list/watch/deletecollection resourceslices with nodeName field selector",
                )
            return
        if request.verb == "create":
            node = _get(document, "spec", "nodeName")
            if node != own:
                # NodeRestriction, after the authorizer let the create through.
                raise status(
                    403,
                    "Forbidden",
                    f'resourceslices.{GROUP} "{_get(document, "metadata", "name") or ""}" is forbidden: '
                    f"node {own!r} is not allowed to create a ResourceSlice for node {node or ''!r}",
                    {"kind": "resourceslices", "group": GROUP},
                )
            return
        with self._lock:
            stored = self._objects.get(("resourceslices", "", request.name))
            node = _get(stored, "spec", "nodeName")
        if stored is not None and node != own:
            raise _forbidden(user, request, f"no relationship found between node '{own}' and this object")
        if request.verb in ("update", "patch") and _get(document, "spec", "nodeName") not in (None, own):
            # A node moving its slice to another node: immutable anyway, refused by NodeRestriction first.
            raise _forbidden(user, request, f"no relationship found between node '{own}' and this object")

    def _claim_used_on(self, node: str, namespace: str, claim: str) -> bool:
        with self._lock:
            for (pod_namespace, _), pod in self._pods.items():
                if pod_namespace != namespace or pod["spec"].get("nodeName") != node:
                    continue
                statuses = pod["status"].get("resourceClaimStatuses") or []
                if any(s.get("resourceClaimName") == claim for s in statuses):
                    return True
        return False

    # -- the verbs ------------------------------------------------------------------------------------

    def _read(self, request: Request) -> dict[str, Any]:
        with self._lock:
            found = self._objects.get((request.kind.resource, request.namespace, request.name))
            if found is None:
                raise _not_found(request.kind, request.name)
            return copy.deepcopy(found)

    def _matching(self, request: Request) -> Iterator[tuple[Key, dict[str, Any]]]:
        for key, obj in sorted(self._objects.items()):
            resource, namespace, _ = key
            if resource != request.kind.resource or (request.namespace and namespace != request.namespace):
                continue
            if all((str(_get(obj, *f.split("."))) == v) == (op == "=") for f, op, v in request.selector):
                yield key, obj

    def _list(self, request: Request, params: Mapping[str, list[str]]) -> dict[str, Any]:
        try:
            limit = int(params.get("limit", ["0"])[-1] or 0)
            start = int(params.get("continue", ["0"])[-1] or 0)
        except ValueError:
            raise status(400, "BadRequest", "invalid limit or continue token") from None
        with self._lock:
            everything = [_as_item(obj) for _, obj in self._matching(request)]
            revision = str(self._server.revision())
        page = everything[start : start + limit] if limit > 0 else everything[start:]
        metadata: dict[str, Any] = {"resourceVersion": revision}
        if limit > 0 and start + limit < len(everything):
            metadata["continue"] = str(start + limit)
            metadata["remainingItemCount"] = len(everything) - start - limit
        return {
            "kind": f"{request.kind.kind}List",
            "apiVersion": f"{GROUP}/{VERSION}",
            "metadata": metadata,
            "items": page,
        }

    def _create(self, kind: Kind, namespace: str, document: Any) -> dict[str, Any]:
        """Called with the lock held."""
        obj = _checked_object(kind, document)
        metadata = obj["metadata"]
        if metadata.get("namespace", namespace) != namespace:
            raise status(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        if not metadata.get("name"):
            generate = metadata.get("generateName")
            if not generate:
                raise _invalid(
                    kind, "", [("metadata.name", "Required value: name or generateName is required")]
                )
            metadata["name"] = f"{generate}{uuid.uuid4().hex[:5]}"
        name = str(metadata["name"])
        _validate(kind, obj, None)
        key = (kind.resource, namespace, name)
        if key in self._objects:
            raise status(
                409,
                "AlreadyExists",
                f'{kind.resource}.{GROUP} "{name}" already exists',
                {"name": name, "group": GROUP, "kind": kind.resource},
            )
        for server_managed in (
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "generation",
            "deletionTimestamp",
        ):
            metadata.pop(server_managed, None)
        if kind is not CLAIMS:
            obj.pop("status", None)
        if namespace:
            metadata["namespace"] = namespace
        metadata.update(
            {
                "uid": str(uuid.uuid4()),
                "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "generation": 1,
                "resourceVersion": str(self._server.revision()),
            }
        )
        obj["apiVersion"], obj["kind"] = f"{GROUP}/{VERSION}", kind.kind
        self._objects[key] = obj
        return copy.deepcopy(obj)

    def _write(self, request: Request, headers: Mapping[str, str], document: Any) -> dict[str, Any]:
        kind = request.kind
        media = headers.get("Content-Type", "").split(";")[0].strip().lower()
        with self._lock:
            key = (kind.resource, request.namespace, request.name)
            old = self._objects.get(key)
            if old is None:
                raise _not_found(kind, request.name)
            if request.verb == "patch":
                if media not in (JSON_PATCH, MERGE_PATCH):
                    raise status(415, "UnsupportedMediaType", UNSUPPORTED_MEDIA)
                new = (
                    _apply_json_patch(old, document)
                    if media == JSON_PATCH
                    else _apply_merge_patch(old, document)
                )
                new = _checked_object(kind, new)
            else:
                new = _checked_object(kind, document)
                if new["metadata"].get("name") != request.name:
                    raise status(
                        400,
                        "BadRequest",
                        f"the name of the object ({new['metadata'].get('name')}) does not match the name on "
                        f"the URL ({request.name})",
                    )
                if not new["metadata"].get("resourceVersion"):
                    raise _invalid(
                        kind,
                        request.name,
                        [("metadata.resourceVersion", "Invalid value: 0x0: must be specified for an update")],
                    )
            wanted = new["metadata"].get("resourceVersion")
            current = old["metadata"]["resourceVersion"]
            if wanted not in (None, "") and wanted != current:
                raise status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {kind.resource}.{GROUP} "{request.name}": the object '
                    "has been modified; please apply your changes to the latest version and try again",
                    {"name": request.name, "group": GROUP, "kind": kind.resource},
                )
            # What this endpoint may not change, kept as it was (the strategies' PrepareForUpdate).
            if request.sub == "status":
                new["spec"] = copy.deepcopy(old.get("spec"))
            elif kind is CLAIMS:
                new["status"] = copy.deepcopy(old.get("status", {}))
            else:
                new.pop("status", None)
            metadata = new["metadata"]
            for server_managed in ("name", "uid", "creationTimestamp", "generation", "namespace"):
                if server_managed in old["metadata"]:
                    metadata[server_managed] = old["metadata"][server_managed]
                else:
                    metadata.pop(server_managed, None)
            metadata["resourceVersion"] = current
            new["apiVersion"], new["kind"] = f"{GROUP}/{VERSION}", kind.kind
            _validate(kind, new, old)
            if new == old:
                return copy.deepcopy(old)  # no change, no write: the resourceVersion stays
            if new.get("spec") != old.get("spec"):
                metadata["generation"] = int(old["metadata"].get("generation", 1)) + 1
            metadata["resourceVersion"] = str(self._server.revision())
            self._objects[key] = new
            return copy.deepcopy(new)

    def _delete(self, request: Request, body: bytes) -> dict[str, Any]:
        options: Any = {}
        if body:
            try:
                options = json.loads(body)
            except ValueError as exc:
                raise status(400, "BadRequest", f"error decoding DeleteOptions: {exc}") from None
        preconditions = options.get("preconditions") if isinstance(options, dict) else None
        with self._lock:
            key = (request.kind.resource, request.namespace, request.name)
            old = self._objects.get(key)
            if old is None:
                raise _not_found(request.kind, request.name)
            for field in ("uid", "resourceVersion"):
                wanted = (preconditions or {}).get(field)
                have = old["metadata"][field]
                if wanted is not None and wanted != have:
                    label = "UID" if field == "uid" else "ResourceVersion"
                    raise status(
                        409,
                        "Conflict",
                        f'Operation cannot be fulfilled on {request.kind.resource}.{GROUP} "{request.name}": '
                        f"Precondition failed: {label} in precondition: {wanted}, "
                        f"{label} in object meta: {have}",
                        {"name": request.name, "group": GROUP, "kind": request.kind.resource},
                    )
            del self._objects[key]
            self._server.revision()
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {
                "name": request.name,
                "group": GROUP,
                "kind": request.kind.resource,
                "uid": old["metadata"]["uid"],
            },
        }

    def _delete_collection(self, request: Request) -> dict[str, Any]:
        with self._lock:
            doomed = list(self._matching(request))
            for key, _ in doomed:
                del self._objects[key]
            revision = str(self._server.revision())
        return {
            "kind": f"{request.kind.kind}List",
            "apiVersion": f"{GROUP}/{VERSION}",
            "metadata": {"resourceVersion": revision},
            "items": [_as_item(obj) for _, obj in doomed],
        }


# -- helpers ----------------------------------------------------------------------------------------


def _get(obj: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _as_item(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A list's item as kube-apiserver writes it: without kind and apiVersion."""
    item = copy.deepcopy(dict(obj))
    item.pop("kind", None)
    item.pop("apiVersion", None)
    return item


def _decode(method: str, headers: Mapping[str, str], body: bytes) -> Any:
    media = headers.get("Content-Type", "").split(";")[0].strip().lower()
    if method != "PATCH" and media != "application/json":
        raise status(
            415,
            "UnsupportedMediaType",
            UNSUPPORTED_MEDIA.replace(
                "json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
                "json, application/yaml, application/vnd.kubernetes.protobuf",
            ),
        )
    try:
        return json.loads(body)
    except ValueError as exc:
        raise status(400, "BadRequest", f"error decoding the request body: {exc}") from None


def _field_selector(kind: Kind, text: str) -> tuple[tuple[str, str, str], ...]:
    """kube-apiserver's field selectors: `f=v`, `f==v`, `f!=v`, comma separated; metadata.name everywhere,
    spec.nodeName and spec.driver on ResourceSlices."""
    if not text:
        return ()
    allowed = ("metadata.name", *(SLICE_FIELDS if kind is SLICES else ()))
    terms = []
    for term in text.split(","):
        found = re.fullmatch(r"(?P<field>[^=!]+)(?P<op>==|=|!=)(?P<value>.*)", term.strip())
        if found is None:
            raise status(400, "BadRequest", f'invalid field selector: "{term}"')
        if found["field"] not in allowed:
            raise status(400, "BadRequest", f"field label not supported: {found['field']}")
        terms.append((found["field"], "!=" if found["op"] == "!=" else "=", found["value"]))
    return tuple(terms)


def _checked_object(kind: Kind, document: Any) -> dict[str, Any]:
    """The body as an object of `kind`, or the 400 Go's decoder would answer."""
    if not isinstance(document, dict):
        raise status(400, "BadRequest", f"the body is not a {kind.kind} object")
    if document.get("kind") not in (None, kind.kind) or document.get("apiVersion") not in (
        None,
        f"{GROUP}/{VERSION}",
    ):
        raise status(
            400,
            "BadRequest",
            f"the API version in the data ({document.get('apiVersion')}) does not match the expected API "
            f"version ({GROUP}/{VERSION}) or kind ({document.get('kind')}) is not {kind.kind}",
        )
    obj = copy.deepcopy(document)
    if not isinstance(obj.setdefault("metadata", {}), dict):
        raise status(
            400,
            "BadRequest",
            f"json: cannot unmarshal into Go struct field {kind.kind}.metadata of type v1.ObjectMeta",
        )
    if not isinstance(obj.setdefault("spec", {}), dict):
        raise status(400, "BadRequest", f"json: cannot unmarshal into Go struct field {kind.kind}.spec")
    return obj


def _not_found(kind: Kind, name: str) -> _Answer:
    return status(
        404,
        "NotFound",
        f'{kind.resource}.{GROUP} "{name}" not found',
        {"name": name, "group": GROUP, "kind": kind.resource},
    )


def _forbidden(user: str, request: Request, reason: str) -> _Answer:
    """The authorizer's refusal, worded as kube-apiserver's (responsewriters.Forbidden)."""
    subject = (
        f'{request.kind.resource}.{GROUP} "{request.name}"'
        if request.name
        else f"{request.kind.resource}.{GROUP}"
    )
    scope = f'in the namespace "{request.namespace}"' if request.namespace else "at the cluster scope"
    message = (
        f'{subject} is forbidden: User "{user}" cannot {request.verb} resource "{request.rbac_resource}" '
        f'in API group "{GROUP}" {scope}'
    )
    details: dict[str, Any] = {"group": GROUP, "kind": request.kind.resource}
    if request.name:
        details["name"] = request.name
    return status(403, "Forbidden", f"{message}: {reason}" if reason else message, details)


def _invalid(kind: Kind, name: str, causes: list[tuple[str, str]]) -> _Answer:
    described = [f"{f}: {m}" for f, m in causes]
    summary = described[0] if len(described) == 1 else "[" + ", ".join(described) + "]"
    reasons = {
        "Required": "FieldValueRequired",
        "Too many": "FieldValueTooMany",
        "Duplicate": "FieldValueDuplicate",
    }
    return status(
        422,
        "Invalid",
        f'{kind.kind}.{GROUP} "{name}" is invalid: {summary}',
        {
            "name": name,
            "group": GROUP,
            "kind": kind.kind,
            "causes": [
                {
                    "reason": next((r for p, r in reasons.items() if m.startswith(p)), "FieldValueInvalid"),
                    "message": m,
                    "field": f,
                }
                for f, m in causes
            ],
        },
    )


def _q(value: Any) -> str:
    """A value as Go's field errors print it: strings quoted, numbers bare."""
    return (
        json.dumps(value)
        if isinstance(value, str)
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )


def _validate(kind: Kind, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
    name = str(obj["metadata"].get("name") or "")
    causes: list[tuple[str, str]] = []
    if len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        causes.append(("metadata.name", f"Invalid value: {_q(name)}: {DNS1123_SUBDOMAIN_ERROR}"))
    check = {SLICES: _slice_causes, CLAIMS: _claim_causes, CLASSES: _class_causes}[kind]
    causes.extend(check(obj["spec"], (old or {}).get("spec")))
    if causes:
        raise _invalid(kind, name, causes)


def _wrong_type(kind: str, field: str, want: str, value: Any) -> _Answer:
    got = {bool: "bool", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), "null"
    )
    return status(
        400, "BadRequest", f"json: cannot unmarshal {got} into Go struct field {kind}.{field} of type {want}"
    )


def _need(value: Any, expected: type, kind: str, field: str, want: str) -> Any:
    """`value` when it is of the JSON type Go's decoder expects (None when absent); else its 400."""
    if value is None:
        return None
    # bool is an int to Python, never to Go's decoder.
    if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
        raise _wrong_type(kind, field, want, value)
    return value


def _dns_subdomain(field: str, value: str, limit: int, causes: list[tuple[str, str]]) -> None:
    if len(value) > limit:
        causes.append((field, f"Too long: may not be more than {limit} bytes"))
    elif not DNS_SUBDOMAIN.match(value):
        causes.append((field, f"Invalid value: {_q(value)}: {DNS1123_SUBDOMAIN_ERROR}"))


def _qualified_key(field: str, key: str, causes: list[tuple[str, str]]) -> None:
    """An attribute or capacity name: a C identifier <= 32, optionally `<DNS subdomain <= 63>/` before."""
    domain, slash, identifier = key.rpartition("/")
    if slash:
        if not domain:
            causes.append((field, f"Invalid value: {_q(key)}: the domain must not be empty"))
        elif len(domain) > 63:
            causes.append((field, f"Invalid value: {_q(key)}: the domain must not be longer than 63 bytes"))
        elif not DNS_SUBDOMAIN.match(domain):
            causes.append((field, f"Invalid value: {_q(domain)}: {DNS1123_SUBDOMAIN_ERROR}"))
    if len(identifier) > 32:
        causes.append((field, f"Invalid value: {_q(identifier)}: the name must not be longer than 32 bytes"))
    elif not C_IDENTIFIER.match(identifier):
        causes.append(
            (
                field,
                f"Invalid value: {_q(identifier)}: a valid C identifier must start with alphabetic character "
                "or '_', followed by a string of alphanumeric characters or '_' (e.g. 'my_name',  or "
                "'MY_NAME',  or 'MyName', regex used for validation is '[A-Za-z_][A-Za-z0-9_]*')",
            )
        )


def _slice_causes(spec: dict[str, Any], old: dict[str, Any] | None) -> list[tuple[str, str]]:
    causes: list[tuple[str, str]] = []
    k = "ResourceSliceSpec"
    driver = _need(spec.get("driver"), str, k, "driver", "string")
    if not driver:
        causes.append(("spec.driver", "Required value"))
    else:
        _dns_subdomain("spec.driver", driver, 63, causes)
    pool = _need(spec.get("pool"), dict, k, "pool", "v1.ResourcePool") or {}
    pool_name = _need(pool.get("name"), str, "ResourcePool", "name", "string")
    if not pool_name:
        causes.append(("spec.pool.name", "Required value"))
    elif len(pool_name) > 253:
        causes.append(("spec.pool.name", "Too long: may not be more than 253 bytes"))
    else:
        for part in pool_name.split("/"):
            if not DNS_SUBDOMAIN.match(part):
                causes.append(
                    ("spec.pool.name", f"Invalid value: {_q(pool_name)}: {DNS1123_SUBDOMAIN_ERROR}")
                )
                break
    generation = _need(pool.get("generation"), int, "ResourcePool", "generation", "int64")
    if generation is not None and generation < 0:
        causes.append(
            ("spec.pool.generation", f"Invalid value: {generation}: must be greater than or equal to 0")
        )
    count = _need(pool.get("resourceSliceCount"), int, "ResourcePool", "resourceSliceCount", "int64")
    if not count or count <= 0:
        causes.append(
            ("spec.pool.resourceSliceCount", f"Invalid value: {count or 0}: must be greater than zero")
        )

    node_name = _need(spec.get("nodeName"), str, k, "nodeName", "string")
    node_selector = _need(spec.get("nodeSelector"), dict, k, "nodeSelector", "v1.NodeSelector")
    all_nodes = _need(spec.get("allNodes"), bool, k, "allNodes", "bool")
    per_device = _need(spec.get("perDeviceNodeSelection"), bool, k, "perDeviceNodeSelection", "bool")
    chosen = [
        f
        for f, set_ in (
            ("`nodeName`", bool(node_name)),
            ("`nodeSelector`", node_selector is not None),
            ("`allNodes`", bool(all_nodes)),
            ("`perDeviceNodeSelection`", bool(per_device)),
        )
        if set_
    ]
    if not chosen:
        causes.append(
            (
                "spec",
                "Required value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                "`perDeviceNodeSelection` is required",
            )
        )
    elif len(chosen) > 1:
        causes.append(
            (
                "spec",
                f"Invalid value: {{{', '.join(chosen)}}}: exactly one of `nodeName`, `nodeSelector`, "
                "`allNodes`, `perDeviceNodeSelection` is required, but multiple fields are set",
            )
        )
    if node_name:
        _dns_subdomain("spec.nodeName", node_name, 253, causes)
    if node_selector is not None:
        terms = node_selector.get("nodeSelectorTerms")
        if not isinstance(terms, list) or len(terms) != 1:
            causes.append(
                (
                    "spec.nodeSelector.nodeSelectorTerms",
                    "Invalid value: must have exactly one node selector term",
                )
            )
    if old is not None:
        for field, new_value, old_value in (
            ("spec.driver", spec.get("driver"), old.get("driver")),
            ("spec.pool.name", pool.get("name"), (old.get("pool") or {}).get("name")),
            ("spec.nodeName", spec.get("nodeName"), old.get("nodeName")),
        ):
            if new_value != old_value:
                causes.append((field, f"Invalid value: {_q(new_value)}: field is immutable"))

    devices = _need(spec.get("devices"), list, k, "devices", "[]v1.Device") or []
    counters = _need(spec.get("sharedCounters"), list, k, "sharedCounters", "[]v1.CounterSet") or []
    if devices and counters:
        causes.append(("spec", "Invalid value: only one of `devices` or `sharedCounters` may be set"))
    if len(counters) > 8:
        causes.append(("spec.sharedCounters", f"Too many: {len(counters)}: must have at most 8 items"))
    limited = any(isinstance(d, dict) and (d.get("taints") or d.get("consumesCounters")) for d in devices)
    limit = MAX_DEVICES_WITH_TAINTS if limited else MAX_DEVICES
    if len(devices) > limit:
        causes.append(("spec.devices", f"Too many: {len(devices)}: must have at most {limit} items"))
    seen: set[str] = set()
    for index, device in enumerate(devices):
        causes.extend(_device_causes(f"spec.devices[{index}]", device, seen))
    return causes


def _device_causes(at: str, device: Any, seen: set[str]) -> list[tuple[str, str]]:
    causes: list[tuple[str, str]] = []
    if not isinstance(device, dict):
        raise _wrong_type("ResourceSliceSpec", "devices", "v1.Device", device)
    name = _need(device.get("name"), str, "Device", "name", "string")
    if not name:
        causes.append((f"{at}.name", "Required value"))
    elif len(name) > 63 or not DNS_LABEL.match(name):
        causes.append((f"{at}.name", f"Invalid value: {_q(name)}: {DNS1123_LABEL_ERROR}"))
    elif name in seen:
        causes.append((f"{at}.name", f"Duplicate value: {_q(name)}"))
    else:
        seen.add(name)
    attributes = (
        _need(
            device.get("attributes"), dict, "Device", "attributes", "map[v1.QualifiedName]v1.DeviceAttribute"
        )
        or {}
    )
    capacity = (
        _need(device.get("capacity"), dict, "Device", "capacity", "map[v1.QualifiedName]v1.DeviceCapacity")
        or {}
    )
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES:
        causes.append(
            (
                f"{at}",
                f"Too many: {len(attributes) + len(capacity)}: must have at most {MAX_ATTRIBUTES} items (the "
                "combined number of attributes and capacity)",
            )
        )
    for key, attribute in attributes.items():
        field = f"{at}.attributes[{key}]"
        _qualified_key(field, key, causes)
        if not isinstance(attribute, dict):
            raise _wrong_type("Device", "attributes", "v1.DeviceAttribute", attribute)
        present = {
            t: v for t, v in attribute.items() if t in ("int", "bool", "string", "version") and v is not None
        }
        _need(attribute.get("int"), int, "DeviceAttribute", "int", "int64")
        _need(attribute.get("bool"), bool, "DeviceAttribute", "bool", "bool")
        _need(attribute.get("string"), str, "DeviceAttribute", "string", "string")
        _need(attribute.get("version"), str, "DeviceAttribute", "version", "string")
        if len(present) != 1:
            causes.append((field, "Invalid value: exactly one value must be specified"))
            continue
        ((which, value),) = present.items()
        if which in ("string", "version") and len(value) > 64:
            causes.append((f"{field}.{which}", "Too long: may not be more than 64 bytes"))
        elif which == "version" and not SEMVER.match(value):
            causes.append(
                (
                    f"{field}.version",
                    f"Invalid value: {_q(value)}: must be a string compatible with semver.org spec 2.0.0",
                )
            )
    multiple = device.get("allowMultipleAllocations") is True
    for key, entry in capacity.items():
        field = f"{at}.capacity[{key}]"
        _qualified_key(field, key, causes)
        if not isinstance(entry, dict):
            raise _wrong_type("Device", "capacity", "v1.DeviceCapacity", entry)
        value = entry.get("value")
        if isinstance(value, bool) or not isinstance(value, (str, int)) or not QUANTITY.match(str(value)):
            causes.append(
                (
                    f"{field}.value",
                    f"Invalid value: {_q(value)}: quantities must match the regular expression "
                    f"'{QUANTITY.pattern}'",
                )
            )
        if entry.get("requestPolicy") is not None and not multiple:
            causes.append((f"{field}.requestPolicy", "Forbidden: allowMultipleAllocations must be true"))
    taints = _need(device.get("taints"), list, "Device", "taints", "[]v1.DeviceTaint") or []
    if len(taints) > MAX_TAINTS:
        causes.append((f"{at}.taints", f"Too many: {len(taints)}: must have at most {MAX_TAINTS} items"))
    for index, taint in enumerate(taints):
        field = f"{at}.taints[{index}]"
        if not isinstance(taint, dict):
            raise _wrong_type("Device", "taints", "v1.DeviceTaint", taint)
        key = _need(taint.get("key"), str, "DeviceTaint", "key", "string")
        if not key:
            causes.append((f"{field}.key", "Required value"))
        else:
            prefix, _, label = key.rpartition("/")
            if (
                len(label) > 63
                or not LABEL_NAME.match(label)
                or (prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix)))
            ):
                causes.append(
                    (
                        f"{field}.key",
                        f"Invalid value: {_q(key)}: name part must consist of alphanumeric characters, "
                        "'-', '_' or '.', and must start and end with an alphanumeric character",
                    )
                )
        value = _need(taint.get("value"), str, "DeviceTaint", "value", "string") or ""
        if len(value) > 63 or not LABEL_VALUE.match(value):
            causes.append(
                (
                    f"{field}.value",
                    f"Invalid value: {_q(value)}: a valid label must be an empty string or consist of "
                    "alphanumeric characters, '-', '_' or '.'",
                )
            )
        effect = taint.get("effect")
        if not effect:
            causes.append((f"{field}.effect", "Required value"))
        elif effect not in TAINT_EFFECTS:
            supported = ", ".join(f'"{e}"' for e in TAINT_EFFECTS)
            causes.append(
                (f"{field}.effect", f"Unsupported value: {_q(effect)}: supported values: {supported}")
            )
    return causes


def _claim_causes(spec: dict[str, Any], old: dict[str, Any] | None) -> list[tuple[str, str]]:
    # A claim's spec is immutable once created (the real validation's rule), which is all a driver meets.
    if old is not None and spec != old:
        return [("spec", "Invalid value: field is immutable")]
    return []


def _class_causes(spec: dict[str, Any], old: dict[str, Any] | None) -> list[tuple[str, str]]:
    causes: list[tuple[str, str]] = []
    k = "DeviceClassSpec"
    selectors = _need(spec.get("selectors"), list, k, "selectors", "[]v1.DeviceSelector") or []
    if len(selectors) > 32:
        causes.append(("spec.selectors", f"Too many: {len(selectors)}: must have at most 32 items"))
    for index, selector in enumerate(selectors):
        expression = _get(selector, "cel", "expression")
        if not isinstance(expression, str) or not expression.strip():
            causes.append((f"spec.selectors[{index}].cel.expression", "Required value"))
    config = _need(spec.get("config"), list, k, "config", "[]v1.DeviceClassConfiguration") or []
    if len(config) > 32:
        causes.append(("spec.config", f"Too many: {len(config)}: must have at most 32 items"))
    for index, entry in enumerate(config):
        driver = _get(entry, "opaque", "driver")
        if not isinstance(driver, str) or not driver:
            causes.append((f"spec.config[{index}].opaque.driver", "Required value"))
        else:
            _dns_subdomain(f"spec.config[{index}].opaque.driver", driver, 63, causes)
        if _get(entry, "opaque", "parameters") is None:
            causes.append((f"spec.config[{index}].opaque.parameters", "Required value"))
        elif len(json.dumps(_get(entry, "opaque", "parameters"))) > 10 * 1024:
            causes.append(
                (f"spec.config[{index}].opaque.parameters", "Too long: may not be more than 10240 bytes")
            )
    extended = _need(spec.get("extendedResourceName"), str, k, "extendedResourceName", "string")
    if extended is not None:
        prefix, _, label = extended.rpartition("/")
        if (
            not prefix
            or not DNS_SUBDOMAIN.match(prefix)
            or len(label) > 63
            or not LABEL_NAME.match(label)
            or (prefix.endswith("kubernetes.io") and prefix != "deviceclass.resource.kubernetes.io")
        ):
            causes.append(
                (
                    "spec.extendedResourceName",
                    f"Invalid value: {_q(extended)}: must be a valid extended resource name",
                )
            )
    return causes
