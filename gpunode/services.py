"""systemd service state, read through the host seam."""

from __future__ import annotations

from collections.abc import Sequence

from gpunode.errors import CommandFailed
from gpunode.host import Host

SYSTEMCTL_TIMEOUT = 5.0


def systemd_running(host: Host) -> bool:
    # sd_booted(3): this directory exists only when systemd is PID 1.
    return host.is_dir("/run/systemd/system")


def service_states(host: Host, units: Sequence[str]) -> dict[str, str | None]:
    """`systemctl is-active` for several units in one call: unit → "active", "inactive", "failed", ...

    None for every unit when systemd is not running here or systemctl cannot answer (a container, a
    chroot): the caller then falls back to other evidence such as sockets.
    """
    unknown: dict[str, str | None] = dict.fromkeys(units)
    # Under --root this machine's systemctl would answer for this machine's units, not the root's.
    if not units or host.offline or not systemd_running(host) or host.which("systemctl") is None:
        return unknown
    try:
        result = host.run(["systemctl", "is-active", *units], timeout=SYSTEMCTL_TIMEOUT)
    except CommandFailed:
        return unknown
    lines = result.stdout.splitlines()
    if len(lines) != len(units):
        return unknown
    return {unit: line.strip() or None for unit, line in zip(units, lines, strict=True)}


def journal_tail(host: Host, unit: str, lines: int = 15) -> str:
    """The unit's last log lines as a paragraph to append to an error ("" when the journal cannot say)."""
    try:
        log = host.run(["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"], timeout=15)
    except CommandFailed:
        return ""
    text = log.stdout.strip()
    return f"\n{unit}'s last log lines:\n{text}" if log.ok and text else ""
