"""sd_notify: tell systemd the service is ready, what it is doing, and that it is alive.

The protocol is one datagram of newline-separated `KEY=value` lines to the unix socket named by
$NOTIFY_SOCKET (a leading "@" means the abstract namespace). Implemented here rather than taken from a
library: it is a dozen lines, python-systemd needs libsystemd's headers to build, and the small PyPI
wrappers (sdnotify) are unmaintained. Outside systemd ($NOTIFY_SOCKET unset) every call is a no-op, so
`gpunode plugin run` behaves the same in a terminal.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if address.startswith("@"):
            self.address = "\0" + address[1:]
        elif address.startswith("/"):
            self.address = address
        self.watchdog_interval = _watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str) -> bool:
        """Send `KEY=value` lines (READY="1", STATUS="...", WATCHDOG="1"); False if not under systemd."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={value.replace(chr(10), ' ')}" for key, value in fields.items())
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.sendto(message.encode(), self.address)
            except OSError:
                return False  # systemd went away or refused: nothing the service can do about it
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY="1", STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG="1")

    def stopping(self) -> bool:
        return self.send(STOPPING="1")


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """How often to ping: half of WatchdogSec, if systemd set it for this very process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2_000_000
