"""`gpunode plugin run` without click: the service's own command line, parsed from the plugin's option table.

The plugin is a long-lived process whose start-up is on the path to a node's GPUs being schedulable, and
click with gpunode's command tree costs it ~20 ms and ~1 MB that it never uses again. This parser takes
only what it fully understands - `plugin run` followed by the options of `plugin run --help`, each at most
once as given or with `=` - and answers None for anything else (--help, --show-config, --json, an unknown or
abbreviated option, a missing value, a --replicas that is not a plain number, a global option such as
--root before `plugin`): the click CLI then handles that command line exactly as before, with its errors.
tests/cli/test_plugin_argv.py checks that both parse every option to the same settings.

Imports nothing heavy itself: the plugin's modules are imported when it runs.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# `plugin run`'s own options that are not settings of the option table (PluginConfig).
_OWN = {"--config": "config", "--simulate": "simulate", "--status-file": "status_file"}


class RunArgs:
    # A plain class: dataclasses (and the inspect module it loads) would be imported before run() turns
    # the collector off.
    def __init__(self) -> None:
        self.config: str | None = None
        self.simulate: str | None = None
        self.status_file: str | None = None
        self.flags: dict[str, Any] = {}  # option name -> value, as the click command passes them


def parse(args: Sequence[str]) -> RunArgs | None:
    """The arguments after `plugin run`, or None when the click CLI must handle them."""
    from gpunode.plugin.config import OPTIONS, is_switch

    values: dict[str, str] = {}  # --flag -> option name, for options that take a value
    switches: dict[str, tuple[str, bool]] = {}  # --flag / --no-flag -> (option name, value)
    for option in OPTIONS:
        if is_switch(option):
            name = option.flag.removeprefix("--")
            switches[f"--{name}"] = (option.name, True)
            switches[f"--no-{name}"] = (option.name, False)
        else:
            values[option.flag] = option.name
    parsed = RunArgs()
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in switches:
            name, on = switches[arg]
            parsed.flags[name] = on
            continue
        flag, eq, value = arg.partition("=")
        if flag not in values and flag not in _OWN:
            return None  # --help, --show-config, an unknown option, a positional argument: click's
        if not eq:
            if i >= len(args) or args[i].startswith("-"):
                return None  # no value (or one click might read otherwise): click says what is wrong
            value = args[i]
            i += 1
        if flag in _OWN:
            setattr(parsed, _OWN[flag], value)
        elif values[flag] == "replicas":
            if not (value.isascii() and value.isdigit() and len(value) <= 9):
                # click's type decides what else is a number, and words the error (int() itself refuses
                # over 4,300 digits with a ValueError)
                return None
            parsed.flags["replicas"] = int(value)
        else:
            parsed.flags[values[flag]] = value
    return parsed


# A fix for the option checks that say what is wrong but not what to give instead (their messages serve the
# config file and the environment too, where the key is named differently), by the check's name.
_FIXES = {
    "_replicas": "give a whole number from 1 to 1024",
    "_listen_address": 'give HOST:PORT with a port from 1 to 65535, e.g. "127.0.0.1:9402"',
    "_seconds": "give a number of seconds, 0 or more",
    "_xids": "give Xid numbers separated by commas, e.g. 13,31",
    "_cdi_kind": "give a CDI kind such as nvidia.com/gpu",
    "_annotation_prefix": "give a prefix such as cdi.k8s.io/",
}


def check_flags(flags: Mapping[str, Any]) -> None:
    """Refuse a bad flag value as a usage error (exit 2), before anything else is tried, in the form click
    gives its own (gpunode/cli/main.py): "plugin run: Invalid value for '--replicas': ..." and a fix.

    The same checks as the config file and the environment, whose bad values stay config errors (exit 4);
    load_config checks the flags again and then finds them good. Both ways in call this: the fast parser
    above and the click command, so that both answer alike.
    """
    from gpunode.errors import ConfigError, UsageError
    from gpunode.plugin.config import BY_NAME

    for name, value in flags.items():
        if value is None:
            continue
        option = BY_NAME[name]
        try:
            option.parse(value, option.flag)
        except ConfigError as err:
            # The check begins its message with the `where` it was given: the flag, named once below.
            detail = err.message.removeprefix(option.flag).removeprefix(": ")
            fix = err.fix or _FIXES.get(getattr(option.parse, "__name__", ""))
            raise UsageError(
                f"plugin run: Invalid value for '{option.flag}': {detail}",
                f"{fix} (see `gpunode plugin run --help`)" if fix else "see `gpunode plugin run --help`",
            ) from None


def run(args: Sequence[str]) -> None:
    """Run the plugin for `gpunode plugin run ARGS` and exit, or return if the click CLI must take them."""
    import gc

    # The cyclic collector off while the plugin imports (~8 % of its start: the imports allocate many
    # objects and no garbage worth collecting); runner turns it back on, with what start-up built frozen,
    # before the plugin starts serving.
    gc.disable()
    parsed = parse(args)
    if parsed is None:
        gc.enable()
        return
    from gpunode.errors import ExitCode, GpunodeError

    debug = os.environ.get("GPUNODE_DEBUG") == "1"
    try:
        check_flags(parsed.flags)
        from gpunode.host import Host
        from gpunode.plugin.runner import run_plugin

        run_plugin(
            Host(),
            config_path=parsed.config,
            flags=parsed.flags,
            simulate=parsed.simulate,
            debug=debug,
            status_file=parsed.status_file,
        )
    except GpunodeError as err:
        # The CLI's error format (gpunode/cli/main.py): what is wrong, then the fix; the same exit code.
        if debug:
            import traceback

            traceback.print_exc()
        sys.stderr.write(f"gpunode: error: {err.message}\n")
        if err.fix:
            sys.stderr.write(f"  fix: {err.fix}\n")
        sys.exit(int(err.exit_code))
    except OSError as err:  # the OS refused what gpunode did not expect to fail: as the CLI says it
        what = f"{err.filename}: " if err.filename else ""
        sys.stderr.write(f"gpunode: error: {what}{err.strerror or err}\n")
        sys.stderr.write("  fix: check the file named, then run the command again\n")
        sys.exit(int(ExitCode.ERROR))
    except KeyboardInterrupt:
        sys.stderr.write("gpunode: interrupted\n")
        sys.exit(int(ExitCode.INTERRUPTED))
    except Exception as err:  # a bug: as the CLI says it
        if debug:
            import traceback

            traceback.print_exc()
        sys.stderr.write(
            f"gpunode: internal error: {type(err).__name__}: {err}\n"
            "  This is a bug in gpunode. Re-run with --debug for the traceback and report it.\n"
        )
        sys.exit(int(ExitCode.INTERNAL))
    # Stopped cleanly: servers stopped, sockets removed, status written, every log line out. Leave now,
    # without the interpreter's finalization: it joins every thread pool worker (gRPC's included) and a
    # worker still finishing a cancelled call could hold the exit until systemd's SIGKILL.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(ExitCode.OK))
