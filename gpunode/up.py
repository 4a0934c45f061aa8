"""`gpunode up`: a fresh GPU node made ready, in one idempotent command.

The steps, in order: preflight (doctor's driver, NVML and kubelet checks must pass: gpunode cannot fix
those), the toolkit (installed if missing), the container runtime kubelet uses (configured for the nvidia
runtime, as the default: pods asking for nvidia.com/gpu carry no runtime class), the device plugin service
(installed, started, registered), and the GPU labels (when the node has API credentials).

Each step is planned first from what is on the node now — "needed" with what it will do, or "done" —
so the whole plan can be printed (`--dry-run` stops there) and a configured node changes nothing. Each step
is planned again right before it runs (an earlier step may have changed what it sees) and stops `up` at
the first failure, with that step's fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpunode.errors import GpunodeError, NotFound
from gpunode.host import Host
from gpunode.nvml.model import Inventory

if TYPE_CHECKING:
    from gpunode.runtimes.plan import RuntimePlan
    from gpunode.systemd.service import ServicePlan, Waiting

# doctor findings that gpunode up cannot fix: it stops before changing anything
BLOCKING_PREFIXES = ("driver", "nvml", "kubelet")


@dataclass(frozen=True)
class UpOptions:
    toolkit_version: str | None = None
    repo_url: str | None = None
    key_file: str | None = None
    key_fingerprint: str | None = None
    runtime: str | None = None
    plugin_config: str | None = None
    labels: bool = True
    node: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    server: str | None = None
    # kubectl's --request-timeout in seconds: None not given (the client's defaults), 0 no timeout.
    request_timeout: float | None = None
    # CDI: CDI on in the runtime, gpunode's CDI spec written and kept true (gpunode.cdi.install).
    cdi: bool = False
    # A built-in simulated node (`up --simulate NAME --dry-run`) whose driver and GPUs stand in for NVML's.
    simulate: str | None = None
    # Where the package manager's output goes while the toolkit installs (the CLI shows it).
    on_output: Callable[[str], None] | None = field(default=None, compare=False)
    # The plugin step's wait for the service to register (up to 120 s): each poll, for the CLI's progress.
    on_wait: Callable[[Waiting], None] | None = field(default=None, compare=False)


@dataclass
class Step:
    name: str
    summary: str  # what it will do, or what is already so
    needed: bool
    details: list[str] = field(default_factory=list)  # the plan's files and commands, for --dry-run
    blocked: str | None = None  # why up cannot go on (preflight)
    fix: str | None = None
    apply: Callable[[], str] | None = None  # does the step; returns the line to print
    error: GpunodeError | None = None  # why it could not be planned
    skipped: bool = False  # not done and not to do: shown as skipped, never as done
    warnings: list[str] = field(default_factory=list)  # what the step disrupts, said before asking


def plan_up(host: Host, opts: UpOptions, discover: Callable[[Host], Inventory]) -> list[Step]:
    """Every step's plan. A step that cannot even be planned (no key, no runtime) is shown with its error,
    so that the whole plan is still printed; `up` then stops before changing anything."""
    steps = [planned("preflight", lambda: _preflight(host, discover, opts.simulate))]
    for name in ("toolkit", "runtime", *(("cdi",) if opts.cdi else ()), "plugin", "labels"):
        steps.append(planned(name, lambda name=name: replan(host, opts, discover, name)))  # type: ignore[misc]
    return steps


def planned(name: str, plan: Callable[[], Step]) -> Step:
    try:
        return plan()
    except GpunodeError as exc:
        return Step(
            name,
            f"cannot be planned: {exc.message}",
            needed=True,
            blocked=exc.message,
            fix=exc.fix,
            error=exc,
        )


def replan(host: Host, opts: UpOptions, discover: Callable[[Host], Inventory], name: str) -> Step:
    """One step planned again, just before it runs."""
    return {
        "toolkit": lambda: _toolkit(host, opts),
        "runtime": lambda: _runtime(host, opts),
        "cdi": lambda: _cdi(host, discover, opts.simulate),
        "plugin": lambda: _plugin(host, opts),
        "labels": lambda: _labels(host, opts, discover),
    }[name]()


# -- the steps --------------------------------------------------------------------------------------


def _preflight(host: Host, discover: Callable[[Host], Inventory], simulate: str | None = None) -> Step:
    from gpunode.doctor import run_doctor
    from gpunode.doctor.checks import kubelet_present
    from gpunode.doctor.model import Finding, Status

    report = run_doctor(host, discover, simulate=simulate)
    blocking = [f for f in report.findings if f.status is Status.FAIL and f.id.startswith(BLOCKING_PREFIXES)]
    if not kubelet_present(host):
        # The plugin registers with kubelet; without one, its service never becomes ready.
        blocking.append(
            Finding(
                "kubelet",
                Status.FAIL,
                "kubelet is not installed: this machine is not a Kubernetes node yet",
                fix="join it to the cluster first (kubeadm join, or a k3s / RKE2 agent), then run this",
            )
        )
    if blocking:
        first = blocking[0]
        return Step(
            "preflight",
            f"{len(blocking)} problem(s) gpunode up cannot fix: " + "; ".join(f.summary for f in blocking),
            needed=False,
            blocked=first.summary,
            fix=first.fix or "run `gpunode doctor` for the details",
        )
    gpus = [f for f in report.findings if f.id.startswith("gpu.") and f.status is not Status.SKIP]
    simulated = f", simulated: {simulate}" if simulate else ""
    return Step(
        "preflight",
        f"driver, NVML and kubelet are fine ({len(gpus)} GPU finding(s){simulated})",
        needed=False,
    )


def _toolkit(host: Host, opts: UpOptions) -> Step:
    from gpunode.toolkit import install as toolkit
    from gpunode.toolkit.managers import package_version

    current = toolkit.status(host)
    wanted = package_version(opts.toolkit_version) if opts.toolkit_version else None
    install_opts = toolkit.InstallOptions(
        version=opts.toolkit_version,
        # None: the repository the last install recorded (a mirror stays there), else NVIDIA's.
        repo_url=opts.repo_url,
        key_file=opts.key_file,
        key_fingerprint=opts.key_fingerprint,
    )
    satisfied = toolkit.satisfied(current.installed, wanted)
    if satisfied and not current.drift:
        return Step("toolkit", f"nvidia-container-toolkit {current.version} is installed", needed=False)
    # Offline: the plan only shows what is to be done (a dry run needs no network); the key is downloaded
    # and checked in apply(), which plans again.
    plan = toolkit.plan_install(host, install_opts, fetch_key=False)
    if plan.changes_nothing and plan.key_download is None:
        return Step("toolkit", f"nvidia-container-toolkit {current.version} is installed", needed=False)
    details = [plan.key_download_note] if plan.key_download_note else []
    details += [f"write {f.file.path}" for f in plan.files if f.changed]
    details += [f"run: {c}" for c in plan.commands]
    details += [f"repair: {d}" for d in plan.drift] + [f"warning: {w}" for w in plan.warnings]

    def apply() -> str:
        toolkit.require_root(host, "up")
        with host.lock(toolkit.LOCK):
            fresh = toolkit.plan_install(host, install_opts)
            progress = toolkit.Progress(line=opts.on_output) if opts.on_output else None
            outcome = toolkit.apply_install(host, fresh, progress)
        return f"nvidia-container-toolkit {toolkit.consistent_version(outcome.installed)} installed"

    summary = (
        "repair the repository files of nvidia-container-toolkit (they drifted)"
        if satisfied
        else f"install nvidia-container-toolkit {wanted or '(newest)'} with {plan.manager.name}"
    )
    return Step(
        "toolkit",
        summary,
        needed=True,
        details=details,
        apply=apply,
    )


def _runtime(host: Host, opts: UpOptions) -> Step:
    from gpunode.runtimes import configure
    from gpunode.runtimes.plan import ConfigureOptions

    runtime, _why = configure.choose_runtime(host, opts.runtime)
    configure_opts = ConfigureOptions(set_as_default=True, cdi=opts.cdi)
    plan = configure.plan_configure(host, runtime, configure_opts)
    return runtime_step(host, plan, lambda: configure.plan_configure(host, runtime, configure_opts))


def runtime_step(host: Host, plan: RuntimePlan, replan: Callable[[], RuntimePlan]) -> Step:
    """The runtime step of up (configure) or down (revert): the diffs, and the restart with every command
    it runs and what it does to running containers."""
    from gpunode.runtimes import configure, records, service

    runtime = plan.runtime
    restart = host.is_real_root and plan.standard_location
    restarts = configure.will_restart(host, plan, restart)
    # A revert's notes say what is kept and why, and why no restart is planned: down reports them.
    notes = [f"note: {m}" for m in plan.messages] if plan.revert else []
    if not plan.pending and not restarts and not plan.kept:
        done = "has none of gpunode's changes" if plan.revert else "is configured for the nvidia runtime"
        return Step("runtime", f"{runtime} {done}", needed=False, details=notes)
    details = [c.diff() for c in plan.pending] + notes
    if restarts:
        details += [f"run: {' '.join(argv)}" for argv in service.restart_commands(host, plan)]
        details.append(f"warning: {service.disruption(host, plan)}")
    warnings = [service.disruption(host, plan)] if restarts else []

    def apply() -> str:
        with host.lock(records.LOCK):
            fresh = replan()
            outcome = configure.apply(host, fresh, restart=restart)
        restarted = f"; restarted {fresh.unit}" if outcome.restarted else ""
        verb = "restored" if fresh.revert else "wrote"
        files = ", ".join([*outcome.written, *outcome.removed]) or "no file"
        kept = f"; kept {', '.join(fresh.kept)} (not what gpunode wrote)" if fresh.kept else ""
        return f"{runtime}: {verb} {files}{kept}{restarted}"

    what = "revert gpunode's changes to" if plan.revert else "configure"
    goal = "" if plan.revert else " for the nvidia runtime, as the default"
    files = ", ".join(c.path for c in plan.pending) or "restart only"
    return Step(
        "runtime",
        f"{what} {runtime}{goal} ({files})" + (f", then restart {plan.unit}" if restarts else ""),
        needed=True,
        details=details,
        apply=apply,
        warnings=warnings,
    )


def _cdi(host: Host, discover: Callable[[Host], Inventory], simulate: str | None = None) -> Step:
    """gpunode's CDI spec written, and the units that keep it true installed (`gpunode cdi install`)."""
    from gpunode.cdi.generate import GenerateOptions, check_writable, generate, write_spec
    from gpunode.cdi.install import apply_install, plan_install
    from gpunode.systemd.service import gpunode_executable

    # Simulated (a dry run only): the spec of the files a real node of that shape has, none looked for here.
    options = GenerateOptions(simulate=simulate)
    generated = generate(host, discover(host), options)
    # Another tool's file at gpunode's path is refused here, so the plan (and --dry-run) shows it before
    # any step has changed the node, not half-way at apply.
    check_writable(host, generated)
    spec_needed = host.read_bytes(generated.path) != generated.text.encode()
    install = plan_install(host, options, gpunode_executable(), restrict_envvar=True)
    if not spec_needed and not install.changed:
        return Step("cdi", f"the CDI spec {generated.path} is current, and kept so", needed=False)
    details = ([f"write {generated.path} ({len(generated.device_names)} devices)"] if spec_needed else []) + [
        f"write {f.path}" for f in install.files if f.changed
    ]
    details += [f"run: {' '.join(c)}" for c in install.commands] + [f"note: {n}" for n in install.notes]

    def apply() -> str:
        fresh = generate(host, discover(host), options)
        write_spec(host, fresh)
        apply_install(host, plan_install(host, options, gpunode_executable(), restrict_envvar=True))
        return (
            f"{fresh.path}: {len(fresh.device_names)} CDI devices, regenerated at boot and on driver changes"
        )

    return Step(
        "cdi",
        f"write the CDI spec {generated.path} and install gpunode-cdi.service / .path to keep it true",
        needed=True,
        details=details,
        apply=apply,
    )


def _plugin(host: Host, opts: UpOptions) -> Step:
    from gpunode.systemd import service

    plan = service.plan_install(
        host, config_file=opts.plugin_config, start=True, executable=service.gpunode_executable()
    )
    if host.offline:
        return _plugin_offline(host, opts, plan)
    state = service.service_state(host)
    if plan.changes_nothing and state.active == "active":
        return Step("plugin", f"{service.UNIT} is installed and running", needed=False)
    details = [f"write {f.path}" for f in plan.files if f.changed] + [
        f"run: {' '.join(c)}" for c in plan.commands
    ]

    def apply() -> str:
        service.require_root(host, "up")
        fresh = service.plan_install(
            host, config_file=opts.plugin_config, start=True, executable=service.gpunode_executable()
        )
        result = service.apply_install(host, fresh, progress=opts.on_wait)
        waited = f" (after {result.waited_s:.0f} s)" if result.waited_s is not None else ""
        status = result.properties.get("StatusText") or "registered"
        return f"{service.UNIT} is {result.active}: {status}{waited}"

    return Step(
        "plugin",
        f"install and start {service.UNIT}, wait until it has registered with kubelet",
        needed=True,
        details=details,
        apply=apply,
    )


def _plugin_offline(host: Host, opts: UpOptions, plan: ServicePlan) -> Step:
    """Under --root: the unit written into the root and enabled by its links; this machine's systemd
    knows nothing of the root's units, so the service's state is not asked and nothing is started here
    (starting it is a step for the system in the root, printed)."""
    from gpunode.systemd import service

    unit = f"{service.UNIT} in {host.root}"
    if plan.changes_nothing:
        return Step("plugin", f"{unit} is installed and enabled (its state not asked: --root)", needed=False)
    details = [f"write {f.path}" for f in plan.files if f.changed]
    details += [f"link {link.path} -> {link.target}" for link in plan.links if link.changed]
    details += [f"on the system in {host.root}, run: {' '.join(c)}" for c in plan.next_steps]

    def apply() -> str:
        service.require_root(host, "up")
        fresh = service.plan_install(
            host, config_file=opts.plugin_config, start=True, executable=service.gpunode_executable()
        )
        service.apply_install(host, fresh)
        then = " && ".join(" ".join(c) for c in fresh.next_steps)
        left = f"; on the system in {host.root}, run: {then}" if then else ""
        return f"{unit} installed and enabled{left}"

    return Step(
        "plugin",
        f"install and enable {unit} (nothing is started on this machine: --root)",
        needed=True,
        details=details,
        apply=apply,
    )


def _labels(host: Host, opts: UpOptions, discover: Callable[[Host], Inventory]) -> Step:
    if not opts.labels:
        return Step("labels", "GPU labels not wanted (--no-labels)", needed=False, skipped=True)
    from gpunode.advertise import AdvertiseOptions, advertise
    from gpunode.kube.client import KubeClient, Timeouts

    try:
        client = KubeClient.from_host(
            host,
            kubeconfig=opts.kubeconfig,
            context=opts.context,
            server=opts.server,
            timeouts=Timeouts.for_request_timeout(opts.request_timeout),
        )
    except NotFound as exc:
        return Step(
            "labels", "no Kubernetes API credentials on this node", needed=False, fix=exc.fix, skipped=True
        )
    adv_opts = AdvertiseOptions(node=opts.node, capacity=False)  # capacity is the device plugin's
    inventory = discover(host)
    with client:
        change = advertise(host, client, adv_opts, inventory, dry_run=True)
    if change.changes_nothing:
        return Step("labels", f"node {change.node} has its GPU labels", needed=False)
    details = [f"label {k}={v}" for k, v in sorted(change.labels_set.items())] + [
        f"remove label {k}" for k in change.labels_removed
    ]

    def apply() -> str:
        with KubeClient.from_host(
            host,
            kubeconfig=opts.kubeconfig,
            context=opts.context,
            server=opts.server,
            timeouts=Timeouts.for_request_timeout(opts.request_timeout),
        ) as fresh_client:
            done = advertise(host, fresh_client, adv_opts, inventory)
        return f"node {done.node}: {len(done.labels_set)} label(s) set, {len(done.labels_removed)} removed"

    return Step(
        "labels",
        f"label node {change.node} ({len(change.labels_set)} to set, {len(change.labels_removed)} to remove)",
        needed=True,
        details=details,
        apply=apply,
    )


def run_steps(steps: list[Step], on_step: Callable[[int, int, Step], None]) -> list[tuple[Step, str]]:
    """Apply the needed steps in order; the first failure stops the rest (its error says which step)."""
    needed = [s for s in steps if s.needed and s.apply is not None]
    results: list[tuple[Step, str]] = []
    for n, step in enumerate(needed, 1):
        on_step(n, len(needed), step)
        assert step.apply is not None  # noqa: S101 (filtered above)
        try:
            results.append((step, step.apply()))
        except GpunodeError as exc:
            exc.changed = exc.changed or bool(results)  # the steps before it stay done
            exc.message = f"step {step.name} failed: {exc.message}"
            if n < len(needed):
                exc.message += f"\nnot done: {', '.join(s.name for s in needed[n:])}"
            raise
    return results
