"""The Kubernetes API client against the test API server (tests/kubeapi/apiserver.py), over real TLS:
success paths, every failure as one clear sentence, retries, read-modify-write on 409, and the token kept
out of every message and log line."""

from __future__ import annotations

import base64
import logging
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import urllib3.util.connection
import yaml

from gpunode.errors import ApiError, ConfigError, ExitCode, UsageError
from gpunode.host import Host
from gpunode.kube import Credentials, Pem, json_pointer
from gpunode.kube.client import KubeClient, RetryPolicy, Timeouts, _proxies
from gpunode.kube.timeout import parse_request_timeout
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.pki import CertPair, Pki
from tests.kubeapi.relay import SlowRelay

TOKEN = "admin-token-5b1e0c2d-never-shown"  # noqa: S105 (test tokens)
VIEWER_TOKEN = "viewer-token-88aa-never-shown"  # noqa: S105
TOKEN_FILE = "/var/run/token"  # noqa: S105
OTHER = {
    "wrong": "wrong-token-0000",
    "sa": "sa-token-1111",
    "node": "node-token-2222",
    "expired": "expired-3333",
}
FAST = RetryPolicy(attempts=3, backoff=0.001, max_backoff=0.01, max_retry_after=0.05, conflict_attempts=3)
TIMEOUTS = Timeouts(connect=2.0, read=3.0)
GPU = json_pointer("status", "capacity", "nvidia.com/gpu")
MERGE, JSONP = "application/merge-patch+json", "application/json-patch+json"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def serving(pki: Pki) -> CertPair:
    return pki.server()


@pytest.fixture
def api(pki: Pki, serving: CertPair) -> Iterator[ApiServer]:
    with ApiServer(
        pki,
        server_cert=serving,
        tokens={TOKEN: "admin", VIEWER_TOKEN: "viewer"},
        allow=[("admin", "*", "*"), ("viewer", "get", "nodes")],
    ) as server:
        server.add_node("n1")
        yield server


@pytest.fixture(autouse=True)
def token_never_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    assert TOKEN not in caplog.text and VIEWER_TOKEN not in caplog.text


def creds(api: ApiServer, pki: Pki, token: str | None = TOKEN, **kwargs: Any) -> Credentials:
    kwargs.setdefault("verify", Pem(origin=str(pki.ca.cert), path=pki.ca.cert))
    return Credentials(
        server=api.url, source='kubeconfig /root/.kube/config, context "test"', token=token, **kwargs
    )


def client(credentials: Credentials, **kwargs: Any) -> KubeClient:
    kwargs.setdefault("retry", FAST)
    kwargs.setdefault("timeouts", TIMEOUTS)
    return KubeClient(credentials, env={}, **kwargs)


def failure(call: Callable[[], object]) -> ApiError:
    """The ApiError a call raises, checked for what every one must be: one sentence, no token."""
    with pytest.raises(ApiError) as raised:
        call()
    error = raised.value
    assert error.exit_code == ExitCode.API
    assert "\n" not in error.message
    assert TOKEN not in str(error) and VIEWER_TOKEN not in str(error)
    return error


# -- success paths ------------------------------------------------------------------------------------------


def test_get_and_patch(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki)) as kube:
        node = kube.get_node("n1")
        assert node["metadata"]["name"] == "n1"
        version = node["metadata"]["resourceVersion"]

        patched = kube.patch_node_status("n1", [{"op": "add", "path": GPU, "value": "4"}])
        assert patched["status"]["capacity"]["nvidia.com/gpu"] == "4"
        assert int(patched["metadata"]["resourceVersion"]) > int(version)

        labelled = kube.patch_node(
            "n1", {"metadata": {"labels": {"nvidia.com/gpu.present": "true", "kubernetes.io/os": None}}}
        )
        assert labelled["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        assert "kubernetes.io/os" not in labelled["metadata"]["labels"]  # null deletes (RFC 7386)

    assert api.node("n1")["status"]["capacity"]["nvidia.com/gpu"] == "4"
    logged = [(r.method, r.path, r.content_type, r.user, r.authenticated_by, r.status) for r in api.requests]
    assert logged == [
        ("GET", "/api/v1/nodes/n1", None, "admin", "token", 200),
        ("PATCH", "/api/v1/nodes/n1/status", "application/json-patch+json", "admin", "token", 200),
        ("PATCH", "/api/v1/nodes/n1", "application/merge-patch+json", "admin", "token", 200),
    ]


def test_client_certificate_from_a_kubeconfig_with_inline_data(
    api: ApiServer, pki: Pki, tmp_path: Path
) -> None:
    user = pki.client("system:node:n1", ["system:nodes"])
    api.allow("system:node:n1", "*", "*")
    config = {
        "clusters": [
            {"name": "c", "cluster": {"server": api.url, "certificate-authority-data": _b64(pki.ca.cert)}}
        ],
        "users": [
            {
                "name": "u",
                "user": {"client-certificate-data": _b64(user.cert), "client-key-data": _b64(user.key)},
            }
        ],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "root/.kube").mkdir(parents=True)
    (tmp_path / "root/.kube/config").write_text(yaml.safe_dump(config))
    host = Host(root=tmp_path, env={"HOME": "/root"}, euid=0)

    kube = KubeClient.from_host(host, retry=FAST, timeouts=TIMEOUTS)
    with kube:
        assert kube.get_node("n1")["metadata"]["name"] == "n1"
        # requests loads certificates from files: private copies, removed on close.
        assert kube._cert is not None and isinstance(kube._verify, str)
        private = Path(kube._cert[0]).parent
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        for path in (*kube._cert, kube._verify):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert Path(path).parent == private
    assert not private.exists()
    assert api.requests[-1].user == "system:node:n1"
    assert api.requests[-1].authenticated_by == "certificate"
    assert not api.requests[-1].sent_authorization


def test_client_certificate_files_are_used_in_place(api: ApiServer, pki: Pki) -> None:
    user = pki.client("alice")
    api.allow("alice", "get", "nodes")
    pair = (Pem(str(user.cert), path=user.cert), Pem(str(user.key), path=user.key))
    with client(creds(api, pki, token=None, cert=pair)) as kube:
        kube.get_node("n1")
        assert kube._tempdir is None
        assert kube._cert == (str(user.cert), str(user.key))
    assert api.requests[-1].user == "alice"


def test_key_that_does_not_match_the_certificate(api: ApiServer, pki: Pki) -> None:
    one, other = pki.client("a"), pki.client("b")
    pair = (Pem("cert.pem", path=one.cert), Pem("key.pem", path=other.key))
    with pytest.raises(
        ConfigError, match=r"client certificate from cert\.pem and key from key\.pem cannot be used"
    ):
        client(creds(api, pki, token=None, cert=pair))


def test_read_modify_write_with_nothing_to_do_writes_nothing(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki)) as kube:
        node = kube.update_node_status("n1", lambda node: None)
        assert node["metadata"]["name"] == "n1"
    assert [r.method for r in api.requests] == ["GET"]


def test_read_modify_write_sends_the_resource_version_it_read(api: ApiServer, pki: Pki) -> None:
    version = api.node("n1")["metadata"]["resourceVersion"]
    with client(creds(api, pki)) as kube:
        node = kube.update_node_status("n1", lambda node: [{"op": "add", "path": GPU, "value": "8"}])
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
        node = kube.update_node("n1", lambda node: {"metadata": {"labels": {"gpunode": "yes"}}})
        assert node["metadata"]["labels"]["gpunode"] == "yes"
    status_patch, merge_patch = api.requests[1].body, api.requests[3].body
    assert status_patch[0] == {"op": "replace", "path": "/metadata/resourceVersion", "value": version}
    assert merge_patch["metadata"]["resourceVersion"] == str(int(version) + 1)


def test_409_is_retried_with_a_fresh_read(api: ApiServer, pki: Pki) -> None:
    seen: list[str] = []

    def compute(node: dict[str, Any]) -> list[dict[str, Any]]:
        seen.append(node["metadata"]["resourceVersion"])
        if len(seen) == 1:
            api.modify_node("n1", lambda n: n["status"]["capacity"].update({"example.com/foo": "1"}))
        return [{"op": "add", "path": GPU, "value": "2"}]

    with client(creds(api, pki)) as kube:
        node = kube.update_node_status("n1", compute)
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "2"
    assert node["status"]["capacity"]["example.com/foo"] == "1"  # the other writer's change is kept
    assert len(seen) == 2 and seen[0] != seen[1]
    assert [(r.method, r.status) for r in api.requests] == [
        ("GET", 200),
        ("PATCH", 409),
        ("GET", 200),
        ("PATCH", 200),
    ]


def test_409_for_ever_gives_up(api: ApiServer, pki: Pki) -> None:
    def compute(node: dict[str, Any]) -> dict[str, Any]:
        api.modify_node("n1")
        return {"metadata": {"labels": {"a": "b"}}}

    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.update_node("n1", compute))
    assert error.message.startswith(
        'node "n1" kept changing while gpunode updated it: all 3 attempts met a 409'
    )
    assert [r.status for r in api.requests].count(409) == 3


def test_plain_http_like_kubectl_proxy(tmp_path: Path) -> None:
    with ApiServer(None, allow=[("admin", "*", "*")]) as proxy:
        proxy.add_node("n1")
        credentials = Credentials(server=proxy.url, source="--server", token=TOKEN)  # never sent in the clear
        with client(credentials) as kube:
            kube.patch_node("n1", {"metadata": {"labels": {"x": "y"}}})
        assert proxy.node("n1")["metadata"]["labels"]["x"] == "y"
        assert not any(r.sent_authorization for r in proxy.requests)


def test_rotated_token_is_read_again(api: ApiServer, pki: Pki) -> None:
    credentials = creds(api, pki, token=OTHER["expired"], token_file=TOKEN_FILE, reload_token=lambda: TOKEN)
    with client(credentials) as kube:
        kube.get_node("n1")
    assert [r.status for r in api.requests] == [401, 200]


def test_impersonation(api: ApiServer, pki: Pki) -> None:
    api.allow("admin", "impersonate", "users")
    api.allow("jane", "get", "nodes")
    with client(creds(api, pki, impersonate_user="jane")) as kube:
        kube.get_node("n1")
    assert api.requests[-1].user == "jane"
    with client(creds(api, pki, token=VIEWER_TOKEN, impersonate_user="jane")) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert 'user "viewer" may not impersonate users' in error.message


# -- failures, each one sentence ----------------------------------------------------------------------------


def test_401_names_the_credentials_source(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki, token=OTHER["wrong"])) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message == (
        f"the Kubernetes API at {api.url} rejected the credentials (a bearer token from kubeconfig "
        '/root/.kube/config, context "test"): 401 Unauthorized'
    )
    assert OTHER["wrong"] not in str(error)


def test_no_credentials_at_all(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki, token=None)) as kube:
        assert "rejected the credentials (no credentials from" in failure(lambda: kube.get_node("n1")).message


def test_403_names_the_verb_and_resource(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki, token=VIEWER_TOKEN)) as kube:
        kube.get_node("n1")
        error = failure(lambda: kube.patch_node_status("n1", [{"op": "add", "path": GPU, "value": "1"}]))
    assert error.message.startswith(
        'the Kubernetes API refused: user "viewer" may not patch nodes/status (node "n1"'
    )
    assert error.fix is not None
    assert "--resource=nodes,nodes/status" in error.fix and "--user=viewer" in error.fix


def test_403_for_a_service_account_and_for_a_kubelet(api: ApiServer, pki: Pki) -> None:
    api.tokens[OTHER["sa"]] = "system:serviceaccount:gpu:gpunode"
    api.tokens[OTHER["node"]] = "system:node:n2"
    with client(creds(api, pki, token=OTHER["sa"])) as kube:
        assert "--serviceaccount=gpu:gpunode" in (failure(lambda: kube.get_node("n1")).fix or "")
    with client(creds(api, pki, token=OTHER["node"])) as kube:
        error = failure(lambda: kube.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}))
    assert 'user "system:node:n2" may not patch nodes' in error.message
    assert 'only their own node ("n2")' in (error.fix or "")


def test_404_names_the_node(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("gpu-7"))
    assert error.message == f'node "gpu-7" does not exist in the cluster at {api.url}'
    assert error.fix is not None and "kubectl get nodes" in error.fix


def test_404_for_a_server_that_is_not_an_api_server(api: ApiServer, pki: Pki) -> None:
    credentials = creds(api, pki)
    credentials = Credentials(
        server=f"{api.url}/wrong-prefix", source=credentials.source, verify=credentials.verify, token=TOKEN
    )
    with client(credentials) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert (
        "has no /wrong-prefix/api/v1/nodes/n1 (404 Not Found): is it a Kubernetes API server?"
        in error.message
    )


def test_422_for_a_patch_that_does_not_apply(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki)) as kube:
        error = failure(
            lambda: kube.patch_node_status("n1", [{"op": "replace", "path": "/status/nope/x", "value": 1}])
        )
    assert error.message == (
        'the Kubernetes API rejected the change to node "n1" as invalid: replace operation does not apply: '
        'doc is missing path: "/status/nope/x": missing value'
    )


def test_422_for_an_invalid_value(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.patch_node_status("n1", [{"op": "add", "path": GPU, "value": "four"}]))
    assert error.message.startswith(
        'the Kubernetes API rejected the change to node "n1" as invalid: Node "n1" is invalid: '
        'status.capacity[nvidia.com/gpu]: Invalid value: "four": quantities must match'
    )
    assert api.node("n1")["status"]["capacity"].get("nvidia.com/gpu") is None


def test_a_plain_409_without_read_modify_write(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki)) as kube:
        error = failure(
            lambda: kube.patch_node("n1", {"metadata": {"resourceVersion": "1", "labels": {"a": "b"}}})
        )
    assert error.message.startswith(
        'the Kubernetes API refused the change to node "n1": Operation cannot be fulfilled'
    )


def test_invalid_node_name_is_refused_before_any_request(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki)) as kube, pytest.raises(UsageError, match="is not a valid node name"):
        kube.get_node("../../secrets")
    assert api.requests == []


# -- retries --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [500, 502, 503, 504, 429])
def test_transient_errors_are_retried(api: ApiServer, pki: Pki, code: int) -> None:
    api.fail_next(code, count=2)
    with client(creds(api, pki)) as kube:
        assert kube.patch_node_status("n1", [{"op": "add", "path": GPU, "value": "1"}])
    assert [r.status for r in api.requests] == [code, code, 200]


def test_retry_after_is_honoured(api: ApiServer, pki: Pki) -> None:
    api.fail_next(429, count=2, retry_after=0.03)
    waits: list[float] = []
    retry = RetryPolicy(attempts=3, backoff=0.001, max_retry_after=10)
    with client(creds(api, pki), retry=retry, sleep=waits.append) as kube:
        kube.get_node("n1")
    assert waits == [0.03, 0.03]


def test_retry_after_is_capped(api: ApiServer, pki: Pki) -> None:
    api.fail_next(503, count=1, retry_after=3600)
    waits: list[float] = []
    with client(creds(api, pki), sleep=waits.append) as kube:
        kube.get_node("n1")
    assert waits == [FAST.max_retry_after]


def test_backoff_grows(api: ApiServer, pki: Pki) -> None:
    api.fail_next(500, count=3)
    waits: list[float] = []
    retry = RetryPolicy(attempts=4, backoff=0.1, max_backoff=0.3)
    with client(creds(api, pki), retry=retry, sleep=waits.append) as kube:
        kube.get_node("n1")
    assert len(waits) == 3
    assert 0.05 <= waits[0] <= 0.1 and 0.1 <= waits[1] <= 0.2 and 0.15 <= waits[2] <= 0.3


def test_retries_exhausted(api: ApiServer, pki: Pki) -> None:
    api.fail_next(503, count=5)
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message == (
        f"the Kubernetes API at {api.url}/api/v1/nodes/n1 answered 503 Service Unavailable 3 times in a row: "
        "the server is currently unable to handle the request"
    )
    assert len(api.requests) == 3


def test_other_errors_are_not_retried(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki, token=VIEWER_TOKEN)) as kube:
        failure(lambda: kube.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}))
    assert len(api.requests) == 1


def test_slow_answer_times_out(api: ApiServer, pki: Pki) -> None:
    # The delay outlasts any stall of a loaded machine (the server's stop wakes it). Only the first answer is
    # delayed: a retry would have been answered, so the error itself shows the call was not retried (each
    # try would wait the whole timeout again).
    api.delay_next(120.0)
    with client(creds(api, pki), timeouts=Timeouts(connect=1.0, read=0.2)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message == f"the Kubernetes API at {api.url}/api/v1/nodes/n1 did not answer within 0.2 s"


# -- hostile servers: an overall deadline and a bounded answer ----------------------------------------------
# Each read below comes well within the read timeout: only the deadline for the whole answer can end them.


@pytest.mark.parametrize("phase", ["body", "headers"])
def test_a_trickled_answer_ends_at_the_deadline(api: ApiServer, pki: Pki, phase: str) -> None:
    api.trickle_next(0.25, phase=phase, limit=20.0)
    with client(creds(api, pki), timeouts=Timeouts(connect=120.0, read=120.0, total=1.0)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message == (
        f"the Kubernetes API at {api.url}/api/v1/nodes/n1 did not send its whole answer within 1 s"
    )
    assert error.fix is not None and "/readyz" in error.fix
    assert len(api.requests) == 1  # not retried: a stalling server would stall every try
    # Cut off after about 1 s of the 20 s the server would go on: a few bytes of the body (or headers).
    assert api.streamed < 200


def test_the_deadline_defaults_to_connect_plus_read(api: ApiServer, pki: Pki) -> None:
    api.trickle_next(0.25, limit=20.0)
    with client(creds(api, pki), timeouts=Timeouts(connect=0.5, read=1.0)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message.endswith("did not send its whole answer within 1.5 s")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("0", 0.0), ("30", 30.0), ("10s", 10.0), ("1m30s", 90.0), ("500ms", 0.5), ("1.5h", 5400.0), ("0s", 0.0)],
)
def test_request_timeout_values_as_kubectl_reads_them(value: str, seconds: float) -> None:
    assert parse_request_timeout(value) == seconds


@pytest.mark.parametrize("value", ["", "5x", "1.5", "-1s", "s", "10 s", "ten"])
def test_request_timeout_values_kubectl_refuses(value: str) -> None:
    with pytest.raises(UsageError, match="is not a timeout"):
        parse_request_timeout(value)


def test_request_timeouts_become_the_deadline() -> None:
    assert Timeouts.for_request_timeout(None) == Timeouts()  # not given: the defaults, 35 s in all
    assert Timeouts.for_request_timeout(None).deadline == 35.0
    assert Timeouts.for_request_timeout(2.0) == Timeouts(connect=2.0, read=2.0, total=2.0)
    assert Timeouts.for_request_timeout(60.0) == Timeouts(connect=5.0, read=60.0, total=60.0)
    assert Timeouts.for_request_timeout(0.0).deadline is None  # 0: no timeout


def test_request_timeout_zero_waits_for_a_slow_answer(api: ApiServer, pki: Pki) -> None:
    # Slower than both the 1 s deadline and the read timeout below would allow: only "no timeout" waits.
    api.delay_next(1.5)
    with client(creds(api, pki), timeouts=Timeouts.for_request_timeout(0.0)) as kube:
        assert kube.get_node("n1")["metadata"]["name"] == "n1"
    api.delay_next(1.5)
    with client(creds(api, pki), timeouts=Timeouts.for_request_timeout(1.0)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert "within 1 s" in error.message


def test_a_body_announced_huge_is_refused_unread(api: ApiServer, pki: Pki) -> None:
    api.flood_next(announce=2**30)
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message == (
        f"the answer from {api.url}/api/v1/nodes/n1 is larger than 16 MiB (1073741824 bytes), far larger "
        "than any Node object: it is not the Kubernetes API answering"
    )
    assert error.fix is not None and "check the server URL" in error.fix
    assert len(api.requests) == 1
    assert api.streamed < 64 * 2**20  # the client hung up long before the server's 256 MiB cap


def test_an_endless_body_stops_at_the_size_limit(api: ApiServer, pki: Pki) -> None:
    api.flood_next(announce=None)  # chunked: no length to refuse up front
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message.startswith(f"the answer from {api.url}/api/v1/nodes/n1 is larger than 16 MiB,")
    assert len(api.requests) == 1
    assert api.streamed < 64 * 2**20
    # The connection it hung up on is not used again: the next request is answered normally.
    with client(creds(api, pki)) as kube:
        assert kube.get_node("n1")["metadata"]["name"] == "n1"


def test_a_hostile_answer_to_a_patch_ends_the_same_way(api: ApiServer, pki: Pki) -> None:
    with client(creds(api, pki), timeouts=Timeouts(connect=120.0, read=120.0, total=1.0)) as kube:
        kube.get_node("n1")  # a connection kept alive, reused below
        api.trickle_next(0.25, limit=20.0)
        error = failure(lambda: kube.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}))
        assert "did not send its whole answer within 1 s" in error.message
        assert kube.get_node("n1")["metadata"]["name"] == "n1"  # and the client still works


@pytest.mark.parametrize("code", [200, 500])
def test_json_nested_without_end_is_no_kubernetes_object(api: ApiServer, pki: Pki, code: int) -> None:
    # A few hundred KiB of "[": the JSON decoder recurses once per level, past Python's limit.
    api.raw_next(b"[" * 300_000, code=code, count=3)
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    if code == 200:
        assert error.message == (
            f"the server at {api.url}/api/v1/nodes/n1 answered 200 with something other than a Kubernetes "
            "object: is it a Kubernetes API server?"
        )
    else:
        assert error.message == (
            f"the Kubernetes API at {api.url}/api/v1/nodes/n1 answered 500 Internal Server Error 3 times in "
            "a row"
        )


# -- secrets, whatever their content ---------------------------------------------------------------------


def exception_chain(error: BaseException) -> list[BaseException]:
    """error and every exception --debug's traceback would print with it (causes and contexts)."""
    chain: list[BaseException] = []
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or any(current is seen for seen in chain):
            continue
        chain.append(current)
        pending.extend([current.__cause__, current.__context__])
    return chain


def test_a_token_with_a_line_break_is_never_shown(api: ApiServer, pki: Pki) -> None:
    # Resolution refuses such a token (test_kube_credentials); the client must still never echo one.
    secret = "first-half-of-a-secret\nsecond-half-of-a-secret"  # noqa: S105
    with client(creds(api, pki, token=secret)) as kube, pytest.raises(ApiError) as raised:
        kube.get_node("n1")
    error = raised.value
    assert error.exit_code == ExitCode.API
    assert "a header value holds a line break or control character" in error.message
    for exc in exception_chain(error):
        shown = f"{exc} {exc.args!r}"
        assert "first-half-of-a-secret" not in shown and "second-half-of-a-secret" not in shown
    assert api.requests == []  # nothing was sent


def test_a_proxy_password_is_never_shown(api: ApiServer, pki: Pki) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens: the proxy is unreachable
    proxy = f"http://user:proxy-password-7a7a@127.0.0.1:{port}"
    credentials = creds(api, pki, proxy=proxy)
    assert "proxy-password-7a7a" not in repr(credentials)
    # A proxy is never used for a loopback server; this one is named by the kubeconfig, so it is.
    with client(credentials) as kube:
        error = failure(lambda: kube.get_node("n1"))
    for exc in exception_chain(error):
        assert "proxy-password-7a7a" not in f"{exc} {exc.args!r}"


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every TCP connection the client opens, by (host, port): attempts counted where they are made."""
    made: list[tuple[str, int]] = []
    real = urllib3.util.connection.create_connection

    def counted(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        made.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(urllib3.util.connection, "create_connection", counted)
    return made


def test_unreachable_server_names_the_url(pki: Pki, connects: list[tuple[str, int]]) -> None:
    # Connection refused is final at once, as kubectl gives up: no second try, no wait.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    credentials = Credentials(server=f"https://127.0.0.1:{port}", source="test", token=TOKEN)
    waits: list[float] = []
    with client(credentials, sleep=waits.append) as kube:
        error = failure(lambda: kube.get_node("n1"))
        failure(lambda: kube.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}))
    assert error.message == (
        f"cannot reach the Kubernetes API at https://127.0.0.1:{port}/api/v1/nodes/n1: connection refused"
    )
    assert error.fix is not None and f"https://127.0.0.1:{port} is its address" in error.fix
    assert connects == [("127.0.0.1", port)] * 2 and waits == []


def test_a_name_that_does_not_resolve_is_final_at_once(
    monkeypatch: pytest.MonkeyPatch, connects: list[tuple[str, int]]
) -> None:
    # The resolver is stood in for, so the test needs no DNS server to fail (nor waits for one to time out).
    def no_such_name(host: str, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    credentials = Credentials(server="https://api.cluster.invalid:6443", source="test", token=TOKEN)
    waits: list[float] = []
    with client(credentials, sleep=waits.append) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message == (
        "cannot reach the Kubernetes API at https://api.cluster.invalid:6443/api/v1/nodes/n1: "
        "the host name does not resolve"
    )
    assert connects == [("api.cluster.invalid", 6443)] and waits == []


def test_a_reset_after_the_request_is_retried_for_a_get_only(api: ApiServer, pki: Pki) -> None:
    # A GET may be sent again; a PATCH the server may already have applied is not.
    api.reset_next(count=2)
    with client(creds(api, pki)) as kube:
        assert kube.get_node("n1")["metadata"]["name"] == "n1"
    assert [r.method for r in api.requests] == ["GET"] * 3

    api.reset_next(count=1)
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}))
    assert error.message.startswith(f"cannot reach the Kubernetes API at {api.url}/api/v1/nodes/n1: ")
    assert "tried" not in error.message
    assert [r.method for r in api.requests[3:]] == ["PATCH"]


def test_resets_for_ever_give_up_after_the_attempts(api: ApiServer, pki: Pki) -> None:
    api.reset_next(count=5)
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message.endswith("(tried 3 times)")
    assert len(api.requests) == 3


def test_wrong_ca_is_a_verification_error(api: ApiServer, tmp_path: Path) -> None:
    other = Pki.create(tmp_path / "other", name="other-ca")
    credentials = Credentials(
        server=api.url, source="test", token=TOKEN, verify=Pem(str(other.ca.cert), path=other.ca.cert)
    )
    with client(credentials) as kube:
        error = failure(lambda: kube.get_node("n1"))
    # The detail in parentheses is OpenSSL's own words, which vary with its version.
    assert error.message.startswith(
        f"cannot connect securely to the Kubernetes API at {api.url}/api/v1/nodes/n1: "
        "certificate verification failed ("
    )
    assert error.fix is not None and f"signed by the CA from {other.ca.cert}" in error.fix
    assert api.requests == []  # the token never left


def test_system_cas_do_not_trust_a_private_ca(api: ApiServer) -> None:
    with client(Credentials(server=api.url, source="test", token=TOKEN)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert "certificate verification failed" in error.message
    assert error.fix is not None and "certificate-authority" in error.fix


def test_certificate_for_another_host(pki: Pki, tmp_path: Path) -> None:
    elsewhere = pki.server(hosts=["apiserver.example"], name="elsewhere")
    server = ApiServer(pki, server_cert=elsewhere, tokens={TOKEN: "admin"}, allow=[("admin", "*", "*")])
    with server as api, client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert (
        "certificate verification failed (IP address mismatch, certificate is not valid for '127.0.0.1'"
        in (error.message)
    )


def test_insecure_skip_tls_verify_connects_without_checking(api: ApiServer) -> None:
    with client(Credentials(server=api.url, source="test", token=TOKEN, verify=False)) as kube:
        assert kube.get_node("n1")["metadata"]["name"] == "n1"


# -- proxies ------------------------------------------------------------------------------------------------


def test_proxies_from_the_environment_and_the_kubeconfig() -> None:
    env = {"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "10.0.0.0/8,.internal,cp.example:6443"}
    assert _proxies("https://api.example:6443", None, env) == {"https": "http://proxy:3128"}
    assert _proxies("https://10.1.2.3:6443", None, env) == {}
    assert _proxies("https://a.internal:6443", None, env) == {}
    assert _proxies("https://cp.example:6443", None, env) == {}
    assert _proxies("https://cp.example:443", None, env) == {"https": "http://proxy:3128"}
    assert _proxies("https://127.0.0.1:6443", None, env) == {}  # never for loopback
    assert _proxies("https://api.example:6443", "http://p:8080", {}) == {"https": "http://p:8080"}
    assert _proxies("https://api.example:6443", None, {}) == {}


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_connect_timeout_is_named_and_not_retried(tmp_path: Path, connects: list[tuple[str, int]]) -> None:
    # A listener whose accept queue is full: the kernel drops further SYNs, so connecting times out.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        try:
            credentials = Credentials(server=f"https://127.0.0.1:{port}", source="test", token=TOKEN)
            with client(credentials, timeouts=Timeouts(connect=0.2, read=1.0)) as kube:
                error = failure(lambda: kube.get_node("n1"))
        finally:
            for filler in fillers:
                filler.close()
    assert error.message == (
        f"cannot reach the Kubernetes API at https://127.0.0.1:{port}/api/v1/nodes/n1: no connection within "
        "0.2 s"
    )
    assert connects == [("127.0.0.1", port)]


def test_a_status_that_is_not_retried(api: ApiServer, pki: Pki) -> None:
    api.fail_next(501)
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message.startswith(
        f"the Kubernetes API at {api.url}/api/v1/nodes/n1 answered 501 Not Implemented"
    )
    assert len(api.requests) == 1


def test_importing_gpunode_kube_loads_neither_requests_nor_yaml() -> None:
    code = (
        "import sys, gpunode.kube, gpunode.kube.credentials; "
        "print(sorted(m for m in ('requests', 'yaml', 'urllib3') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# -- the test server itself behaves like kube-apiserver ------------------------------------------------------


def raw(api: ApiServer, pki: Pki, method: str, path: str, **kwargs: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {TOKEN}", **kwargs.pop("headers", {})}
    return requests.request(
        method, api.url + path, headers=headers, verify=str(pki.ca.cert), timeout=5, **kwargs
    )


def test_server_answers_statuses_shaped_like_kubernetes(api: ApiServer, pki: Pki) -> None:
    answer = raw(api, pki, "PATCH", "/api/v1/nodes/n1", data=b"{}", headers={"Content-Type": "text/plain"})
    assert answer.status_code == 415
    assert answer.json()["reason"] == "UnsupportedMediaType"
    assert raw(api, pki, "DELETE", "/api/v1/nodes/n1").json()["reason"] == "MethodNotAllowed"
    unknown = raw(api, pki, "GET", "/api/v1/pods")
    assert (unknown.status_code, unknown.json()["message"]) == (
        404,
        "the server could not find the requested resource",
    )
    unauthorized = raw(api, pki, "GET", "/api/v1/nodes/n1", headers={"Authorization": "Bearer nope"})
    assert unauthorized.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Unauthorized",
        "reason": "Unauthorized",
        "code": 401,
    }
    forbidden = raw(
        api, pki, "PATCH", "/api/v1/nodes/n1/status", headers={"Authorization": f"Bearer {VIEWER_TOKEN}"}
    )
    assert forbidden.json()["message"] == (
        'nodes "n1" is forbidden: User "viewer" cannot patch resource "nodes/status" in API group "" at the '
        "cluster scope"
    )
    assert forbidden.json()["details"] == {"name": "n1", "kind": "nodes"}
    assert not any(TOKEN in repr(entry) for entry in api.requests)


def test_server_subresources_and_resource_versions(api: ApiServer, pki: Pki) -> None:
    version = api.node("n1")["metadata"]["resourceVersion"]
    # The main resource ignores status; the status subresource ignores spec.
    merge = {"status": {"capacity": {"x": "1"}}, "spec": {"unschedulable": True}}
    body = raw(api, pki, "PATCH", "/api/v1/nodes/n1", json=merge, headers={"Content-Type": MERGE}).json()
    assert body["spec"]["unschedulable"] is True and "x" not in body["status"]["capacity"]
    ops = [
        {"op": "add", "path": "/spec/taints", "value": []},
        {"op": "add", "path": "/status/phase", "value": "Up"},
    ]
    body = raw(api, pki, "PATCH", "/api/v1/nodes/n1/status", json=ops, headers={"Content-Type": JSONP}).json()
    assert "taints" not in body["spec"] and body["status"]["phase"] == "Up"
    assert int(body["metadata"]["resourceVersion"]) == int(version) + 2
    # A patch that changes nothing writes nothing.
    same = raw(
        api, pki, "PATCH", "/api/v1/nodes/n1/status", json=ops[1:], headers={"Content-Type": JSONP}
    ).json()
    assert same["metadata"]["resourceVersion"] == body["metadata"]["resourceVersion"]
    # A failing test op is a 422 (not a 409), as with the real server.
    test = [{"op": "test", "path": "/metadata/resourceVersion", "value": version}]
    failed = raw(api, pki, "PATCH", "/api/v1/nodes/n1/status", json=test, headers={"Content-Type": JSONP})
    assert failed.status_code == 422
    assert failed.json()["message"] == "the server rejected our request due to an error in our request"
    assert (
        failed.json()["details"]["causes"][0]["message"]
        == "testing value /metadata/resourceVersion failed: test failed"
    )


def test_a_server_slow_from_its_tls_handshake_on_ends_at_the_deadline(api: ApiServer, pki: Pki) -> None:
    # Each byte arrives well within the connect and read timeouts; the handshake alone would take minutes at
    # this pace. Those timeouts are far above the total deadline so that only the deadline can end the call,
    # however late a loaded machine runs the relay's thread (with 2 s, a stalled relay once let the read
    # timeout fire first).
    with SlowRelay(api.port, interval=0.25, limit=20.0) as relay:
        slow = Credentials(
            server=relay.url, source="test", token=TOKEN, verify=Pem(str(pki.ca.cert), path=pki.ca.cert)
        )
        with client(slow, timeouts=Timeouts(connect=120.0, read=120.0, total=1.0)) as kube:
            error = failure(lambda: kube.get_node("n1"))
        assert error.message == (
            f"the Kubernetes API at {relay.url}/api/v1/nodes/n1 did not send its whole answer within 1 s"
        )
        assert relay.relayed < 20  # a few bytes of the server's handshake, of the 20 s it would take
    assert api.requests == []


def test_a_redirect_is_an_answer_not_followed(api: ApiServer, pki: Pki) -> None:
    # Never followed: the token would go wherever the server points.
    api.raw_next(b"", code=302, headers={"Location": "https://elsewhere.example/api/v1/nodes/n1"})
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message == f"the Kubernetes API at {api.url}/api/v1/nodes/n1 answered 302 Found"
    assert len(api.requests) == 1


def test_a_redirect_whose_body_has_no_end_is_stopped_at_the_size_limit(api: ApiServer, pki: Pki) -> None:
    # requests' Session.send reads a redirect's whole body even when it does not follow it.
    api.flood_next(announce=None, code=302, headers={"Location": "https://elsewhere.example/"})
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.message.startswith(f"the answer from {api.url}/api/v1/nodes/n1 is larger than 16 MiB,")
    assert api.streamed < 64 * 2**20
