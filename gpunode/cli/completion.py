"""`gpunode completion bash|zsh|fish`: print the shell's completion script (install.sh installs them)."""

from __future__ import annotations

import click

from gpunode.cli.common import Command, exit_codes
from gpunode.cli.state import COMPLETE_VAR

SHELLS = ("bash", "zsh", "fish")


def script(root: click.Command, shell: str) -> str:
    """The script for `shell`: a function that asks `gpunode` itself for candidates (click's protocol,
    through the _GPUNODE_COMPLETE variable), so it never goes stale when commands or options change."""
    from click.shell_completion import get_completion_class

    completion_class = get_completion_class(shell)
    if completion_class is None:  # click.Choice has refused anything else already
        raise click.BadParameter(f"no completion for {shell}")
    source = completion_class(root, {}, "gpunode", COMPLETE_VAR).source()
    # click's fish script splits each answer "type,value<TAB>help" at every comma, so a help text with a
    # comma loses its end ("Add the NVIDIA runtime to docker"): split at the first comma only.
    return source.replace('(string split "," $completion)', '(string split -m 1 "," $completion)')


@click.command(
    "completion",
    cls=Command,
    epilog=exit_codes("0    the script was printed"),
    short_help="Print the shell completion script for bash, zsh or fish.",
)
@click.argument("shell", type=click.Choice(SHELLS), metavar="SHELL")
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script for bash, zsh or fish.

    install.sh installs them where each shell looks. By hand, e.g.:
    `gpunode completion bash > /usr/share/bash-completion/completions/gpunode`,
    `gpunode completion zsh > /usr/local/share/zsh/site-functions/_gpunode`,
    `gpunode completion fish > /usr/share/fish/vendor_completions.d/gpunode.fish`.
    """
    text = script(ctx.find_root().command, shell)
    click.echo(text, nl=not text.endswith("\n"))
