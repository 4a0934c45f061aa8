"""The root `gpunode` command, its global options, and the one place exceptions become exit codes.

Plain click, with explicit parameter types: typer's runtime coercion built a pydantic adapter for every
option (pydantic imported on every command, 45-50 ms and ~10 MB). Each command's module is imported only
when that command runs (or shows its help): `gpunode --help` lists them from the table below.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpunode.cli.common import Group, exit_codes
from gpunode.cli.state import COMPLETE_VAR, AppState, overrides
from gpunode.errors import ExitCode, GpunodeError

if TYPE_CHECKING:
    from gpunode.host import Host

# name: (module, attribute, the one-line help `gpunode --help` shows). In the order an operator meets
# them; tests/cli/test_main.py checks each line against the command's own help.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "doctor": (
        "gpunode.cli.doctor",
        "doctor",
        "Diagnose this node: driver, GPUs, container toolkit and runtimes, kubelet, device plugin.",
    ),
    "up": (
        "gpunode.cli.up",
        "up",
        "Make this a working GPU node: preflight, toolkit, container runtime, device plugin, labels.",
    ),
    "down": (
        "gpunode.cli.down",
        "down",
        "Undo `gpunode up` in reverse: plugin service, node capacity and labels, runtime configuration, "
        "and with --toolkit the toolkit.",
    ),
    "toolkit": (
        "gpunode.cli.toolkit",
        "app",
        "Install nvidia-container-toolkit from NVIDIA's signed repositories (apt, dnf/yum, zypper).",
    ),
    "configure-runtime": (
        "gpunode.cli.runtime",
        "configure_runtime",
        "Add the NVIDIA runtime to docker, containerd or CRI-O: atomically, with a backup and a way back.",
    ),
    "plugin": (
        "gpunode.cli.plugin",
        "app",
        "The embedded Kubernetes device plugin (deviceplugin v1beta1).",
    ),
    "cdi": (
        "gpunode.cli.cdi",
        "app",
        "The CDI (Container Device Interface) spec of this node's GPUs: generate it, list what the runtimes "
        "see, check it is current.",
    ),
    "node": (
        "gpunode.cli.node",
        "app",
        "Advertise this node's GPUs through the Kubernetes API (capacity and GPU feature discovery labels).",
    ),
    "dra": (
        "gpunode.cli.dra",
        "app",
        "Dynamic Resource Allocation (resource.k8s.io/v1): the kubelet plugin that serves this node's GPUs "
        "and the DeviceClasses that select them.",
    ),
    "completion": (
        "gpunode.cli.completion",
        "completion",
        "Print the shell completion script for bash, zsh or fish.",
    ),
    "version": (
        "gpunode.cli.version",
        "version",
        "Print gpunode's version and commit, and the versions of Python, pynvml and grpcio.",
    ),
}


class LazyGroup(Group):
    """The root group: commands come from COMMANDS, imported when one is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        import importlib

        module, attribute, _ = COMMANDS[cmd_name]
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):  # a wiring mistake, caught by the tests
            raise TypeError(f"{module}.{attribute} is not a click command")
        return command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0]
        if name not in COMMANDS and not name.startswith("-"):
            import difflib

            near = difflib.get_close_matches(name, list(COMMANDS), n=1)
            raise click.UsageError(
                f"no command {name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""), ctx
            )
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # From the table, not from the modules: listing the commands must not import them all.
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, _, help_) in COMMANDS.items()])


@click.group(
    "gpunode",
    cls=LazyGroup,
    help="Turn a Linux machine with NVIDIA GPUs into a working Kubernetes GPU node, and keep it working.",
    epilog=exit_codes(
        "0    success (doctor: nothing failed)",
        "1    the node is unhealthy (doctor found a failure), or a confirmation was declined",
        full=True,
    ),
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--debug", is_flag=True, help="Show tracebacks and internal detail on errors (also GPUNODE_DEBUG=1)."
)
@click.option(
    "--root",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    metavar="DIR",
    help="Read the host's files under DIR instead of / (an image or chroot). NVML still reads this "
    "machine's GPUs.",
)
@click.option("--no-color", is_flag=True, help="No colour in terminal output (also NO_COLOR=1).")
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, param, value: _print_version(ctx) if value else None,
    help="Show the version and the commit (or build) it was made from, and exit.",
)
@click.pass_context
def cli(ctx: click.Context, debug: bool, root: Path, no_color: bool) -> None:
    from gpunode.host import Host

    color = not no_color and not os.environ.get("NO_COLOR")  # no-color.org: set and not empty
    ctx.obj = AppState(host=overrides.get("host") or Host(root=root), debug=debug, color=color)


def _print_version(ctx: click.Context) -> None:
    # Only here (and in `gpunode version`) is git asked for the commit: never on an ordinary start.
    from gpunode.buildinfo import build
    from gpunode.host import Host

    click.echo(build(overrides.get("host") or Host()).line())
    ctx.exit(0)


def _help_width() -> int:
    """Help for a terminal fits it (at most 110 columns: longer lines are hard to read); help piped to a
    file or grep is not wrapped at all, so a grep finds an option's whole description."""
    if sys.stdout.isatty():
        import shutil

        return min(shutil.get_terminal_size().columns, 110)
    return 100_000


def _print_error(err: GpunodeError) -> None:
    jsonout = sys.modules.get("gpunode.jsonout")  # imported by a command that asked for JSON, if any
    if jsonout is not None:
        jsonout.fail(err)  # the command's --json document
    sys.stderr.write(f"gpunode: error: {err.message}\n")
    if err.fix:
        sys.stderr.write(f"  fix: {err.fix}\n")


def _usage_error(err: click.UsageError) -> GpunodeError:
    """click's usage errors in gpunode's own format: what is wrong, and where the command's help is."""
    from gpunode.errors import UsageError

    path = err.ctx.command_path if err.ctx is not None else "gpunode"
    # Which command refused it, before the message: "plugin run: Invalid value for '--replicas': ...".
    where = f"{path.removeprefix('gpunode').strip()}: " if path != "gpunode" else ""
    if isinstance(err, click.exceptions.NoArgsIsHelpError):
        # `gpunode` or `gpunode plugin` alone: the help, on stderr, is the most useful answer.
        sys.stderr.write(err.ctx.get_help() + "\n\n")
        return UsageError(f"{where}a command is needed", f"run one of the commands above (`{path} --help`)")
    message = " ".join(err.format_message().split())  # one line: "Choose from:" lists come on several
    message = message[:-1] if message.endswith(".") and not message.endswith("..") else message
    return UsageError(f"{where}{message}", f"see `{path} --help`")


def _invoke(args: list[str]) -> int:
    instruction = os.environ.get(COMPLETE_VAR)
    if instruction:
        from click.shell_completion import shell_complete

        return shell_complete(cli, {}, "gpunode", COMPLETE_VAR, instruction)
    width = _help_width()
    with cli.make_context("gpunode", args, terminal_width=width, max_content_width=width) as ctx:
        result: Any = cli.invoke(ctx)
    return result if isinstance(result, int) else int(ExitCode.OK)


def main(argv: list[str] | None = None, host: Host | None = None) -> int:
    """Run the CLI; every outcome ends here as an exit code from ExitCode."""
    overrides.clear()
    jsonout = sys.modules.get("gpunode.jsonout")  # not imported for nothing: only --json needs it
    if jsonout is not None:
        jsonout.reset()  # a JSON request belongs to one run (tests call main() many times in one process)
    if host is not None:
        overrides["host"] = host
    args = sys.argv[1:] if argv is None else list(argv)
    _stdout_at_start[:] = [_stdout_identity()]
    debug = "--debug" in args or os.environ.get("GPUNODE_DEBUG") == "1"
    try:
        code = _invoke(args)
    except click.exceptions.Exit as exit_:  # --help, --version, and a command's own exit status
        code = exit_.exit_code
    except click.UsageError as err:
        _print_error(_usage_error(err))
        return int(ExitCode.USAGE)
    except click.ClickException as err:  # click's others (a file it could not open): not a bug
        _print_error(GpunodeError(err.format_message(), "check the value given, then run the command again"))
        return int(ExitCode.ERROR)
    except SystemExit as exit_:
        code_ = exit_.code
        if _stdout_closed():
            return int(ExitCode.BROKEN_PIPE)
        if code_ is None:
            return int(ExitCode.OK)
        if isinstance(code_, int):
            return code_
        sys.stderr.write(f"{code_}\n")
        return int(ExitCode.ERROR)
    except GpunodeError as err:
        if debug:
            _print_traceback()
        _print_error(err)
        return int(err.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        sys.stderr.write("gpunode: interrupted\n")
        return int(ExitCode.INTERRUPTED)
    except OSError as err:
        # The output itself failed (a closed pipe, a full disk behind `>`), or the OS refused something
        # gpunode did not expect to fail: a one-line error, never "this is a bug".
        if err.errno == errno.EPIPE:
            _silence_stdout()
            return int(ExitCode.BROKEN_PIPE)
        if debug:
            _print_traceback()
        _print_error(_os_error(err))
        return int(ExitCode.ERROR)
    except Exception as err:  # a bug: say so plainly, show the traceback only on request
        if debug:
            _print_traceback()
        sys.stderr.write(
            f"gpunode: internal error: {type(err).__name__}: {err}\n"
            "  This is a bug in gpunode. Re-run with --debug for the traceback and report it.\n"
        )
        return int(ExitCode.INTERNAL)
    if _stdout_closed():
        return int(ExitCode.BROKEN_PIPE)
    return code


def _print_traceback() -> None:
    import traceback  # only for --debug: not on every start-up

    traceback.print_exc()


def _os_error(err: OSError) -> GpunodeError:
    what = f"{err.filename}: " if err.filename else ""
    if err.errno in (errno.ENOSPC, errno.EIO) and not err.filename:
        return GpunodeError(
            f"cannot write the output: {err.strerror}", "send the output where there is room (or to a file)"
        )
    if err.errno == errno.EROFS:
        return GpunodeError(
            f"{what}the filesystem is read-only", "remount it read-write, or run where gpunode may write"
        )
    return GpunodeError(f"{what}{err.strerror or err}", "check the file named, then run the command again")


def _stdout_identity() -> tuple[int, int] | None:
    try:
        st = os.fstat(1)
    except OSError:
        return None
    return st.st_dev, st.st_ino


_stdout_at_start: list[tuple[int, int] | None] = []


def _stdout_closed() -> bool:
    # rich swallows EPIPE itself and exits 1 after putting /dev/null on descriptor 1 (click, where it runs
    # its own main, leaves a PacifyFlushWrapper on sys.stdout). A closed pipe is not a failure of the
    # command, and 1 would read as "unhealthy".
    if type(sys.stdout).__name__ == "PacifyFlushWrapper":
        return True
    return bool(_stdout_at_start) and _stdout_identity() != _stdout_at_start[-1]


def _silence_stdout() -> None:
    # The reader is gone: later flushes (at exit too) must not raise again (Python's documented recipe).
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> None:
    """The console script: flush the output here, where a full disk or a closed pipe can still be said."""
    code = main()
    try:
        sys.stdout.flush()
    except OSError as err:
        if err.errno == errno.EPIPE:
            _silence_stdout()
            code = int(ExitCode.BROKEN_PIPE)
        else:
            _print_error(_os_error(err))
            _silence_stdout()
            code = int(ExitCode.ERROR)
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
