"""Read-only probes of a runtime's own program (`--version`, `dockerd --validate`): which binary, and where.

One rule for every probe, with and without --root: the program asked is the one that reads the files.
On the real root that is the installed program. Under --root R, gpunode runs nothing that acts on this
machine, and this machine's programs do not read R's files: a probe runs R's own binary (by its path in R)
when R has one, and otherwise the answer is "unknown (no PROGRAM in R)" and the caller decides the way
its docstring says, never by asking this machine's program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpunode.errors import CommandFailed
from gpunode.host import CommandResult, Host


@dataclass(frozen=True)
class Probe:
    argv: tuple[str, ...] | None  # what runs; None: nothing to run (no such program where it must be)
    where: str  # where gpunode looked, for the operator


def locate(host: Host, program: str) -> Probe:
    """How to run `program` as the system under the Host's root has it. `program` is a name looked up on
    PATH, or an absolute host path (k3s's embedded containerd)."""
    if host.commands_reach_root:
        if program.startswith("/"):
            found = program if host.is_file(program) else None
            where = "this machine" if host.is_real_root else f"{host.root}"
            return Probe((program,) if found else None, f"{program} on {where}" if found else f"no {program}")
        # The runner finds the program as Host.which would (PATH, then the sbin directories).
        return Probe((program,), f"{program} on this machine" if host.is_real_root else program)
    found = program if program.startswith("/") and host.is_file(program) else None
    if not program.startswith("/"):
        found = host.which(program)
    name = program.rsplit("/", 1)[-1]
    if found is None:
        return Probe(None, f"no {name} in {host.root}")
    return Probe((str(host.path(found)),), f"{found} in {host.root}")


def run(host: Host, program: str, args: Sequence[str], *, timeout: float) -> tuple[CommandResult | None, str]:
    """(the result, or None when there is nothing to run or it could not start; where it looked)."""
    probe = locate(host, program)
    if probe.argv is None:
        return None, probe.where
    try:
        return host.run([*probe.argv, *args], timeout=timeout), probe.where
    except CommandFailed:
        return None, probe.where
