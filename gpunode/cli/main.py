"""The root `gpunode` app, its global options, and the one place exceptions become exit codes."""

from __future__ import annotations

import errno
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import typer

from gpunode import __version__
from gpunode.errors import ExitCode, GpunodeError
from gpunode.host import Host

app = typer.Typer(
    name="gpunode",
    help="Turn a Linux machine with NVIDIA GPUs into a working Kubernetes GPU node, and keep it working.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


# Set only by main(host=...): lets tests run the whole CLI against a temp root and a scripted runner.
_overrides: dict[str, Host] = {}


@dataclass(frozen=True)
class AppState:
    host: Host
    debug: bool


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"gpunode {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and internal detail on errors."),
    root: Path = typer.Option(
        Path("/"),
        "--root",
        help="Read the host's files under DIR instead of / (an image or chroot). NVML still reads this "
        "machine's GPUs.",
        metavar="DIR",
        file_okay=False,
        exists=True,
    ),
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    ctx.obj = AppState(host=_overrides.get("host") or Host(root=root), debug=debug)


def state(ctx: typer.Context) -> AppState:
    obj = ctx.find_root().obj
    if not isinstance(obj, AppState):  # _root sets it before any command runs
        raise RuntimeError("gpunode's root callback did not run")
    return obj


def _register_commands() -> None:
    from gpunode.cli import doctor, down, node, plugin, runtime, toolkit, up

    app.command("doctor")(doctor.doctor)
    app.command("configure-runtime")(runtime.configure_runtime)
    app.command("up")(up.up)
    app.command("down")(down.down)
    app.add_typer(plugin.app, name="plugin")
    app.add_typer(toolkit.app, name="toolkit")
    app.add_typer(node.app, name="node")


_register_commands()


def _print_error(err: GpunodeError) -> None:
    from gpunode import jsonout

    jsonout.fail(err)  # the command's --json document, when it asked for one
    sys.stderr.write(f"gpunode: error: {err.message}\n")
    if err.fix:
        sys.stderr.write(f"  fix: {err.fix}\n")


def main(argv: list[str] | None = None, host: Host | None = None) -> int:
    """Run the CLI; every outcome ends here as an exit code from ExitCode."""
    _overrides.clear()
    from gpunode import jsonout

    jsonout.reset()  # a JSON request belongs to one run (tests call main() many times in one process)
    if host is not None:
        _overrides["host"] = host
    args = sys.argv[1:] if argv is None else argv
    _stdout_at_start[:] = [_stdout_identity()]
    debug = "--debug" in args or os.environ.get("GPUNODE_DEBUG") == "1"
    try:
        # Standalone mode: typer itself reports usage errors (exit 2) and turns Ctrl-C into exit 130.
        app(args=args, prog_name="gpunode")
    except SystemExit as exit_:
        code = exit_.code
        if _stdout_closed():
            return int(ExitCode.BROKEN_PIPE)
        if code is None:
            return int(ExitCode.OK)
        if isinstance(code, int):
            return code
        sys.stderr.write(f"{code}\n")
        return int(ExitCode.ERROR)
    except GpunodeError as err:
        if debug:
            traceback.print_exc()
        _print_error(err)
        return int(err.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("gpunode: interrupted\n")
        return int(ExitCode.INTERRUPTED)
    except OSError as err:
        # The output itself failed (a closed pipe, a full disk behind `>`), or the OS refused something
        # gpunode did not expect to fail: a one-line error, never "this is a bug".
        if err.errno == errno.EPIPE:
            _silence_stdout()
            return int(ExitCode.BROKEN_PIPE)
        if debug:
            traceback.print_exc()
        _print_error(_os_error(err))
        return int(ExitCode.ERROR)
    except Exception as err:  # a bug: say so plainly, show the traceback only on request
        if debug:
            traceback.print_exc()
        sys.stderr.write(
            f"gpunode: internal error: {type(err).__name__}: {err}\n"
            "  This is a bug in gpunode. Re-run with --debug for the traceback and report it.\n"
        )
        return int(ExitCode.INTERNAL)
    return int(ExitCode.OK) if not _stdout_closed() else int(ExitCode.BROKEN_PIPE)


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
    # click and rich swallow EPIPE themselves and exit 1: click leaves its wrapper on sys.stdout, rich puts
    # /dev/null on descriptor 1. A closed pipe is not a failure of the command, and 1 would read as
    # "unhealthy".
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
