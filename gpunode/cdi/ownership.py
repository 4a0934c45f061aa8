"""Which spec files gpunode wrote, so that `cdi generate` (and the plugin, which regenerates gpunode's spec)
never replaces another tool's: `--output /etc/cdi/nvidia.yaml` would otherwise silently overwrite
nvidia-ctk's spec, and a spec path that is a link to /etc/important.conf would overwrite the link's target.

A spec is gpunode's when its text starts with gpunode's header (YAML: `# Written by gpunode ...`), or when
the record (/var/lib/gpunode/cdi-specs.json, by canonical path) says gpunode last wrote exactly these bytes
(JSON has no comments, so the record is how its JSON specs are known). Anything else is replaced only with
`--force`, which first copies it to /var/lib/gpunode/backups/<path>.<sha256 prefix> (named by content,
so a later forced write never overwrites an earlier backup) and records where. (gpunode before issue 23
used /var/lib/gpunode/backup/cdi/: those backups are recorded by their full path and still found.)
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any

from gpunode.errors import ConfigError, GpunodeError
from gpunode.host import MAX_READ, Host

MARKER = "# Written by gpunode"  # the first line of every YAML spec gpunode writes (generate.py's header)
RECORD = "/var/lib/gpunode/cdi-specs.json"
BACKUP_DIR = "/var/lib/gpunode/backups"  # where every gpunode command keeps the files it replaced
FORMAT_VERSION = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Current:
    """What is at a spec path before gpunode writes it."""

    data: bytes | None  # None: nothing there
    ours: bool  # gpunode's header or its record says gpunode wrote these bytes
    exists: bool


def refuse_escaping_link(host: Host, path: str) -> None:
    """A spec path that is a link is written through (as every file gpunode writes), but only to a file in the
    same directory: a link out of the spec directory (to /etc/important.conf) is refused, --force or not."""
    if not host.is_symlink(path):
        return
    directory = posixpath.dirname(path) or "/"
    try:
        target_dir = posixpath.dirname(host.canonical(path))
        spec_dir = host.canonical(directory)
    except (GpunodeError, OSError, ValueError) as exc:  # a link loop
        raise ConfigError(
            f"{path} is a symbolic link that cannot be followed ({exc})",
            f"replace the link {path} with a regular file (or remove it), then run the command again",
        ) from exc
    if target_dir != spec_dir:
        target = os.readlink(host.path(path, follow_last=False))
        raise ConfigError(
            f"{path} is a symbolic link to {target}, outside {directory}: gpunode writes a CDI spec only "
            "inside the spec directory, never through a link out of it",
            f"remove the link {path} (it is not gpunode's), or give --output a path that is not a link; then "
            "run the command again",
        )


def _load(host: Host) -> dict[str, Any]:
    """The record's files; an unreadable or damaged record knows nothing (its specs are then recognised by
    their header only, and are recorded again when next written)."""
    try:
        text = host.read_text_if_exists(RECORD)
        data = json.loads(text) if text else {}
    except (GpunodeError, ValueError, RecursionError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}


def current(host: Host, path: str) -> Current:
    """What is at `path` now, and whether gpunode wrote it."""
    host.refuse_dangling_link(path)
    if not host.exists(path):
        return Current(None, ours=False, exists=False)
    if not host.is_file(path):
        raise ConfigError(
            f"{path} exists and is not a regular file: not a CDI spec gpunode can replace",
            f"move {path} away, or give --output another path; then run the command again",
        )
    try:
        size = host.path(path).stat().st_size
    except OSError:
        size = MAX_READ + 1
    if size > MAX_READ:  # no spec is this large; and it could not be kept before being replaced
        raise ConfigError(
            f"{path} is larger than {MAX_READ // 2**20} MiB: not a CDI spec, and not replaced",
            f"move {path} away, or give --output another path; then run the command again",
        )
    data = host.read_bytes(path) or b""
    if data.startswith(MARKER.encode()):
        return Current(data, ours=True, exists=True)
    entry = _load(host).get(host.canonical(path))
    ours = isinstance(entry, dict) and entry.get("written_sha256") == sha256(data)
    return Current(data, ours=ours, exists=True)


def backup_path(host: Host, path: str, data: bytes) -> str:
    return f"{BACKUP_DIR}{host.canonical(path)}.{sha256(data)[:12]}"


def record(host: Host, path: str, written: bytes, backup: str | None) -> None:
    """Note that gpunode wrote `written` at `path` (and where the file it replaced was kept). The record is
    gpunode's own file: written atomically, readable by root only."""
    files = _load(host)
    key = host.canonical(path)
    entry: dict[str, Any] = files[key] if isinstance(files.get(key), dict) else {}
    backups = [b for b in entry.get("backups", []) if isinstance(b, str)]
    if backup is not None and backup not in backups:
        backups.append(backup)
    files[key] = {"written_sha256": sha256(written), "backups": backups}
    text = json.dumps({"version": FORMAT_VERSION, "files": files}, indent=2, sort_keys=True) + "\n"
    host.write_file(RECORD, text, mode=0o600, make_parents=True)


def backups(host: Host, path: str) -> list[str]:
    """The originals `--force` replaced at `path`, oldest first (for a way back: `cdi uninstall`, or by
    hand)."""
    entry = _load(host).get(host.canonical(path))
    return [b for b in entry.get("backups", []) if isinstance(b, str)] if isinstance(entry, dict) else []


def recorded(host: Host) -> list[str]:
    """Every spec path the record says gpunode wrote (canonical host paths)."""
    return sorted(str(k) for k in _load(host))


def forget(host: Host, path: str, backup: str | None) -> None:
    """`cdi uninstall` took the spec at `path` away (or put `backup` back in its place): its entry goes,
    except for any other backups it names, which stay recorded (never the only copy of anything lost)."""
    files = _load(host)
    key = host.canonical(path)
    entry = files.get(key)
    if entry is None:
        return
    left = (
        [b for b in entry.get("backups", []) if isinstance(b, str) and b != backup]
        if isinstance(entry, dict)
        else []
    )
    if left:
        files[key] = {"written_sha256": None, "backups": left}
    else:
        del files[key]
    text = json.dumps({"version": FORMAT_VERSION, "files": files}, indent=2, sort_keys=True) + "\n"
    host.write_file(RECORD, text, mode=0o600, make_parents=True)
