"""The one way gpunode reads YAML (and the JSON it reads as YAML): bounded in size, depth and expansion.

PyYAML alone turns small hostile files into huge work: `&a [*a, *a, ...]` nine levels deep is a 1.8 KB file
whose data, printed or walked, is hundreds of MB (aliases are shared objects, so the load is cheap and the
first walk is not); an alias inside its own anchor makes a structure without end; 5,000 nested brackets are
a RecursionError in the composer; a 5,000-digit integer is a ValueError (Python's int() digit limit); a
duplicate key silently keeps the last value; and the pure-Python loader needs minutes for a few MB. So every
document goes through three steps here:

1. the size, before anything is parsed (MAX_BYTES);
2. one pass over the parser's events (iterative: no recursion, and it stops at the first excess) counting
   nesting depth and nodes, an alias counted as every node of what it names, so the work of every later
   walk of the data is bounded by MAX_NODES;
3. the load itself, with libyaml's parser where PyYAML has it, refusing duplicate keys.

Every failure is a ConfigError (exit 4) naming the file and, where known, the line; no message quotes more
than a short piece of the document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpunode.errors import ConfigError

MAX_BYTES = 2**20  # far above any NVIDIA config, CDI spec or kubeconfig gpunode has met
MAX_DEPTH = 100  # NVIDIA's config nests 4 levels, a CDI spec 5, a kubeconfig's exec extension a few more
MAX_NODES = (
    100_000  # every scalar, list and mapping, aliases expanded: a CDI spec of 1,000 devices is ~20,000
)
MAX_QUOTE = 80  # the most of a value any message quotes


class YamlRefused(ConfigError):
    """The document is refused for what it holds (its size, depth or expansion, a duplicate key, a value
    Python cannot hold), not for its syntax: a reader trying formats one after another stops here rather
    than try the next one."""


def shorten(text: str, limit: int = MAX_QUOTE) -> str:
    """`text` cut to `limit` characters (with its length said), for quoting a value in a message."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def load_yaml(source: str | bytes, what: str, *, max_bytes: int = MAX_BYTES) -> Any:
    """The data of one YAML (or JSON) document. `what` names it in errors ("/etc/x.yaml", "kubeconfig
    /root/.kube/config"). ConfigError for invalid YAML; YamlRefused past the limits."""
    text = _text(source, what, max_bytes)
    _check_events(text, what)
    return _construct(text, what)


def load_yaml_nodes(source: str | bytes, what: str, *, max_bytes: int = MAX_BYTES) -> tuple[Any, Any]:
    """(data, root node) of one document: the node tree keeps each key's line for messages. The two are
    built separately (constructing resolves merge keys in the node tree it is given)."""
    text = _text(source, what, max_bytes)
    _check_events(text, what)
    data = _construct(text, what)

    def compose() -> Any:
        loader = _loader_class()(text)
        try:
            return loader.get_single_node()
        finally:
            loader.dispose()

    return data, _guarded(compose, what)


def _text(source: str | bytes, what: str, max_bytes: int) -> str:
    size = len(source) if isinstance(source, bytes) else len(source.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise YamlRefused(
            f"{what} is {size} bytes, more than the {_size(max_bytes)} gpunode reads as YAML; refusing to "
            "parse it",
            f"check that {what} is the file meant (no real one is this large)",
        )
    if isinstance(source, str):
        return source
    try:
        return source.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})", f"save {what} as UTF-8"
        ) from None


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n} bytes"


def _loader_class() -> Any:
    import yaml

    base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~100 times faster
    return _make_loader(base)


_LOADERS: dict[Any, Any] = {}


def _make_loader(base: Any) -> Any:
    """`base` (CSafeLoader or SafeLoader) refusing duplicate keys, which PyYAML resolves as last-wins."""
    if base in _LOADERS:
        return _LOADERS[base]
    import yaml

    class Loader(base):  # type: ignore[misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, Any] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # keys a merge brings are overridden by the mapping's own: YAML's rule
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node)
                    except TypeError:
                        continue  # an unhashable key: the base class refuses it with its line
                    if first is not key_node:
                        raise _DuplicateKey(
                            f"while reading the mapping that starts on line {node.start_mark.line + 1}",
                            node.start_mark,
                            f"the key {shorten(str(key))!r} is given twice (lines "
                            f"{first.start_mark.line + 1} and {key_node.start_mark.line + 1}); only one can "
                            "be meant",
                            key_node.start_mark,
                        )
            return super().construct_mapping(node, deep=deep)

    Loader.add_constructor("tag:yaml.org,2002:map", Loader.construct_yaml_map)
    _LOADERS[base] = Loader
    return Loader


class _DuplicateKey(Exception):
    """Raised inside the constructor; becomes YamlRefused."""

    def __init__(self, context: str, context_mark: Any, problem: str, problem_mark: Any) -> None:
        super().__init__(problem)
        self.context, self.problem, self.problem_mark = context, problem, problem_mark


def _check_events(text: str, what: str) -> None:
    """Depth, node count (aliases expanded) and recursive aliases, from the parser's events alone."""
    _guarded(lambda: _count_events(text, what), what)


def _count_events(text: str, what: str) -> None:
    import yaml

    loader = _loader_class()(text)
    anchors: dict[str, int] = {}  # anchor -> its expanded node count, once its node is complete
    open_nodes: list[tuple[str | None, int]] = []  # (anchor, nodes counted before it) of each open collection
    nodes = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            line = event.start_mark.line + 1 if event.start_mark is not None else 0
            anchor: str | None = getattr(event, "anchor", None)
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                open_nodes.append((anchor, nodes))
                nodes += 1
                if len(open_nodes) > MAX_DEPTH:
                    raise YamlRefused(
                        f"{what}, line {line}: lists and mappings nested more than "
                        f"{MAX_DEPTH} deep; refusing to parse it",
                        f"correct {what}: no configuration gpunode reads nests more than a few levels",
                    )
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                started, before = open_nodes.pop()
                if started is not None:
                    anchors[started] = nodes - before
            elif isinstance(event, yaml.ScalarEvent):
                nodes += 1
                if anchor is not None:
                    anchors[anchor] = 1
            elif isinstance(event, yaml.AliasEvent) and anchor is not None:
                if any(anchor == started for started, _ in open_nodes):
                    raise YamlRefused(
                        f"{what}, line {line}: the alias *{shorten(anchor)} is "
                        "inside the node it names, which makes data without end",
                        f"correct {what}",
                    )
                nodes += anchors.get(anchor, 1)  # an unknown anchor: the load says so below
            if nodes > MAX_NODES:
                raise YamlRefused(
                    f"{what}, line {line}: more than {MAX_NODES:,} values (aliases "
                    "counted as all they repeat); refusing to expand it",
                    f"correct {what}: aliases that repeat aliases grow without bound (a 'billion laughs' "
                    "document)",
                )
    finally:
        loader.dispose()


def _construct(text: str, what: str) -> Any:
    def construct() -> Any:
        loader = _loader_class()(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()

    return _guarded(construct, what)


def _guarded(step: Callable[[], Any], what: str) -> Any:
    """step(), its parser's and constructor's exceptions made ConfigErrors."""
    import yaml

    error: ConfigError
    try:
        return step()
    except yaml.YAMLError as exc:
        # libyaml refuses 1,000 nested flow collections itself, while scanning ahead of the events.
        deep = "maximum nesting depth" in str(getattr(exc, "problem", ""))
        error = _syntax_error(exc, what, YamlRefused if deep else ConfigError)
    except _DuplicateKey as exc:
        error = _syntax_error(exc, what, YamlRefused)
    except ValueError as exc:
        # A scalar PyYAML's resolver takes for a number or date and Python cannot build: an integer of
        # thousands of digits (int()'s limit), 2024-02-30. The message is short; the value is not quoted.
        error = YamlRefused(
            f"{what} holds a value gpunode cannot read ({shorten(str(exc).split(':')[0])})",
            f"correct {what}: quote the value if it is meant as text",
        )
    except RecursionError:  # not reached past the depth check; said plainly if a parser recurses after all
        error = YamlRefused(f"{what} nests too deeply to be read", f"correct {what}")
    # Raised out here: raised in an except clause, the YAML error (and the line it may quote, which may
    # hold a token) would stay attached as __context__, which --debug prints.
    raise error


def _syntax_error(exc: Exception, what: str, kind: type[ConfigError] = ConfigError) -> ConfigError:
    # The problem and its place only: str() of a YAML error quotes the line, which may hold a token.
    mark = getattr(exc, "problem_mark", None)
    parts = (getattr(exc, "context", None), getattr(exc, "problem", None))
    detail = shorten(": ".join(p for p in parts if isinstance(p, str) and p) or "syntax error", 300)
    if kind is ConfigError:
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return ConfigError(f"{what} is not valid YAML: {detail}{at}", f"correct {what}")
    at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return kind(f"{what}{at}: {detail}", f"correct {what}")
