"""`gpunode plugin ...`: wiring only; the plugin lives in gpunode.plugin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from gpunode.cli.common import (
    Group,
    checked,
    complete_device_list_strategy,
    complete_mig_strategy,
    complete_simulate,
    exit_codes,
)
from gpunode.cli.plugin_manifest import manifest

F = TypeVar("F", bound=Callable[..., Any])


@click.group(
    "plugin",
    cls=Group,
    help="The embedded Kubernetes device plugin (deviceplugin v1beta1).",
    epilog=exit_codes("0    done; each command's --help lists what else it exits with"),
)
def app() -> None:
    pass


def _flag(
    flag: str, env: str, text: str, metavar: str, type_: Any = None, complete: Any = None
) -> Callable[[F], F]:
    # A plain value with shell completion, not click.Choice: the plugin's config reading judges the value
    # (the flag, its environment variable and the file the same way).
    return click.option(
        flag, metavar=metavar, type=type_, help=f"{text} (env {env})", shell_complete=complete
    )


class _Int(click.types.IntParamType):
    """click's INT, quoting at most 80 characters of a value it refuses (a number of 5,000 digits, which
    int() refuses, was echoed whole)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and len(value) > 80:
            self.fail(f"{value[:40]!r}... ({len(value)} characters) is not a valid integer", param, ctx)
        return super().convert(value, param, ctx)


def _switch(flag: str, env: str, text: str) -> Callable[[F], F]:
    # None when not given: the environment and the config file decide then.
    name = flag.removeprefix("--")
    return click.option(f"--{name}/--no-{name}", default=None, help=f"{text} (env {env})")


@app.command(
    "run",
    epilog=exit_codes(
        "0    stopped by SIGTERM / SIGINT",
        "3    another gpunode plugin serves in the same socket directory",
        "2    a bad flag value or an unknown --simulate profile",
        "4    a bad config (file, environment), or a node that does not fit it",
        "6    the --config file does not exist",
        "7    NVML cannot be used at start (with fail-on-init-error)",
    ),
)
@click.option(
    "--config",
    metavar="PATH",
    help="Config file: gpunode's TOML, or NVIDIA's device-plugin config (YAML/JSON, version v1) as it is. "
    "Default: $GPUNODE_PLUGIN_CONFIG, else NVIDIA's $CONFIG_FILE, else /etc/gpunode/plugin.toml if it "
    "exists.",
)
@click.option(
    "--simulate",
    metavar="PROFILE",
    shell_complete=complete_simulate,
    help="Serve a built-in simulated node instead of NVML's GPUs (dgx-a100, pcie-4, pairs-4, mig, h100, "
    "...): demos and scheduler tests on GPU-less clusters.",
)
@click.option(
    "--show-config",
    is_flag=True,
    help="Print every setting as TOML (a config file the plugin reads back), each with a comment saying "
    "where its value came from; then exit.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="With --show-config: print one JSON document (schema gpunode.plugin-run/v1) instead.",
)
@click.option(
    "--status-file",
    metavar="PATH",
    help="Where to keep the status file `gpunode plugin status` reads (env GPUNODE_PLUGIN_STATUS_FILE; "
    "default /run/gpunode/plugin-status.json).",
)
@_flag("--resource-name", "GPUNODE_RESOURCE_NAME", "Resource to advertise (default nvidia.com/gpu).", "NAME")
@_flag(
    "--mig-strategy",
    "GPUNODE_MIG_STRATEGY",
    "none | single | mixed (default none).",
    "STRATEGY",
    complete=complete_mig_strategy,
)
@_flag(
    "--device-list-strategy",
    "GPUNODE_DEVICE_LIST_STRATEGY",
    "Comma-separated: envvar, volume-mounts, cdi-cri, cdi-annotations (default envvar).",
    "LIST",
    complete=complete_device_list_strategy,
)
@_flag("--device-id-strategy", "GPUNODE_DEVICE_ID_STRATEGY", "uuid | index (default uuid).", "STRATEGY")
@_switch("--pass-device-specs", "GPUNODE_PASS_DEVICE_SPECS", "Also pass the /dev/nvidia* device nodes.")
@_switch("--pre-start-required", "GPUNODE_PRE_START_REQUIRED", "Ask kubelet to call PreStartContainer.")
@_switch(
    "--fail-on-init-error",
    "GPUNODE_FAIL_ON_INIT_ERROR",
    "Exit when NVML fails at start (default); off: serve nothing and retry.",
)
@_flag("--driver-root", "GPUNODE_DRIVER_ROOT", "Where the driver is installed (default /).", "DIR")
@_flag(
    "--socket-dir",
    "GPUNODE_SOCKET_DIR",
    "kubelet's device-plugins directory (default /var/lib/kubelet/device-plugins).",
    "DIR",
)
@_flag(
    "--cdi-kind", "GPUNODE_CDI_KIND", "CDI kind for the cdi-* strategies (default nvidia.com/gpu).", "KIND"
)
@_flag(
    "--replicas",
    "GPUNODE_REPLICAS",
    "Time-slicing: replicas per GPU (default 1: no sharing).",
    "N",
    _Int(),
)
@_switch("--rename-by-default", "GPUNODE_RENAME_BY_DEFAULT", "Advertise shared GPUs as <resource>.shared.")
@_switch(
    "--fail-requests-greater-than-one",
    "GPUNODE_FAIL_REQUESTS_GREATER_THAN_ONE",
    "Refuse a container asking for more than one shared GPU.",
)
@_flag("--placement", "GPUNODE_PLACEMENT", "Replicas: spread over GPUs (default) or packed.", "MODE")
@_flag(
    "--time-slicing-resources",
    "GPUNODE_TIME_SLICING_RESOURCES",
    'Per resource, as JSON: [{"name": "nvidia.com/gpu", "replicas": 4, "devices": [0, 1], "rename": ...}].',
    "JSON",
)
@_flag(
    "--gpu-resources",
    "GPUNODE_GPU_RESOURCES",
    'A resource per GPU model, as JSON: [{"pattern": "*A100*", "name": "a100"}].',
    "JSON",
)
@_flag(
    "--mig-resources",
    "GPUNODE_MIG_RESOURCES",
    'A resource per MIG profile (mixed), as JSON: [{"pattern": "1g.*", "name": "mig-small"}].',
    "JSON",
)
@_flag("--dev-root", "GPUNODE_DEV_ROOT", "Where the device nodes are (default: the driver root).", "DIR")
@_flag(
    "--cdi-annotation-prefix",
    "GPUNODE_CDI_ANNOTATION_PREFIX",
    "Key prefix of the cdi-annotations strategy (default cdi.k8s.io/).",
    "PREFIX",
)
@_switch("--gds-enabled", "GPUNODE_GDS_ENABLED", "Give containers NVIDIA_GDS=enabled (GPUDirect Storage).")
@_switch("--mofed-enabled", "GPUNODE_MOFED_ENABLED", "Give containers NVIDIA_MOFED=enabled.")
@_switch("--gdrcopy-enabled", "GPUNODE_GDRCOPY_ENABLED", "Give containers NVIDIA_GDRCOPY=enabled.")
@_flag(
    "--imex-channel-ids",
    "GPUNODE_IMEX_CHANNEL_IDS",
    "IMEX channels to give every container: 0 or none (default none).",
    "LIST",
)
@_switch(
    "--imex-required", "GPUNODE_IMEX_REQUIRED", "Refuse to start when a configured IMEX channel is missing."
)
@_flag(
    "--mps-resources",
    "GPUNODE_MPS_RESOURCES",
    'MPS sharing per resource, as JSON: [{"name": "nvidia.com/gpu", "replicas": 4}]; a control daemon each.',
    "JSON",
)
@_flag(
    "--mps-root", "GPUNODE_MPS_ROOT", "MPS pipe, log and shm directories (default /run/nvidia/mps).", "DIR"
)
@_flag(
    "--mps-active-thread-percentage",
    "GPUNODE_MPS_ACTIVE_THREAD_PERCENTAGE",
    "MPS: active threads per client, 1-100 (default 100 / replicas).",
    "PERCENT",
)
@_flag(
    "--mps-pinned-memory-limit",
    "GPUNODE_MPS_PINNED_MEMORY_LIMIT",
    "MPS: device memory per client, MiB or e.g. 10G (default: the GPU's memory / replicas).",
    "SIZE",
)
@_switch("--health-checks", "GPUNODE_HEALTH_ENABLED", "Watch NVML events (Xid, ECC) and mark GPUs unhealthy.")
@_flag(
    "--ignored-xids",
    "GPUNODE_HEALTH_IGNORED_XIDS",
    "Xids that do not make a GPU unhealthy (default 13,31,43,45,68,109).",
    "LIST",
)
@_flag("--critical-xids", "GPUNODE_HEALTH_CRITICAL_XIDS", "Xids that always make a GPU unhealthy.", "LIST")
@_flag(
    "--recovery-quiet-period",
    "GPUNODE_HEALTH_RECOVERY_QUIET_PERIOD",
    "Seconds a GPU must stay fine before it is healthy again; 0: never (default 60).",
    "SECONDS",
)
@_flag(
    "--metrics-address",
    "GPUNODE_METRICS_ADDRESS",
    'Serve Prometheus metrics on HOST:PORT (e.g. 127.0.0.1:9402); "" (the default): off.',
    "HOST:PORT",
)
@_switch(
    "--events", "GPUNODE_EVENTS_ENABLED", "Report GPU health as Node Events and the GPUHealthy condition."
)
@_flag(
    "--events-kubeconfig",
    "GPUNODE_EVENTS_KUBECONFIG",
    "The node's kubeconfig for Events and the condition (default /etc/kubernetes/kubelet.conf).",
    "PATH",
)
@_flag(
    "--node-name",
    "GPUNODE_NODE_NAME",
    "This node's name in Kubernetes (default: as kubelet names it).",
    "NAME",
)
@click.pass_context
def run(
    ctx: click.Context,
    config: str | None,
    simulate: str | None,
    show_config: bool,
    as_json: bool,
    status_file: str | None,
    resource_name: str | None,
    mig_strategy: str | None,
    device_list_strategy: str | None,
    device_id_strategy: str | None,
    pass_device_specs: bool | None,
    pre_start_required: bool | None,
    fail_on_init_error: bool | None,
    driver_root: str | None,
    socket_dir: str | None,
    cdi_kind: str | None,
    replicas: int | None,
    rename_by_default: bool | None,
    fail_requests_greater_than_one: bool | None,
    placement: str | None,
    time_slicing_resources: str | None,
    gpu_resources: str | None,
    mig_resources: str | None,
    dev_root: str | None,
    cdi_annotation_prefix: str | None,
    gds_enabled: bool | None,
    mofed_enabled: bool | None,
    gdrcopy_enabled: bool | None,
    imex_channel_ids: str | None,
    imex_required: bool | None,
    mps_resources: str | None,
    mps_root: str | None,
    mps_active_thread_percentage: str | None,
    mps_pinned_memory_limit: str | None,
    health_checks: bool | None,
    ignored_xids: str | None,
    critical_xids: str | None,
    recovery_quiet_period: str | None,
    metrics_address: str | None,
    events: bool | None,
    events_kubeconfig: str | None,
    node_name: str | None,
) -> None:
    """Run the device plugin: serve the GPUs to kubelet until SIGTERM; SIGHUP reloads.

    Every option is also a key in the TOML config file and an environment variable; a flag wins over
    the environment, which wins over the file.
    """
    from gpunode.cli.state import state

    app_state = state(ctx)
    flags = {
        "resource_name": resource_name,
        "mig_strategy": mig_strategy,
        "device_list_strategy": device_list_strategy,
        "device_id_strategy": device_id_strategy,
        "pass_device_specs": pass_device_specs,
        "pre_start_required": pre_start_required,
        "fail_on_init_error": fail_on_init_error,
        "driver_root": driver_root,
        "socket_dir": socket_dir,
        "cdi_kind": cdi_kind,
        "replicas": replicas,
        "rename_by_default": rename_by_default,
        "fail_requests_greater_than_one": fail_requests_greater_than_one,
        "placement": placement,
        "shared_resources": time_slicing_resources,
        "gpu_resources": gpu_resources,
        "mig_resources": mig_resources,
        "dev_root": dev_root,
        "cdi_annotation_prefix": cdi_annotation_prefix,
        "gds_enabled": gds_enabled,
        "mofed_enabled": mofed_enabled,
        "gdrcopy_enabled": gdrcopy_enabled,
        "imex_channel_ids": imex_channel_ids,
        "imex_required": imex_required,
        "mps_resources": mps_resources,
        "mps_root": mps_root,
        "mps_active_thread_percentage": mps_active_thread_percentage,
        "mps_pinned_memory_limit": mps_pinned_memory_limit,
        "health.enabled": health_checks,
        "health.ignored_xids": ignored_xids,
        "health.critical_xids": critical_xids,
        "health.recovery_quiet_period": recovery_quiet_period,
        "metrics_address": metrics_address,
        "events_enabled": events,
        "events_kubeconfig": events_kubeconfig,
        "node_name": node_name,
    }
    if show_config or as_json:
        _show_config(
            app_state.host, config, flags, as_json=as_json, show_config=show_config, simulate=simulate
        )
        return

    from gpunode.plugin.argv import check_flags
    from gpunode.plugin.runner import run_plugin

    check_flags(flags)  # a bad flag value is a usage error, said before a file or NVML is read

    run_plugin(
        app_state.host,
        config_path=config,
        flags=flags,
        simulate=simulate,
        debug=app_state.debug,
        status_file=status_file,
    )


def _unit_path(option: str, path: str) -> None:
    from gpunode.systemd.unitsyntax import absolute_path

    absolute_path(option, path)  # the check plan_install makes, before root or systemd is asked


@app.command(
    "install",
    epilog=exit_codes(
        "0    installed and registered with kubelet (or already so)",
        "4    the --config file does not load",
        "5    not root (without --dry-run)",
        "8    the plugin did not become ready within 120 s",
    ),
)
@click.option(
    "--config",
    metavar="FILE",
    help="A plugin config to install as /etc/gpunode/plugin.toml (checked first): gpunode's TOML, or "
    "NVIDIA's device-plugin config, installed as the gpunode TOML it means (see `plugin import-config`).",
)
@click.option("--dry-run", is_flag=True, help="Print the unit and the commands; change nothing.")
@click.option("--no-start", is_flag=True, help="Install and enable, but do not start it now.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.plugin-install/v1)."
)
@click.option(
    "--doctor-metrics",
    metavar="DIR",
    callback=checked(lambda directory: _unit_path("--doctor-metrics", directory)),
    help="Also install gpunode-doctor-metrics.timer: every 5 minutes `gpunode doctor --prometheus` writes "
    "DIR/gpunode_doctor.prom for node_exporter's textfile collector (its --collector.textfile.directory).",
)
@click.pass_context
def install(
    ctx: click.Context,
    config: str | None,
    dry_run: bool,
    no_start: bool,
    as_json: bool,
    doctor_metrics: str | None,
) -> None:
    """Install the plugin as the systemd service gpunode-device-plugin, start it, wait until registered."""
    from gpunode import jsonout
    from gpunode.cli.state import state
    from gpunode.systemd import service

    if as_json:
        jsonout.request("plugin-install", dry_run=dry_run)
    host = state(ctx).host
    if not dry_run:
        service.require_root(host, "plugin install")
    plan = service.plan_install(
        host,
        config_file=config,
        start=not no_start,
        executable=service.gpunode_executable(),
        doctor_metrics=doctor_metrics,
    )
    if dry_run:
        if as_json:
            jsonout.emit(jsonout.document("plugin-install", changed=False, dry_run=True, **_plan_json(plan)))
        else:
            _print_plan(plan, host)
        return
    # Under --root this machine's systemd knows nothing of the root's units: it is not asked.
    if plan.changes_nothing and (no_start or host.offline or service.service_state(host).active == "active"):
        current = None if host.offline else service.service_state(host)
        state_field: dict[str, Any] = {} if current is None else {"state": _state_json(current)}
        if as_json:
            jsonout.emit(jsonout.document("plugin-install", changed=False, **_plan_json(plan), **state_field))
            return
        click.echo(f"{service.UNIT} is installed and up to date; nothing to do")
        if current is not None:
            _print_state(current)
        return
    if not as_json:
        for note in plan.notes:
            click.echo(f"note: {note}")
    from gpunode.cli.waitline import WaitLine

    # The wait for the plugin to register can last 120 s: its progress goes to stderr, never to stdout.
    with WaitLine() as waiting:
        try:
            result = service.apply_install(host, plan, progress=waiting)
        finally:
            if as_json:
                jsonout.update(**waiting.json())  # an error document (Ctrl-C, a timeout) carries it too
    if as_json:
        state_field = {} if host.offline else {"state": _state_json(result)}
        doc = jsonout.document("plugin-install", changed=True, **_plan_json(plan), **state_field)
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
        _print_state(result)


@app.command(
    "uninstall",
    epilog=exit_codes("0    removed (or was not installed)", "5    not root (without --dry-run)"),
)
@click.option("--dry-run", is_flag=True, help="Print what would be stopped and removed.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.plugin-uninstall/v1)."
)
@click.pass_context
def uninstall(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Stop and disable the service and remove the files `plugin install` wrote (nothing else)."""
    from gpunode import jsonout
    from gpunode.cli.state import state
    from gpunode.systemd import service

    if as_json:
        jsonout.request("plugin-uninstall", dry_run=dry_run)
    host = state(ctx).host
    if not dry_run:
        service.require_root(host, "plugin uninstall")
    plan = service.plan_uninstall(host)
    if dry_run:
        if as_json:
            jsonout.emit(
                jsonout.document("plugin-uninstall", changed=False, dry_run=True, **_plan_json(plan))
            )
        else:
            _print_plan(plan, host)
        return
    if not plan.changes_nothing:
        service.apply_uninstall(host, plan)
    if as_json:
        jsonout.emit(
            jsonout.document("plugin-uninstall", changed=not plan.changes_nothing, **_plan_json(plan))
        )
        return
    if plan.changes_nothing:
        click.echo(f"{service.UNIT} is not installed; nothing to do")
    else:
        for argv in plan.commands:
            click.echo(f"ran {' '.join(argv)}")
        for path in plan.remove:
            click.echo(f"removed {path}")
        _print_links(plan, host, done=True)
    for note in plan.notes:
        click.echo(f"note: {note}")


@app.command(
    "status",
    epilog=exit_codes(
        "0    the plugin is running and registered (and the service active, where systemd runs it)",
        "1    it is not, or no status file was found (the output says where it looked)",
    ),
)
@click.option(
    "--status-file",
    metavar="PATH",
    callback=lambda ctx, param, value: _absolute_status_file(value),
    help="Read this status file: the one a plugin started by hand or in a container was given with "
    "`plugin run --status-file` (env GPUNODE_PLUGIN_STATUS_FILE). Default: where the systemd unit tells the "
    "service to write it, else /run/gpunode/plugin-status.json.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.plugin-status/v1)."
)
@click.pass_context
def status(ctx: click.Context, status_file: str | None, as_json: bool) -> None:
    """The plugin's state: whether each resource is registered with kubelet, its devices' health, the GPUs
    it cannot monitor, and the service's state where systemd runs it."""
    from gpunode import jsonout
    from gpunode.cli.state import state
    from gpunode.errors import ExitCode
    from gpunode.systemd import service

    if as_json:
        jsonout.request("plugin-status")
    host = state(ctx).host
    current = service.service_state(host, status_file=status_file, env=host.env)
    ok = _status_ok(current)
    if as_json:
        jsonout.emit(jsonout.document("plugin-status", changed=False, ready=ok, **_state_json(current)))
    else:
        _print_state(current)
    if not ok:
        raise click.exceptions.Exit(int(ExitCode.UNHEALTHY))


def _absolute_status_file(path: str | None) -> str | None:
    # `plugin run` takes only an absolute --status-file: a relative one names no file a plugin writes.
    if path is not None and not path.startswith("/"):
        raise click.BadParameter(
            f"{path!r} is not an absolute path; give the path the plugin was started with "
            "(`plugin run --status-file`)"
        )
    return path


@app.command(
    "import-config",
    epilog=exit_codes(
        "0    printed",
        "4    the file is not NVIDIA's config, or the plugin would refuse it (the key and line named)",
        "6    the file does not exist",
    ),
)
@click.argument("nvidia_file", metavar="NVIDIA_FILE")
@click.pass_context
def import_config(ctx: click.Context, nvidia_file: str) -> None:
    """Print NVIDIA's device-plugin config file (YAML or JSON, version v1) as the equivalent gpunode TOML,
    each key with a comment naming the NVIDIA key it came from. `plugin run --config` also reads the NVIDIA
    file as it is; this is for review, and for keeping gpunode's own file."""
    import os

    from gpunode.cli.state import state
    from gpunode.errors import NotFound
    from gpunode.plugin.import_config import render

    host = state(ctx).host
    nvidia_file = os.path.abspath(nvidia_file)  # a path given relative to where the command runs
    text = host.read_text_if_exists(nvidia_file)
    if text is None:
        raise NotFound(f"{nvidia_file} does not exist", "give the path of NVIDIA's device-plugin config file")
    click.echo(render(text, nvidia_file), nl=False)


def _status_ok(current: Any) -> bool:
    """Registered, and running: the file's process alive and, when the file is the service's, the unit
    active (a file left by a service that died would still say ready)."""
    lookup = current.lookup
    if not lookup.ready:
        return False
    explicit = lookup.found is not None and lookup.found.source.startswith(("flag ", "env "))
    if explicit or not current.installed:
        return True
    return bool(current.active == "active")


def _plan_json(plan: Any) -> dict[str, Any]:
    return {
        "files": [
            {
                "path": f.path,
                "action": "unchanged" if not f.changed else ("create" if f.before is None else "replace"),
                "content": f.content,
            }
            for f in plan.files
        ],
        "commands": [list(argv) for argv in plan.commands],
        "remove": list(plan.remove),
        "wait_ready": plan.wait_ready,
        "notes": list(plan.notes),
        "links": [link.to_json() for link in plan.links],
        "next_steps": [list(argv) for argv in plan.next_steps],
    }


def _print_links(plan: Any, host: Any, *, done: bool) -> None:
    from gpunode.systemd.enable import describe

    for line in describe(str(host.root), plan.links, plan.next_steps, done=done):
        click.echo(line)


def _state_json(current: Any, unit: str = "gpunode-device-plugin.service") -> dict[str, Any]:
    props = current.properties
    lookup = current.lookup
    return {
        "service": {
            "unit": unit,
            "installed": current.installed,
            "active_state": props.get("ActiveState"),
            "sub_state": props.get("SubState"),
            "unit_file_state": props.get("UnitFileState"),
            "main_pid": int(props["MainPID"]) if props.get("MainPID", "").isdigit() else None,
            "restarts": int(props["NRestarts"]) if props.get("NRestarts", "").isdigit() else None,
            "status_text": props.get("StatusText"),
        },
        "status_file": None
        if lookup.found is None
        else {"path": lookup.found.path, "source": lookup.found.source},
        "looked": [{"path": p.path, "source": p.source} for p in lookup.looked],
        "problem": lookup.problem,
        "pid_running": lookup.pid_running,
        "plugin": lookup.document,
    }


def _show_config(
    host: Any,
    config: str | None,
    flags: dict[str, Any],
    *,
    as_json: bool,
    show_config: bool,
    simulate: str | None = None,
) -> None:
    import os

    from gpunode import jsonout
    from gpunode.errors import UsageError
    from gpunode.plugin.config import OPTIONS, load_config, to_toml, value_of

    if as_json:
        jsonout.request("plugin-run")
    if not show_config:
        raise UsageError("plugin run: --json goes with --show-config", "add --show-config")
    from gpunode.plugin.argv import check_flags

    check_flags(flags)  # a usage error (in the JSON document too), before the config file is read
    if simulate:  # refused as `plugin run --simulate` refuses it, never ignored (exit 2, the names listed)
        from gpunode.plugin.runner import inventory_source

        inventory_source(host, simulate)
    resolved = load_config(host, config_path=config, env=os.environ, flags=flags)
    if not as_json:
        click.echo(to_toml(resolved), nl=False)
        return
    settings = [
        {
            "key": o.key,
            "value": value_of(resolved, o),
            "origin": resolved.origins.get(o.name, "default"),
            "env": o.env,
            "flag": o.flag,
        }
        for o in OPTIONS
    ]
    jsonout.emit(
        jsonout.document(
            "plugin-run",
            changed=False,
            settings=settings,
            all_xids_critical=resolved.health.all_xids_critical,
        )
    )


def _print_plan(plan: Any, host: Any) -> None:
    for f in plan.files:
        verb = "unchanged" if not f.changed else ("would create" if f.before is None else "would replace")
        click.echo(f"{verb} {f.path}:")
        if f.changed:
            click.echo("".join(f"    {line}\n" for line in f.content.splitlines()), nl=False)
    for path in plan.remove:
        click.echo(f"would remove {path}")
    for argv in plan.commands:
        click.echo(f"would run: {' '.join(argv)}")
    _print_links(plan, host, done=False)
    if plan.wait_ready:
        who = "the plugin" if plan.spec.command == "plugin" else plan.spec.unit
        click.echo(f"would wait until {who} is registered with kubelet (the unit turns active)")
    for note in plan.notes:
        click.echo(f"note: {note}")
    if plan.changes_nothing:
        click.echo("nothing to change")


def _print_state(current: Any) -> None:
    props = current.properties
    if current.installed:
        click.echo(
            f"service: {props.get('ActiveState', 'unknown')} ({props.get('SubState', '?')}), "
            f"{props.get('UnitFileState', 'unknown')}, restarts {props.get('NRestarts', '?')}"
        )
    else:
        click.echo("service: gpunode-device-plugin.service is not installed (or systemd does not answer)")
    lookup = current.lookup
    if lookup.found is None:
        click.echo("plugin: no status (not running); looked for its status file at:")
        for place in lookup.looked:
            click.echo(f"  {place.path} ({place.source})")
        click.echo("  (a plugin run by hand or in a container: --status-file PATH, as it was given)")
        return
    click.echo(f"status file: {lookup.found.path} ({lookup.found.source})")
    if lookup.problem:
        click.echo(f"plugin: unreadable status: {lookup.problem}")
        return
    plugin = current.plugin
    stale = " (not running: the file is stale)" if lookup.pid_running is False else ""
    click.echo(f"plugin: pid {plugin.get('pid')}{stale}, {plugin.get('summary')}")
    for resource in plugin.get("resources") or []:
        state_text = (
            "registered" if resource.get("registered") else (resource.get("refused") or "not registered")
        )
        click.echo(
            f"  {resource.get('name')}: {resource.get('healthy')}/{resource.get('devices')} healthy, "
            f"{state_text} ({resource.get('socket')})"
            + (f"; shared by {resource['sharing']}" if resource.get("sharing") not in (None, "none") else "")
            + (f"; all unhealthy: {resource['down']}" if resource.get("down") else "")
        )
    # Schedulable, but their faults go unseen: "cannot monitor" is not "unhealthy".
    for gpu in plugin.get("unmonitored") or []:
        click.echo(f"  unmonitored: GPU {gpu.get('index')} ({gpu.get('uuid')}): {gpu.get('reason')}")


app.add_command(manifest)  # `plugin manifest`: the DaemonSet form, in its own module (listed last)
