"""`gpunode plugin manifest`: the DaemonSet form of this node's plugin config (gpunode/plugin/manifest.py).

A module of its own, registered on the `plugin` group by gpunode/cli/plugin.py; it imports only click at
import time, as the other command modules do.
"""

from __future__ import annotations

import click

from gpunode.cli.common import Command, checked, exit_codes


def _namespace(namespace: str) -> None:
    import re

    from gpunode.errors import UsageError

    # A DNS-1123 label, as the API requires of a namespace's name: refused here rather than by kubectl.
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", namespace):
        raise UsageError(
            f"{namespace!r} is not a valid namespace name",
            "use lower-case letters, digits and '-', at most 63 characters",
        )


def _image(image: str) -> None:
    from gpunode.errors import UsageError

    if not image or any(c.isspace() for c in image):
        raise UsageError(f"{image!r} is not an image reference", "give e.g. registry/name:tag")


def _status_file(path: str) -> None:
    from gpunode.plugin.manifest import status_file_path

    status_file_path(path)


@click.command(
    "manifest",
    cls=Command,  # gpunode's help layout and usage errors, as the group's own commands get them
    epilog=exit_codes(
        "0    printed",
        "4    the plugin config (file, environment) does not load",
        "6    the --config file does not exist",
    ),
)
@click.option(
    "--config",
    metavar="PATH",
    help="The plugin config to deploy (as `plugin run --config`): gpunode's TOML or NVIDIA's config. "
    "Default: $GPUNODE_PLUGIN_CONFIG, else NVIDIA's $CONFIG_FILE, else /etc/gpunode/plugin.toml if it "
    "exists. GPUNODE_* and NVIDIA's variables count too, as for `plugin run`.",
)
@click.option(
    "--namespace",
    metavar="NAME",
    default="gpunode-system",
    show_default=True,
    callback=checked(_namespace),
    help="The namespace created for the plugin.",
)
@click.option(
    "--image",
    metavar="IMAGE",
    default=None,
    callback=checked(_image),
    help="The image built from the Containerfile (default gpunode-device-plugin:<this version>).",
)
@click.option(
    "--status-file",
    metavar="PATH",
    default=None,
    callback=checked(_status_file),
    help="Where the plugin keeps its status file in the container; the liveness probe reads it "
    "(default /run/gpunode/plugin-status.json, on an emptyDir).",
)
@click.option(
    "--events/--no-events",
    default=False,
    help="Grant the RBAC for Events on the Node and its GPUHealthy condition (default: none, and no "
    "service account token is mounted).",
)
@click.pass_context
def manifest(
    ctx: click.Context,
    config: str | None,
    namespace: str,
    image: str | None,
    status_file: str | None,
    events: bool,
) -> None:
    """Print the Kubernetes manifests (Namespace, ServiceAccount, RBAC, ConfigMap, DaemonSet) that run the
    device plugin with this node's config on every GPU node: the same settings as `plugin install`."""
    import os

    from gpunode.cli.state import state
    from gpunode.plugin import manifest as dm
    from gpunode.plugin.config import load_config

    # The option values were checked while parsing (their callbacks); normalised here.
    if status_file is not None:
        status_file = dm.status_file_path(status_file)
    host = state(ctx).host
    if config:
        config = os.path.abspath(config)  # a path given relative to where the command runs
    resolved = load_config(host, config_path=config, flags={})  # the environment: host.env
    driver_root, socket_dir = dm.host_paths(resolved)
    options = dm.ManifestOptions(
        namespace=namespace,
        image=image or dm.IMAGE,
        driver_root=driver_root,
        socket_dir=socket_dir,
        status_file=status_file or dm.STATUS_FILE,
        events=events,
    )
    click.echo(dm.manifests(resolved, options), nl=False)
