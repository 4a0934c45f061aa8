"""The base of the tests' stateful stand-ins for a node's programs (systemctl, crio, a whole node).

gpunode.host.ScriptedRunner answers from a fixed table; a fake that keeps state (a unit that turns active
after some polls, a systemd that refuses `enable`) needs code, and each such fake used to write the Runner
protocol's `run(argv, *, timeout, env, input)` and the call record again. Here they are once: a fake says
only how its programs answer, in `answer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpunode.host import CommandResult


class FakeRunner:
    """A Runner (gpunode.host) that records every command in `calls`, in order, and answers it by
    `answer`. A dataclass subclass declares `calls` as a field (its own __init__ replaces this one)."""

    calls: list[tuple[str, ...]]

    def __init__(self) -> None:
        self.calls = []

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult:
        key = tuple(argv)
        self.calls.append(key)
        return self.answer(key)

    def answer(self, key: tuple[str, ...]) -> CommandResult:
        """The program's answer to the command `key` (argv as a tuple): a result, or an exception raised
        as the real runner raises it."""
        raise NotImplementedError(f"{type(self).__name__} does not answer {key}")


def done(argv: tuple[str, ...], stdout: str = "", returncode: int = 0, stderr: str = "") -> CommandResult:
    """What a program that ran answers: its exit status and output."""
    return CommandResult(argv, returncode, stdout, stderr)
