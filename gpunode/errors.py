"""The one exception hierarchy that reaches the user, and the exit codes it maps to.

A leaf module: everything may import it, it imports nothing of gpunode. Any exception that is not a
GpunodeError is a bug; the CLI shows it as an internal error (traceback only with --debug).
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit statuses; the README's table lists the same values."""

    OK = 0
    UNHEALTHY = 1  # the command ran, and what it checked is not healthy (doctor found a failure)
    DECLINED = 1  # the operator answered no to a confirmation: nothing was changed
    USAGE = 2  # a wrong flag or argument (click's own code for usage errors)
    ERROR = 3  # a gpunode error with no more specific code
    CONFIG = 4  # a file gpunode must read is malformed or of an unknown format
    PERMISSION = 5  # needs root, or the OS refused access
    NOT_FOUND = 6  # a file, program or device that is needed is missing
    NVML = 7  # the NVIDIA driver / NVML cannot be used
    COMMAND_FAILED = 8  # an external command failed or timed out
    API = 9  # the Kubernetes API refused or could not be reached
    INTERNAL = 70  # a bug in gpunode (EX_SOFTWARE)
    INTERRUPTED = 130  # Ctrl-C
    BROKEN_PIPE = 141  # the reader of the output went away (`| head -1`), as for a program SIGPIPE ends


class GpunodeError(Exception):
    """An error the user can act on: what went wrong, and the fix."""

    exit_code: ExitCode = ExitCode.ERROR
    # True when the host was left changed by the failing command (a rollback that could not finish): the
    # `changed` of its --json error document.
    changed: bool = False

    def __init__(self, message: str, fix: str | None = None, *, exit_code: ExitCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\nFix: {self.fix}"


class UsageError(GpunodeError):
    exit_code = ExitCode.USAGE


class ConfigError(GpunodeError):
    """A file is malformed: the message names the file (and line where known)."""

    exit_code = ExitCode.CONFIG


class UneditableToml(ConfigError):
    """A valid TOML file whose layout gpunode's TOML editor (tomlkit) cannot parse: it can be read, not
    edited in place."""


class PermissionDenied(GpunodeError):
    exit_code = ExitCode.PERMISSION


class NotFound(GpunodeError):
    exit_code = ExitCode.NOT_FOUND


class CommandFailed(GpunodeError):
    """An external command exited non-zero, could not start, or timed out."""

    exit_code = ExitCode.COMMAND_FAILED


class ConcurrentChange(GpunodeError):
    """A file changed between gpunode reading it and replacing it: nothing was written over it."""

    exit_code = ExitCode.ERROR


class ApiError(GpunodeError):
    """The Kubernetes API refused a request or could not be reached: one sentence saying which."""

    exit_code = ExitCode.API


class NvmlError(GpunodeError):
    """NVML (the NVIDIA management library) cannot be used; subclasses say why."""

    exit_code = ExitCode.NVML


class NvmlLibraryNotFound(NvmlError):
    pass


class DriverNotLoaded(NvmlError):
    pass


class NvmlNoPermission(NvmlError):
    pass


class GpuLost(NvmlError):
    pass
