"""The Node condition GPUHealthy that the device plugin keeps (gpunode.kube.events) and that `node withdraw`
and `down` remove: the JSON patch ops on nodes/status, pure (no client, no imports beyond the standard
library), so the withdraw path does not load the plugin."""

from __future__ import annotations

import time
from typing import Any

CONDITION = "GPUHealthy"


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def condition_ops(
    node: dict[str, Any],
    condition: dict[str, Any] | None,
    now: str | None = None,
    *,
    heartbeat: bool = False,
) -> list[dict[str, Any]]:
    """JSON patch ops that make the node's GPUHealthy condition `condition` (type, status, reason, message;
    None: remove it); [] when it is already so, unless `heartbeat`: then an unchanged condition gets a new
    lastHeartbeatTime, so that a condition nobody refreshes any more (the plugin gone) can be told from
    a current one. Both times are set as kubelet sets its own: the heartbeat at each write, the
    transition kept while the status stays."""
    stamp = now or now_rfc3339()
    status = node.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    value = None
    if condition is not None:
        value = {**condition, "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
    if not isinstance(conditions, list):
        return [] if value is None else [{"op": "add", "path": "/status/conditions", "value": [value]}]
    for i, existing in enumerate(conditions):
        if isinstance(existing, dict) and existing.get("type") == CONDITION:
            # A `test` of the type first: should the list have moved, the patch fails instead of replacing
            # another condition (the resourceVersion guard catches that too; this says what it protects).
            test = {"op": "test", "path": f"/status/conditions/{i}/type", "value": CONDITION}
            if value is None:
                return [test, {"op": "remove", "path": f"/status/conditions/{i}"}]
            if all(existing.get(k) == value[k] for k in ("status", "reason", "message")) and not heartbeat:
                return []
            if existing.get("status") == value["status"] and existing.get("lastTransitionTime"):
                value["lastTransitionTime"] = existing["lastTransitionTime"]
            return [test, {"op": "replace", "path": f"/status/conditions/{i}", "value": value}]
    return [] if value is None else [{"op": "add", "path": "/status/conditions/-", "value": value}]
