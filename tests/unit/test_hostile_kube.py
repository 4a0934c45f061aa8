"""Answers no Kubernetes API server sends: a Node whose labels are not a map, an integer annotation, JSON
nested 100,000 deep. Each is an API error (exit 9) naming what is wrong, never a crash in a reader (issue
23). Over real TLS against the test API server, with test_kube_client's fixtures."""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.errors import ApiError, ExitCode
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.pki import Pki
from tests.unit import test_kube_client as base

# test_kube_client's fixtures, used here by name.
pki, serving, api, token_never_logged = base.pki, base.serving, base.api, base.token_never_logged
client, creds, failure = base.client, base.creds, base.failure


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda n: n["metadata"].update({"annotations": {"gpunode.io/capacity": 5}}), "metadata.annotations"),
        (lambda n: n["metadata"].update({"labels": ["a", "b"]}), "metadata.labels"),
        (lambda n: n.update({"status": "x"}), "status is not an object"),
        (lambda n: n["status"].update({"capacity": {"nvidia.com/gpu": 4}}), "status.capacity"),
        (lambda n: n["status"].update({"conditions": {"Ready": True}}), "status.conditions"),
    ],
)
def test_a_node_of_the_wrong_shape_is_an_api_error(
    api: ApiServer, pki: Pki, change: Any, problem: str
) -> None:
    api.modify_node("n1", change)
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert error.exit_code == ExitCode.API
    assert "answered a Node whose " + problem in error.message


def test_json_nested_thousands_deep_is_not_a_kubernetes_object(api: ApiServer, pki: Pki) -> None:
    api.raw_next(b"[" * 100_000 + b"]" * 100_000, headers={"Content-Type": "application/json"})
    with client(creds(api, pki)) as kube:
        error = failure(lambda: kube.get_node("n1"))
    assert isinstance(error, ApiError) and "something other than a Kubernetes object" in error.message
