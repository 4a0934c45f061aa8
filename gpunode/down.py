"""`gpunode down`: undo `gpunode up`, in reverse order, plan first.

The steps, in order: the device plugin service (stopped, disabled and its files removed, so that it stops
advertising GPUs), the node (the capacity and labels gpunode advertised withdrawn, when the node has API
credentials), the CDI spec and its units (`gpunode cdi uninstall`), the container runtime (every file
gpunode changed for it put back, then restarted), and — only when asked, since other software may use it —
the toolkit (packages and repository files removed).

Each step undoes only what gpunode recorded doing, so running `down` on a node `up` never touched, or twice,
changes nothing. The steps and their rendering are shared with `up` (gpunode.up.Step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpunode.errors import NotFound
from gpunode.host import Host
from gpunode.up import Step, runtime_step

if TYPE_CHECKING:
    from gpunode.systemd.service import ServicePlan


@dataclass(frozen=True)
class DownOptions:
    toolkit: bool = False  # also remove nvidia-container-toolkit and its repository files
    node: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    server: str | None = None
    # kubectl's --request-timeout in seconds: None not given (the client's defaults), 0 no timeout.
    request_timeout: float | None = None
    on_output: Callable[[str], None] | None = field(default=None, compare=False)


def plan_down(host: Host, opts: DownOptions) -> list[Step]:
    from gpunode.up import planned

    steps = [planned("plugin", lambda: _plugin(host))]
    steps.append(planned("node", lambda: _node(host, opts)))
    steps.append(planned("cdi", lambda: _cdi(host)))
    steps.extend(_runtimes(host))
    steps.append(planned("toolkit", lambda: _toolkit(host, opts)))
    return steps


def _plugin(host: Host) -> Step:
    from gpunode.systemd import service

    plan = service.plan_uninstall(host)
    details = [f"run: {' '.join(c)}" for c in plan.commands] + [f"remove {p}" for p in plan.remove]
    details += [f"keep {p} (changed since gpunode wrote it)" for p in plan.kept]
    details += [f"unlink {link.path}" for link in plan.links if link.changed]
    details += [f"on the system in {host.root}, run: {' '.join(c)}" for c in plan.next_steps]
    details += [f"note: {n}" for n in plan.notes]
    if plan.changes_nothing:
        return Step(
            "plugin",
            f"{service.UNIT} is not installed by gpunode" + (" (nothing of it is undone)" if details else ""),
            needed=False,
            skipped=True,
            details=details,
        )

    def apply() -> str:
        service.require_root(host, "down")
        fresh = service.plan_uninstall(host)
        service.apply_uninstall(host, fresh)
        return _plugin_done(fresh)

    verbs = (["stop", "disable"] if _disables(plan) else []) + (["remove"] if plan.remove else [])
    said = f"{', '.join(verbs[:-1])} and {verbs[-1]}" if len(verbs) > 1 else "".join(verbs)
    summary = f"{said or 'undo what gpunode did to'} {service.UNIT}"
    if plan.kept:
        summary += f"; keep {', '.join(plan.kept)} (changed since gpunode wrote it)"
    return Step(
        "plugin",
        summary,
        needed=True,
        details=details,
        apply=apply,
        warnings=["pods already running on the node's GPUs keep running; new ones are not scheduled here"],
    )


def _disables(plan: ServicePlan) -> bool:
    from gpunode.systemd.service import UNIT

    return ("systemctl", "disable", "--now", UNIT) in plan.commands


def _plugin_done(plan: ServicePlan) -> str:
    """What the plugin step did, as it was done: a file kept is never reported removed."""
    from gpunode.systemd.service import UNIT

    done = []
    if _disables(plan):
        done.append("stopped and disabled")
    if plan.remove:
        done.append("removed " + ", ".join(plan.remove))
    if plan.kept:
        done.append("kept " + ", ".join(plan.kept) + " (changed since gpunode wrote it)")
    return f"{UNIT}: " + ("; ".join(done) or "nothing left to undo")


def _node(host: Host, opts: DownOptions) -> Step:
    from gpunode.advertise import withdraw
    from gpunode.kube.client import KubeClient, Timeouts

    def client() -> KubeClient:
        return KubeClient.from_host(
            host,
            kubeconfig=opts.kubeconfig,
            context=opts.context,
            server=opts.server,
            timeouts=Timeouts.for_request_timeout(opts.request_timeout),
        )

    try:
        first = client()
    except NotFound as exc:
        return Step(
            "node", "no Kubernetes API credentials on this node", needed=False, fix=exc.fix, skipped=True
        )
    with first:
        change = withdraw(host, first, node=opts.node, resource=None, dry_run=True)
    if change.changes_nothing:
        return Step("node", f"node {change.node} has nothing gpunode advertised", needed=False)
    details = [
        f"remove {op['path']}"
        for op in change.capacity_ops
        if op["op"] == "remove" and not op["path"].startswith("/status/conditions/")
    ]
    details += ["remove condition GPUHealthy"] if change.condition_removed else []
    details += [f"remove label {k}" for k in change.labels_removed]

    def apply() -> str:
        with client() as fresh:
            done = withdraw(host, fresh, node=opts.node, resource=None)
        labels = len(done.labels_removed)
        return f"node {done.node}: withdrew {done.resource or 'no resource'}, {labels} label(s)"

    return Step(
        "node",
        f"withdraw what gpunode advertised on node {change.node} (capacity of {change.resource or 'none'}, "
        f"{len(change.labels_removed)} label(s))",
        needed=True,
        details=details,
        apply=apply,
    )


def _cdi(host: Host) -> Step:
    """`gpunode cdi uninstall`: the units that keep the spec true, gpunode's spec, and the toolkit's
    NVIDIA_VISIBLE_DEVICES setting (what `up --cdi` / `cdi install` did)."""
    from gpunode.cdi.generate import GenerateOptions
    from gpunode.cdi.install import apply_uninstall, plan_uninstall

    plan = plan_uninstall(host, GenerateOptions())
    if plan.changes_nothing:
        return Step("cdi", "gpunode has set up no CDI spec here", needed=False, skipped=True)
    details = [f"run: {' '.join(c)}" for c in plan.commands] + [f"remove {p}" for p in plan.remove]
    details += [f"put back {p}" for p, _ in plan.restore] + [f"note: {n}" for n in plan.notes]

    def apply() -> str:
        fresh = plan_uninstall(host, GenerateOptions())
        apply_uninstall(host, fresh)
        return f"removed {len(fresh.remove)} file(s), put back {len(fresh.restore)}"

    return Step(
        "cdi",
        "remove gpunode's CDI spec and the units that keep it current",
        needed=True,
        details=details,
        apply=apply,
        warnings=["pods created from now on get no GPU through CDI names"],
    )


def _runtimes(host: Host) -> list[Step]:
    from gpunode.runtimes import configure, records
    from gpunode.runtimes.plan import RUNTIMES, ConfigureOptions, RuntimePlan
    from gpunode.up import planned

    known = records.load(host)
    changed = [r for r in RUNTIMES if known.for_runtime(r) or r in known.restart_pending]
    if not changed:
        return [Step("runtime", "gpunode has not changed any runtime's configuration", needed=False)]

    def step(runtime: str) -> Step:
        def replan() -> RuntimePlan:
            return configure.plan_revert(host, runtime, ConfigureOptions())

        return runtime_step(host, replan(), replan)

    return [planned("runtime", lambda runtime=runtime: step(runtime)) for runtime in changed]  # type: ignore[misc]


def _toolkit(host: Host, opts: DownOptions) -> Step:
    if not opts.toolkit:
        return Step("toolkit", "left installed (add --toolkit to remove it)", needed=False, skipped=True)
    from gpunode.toolkit import install as toolkit

    plan = toolkit.plan_uninstall(host)
    if plan.changes_nothing:
        return Step("toolkit", "nvidia-container-toolkit is not installed", needed=False)
    details = [f"run: {c}" for c in plan.commands] + [f"remove {p}" for p in plan.remove]
    details += [f"restore {p}" for p, _ in plan.restore] + [f"note: {n}" for n in plan.notes]

    def apply() -> str:
        toolkit.require_root(host, "down")
        with host.lock(toolkit.LOCK):
            fresh = toolkit.plan_uninstall(host)
            progress = toolkit.Progress(line=opts.on_output) if opts.on_output else None
            toolkit.apply_uninstall(host, fresh, progress)
        return "nvidia-container-toolkit removed"

    return Step(
        "toolkit",
        f"remove nvidia-container-toolkit and its repository files ({plan.manager.name})",
        needed=True,
        details=details,
        apply=apply,
    )
