"""The host seam: every file gpunode reads or writes, and every command it runs, goes through a Host.

A Host is a root path plus a command runner. Production uses Host() (root "/", real subprocesses); tests
use Host(root=tmp_path, runner=a scripted runner) and see every read, write and command. NVML is the one
exception: it is the process's own shared library, not a file under the root.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from gpunode.errors import CommandFailed, ConcurrentChange, ConfigError, NotFound, PermissionDenied

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_TIMEOUT = 10.0
MAX_READ = 8 * 2**20  # far above any configuration file gpunode reads
STREAM_KEEP = 200  # lines of a streamed command's output kept for its error message


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def check(self) -> CommandResult:
        """Raise CommandFailed (with the command and the end of its output) unless it exited 0."""
        if self.returncode != 0:
            tail = "\n".join((self.stderr or self.stdout).strip().splitlines()[-10:])
            raise CommandFailed(
                f"`{' '.join(self.argv)}` exited with status {self.returncode}"
                + (f":\n{tail}" if tail else ""),
            )
        return self


class Runner(Protocol):
    """Runs a command given as an argument list (never a shell string)."""

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult: ...


def _with_program_path(argv: Sequence[str]) -> Sequence[str]:
    """argv with its program found as Host.which finds it: the caller's PATH, then the standard directories
    (sbin included), so that cron's or Ansible's short PATH runs the same program as a login shell."""
    if not argv or "/" in argv[0]:
        return argv
    import shutil  # here, not at the top: the device plugin never runs a command (its start and memory)

    path = os.pathsep.join([*os.environ.get("PATH", "").split(os.pathsep), *DEFAULT_PATH.split(":")])
    try:
        found = shutil.which(argv[0], path=path)
    except OSError:
        found = None
    return argv if found is None else [found, *argv[1:]]


class SubprocessRunner:
    """The real runner. A program that cannot start or runs past its timeout raises CommandFailed."""

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult:
        import subprocess  # here, not at the top: the device plugin never runs a command

        start = time.monotonic()
        full_env = None if env is None else {**os.environ, **env}
        argv = _with_program_path(argv)
        try:
            proc = subprocess.run(
                list(argv),
                capture_output=True,
                # Programs print what they like (a journal line with a Latin-1 byte, a path that is not
                # UTF-8): a strict decode would turn that into a crash half-way through a change. U+FFFD
                # stands for such a byte, in parsed output and in messages alike.
                encoding="utf-8",
                errors="replace",
                timeout=timeout,
                env=full_env,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
                check=False,
            )
        except FileNotFoundError as exc:
            raise CommandFailed(f"`{argv[0]}` is not installed (not found on PATH)") from exc
        except PermissionError as exc:
            raise CommandFailed(f"`{argv[0]}` cannot be executed: permission denied") from exc
        except subprocess.TimeoutExpired as exc:
            raise CommandFailed(
                f"`{' '.join(argv)}` did not finish within {timeout:g} s and was stopped",
            ) from exc
        return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)

    def stream(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        on_line: Callable[[str], None],
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run a long command, handing each line of its output (stdout and stderr merged, as a terminal
        shows them) to `on_line` as it comes. The result's stdout holds the last STREAM_KEEP lines."""
        import subprocess

        start = time.monotonic()
        full_env = None if env is None else {**os.environ, **env}
        argv = _with_program_path(argv)
        try:
            proc = subprocess.Popen(
                list(argv),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                encoding="utf-8",  # as run(): whatever the locale, a byte that is not UTF-8 is U+FFFD
                errors="replace",
            )
        except FileNotFoundError as exc:
            raise CommandFailed(f"`{argv[0]}` is not installed (not found on PATH)") from exc
        except PermissionError as exc:
            raise CommandFailed(f"`{argv[0]}` cannot be executed: permission denied") from exc
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            proc.kill()

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()
        kept: collections.deque[str] = collections.deque(maxlen=STREAM_KEEP)
        try:
            assert proc.stdout is not None  # noqa: S101 (stdout=PIPE above)
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                kept.append(line)
                on_line(line)
            returncode = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # interrupted (Ctrl-C): do not leave it running unseen
                proc.kill()
                proc.wait()
        if expired.is_set():
            raise CommandFailed(f"`{' '.join(argv)}` did not finish within {timeout:g} s and was stopped")
        return CommandResult(tuple(argv), returncode, "\n".join(kept), "", time.monotonic() - start)


@dataclass
class ScriptedRunner:
    """A runner for tests and dry runs: records every command and answers from a table.

    `responses` maps an argv prefix (tuple) to a CommandResult, or to an exception to raise; the
    longest matching prefix wins. A command with no answer behaves like a program that is not installed.
    """

    responses: dict[tuple[str, ...], CommandResult | Exception] = field(default_factory=dict)
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def answer(self, argv: Sequence[str], stdout: str = "", returncode: int = 0, stderr: str = "") -> None:
        self.responses[tuple(argv)] = CommandResult(tuple(argv), returncode, stdout, stderr)

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
        for n in range(len(key), 0, -1):
            found = self.responses.get(key[:n])
            if found is None:
                continue
            if isinstance(found, Exception):
                raise found
            return CommandResult(key, found.returncode, found.stdout, found.stderr)
        raise CommandFailed(f"`{argv[0]}` is not installed (not found on PATH)")


@dataclass(frozen=True)
class WriteOutcome:
    path: Path
    changed: bool
    backup: Path | None = None


class _Unchecked:
    """The `expect` of a write that does not check what it replaces."""


UNCHECKED = _Unchecked()


class Host:
    """One machine as gpunode sees it: files under `root`, commands through `runner`."""

    def __init__(
        self,
        root: str | os.PathLike[str] = "/",
        runner: Runner | None = None,
        env: Mapping[str, str] | None = None,
        euid: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.runner: Runner = runner or SubprocessRunner()
        self.env: Mapping[str, str] = os.environ if env is None else env
        self._euid = euid

    @property
    def is_real_root(self) -> bool:
        return self.root == Path("/")

    @property
    def commands_reach_root(self) -> bool:
        """Whether the commands this Host runs are the programs of the system under its root.

        On the real root they are. Under --root R the real runner runs this machine's programs, not R's:
        gpunode then runs nothing that acts (a restart, an enable) and probes R's own binaries by their
        path in R. A runner that answers for R itself (the scripted node of tests) reaches R.
        """
        return self.is_real_root or not isinstance(self.runner, SubprocessRunner)

    @property
    def offline(self) -> bool:
        """The other side of commands_reach_root, where a step is skipped: under --root DIR with this
        machine's programs as the runner, a command that acts (systemctl enable, start, a restart) would act
        on this machine, not on the system in DIR, so none is run."""
        return not self.commands_reach_root

    @property
    def euid(self) -> int:
        return os.geteuid() if self._euid is None else self._euid

    def path(self, host_path: str | os.PathLike[str], *, follow_last: bool = True) -> Path:
        """The local path of `host_path` (an absolute path on the host) under this Host's root.

        Under a root other than /, symlinks are resolved the way the host would see them (absolute
        targets are host paths), so nothing read or written ever escapes the root.
        """
        p = PurePosixPath(host_path)
        if not p.is_absolute():
            raise ValueError(f"host paths are absolute, got {host_path!r}")
        if self.is_real_root:
            return Path(p)
        return self.root.joinpath(*self._resolve_parts(p, follow_last))

    def canonical(self, host_path: str) -> str:
        """The one name of the file `host_path` reaches: `//`, `/./`, `..` and every symlink resolved.

        Records, backups and locks key a file by this name, so the same file reached through a link, its
        target or an odd spelling is one file with one original. A part that does not exist yet is kept
        as spelled (a drop-in about to be created).
        """
        p = PurePosixPath(host_path)
        if not p.is_absolute():
            raise ValueError(f"host paths are absolute, got {host_path!r}")
        if self.is_real_root:
            return os.path.realpath(p)
        return "/" + "/".join(self._resolve_parts(p, True))

    def dangling_link(self, host_path: str) -> str | None:
        """The target of `host_path` when it is a symbolic link to nothing (None otherwise)."""
        try:
            link = self.path(host_path, follow_last=False)
            if not link.is_symlink():
                return None
            target = self.path(host_path)
        except (OSError, ConfigError):
            return None
        if target.exists():
            return None
        return os.readlink(link)

    def refuse_dangling_link(self, host_path: str) -> None:
        """A link to nothing is the operator's mistake to see, not a file for gpunode to create."""
        dangling = self.dangling_link(host_path)
        if dangling is not None:
            raise NotFound(
                f"{host_path} is a symbolic link to {dangling}, which does not exist; gpunode writes "
                "through links and never replaces one",
                f"create {dangling}, or replace the link {host_path} with a regular file, then run the "
                "command again",
            )

    def _resolve_parts(self, p: PurePosixPath, follow_last: bool) -> list[str]:
        resolved: list[str] = []
        pending = list(p.parts[1:])
        hops = 0
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            local = self.root.joinpath(*resolved, part)
            if (pending or follow_last) and local.is_symlink():
                hops += 1
                if hops > 40:  # the kernel's own limit
                    raise ConfigError(f"{p}: too many levels of symbolic links")
                target = PurePosixPath(os.readlink(local))
                if target.is_absolute():
                    resolved = []
                pending = [*target.parts[1 if target.is_absolute() else 0 :], *pending]
                continue
            resolved.append(part)
        return resolved

    # -- reading -------------------------------------------------------------------------------
    # The predicates answer False for whatever cannot be looked at (permission, link loops): a
    # diagnosis must go on. The reads below say precisely what is wrong.

    def _stat(self, host_path: str, *, follow: bool = True) -> os.stat_result | None:
        try:
            local = self.path(host_path, follow_last=follow)
            return local.stat() if follow else local.lstat()
        except (OSError, ConfigError):
            return None

    def exists(self, host_path: str) -> bool:
        return self._stat(host_path) is not None

    def is_dir(self, host_path: str) -> bool:
        st = self._stat(host_path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def is_file(self, host_path: str) -> bool:
        st = self._stat(host_path)
        return st is not None and stat.S_ISREG(st.st_mode)

    def is_symlink(self, host_path: str) -> bool:
        st = self._stat(host_path, follow=False)
        return st is not None and stat.S_ISLNK(st.st_mode)

    def is_socket(self, host_path: str) -> bool:
        st = self._stat(host_path)
        return st is not None and stat.S_ISSOCK(st.st_mode)

    def is_char_device(self, host_path: str) -> bool:
        st = self._stat(host_path)
        return st is not None and stat.S_ISCHR(st.st_mode)

    def listdir(self, host_path: str) -> list[str]:
        """Names in a directory, sorted; [] when it does not exist or is not a directory."""
        try:
            return sorted(os.listdir(self.path(host_path)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except PermissionError as exc:
            raise PermissionDenied(
                f"cannot list {host_path}: permission denied", "run gpunode as root (sudo)"
            ) from exc
        except OSError as exc:
            raise ConfigError(f"cannot list {host_path}: {exc.strerror or exc}") from exc

    def read_text(self, host_path: str) -> str:
        """Read a text file. Missing, unreadable, not a regular file, too large, or not UTF-8: each
        raises a clear error naming the file."""
        data = self._read_regular(host_path)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{host_path} is not a UTF-8 text file ({exc.reason} at byte {exc.start})"
            ) from exc

    def _read_regular(self, host_path: str) -> bytes:
        """The bytes of a regular file of at most MAX_READ bytes: a FIFO would block the read (or wait
        for a writer on open), a device such as /dev/zero would never end."""
        local = self.path(host_path)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused just below.
            fd = os.open(local, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise NotFound(f"{host_path} does not exist") from exc
        except PermissionError as exc:
            raise PermissionDenied(
                f"cannot read {host_path}: permission denied", "run gpunode as root (sudo)"
            ) from exc
        except OSError as exc:
            raise ConfigError(f"cannot read {host_path}: {exc.strerror or exc}") from exc
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # directories, FIFOs, devices; /proc and /sys files are regular
            os.close(fd)
            what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(f"{host_path} is {what} where a file was expected")
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_READ + 1)
        if len(data) > MAX_READ:
            raise ConfigError(f"{host_path} is larger than {MAX_READ // 2**20} MiB; refusing to parse it")
        return data

    def read_text_if_exists(self, host_path: str) -> str | None:
        try:
            return self.read_text(host_path)
        except NotFound:
            return None

    def which(self, program: str) -> str | None:
        """The host path of `program` on the host's PATH, then in the standard directories, looked up under
        the root.

        The sbin directories are always searched: cron, Ansible and non-login shells run gpunode with a PATH
        that lacks them, and the same program must be found whoever calls. A directory that cannot be
        looked into (permission, a link loop) is skipped, as a shell skips it.
        """
        searched: list[str] = []
        for entry in [*self.env.get("PATH", DEFAULT_PATH).split(os.pathsep), *DEFAULT_PATH.split(":")]:
            directory = entry.rstrip("/") or "/"
            if not directory.startswith("/") or directory in searched:
                continue
            searched.append(directory)
            candidate = f"{directory.rstrip('/')}/{program}"
            try:
                local = self.path(candidate)
                if local.is_file() and os.access(local, os.X_OK):
                    return candidate
            except (OSError, ConfigError):
                continue
        return None

    # -- commands ------------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult:
        """Run a command (argument list). Non-zero exit is returned, not raised: call .check()."""
        return self.runner.run(argv, timeout=timeout, env=env, input=input)

    def run_together(
        self, commands: Sequence[tuple[Sequence[str], float]]
    ) -> list[CommandResult | CommandFailed]:
        """Run independent read-only commands (argument list, timeout) at the same time, through the same
        runner as run(): doctor asks containerd for its version and its config dump, ~20 ms and ~60 ms of
        process start each, and waiting for them one after the other was a quarter of its time. Each
        answer in the order given: the result, or the CommandFailed its run() raised."""

        def one(argv: Sequence[str], timeout: float) -> CommandResult | CommandFailed:
            try:
                return self.runner.run(argv, timeout=timeout)
            except CommandFailed as exc:
                return exc

        answers: list[CommandResult | CommandFailed | None] = [None] * len(commands)

        def into(n: int) -> None:
            answers[n] = one(*commands[n])

        # The first in this thread, the others in threads of their own (the runner waits on a process,
        # which frees the GIL); any other exception of a thread is its bug, and is raised here too.
        failures: list[BaseException] = []

        def guarded(n: int) -> None:
            try:
                into(n)
            except BaseException as exc:  # handed to the caller's thread below
                failures.append(exc)

        threads = [threading.Thread(target=guarded, args=(n,), daemon=True) for n in range(1, len(commands))]
        for thread in threads:
            thread.start()
        try:
            if commands:
                into(0)
        finally:
            for thread in threads:
                thread.join()
        if failures:
            raise failures[0]
        return [a for a in answers if a is not None]

    def stream(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        on_line: Callable[[str], None],
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run a long command (a package manager), showing its output as it comes. Runners that cannot
        stream (the scripted ones of tests and dry runs) run it whole and replay the lines."""
        stream = getattr(self.runner, "stream", None)
        if stream is not None:
            result: CommandResult = stream(argv, timeout=timeout, on_line=on_line, env=env)
            return result
        result = self.runner.run(argv, timeout=timeout, env=env)
        for line in (result.stdout + result.stderr).splitlines():
            on_line(line)
        return result

    # -- writing -------------------------------------------------------------------------------

    def write_file(
        self,
        host_path: str,
        content: str | bytes,
        *,
        mode: int = 0o644,
        backup_to: str | None = None,
        make_parents: bool = False,
        temp_dir: str | None = None,
        exact_mode: bool = False,
        expect: str | bytes | _Unchecked | None = UNCHECKED,
    ) -> WriteOutcome:
        """Replace a file atomically.

        temp file in the same directory → fsync → rename → fsync the directory, so a crash leaves either
        the old or the new file, never half of one. A symlinked path is written through to its target (on
        the real root too: a link is never replaced by a file); a link to nothing is refused. The existing
        file's mode, owner and extended attributes (ACLs, SELinux label) are kept and `mode` is for new
        files, unless `exact_mode`: a file that belongs to gpunode (a unit, a keyring) gets `mode` and the
        caller's owner whatever was there. Identical content is not rewritten (same bytes, same mtime).
        With `backup_to` (a host path), the original is first copied there, atomically too, unless a
        backup is already there: the backup is always the file as it was before gpunode's first change.

        `expect` is the content the caller planned from (None: no file). Under the lock, and again right
        before the rename, the file must still be that; otherwise another program changed it meanwhile and
        ConcurrentChange is raised with nothing written.

        `temp_dir` (a host path on the same filesystem) holds the temp file instead of the target's own
        directory: for a directory a runtime reads whole (crio.conf.d), where a temp file left by a killed
        process would be read as configuration. Temp files left by an earlier killed run are removed.
        """
        data = content.encode("utf-8") if isinstance(content, str) else content
        expected = expect.encode("utf-8") if isinstance(expect, str) else expect
        self.refuse_dangling_link(host_path)
        target = self._write_target(host_path)  # every symlink on the way resolved, never leaving the root
        directory = target.parent
        if target.is_dir():
            raise ConfigError(f"{host_path} is a directory where a file was expected")
        if make_parents and not directory.exists():
            self.make_dirs(str(PurePosixPath(self.canonical(host_path)).parent))
        if not directory.is_dir():
            parent = str(PurePosixPath(host_path).parent)
            raise NotFound(f"cannot write {host_path}: directory {parent} does not exist")
        tmp_directory = self.path(temp_dir) if temp_dir is not None else directory
        with _locked_directory(directory, host_path):
            _remove_stale_temps(target, {directory, tmp_directory})
            old, st = _read_current(target, host_path)
            if not isinstance(expected, _Unchecked) and old != expected:
                raise _changed_meanwhile(host_path)
            if old == data and (not exact_mode or st is None or _has_mode(st, mode, self.euid)):
                return WriteOutcome(target, changed=False)
            backup: Path | None = None
            if old is not None and st is not None and backup_to is not None:
                self.make_dirs(str(PurePosixPath(backup_to).parent), mode=0o700)
                backup = self.path(backup_to)
                _remove_stale_temps(backup, {backup.parent})
                if not backup.exists():
                    _atomic_write(backup, old, st.st_mode, st.st_uid, st.st_gid, attrs_from=target)
            if exact_mode:
                new_mode, uid, gid = mode, self.euid, os.getegid()
            elif st is not None:
                new_mode, uid, gid = st.st_mode, st.st_uid, st.st_gid
            else:
                new_mode, uid, gid = mode, None, None

            def still_as_planned() -> None:
                if not isinstance(expected, _Unchecked) and _read_current(target, host_path)[0] != expected:
                    raise _changed_meanwhile(host_path)

            _atomic_write(
                target,
                data,
                new_mode,
                uid,
                gid,
                tmp_directory=tmp_directory,
                attrs_from=target if st is not None else None,
                before_rename=still_as_planned,
            )
            return WriteOutcome(target, changed=True, backup=backup)

    def _write_target(self, host_path: str) -> Path:
        # On the real root the kernel would resolve links on open, but a rename replaces the link itself:
        # resolve it here, as path() does under another root.
        if self.is_real_root:
            return Path(os.path.realpath(host_path))
        return self.path(host_path)

    def read_bytes(self, host_path: str) -> bytes | None:
        """A file's exact bytes (to compare byte for byte); None when it does not exist. The guards of
        read_text: a FIFO, a device (/dev/zero) or a file over MAX_READ is refused, never read."""
        try:
            return self._read_regular(host_path)
        except NotFound:
            return None

    def remove_file(self, host_path: str) -> bool:
        """Delete a file (durably: the directory is fsynced). False when it was not there.

        A symbolic link is never deleted: it is the operator's, and a link gpunode wrote through still
        points at the file that was put back."""
        target = self.path(host_path, follow_last=False)
        if target.is_symlink():
            raise ConfigError(
                f"{host_path} is a symbolic link; gpunode does not remove links",
                f"remove {host_path} by hand if it should go",
            )
        try:
            with _permission("remove", host_path):
                if target.parent.is_dir():
                    with _locked_directory(target.parent, host_path):
                        _remove_stale_temps(target, {target.parent})  # left by a write killed midway
                target.unlink()
        except FileNotFoundError:
            return False
        except IsADirectoryError as exc:
            raise ConfigError(f"{host_path} is a directory where a file was expected") from exc
        _fsync_directory(target.parent)
        return True

    def remove_empty_dir(self, host_path: str) -> bool:
        """Remove an empty directory (durably); False when it is gone already or not empty."""
        target = self.path(host_path, follow_last=False)
        try:
            with _permission("remove directory", host_path):
                target.rmdir()
        except OSError:  # gone already, or not empty (ENOTEMPTY): either way it stays as it is
            return False
        _fsync_directory(target.parent)
        return True

    def link_target(self, host_path: str) -> str | None:
        """Where the symbolic link `host_path` points, as written in it; None when it is not a link."""
        try:
            link = self.path(host_path, follow_last=False)
            return os.readlink(link) if link.is_symlink() else None
        except (OSError, ConfigError):
            return None

    def make_symlink(self, host_path: str, target: str) -> bool:
        """Create the symbolic link `host_path` -> `target` (a host path, as the system in the root will
        read it: an enabled unit's link in a .wants/ directory), its directory too; durably. False when
        that very link is there already; anything else in its place is an error, never replaced."""
        if self.link_target(host_path) == target:
            return False
        self.make_dirs(str(PurePosixPath(host_path).parent))
        link = self.path(host_path, follow_last=False)
        try:
            with _permission("create the link", host_path):
                os.symlink(target, link)
        except FileExistsError as exc:
            raise ConfigError(
                f"{host_path} exists and is not a link to {target}",
                f"move {host_path} away, then run the command again",
            ) from exc
        _fsync_directory(link.parent)
        return True

    def remove_symlink(self, host_path: str, target: str) -> bool:
        """Remove the symbolic link `host_path` only while it points at `target` (the link gpunode made, or
        `systemctl enable` would make); durably. False when it is not that link."""
        if self.link_target(host_path) != target:
            return False
        link = self.path(host_path, follow_last=False)
        with _permission("remove the link", host_path):
            link.unlink()
        _fsync_directory(link.parent)
        return True

    def make_dirs(self, host_path: str, *, mode: int = 0o755) -> None:
        try:
            with _permission("create directory", host_path):
                self.path(host_path).mkdir(parents=True, exist_ok=True, mode=mode)
        except FileExistsError as exc:
            raise ConfigError(f"{host_path} exists and is not a directory") from exc
        except NotADirectoryError as exc:
            raise ConfigError(
                f"cannot create directory {host_path}: a part of that path is a file, not a directory",
                "move that file away (or point gpunode at another directory), then run the command again",
            ) from exc

    def set_mode(self, host_path: str, mode: int) -> None:
        """chmod: for directories whose mode the umask must not decide (a sticky, world-writable one)."""
        with _permission("change the mode of", host_path):
            os.chmod(self.path(host_path), mode)

    @contextlib.contextmanager
    def lock(self, host_path: str) -> Iterator[None]:
        """Hold an exclusive lock (flock on `host_path`, created if needed) so that two gpunode runs that
        read, plan and write the same files cannot interleave."""
        self.make_dirs(str(PurePosixPath(host_path).parent))
        with _permission("open the lock", host_path):
            fd = os.open(self.path(host_path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _wait_for_lock(lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB), host_path, 120.0)
            yield
        finally:
            os.close(fd)


@contextlib.contextmanager
def _permission(action: str, host_path: str) -> Iterator[None]:
    """The one message for a refusal by the OS: what could not be done to which file, and the fix."""
    try:
        yield
    except PermissionError as exc:
        if os.geteuid() == 0 and exc.errno == errno.EPERM:
            # Root is refused only by an attribute: immutable or append-only (chattr +i / +a).
            raise PermissionDenied(
                f"cannot {action} {host_path}: operation not permitted, even to root",
                f"see `lsattr {host_path}`: an immutable or append-only attribute must be lifted first",
            ) from exc
        raise PermissionDenied(
            f"cannot {action} {host_path}: permission denied", "run gpunode as root (sudo)"
        ) from exc
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        raise _read_only(action, host_path) from exc


def _read_only(action: str, where: str) -> PermissionDenied:
    return PermissionDenied(
        f"cannot {action} {where}: the filesystem is read-only",
        "remount it read-write (or point gpunode at a writable root), then run the command again",
    )


@contextlib.contextmanager
def _locked_directory(directory: Path, host_path: str) -> Iterator[None]:
    """Serialise gpunode's writers in one directory (flock on the directory itself: no lock files left)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for_lock(lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB), host_path)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _wait_for_lock(try_lock: Callable[[], None], host_path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            try_lock()
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise CommandFailed(
                    f"another gpunode holds {host_path} and did not finish within {timeout:g} s",
                    "wait for it to finish, then run the command again",
                ) from None
            time.sleep(0.05)


TEMP_SUFFIX = ".gpunode-tmp"


def _changed_meanwhile(host_path: str) -> ConcurrentChange:
    return ConcurrentChange(
        f"{host_path} was changed by another program while gpunode was working on it; gpunode did not "
        "write it",
        "check what changed it, then run the command again (it plans from the file as it is then)",
    )


def _read_current(target: Path, host_path: str) -> tuple[bytes | None, os.stat_result | None]:
    try:
        with open(target, "rb") as fh:
            return fh.read(), os.fstat(fh.fileno())
    except FileNotFoundError:
        return None, None
    except PermissionError as exc:
        raise PermissionDenied(
            f"cannot read {host_path}: permission denied", "run gpunode as root (sudo)"
        ) from exc


def _has_mode(st: os.stat_result, mode: int, uid: int) -> bool:
    return stat.S_IMODE(st.st_mode) == stat.S_IMODE(mode) and st.st_uid == uid


def _copy_xattrs(source: Path, fd: int, target: Path) -> None:
    """Extended attributes of `source` onto the open file `fd`: POSIX ACLs (system.posix_acl_access), the
    SELinux label (security.selinux), capabilities, user attributes. A filesystem without them has none
    to keep; one that has them and refuses a copy stops the write rather than drop them silently."""
    try:
        names = os.listxattr(source)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.ENOENT):
            return
        raise
    for name in names:
        try:
            value = os.getxattr(source, name)
            os.setxattr(fd, name, value)
        except OSError as exc:
            raise PermissionDenied(
                f"cannot keep the extended attribute {name} of {target}: {exc.strerror or exc}",
                "run gpunode as root, on a filesystem that supports the attribute",
            ) from exc


def _remove_stale_temps(target: Path, directories: set[Path]) -> None:
    # Only temps for this very file: their writer held the same directory lock we hold now.
    for directory in directories:
        for stale in directory.glob(f".{target.name}.*{TEMP_SUFFIX}"):
            with contextlib.suppress(OSError):
                stale.unlink()


def _atomic_write(
    target: Path,
    data: bytes,
    mode: int,
    uid: int | None,
    gid: int | None,
    *,
    tmp_directory: Path | None = None,
    attrs_from: Path | None = None,
    before_rename: Callable[[], None] | None = None,
) -> None:
    import tempfile  # with shutil, bz2, lzma, random: not on every command's start, nor the plugin's

    directory = target.parent
    tmp_dir = tmp_directory or directory
    try:
        fd, tmp_name = tempfile.mkstemp(dir=tmp_dir, prefix=f".{target.name}.", suffix=TEMP_SUFFIX)
    except PermissionError as exc:
        raise PermissionDenied(
            f"cannot write in {directory}: permission denied", "run gpunode as root (sudo)"
        ) from exc
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise _read_only("write in", str(directory)) from exc
        raise
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if uid is not None and gid is not None:
                # Only root may give a file away; a non-root writer already owns what it may write.
                with contextlib.suppress(PermissionError):
                    os.fchown(fh.fileno(), uid, gid)
            if attrs_from is not None:
                _copy_xattrs(attrs_from, fh.fileno(), target)
            # After the ACL: setting system.posix_acl_access rewrites the group bits from its mask.
            os.fchmod(fh.fileno(), stat.S_IMODE(mode))
            os.fsync(fh.fileno())
        if before_rename is not None:
            before_rename()
        try:
            os.rename(tmp, target)
        except PermissionError as exc:
            if os.geteuid() == 0:
                raise PermissionDenied(
                    f"cannot replace {target}: operation not permitted, even to root",
                    f"see `lsattr {target}`: an immutable or append-only attribute must be lifted first",
                ) from exc
            raise PermissionDenied(
                f"cannot replace {target}: permission denied", "run gpunode as root (sudo)"
            ) from exc
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            tmp.unlink()  # another filesystem after all: the target's own directory will do
            _atomic_write(target, data, mode, uid, gid, attrs_from=attrs_from, before_rename=before_rename)
            return
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise CommandFailed(f"no space left on the device to write {target}") from exc
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    # The rename or unlink is durable only once the directory entry itself is on disk.
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
