"""Restart a container runtime through systemd and ask it whether the new configuration took."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from gpunode.errors import CommandFailed, GpunodeError
from gpunode.host import Host
from gpunode.runtimes.plan import RuntimePlan
from gpunode.services import journal_tail

RESTART_TIMEOUT = 120.0
READY_TIMEOUT = 60.0
SOCKET = "/run/containerd/containerd.sock"


def restart_commands(host: Host, plan: RuntimePlan) -> list[list[str]]:
    """Every command a restart runs, for plans and dry runs: the restart, then the readiness check."""
    unit = plan.unit or f"{plan.runtime}.service"
    return [["systemctl", "restart", unit], readiness_command(host, plan)]


def readiness_command(host: Host, plan: RuntimePlan) -> list[str]:
    if plan.runtime == "docker":
        fmt = "{{json .Runtimes}}\t{{.DefaultRuntime}}"
        return ["docker", "-H", f"unix://{plan.socket}", "info", "--format", fmt]
    if plan.runtime == "containerd":
        ctr = ["ctr"] if host.which("ctr") or plan.flavour == "containerd" else [plan.flavour, "ctr"]
        return [*ctr, "--address", plan.socket or SOCKET, "plugins", "ls"]
    return ["systemctl", "is-active", plan.unit or "crio.service"]


def disruption(host: Host, plan: RuntimePlan) -> str:
    """What a restart does to the containers running now, in the operator's terms."""
    unit = plan.unit or f"{plan.runtime}.service"
    if plan.runtime == "docker":
        if _docker_live_restore(host, plan):
            return (
                f"restarting {unit}: containers keep running (live-restore is on), but the docker API "
                "is down until dockerd is back"
            )
        return (
            f"restarting {unit} STOPS every running container on this node (live-restore is off in "
            "daemon.json); they start again only if their restart policy says so"
        )
    return (
        f"restarting {unit}: running containers keep running (their shims stay), but kubelet cannot start "
        f"or stop pods until {plan.runtime} is back"
    )


def _docker_live_restore(host: Host, plan: RuntimePlan) -> bool:
    from gpunode.runtimes.docker import parse_daemon_json

    for change in plan.changes:
        text = change.after if change.after is not None else change.before
        if text is not None:
            try:
                return parse_daemon_json(text, change.path).get("live-restore") is True
            except GpunodeError:
                return False
    return False


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
    result = host.run(readiness_command(host, plan), timeout=15)
    if not result.ok:
        return False, f"`docker info` failed: {(result.stderr or result.stdout).strip()}"
    runtimes_json, _, default = result.stdout.strip().partition("\t")
    try:
        runtimes = json.loads(runtimes_json)
    except (ValueError, RecursionError):
        return False, f"`docker info` printed something unexpected: {result.stdout.strip()[:200]}"
    return _expected(plan, set(runtimes), default.strip(), "dockerd")


def _check_containerd(host: Host, plan: RuntimePlan) -> tuple[bool, str]:
    listing = readiness_command(host, plan)
    result = host.run(listing, timeout=15)
    if not result.ok:
        why = (result.stderr or result.stdout).strip()
        return False, f"containerd does not answer on {plan.socket}: {why}"
    for line in result.stdout.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] == "io.containerd.grpc.v1" and words[1] == "cri":
            if words[-1] == "ok":
                return True, "containerd answers and its CRI plugin is ok"
            detail = host.run([*listing, "-d", "id==cri"], timeout=15)
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
