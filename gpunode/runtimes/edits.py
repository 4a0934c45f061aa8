"""Key-level edits of a configuration document, recorded so that they can be undone one by one.

Every change `configure-runtime` makes is an Edit: a key path, the value before (or ABSENT) and the value
after. The list of edits is kept with the backup; `--revert` on a file the user has changed since uses it
to take back only what gpunode set, leaving everything else as the user left it.

Two document formats share this: JSON (docker's daemon.json; plain dicts) and TOML (containerd, CRI-O;
tomlkit documents, edited in place so that comments, key order, quoting and blank lines survive).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import tomlkit
from tomlkit.container import Container
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import AoT, Item, String, StringType, Table, Whitespace

from gpunode.errors import ConfigError
from gpunode.runtimes.tomldoc import parse_toml_document
from gpunode.runtimes.tomlread import plain


class _Absent:
    """The value of a key that is not there (distinct from null / an empty string)."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


@dataclass(frozen=True)
class Edit:
    """One key gpunode set. op "set": `path` now holds `after`; op "append": `after` was appended to the
    list at `path`; op "table": gpunode created the (empty) table at `path` to hold its keys; op "delete":
    gpunode removed `path`, which held `before` (`configure-runtime --remove`)."""

    path: tuple[str, ...]
    before: Any
    after: Any
    op: str = "set"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": list(self.path), "op": self.op}
        if self.op != "delete":
            data["after"] = self.after
        if self.before is not ABSENT:
            data["before"] = self.before
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Edit:
        op = data.get("op", "set")
        after = ABSENT if op == "delete" else data.get("after")
        return cls(tuple(data["path"]), data.get("before", ABSENT), after, op)

    def describe(self) -> str:
        return ".".join(f'"{k}"' if "." in k else k for k in self.path)


def lookup(doc: Mapping[str, Any], path: Sequence[str]) -> Any:
    """The plain value at `path`, or ABSENT (also when something on the way is not a table)."""
    current: Any = doc
    for key in path:
        if not isinstance(current, Mapping) or key not in current:
            return ABSENT
        current = current[key]
    return plain(current)


class Format(Protocol):
    """How one file format is parsed, edited key by key, and written back."""

    name: str

    def parse(self, text: str, path: str) -> MutableMapping[str, Any]: ...

    def render(self, doc: MutableMapping[str, Any], original: str | None) -> str: ...

    def set(self, doc: MutableMapping[str, Any], path: Sequence[str], value: Any) -> None: ...

    def delete(self, doc: MutableMapping[str, Any], path: Sequence[str]) -> None: ...


class Editor:
    """Applies edits to one document through its Format and keeps the list of what it changed."""

    def __init__(self, fmt: Format, doc: MutableMapping[str, Any]) -> None:
        self.fmt = fmt
        self.doc = doc
        self.edits: list[Edit] = []

    def set(self, path: Sequence[str], value: Any) -> bool:
        """Set `path` to `value` unless it already holds it; True when something changed."""
        path = tuple(path)
        before = lookup(self.doc, path)
        if before == value:
            return False
        self._record_created_tables(path)
        try:
            self.fmt.set(self.doc, path, value)
        except (TOMLKitError, TypeError, ValueError, AttributeError) as exc:
            raise _cannot_edit(path, exc) from None
        self.edits.append(Edit(path, before, value))
        return True

    def append(self, path: Sequence[str], item: Any) -> bool:
        path = tuple(path)
        before = lookup(self.doc, path)
        if before is ABSENT:
            self._record_created_tables(path)
            self.fmt.set(self.doc, path, [item])
        elif not isinstance(before, list):
            raise ConfigError(f"{Edit(path, None, None).describe()} must be a list")
        elif item in before:
            return False
        else:
            _container_at(self.doc, path[:-1])[path[-1]].append(item)
        self.edits.append(Edit(path, before, item, op="append"))
        return True

    def delete(self, path: Sequence[str]) -> bool:
        """Remove `path` (a key or a whole table) when it is there; True when something changed."""
        path = tuple(path)
        before = lookup(self.doc, path)
        if before is ABSENT:
            return False
        self.fmt.delete(self.doc, path)
        self.edits.append(Edit(path, before, ABSENT, op="delete"))
        return True

    def _record_created_tables(self, path: tuple[str, ...]) -> None:
        for depth in range(1, len(path)):
            if lookup(self.doc, path[:depth]) is ABSENT:
                self.edits.append(Edit(path[:depth], ABSENT, {}, op="table"))


def _cannot_edit(path: Sequence[str], exc: Exception) -> ConfigError:
    return ConfigError(
        f"gpunode cannot safely edit {Edit(tuple(path), None, None).describe()} as the file writes it "
        f"(an inline table or dotted keys on the way: {exc})",
        "write the tables on that path as [section] headers, then run the command again",
    )


def check_rendered(fmt: Format, text: str, edits: Sequence[Edit], path: str) -> None:
    """Parse what is about to be written and check every edit reads back as set: a layout tomlkit
    mishandles (dotted keys, inline tables) is refused rather than written wrong."""
    doc = fmt.parse(text, path)
    for n, edit in enumerate(edits):
        overlapping = (
            later.path[: len(edit.path)] == edit.path or edit.path[: len(later.path)] == later.path
            for later in edits[n + 1 :]
        )
        if any(overlapping):
            continue  # a later edit changed part of it: only the final state is checked
        value = lookup(doc, edit.path)
        ok = (
            (isinstance(value, list) and edit.after in value)
            if edit.op == "append"
            else isinstance(value, dict)
            if edit.op == "table"
            else value == edit.after
        )
        if not ok:
            raise _cannot_edit(edit.path, ValueError("the result does not read back as written"))


def undo_edits(fmt: Format, doc: MutableMapping[str, Any], edits: Sequence[Edit]) -> list[str]:
    """Take back `edits` (newest first) from a document the user may have changed since.

    A key is put back only while it still holds what gpunode set; a table gpunode added is removed even if
    the user tuned it (it exists only because of gpunode). Returns notes on what was left alone.
    """
    notes: list[str] = []
    for edit in reversed(edits):
        current = lookup(doc, edit.path)
        if edit.op == "delete":
            if current is ABSENT:
                fmt.set(doc, edit.path, edit.before)
            else:
                notes.append(f"left {edit.describe()} as it is: it was set again after gpunode removed it")
            continue
        if edit.op == "append":
            if isinstance(current, list) and edit.after in current:
                remaining = [v for v in current if v != edit.after]
                if remaining or edit.before is not ABSENT:
                    fmt.set(doc, edit.path, remaining)
                else:
                    fmt.delete(doc, edit.path)
            continue
        if edit.op == "table":
            if current == {}:
                fmt.delete(doc, edit.path)
            continue
        if current is ABSENT and edit.before is ABSENT:
            continue
        gpunode_made_table = edit.before is ABSENT and isinstance(edit.after, dict)
        if current == edit.after or gpunode_made_table:
            if edit.before is ABSENT:
                fmt.delete(doc, edit.path)
            else:
                fmt.set(doc, edit.path, edit.before)
        else:
            notes.append(f"left {edit.describe()} as it is: it was changed after gpunode set it")
    return notes


def _container_at(doc: MutableMapping[str, Any], path: Sequence[str]) -> MutableMapping[str, Any]:
    current: Any = doc
    for key in path:
        current = current[key]
    if not isinstance(current, MutableMapping):
        raise ConfigError(f"{Edit(tuple(path), None, None).describe()} must be a table")
    return current


def _parents(doc: MutableMapping[str, Any], path: Sequence[str], make: Any) -> MutableMapping[str, Any]:
    current: MutableMapping[str, Any] = doc
    for depth, key in enumerate(path):
        if key not in current:
            current[key] = make()
        value = current[key]
        if not isinstance(value, MutableMapping):
            raise ConfigError(f"{Edit(tuple(path[: depth + 1]), None, None).describe()} must be a table")
        current = value
    return current


# -- JSON (daemon.json) -----------------------------------------------------------------------------


class JsonFormat:
    """daemon.json: key order is kept (dicts are ordered) and the file's own indentation is reused."""

    name = "json"

    def parse(self, text: str, path: str) -> MutableMapping[str, Any]:
        from gpunode.runtimes.docker import parse_daemon_json

        return parse_daemon_json(text, path)

    def render(self, doc: MutableMapping[str, Any], original: str | None) -> str:
        # A BOM the file had stays (only a dockerd that reads it ever got such a file from gpunode).
        bom = "\ufeff" if (original or "").startswith("\ufeff") else ""
        return bom + json.dumps(doc, indent=json_indent(original), ensure_ascii=False) + "\n"

    def set(self, doc: MutableMapping[str, Any], path: Sequence[str], value: Any) -> None:
        _parents(doc, path[:-1], dict)[path[-1]] = value

    def delete(self, doc: MutableMapping[str, Any], path: Sequence[str]) -> None:
        parent = _container_at(doc, path[:-1])
        parent.pop(path[-1], None)


def json_indent(text: str | None) -> str | int | None:
    """The indentation a JSON file uses: its first indented line's leading whitespace.

    A file with no line breaks inside stays on one line; a new or empty file gets 4 spaces.
    """
    if text is None or not text.strip():
        return 4
    body = text.strip()
    if "\n" not in body:
        return None
    found = re.search(r"\n([ \t]+)\S", body)
    if found is None:
        return 4
    indent = found.group(1)
    return indent if "\t" in indent else len(indent)


# -- TOML (containerd, CRI-O) -----------------------------------------------------------------------


class TomlFormat:
    """TOML through tomlkit, which keeps comments, order, quoting and whitespace of what it does not touch.

    New keys and tables copy the indentation of their neighbours, so an indented file (containerd's
    default config) stays consistently indented.
    """

    name = "toml"

    def __init__(self) -> None:
        # Per document (by id): whether its strings are mostly 'literal', and the tables gpunode added.
        self._literal: dict[int, bool] = {}
        self._header_step: dict[int, str] = {}
        self._new_tables: dict[int, list[tuple[str, ...]]] = {}

    def parse(self, text: str, path: str) -> MutableMapping[str, Any]:
        if text and not text.endswith("\n"):
            text += "\n"  # else a table gpunode appends would start on the last line of the file
        doc = parse_toml_document(text, path)
        self._literal[id(doc)] = _prefers_literal_strings(doc)
        self._header_step[id(doc)] = _header_step(doc)
        return doc

    def render(self, doc: MutableMapping[str, Any], original: str | None) -> str:
        text = tomlkit.dumps(doc)
        # A table appended at the end carries the blank line that separates it from a following one.
        if text.endswith("\n\n") and not (original or "").endswith("\n\n"):
            text = text.rstrip("\n") + "\n"
        return _blank_line_before(text, self._new_tables.get(id(doc), []))

    def set(self, doc: MutableMapping[str, Any], path: Sequence[str], value: Any) -> None:
        parent = _parents(doc, path[:-1], lambda: tomlkit.table(is_super_table=True))
        key = path[-1]
        literal = self._literal.get(id(doc), False)
        if isinstance(value, Mapping):
            like = _sibling_table(parent)
            if key in parent:
                del parent[key]
            parent[key] = _styled_table(value, like, literal=literal, step=self._header_step.get(id(doc), ""))
            _indent_like(_raw_item(parent, key), like)  # after insertion: tomlkit adds the parent's indent
            self._new_tables.setdefault(id(doc), []).extend(_table_paths(tuple(path), value))
            return
        if key in parent:
            old = _raw_item(parent, key)
            # tomlkit keeps the key's comment and indentation; the quoting is kept here.
            parent[key] = _styled_value(value, _is_literal(old) if isinstance(old, String) else literal)
            return
        indent = _key_indent(parent)
        parent[key] = _styled_value(value, literal)
        item = _raw_item(parent, key)
        if item is not None and indent:
            item.trivia.indent = indent

    def delete(self, doc: MutableMapping[str, Any], path: Sequence[str]) -> None:
        parent = _container_at(doc, path[:-1])
        if path[-1] in parent:
            del parent[path[-1]]


def read_toml(text: str, path: str) -> dict[str, Any]:
    """A TOML file's plain values, for reading only (gpunode.runtimes.tomlread: tomllib first)."""
    from gpunode.runtimes.tomlread import read_toml as read

    return read(text, path)


def new_toml_document(header: str | None = None) -> MutableMapping[str, Any]:
    doc = tomlkit.document()
    if header:
        for line in header.splitlines():
            doc.add(tomlkit.comment(line))
        doc.add(tomlkit.nl())
    return doc


def _body(container: Any) -> list[tuple[Any, Item]]:
    if isinstance(container, Table):
        return list(container.value.body)
    if isinstance(container, Container):
        return list(container.body)
    return []


def _raw_item(container: Any, key: str) -> Item | None:
    for k, item in _body(container):
        if k is not None and k.key == key:
            return item
    return None


def _key_indent(container: Any) -> str:
    for k, item in _body(container):
        if k is not None and not isinstance(item, (Table, AoT)):
            return str(item.trivia.indent)
    return ""


def _sibling_table(container: Any) -> Table | None:
    tables = [item for k, item in _body(container) if k is not None and isinstance(item, Table)]
    return tables[-1] if tables else None


def _is_literal(item: String) -> bool:
    return item.type in (StringType.SLL, StringType.MLL)


def _header_step(doc: Any) -> str:
    """How much deeper the file indents a sub-table's header than its parent's (containerd's own files:
    two spaces; hand-written ones: usually none), from the first table nested in another."""
    pending: list[Any] = [doc]
    while pending:
        container = pending.pop()
        for _, item in _body(container):
            if not isinstance(item, Table):
                continue
            if isinstance(container, Table) and not container.is_super_table():
                outer, inner = container.trivia.indent.lstrip("\n"), item.trivia.indent.lstrip("\n")
                if inner.startswith(outer):
                    return inner[len(outer) :]
            pending.append(item)
    return ""


def _prefers_literal_strings(doc: Any) -> bool:
    """Whether most string values of the document are 'literal' (containerd 2.x writes its config so)."""
    literal = basic = 0
    pending: list[Any] = [doc]
    while pending:
        container = pending.pop()
        for _, item in _body(container):
            if isinstance(item, String):
                literal, basic = (literal + 1, basic) if _is_literal(item) else (literal, basic + 1)
            elif isinstance(item, Table):
                pending.append(item)
            elif isinstance(item, AoT):
                pending.extend(item.body)
    return literal > basic


def _styled_value(value: Any, literal: bool) -> Any:
    """A new value quoted like its neighbours: 'literal' strings in a file that writes them (where the text
    allows: no quote or line break in it), "basic" ones otherwise."""
    if isinstance(value, str) and literal and "'" not in value and "\n" not in value:
        return tomlkit.string(value, literal=True)
    if isinstance(value, list):
        array = tomlkit.array()
        array.extend(_styled_value(v, literal) for v in value)
        return array
    return value


def _table_paths(path: tuple[str, ...], value: Mapping[str, Any]) -> list[tuple[str, ...]]:
    paths = [path]
    for key, item in value.items():
        if isinstance(item, Mapping):
            paths.extend(_table_paths((*path, str(key)), item))
    return paths


def _blank_line_before(text: str, tables: Sequence[tuple[str, ...]]) -> str:
    """Each table gpunode added starts after a blank line, however the file separates its own tables."""
    if not tables:
        return text
    lines = text.split("\n")
    for path in tables:
        header = _header_pattern(path)
        for n, line in enumerate(lines):
            if n > 0 and header.match(line) and lines[n - 1].strip() != "":
                lines.insert(n, "")
                break
    return "\n".join(lines)


def _header_pattern(path: tuple[str, ...]) -> re.Pattern[str]:
    # A key as tomlkit may render it: bare, "basic" or 'literal' (a key keeps the quoting the file used).
    keys = [rf"""(?:{re.escape(k)}|"{re.escape(k)}"|'{re.escape(k)}')""" for k in path]
    return re.compile(r"^\s*\[\s*" + r"\s*\.\s*".join(keys) + r"\s*\]\s*(?:#.*)?$")


def _styled_table(
    value: Mapping[str, Any],
    like: Table | None,
    *,
    literal: bool = False,
    header_indent: str | None = None,
    key_indent: str | None = None,
    step: str = "",
) -> Table:
    """A new table with the look of `like` (a sibling): key indentation, a blank line before its
    sub-tables and after it, as containerd's own generated file has. A sub-table with no sibling to copy
    continues the file's indentation: its header `step` deeper than this one's, its keys as deep below it
    as this table's keys are below this header."""
    table = tomlkit.table()
    own_header = header_indent if header_indent is not None else (like.trivia.indent if like else "")
    own_keys = key_indent if key_indent is not None else (_key_indent(like) if like is not None else "")
    key_step = own_keys[len(own_header) :] if own_keys.startswith(own_header) else ""
    sub_like = _sibling_table(like) if like is not None else None
    scalars = {k: v for k, v in value.items() if not isinstance(v, Mapping)}
    tables = {k: v for k, v in value.items() if isinstance(v, Mapping)}
    for key, item in scalars.items():
        table.add(key, _styled_value(item, literal))
        raw = _raw_item(table, key)
        if raw is not None and own_keys:
            raw.trivia.indent = own_keys
    if scalars and tables:
        table.add(Whitespace("\n"))
    for key, item in tables.items():
        if sub_like is not None:
            sub_header = sub_like.trivia.indent
            sub_keys = _key_indent(sub_like) or sub_header + key_step
        else:
            sub_header = own_header + step
            sub_keys = sub_header + key_step
        table.add(
            key,
            _styled_table(
                item, sub_like, literal=literal, header_indent=sub_header, key_indent=sub_keys, step=step
            ),
        )
        raw = _raw_item(table, key)
        if raw is not None:
            raw.trivia.indent = sub_header
    if not tables:
        table.add(Whitespace("\n"))
    return table


def _indent_like(item: Item | None, like: Table | None) -> None:
    if item is not None and like is not None:
        item.trivia.indent = like.trivia.indent
