"""What the two fake kubelets (kubelet.py for device plugins, drakubelet.py for DRA drivers) do alike: wait
on their record of what happened, and word a gRPC error as kubelet logs it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(
    cond: threading.Condition, found: Callable[[], T | None], timeout: float, gave_up: Callable[[], str]
) -> T:
    """found() under `cond`, again each time the condition is notified, until it returns something; after
    `timeout` seconds a TimeoutError with gave_up()'s text (called under the lock, so that it may read the
    record to say what did happen instead)."""
    deadline = time.monotonic() + timeout
    with cond:
        while (result := found()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(gave_up())
            cond.wait(left)
        return result


def rpc_error_text(err: Any) -> str:
    """A grpc.RpcError as Go's status error prints it (what kubelet logs and returns)."""
    return f"rpc error: code = {err.code().name} desc = {err.details()}"
