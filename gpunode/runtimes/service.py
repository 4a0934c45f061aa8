"""Restart a container runtime through systemd and ask it whether the new configuration took."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from gpunode.errors import CommandFailed
from gpunode.host import Host
from gpunode.runtimes.plan import RuntimePlan
from gpunode.services import journal_tail

RESTART_TIMEOUT = 120.0
READY_TIMEOUT = 60.0
SOCKET = "/run/containerd/containerd.sock"


def restart(host: Host, plan: RuntimePlan) -> None:
    """`systemctl restart UNIT`; a failure carries the unit's own last log lines."""
    unit = plan.unit or f"{plan.runtime}.service"
    result = host.run(["systemctl", "restart", unit], timeout=RESTART_TIMEOUT)
    if not result.ok:
        raise CommandFailed(
            f"`systemctl restart {unit}` failed: {(result.stderr or result.stdout).strip()}"
            + journal_tail(host, unit)
        )


def wait_until_ready(
    host: Host,
    plan: RuntimePlan,
    *,
    timeout: float = READY_TIMEOUT,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Poll the runtime until it answers with the expected runtime (a summary), or raise with why not.

    Polling is right here: a restarting daemon offers nothing to wait on but its socket answering.
    """
    check = {"docker": _check_docker, "containerd": _check_containerd, "crio": _check_crio}[plan.runtime]
    deadline = time.monotonic() + timeout
    while True:
        ok, summary = check(host, plan)
        if ok:
            return summary
        if time.monotonic() >= deadline:
            unit = plan.unit or plan.runtime
            raise CommandFailed(f"{plan.runtime} did not come back: {summary}" + journal_tail(host, unit))
        sleep(0.5)


def _check_docker(host: Host, plan: RuntimePlan) -> tuple[bool, str]:
    fmt = "{{json .Runtimes}}\t{{.DefaultRuntime}}"
    result = host.run(["docker", "-H", f"unix://{plan.socket}", "info", "--format", fmt], timeout=15)
    if not result.ok:
        return False, f"`docker info` failed: {(result.stderr or result.stdout).strip()}"
    runtimes_json, _, default = result.stdout.strip().partition("\t")
    try:
        runtimes = json.loads(runtimes_json)
    except ValueError:
        return False, f"`docker info` printed something unexpected: {result.stdout.strip()[:200]}"
    return _expected(plan, set(runtimes), default.strip(), "dockerd")


def _check_containerd(host: Host, plan: RuntimePlan) -> tuple[bool, str]:
    ctr = ["ctr"] if host.which("ctr") or plan.flavour == "containerd" else [plan.flavour, "ctr"]
    address = ["--address", plan.socket or SOCKET]
    result = host.run([*ctr, *address, "plugins", "ls"], timeout=15)
    if not result.ok:
        why = (result.stderr or result.stdout).strip()
        return False, f"containerd does not answer on {plan.socket}: {why}"
    for line in result.stdout.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] == "io.containerd.grpc.v1" and words[1] == "cri":
            if words[-1] == "ok":
                return True, "containerd answers and its CRI plugin is ok"
            detail = host.run([*ctr, *address, "plugins", "ls", "-d", "id==cri"], timeout=15)
            return False, f"containerd's CRI plugin is in state {words[-1]!r}:\n{detail.stdout.strip()}"
    return False, "containerd answers but lists no CRI plugin"


def _check_crio(host: Host, plan: RuntimePlan) -> tuple[bool, str]:
    unit = plan.unit or "crio.service"
    state = host.run(["systemctl", "is-active", unit], timeout=15).stdout.strip()
    if state != "active":
        return False, f"{unit} is {state or 'not running'}"
    if plan.socket and not host.is_socket(plan.socket):
        return False, f"CRI-O is running but {plan.socket} is not there yet"
    return True, "CRI-O is running and its socket is there"


def _expected(plan: RuntimePlan, runtimes: set[str], default: str, who: str) -> tuple[bool, str]:
    if plan.expect is None:
        return True, f"{who} is running (default runtime: {default})"
    name, as_default = plan.expect
    if name not in runtimes:
        return False, f"{who} is running but does not list the {name!r} runtime"
    if as_default and default != name:
        return False, f"{who} is running but its default runtime is {default!r}, not {name!r}"
    return True, f"{who} lists the {name!r} runtime" + (" as its default" if default == name else "")
