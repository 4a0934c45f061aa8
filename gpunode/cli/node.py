"""`gpunode node advertise|withdraw`: wiring and rendering; the work is in gpunode.advertise."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Optional

import typer

if TYPE_CHECKING:
    from gpunode.advertise import Change
    from gpunode.host import Host
    from gpunode.kube.client import KubeClient

app = typer.Typer(
    help="Advertise this node's GPUs through the Kubernetes API (capacity and GPU feature discovery labels).",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)

KUBECONFIG_HELP = (
    "kubeconfig file (default: $KUBECONFIG, ~/.kube/config, /etc/kubernetes/kubelet.conf, k3s/RKE2's, then "
    "the in-cluster service account)."
)


def kube_options() -> dict[str, Any]:
    """The credential options every command that talks to the API takes (also `gpunode up`)."""
    return {
        "kubeconfig": typer.Option(
            None, "--kubeconfig", metavar="PATH", help=KUBECONFIG_HELP, show_default=False
        ),
        "context": typer.Option(
            None,
            "--context",
            metavar="NAME",
            help="kubeconfig context (default: current).",
            show_default=False,
        ),
        "server": typer.Option(
            None,
            "--server",
            metavar="URL",
            help="API server URL, overriding the kubeconfig's (e.g. `kubectl proxy`'s http://127.0.0.1:8001).",
            show_default=False,
        ),
    }


_KUBE = kube_options()


@app.command("advertise")
def advertise(
    ctx: typer.Context,
    node: Optional[str] = typer.Option(  # noqa: UP045 (typer reads the annotation at runtime)
        None,
        "--node",
        metavar="NAME",
        help="Node name (default: $NODE_NAME, kubelet's --hostname-override, the host name).",
        show_default=False,
    ),
    resource: str = typer.Option(
        "nvidia.com/gpu", "--resource", metavar="NAME", help="Extended resource name."
    ),
    count: Optional[int] = typer.Option(  # noqa: UP045
        None,
        "--count",
        metavar="N",
        help="Capacity to advertise (default: the GPUs NVML reports).",
        show_default=False,
    ),
    labels: bool = typer.Option(True, "--labels/--no-labels", help="Set the GPU feature discovery labels."),
    capacity: bool = typer.Option(
        True,
        "--capacity/--no-capacity",
        help="Patch the extended-resource capacity (warns when a device plugin owns it).",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Read the node and print the patches; change nothing."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    kubeconfig: Optional[str] = _KUBE["kubeconfig"],  # noqa: UP045
    context: Optional[str] = _KUBE["context"],  # noqa: UP045
    server: Optional[str] = _KUBE["server"],  # noqa: UP045
) -> None:
    """Set the node's GPU capacity (JSON patch on nodes/status) and GPU labels (merge patch on the node)."""
    from gpunode import advertise as adv
    from gpunode.cli.main import state
    from gpunode.errors import UsageError

    host = state(ctx).host
    if not labels and not capacity:
        raise UsageError("--no-labels with --no-capacity leaves nothing to advertise")
    inventory = _inventory(host, need=labels or count is None)
    opts = adv.AdvertiseOptions(node=node, resource=resource, count=count, labels=labels, capacity=capacity)
    with _client(host, kubeconfig, context, server) as client:
        change = adv.advertise(host, client, opts, inventory, dry_run=dry_run)
    _render(change, dry_run=dry_run, as_json=as_json, withdraw=False)


@app.command("withdraw")
def withdraw(
    ctx: typer.Context,
    node: Optional[str] = typer.Option(  # noqa: UP045
        None, "--node", metavar="NAME", help="Node name (default as for advertise).", show_default=False
    ),
    resource: Optional[str] = typer.Option(  # noqa: UP045
        None,
        "--resource",
        metavar="NAME",
        help="Also remove this resource's capacity (default: only what gpunode advertised).",
        show_default=False,
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Read the node and print the patches; change nothing."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    kubeconfig: Optional[str] = _KUBE["kubeconfig"],  # noqa: UP045
    context: Optional[str] = _KUBE["context"],  # noqa: UP045
    server: Optional[str] = _KUBE["server"],  # noqa: UP045
) -> None:
    """Remove the capacity and the labels gpunode set (labels set by anything else stay)."""
    from gpunode import advertise as adv
    from gpunode.cli.main import state

    host = state(ctx).host
    with _client(host, kubeconfig, context, server) as client:
        change = adv.withdraw(host, client, node=node, resource=resource, dry_run=dry_run)
    _render(change, dry_run=dry_run, as_json=as_json, withdraw=True)


def _inventory(host: Host, *, need: bool) -> Any:
    from gpunode.nvml.model import Inventory

    if not need:
        return Inventory(driver_version=None, cuda_driver_version=None, nvml_version=None, gpus=())
    from gpunode.nvml.discovery import discover

    return discover(host)


def _client(host: Host, kubeconfig: str | None, context: str | None, server: str | None) -> KubeClient:
    from gpunode.kube.client import KubeClient

    return KubeClient.from_host(host, kubeconfig=kubeconfig, context=context, server=server)


def _render(change: Change, *, dry_run: bool, as_json: bool, withdraw: bool) -> None:
    if as_json:
        sys.stdout.write(
            json.dumps(
                {
                    "node": change.node,
                    "node_source": change.node_source,
                    "resource": change.resource,
                    "count": change.count,
                    "capacity_before": change.capacity_before,
                    "status_patch": change.capacity_ops,
                    "node_patch": change.metadata_patch,
                    "changed": not change.changes_nothing and not dry_run,
                    "dry_run": dry_run,
                    "warnings": change.warnings,
                },
                indent=2,
            )
            + "\n"
        )
        return
    would = "would " if dry_run else ""
    typer.echo(f"node {change.node} (from {change.node_source})")
    for warning in change.warnings:
        typer.echo(f"warning: {warning}")
    if change.changes_nothing:
        what = "nothing gpunode advertised is left on it" if withdraw else "already advertised as wanted"
        typer.echo(f"{what}: nothing to change")
        return
    for op in change.capacity_ops:
        if op["op"] == "remove":
            typer.echo(f"{would}remove {op['path']}")
        elif op.get("value") != {}:
            typer.echo(f"{would}set {op['path']} = {op['value']}")
    for key, value in sorted(change.labels_set.items()):
        typer.echo(f"{would}label {key}={value}")
    for key in change.labels_removed:
        typer.echo(f"{would}remove label {key}")
    if dry_run:
        typer.echo("dry run: nothing was changed")
