"""`gpunode node advertise|withdraw`: wiring and rendering; the work is in gpunode.advertise."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from gpunode.cli.common import Group, checked, exit_codes

if TYPE_CHECKING:
    from gpunode.advertise import Change
    from gpunode.host import Host
    from gpunode.kube.client import KubeClient


@click.group(
    "node",
    cls=Group,
    help="Advertise this node's GPUs through the Kubernetes API (capacity and GPU feature discovery labels).",
    epilog=exit_codes("0    done; each command's --help lists what else it exits with"),
)
def app() -> None:
    pass


KUBECONFIG_HELP = (
    "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, /etc/kubernetes/kubelet.conf, k3s/RKE2's, then "
    "the in-cluster service account)."
)

F = TypeVar("F", bound=Callable[..., Any])


def _request_timeout(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """kubectl's --request-timeout, checked while parsing (exit 2): seconds, 0 for none, None not given."""
    if value is None:
        return None
    from gpunode.errors import UsageError
    from gpunode.kube.timeout import parse_request_timeout

    try:
        return parse_request_timeout(value)
    except UsageError as exc:
        raise click.BadParameter(f"{exc.message}; {exc.fix}", ctx=ctx, param=param) from None


def _server(url: str) -> None:
    from gpunode.kube.credentials import _normalise_server

    _normalise_server(url, "--server")  # the check the client makes before its first request


def _node(name: str) -> None:
    from gpunode.kube.client import _node_path

    _node_path(name)  # the check the client makes on the name before it asks for the Node


def _resource(name: str) -> None:
    from gpunode.advertise import _check_resource

    _check_resource(name)


def _count(count: int | None) -> int | None:
    # Before NVML is asked for the GPUs it would replace (advertise makes the same check later).
    if count is not None and count < 0:
        raise click.BadParameter(f"{count}: a count cannot be negative; give 0 or more")
    return count


check_node = checked(_node)  # --node of advertise, withdraw, up and down


def kube_options(command: F) -> F:
    """The credential options every command that talks to the API takes (also `gpunode up` and `down`):
    --kubeconfig, --context, --server, --request-timeout (seconds as a float; 0 no timeout)."""
    for option in reversed(
        (
            click.option("--kubeconfig", metavar="PATH", help=KUBECONFIG_HELP),
            click.option("--context", metavar="NAME", help="kubeconfig context (default: current)."),
            click.option(
                "--server",
                metavar="URL",
                callback=checked(_server),
                help="API server URL, overriding the kubeconfig's (e.g. `kubectl proxy`'s "
                "http://127.0.0.1:8001).",
            ),
            click.option(
                "--request-timeout",
                metavar="DURATION",
                callback=_request_timeout,
                help="Give up on a single API request after this long, as kubectl: 30 (seconds), 10s, 1m; "
                "0 means no timeout (default: 5 s to connect, 30 s to answer).",
            ),
        )
    ):
        command = option(command)
    return command


_API = "9    the Kubernetes API refused the request or could not be reached"


@app.command("advertise", epilog=exit_codes("0    advertised (or already so)", _API))
@click.option(
    "--node",
    metavar="NAME",
    callback=check_node,
    help="Node name (default: $NODE_NAME, kubelet's --hostname-override, the host name).",
)
@click.option(
    "--resource",
    default="nvidia.com/gpu",
    show_default=True,
    metavar="NAME",
    callback=checked(_resource),
    help="Extended resource name.",
)
@click.option(
    "--count",
    type=click.INT,
    callback=lambda ctx, param, value: _count(value),
    metavar="N",
    help="Capacity to advertise (default: the GPUs NVML reports).",
)
@click.option("--labels/--no-labels", default=True, help="Set the GPU feature discovery labels.")
@click.option(
    "--capacity/--no-capacity",
    default=True,
    help="Patch the extended-resource capacity (warns when a device plugin owns it).",
)
@click.option("--dry-run", is_flag=True, help="Read the node and print the patches; change nothing.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.node-advertise/v1)."
)
@kube_options
@click.pass_context
def advertise(
    ctx: click.Context,
    node: str | None,
    resource: str,
    count: int | None,
    labels: bool,
    capacity: bool,
    dry_run: bool,
    as_json: bool,
    kubeconfig: str | None,
    context: str | None,
    server: str | None,
    request_timeout: float | None,
) -> None:
    """Set the node's GPU capacity (JSON patch on nodes/status) and GPU labels (merge patch on the node)."""
    from gpunode import advertise as adv
    from gpunode.cli.state import state
    from gpunode.errors import UsageError

    host = state(ctx).host
    if as_json:
        from gpunode import jsonout

        jsonout.request("node-advertise", dry_run=dry_run)
    if not labels and not capacity:
        raise UsageError("--no-labels with --no-capacity leaves nothing to advertise")
    inventory = _inventory(host, need=labels or count is None)
    opts = adv.AdvertiseOptions(node=node, resource=resource, count=count, labels=labels, capacity=capacity)
    with _client(host, kubeconfig, context, server, request_timeout) as client:
        change = adv.advertise(host, client, opts, inventory, dry_run=dry_run)
    _render(change, dry_run=dry_run, as_json=as_json, withdraw=False)


@app.command("withdraw", epilog=exit_codes("0    withdrawn (or nothing of gpunode's was there)", _API))
@click.option("--node", metavar="NAME", callback=check_node, help="Node name (default as for advertise).")
@click.option(
    "--resource",
    metavar="NAME",
    callback=checked(_resource),
    help="Also remove this resource's capacity (default: only what gpunode advertised).",
)
@click.option("--dry-run", is_flag=True, help="Read the node and print the patches; change nothing.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (schema gpunode.node-withdraw/v1)."
)
@kube_options
@click.pass_context
def withdraw(
    ctx: click.Context,
    node: str | None,
    resource: str | None,
    dry_run: bool,
    as_json: bool,
    kubeconfig: str | None,
    context: str | None,
    server: str | None,
    request_timeout: float | None,
) -> None:
    """Remove the capacity and the labels gpunode set (labels set by anything else stay)."""
    from gpunode import advertise as adv
    from gpunode.cli.state import state

    host = state(ctx).host
    if as_json:
        from gpunode import jsonout

        jsonout.request("node-withdraw", dry_run=dry_run)
    with _client(host, kubeconfig, context, server, request_timeout) as client:
        change = adv.withdraw(host, client, node=node, resource=resource, dry_run=dry_run)
    _render(change, dry_run=dry_run, as_json=as_json, withdraw=True)


def _inventory(host: Host, *, need: bool) -> Any:
    from gpunode.nvml.model import Inventory

    if not need:
        return Inventory(driver_version=None, cuda_driver_version=None, nvml_version=None, gpus=())
    from gpunode.nvml.discovery import discover

    return discover(host)


def _client(
    host: Host,
    kubeconfig: str | None,
    context: str | None,
    server: str | None,
    request_timeout: float | None,
) -> KubeClient:
    from gpunode.kube.client import KubeClient, Timeouts

    return KubeClient.from_host(
        host,
        kubeconfig=kubeconfig,
        context=context,
        server=server,
        timeouts=Timeouts.for_request_timeout(request_timeout),
    )


def _render(change: Change, *, dry_run: bool, as_json: bool, withdraw: bool) -> None:
    if as_json:
        from gpunode import jsonout

        doc = jsonout.document(
            "node-withdraw" if withdraw else "node-advertise",
            changed=not change.changes_nothing and not dry_run,
            dry_run=dry_run,
            node=change.node,
            node_source=change.node_source,
            resource=change.resource,
            count=change.count,
            capacity_before=change.capacity_before,
            status_patch=change.capacity_ops,
            node_patch=change.metadata_patch,
            labels_set=change.labels_set,
            labels_removed=change.labels_removed,
            warnings=change.warnings,
        )
        jsonout.emit(doc)
        return
    would = "would " if dry_run else ""
    click.echo(f"node {change.node} (from {change.node_source})")
    for warning in change.warnings:
        click.echo(f"warning: {warning}")
    if change.changes_nothing:
        what = "nothing gpunode advertised is left on it" if withdraw else "already advertised as wanted"
        click.echo(f"{what}: nothing to change")
        return
    if change.condition_removed:
        click.echo(f"{would}remove condition GPUHealthy")
    for op in change.capacity_ops:
        if op["op"] == "test" or op["path"].startswith("/status/conditions/"):
            continue  # the condition's ops, said above
        if op["op"] == "remove":
            click.echo(f"{would}remove {op['path']}")
        elif op.get("value") != {}:
            click.echo(f"{would}set {op['path']} = {op['value']}")
    for key, value in sorted(change.labels_set.items()):
        click.echo(f"{would}label {key}={value}")
    for key in change.labels_removed:
        click.echo(f"{would}remove label {key}")
    if dry_run:
        click.echo("dry run: nothing was changed")
