"""`gpunode plugin ...`: wiring only; the plugin lives in gpunode.plugin."""

from __future__ import annotations

from typing import Any, Optional

import typer

app = typer.Typer(
    help="The embedded Kubernetes device plugin (deviceplugin v1beta1).",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _flag(flag: str, env: str, text: str, metavar: str | None = None) -> Any:
    return typer.Option(None, flag, metavar=metavar, help=f"{text} (env {env})", show_default=False)


def _switch(flag: str, env: str, text: str) -> Any:
    name = flag.removeprefix("--")
    return typer.Option(None, f"--{name}/--no-{name}", help=f"{text} (env {env})", show_default=False)


@app.command("run")
def run(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(  # noqa: UP045 (typer reads the annotation at runtime)
        None,
        "--config",
        metavar="PATH",
        help="TOML config file. Default: $GPUNODE_PLUGIN_CONFIG, else /etc/gpunode/plugin.toml if it exists.",
        show_default=False,
    ),
    simulate: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--simulate",
        metavar="PROFILE",
        help="Serve a built-in simulated node instead of NVML's GPUs (dgx-a100, pcie-4, pairs-4, mig, h100, "
        "...): demos and scheduler tests on GPU-less clusters.",
        show_default=False,
    ),
    show_config: bool = typer.Option(
        False, "--show-config", help="Print every setting, its value and where it came from; then exit."
    ),
    resource_name: Optional[str] = _flag(  # noqa: UP045
        "--resource-name", "GPUNODE_RESOURCE_NAME", "Resource to advertise (default nvidia.com/gpu).", "NAME"
    ),
    mig_strategy: Optional[str] = _flag(  # noqa: UP045
        "--mig-strategy", "GPUNODE_MIG_STRATEGY", "none | single | mixed (default none).", "STRATEGY"
    ),
    device_list_strategy: Optional[str] = _flag(  # noqa: UP045
        "--device-list-strategy",
        "GPUNODE_DEVICE_LIST_STRATEGY",
        "Comma-separated: envvar, volume-mounts, cdi-cri, cdi-annotations (default envvar).",
        "LIST",
    ),
    device_id_strategy: Optional[str] = _flag(  # noqa: UP045
        "--device-id-strategy", "GPUNODE_DEVICE_ID_STRATEGY", "uuid | index (default uuid).", "STRATEGY"
    ),
    pass_device_specs: Optional[bool] = _switch(  # noqa: UP045
        "--pass-device-specs", "GPUNODE_PASS_DEVICE_SPECS", "Also pass the /dev/nvidia* device nodes."
    ),
    pre_start_required: Optional[bool] = _switch(  # noqa: UP045
        "--pre-start-required", "GPUNODE_PRE_START_REQUIRED", "Ask kubelet to call PreStartContainer."
    ),
    fail_on_init_error: Optional[bool] = _switch(  # noqa: UP045
        "--fail-on-init-error",
        "GPUNODE_FAIL_ON_INIT_ERROR",
        "Exit when NVML fails at start (default); off: serve nothing and retry.",
    ),
    driver_root: Optional[str] = _flag(  # noqa: UP045
        "--driver-root", "GPUNODE_DRIVER_ROOT", "Where the driver is installed (default /).", "DIR"
    ),
    socket_dir: Optional[str] = _flag(  # noqa: UP045
        "--socket-dir",
        "GPUNODE_SOCKET_DIR",
        "kubelet's device-plugins directory (default /var/lib/kubelet/device-plugins).",
        "DIR",
    ),
    cdi_kind: Optional[str] = _flag(  # noqa: UP045
        "--cdi-kind",
        "GPUNODE_CDI_KIND",
        "CDI kind for the cdi-* strategies (default nvidia.com/gpu).",
        "KIND",
    ),
    replicas: Optional[int] = _flag(  # noqa: UP045
        "--replicas", "GPUNODE_REPLICAS", "Time-slicing: replicas per GPU (default 1: no sharing).", "N"
    ),
    rename_by_default: Optional[bool] = _switch(  # noqa: UP045
        "--rename-by-default", "GPUNODE_RENAME_BY_DEFAULT", "Advertise shared GPUs as <resource>.shared."
    ),
    fail_requests_greater_than_one: Optional[bool] = _switch(  # noqa: UP045
        "--fail-requests-greater-than-one",
        "GPUNODE_FAIL_REQUESTS_GREATER_THAN_ONE",
        "Refuse a container asking for more than one shared GPU.",
    ),
    placement: Optional[str] = _flag(  # noqa: UP045
        "--placement", "GPUNODE_PLACEMENT", "Replicas: spread over GPUs (default) or packed.", "MODE"
    ),
    health_checks: Optional[bool] = _switch(  # noqa: UP045
        "--health-checks", "GPUNODE_HEALTH_ENABLED", "Watch NVML events (Xid, ECC) and mark GPUs unhealthy."
    ),
    ignored_xids: Optional[str] = _flag(  # noqa: UP045
        "--ignored-xids",
        "GPUNODE_HEALTH_IGNORED_XIDS",
        "Xids that do not make a GPU unhealthy (default 13,31,43,45,68,109).",
        "LIST",
    ),
    critical_xids: Optional[str] = _flag(  # noqa: UP045
        "--critical-xids", "GPUNODE_HEALTH_CRITICAL_XIDS", "Xids that always make a GPU unhealthy.", "LIST"
    ),
    recovery_quiet_period: Optional[str] = _flag(  # noqa: UP045
        "--recovery-quiet-period",
        "GPUNODE_HEALTH_RECOVERY_QUIET_PERIOD",
        "Seconds a GPU must stay fine before it is healthy again; 0: never (default 60).",
        "SECONDS",
    ),
) -> None:
    """Run the device plugin: serve the GPUs to kubelet until SIGTERM; SIGHUP reloads.

    Every option is also a key in the TOML config file and an environment variable; a flag wins over
    the environment, which wins over the file.
    """
    from gpunode.cli.main import state

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
        "health.enabled": health_checks,
        "health.ignored_xids": ignored_xids,
        "health.critical_xids": critical_xids,
        "health.recovery_quiet_period": recovery_quiet_period,
    }
    if show_config:
        import os

        from gpunode.plugin.config import describe, load_config

        resolved = load_config(app_state.host, config_path=config, env=os.environ, flags=flags)
        rows = describe(resolved)
        width = max(len(k) for k, _, _ in rows)
        for key, value, origin in rows:
            typer.echo(f"{key:<{width}}  {value or '(none)'}  [{origin}]")
        return

    from gpunode.plugin.runner import run_plugin

    run_plugin(app_state.host, config_path=config, flags=flags, simulate=simulate, debug=app_state.debug)


@app.command("install")
def install(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--config",
        metavar="FILE",
        help="A plugin TOML config to install as /etc/gpunode/plugin.toml (checked first).",
        show_default=False,
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the unit and the commands; change nothing."),
    no_start: bool = typer.Option(False, "--no-start", help="Install and enable, but do not start it now."),
) -> None:
    """Install the plugin as the systemd service gpunode-device-plugin, start it, wait until registered."""
    from gpunode.cli.main import state
    from gpunode.systemd import service

    host = state(ctx).host
    if not dry_run:
        service.require_root(host, "plugin install")
    plan = service.plan_install(
        host, config_file=config, start=not no_start, executable=service.gpunode_executable()
    )
    if dry_run:
        _print_plan(plan)
        return
    if plan.changes_nothing and (no_start or service.service_state(host).active == "active"):
        typer.echo(f"{service.UNIT} is installed and up to date; nothing to do")
        _print_state(service.service_state(host))
        return
    for note in plan.notes:
        typer.echo(f"note: {note}")
    result = service.apply_install(host, plan)
    for f in plan.files:
        typer.echo(f"{'wrote' if f.changed else 'unchanged'} {f.path}")
    for argv in plan.commands:
        typer.echo(f"ran {' '.join(argv)}")
    _print_state(result)


@app.command("uninstall")
def uninstall(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be stopped and removed."),
) -> None:
    """Stop and disable the service and remove the files `plugin install` wrote (nothing else)."""
    from gpunode.cli.main import state
    from gpunode.systemd import service

    host = state(ctx).host
    if not dry_run:
        service.require_root(host, "plugin uninstall")
    plan = service.plan_uninstall(host)
    if dry_run:
        _print_plan(plan)
        return
    if plan.changes_nothing:
        typer.echo(f"{service.UNIT} is not installed; nothing to do")
    else:
        service.apply_uninstall(host, plan)
        for argv in plan.commands:
            typer.echo(f"ran {' '.join(argv)}")
        for path in plan.remove:
            typer.echo(f"removed {path}")
    for note in plan.notes:
        typer.echo(f"note: {note}")


@app.command("status")
def status(ctx: typer.Context) -> None:
    """The service's state, whether the plugin is registered with kubelet, and the devices it serves."""
    from gpunode.cli.main import state
    from gpunode.errors import ExitCode
    from gpunode.systemd import service

    current = service.service_state(state(ctx).host)
    _print_state(current)
    if current.active != "active" or not (current.plugin or {}).get("ready"):
        raise typer.Exit(int(ExitCode.UNHEALTHY))


def _print_plan(plan: Any) -> None:
    for f in plan.files:
        verb = "unchanged" if not f.changed else ("would create" if f.before is None else "would replace")
        typer.echo(f"{verb} {f.path}:")
        if f.changed:
            typer.echo("".join(f"    {line}\n" for line in f.content.splitlines()), nl=False)
    for path in plan.remove:
        typer.echo(f"would remove {path}")
    for argv in plan.commands:
        typer.echo(f"would run: {' '.join(argv)}")
    if plan.wait_ready:
        typer.echo("would wait until the plugin is registered with kubelet (the unit turns active)")
    for note in plan.notes:
        typer.echo(f"note: {note}")
    if plan.changes_nothing:
        typer.echo("nothing to change")


def _print_state(current: Any) -> None:
    props = current.properties
    typer.echo(
        f"service: {props.get('ActiveState', 'unknown')} ({props.get('SubState', '?')}), "
        f"{props.get('UnitFileState', 'unknown')}, restarts {props.get('NRestarts', '?')}"
    )
    plugin = current.plugin
    if not plugin:
        typer.echo("plugin: no status (not running)")
        return
    typer.echo(f"plugin: pid {plugin.get('pid')}, {plugin.get('summary')}")
    for resource in plugin.get("resources") or []:
        state_text = (
            "registered" if resource.get("registered") else (resource.get("refused") or "not registered")
        )
        typer.echo(
            f"  {resource.get('name')}: {resource.get('healthy')}/{resource.get('devices')} healthy, "
            f"{state_text} ({resource.get('socket')})"
        )
    # Schedulable, but their faults go unseen: "cannot monitor" is not "unhealthy".
    for gpu in plugin.get("unmonitored") or []:
        typer.echo(f"  unmonitored: GPU {gpu.get('index')} ({gpu.get('uuid')}): {gpu.get('reason')}")
