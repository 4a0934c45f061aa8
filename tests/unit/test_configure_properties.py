"""Property tests of configure-runtime: random valid configurations, written with random formatting.

For docker, containerd (config versions 1, 2 and 3, in place and with --drop-in) and CRI-O, whatever the
input looks like: the output parses; the read-only readers see the nvidia runtime with the requested binary
(and as the default when asked); every key gpunode does not own keeps its value; every comment survives; a
second run changes nothing (not even the mtime); and revert gives back the original bytes exactly.

The TOML inputs are written by hand here, not by a serializer, so that indentation, comments, blank lines,
quoting, dotted keys, inline tables, omitted super-table headers, tables moved out of order and a missing
final newline all vary the way hand-edited files do. tomllib (tests.tomlread) is the independent judge of
what a file means. The generators keep inline tables and dotted keys off the path gpunode adds tables to,
and runc-type runtimes agreeing on SystemdCgroup; the tests at the end show those cases one by one.
"""

from __future__ import annotations

import copy
import json
import random
import re
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunode.cli.main import main
from gpunode.errors import ConfigError, ExitCode, NotFound
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import configure, containerd, crio, docker, records
from gpunode.runtimes.edits import read_toml
from gpunode.runtimes.plan import ConfigureOptions
from tests import tomlread

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20 1.6.20~ds1-1\n"
CONTAINERD_2_0 = (
    "containerd github.com/containerd/containerd/v2 v2.0.0 207ad711eabd375a01713109a8a197d197ff6542\n"
)
CONTAINERD_CONFIG = containerd.DEFAULT_CONFIG
CONTAINERD_DROPIN = "/etc/containerd/conf.d/99-nvidia.toml"
RUNC_V2 = "io.containerd.runc.v2"
CRI_PATHS = {
    1: ("plugins", "cri"),
    2: ("plugins", "io.containerd.grpc.v1.cri"),
    3: ("plugins", "io.containerd.cri.v1.runtime"),
}

# Names and binaries the nvidia runtime is configured with; none collides with the other runtimes generated.
RUNTIME_NAMES = ("nvidia", "gpu", "nvidia-experimental", "nv_2", "nvidia.cdi")
RUNTIME_PATHS = (
    "/usr/bin/nvidia-container-runtime",
    "/usr/local/nvidia/toolkit/nvidia-container-runtime",
    "nvidia-container-runtime",
)
OLD_NVIDIA_PATHS = ("/usr/bin/nvidia-container-runtime", "/opt/old/nvidia-container-runtime", "/usr/bin/runc")

# derandomize: the same examples on every run, so a failure is reproducible and never flaky.
PROPERTY_SETTINGS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

MISSING: Any = object()  # a key that is not there (distinct from any value a file can hold)

# -- values -----------------------------------------------------------------------------------------

TEXT_CHARS = st.characters(
    codec="utf-8", exclude_categories=("Cc", "Cs", "Co", "Cn", "Zl", "Zp"), max_codepoint=0x1F64F
)
# Comments may hold anything but control characters; '#' and quotes inside test the parsers.
COMMENT_CHARS = "abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789#\"'[]{}=.,:;!?-_/\\éü中🙂\t"

texts = st.text(TEXT_CHARS, max_size=12)
scalars: st.SearchStrategy[Any] = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
toml_values: st.SearchStrategy[Any] = st.one_of(
    scalars, st.lists(st.one_of(texts, st.integers()), max_size=3)
)
extra_keys = st.from_regex(r"\Ax[_-][a-z0-9_-]{1,8}\Z").map(str)
dotted_keys = st.from_regex(r"\Aio\.example\.v[0-9]\.[a-z]{1,6}\Z").map(str)


def leaves(doc: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every scalar or list (and every empty table) with its key path."""
    for key, value in doc.items():
        path = (*prefix, key)
        if isinstance(value, Mapping) and value:
            yield from leaves(value, path)
        else:
            yield path, value


def get(doc: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(doc, Mapping) or key not in doc:
            return MISSING
        doc = doc[key]
    return doc


def owned_by(path: tuple[str, ...], owned: Sequence[tuple[str, ...]]) -> bool:
    return any(path[: len(o)] == o for o in owned)


def assert_kept(
    before: Mapping[str, Any], after: Mapping[str, Any], owned: Sequence[tuple[str, ...]]
) -> None:
    """Every key of `before` outside what gpunode owns holds the same value in `after`."""
    for path, value in leaves(before):
        if owned_by(path, owned):
            continue
        now = get(after, path)
        if isinstance(value, Mapping):  # an empty table may have gained keys, never lost its place
            assert isinstance(now, Mapping), f"table {path} became {now!r}"
        else:
            assert now == value and type(now) is type(value), f"{path}: {value!r} became {now!r}"


# -- a hand-written TOML renderer with random formatting --------------------------------------------

BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class TomlStyle:
    indent: str  # one level of indentation
    eq: str  # what separates a key from its value
    comment_rate: float  # chance of a full-line comment before a line
    trailing_rate: float  # chance of a comment after a key or a header
    blank_rate: float
    jitter_rate: float  # chance a line gets some extra indentation
    quote_rate: float  # chance a bare key is quoted anyway
    literal_rate: float  # chance a string is written 'literal'
    dotted_rate: float  # chance a table of scalars is written as dotted keys in its parent
    inline_rate: float  # chance a table of scalars is written as an inline table
    omit_super_rate: float  # chance a table holding only tables gets no header
    move_rate: float  # chance a nested table (and its sub-tables) is moved to the end of the file
    multiline_rate: float  # chance an array spans several lines
    underscore_rate: float  # chance an integer is written 1_000
    final_newline: bool
    seed: int  # drives the per-line decisions (too many to draw one by one)


rates = st.sampled_from((0.0, 0.1, 0.3))
toml_styles = st.builds(
    TomlStyle,
    indent=st.sampled_from(("", "  ", "    ", "\t", " ")),
    eq=st.sampled_from((" = ", "=", "  =  ", "\t=\t")),
    comment_rate=rates,
    trailing_rate=rates,
    blank_rate=rates,
    jitter_rate=st.sampled_from((0.0, 0.1)),
    quote_rate=st.sampled_from((0.0, 0.2)),
    literal_rate=st.sampled_from((0.0, 0.3)),
    dotted_rate=st.sampled_from((0.0, 0.0, 0.3)),
    inline_rate=st.sampled_from((0.0, 0.0, 0.3)),
    omit_super_rate=st.sampled_from((0.0, 0.5)),
    move_rate=st.sampled_from((0.0, 0.0, 0.15)),
    multiline_rate=st.sampled_from((0.0, 0.3)),
    underscore_rate=st.sampled_from((0.0, 0.3)),
    final_newline=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)


@dataclass
class TomlText:
    text: str
    comment_lines: list[str] = field(default_factory=list)  # full-line comments, exactly as written
    trailing: list[str] = field(default_factory=list)  # end-of-line comments (from the '#')


def basic_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


class TomlWriter:
    def __init__(self, style: TomlStyle, edited: Sequence[tuple[str, ...]] = ()) -> None:
        self.style = style
        self.edited = edited
        self.rng = random.Random(style.seed)  # noqa: S311 (layout noise, reproducible from the seed)
        self.out = TomlText("")

    def chance(self, rate: float) -> bool:
        return rate > 0 and self.rng.random() < rate

    def comment(self) -> str:
        body = "".join(self.rng.choice(COMMENT_CHARS) for _ in range(self.rng.randint(0, 16)))
        return "#" + self.rng.choice(("", " ")) + body.rstrip()

    def key(self, k: str) -> str:
        if BARE_KEY.match(k) and not self.chance(self.style.quote_rate):
            return k
        if "'" not in k and self.chance(0.3):
            return f"'{k}'"
        return basic_string(k)

    def value(self, v: Any, depth: int) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return f"{v:_}" if self.chance(self.style.underscore_rate) else str(v)
        if isinstance(v, float):
            return repr(v)
        if isinstance(v, str):
            literal_ok = not any((ord(c) < 0x20 and c != "\t") or c in "'\x7f" for c in v)
            return f"'{v}'" if literal_ok and self.chance(self.style.literal_rate) else basic_string(v)
        if isinstance(v, list):
            items = [self.value(x, depth + 1) for x in v]
            if items and self.chance(self.style.multiline_rate):
                inner = self.style.indent * (depth + 1)
                return "[\n" + "".join(f"{inner}{i},\n" for i in items) + self.style.indent * depth + "]"
            return "[" + ", ".join(items) + "]"
        if isinstance(v, Mapping):
            inner = ", ".join(f"{self.key(k)} = {self.value(x, depth)}" for k, x in v.items())
            return "{ " + inner + " }" if inner else "{}"
        raise TypeError(f"no TOML for {v!r}")

    def line(self, depth: int, text: str) -> list[str]:
        """`text` at `depth`, maybe after blank lines and a comment, maybe with a trailing comment."""
        lines: list[str] = []
        while self.chance(self.style.blank_rate):
            lines.append(self.rng.choice(("", " ", "\t")) if self.chance(0.2) else "")
        indent = self.style.indent * depth
        if self.chance(self.style.jitter_rate):
            indent += self.rng.choice((" ", "  ", "\t"))
        if self.chance(self.style.comment_rate):
            comment = self.rng.choice((indent, "", self.style.indent)) + self.comment()
            lines.append(comment)
            self.out.comment_lines.append(comment)
        if self.chance(self.style.trailing_rate):
            trailing = self.comment()
            text += self.rng.choice((" ", "  ", "\t")) + trailing
            self.out.trailing.append(trailing)
        lines.append(indent + text)
        return lines

    def blocks(
        self, path: tuple[str, ...], table: Mapping[str, Any]
    ) -> list[tuple[tuple[str, ...], list[str]]]:
        """(table path, lines) for `table` and its sub-tables, parents first."""
        depth = len(path)
        body: list[str] = []
        children: list[tuple[str, Mapping[str, Any]]] = []
        for k, v in table.items():
            if not isinstance(v, Mapping):
                body += self.line(depth, f"{self.key(k)}{self.style.eq}{self.value(v, depth)}")
        for k, v in table.items():
            if not isinstance(v, Mapping):
                continue
            only_scalars = not any(isinstance(x, Mapping) for x in v.values())
            collapsible = only_scalars and self.may_collapse((*path, k))
            if collapsible and v and self.chance(self.style.dotted_rate):
                for kk, vv in v.items():
                    body += self.line(
                        depth, f"{self.key(k)}.{self.key(kk)}{self.style.eq}{self.value(vv, depth)}"
                    )
            elif collapsible and self.chance(self.style.inline_rate):
                body += self.line(depth, f"{self.key(k)}{self.style.eq}{self.value(v, depth)}")
            else:
                children.append((k, v))
        blocks: list[tuple[tuple[str, ...], list[str]]] = []
        if not path:
            blocks.append((path, body))
        elif body or not children or not self.chance(self.style.omit_super_rate):
            header = self.line(depth - 1, "[" + ".".join(self.key(p) for p in path) + "]")
            blocks.append((path, header + body))
        for k, v in children:
            blocks += self.blocks((*path, k), v)
        return blocks

    def may_collapse(self, path: tuple[str, ...]) -> bool:
        # Tables gpunode may add a sub-table to are never inline or dotted here: those cases have their own
        # tests below (test_inline_table_on_the_edited_path_..., test_dotted_keys_on_the_edited_path_...).
        return not any(len(path) < len(e) and e[: len(path)] == path for e in self.edited)

    def render(self, doc: Mapping[str, Any]) -> TomlText:
        blocks = self.blocks((), doc)
        # Users append tables at the end of a file: move some nested sub-trees there (valid TOML).
        moved_roots = [p for p, _ in blocks if len(p) >= 2 and self.chance(self.style.move_rate)]

        def moved(p: tuple[str, ...]) -> bool:
            return any(p[: len(r)] == r for r in moved_roots)

        ordered = [b for b in blocks if not moved(b[0])] + [b for b in blocks if moved(b[0])]
        lines = [line for _, block in ordered for line in block]
        if self.chance(self.style.comment_rate):
            comment = self.comment()
            lines.append(comment)
            self.out.comment_lines.append(comment)
        self.out.text = "\n".join(lines) + ("\n" if self.style.final_newline else "")
        return self.out


def render_toml(doc: Mapping[str, Any], style: TomlStyle, edited: Sequence[tuple[str, ...]] = ()) -> TomlText:
    """`doc` as TOML text; `edited`: tables gpunode adds to, written with a [header] (see may_collapse)."""
    out = TomlWriter(style, edited).render(doc)
    assert tomlread.loads(out.text) == doc, "the generator wrote TOML that does not mean the document"
    return out


def comments_only(style: TomlStyle) -> TomlText:
    writer = TomlWriter(style)
    lines = [writer.comment() for _ in range(writer.rng.randint(0, 4))]
    writer.out.comment_lines = list(lines)
    writer.out.text = "\n".join(lines) + ("\n" if lines and style.final_newline else "")
    return writer.out


def assert_comments_kept(source: TomlText, output: str) -> None:
    missing = Counter(source.comment_lines) - Counter(output.splitlines())
    assert not missing, f"full-line comments lost: {list(missing)}"
    for comment in set(source.trailing):
        assert output.count(comment) >= source.text.count(comment), f"trailing comment lost: {comment!r}"


# -- the test harness -------------------------------------------------------------------------------


def make_host(root: Path, containerd_version: str = CONTAINERD_1_6) -> Host:
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], containerd_version)
    return Host(root=root, runner=runner)


def put(root: Path, host_path: str, text: str | None) -> None:
    if text is None:
        return
    local = root / host_path.lstrip("/")
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(text.encode())


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under the root with its bytes and mtime, to show that nothing is rewritten."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def assert_idempotent(host: Host, root: Path, runtime: str, opts: ConfigureOptions) -> None:
    before = snapshot(root)
    plan = configure.plan_configure(host, runtime, opts)
    assert plan.pending == (), f"a second run would change {[c.path for c in plan.pending]}"
    outcome = configure.apply(host, plan, restart=False)
    assert not outcome.changed
    assert snapshot(root) == before


def assert_reverts(
    host: Host, root: Path, runtime: str, originals: Mapping[str, bytes | None], *, changed: bool
) -> None:
    """Revert puts every file back byte for byte (removes the ones that did not exist) and forgets them.
    A configure that found everything in place changed nothing, and left nothing to revert."""
    if not changed:
        with pytest.raises(NotFound):
            configure.plan_revert(host, runtime, ConfigureOptions())
        for host_path, original in originals.items():
            assert host.read_bytes(host_path) == original
        return
    plan = configure.plan_revert(host, runtime, ConfigureOptions())
    configure.apply(host, plan, restart=False)
    for host_path, original in originals.items():
        local = root / host_path.lstrip("/")
        if original is None:
            assert not local.exists(), f"{host_path} did not exist before and is still there"
        else:
            assert local.read_bytes() == original, f"{host_path} is not back to its original bytes"
    assert not host.exists(records.RECORDS)
    for host_path in originals:
        assert not host.exists(records.backup_path(host_path))


def assert_no_temp_files(root: Path) -> None:
    assert not [p for p in root.rglob("*") if p.name.endswith(".gpunode-tmp")]


# -- containerd -------------------------------------------------------------------------------------

STOCK_V2: dict[str, Any] = tomlread.loads((FIXTURES / "containerd/default-v2.toml").read_text())
RUNC_OPTION_VALUES: Mapping[str, st.SearchStrategy[Any]] = {
    "BinaryName": st.sampled_from(("", "/usr/bin/runc", "/usr/local/sbin/runc")),
    "Root": st.sampled_from(("", "/run/containerd/runc")),
    "NoPivotRoot": st.booleans(),
    "ShimCgroup": st.sampled_from(("", "system.slice")),
    "IoUid": st.integers(0, 65535),
    "CriuPath": texts,
}


def stock_config(version: int) -> dict[str, Any]:
    """`containerd config default` of the containerd that writes `version` files."""
    doc = copy.deepcopy(STOCK_V2)
    if version == 2:
        return doc
    plugins = doc["plugins"]
    cri = plugins.pop("io.containerd.grpc.v1.cri")
    if version == 1:
        plugins["cri"] = cri
        doc["version"] = 1
        return doc
    # containerd 2.0 splits the CRI plugin; the runtimes live in io.containerd.cri.v1.runtime.
    old = cri["containerd"]
    plugins["io.containerd.cri.v1.images"] = {
        "max_concurrent_downloads": 3,
        "snapshotter": "overlayfs",
        "pinned_images": {"sandbox": "registry.k8s.io/pause:3.10"},
        "registry": {"config_path": ""},
    }
    plugins["io.containerd.cri.v1.runtime"] = {
        "enable_selinux": False,
        "max_container_log_line_size": 16384,
        "cni": cri["cni"],
        "containerd": {
            "default_runtime_name": old["default_runtime_name"],
            "ignore_blockio_not_enabled_errors": False,
            "runtimes": old["runtimes"],
        },
    }
    plugins["io.containerd.grpc.v1.cri"] = {"disable_tcp_service": True, "stream_server_address": "127.0.0.1"}
    doc["version"] = 3
    return doc


@dataclass
class ContainerdCase:
    installed: str
    text: TomlText | None  # None: no config.toml
    opts: ConfigureOptions


@st.composite
def containerd_options(draw: st.DrawFn, version: int) -> ConfigureOptions:
    return ConfigureOptions(
        runtime_name=draw(st.sampled_from(RUNTIME_NAMES)),
        runtime_path=draw(st.sampled_from(RUNTIME_PATHS)),
        set_as_default=draw(st.booleans()),
        cdi=draw(st.booleans()),
        drop_in=draw(st.sampled_from((None, None, CONTAINERD_DROPIN))) if version > 1 else None,
    )


@st.composite
def runc_like(
    draw: st.DrawFn, binary: str | None, cgroup: Any, base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    entry: dict[str, Any] = copy.deepcopy(dict(base)) if base is not None else {"runtime_type": RUNC_V2}
    options: dict[str, Any] = entry.setdefault("options", {})
    if binary is not None:
        options["BinaryName"] = binary
    options.pop("SystemdCgroup", None)
    if cgroup is not MISSING:
        options["SystemdCgroup"] = cgroup
    for key in draw(st.lists(st.sampled_from(sorted(RUNC_OPTION_VALUES)), max_size=3, unique=True)):
        if key != "BinaryName" or binary is None:
            options[key] = draw(RUNC_OPTION_VALUES[key])
    if not options and draw(st.booleans()):
        del entry["options"]
    return entry


@st.composite
def existing_nvidia(draw: st.DrawFn) -> dict[str, Any]:
    """An nvidia runtime someone (nvidia-ctk, a guide, gpunode itself) wrote before."""
    entry: dict[str, Any] = {}
    runtime_type = draw(st.sampled_from((MISSING, RUNC_V2, RUNC_V2, "io.containerd.runtime.v1.linux")))
    if runtime_type is not MISSING:
        entry["runtime_type"] = runtime_type
    if draw(st.booleans()):
        entry["privileged_without_host_devices"] = draw(st.booleans())
    options: dict[str, Any] = {}
    binary = draw(st.sampled_from((MISSING, *OLD_NVIDIA_PATHS)))
    if binary is not MISSING:
        options["BinaryName"] = binary
    cgroup = draw(st.sampled_from((MISSING, True, False)))
    if cgroup is not MISSING:
        options["SystemdCgroup"] = cgroup
    if draw(st.booleans()):
        options[draw(extra_keys)] = draw(scalars)
    keep_empty = draw(st.booleans())
    if options or keep_empty:
        entry["options"] = options
    return entry


@st.composite
def containerd_docs(draw: st.DrawFn, version: int, name: str, shapes: Sequence[str]) -> dict[str, Any]:
    shape = draw(st.sampled_from(shapes))
    doc: dict[str, Any]
    if shape == "stock":
        doc = stock_config(version)
    elif shape == "minimal":
        doc = {"version": version, "plugins": {CRI_PATHS[version][1]: {"containerd": {}}}}
    else:
        doc = {"version": version, "root": "/var/lib/containerd"}
    if version == 1 and draw(st.booleans()):
        del doc["version"]  # a file with content and no version is version 1
    cri = get(doc, CRI_PATHS[version])
    if cri is not MISSING:
        ctd = cri.setdefault("containerd", {})
        runtimes: dict[str, Any] = ctd.pop("runtimes", {})
        stock_runc = runtimes.get("runc")
        # The cgroup driver is the node's (kubelet's): runc-type runtimes agree on SystemdCgroup. A node where
        # they disagree is test_mixed_systemd_cgroup_default_is_consistent_with_the_reader's.
        cgroup = draw(st.sampled_from((True, False, MISSING)))
        runtimes = {}
        # Hand-written files often have no runtimes table at all (containerd's built-in runc).
        some = stock_runc is not None or draw(st.booleans())
        if stock_runc is not None or (some and draw(st.booleans())):
            runtimes["runc"] = draw(runc_like(None, cgroup, stock_runc))
        if some and draw(st.booleans()):
            runtimes["crun"] = draw(runc_like("/usr/bin/crun", cgroup))
        if some and draw(st.booleans()):
            runtimes["kata"] = {
                "runtime_type": "io.containerd.kata.v2",
                "privileged_without_host_devices": True,
                "options": {"ConfigPath": "/opt/kata/share/defaults/kata-containers/configuration.toml"},
            }
        if some and draw(st.booleans()):
            runtimes[name] = draw(existing_nvidia())
        # An empty runtimes table would leave containerd without runc: a broken input, not generated.
        if runtimes:
            ctd["runtimes"] = runtimes
        defined = list(runtimes) if runtimes else ["runc"]
        # Without default_runtime_name the default is runc, which must then be defined.
        default = draw(st.sampled_from((MISSING, *defined) if "runc" in defined else defined))
        ctd.pop("default_runtime_name", None)
        if default is not MISSING:
            ctd["default_runtime_name"] = default
        cdi = draw(st.sampled_from((MISSING, False, True)))
        if cdi is not MISSING:
            cri["enable_cdi"] = cdi
        cri.update(draw(st.dictionaries(extra_keys, toml_values, max_size=2)))
        ctd.update(draw(st.dictionaries(extra_keys, toml_values, max_size=2)))
        # Reorder: the runtimes often come first or last in hand-written files.
        if draw(st.booleans()):
            for key in [k for k in ctd if k != "runtimes"]:
                ctd[key] = ctd.pop(key)
    top = draw(st.dictionaries(extra_keys, toml_values, max_size=3))
    doc = {
        **{k: v for k, v in doc.items() if not isinstance(v, dict)},
        **top,
        **{k: v for k, v in doc.items() if isinstance(v, dict)},
    }
    for key, table in draw(
        st.dictionaries(extra_keys, st.dictionaries(extra_keys, toml_values, max_size=3), max_size=2)
    ).items():
        doc.setdefault(key, table)
    if "plugins" in doc and draw(st.booleans()):
        doc["plugins"][draw(dotted_keys)] = draw(st.dictionaries(extra_keys, toml_values, max_size=3))
    # Tables in any order: the one gpunode edits is sometimes the last of the file.
    tables = draw(st.permutations([k for k, v in doc.items() if isinstance(v, dict)]))
    return {**{k: v for k, v in doc.items() if not isinstance(v, dict)}, **{k: doc[k] for k in tables}}


@st.composite
def containerd_cases(
    draw: st.DrawFn, version: int, shapes: Sequence[str] = ("stock", "minimal", "bare")
) -> ContainerdCase:
    """A config of `version`: the stock `containerd config default` reworked, a small hand-written one
    ("minimal": the CRI table only; "bare": no CRI table), or (versions 2, 3) none, or comments only."""
    installed = CONTAINERD_2_0 if version == 3 else CONTAINERD_1_6
    opts = draw(containerd_options(version))
    style = draw(toml_styles)
    # Files with no content take the installed containerd's version: only for versions 2 and 3.
    kinds = ("doc",) if version == 1 else ("doc", "doc", "doc", "doc", "missing", "comments")
    kind = draw(st.sampled_from(kinds))
    if kind == "missing":
        return ContainerdCase(installed, None, opts)
    if kind == "comments":
        return ContainerdCase(installed, comments_only(style), opts)
    return ContainerdCase(
        installed,
        render_toml(
            draw(containerd_docs(version, opts.runtime_name, shapes)),
            style,
            [
                (*CRI_PATHS[version], "containerd", "runtimes", n, "options")
                for n in (opts.runtime_name, "runc")
            ],
        ),
        opts,
    )


def reference_runtime(runtimes: Mapping[str, Any], default: str, name: str) -> Mapping[str, Any] | None:
    """The runtime whose options the new one must copy: the default, else runc, else crun (runc type)."""
    for candidate in (default, "runc", "crun"):
        entry = runtimes.get(candidate)
        if candidate != name and isinstance(entry, Mapping) and entry.get("runtime_type", RUNC_V2) == RUNC_V2:
            return entry
    return None


def check_containerd(case: ContainerdCase) -> None:
    opts = case.opts
    name = opts.runtime_name
    source = case.text.text if case.text is not None else None
    before = tomlread.loads(source or "")
    installed_major = 2 if case.installed == CONTAINERD_2_0 else 1
    version = before.get("version", 1) if before else (3 if installed_major == 2 else 2)
    cri = CRI_PATHS[version]
    runtimes_path = (*cri, "containerd", "runtimes")
    entry_path = (*runtimes_path, name)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        put(root, CONTAINERD_CONFIG, source)
        host = make_host(root, case.installed)
        originals = {CONTAINERD_CONFIG: host.read_bytes(CONTAINERD_CONFIG)}
        if opts.drop_in:
            originals[opts.drop_in] = None
        loaded_before = containerd.load_config(host, CONTAINERD_CONFIG, (installed_major, 0))
        # An nvidia runtime without runc's SystemdCgroup is an input gpunode must repair; others are broken.
        broken = [p for p in containerd.read_state(host).problems if "SystemdCgroup" not in p]
        assert not broken, f"the generator made an input containerd refuses: {broken}"
        if opts.cdi and version == 1:
            try:
                configure.plan_configure(host, "containerd", opts)
            except ConfigError as err:
                assert "version 1" in err.message
            else:
                raise AssertionError("CDI on a version 1 file was not refused")
            assert host.read_bytes(CONTAINERD_CONFIG) == originals[CONTAINERD_CONFIG]
            return

        plan = configure.plan_configure(host, "containerd", opts)
        changed = configure.apply(host, plan, restart=False).changed
        assert_no_temp_files(root)
        output = (root / CONTAINERD_CONFIG.lstrip("/")).read_text()
        after_main = tomlread.loads(output)
        if case.text is not None:
            assert_comments_kept(case.text, output)

        # The readers see what was asked for.
        state = containerd.read_state(host)
        assert not state.problems, state.problems
        assert state.version == version
        assert name in state.runtimes
        assert state.nvidia_runtime == name
        assert state.nvidia_binary == opts.runtime_path
        if opts.set_as_default:
            assert state.default_runtime == name and state.nvidia_is_default
        if opts.cdi:
            assert state.cdi_enabled is True

        # The effective configuration (imports merged): nvidia as asked, everything else as before.
        merged = containerd.load_config(host, CONTAINERD_CONFIG, (installed_major, 0)).merged
        entry = get(merged, entry_path)
        assert entry["runtime_type"] == RUNC_V2
        assert entry["options"]["BinaryName"] == opts.runtime_path
        old_runtimes = get(before, runtimes_path)
        old_runtimes = old_runtimes if isinstance(old_runtimes, Mapping) else {}
        default_before = get(before, (*cri, "containerd", "default_runtime_name"))
        reference = reference_runtime(
            old_runtimes, default_before if default_before is not MISSING else "runc", name
        )
        ref_options: Mapping[str, Any] = (reference or {}).get("options", {})
        if name not in old_runtimes:
            for key, value in (reference or {}).items():
                # runtime_engine / runtime_root are the v1 shim's own: never copied onto a runc v2 runtime.
                if key not in ("options", "runtime_type", "runtime_engine", "runtime_root"):
                    assert entry[key] == value, f"{key} of the default runtime was not copied"
            for key, value in ref_options.items():
                if key != "BinaryName":
                    assert entry["options"][key] == value, (
                        f"option {key} of the default runtime was not copied"
                    )
        if ref_options.get("SystemdCgroup") is True:
            assert entry["options"]["SystemdCgroup"] is True
        if get(before, runtimes_path) is MISSING:
            # runc was built in; a runtimes table holding only nvidia would drop it.
            assert get(merged, (*runtimes_path, "runc", "runtime_type")) == RUNC_V2, "runc was lost"
        owned = [(*entry_path, "runtime_type"), (*entry_path, "options", "BinaryName")]
        if ref_options.get("SystemdCgroup") is True:
            owned.append((*entry_path, "options", "SystemdCgroup"))
        if opts.set_as_default:
            owned.append((*cri, "containerd", "default_runtime_name"))
        if opts.cdi:
            owned.append((*cri, "enable_cdi"))
        assert_kept(loaded_before.merged, merged, [*owned, ("imports",)] if opts.drop_in else owned)
        if opts.drop_in:
            assert after_main["imports"][-1] == opts.drop_in
            assert_kept(before, after_main, [("imports",)])
            assert (
                get(before, ("imports",)) in (MISSING, []) or after_main["imports"][:-1] == before["imports"]
            )
        else:
            assert_kept(before, after_main, owned)

        assert_idempotent(host, root, "containerd", opts)
        assert_reverts(host, root, "containerd", originals, changed=changed)
        assert_no_temp_files(root)


@settings(PROPERTY_SETTINGS, max_examples=50)
@given(containerd_cases(2, ("stock",)))
def test_containerd_v2_stock_configure_properties(case: ContainerdCase) -> None:
    """The most common real input, `containerd config default > config.toml`, reworked and reformatted."""
    check_containerd(case)


# Small files are cheap to run, so they get many examples: hand-written configs vary most.
@settings(PROPERTY_SETTINGS, max_examples=200)
@given(containerd_cases(2, ("minimal", "bare")))
def test_containerd_v2_configure_properties(case: ContainerdCase) -> None:
    check_containerd(case)


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(containerd_cases(1))
def test_containerd_v1_configure_properties(case: ContainerdCase) -> None:
    check_containerd(case)


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(containerd_cases(3))
def test_containerd_v3_configure_properties(case: ContainerdCase) -> None:
    check_containerd(case)


# -- docker -----------------------------------------------------------------------------------------

json_scalars: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
DOCKER_KEYS = (
    "log-driver",
    "log-opts",
    "storage-driver",
    "data-root",
    "exec-opts",
    "registry-mirrors",
    "insecure-registries",
    "live-restore",
    "default-ulimits",
    "default-address-pools",
    "builder",
    "dns",
    "mtu",
)
UNKNOWN_DOCKER_KEY = "x-not-a-dockerd-key"  # dockerd refuses to start with it, so gpunode must refuse too


@dataclass
class DockerCase:
    text: str | None
    opts: ConfigureOptions


@st.composite
def docker_cases(draw: st.DrawFn) -> DockerCase:
    opts = ConfigureOptions(
        runtime_name=draw(st.sampled_from(RUNTIME_NAMES)),
        runtime_path=draw(st.sampled_from(RUNTIME_PATHS)),
        set_as_default=draw(st.booleans()),
        cdi=draw(st.booleans()),
    )
    kind = draw(st.sampled_from(("doc", "doc", "doc", "doc", "missing", "empty")))
    if kind == "missing":
        return DockerCase(None, opts)
    if kind == "empty":
        return DockerCase(draw(st.sampled_from(("", "\n", "  \n\t"))), opts)
    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(DOCKER_KEYS), max_size=5, unique=True)):
        doc[key] = draw(json_values)
    if draw(st.integers(0, 9)) == 0:
        doc[UNKNOWN_DOCKER_KEY] = draw(json_values)
    runtimes: dict[str, Any] = {}
    for other in draw(
        st.lists(st.sampled_from(("crun", "runsc", "kata", opts.runtime_name)), max_size=3, unique=True)
    ):
        binary = "/opt/old/nvidia-container-runtime" if other == opts.runtime_name else f"/usr/bin/{other}"
        entry: dict[str, Any] = {"path": binary}
        if draw(st.booleans()):
            entry["runtimeArgs" if draw(st.booleans()) else "args"] = draw(st.lists(texts, max_size=2))
        runtimes[other] = entry
    keep_empty = draw(st.booleans())
    if runtimes or keep_empty:
        doc["runtimes"] = runtimes
    default = draw(st.sampled_from((MISSING, "runc", "io.containerd.runc.v2", opts.runtime_name, *runtimes)))
    if default is not MISSING:
        doc["default-runtime"] = default
    if draw(st.booleans()):
        doc["features"] = draw(
            st.dictionaries(
                st.sampled_from(("buildkit", "containerd-snapshotter", "cdi")), st.booleans(), max_size=3
            )
        )
    doc = {k: doc[k] for k in draw(st.permutations(list(doc)))}
    indent = draw(st.sampled_from((None, 2, 4, "\t")))
    separators = (",", ":") if indent is None and draw(st.booleans()) else None
    text = json.dumps(doc, indent=indent, ensure_ascii=draw(st.booleans()), separators=separators)
    return DockerCase(text + draw(st.sampled_from(("", "\n", "\n\n"))), opts)


@PROPERTY_SETTINGS
@given(docker_cases())
def test_docker_configure_properties(case: DockerCase) -> None:
    opts = case.opts
    name = opts.runtime_name
    path = docker.DAEMON_JSON
    before = json.loads(case.text) if case.text and case.text.strip() else {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        put(root, path, case.text)
        host = make_host(root)
        if UNKNOWN_DOCKER_KEY in before:
            try:
                configure.plan_configure(host, "docker", opts)
            except ConfigError as err:
                assert UNKNOWN_DOCKER_KEY in err.message
            else:
                raise AssertionError("a daemon.json dockerd refuses was accepted")
            assert host.read_text(path) == case.text
            return
        plan = configure.plan_configure(host, "docker", opts)
        changed = configure.apply(host, plan, restart=False).changed
        assert_no_temp_files(root)
        output = (root / path.lstrip("/")).read_text()
        after = json.loads(output)
        assert output.endswith("\n")

        state = docker.read_state(host)
        assert not state.problems, state.problems
        assert state.nvidia_runtime == name and state.nvidia_binary == opts.runtime_path
        if opts.set_as_default:
            assert state.default_runtime == name and state.nvidia_is_default
        if opts.cdi:
            assert state.cdi_enabled is True
        owned: list[tuple[str, ...]] = [("runtimes", name, "path")]
        if opts.set_as_default:
            owned.append(("default-runtime",))
        if opts.cdi:
            owned.append(("features", "cdi"))
        assert_kept(before, after, owned)
        if name not in before.get("runtimes", {}):
            assert after["runtimes"][name] == {"path": opts.runtime_path}
        # The file's own layout is kept: one line stays one line, an indented file keeps its indent.
        if case.text and case.text.strip() and "\n" not in case.text.strip():
            assert "\n" not in output.strip()

        assert_idempotent(host, root, "docker", opts)
        original = case.text.encode() if case.text is not None else None
        assert_reverts(host, root, "docker", {path: original}, changed=changed)


# -- CRI-O ------------------------------------------------------------------------------------------

CRIO_RUNTIMES: Mapping[str, dict[str, Any]] = {
    "runc": {"runtime_path": "", "runtime_type": "oci", "runtime_root": "/run/runc"},
    "crun": {
        "runtime_path": "/usr/bin/crun",
        "runtime_type": "oci",
        "runtime_root": "/run/crun",
        "monitor_path": "/usr/libexec/crio/conmon",
        "allowed_annotations": ["io.containers.trace-syscall"],
    },
    "kata": {
        "runtime_path": "/usr/bin/containerd-shim-kata-v2",  # CRI-O requires this name for a vm runtime
        "runtime_type": "vm",
        "runtime_root": "/run/vc",
        "privileged_without_host_devices": True,
    },
}
CRIO_DROPINS = ("01-storage.conf", "10-crio.conf", "20-custom.conf", "99-nvidia.toml", "99-zz-local.conf")
CRIO_ALT_DROPIN = f"{crio.DROPIN_DIR}/50-nvidia.conf"


@dataclass
class CrioCase:
    files: dict[str, TomlText]  # host path -> content
    opts: ConfigureOptions

    @property
    def target(self) -> str:
        if self.opts.in_place:
            return crio.CRIO_CONF
        return self.opts.drop_in or f"{crio.DROPIN_DIR}/99-nvidia.toml"


@st.composite
def crio_doc(draw: st.DrawFn, runtime_names: Sequence[str], name: str, main: bool) -> dict[str, Any]:
    runtime: dict[str, Any] = {}
    if main or draw(st.booleans()):
        runtime.update(
            draw(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "cgroup_manager": st.sampled_from(("systemd", "cgroupfs")),
                        "conmon_cgroup": st.just("pod"),
                        "selinux": st.booleans(),
                    },
                )
            )
        )
    defined = draw(st.lists(st.sampled_from(runtime_names), max_size=2, unique=True))
    if defined:
        table: dict[str, Any] = {}
        for runtime_name in defined:
            entry = copy.deepcopy(CRIO_RUNTIMES.get(runtime_name, {}))
            if runtime_name == name:
                entry = {"runtime_path": draw(st.sampled_from(OLD_NVIDIA_PATHS)), "runtime_type": "oci"}
            if draw(st.booleans()):
                entry[draw(extra_keys)] = draw(toml_values)
            table[runtime_name] = entry
        runtime["runtimes"] = table
    doc: dict[str, Any] = {"crio": {}}
    if main:
        doc["crio"].update({"root": "/var/lib/containers/storage", "log_dir": "/var/log/crio/pods"})
    doc["crio"].update(draw(st.dictionaries(extra_keys, toml_values, max_size=2)))
    if runtime:
        doc["crio"]["runtime"] = runtime
    if draw(st.booleans()):
        doc["crio"]["image"] = {
            "pause_image": "registry.k8s.io/pause:3.9",
            **draw(st.dictionaries(extra_keys, toml_values, max_size=2)),
        }
    if draw(st.booleans()):
        doc["crio"]["network"] = {"network_dir": "/etc/cni/net.d/", "plugin_dirs": ["/opt/cni/bin/"]}
    return doc


@st.composite
def crio_cases(draw: st.DrawFn) -> CrioCase:
    name = draw(st.sampled_from(RUNTIME_NAMES))
    mode = draw(st.sampled_from(("default", "default", "drop_in", "in_place")))
    opts = ConfigureOptions(
        runtime_name=name,
        runtime_path=draw(st.sampled_from(RUNTIME_PATHS)),
        set_as_default=draw(st.booleans()),
        cdi=draw(st.booleans()),
        drop_in=CRIO_ALT_DROPIN if mode == "drop_in" else None,
        in_place=mode == "in_place",
    )
    names = ("runc", "crun", "kata", name)
    docs: dict[str, dict[str, Any]] = {}
    if draw(st.booleans()) or mode == "in_place":
        docs[crio.CRIO_CONF] = draw(crio_doc(names, name, main=True))
    for dropin in draw(st.lists(st.sampled_from(CRIO_DROPINS), max_size=3, unique=True)):
        docs[f"{crio.DROPIN_DIR}/{dropin}"] = draw(crio_doc(names, name, main=False))
    # default_runtime may only name a runtime that is defined somewhere (else CRI-O does not start).
    defined = {n for d in docs.values() for n in d["crio"].get("runtime", {}).get("runtimes", {})}
    for path in sorted(docs):
        if draw(st.integers(0, 2)) == 0:
            runtime = docs[path]["crio"].setdefault("runtime", {})
            runtime["default_runtime"] = draw(st.sampled_from(sorted({"runc", "crun"} | defined)))
    edited = [(*crio.RUNTIMES_PATH, name)]
    files = {path: render_toml(doc, draw(toml_styles), edited) for path, doc in docs.items()}
    return CrioCase(files, opts)


def crio_conflict(case: CrioCase) -> bool:
    """Whether a file CRI-O reads after gpunode's would undo it (gpunode must refuse, not pretend)."""
    target = case.target
    for path, text in case.files.items():
        if path in (target, crio.CRIO_CONF) or (target != crio.CRIO_CONF and path <= target):
            continue
        doc = tomlread.loads(text.text)
        default = get(doc, ("crio", "runtime", "default_runtime"))
        if case.opts.set_as_default and default not in (MISSING, case.opts.runtime_name):
            return True
        if get(doc, (*crio.RUNTIMES_PATH, case.opts.runtime_name)) is not MISSING:
            return True
    return False


def crio_merged(files: Mapping[str, str]) -> dict[str, Any]:
    ordered = [crio.CRIO_CONF] if crio.CRIO_CONF in files else []
    ordered += sorted(p for p in files if p != crio.CRIO_CONF)
    merged: dict[str, Any] = {}
    for path in ordered:
        merged = crio.merge_dropin(merged, tomlread.loads(files[path]))
    return merged


@PROPERTY_SETTINGS
@given(crio_cases())
def test_crio_configure_properties(case: CrioCase) -> None:
    opts = case.opts
    name = opts.runtime_name
    target = case.target
    entry_path = (*crio.RUNTIMES_PATH, name)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for path, text in case.files.items():
            put(root, path, text.text)
        if opts.drop_in:
            # gpunode creates only its standard drop-in's directory; one named with --drop-in must exist.
            (root / crio.DROPIN_DIR.lstrip("/")).mkdir(parents=True, exist_ok=True)
        host = make_host(root)
        before_files = snapshot(root)
        merged_before = crio_merged({p: t.text for p, t in case.files.items()})
        try:
            plan = configure.plan_configure(host, "crio", opts)
        except ConfigError as err:
            assert crio_conflict(case), f"refused without a reason: {err.message}"
            assert snapshot(root) == before_files
            return
        assert not crio_conflict(case), "a later drop-in overrides gpunode's, and gpunode did not say so"
        assert [c.path for c in plan.pending] in ([target], [])
        changed = configure.apply(host, plan, restart=False).changed
        assert_no_temp_files(root)
        after_files = {
            p: (root / p.lstrip("/")).read_text()
            for p in [*case.files, target]
            if (root / p.lstrip("/")).exists()
        }
        for rel, (data, _) in before_files.items():
            if "/" + rel != target:
                assert (root / rel).read_bytes() == data, f"/{rel} was changed"
        output = after_files[target]
        after_target = tomlread.loads(output)
        if target in case.files:
            assert_comments_kept(case.files[target], output)

        state = crio.read_state(host)
        assert not state.problems, state.problems
        assert state.nvidia_runtime == name and state.nvidia_binary == opts.runtime_path
        if opts.set_as_default:
            assert state.default_runtime == name and state.nvidia_is_default
        merged_after = crio_merged(after_files)
        owned: list[tuple[str, ...]] = [(*entry_path, "runtime_path"), (*entry_path, "runtime_type")]
        if opts.set_as_default:
            owned.append(("crio", "runtime", "default_runtime"))
        assert_kept(merged_before, merged_after, owned)
        before_target = tomlread.loads(case.files[target].text) if target in case.files else {}
        assert_kept(before_target, after_target, owned)
        if get(before_target, entry_path) is MISSING:
            # The entry replaces any earlier one whole: it carries what that one (or the default) had.
            runtimes = get(merged_before, crio.RUNTIMES_PATH)
            runtimes = runtimes if isinstance(runtimes, Mapping) else {}
            default = crio.default_runtime(merged_before, runtimes)
            base = runtimes.get(name)
            if base is None:
                base = next(
                    (
                        runtimes[c]
                        for c in (default, "crun", "runc")
                        if c != name and c in runtimes and runtimes[c].get("runtime_type", "oci") == "oci"
                    ),
                    {},
                )
            entry = get(merged_after, entry_path)
            for key, value in base.items():
                if key not in ("runtime_path", "runtime_type"):
                    assert entry[key] == value, f"{key} of the reference runtime was not copied"
            assert entry["runtime_type"] == "oci"

        assert_idempotent(host, root, "crio", opts)
        originals: dict[str, bytes | None] = {
            target: case.files[target].text.encode() if target in case.files else None
        }
        assert_reverts(host, root, "crio", originals, changed=changed)
        for rel, (data, _) in before_files.items():
            assert (root / rel).read_bytes() == data


# -- what the generators above leave out, each shown once -------------------------------------------


@pytest.mark.parametrize(
    ("runtime", "path", "text"),
    [
        (
            "containerd",
            CONTAINERD_CONFIG,
            'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n'
            'containerd = { snapshotter = "overlayfs" }\n',
        ),
        ("crio", f"{crio.DROPIN_DIR}/99-nvidia.toml", '[crio]\nruntime = { default_runtime = "crun" }\n'),
    ],
    ids=["containerd", "crio"],
)
def test_inline_table_on_the_edited_path_is_not_an_internal_error(
    runtime: str, path: str, text: str, tmp_path: Path
) -> None:
    """Valid TOML with an inline table where gpunode adds a table: configure it, or refuse with a clear
    error; not tomlkit's ValueError ("Inline tables cannot contain a table") shown as a bug in gpunode."""
    put(tmp_path, path, text)
    code = main(["configure-runtime", runtime, "--no-restart"], host=make_host(tmp_path))
    assert code != ExitCode.INTERNAL
    if code == ExitCode.OK:
        state = (containerd.read_state if runtime == "containerd" else crio.read_state)(make_host(tmp_path))
        assert state.nvidia_runtime == "nvidia"
    else:
        assert code == ExitCode.CONFIG
        assert (tmp_path / path.lstrip("/")).read_text() == text


MIXED_CGROUPS = """version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
default_runtime_name = "crun"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
SystemdCgroup = true
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun]
runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun.options]
BinaryName = "/usr/bin/crun"
"""


def test_mixed_systemd_cgroup_default_is_consistent_with_the_reader(tmp_path: Path) -> None:
    """crun is the default without SystemdCgroup, runc has it. The editor copies the previous default's
    options (crun's) into nvidia; once nvidia is the default, the reader used to compare nvidia with runc
    and report a problem: doctor failed on the file gpunode had just written, and a second run added
    SystemdCgroup. Editor and reader agree, and the second run changes nothing."""
    put(tmp_path, CONTAINERD_CONFIG, MIXED_CGROUPS)
    host = make_host(tmp_path)
    assert not containerd.read_state(host).problems
    opts = ConfigureOptions(set_as_default=True)
    configure.apply(host, configure.plan_configure(host, "containerd", opts), restart=False)
    state = containerd.read_state(host)
    assert state.nvidia_is_default
    assert not state.problems, state.problems
    written = (tmp_path / CONTAINERD_CONFIG.lstrip("/")).read_text()
    assert "SystemdCgroup" not in tomlread.loads(written)["plugins"]["io.containerd.grpc.v1.cri"][
        "containerd"
    ]["runtimes"]["nvidia"].get("options", {})
    again = configure.plan_configure(host, "containerd", opts)
    assert not again.pending, again
    assert (tmp_path / CONTAINERD_CONFIG.lstrip("/")).read_text() == written


NVIDIA_NO_CGROUP = (
    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
    'runtime_type = "io.containerd.runc.v2"\n'
    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
    'BinaryName = "/usr/bin/nvidia-container-runtime"\n'
)
KATA_DEFAULT = (
    'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\ndefault_runtime_name = "kata"\n'
    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]\nruntime_type = "io.containerd.kata.v2"\n'
    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n'
    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\nSystemdCgroup = true\n'
) + NVIDIA_NO_CGROUP
LEGACY_DEFAULT = (
    'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nsystemd_cgroup = true\n'
    '[plugins."io.containerd.grpc.v1.cri".containerd]\ndefault_runtime_name = "runc"\n'
    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
    'runtime_type = "io.containerd.runtime.v1.linux"\n'
) + NVIDIA_NO_CGROUP


@pytest.mark.parametrize(
    ("text", "reference"), [(KATA_DEFAULT, "runc"), (LEGACY_DEFAULT, "runc")], ids=["kata", "legacy-v1"]
)
def test_doctor_and_the_editor_read_the_same_reference_runtime(
    tmp_path: Path, text: str, reference: str
) -> None:
    """A Kata default is no model (runc is), and a legacy v1-shim default has SystemdCgroup through the CRI
    plugin's systemd_cgroup: doctor reports what configure-runtime repairs, and nothing after it."""
    put(tmp_path, CONTAINERD_CONFIG, text)
    host = make_host(tmp_path)
    (problem,) = containerd.read_state(host).problems
    assert f'lacks `SystemdCgroup = true` while "{reference}" has it' in problem
    plan = configure.plan_configure(host, "containerd", ConfigureOptions())
    assert any(f'as "{reference}" has it' in m for m in plan.messages), plan.messages
    configure.apply(host, plan, restart=False)
    assert not containerd.read_state(host).problems
    assert not configure.plan_configure(host, "containerd", ConfigureOptions()).pending


def test_systemd_cgroup_is_still_checked_once_nvidia_is_the_default(tmp_path: Path) -> None:
    """Where the other runtimes agree (runc and crun with SystemdCgroup), an nvidia default without it is
    reported, and configure-runtime adds it."""
    agreeing = MIXED_CGROUPS.replace(
        'BinaryName = "/usr/bin/crun"', 'BinaryName = "/usr/bin/crun"\nSystemdCgroup = true'
    )
    broken = agreeing.replace('default_runtime_name = "crun"', 'default_runtime_name = "nvidia"') + (
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        'runtime_type = "io.containerd.runc.v2"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        'BinaryName = "/usr/bin/nvidia-container-runtime"\n'
    )
    put(tmp_path, CONTAINERD_CONFIG, broken)
    host = make_host(tmp_path)
    (problem,) = containerd.read_state(host).problems
    assert 'runtime "nvidia" lacks `SystemdCgroup = true` while "runc" has it' in problem
    plan = configure.plan_configure(host, "containerd", ConfigureOptions(set_as_default=True))
    assert any('added SystemdCgroup = true to "nvidia", as "runc" has it' in m for m in plan.messages), plan
    configure.apply(host, plan, restart=False)
    assert not containerd.read_state(host).problems


@pytest.mark.parametrize(
    ("runtime", "path", "text"),
    [
        (
            "containerd",
            CONTAINERD_CONFIG,
            'version = 2\n[plugins]\n  [plugins."io.containerd.grpc.v1.cri"]\n'
            '    [plugins."io.containerd.grpc.v1.cri".containerd]\n      default_runtime_name = "runc"',
        ),
        (
            "containerd",
            CONTAINERD_CONFIG,
            'version = 2\n[plugins]\n  [plugins."io.containerd.grpc.v1.cri"]\n'
            '    [plugins."io.containerd.grpc.v1.cri".containerd]\n# the last line is a comment',
        ),
        (
            "crio",
            f"{crio.DROPIN_DIR}/99-nvidia.toml",
            '[crio]\n  [crio.runtime]\n    default_runtime = "crun"',
        ),
    ],
    ids=["containerd-key", "containerd-comment", "crio"],
)
def test_an_indented_file_without_a_final_newline_stays_valid(
    runtime: str, path: str, text: str, tmp_path: Path
) -> None:
    """The new table's header must start on a line of its own. Glued to the last line it makes invalid
    TOML (containerd and CRI-O refuse to start) or, after a comment, turns the header into comment text."""
    put(tmp_path, path, text)
    assert main(["configure-runtime", runtime, "--no-restart"], host=make_host(tmp_path)) == ExitCode.OK
    output = (tmp_path / path.lstrip("/")).read_text()
    assert output.startswith(text + "\n")
    tomlread.loads(output)
    state = (containerd.read_state if runtime == "containerd" else crio.read_state)(make_host(tmp_path))
    assert state.nvidia_runtime == "nvidia"


@pytest.mark.parametrize(
    ("runtime", "path", "text", "in_place"),
    [
        (
            "containerd",
            CONTAINERD_CONFIG,
            'version = 1\n[plugins.cri]\ncontainerd.snapshotter = "overlayfs"\n',
            False,
        ),
        (
            "containerd",
            CONTAINERD_CONFIG,
            'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\ncontainerd.snapshotter = "overlayfs"\n',
            False,
        ),
        ("crio", crio.CRIO_CONF, '[crio]\nruntime.default_runtime = "crun"\n', True),
    ],
    ids=["containerd-v1", "containerd-v2", "crio-in-place"],
)
def test_dotted_keys_on_the_edited_path_keep_the_runtime_in_its_table(
    runtime: str, path: str, text: str, in_place: bool, tmp_path: Path
) -> None:
    """A table defined by dotted keys (`containerd.snapshotter = ...` inside the CRI table) is still that
    table: the runtime gpunode adds belongs under it, not in a new top-level [containerd.runtimes...] /
    [runtime.runtimes...] table that the runtime never reads (what tomlkit writes). Configure it there, or
    refuse clearly and leave the file alone."""
    put(tmp_path, path, text)
    args = ["configure-runtime", runtime, "--no-restart", *(["--in-place"] if in_place else [])]
    code = main(args, host=make_host(tmp_path))
    if code == ExitCode.OK:
        state = (containerd.read_state if runtime == "containerd" else crio.read_state)(make_host(tmp_path))
        assert state.nvidia_runtime == "nvidia", (tmp_path / path.lstrip("/")).read_text()
    else:
        assert code == ExitCode.CONFIG
        assert (tmp_path / path.lstrip("/")).read_text() == text


# Valid TOML (tomllib and containerd read it) that tomlkit fails on: an indented header, then the runtimes
# table continued after another table.
SPLIT_RUNTIMES = """version = 2
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]
[plugins."io.example.v1.other"]
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
SystemdCgroup = true
"""


def test_a_valid_file_tomlkit_cannot_edit_is_not_reported_as_invalid_toml(tmp_path: Path) -> None:
    """tomlkit fails on this valid layout (OutOfOrderTableProxy): the operator is told the file is valid,
    what to move, and that nothing changed; not that the file containerd runs with is broken."""
    tomlread.loads(SPLIT_RUNTIMES)
    put(tmp_path, CONTAINERD_CONFIG, SPLIT_RUNTIMES)
    with pytest.raises(ConfigError) as info:
        configure.plan_configure(make_host(tmp_path), "containerd", ConfigureOptions())
    err = info.value
    assert "is not valid TOML" not in err.message, f"a valid file is blamed: {err.message}"
    assert err.message.startswith(f"{CONTAINERD_CONFIG} is valid TOML, but gpunode's TOML editor")
    assert "nothing was changed" in err.message
    # tomlkit's line is where it gave up (here the key under the table to move): none is named.
    assert err.fix is not None and not re.search(r"line \d", err.message + err.fix)
    assert "sub-tables together" in err.fix
    code = main(["configure-runtime", "containerd", "--no-restart"], host=make_host(tmp_path))
    assert code == ExitCode.CONFIG
    assert (tmp_path / CONTAINERD_CONFIG.lstrip("/")).read_text() == SPLIT_RUNTIMES


def test_a_valid_file_tomlkit_cannot_edit_is_still_read(tmp_path: Path) -> None:
    """Reading needs no editor: doctor and status read the file as containerd does (tomllib), with no
    problem and the runtimes it defines."""
    put(tmp_path, CONTAINERD_CONFIG, SPLIT_RUNTIMES)
    state = containerd.read_state(make_host(tmp_path))
    assert not state.problems, state.problems
    assert read_toml(SPLIT_RUNTIMES, CONTAINERD_CONFIG) == tomlread.loads(SPLIT_RUNTIMES)
    with pytest.raises(ConfigError, match="is not valid TOML"):
        read_toml(SPLIT_RUNTIMES + "[\n", CONTAINERD_CONFIG)


def test_a_broken_file_is_still_reported_as_invalid_toml(tmp_path: Path) -> None:
    broken = SPLIT_RUNTIMES.replace("SystemdCgroup = true", "SystemdCgroup = ")
    with pytest.raises(tomlread.TOMLDecodeError):
        tomlread.loads(broken)
    put(tmp_path, CONTAINERD_CONFIG, broken)
    with pytest.raises(ConfigError) as info:
        configure.plan_configure(make_host(tmp_path), "containerd", ConfigureOptions())
    assert info.value.message.startswith(f"{CONTAINERD_CONFIG} is not valid TOML")
