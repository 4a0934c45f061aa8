"""`gpunode dra classes`: wiring and rendering; the objects are in gpunode.dra.classes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpunode.cli.common import Group, checked, exit_codes
from gpunode.cli.node import kube_options

if TYPE_CHECKING:
    from gpunode.dra.classes import ClassChange


@click.group(
    "dra",
    cls=Group,
    help="Dynamic Resource Allocation (resource.k8s.io/v1): the DeviceClasses that select this node's GPUs.",
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
