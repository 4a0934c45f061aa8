"""What several commands share: the checks before a command changes the host, and the exit-status epilog
every command's help ends with (the README is not installed with the tool)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from gpunode.host import Host


def complete_runtime(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion of a container runtime's name (the value stays a plain string: the command
    names the runtimes it knows when it refuses one)."""
    return [name for name in ("docker", "containerd", "crio") if name.startswith(incomplete)]


def complete_mig_strategy(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion only (the plugin's own config reading judges the value, with its fix line)."""
    from gpunode.plugin.devices import MIG_STRATEGIES

    return [name for name in MIG_STRATEGIES if name.startswith(incomplete)]


def complete_device_list_strategy(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """The strategies, for the last item of a comma-separated list (`envvar,cdi-` → `envvar,cdi-cri`)."""
    from gpunode.plugin.config import DEVICE_LIST_STRATEGIES

    done, _, last = incomplete.rpartition(",")
    given = set(done.split(",")) if done else set()
    prefix = f"{done}," if done else ""
    return [prefix + name for name in DEVICE_LIST_STRATEGIES if name.startswith(last) and name not in given]


def complete_simulate(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """The built-in simulated nodes (imported only when a shell asks: the plugin's start-up skips it)."""
    from gpunode.plugin.simulate import PROFILES

    return [name for name in PROFILES if name.startswith(incomplete)]


def checked(check: Callable[[Any], object]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """An option's callback from one of gpunode's own checks (the one the work itself makes later): a bad
    value is refused while the command line is parsed, in click's form (exit 2), before NVML, the API, a
    file or a command is touched (issue 24). The value is returned as given: the work normalises it.

    The check's message names its flag first ("--repo-url 'x' holds ..."); click names the option once
    ("Invalid value for '--repo-url': 'x' holds ..."), and the check's fix follows, with this option's
    name where the check named another (`up --toolkit-version` is `toolkit install --version`)."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        from gpunode.errors import GpunodeError

        if value is None:
            return value
        try:
            check(value)
        except GpunodeError as err:
            flag = _LEADING_FLAG.match(err.message)
            detail = err.message[flag.end() :] if flag else err.message
            fix = err.fix or ""
            if flag and param.opts and flag.group(1) != param.opts[0]:
                fix = re.sub(rf"{re.escape(flag.group(1))}\b", param.opts[0], fix)
            raise click.BadParameter(f"{detail}; {fix}" if fix else detail, ctx=ctx, param=param) from None
        return value

    return callback


# "--flag 'x' ...", "--flag: 'x' ...", "invalid --flag 'x'", "plugin manifest: --flag 'x' ...".
_LEADING_FLAG = re.compile(r"(?:[a-z-]+ [a-z-]+: )?(?:invalid )?(--[a-z][a-z-]*):? ")


class HelpFormatter(click.HelpFormatter):
    """click's help, but on a narrow terminal each option's text goes under its name, across the width,
    instead of in a column a few characters wide beside names that take 30."""

    def write_dl(self, rows: Iterable[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        super().write_dl(rows, col_max=col_max if self.width >= 70 else 0, col_spacing=col_spacing)


class Context(click.Context):
    formatter_class = HelpFormatter


class Command(click.Command):
    """Every gpunode command: a usage error always knows its command, so the error can name that
    command's help (click's parser raises some, such as a missing option value, without it)."""

    context_class = Context

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as err:
            err.ctx = err.ctx or ctx
            raise


class Group(click.Group):
    """A group of gpunode commands (`gpunode plugin ...`); see Command."""

    context_class = Context
    command_class = Command

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)  # in the order they are declared (click sorts them)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as err:
            err.ctx = err.ctx or ctx
            raise


# The statuses every command can end with; gpunode/errors.py's ExitCode has the same values.
_SHARED = (
    "2    wrong usage: a bad option or argument",
    "3    a gpunode error with no more specific code",
    "4    a file gpunode must read is malformed or of an unknown format",
    "5    permission denied: needs root, or the OS refused access",
    "6    a file, program or device that is needed does not exist",
    "7    the NVIDIA driver / NVML cannot be used",
    "8    an external command failed, could not start, or timed out",
    "9    the Kubernetes API refused a request or could not be reached",
    "70   a bug in gpunode (--debug shows the traceback)",
    "130  interrupted (Ctrl-C)",
    "141  the reader of the output went away (`| head`)",
)


def exit_codes(*own: str, full: bool = False) -> str:
    """A help epilog: the command's own exit statuses (`"0    what it means"`) and the shared ones, in order.

    `full` lists every shared status; otherwise 3-9 is one line pointing at `gpunode --help`.
    """
    shared = (
        _SHARED
        if full
        else (_SHARED[0], "3-9  other gpunode errors (`gpunode --help` lists them)", *_SHARED[-3:])
    )
    lines = sorted((*own, *shared), key=lambda line: int(line.split()[0].split("-")[-1]))  # a range: its end
    # "\b" keeps click from re-wrapping the lines into one paragraph.
    return "\b\nExit status:\n" + "\n".join(f"  {line}" for line in lines)


def refuse_foreign_root(host: Host, dry_run: bool, why: str) -> None:
    """Refuse a command that would act outside --root DIR unless it is a dry run. `why` is the caller's
    own reason, true for that command as called ("this machine's package manager would install ..."):
    each command acts differently (down without --toolkit runs no package manager)."""
    from gpunode.errors import UsageError
    from gpunode.host import SubprocessRunner

    if not dry_run and not host.is_real_root and isinstance(host.runner, SubprocessRunner):
        raise UsageError(
            f"--root {host.root} works with --dry-run only: {why}",
            "add --dry-run, or run gpunode inside that system (chroot, systemd-nspawn)",
        )


def confirm(yes: bool, what: str, warning: str | None = None) -> None:
    """Ask before a change that disrupts; --yes answers for automation. Declining exits 1 (the operator's
    choice, not an interruption)."""
    from gpunode import jsonout
    from gpunode.errors import ExitCode, UsageError

    if warning and not jsonout.requested():  # under --json, stdout is the one document (which says it)
        click.echo(f"warning: {warning}")
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(
            f"{what} changes this system (packages, configuration or services) and there is no terminal "
            "to confirm on",
            "add --yes to run it unattended (or --dry-run to see the plan)",
        )
    if not click.confirm("Go ahead?", default=False):
        click.echo("nothing was changed")
        raise click.exceptions.Exit(int(ExitCode.DECLINED))
