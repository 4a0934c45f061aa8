"""The one place values are put into the systemd units gpunode writes: escaped by systemd's own rules.

A value reaches a unit from the command line (`cdi install --driver-root`, `plugin install
--doctor-metrics`) or from where gpunode is installed. Written as it is, a newline would end the setting
and start another (`[Unit]` + `Wants=poweroff.target`), a `%` would be read as a specifier and a `$` as a
variable, and shell quoting (which systemd does not speak) would leave `'` in the argument. So every value
goes through one of these functions, each following systemd.syntax(7) / systemd.service(5) for the
kind of setting it fills, and checked against systemd 252's parser in the tests:

- `exec_start`: ExecStart= command lines. Specifiers are expanded over the whole line before it is split
  (`%` → `%%`, the program included); each word is unquoted with C escapes (`\\` → `\\\\`, `"` inside
  double quotes → `\\"`); `$VAR` is expanded in arguments (`$` → `$$`), not in the program path.
- `path_setting`: settings that hold one path (PathChanged=, ...): taken literally after specifier
  expansion (`%` → `%%`), and systemd ignores a path that is not absolute and normalised.

Control characters (newline, NUL, ...) and text that is not UTF-8 cannot be written into a unit at all:
they are refused as a usage error naming the option they came from.
"""

from __future__ import annotations

import posixpath
import re
import unicodedata
from collections.abc import Sequence

from gpunode.errors import GpunodeError, UsageError

# What may stand in an ExecStart= word unquoted and mean itself: anything else (a space, `;`, a quote) is
# quoted. `%` and `$` are plain here only after they were doubled (see _escape_word).
_PLAIN = re.compile(r"[A-Za-z0-9/._+:,=~@%$-]+")


def check_value(option: str, value: str) -> str:
    """`value` as given to `option`, refused when a unit cannot hold it: a control character (a newline
    would start a new setting, NUL ends it) or text that is not UTF-8 (undecodable bytes on the command
    line)."""
    bad = sorted({c for c in value if unicodedata.category(c) in ("Cc", "Cs")})
    if bad:
        what = ", ".join(
            repr(c) if unicodedata.category(c) == "Cc" else "bytes that are not UTF-8" for c in bad
        )
        raise UsageError(
            f"{option} {value[:200]!r} contains {what}, which a systemd unit cannot hold (a newline would "
            "start a new setting)",
            f"give {option} without control characters",
        )
    return value


def _escape_word(word: str) -> str:
    r"""One ExecStart= argument that systemd splits, unquotes and expands back to exactly `word`."""
    escaped = word.replace("%", "%%").replace("$", "$$")
    if word and _PLAIN.fullmatch(word):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_path(executable: str) -> str:
    """The program path as an ExecStart= word that systemd reads back as exactly `executable`.

    `$VAR` is not expanded in the program path (only in arguments), so `$` stays as is. `"`, `'`, `\\` and
    control characters are refused by systemd in a program path whatever the quoting ("Executable name
    contains special characters"): such a path is an error here, before anything is written.
    """
    bad = sorted({c for c in executable if c in "\"'\\" or unicodedata.category(c) in ("Cc", "Cs")})
    if bad or not executable.startswith("/"):
        what = "is not an absolute path" if not bad else "contains " + ", ".join(repr(c) for c in bad)
        raise GpunodeError(
            f"cannot run gpunode from {executable!r} under systemd: the path {what}, which a unit's "
            "ExecStart= cannot name",
            "install gpunode under a plain absolute path (./install.sh puts it in /usr/local), then run "
            "this again",
        )
    escaped = executable.replace("%", "%%")
    return escaped if _PLAIN.fullmatch(executable) else f'"{escaped}"'


def exec_start(executable: str, args: Sequence[str]) -> str:
    """The value of ExecStart= that runs `executable` with exactly these arguments. Callers check a value
    that came from an option with `check_value` first, so that a refusal names the option."""
    return " ".join([exec_path(executable), *(_escape_word(check_value("an argument", a)) for a in args)])


def absolute_path(option: str, path: str) -> str:
    """`path` checked for a unit and normalised (`//` and a trailing `/` dropped): absolute, without `.`
    or `..` (refused rather than resolved: which directory they mean depends on links only the host can
    resolve), without surrounding white space (systemd strips it from a setting)."""
    check_value(option, path)
    parts = path.split("/")
    if not path.startswith("/") or any(p in (".", "..") for p in parts):
        raise UsageError(
            f"{option} {path!r} is not an absolute path without '.' or '..'",
            # lstrip: normpath keeps a leading `//` (POSIX leaves its meaning open), and `/` + an absolute
            # path is one.
            f"give {option} as an absolute path, e.g. {posixpath.normpath('/' + path.lstrip('/'))}",
        )
    if path != path.strip():
        raise UsageError(
            f"{option} {path!r} begins or ends with white space, which systemd strips from a unit's setting",
            f"give {option} without the surrounding spaces",
        )
    return "/" + "/".join(p for p in parts if p)


def path_setting(option: str, path: str) -> str:
    """A path for a setting that holds one (PathChanged=): taken literally by systemd after specifiers
    are expanded (`%` doubled); a path that is not absolute and normalised would be ignored with only a
    warning in the journal, so it is refused or normalised here (`absolute_path`)."""
    return absolute_path(option, path).replace("%", "%%")
