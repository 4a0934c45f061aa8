"""`gpunode dra classes`: wiring and rendering; the objects are in gpunode.dra.classes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from gpunode.cli.common import Group, checked, complete_simulate, exit_codes
from gpunode.cli.node import kube_options
from gpunode.cli.plugin_manifest import _image, _namespace

if TYPE_CHECKING:
    from gpunode.dra.classes import ClassChange


@click.group(
    "dra",
    cls=Group,
    help="Dynamic Resource Allocation (resource.k8s.io/v1): the kubelet plugin that serves this node's GPUs "
    "and the DeviceClasses that select them.",
    epilog=exit_codes("0    done; each command's --help lists what else it exits with"),
)
def app() -> None:
    pass


def _driver(name: str) -> None:
    from gpunode.dra.classes import check_driver

    check_driver(name)


def _complete_driver(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    return [name for name in ("gpu.nvidia.com",) if name.startswith(incomplete)]


@app.command(
    "classes",
    epilog=exit_codes(
        "0    printed; with --apply, applied (or already as wanted)",
        "9    the Kubernetes API refused the request or could not be reached",
    ),
)
@click.option(
    "--driver",
    default="gpu.nvidia.com",
    show_default=True,
    metavar="NAME",
    callback=checked(_driver),
    shell_complete=_complete_driver,
    help="The DRA driver whose devices the classes select; the classes are named after it "
    "(gpu.nvidia.com: NVIDIA's gpu.nvidia.com and mig.nvidia.com).",
)
@click.option(
    "--no-extended-resource",
    is_flag=True,
    help="Leave out the gpu class's extendedResourceName: nvidia.com/gpu (pods asking for nvidia.com/gpu are "
    "then not served through this class).",
)
@click.option(
    "--apply",
    "apply_",
    is_flag=True,
    help="Create or update the classes through the Kubernetes API (credentials that may write "
    "deviceclasses: a node's own may not).",
)
@click.option(
    "--dry-run", is_flag=True, help="With --apply: read the classes there and say what would change."
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.dra-classes/v1)."
)
@kube_options
@click.pass_context
def classes(
    ctx: click.Context,
    driver: str,
    no_extended_resource: bool,
    apply_: bool,
    dry_run: bool,
    as_json: bool,
    kubeconfig: str | None,
    context: str | None,
    server: str | None,
    request_timeout: float | None,
) -> None:
    """Print the DeviceClasses for this driver as YAML (for `kubectl apply -f -`), or apply them:
    gpu.nvidia.com (full GPUs, serving pods that ask for nvidia.com/gpu) and mig.nvidia.com (MIG devices),
    selecting devices as NVIDIA's DRA driver's chart does."""
    from gpunode.dra import classes as dc
    from gpunode.errors import UsageError

    if as_json:
        from gpunode import jsonout

        jsonout.request("dra-classes", dry_run=dry_run, driver=driver, classes=[], applied=[])
    if not apply_:
        given = [
            flag
            for flag, value in (
                ("--dry-run", dry_run),
                ("--kubeconfig", kubeconfig),
                ("--context", context),
                ("--server", server),
                ("--request-timeout", request_timeout),
            )
            if value not in (None, False)
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --apply: without it the "
                "classes are only printed",
                "add --apply (with --dry-run to see what would change first)",
            )
    objects = dc.device_classes(driver, extended_resource=not no_extended_resource)
    changes: list[ClassChange] = []
    if apply_:
        from gpunode.cli.state import state
        from gpunode.kube.client import KubeClient, Timeouts

        client = KubeClient.from_host(
            state(ctx).host,
            kubeconfig=kubeconfig,
            context=context,
            server=server,
            timeouts=Timeouts.for_request_timeout(request_timeout),
        )
        with client:
            changes = dc.apply(client, objects, dry_run=dry_run)
    if as_json:
        from gpunode import jsonout

        doc = jsonout.document(
            "dra-classes",
            changed=any(change.written for change in changes),
            dry_run=dry_run,
            driver=driver,
            classes=objects,
            applied=[change.as_json() for change in changes],
        )
        jsonout.emit(doc)
        return
    if not apply_:
        click.echo(dc.to_yaml(objects), nl=False)
        return
    _render(changes, dry_run=dry_run)


def _render(changes: list[ClassChange], *, dry_run: bool) -> None:
    done = {"create": "created", "update": "updated", "unchanged": "unchanged"}
    for change in changes:
        if change.action == "unchanged":
            click.echo(f"deviceclass {change.name}: already as wanted, nothing to change")
            continue
        click.echo(
            f"deviceclass {change.name}: {'would ' + change.action if dry_run else done[change.action]}"
        )
        if change.diff:
            click.echo(change.diff, nl=not change.diff.endswith("\n"))
    if dry_run:
        click.echo("dry run: nothing was changed")


def _simulate(name: str | None) -> None:
    if name:
        from gpunode.plugin.simulate import check_profile

        check_profile(name)


def _node_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """--node-name, NODE_NAME (a DaemonSet's downward API), else the host name as kubelet takes it."""
    import socket

    from gpunode.dra.slices import SliceSettings
    from gpunode.errors import ConfigError

    name = (value or socket.gethostname()).strip().lower()
    try:
        SliceSettings(node_name=name)  # checked as the slices check it, before anything is served
    except ConfigError as exc:
        raise click.BadParameter(f"{exc.message}; {exc.fix}" if exc.fix else exc.message) from None
    return name


@app.command(
    "run",
    epilog=exit_codes(
        "0    stopped by SIGTERM or SIGINT",
        "3    another live driver of this name is registered on the node",
        "6    no Kubernetes credentials were found",
        "7    NVML cannot be used",
    ),
)
@click.option(
    "--driver",
    default="gpu.nvidia.com",
    show_default=True,
    envvar="GPUNODE_DRA_DRIVER",
    metavar="NAME",
    callback=checked(_driver),
    shell_complete=_complete_driver,
    help="The DRA driver name (ResourceSlices' spec.driver, the sockets' names). Env GPUNODE_DRA_DRIVER.",
)
@click.option(
    "--node-name",
    envvar="NODE_NAME",
    metavar="NAME",
    callback=_node_name,
    help="This node's name in Kubernetes: the pool and the slices' nodeName. Env NODE_NAME; default the "
    "host name.",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="The node's credentials. Default: KUBECONFIG, else kubelet's /etc/kubernetes/kubelet.conf.",
)
@click.option(
    "--plugins-dir",
    default="/var/lib/kubelet/plugins",
    show_default=True,
    envvar="GPUNODE_DRA_PLUGINS_DIR",
    type=click.Path(file_okay=False),
    help="Where <driver>/dra.sock and the checkpoint go. Env GPUNODE_DRA_PLUGINS_DIR.",
)
@click.option(
    "--registry-dir",
    default="/var/lib/kubelet/plugins_registry",
    show_default=True,
    envvar="GPUNODE_DRA_REGISTRY_DIR",
    type=click.Path(file_okay=False),
    help="kubelet's plugin registration directory (<driver>-reg.sock). Env GPUNODE_DRA_REGISTRY_DIR.",
)
@click.option(
    "--cdi-dir",
    default="/var/run/cdi",
    show_default=True,
    envvar="GPUNODE_DRA_CDI_DIR",
    type=click.Path(file_okay=False),
    help="Where each prepared claim's CDI spec is written. Env GPUNODE_DRA_CDI_DIR.",
)
@click.option(
    "--driver-root",
    default="/",
    show_default=True,
    envvar="GPUNODE_DRA_DRIVER_ROOT",
    type=click.Path(file_okay=False),
    help="Where the NVIDIA driver's files are (/run/nvidia/driver for a containerised driver). "
    "Env GPUNODE_DRA_DRIVER_ROOT.",
)
@click.option(
    "--dev-root",
    envvar="GPUNODE_DRA_DEV_ROOT",
    type=click.Path(file_okay=False),
    help="Where the driver's /dev is. Default: the driver root. Env GPUNODE_DRA_DEV_ROOT.",
)
@click.option(
    "--lost-gpu-effect",
    type=click.Choice(["NoSchedule", "NoExecute"]),
    default="NoSchedule",
    show_default=True,
    envvar="GPUNODE_DRA_LOST_GPU_EFFECT",
    help="The taint effect of a GPU fallen off the bus (NoExecute evicts its pods). "
    "Env GPUNODE_DRA_LOST_GPU_EFFECT.",
)
@click.option(
    "--recovery-quiet-period",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    envvar="GPUNODE_DRA_RECOVERY_QUIET_PERIOD",
    metavar="SECONDS",
    help="How long NVML must report an unhealthy GPU fine before it is healthy again (its taint removed); "
    "0: never on its own. Env GPUNODE_DRA_RECOVERY_QUIET_PERIOD.",
)
@click.option(
    "--status-file",
    default="/run/gpunode/dra.json",
    show_default=True,
    envvar="GPUNODE_DRA_STATUS_FILE",
    type=click.Path(dir_okay=False),
    help="Where the running driver writes its status (removed at exit). Env GPUNODE_DRA_STATUS_FILE.",
)
@click.option(
    "--simulate",
    metavar="NODE",
    envvar="GPUNODE_DRA_SIMULATE",
    callback=checked(_simulate),
    shell_complete=complete_simulate,
    help="Serve a built-in simulated node instead of NVML's GPUs (no health is watched).",
)
@click.pass_context
def run(
    ctx: click.Context,
    driver: str,
    node_name: str,
    kubeconfig: str | None,
    plugins_dir: str,
    registry_dir: str,
    cdi_dir: str,
    driver_root: str,
    dev_root: str | None,
    lost_gpu_effect: str,
    recovery_quiet_period: float,
    status_file: str,
    simulate: str | None,
) -> None:
    """Run the DRA kubelet plugin in the foreground: serve NodePrepareResources and the health stream,
    register with kubelet, and publish this node's GPUs as ResourceSlices. SIGTERM/SIGINT stop it,
    SIGHUP re-reads the GPUs."""
    from gpunode.cli.state import state
    from gpunode.dra.driver import DriverSettings, run_driver

    settings = DriverSettings(
        driver=driver,
        node_name=node_name,
        plugins_dir=plugins_dir,
        registry_dir=registry_dir,
        kubeconfig=kubeconfig,
        driver_root=driver_root.rstrip("/") or "/",
        dev_root=(dev_root.rstrip("/") or "/") if dev_root else None,
        cdi_dir=cdi_dir,
        simulate=simulate,
        lost_effect="NoExecute" if lost_gpu_effect == "NoExecute" else "NoSchedule",
        status_file=status_file or None,
        recovery_quiet_period=recovery_quiet_period,
    )
    run_driver(state(ctx).host, settings, debug=state(ctx).debug)


# `dra install|uninstall|status`: the systemd form, on the plugin's machinery (gpunode/systemd/service.py,
# spec service.DRA) and the plugin commands' rendering, so both services keep the same guarantees.


@app.command(
    "install",
    epilog=exit_codes(
        "0    installed and registered with kubelet (or already so)",
        "3    gpunode's device-plugin service is installed and enabled (one side per node)",
        "5    not root (without --dry-run)",
        "6    under --root: the gpunode program the unit names is not in the root",
        "8    the driver did not become ready within 120 s",
    ),
)
@click.option("--dry-run", is_flag=True, help="Print the unit and the commands; change nothing.")
@click.option("--no-start", is_flag=True, help="Install and enable, but do not start it now.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.dra-install/v1)."
)
@click.pass_context
def install(ctx: click.Context, dry_run: bool, no_start: bool, as_json: bool) -> None:
    """Install the DRA driver as the systemd service gpunode-dra-driver, start it, wait until registered.
    Its settings come from /etc/default/gpunode-dra-driver (the variables of `dra run`)."""
    from gpunode import jsonout
    from gpunode.cli.plugin import _plan_json, _print_links, _print_plan
    from gpunode.cli.state import state
    from gpunode.systemd import service

    spec = service.DRA
    if as_json:
        jsonout.request("dra-install", dry_run=dry_run)
    host = state(ctx).host
    if not dry_run:
        service.require_root(host, "dra install")
    plan = service.plan_install(
        host, config_file=None, start=not no_start, executable=service.gpunode_executable(), spec=spec
    )
    if dry_run:
        if as_json:
            jsonout.emit(jsonout.document("dra-install", changed=False, dry_run=True, **_plan_json(plan)))
        else:
            _print_plan(plan, host)
        return
    # Under --root this machine's systemd knows nothing of the root's units: it is not asked.
    if plan.changes_nothing and (
        no_start or host.offline or service.service_state(host, spec=spec).active == "active"
    ):
        current = None if host.offline else service.service_state(host, spec=spec)
        state_field: dict[str, Any] = {} if current is None else {"state": _dra_state_json(current)}
        if as_json:
            jsonout.emit(jsonout.document("dra-install", changed=False, **_plan_json(plan), **state_field))
            return
        click.echo(f"{spec.unit} is installed and up to date; nothing to do")
        if current is not None:
            _print_dra_state(current)
        return
    if not as_json:
        for note in plan.notes:
            click.echo(f"note: {note}")
    from gpunode.cli.waitline import WaitLine

    # The wait for the driver to register can last 120 s: its progress goes to stderr, never to stdout.
    with WaitLine() as waiting:
        try:
            result = service.apply_install(host, plan, progress=waiting)
        finally:
            if as_json:
                jsonout.update(**waiting.json())  # an error document (Ctrl-C, a timeout) carries it too
    if as_json:
        state_field = {} if host.offline else {"state": _dra_state_json(result)}
        doc = jsonout.document("dra-install", changed=True, **_plan_json(plan), **state_field)
        jsonout.emit({**doc, **waiting.json()})
        return
    for f in plan.files:
        click.echo(f"{'wrote' if f.changed else 'unchanged'} {f.path}")
    _print_links(plan, host, done=True)
    for argv in plan.commands:
        click.echo(f"ran {' '.join(argv)}")
    if waiting.last is not None:
        click.echo(f"waited {waiting.last.elapsed:.0f} s for {waiting.last.what}")
    if not host.offline:
        _print_dra_state(result)


@app.command(
    "uninstall",
    epilog=exit_codes("0    removed (or was not installed)", "5    not root (without --dry-run)"),
)
@click.option("--dry-run", is_flag=True, help="Print what would be stopped and removed.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.dra-uninstall/v1)."
)
@click.pass_context
def uninstall(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Stop and disable the service and remove the files `dra install` wrote (nothing else: a file
    changed since is left in place)."""
    from gpunode import jsonout
    from gpunode.cli.plugin import _plan_json, _print_links, _print_plan
    from gpunode.cli.state import state
    from gpunode.systemd import service

    if as_json:
        jsonout.request("dra-uninstall", dry_run=dry_run)
    host = state(ctx).host
    if not dry_run:
        service.require_root(host, "dra uninstall")
    plan = service.plan_uninstall(host, service.DRA)
    if dry_run:
        if as_json:
            jsonout.emit(jsonout.document("dra-uninstall", changed=False, dry_run=True, **_plan_json(plan)))
        else:
            _print_plan(plan, host)
        return
    if not plan.changes_nothing:
        service.apply_uninstall(host, plan)
    if as_json:
        jsonout.emit(jsonout.document("dra-uninstall", changed=not plan.changes_nothing, **_plan_json(plan)))
        return
    if plan.changes_nothing:
        click.echo(f"{service.DRA.unit} is not installed; nothing to do")
    else:
        for argv in plan.commands:
            click.echo(f"ran {' '.join(argv)}")
        for path in plan.remove:
            click.echo(f"removed {path}")
        _print_links(plan, host, done=True)
    for note in plan.notes:
        click.echo(f"note: {note}")


def _absolute(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # `dra run` writes where it was told; a relative path names no file a driver writes.
    if value is not None and not value.startswith("/"):
        raise click.BadParameter(
            f"{value!r} is not an absolute path; give the path the driver was started with "
            "(`dra run --status-file`)"
        )
    return value


@app.command(
    "status",
    epilog=exit_codes(
        "0    the driver is running and serving (and the service active, where systemd runs it)",
        "1    it is not, or no status file was found (the output says where it looked)",
    ),
)
@click.option(
    "--status-file",
    metavar="PATH",
    callback=_absolute,
    help="Read this status file (a driver started by hand: `dra run --status-file`, env "
    "GPUNODE_DRA_STATUS_FILE). Default: where the systemd unit tells the service to write it, else "
    "/run/gpunode/dra.json.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.dra-status/v1)."
)
@click.pass_context
def status(ctx: click.Context, status_file: str | None, as_json: bool) -> None:
    """The DRA driver's state: its sockets, its devices' health, the slices' generation and last API
    error, and the service's state where systemd runs it."""
    from gpunode import jsonout
    from gpunode.cli.state import state
    from gpunode.errors import ExitCode
    from gpunode.systemd import service

    if as_json:
        jsonout.request("dra-status")
    host = state(ctx).host
    current = service.service_state(host, status_file=status_file, env=host.env, spec=service.DRA)
    ok = _dra_ok(current)
    if as_json:
        jsonout.emit(jsonout.document("dra-status", changed=False, ready=ok, **_dra_state_json(current)))
    else:
        _print_dra_state(current)
    if not ok:
        raise click.exceptions.Exit(int(ExitCode.UNHEALTHY))


def _dra_ok(current: Any) -> bool:
    """Serving, its process alive and, when the file is the service's, the unit active (a file left by a
    driver that was killed would still say serving)."""
    lookup = current.lookup
    document = lookup.document
    if not document or document.get("state") != "serving" or lookup.pid_running is False:
        return False
    explicit = lookup.found is not None and lookup.found.source.startswith(("flag ", "env "))
    if explicit or not current.installed:
        return True
    return bool(current.active == "active")


def _dra_state_json(current: Any) -> dict[str, Any]:
    from gpunode.cli.plugin import _state_json
    from gpunode.systemd.service import DRA

    doc = _state_json(current, DRA.unit)
    doc["driver"] = doc.pop("plugin")
    return doc


def _print_dra_state(current: Any) -> None:
    from gpunode.systemd.service import DRA

    props = current.properties
    if current.installed:
        click.echo(
            f"service: {props.get('ActiveState', 'unknown')} ({props.get('SubState', '?')}), "
            f"{props.get('UnitFileState', 'unknown')}, restarts {props.get('NRestarts', '?')}"
        )
    else:
        click.echo(f"service: {DRA.unit} is not installed (or systemd does not answer)")
    lookup = current.lookup
    if lookup.found is None:
        click.echo("driver: no status (not running); looked for its status file at:")
        for place in lookup.looked:
            click.echo(f"  {place.path} ({place.source})")
        click.echo("  (a driver run by hand or in a container: --status-file PATH, as it was given)")
        return
    click.echo(f"status file: {lookup.found.path} ({lookup.found.source})")
    if lookup.problem:
        click.echo(f"driver: unreadable status: {lookup.problem}")
        return
    doc = lookup.document or {}
    stale = " (not running: the file is stale)" if lookup.pid_running is False else ""
    click.echo(
        f"driver: {doc.get('driver')} on node {doc.get('node')}, pid {doc.get('pid')}{stale}, "
        f"{doc.get('state')}"
    )
    click.echo(f"  sockets: {doc.get('dra_socket')}, {doc.get('registration_socket')}")
    devices: dict[str, Any] = doc["devices"] if isinstance(doc.get("devices"), dict) else {}
    healthy = len([d for d in devices.values() if isinstance(d, dict) and d.get("healthy")])
    click.echo(f"  devices: {healthy}/{len(devices)} healthy")
    for name, device in sorted(devices.items()):
        if isinstance(device, dict) and not device.get("healthy"):
            click.echo(f"    {name} ({device.get('uuid')}): {device.get('reason')}")
    slices: dict[str, Any] = doc["slices"] if isinstance(doc.get("slices"), dict) else {}
    error = slices.get("error")
    click.echo(
        f"  slices: generation {slices.get('generation')}" + (f"; last API error: {error}" if error else "")
    )


def _driver_root(path: str) -> None:
    from gpunode.dra.manifest import driver_root_path

    driver_root_path(path)


@app.command(
    "manifest",
    epilog=exit_codes("0    printed"),
)
@click.option(
    "--namespace",
    metavar="NAME",
    default="gpunode-system",
    show_default=True,
    callback=checked(_namespace),
    help="The namespace created for the driver.",
)
@click.option(
    "--image",
    metavar="IMAGE",
    default=None,
    callback=checked(_image),
    help="The image built from the Containerfile (default gpunode-device-plugin:<this version>).",
)
@click.option(
    "--driver",
    default="gpu.nvidia.com",
    show_default=True,
    metavar="NAME",
    callback=checked(_driver),
    shell_complete=_complete_driver,
    help="The DRA driver name the pods serve (`dra run --driver`) and the DeviceClasses select.",
)
@click.option(
    "--driver-root",
    default="/run/nvidia/driver",
    show_default=True,
    metavar="PATH",
    callback=checked(_driver_root),
    help="Where the NVIDIA driver's files are on the nodes, mounted at that same path in the container "
    "(the claims' CDI specs name host paths): the GPU Operator's driver container's. A driver installed on "
    "the host (/) is served by `gpunode dra install` instead.",
)
@click.option("--no-classes", is_flag=True, help="Leave the DeviceClasses out of the output.")
@click.option(
    "--no-extended-resource",
    is_flag=True,
    help="Leave out the gpu class's extendedResourceName: nvidia.com/gpu (as `dra classes`).",
)
def manifest(
    namespace: str,
    image: str | None,
    driver: str,
    driver_root: str,
    no_classes: bool,
    no_extended_resource: bool,
) -> None:
    """Print the Kubernetes manifests (Namespace, ServiceAccount, RBAC, ConfigMap, DaemonSet, DeviceClasses)
    that run `gpunode dra run` on every GPU node, for `kubectl apply -f -`."""
    from gpunode.dra import manifest as dm

    options = dm.DraManifestOptions(
        namespace=namespace,
        image=image or dm.IMAGE,
        driver=driver,
        driver_root=dm.driver_root_path(driver_root),
        classes=not no_classes,
        extended_resource=not no_extended_resource,
    )
    click.echo(dm.manifests(options), nl=False)
