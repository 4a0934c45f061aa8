"""What gpunode changed in runtime configuration files, kept so that `--revert` can take it back.

For every file it changes, gpunode keeps the original under /var/lib/gpunode/backups/<path of the file>
(once, before its first change) and a record in /var/lib/gpunode/runtime-changes.json: whether the file
existed, the checksums of the original and of what gpunode last wrote, and the key-level edits. Backups
live away from the configuration directories on purpose: CRI-O applies every file in crio.conf.d, a
backup next to a drop-in included.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpunode.errors import ConfigError
from gpunode.host import Host
from gpunode.runtimes.edits import Edit

STATE_DIR = "/var/lib/gpunode"
RECORDS = f"{STATE_DIR}/runtime-changes.json"
BACKUP_DIR = f"{STATE_DIR}/backups"
LOCK = f"{STATE_DIR}/configure-runtime.lock"
FORMAT_VERSION = 1


def sha256(data: bytes | str | None) -> str | None:
    if data is None:
        return None
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()


def backup_path(host_path: str) -> str:
    return f"{BACKUP_DIR}{host_path}"


def remove_backup(host: Host, backup: str) -> bool:
    """Remove a backup, then the directories it leaves empty under BACKUP_DIR (BACKUP_DIR too): they
    mirror the backed-up file's path and were made for it (Host.write_file's backup_to). The walk stops at
    the first directory with anything in it (another backup: the plugin's unit is kept here too) and never
    leaves BACKUP_DIR. True when the backup was there."""
    removed = host.remove_file(backup)
    directory = posixpath.dirname(backup)
    while directory == BACKUP_DIR or directory.startswith(BACKUP_DIR + "/"):
        if host.listdir(directory) or not host.remove_empty_dir(directory):
            break
        directory = posixpath.dirname(directory)
    return removed


@dataclass(frozen=True)
class FileRecord:
    path: str
    runtime: str
    original_sha256: str | None  # None: the file did not exist before gpunode
    written_sha256: str | None  # what gpunode last wrote (None: it removed the file)
    backup: str | None  # host path of the original's copy (None when there was no original)
    edits: tuple[Edit, ...] = ()
    owned: bool = False  # a file that exists only for gpunode (a drop-in it created)
    made_dirs: tuple[str, ...] = ()  # directories gpunode created for it, outermost first
    # False for a record that does not say what gpunode wrote (no written_sha256 key: an older or
    # hand-made record): the file cannot be told from the operator's, so a revert never removes it.
    written_known: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "original_sha256": self.original_sha256,
            **({"written_sha256": self.written_sha256} if self.written_known else {}),
            "backup": self.backup,
            "owned": self.owned,
            "edits": [e.to_json() for e in self.edits],
            **({"made_dirs": list(self.made_dirs)} if self.made_dirs else {}),
        }

    @classmethod
    def from_json(cls, path: str, data: Mapping[str, Any]) -> FileRecord:
        return cls(
            path=path,
            runtime=str(data["runtime"]),
            original_sha256=data.get("original_sha256"),
            written_sha256=data.get("written_sha256"),
            backup=data.get("backup"),
            edits=tuple(Edit.from_json(e) for e in data.get("edits", [])),
            owned=bool(data.get("owned", False)),
            made_dirs=tuple(str(d) for d in data.get("made_dirs", [])),
            written_known="written_sha256" in data,
        )


@dataclass
class Records:
    files: dict[str, FileRecord] = field(default_factory=dict)
    # Runtimes whose configuration gpunode changed and that have not been restarted since: set before the
    # first file is written, cleared once the runtime came back, so a run killed in between is detected.
    restart_pending: set[str] = field(default_factory=set)

    def for_runtime(self, runtime: str) -> list[FileRecord]:
        return [r for r in self.files.values() if r.runtime == runtime]

    def updated(
        self,
        runtime: str,
        path: str,
        before: str | None,
        after: str | None,
        edits: Sequence[Edit],
        *,
        owned: bool,
        made_dirs: Sequence[str] = (),
    ) -> FileRecord:
        """The record after gpunode writes `after` over `before`: the first change keeps the original."""
        old = self.files.get(path)
        if old is None:
            return FileRecord(
                path=path,
                runtime=runtime,
                original_sha256=sha256(before),
                written_sha256=sha256(after),
                backup=backup_path(path) if before is not None else None,
                edits=tuple(edits),
                owned=owned,
                made_dirs=tuple(made_dirs),
            )
        return replace(old, written_sha256=sha256(after), edits=(*old.edits, *edits), written_known=True)


def load(host: Host) -> Records:
    """The records, keyed by each file's canonical name (see Host.canonical)."""
    text = host.read_text_if_exists(RECORDS)
    if text is None:
        return Records()
    try:
        data = json.loads(text)
        files: dict[str, FileRecord] = {}
        for path, entry in data["files"].items():
            if not isinstance(path, str) or not path.startswith("/"):
                raise ValueError(f"{path!r} is not an absolute path")
            record = FileRecord.from_json(host.canonical(path), entry)
            files.setdefault(record.path, record)
        pending = {str(r) for r in data.get("restart_pending", [])}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ConfigError(
            f"{RECORDS} is damaged ({exc}): gpunode cannot tell what it changed",
            f"the originals are under {BACKUP_DIR}; restore by hand, then remove {RECORDS}",
        ) from None
    return Records(files, pending)


def save(host: Host, records: Records) -> None:
    if not records.files and not records.restart_pending:
        host.remove_file(RECORDS)
        return
    data: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "files": {path: record.to_json() for path, record in sorted(records.files.items())},
    }
    if records.restart_pending:
        data["restart_pending"] = sorted(records.restart_pending)
    host.write_file(
        RECORDS, json.dumps(data, indent=2) + "\n", mode=0o600, make_parents=True, exact_mode=True
    )


def trusted_backup(host: Host, record: FileRecord) -> str | None:
    """The original's content from the record's backup, after checking that the record may be believed: the
    backup lies where gpunode keeps backups and holds exactly what the record says the original was.
    None when the record has no backup or the backup is gone."""
    if record.backup is None:
        return None
    where = host.canonical(record.backup)
    if not where.startswith(BACKUP_DIR + "/"):
        raise ConfigError(
            f"{RECORDS} names {record.backup} as the backup of {record.path}, which is outside {BACKUP_DIR}; "
            "gpunode does not restore from it",
            f"check {RECORDS} (someone changed it), restore {record.path} by hand, then remove its entry",
        )
    data = host.read_bytes(record.backup)
    if data is None:
        return None
    if sha256(data) != record.original_sha256:
        raise ConfigError(
            f"the backup {record.backup} of {record.path} is not the original gpunode recorded (its "
            "checksum differs); gpunode does not restore from it",
            f"compare {record.backup} with {record.path} and restore by hand, then remove the entry for "
            f"{record.path} from {RECORDS}",
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"the backup {record.backup} of {record.path} is not UTF-8 text") from None
