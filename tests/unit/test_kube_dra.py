"""resource.k8s.io/v1 against the test API server over real TLS: the server's validation of ResourceSlices
(each rule accepted and refused, 422), its Node authorizer for a kubelet's client certificate (403), and
gpunode's client methods for a DRA driver end to end, with their errors and answer checks."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from gpunode.errors import ApiError, ExitCode, UsageError
from gpunode.kube import Credentials, Pem
from gpunode.kube import client as client_module
from gpunode.kube.client import KubeClient, RetryPolicy, Timeouts
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.dra import SLICES
from tests.kubeapi.pki import CertPair, Pki

TOKEN = "admin-token-77c1-never-shown"  # noqa: S105 (a test token)
FAST = RetryPolicy(attempts=3, backoff=0.001, max_backoff=0.01, max_retry_after=0.05, conflict_attempts=3)
DRIVER = "gpu.nvidia.com"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def node_certs(pki: Pki) -> dict[str, CertPair]:
    """Kubelet client certificates, as kubelet's kubeconfig holds them: CN system:node:NAME."""
    return {name: pki.client(f"system:node:{name}", ["system:nodes"]) for name in ("n1", "n2")}


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(pki, tokens={TOKEN: "admin"}, allow=[("admin", "*", "*")]) as server:
        for name in ("n1", "n2"):
            server.add_node(name)
        yield server


@pytest.fixture(autouse=True)
def token_never_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    assert TOKEN not in caplog.text


def admin(api: ApiServer, pki: Pki) -> KubeClient:
    credentials = Credentials(
        server=api.url,
        source="kubeconfig /root/.kube/config",
        verify=Pem(str(pki.ca.cert), path=pki.ca.cert),
        token=TOKEN,
    )
    return KubeClient(credentials, retry=FAST, timeouts=Timeouts(connect=2, read=5), env={})


def kubelet(api: ApiServer, pki: Pki, cert: CertPair) -> KubeClient:
    credentials = Credentials(
        server=api.url,
        source="kubeconfig /etc/kubernetes/kubelet.conf",
        verify=Pem(str(pki.ca.cert), path=pki.ca.cert),
        cert=(Pem(str(cert.cert), path=cert.cert), Pem(str(cert.key), path=cert.key)),
    )
    return KubeClient(credentials, retry=FAST, timeouts=Timeouts(connect=2, read=5), env={})


def failure(call: Callable[[], object]) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call()
    error = raised.value
    assert error.exit_code == ExitCode.API
    assert "\n" not in error.message and TOKEN not in str(error)
    return error


def raw(
    api: ApiServer, pki: Pki, method: str, path: str, *, cert: CertPair | None = None, body: Any = None
) -> requests.Response:
    """One request as another client sends it, for what gpunode's client never asks."""
    headers = {} if cert is not None else {"Authorization": f"Bearer {TOKEN}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    return requests.request(
        method,
        api.url + path,
        headers=headers,
        data=json.dumps(body) if body is not None else None,
        verify=str(pki.ca.cert),
        cert=(str(cert.cert), str(cert.key)) if cert is not None else None,
        timeout=10,
    )


def device(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-{name}"},
            "driverVersion": {"version": "550.54.15"},
            "index": {"int": 0},
            "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"},
            "mig": {"bool": False},
        },
        "capacity": {"memory": {"value": "80Gi"}},
        **extra,
    }


def slice_of(node: str = "n1", name: str | None = None, devices: int = 2, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": name or f"{node}-gpu"},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
            "nodeName": node,
            "devices": [device(f"gpu-{i}") for i in range(devices)],
        },
    }
    body["spec"].update(spec)
    return body


# -- validation: each rule accepted and refused ------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(body: dict[str, Any]) -> None:
        *parents, last = path.split("|")
        target = body
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = copy.deepcopy(value)

    return change


_DELETE = object()


def _devices(count: int, **extra: Any) -> Callable[[dict[str, Any]], None]:
    return _set("spec|devices", [device(f"gpu-{i}", **extra) for i in range(count)])


def _attributes(count: int) -> Callable[[dict[str, Any]], None]:
    """`count` keys in all: the one capacity key and `count` - 1 attributes (the limit counts both)."""
    return _set("spec|devices|0|attributes", {f"a{i}": {"int": i} for i in range(count - 1)})


TAINT = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}

VALID = {
    "a driver of 63 characters": _set("spec|driver", "d" * 59 + ".com"),
    "a pool name of DNS subdomains": _set("spec|pool|name", "rack-1/n1.example.com"),
    "a pool name of 253 characters": _set("spec|pool|name", ("p" * 61 + ".") * 4 + "ppppp"),
    "generation 0": _set("spec|pool|generation", 0),
    "allNodes instead of nodeName": lambda b: (b["spec"].pop("nodeName"), b["spec"].update(allNodes=True)),
    "a nodeSelector of one term": lambda b: (
        b["spec"].pop("nodeName"),
        b["spec"].update(nodeSelector={"nodeSelectorTerms": [{"matchLabels": {}}]}),
    ),
    "perDeviceNodeSelection": lambda b: (
        b["spec"].pop("nodeName"),
        b["spec"].update(perDeviceNodeSelection=True),
    ),
    "128 devices": _devices(128),
    "64 devices with taints": _devices(64, taints=[TAINT]),
    "32 attributes and capacity keys": _attributes(32),
    "a domain-qualified key": _set("spec|devices|0|attributes|nvidia.com/link", {"int": 1}),
    "a key of 32 characters": _set("spec|devices|0|attributes|" + "k" * 32, {"bool": True}),
    "a string of 64 characters": _set("spec|devices|0|attributes|type", {"string": "s" * 64}),
    "a semver with a prerelease": _set("spec|devices|0|attributes|driverVersion", {"version": "1.2.3-rc.1"}),
    "16 taints, each effect": _set(
        "spec.devices.0.taints",
        [{"key": f"k{i}", "effect": ("None", "NoSchedule", "NoExecute")[i % 3]} for i in range(16)],
    ),
}

INVALID = {
    "a driver that is no DNS subdomain": (_set("spec|driver", "GPU_driver"), "spec.driver: Invalid value"),
    "a driver of 64 characters": (_set("spec|driver", "d" * 60 + ".com"), "spec.driver: Too long"),
    "no driver": (_set("spec|driver", _DELETE), "spec.driver: Required value"),
    "a pool name of 254 characters": (
        _set("spec|pool|name", ("p" * 61 + ".") * 4 + "pppppp"),
        "spec.pool.name: Too long",
    ),
    "a pool name with capitals": (_set("spec|pool|name", "Pool"), "spec.pool.name: Invalid value"),
    "generation -1": (_set("spec|pool|generation", -1), "spec.pool.generation: Invalid value: -1"),
    "resourceSliceCount 0": (_set("spec|pool|resourceSliceCount", 0), "spec.pool.resourceSliceCount"),
    "no node field": (_set("spec|nodeName", _DELETE), "spec: Required value: exactly one of `nodeName`"),
    "nodeName and allNodes": (_set("spec|allNodes", True), "but multiple fields are set"),
    "a nodeSelector of two terms": (
        lambda b: (
            b["spec"].pop("nodeName"),
            b["spec"].update(nodeSelector={"nodeSelectorTerms": [{}, {}]}),
        ),
        "spec.nodeSelector.nodeSelectorTerms",
    ),
    "129 devices": (_devices(129), "spec.devices: Too many: 129: must have at most 128 items"),
    "65 devices with taints": (
        _devices(65, taints=[TAINT]),
        "spec.devices: Too many: 65: must have at most 64 items",
    ),
    "devices and sharedCounters": (
        _set("spec|sharedCounters", [{"name": "c", "counters": {}}]),
        "only one of `devices` or `sharedCounters`",
    ),
    "a device name that is no DNS label": (_set("spec|devices|0|name", "GPU.0"), "spec.devices[0].name"),
    "a device name twice": (
        _set("spec|devices|1|name", "gpu-0"),
        'spec.devices[1].name: Duplicate value: "gpu-0"',
    ),
    "33 attributes and capacity keys": (_attributes(33), "spec.devices[0]: Too many: 33"),
    "a key that is no C identifier": (_set("spec|devices|0|attributes|1st", {"int": 1}), "attributes[1st]"),
    "a key of 33 characters": (
        _set("spec|devices|0|attributes|" + "k" * 33, {"int": 1}),
        "the name must not be longer than 32 bytes",
    ),
    "a key whose domain is too long": (
        _set("spec|devices|0|attributes|" + "d" * 60 + ".com/x", {"int": 1}),
        "the domain must not be longer than 63 bytes",
    ),
    "a key whose domain is no DNS subdomain": (
        _set("spec|devices|0|attributes|Bad_Domain/x", {"int": 1}),
        'Invalid value: "Bad_Domain"',
    ),
    "an attribute with two values": (
        _set("spec|devices|0|attributes|type", {"string": "gpu", "int": 1}),
        "attributes[type]: Invalid value: exactly one value must be specified",
    ),
    "an attribute with no value": (
        _set("spec|devices|0|attributes|type", {}),
        "exactly one value must be specified",
    ),
    "a string of 65 characters": (
        _set("spec|devices|0|attributes|type", {"string": "s" * 65}),
        "attributes[type].string: Too long",
    ),
    "a version that is no semver": (
        _set("spec|devices|0|attributes|driverVersion", {"version": "550.54"}),
        "must be a string compatible with semver.org spec 2.0.0",
    ),
    "a version of 65 characters": (
        _set("spec|devices|0|attributes|driverVersion", {"version": "1.2.3-" + "r" * 59}),
        "attributes[driverVersion].version: Too long",
    ),
    "17 taints": (
        _set("spec|devices|0|taints", [{"key": f"k{i}", "effect": "NoSchedule"} for i in range(17)]),
        "spec.devices[0].taints: Too many: 17: must have at most 16 items",
    ),
    "a taint effect of another name": (
        _set("spec|devices|0|taints", [{"key": "k", "effect": "PreferNoSchedule"}]),
        'taints[0].effect: Unsupported value: "PreferNoSchedule"',
    ),
    "a taint without effect": (_set("spec|devices|0|taints", [{"key": "k"}]), "taints[0].effect: Required"),
    "a capacity that is no quantity": (
        _set("spec|devices|0|capacity|memory", {"value": "lots"}),
        "capacity[memory].value: Invalid value",
    ),
}


@pytest.mark.parametrize("change", VALID.values(), ids=VALID.keys())
def test_valid_slices_are_accepted(
    api: ApiServer, pki: Pki, change: Callable[[dict[str, Any]], None]
) -> None:
    body = slice_of()
    change(body)
    with admin(api, pki) as kube:
        created = kube.create_resource_slice(body)
    assert created["spec"] == body["spec"]
    assert api.requests[-1].status == 201


@pytest.mark.parametrize(("change", "cause"), INVALID.values(), ids=INVALID.keys())
def test_invalid_slices_are_refused_with_422(
    api: ApiServer, pki: Pki, change: Callable[[dict[str, Any]], None], cause: str
) -> None:
    body = slice_of()
    change(body)
    with admin(api, pki) as kube:
        error = failure(lambda: kube.create_resource_slice(body))
    assert error.message.startswith('the Kubernetes API rejected resourceslice "n1-gpu" as invalid: ')
    assert cause in error.message
    answer = raw(api, pki, "POST", SLICES_PATH, body=body)
    status = answer.json()
    assert (answer.status_code, status["kind"], status["reason"]) == (422, "Status", "Invalid")
    assert status["message"].startswith('ResourceSlice.resource.k8s.io "n1-gpu" is invalid: ')
    described = [f"{c['field']}: {c['message']}" for c in status["details"]["causes"]]
    assert any(cause in line for line in described), described
    assert api.dra.items(SLICES) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("driver", "other.example.com"), ("pool", {"name": "n2", "generation": 1, "resourceSliceCount": 1}),
     ("nodeName", "n2")],
)  # fmt: skip
def test_driver_pool_name_and_node_name_are_immutable(
    api: ApiServer, pki: Pki, field: str, value: Any
) -> None:
    with admin(api, pki) as kube:
        stored = kube.create_resource_slice(slice_of())
        stored["spec"][field] = value
        error = failure(lambda: kube.update_resource_slice(stored))
    assert "field is immutable" in error.message
    kept = api.dra.get(SLICES, "n1-gpu")
    assert kept is not None and kept["spec"] == slice_of()["spec"]


def test_a_value_of_the_wrong_json_type_is_400(api: ApiServer, pki: Pki) -> None:
    body = slice_of()
    body["spec"]["devices"][0]["attributes"]["index"] = {"int": "0"}
    answer = raw(api, pki, "POST", SLICES_PATH, body=body)
    assert answer.status_code == 400
    assert (
        "cannot unmarshal string into Go struct field DeviceAttribute.int of type int64"
        in answer.json()["message"]
    )


# -- resourceVersion and generation ------------------------------------------------------------------------


def test_resource_version_and_generation_bookkeeping(api: ApiServer, pki: Pki) -> None:
    with admin(api, pki) as kube:
        created = kube.create_resource_slice(slice_of())
        assert created["metadata"]["generation"] == 1
        unchanged = kube.update_resource_slice(created)
        assert unchanged["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
        changed = copy.deepcopy(created)
        changed["spec"]["devices"][0]["taints"] = [TAINT]
        updated = kube.update_resource_slice(changed)
        assert updated["metadata"]["generation"] == 2
        assert int(updated["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
        labelled = copy.deepcopy(updated)
        labelled["metadata"]["labels"] = {"a": "b"}
        relabelled = kube.update_resource_slice(labelled)
        assert relabelled["metadata"]["generation"] == 2  # metadata is no spec change
        error = failure(lambda: kube.update_resource_slice(created))  # the resourceVersion read first
    assert error.message.startswith('the Kubernetes API refused to update resourceslice "n1-gpu": it changed')
    assert error.fix == "read it again and retry"


# -- the Node authorizer for a kubelet's credentials -------------------------------------------------------


def test_a_node_manages_its_own_slices(api: ApiServer, pki: Pki, node_certs: dict[str, CertPair]) -> None:
    with kubelet(api, pki, node_certs["n1"]) as kube:
        created = kube.create_resource_slice(slice_of("n1"))
        assert [s["metadata"]["name"] for s in kube.list_resource_slices("n1", DRIVER)] == ["n1-gpu"]
        created["spec"]["devices"].pop()
        assert len(kube.update_resource_slice(created)["spec"]["devices"]) == 1
        assert kube.delete_resource_slice("n1-gpu", created["metadata"]["uid"]) is True
        kube.create_resource_slice(slice_of("n1", name="n1-gpu-b"))
        assert [s["metadata"]["name"] for s in kube.delete_resource_slices("n1", DRIVER)] == ["n1-gpu-b"]
    assert {r.user for r in api.requests} == {"system:node:n1"}
    assert all(r.status < 300 for r in api.requests)


def test_a_node_may_not_create_another_nodes_slice(
    api: ApiServer, pki: Pki, node_certs: dict[str, CertPair]
) -> None:
    with kubelet(api, pki, node_certs["n1"]) as kube:
        error = failure(lambda: kube.create_resource_slice(slice_of("n2")))
    assert api.requests[-1].status == 403
    assert "node 'n1' is not allowed to create a ResourceSlice for node 'n2'" in error.message
    assert error.fix is not None and 'spec.nodeName "n1"' in error.fix
    assert api.dra.items(SLICES) == []


def test_a_node_may_not_touch_another_nodes_slice(
    api: ApiServer, pki: Pki, node_certs: dict[str, CertPair]
) -> None:
    api.dra.put(SLICES, slice_of("n2"))
    theirs = api.dra.get(SLICES, "n2-gpu")
    assert theirs is not None
    path = f"{SLICES_PATH}/n2-gpu"
    for method in ("GET", "DELETE"):
        answer = raw(api, pki, method, path, cert=node_certs["n1"])
        assert answer.status_code == 403
        assert "no relationship found between node 'n1' and this object" in answer.json()["message"]
    with kubelet(api, pki, node_certs["n1"]) as kube:
        error = failure(lambda: kube.update_resource_slice(theirs))
        assert failure(lambda: kube.delete_resource_slice("n2-gpu")).message == error.message.replace(
            "update", "delete"
        )
    assert error.message == (
        'the Kubernetes API refused: user "system:node:n1" may not update resourceslices (resourceslice '
        '"n2-gpu"; credentials from kubeconfig /etc/kubernetes/kubelet.conf): no relationship found between '
        "node 'n1' and this object"
    )
    assert api.dra.get(SLICES, "n2-gpu") == theirs
    with kubelet(api, pki, node_certs["n2"]) as kube:
        assert kube.delete_resource_slice("n2-gpu") is True


@pytest.mark.parametrize(
    "query",
    ["", "?fieldSelector=spec.driver%3Dgpu.nvidia.com", "?fieldSelector=spec.nodeName%3Dn2",
     "?fieldSelector=spec.nodeName%21%3Dn1"],
)  # fmt: skip
def test_a_node_lists_and_deletes_slices_only_by_its_own_node_name(
    api: ApiServer, pki: Pki, node_certs: dict[str, CertPair], query: str
) -> None:
    api.dra.put(SLICES, slice_of("n2"))
    for method in ("GET", "DELETE"):
        answer = raw(api, pki, method, SLICES_PATH + query, cert=node_certs["n1"])
        assert answer.status_code == 403, method
        assert answer.json()["message"].endswith(
            "can only list/watch/deletecollection resourceslices with nodeName field selector"
        )
    with kubelet(api, pki, node_certs["n1"]) as kube:
        error = failure(lambda: kube.delete_resource_slices("n2", DRIVER))
    assert 'user "system:node:n1" may not deletecollection resourceslices' in error.message
    assert len(api.dra.items(SLICES)) == 1


def test_field_selectors_pick_node_and_driver(api: ApiServer, pki: Pki) -> None:
    api.dra.put(SLICES, slice_of("n1"))
    api.dra.put(SLICES, slice_of("n2"))
    api.dra.put(SLICES, slice_of("n1", name="n1-other", driver="other.example.com"))
    with admin(api, pki) as kube:
        assert [s["metadata"]["name"] for s in kube.list_resource_slices("n1", DRIVER)] == ["n1-gpu"]
        assert [s["metadata"]["name"] for s in kube.delete_resource_slices("n1", DRIVER)] == ["n1-gpu"]
    assert sorted(s["metadata"]["name"] for s in api.dra.items(SLICES)) == ["n1-other", "n2-gpu"]
    unsupported = raw(api, pki, "GET", SLICES_PATH + "?fieldSelector=spec.pool.name%3Dn1")
    assert (unsupported.status_code, unsupported.json()["message"]) == (
        400,
        "field label not supported: spec.pool.name",
    )


def test_a_node_reads_only_the_claims_of_its_own_pods(
    api: ApiServer, pki: Pki, node_certs: dict[str, CertPair]
) -> None:
    api.dra.allocate_claim("ml", "train", node="n1", driver=DRIVER, devices=("gpu-0", "gpu-1"))
    api.dra.allocate_claim("ml", "other", node="n2", driver=DRIVER, devices=("gpu-0",))
    with kubelet(api, pki, node_certs["n1"]) as kube:
        claim = kube.get_resource_claim("ml", "train")
        error = failure(lambda: kube.get_resource_claim("ml", "other"))
    results = claim["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["pool"], r["device"]) for r in results] == [
        (DRIVER, "n1", "gpu-0"),
        (DRIVER, "n1", "gpu-1"),
    ]
    assert claim["status"]["reservedFor"][0]["name"] == "train-pod"
    assert error.message.startswith(
        'the Kubernetes API refused: user "system:node:n1" may not get resourceclaims'
    )
    assert "no relationship found between node 'n1' and this object" in error.message
    assert error.fix is not None and 'scheduled to node "n1"' in error.fix
    # The pod moved off the node (deleted): the edge is gone, and so is the right to read.
    api.dra.unbind_pod("ml", "train-pod")
    with kubelet(api, pki, node_certs["n1"]) as kube:
        failure(lambda: kube.get_resource_claim("ml", "train"))
    # A pod bound by the helper gives the edge back.
    api.dra.bind_claim_to_node("ml", "train", "n1")
    with kubelet(api, pki, node_certs["n1"]) as kube:
        assert kube.get_resource_claim("ml", "train")["metadata"]["name"] == "train"


@pytest.mark.parametrize(
    ("method", "path", "reason"),
    [
        ("GET", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims", "can only get individual resources"),
        ("GET", "/apis/resource.k8s.io/v1/resourceclaims", "can only get individual resources"),
        (
            "GET",
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/train/status",
            "cannot get subresource",
        ),
        (
            "PUT",
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/train/status",
            "cannot get subresource",
        ),
    ],
)
def test_a_node_may_not_list_claims_or_touch_their_status(  # noqa: PLR0917 (fixtures and parameters)
    api: ApiServer, pki: Pki, node_certs: dict[str, CertPair], method: str, path: str, reason: str
) -> None:
    claim = api.dra.allocate_claim("ml", "train", node="n1", driver=DRIVER, devices=("gpu-0",))
    answer = raw(api, pki, method, path, cert=node_certs["n1"], body=claim if method == "PUT" else None)
    assert answer.status_code == 403
    assert answer.json()["reason"] == "Forbidden" and reason in answer.json()["message"]
    assert raw(api, pki, method, path, body=claim if method == "PUT" else None).status_code == 200  # admin


def test_a_node_has_no_access_to_device_classes(
    api: ApiServer, pki: Pki, node_certs: dict[str, CertPair]
) -> None:
    wanted = {"metadata": {"name": "gpu.nvidia.com"}, "spec": {"selectors": []}}
    with kubelet(api, pki, node_certs["n1"]) as kube:
        error = failure(lambda: kube.apply_device_class(wanted))
    assert error.message == (
        'the Kubernetes API refused: user "system:node:n1" may not get deviceclasses (deviceclass '
        '"gpu.nvidia.com"; credentials from kubeconfig /etc/kubernetes/kubelet.conf)'
    )
    assert error.fix is not None and "admin kubeconfig" in error.fix
    for method, body in (("GET", None), ("POST", wanted)):
        path = "/apis/resource.k8s.io/v1/deviceclasses" + ("/gpu.nvidia.com" if method == "GET" else "")
        assert raw(api, pki, method, path, cert=node_certs["n1"], body=body).status_code == 403


def test_another_user_is_told_what_to_grant(api: ApiServer, pki: Pki) -> None:
    viewer = pki.client("viewer")
    pair = (Pem(str(viewer.cert), path=viewer.cert), Pem(str(viewer.key), path=viewer.key))
    credentials = Credentials(
        server=api.url, source="kubeconfig v", verify=Pem("ca", path=pki.ca.cert), cert=pair
    )
    with KubeClient(credentials, retry=FAST, env={}) as kube:
        error = failure(lambda: kube.list_resource_slices("n1", DRIVER))
    assert error.message.startswith('the Kubernetes API refused: user "viewer" may not list resourceslices')
    assert error.fix is not None
    assert (
        "--verb=list --resource=resourceslices.resource.k8s.io" in error.fix and "--user=viewer" in error.fix
    )


# -- the client methods ------------------------------------------------------------------------------------


def test_list_follows_continue_pages(api: ApiServer, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "LIST_PAGE", 2)
    for index in range(5):
        api.dra.put(SLICES, slice_of("n1", name=f"n1-gpu-{index}"))
    with admin(api, pki) as kube:
        names = [s["metadata"]["name"] for s in kube.list_resource_slices("n1", DRIVER)]
    assert names == [f"n1-gpu-{i}" for i in range(5)]
    assert [r.method for r in api.requests] == ["GET"] * 3


def test_create_with_generate_name_and_an_existing_name(api: ApiServer, pki: Pki) -> None:
    body = slice_of()
    body["metadata"] = {"generateName": "n1-gpu.nvidia.com-"}
    with admin(api, pki) as kube:
        created = kube.create_resource_slice(body)
        assert created["metadata"]["name"].startswith("n1-gpu.nvidia.com-")
        kube.create_resource_slice(slice_of())
        error = failure(lambda: kube.create_resource_slice(slice_of()))
    assert error.message == f'resourceslice "n1-gpu" already exists in the cluster at {api.url}'


def test_delete_only_the_slice_that_was_read(api: ApiServer, pki: Pki) -> None:
    with admin(api, pki) as kube:
        old = kube.create_resource_slice(slice_of())
        assert kube.delete_resource_slice("n1-gpu") is True
        new = kube.create_resource_slice(slice_of())  # the same name, made again (another writer)
        error = failure(lambda: kube.delete_resource_slice("n1-gpu", old["metadata"]["uid"]))
        assert "Precondition failed: UID in precondition" in error.message
        assert api.dra.get(SLICES, "n1-gpu") is not None
        assert kube.delete_resource_slice("n1-gpu", new["metadata"]["uid"]) is True
        assert kube.delete_resource_slice("n1-gpu") is False  # already gone: nothing to do
        missing = failure(lambda: kube.update_resource_slice(new))
    assert missing.message == f'resourceslice "n1-gpu" does not exist in the cluster at {api.url}'


def test_get_claim_that_does_not_exist(api: ApiServer, pki: Pki) -> None:
    with admin(api, pki) as kube:
        error = failure(lambda: kube.get_resource_claim("ml", "nope"))
    assert error.message == f'resourceclaim "ml/nope" does not exist in the cluster at {api.url}'
    assert error.fix == "check it with `kubectl get resourceclaims -n ml nope`"


def test_apply_device_class_creates_updates_and_keeps_what_it_does_not_own(api: ApiServer, pki: Pki) -> None:
    wanted: dict[str, Any] = {
        "metadata": {"name": "gpu.nvidia.com", "labels": {"app.kubernetes.io/managed-by": "gpunode"}},
        "spec": {
            "selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}],
            "extendedResourceName": "nvidia.com/gpu",
        },
    }
    with admin(api, pki) as kube:
        created, changed = kube.apply_device_class(wanted)
        assert changed and created["metadata"]["generation"] == 1
        again, changed = kube.apply_device_class(wanted)
        assert not changed and again == created
        assert [r.method for r in api.requests] == ["GET", "POST", "GET"]  # nothing written the second time

        current = raw(api, pki, "GET", "/apis/resource.k8s.io/v1/deviceclasses/gpu.nvidia.com").json()
        current["metadata"]["labels"]["team"] = "ml"  # another writer's label: kept
        assert raw(api, pki, "PUT", "/apis/resource.k8s.io/v1/deviceclasses/gpu.nvidia.com", body=current).ok
        wanted["spec"]["selectors"].append(
            {"cel": {"expression": "device.attributes['gpu.nvidia.com'].type == 'gpu'"}}
        )
        updated, changed = kube.apply_device_class(wanted)
    assert changed and updated["metadata"]["generation"] == 2
    assert updated["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gpunode", "team": "ml"}
    assert len(updated["spec"]["selectors"]) == 2


def test_apply_device_class_refused_as_invalid(api: ApiServer, pki: Pki) -> None:
    wanted = {"metadata": {"name": "bad"}, "spec": {"selectors": [{"cel": {"expression": ""}}]}}
    with admin(api, pki) as kube:
        error = failure(lambda: kube.apply_device_class(wanted))
    assert error.message == (
        'the Kubernetes API rejected deviceclass "bad" as invalid: DeviceClass.resource.k8s.io "bad" is '
        "invalid: spec.selectors[0].cel.expression: Required value"
    )


def test_transient_errors_are_retried(api: ApiServer, pki: Pki) -> None:
    api.dra.put(SLICES, slice_of())
    api.fail_next(503, count=2)
    with admin(api, pki) as kube:
        assert len(kube.list_resource_slices("n1", DRIVER)) == 1
    assert [r.status for r in api.requests] == [503, 503, 200]


def test_a_server_without_the_api(api: ApiServer, pki: Pki) -> None:
    generic = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
    api.raw_next(json.dumps(generic).encode(), code=404)
    with admin(api, pki) as kube:
        error = failure(lambda: kube.get_resource_claim("ml", "train"))
    assert "does not serve resource.k8s.io/v1 resourceclaims (404 Not Found)" in error.message
    assert error.fix is not None and "kubectl api-versions" in error.fix


WRONG_SHAPES = {
    "items not a list": ("list", {"kind": "ResourceSliceList", "items": {}}, "items is not a list"),
    "an item without a spec": (
        "list",
        {"items": [{"metadata": {"name": "a", "uid": "u", "resourceVersion": "1"}, "spec": []}]},
        "items[0]: a ResourceSlice whose spec is not an object",
    ),
    "a pool generation that is a string": (
        "list",
        {
            "items": [
                {
                    "metadata": {"name": "a", "uid": "u", "resourceVersion": "1"},
                    "spec": {"driver": DRIVER, "pool": {"name": "n1", "generation": "1"}},
                }
            ]
        },
        "spec.pool.generation is not an integer",
    ),
    "continue that is a number": (
        "list",
        {"items": [], "metadata": {"continue": 7}},
        "continue is not a string",
    ),
    "a claim whose results are an object": (
        "claim",
        {
            "metadata": {"name": "c", "uid": "u", "resourceVersion": "1"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": {"device": "gpu-0"}}}},
        },
        "results is not a list",
    ),
    "a claim result without a device": (
        "claim",
        {
            "metadata": {"name": "c", "uid": "u", "resourceVersion": "1"},
            "spec": {},
            "status": {
                "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "n1"}]}}
            },
        },
        "results[0] lacks request, driver, pool or device strings",
    ),
    "a claim whose config is malformed": (
        "claim",
        {
            "metadata": {"name": "c", "uid": "u", "resourceVersion": "1"},
            "spec": {},
            "status": {"allocation": {"devices": {"config": [{"opaque": {"driver": 1}}]}}},
        },
        "config[0] is malformed",
    ),
    "a claim whose metadata is a list": ("claim", {"metadata": [], "spec": {}}, "without a metadata object"),
    "a created slice without a uid": (
        "create",
        {"metadata": {"name": "n1-gpu", "resourceVersion": "1"}, "spec": {}},
        "metadata.uid is not a string",
    ),
}


@pytest.mark.parametrize(("call", "answer", "problem"), WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_answers_of_the_wrong_shape_are_api_errors(
    api: ApiServer, pki: Pki, call: str, answer: dict[str, Any], problem: str
) -> None:
    api.raw_next(json.dumps(answer).encode(), code=201 if call == "create" else 200)
    calls: dict[str, Callable[[KubeClient], object]] = {
        "list": lambda kube: kube.list_resource_slices("n1", DRIVER),
        "claim": lambda kube: kube.get_resource_claim("ml", "c"),
        "create": lambda kube: kube.create_resource_slice(slice_of()),
    }
    with admin(api, pki) as kube:
        error = failure(lambda: calls[call](kube))
    assert problem in error.message and "which no Kubernetes API server sends" in error.message


@pytest.mark.parametrize(
    "call",
    [
        lambda kube: kube.get_resource_claim("ml", "../../secrets"),
        lambda kube: kube.get_resource_claim("ML_ns", "c"),
        lambda kube: kube.list_resource_slices("n1", "Not/A.Driver"),
        lambda kube: kube.list_resource_slices("../n1", DRIVER),
        lambda kube: kube.delete_resource_slice("a/b"),
        lambda kube: kube.update_resource_slice({"metadata": {"name": "n1-gpu"}, "spec": {}}),
        lambda kube: kube.apply_device_class({"metadata": {"name": "Gpu?x=1"}}),
    ],
)
def test_bad_names_are_refused_before_any_request(
    api: ApiServer, pki: Pki, call: Callable[[KubeClient], object]
) -> None:
    with admin(api, pki) as kube, pytest.raises(UsageError):
        call(kube)
    assert api.requests == []
