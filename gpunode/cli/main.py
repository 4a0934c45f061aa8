"""The root `gpunode` app, its global options, and the one place exceptions become exit codes."""

from __future__ import annotations

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
    from gpunode.cli import doctor, node, plugin, runtime, toolkit, up

    app.command("doctor")(doctor.doctor)
    app.command("configure-runtime")(runtime.configure_runtime)
    app.command("up")(up.up)
    app.add_typer(plugin.app, name="plugin")
    app.add_typer(toolkit.app, name="toolkit")
    app.add_typer(node.app, name="node")


_register_commands()


def _print_error(err: GpunodeError) -> None:
    sys.stderr.write(f"gpunode: error: {err.message}\n")
    if err.fix:
        sys.stderr.write(f"  fix: {err.fix}\n")


def main(argv: list[str] | None = None, host: Host | None = None) -> int:
    """Run the CLI; every outcome ends here as an exit code from ExitCode."""
    _overrides.clear()
    if host is not None:
        _overrides["host"] = host
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args or os.environ.get("GPUNODE_DEBUG") == "1"
    try:
        # Standalone mode: typer itself reports usage errors (exit 2) and turns Ctrl-C into exit 130.
        app(args=args, prog_name="gpunode")
    except SystemExit as exit_:
        code = exit_.code
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
    except Exception as err:  # a bug: say so plainly, show the traceback only on request
        if debug:
            traceback.print_exc()
        sys.stderr.write(
            f"gpunode: internal error: {type(err).__name__}: {err}\n"
            "  This is a bug in gpunode. Re-run with --debug for the traceback and report it.\n"
        )
        return int(ExitCode.INTERNAL)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
