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


@dataclass(frozen=True)
class FileRecord:
    path: str
    runtime: str
    original_sha256: str | None  # None: the file did not exist before gpunode
    written_sha256: str | None  # what gpunode last wrote (None: it removed the file)
    backup: str | None  # host path of the original's copy (None when there was no original)
    edits: tuple[Edit, ...] = ()
    owned: bool = False  # a file that exists only for gpunode (a drop-in it created)

    def to_json(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "original_sha256": self.original_sha256,
            "written_sha256": self.written_sha256,
            "backup": self.backup,
            "owned": self.owned,
            "edits": [e.to_json() for e in self.edits],
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
        )


@dataclass
class Records:
    files: dict[str, FileRecord] = field(default_factory=dict)

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
            )
        return replace(old, written_sha256=sha256(after), edits=(*old.edits, *edits))


def load(host: Host) -> Records:
    text = host.read_text_if_exists(RECORDS)
    if text is None:
        return Records()
    try:
        data = json.loads(text)
        files = {path: FileRecord.from_json(path, entry) for path, entry in data["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{RECORDS} is damaged ({exc}): gpunode cannot tell what it changed",
            f"the originals are under {BACKUP_DIR}; restore by hand, then remove {RECORDS}",
        ) from None
    return Records(files)


def save(host: Host, records: Records) -> None:
    if not records.files:
        host.remove_file(RECORDS)
        return
    data = {
        "version": FORMAT_VERSION,
        "files": {path: record.to_json() for path, record in sorted(records.files.items())},
    }
    host.write_file(RECORDS, json.dumps(data, indent=2) + "\n", mode=0o600, make_parents=True)
