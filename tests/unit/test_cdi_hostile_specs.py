"""Third-party files in the CDI spec directories, however broken or hostile: each is skipped as the runtimes
skip it (containerd and CRI-O log and go on), with one warning naming the file and the problem, and never
stops `cdi list`, `cdi check` or the plugin's check of its devices (a crash there is a plugin that never
starts: a crash loop under systemd, no GPUs advertised).

The property tests build spec documents with a value of the wrong type (or a hostile one) put at every
level, and feed the reader text and bytes of every shape: the reader answers with problems or a ConfigError
naming the file, never another exception."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunode.cdi import spec as cdispec
from gpunode.cdi.registry import list_devices, read_specs, unresolvable
from gpunode.cli.main import main
from gpunode.errors import ConfigError, ExitCode
from gpunode.host import Host, ScriptedRunner
from tests import cdinode


def _alias_bomb(levels: int = 9) -> str:
    """Nine levels of nine aliases: 1.8 KB of text, 9**9 values to whoever walks it."""
    text = 'a0: &a0 ["x","x","x","x","x","x","x","x","x"]\n'
    for level in range(1, levels + 1):
        text += f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 9)}]\n"
    return text


def _with_devices(value: str) -> str:
    return f'cdiVersion: "0.5.0"\nkind: nvidia.com/gpu\n{value}\n'


# name -> (file name, content); each is a file the runtimes skip.
HOSTILE: dict[str, tuple[str, bytes]] = {
    "devices-an-integer": ("a.yaml", _with_devices("devices: 5").encode()),
    "edits-a-list": ("a.yaml", _with_devices("devices: []\ncontainerEdits: []").encode()),
    "edits-a-list-with-items": ("a.yaml", _with_devices("devices: []\ncontainerEdits: [1, 2]").encode()),
    "device-edits-a-string": (
        "a.yaml",
        _with_devices("devices: [{name: x, containerEdits: 'nodes'}]").encode(),
    ),
    "device-nodes-an-integer": (
        "a.yaml",
        _with_devices("devices: [{name: x, containerEdits: {deviceNodes: 5}}]").encode(),
    ),
    "env-a-mapping": (
        "a.yaml",
        _with_devices("devices: [{name: x, containerEdits: {env: {A: 1}}}]").encode(),
    ),
    "mounts-of-integers": (
        "a.yaml",
        _with_devices("devices: []\ncontainerEdits: {mounts: [1, [2], null]}").encode(),
    ),
    "hooks-a-string": ("a.yaml", _with_devices("devices: []\ncontainerEdits: {hooks: run}").encode()),
    "a-list-document": ("a.yaml", b"- 1\n- 2\n"),
    "a-scalar-document": ("a.json", b"5"),
    "not-utf8": ("a.yaml", b"kind: \xff\xfe nvidia.com/gpu\n"),
    "alias-bomb": ("a.yaml", _alias_bomb().encode()),
    "self-alias": ("a.yaml", b"devices: &d [*d]\n"),
    "deep-json": ("a.json", b"[" * 100_000 + b"]" * 100_000),
    "deep-yaml": ("a.yaml", b"a:\n" + b"".join(b" " * i + b"- \n" for i in range(1, 300))),
    "huge-int": ("a.yaml", _with_devices("devices: []\nn: " + "9" * 5000).encode()),
    "bad-date": ("a.yaml", b"cdiVersion: 2001-13-45\n"),
    "python-tag": ("a.yaml", b"kind: !!python/object/apply:os.system ['true']\n"),
    "huge": ("a.json", b'{"devices": [' + b"0," * (5 * 2**20) + b"0]}"),
}


def node_host(root: Path) -> Host:
    return Host(root=root, runner=ScriptedRunner(), env={"PATH": "/usr/bin"})


@pytest.fixture
def node(tmp_path: Path) -> Host:
    """A node whose /var/run/cdi holds a valid spec of GPUs 0 and 1."""
    cdinode.write_spec(tmp_path / "var/run/cdi", ["0", "1"])
    return node_host(tmp_path)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_spec_is_skipped_with_one_warning(
    node: Host, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    name, content = HOSTILE[case]
    hostile = node.root / "etc/cdi" / name
    hostile.parent.mkdir(parents=True)
    hostile.write_bytes(content)
    files = {f.path: f for f in read_specs(node)}
    assert files[f"/etc/cdi/{name}"].problems, case
    assert all(len(p) < 400 for p in files[f"/etc/cdi/{name}"].problems)  # a value is shown short
    with caplog.at_level(logging.WARNING, logger="gpunode.cdi"):
        # The devices of the good spec are still found: the bad file costs nothing but its own devices.
        assert unresolvable(node, "nvidia.com/gpu", ["0", "1"]) == []
        assert unresolvable(node, "nvidia.com/gpu", ["0"]) == []  # read again: not said again
    lines = [r.getMessage() for r in caplog.records if r.name == "gpunode.cdi"]
    assert len(lines) == 1, lines
    assert f"/etc/cdi/{name}" in lines[0] and "skipped" in lines[0] and "\n" not in lines[0]


def test_files_that_are_not_regular_files_are_skipped(node: Host) -> None:
    spec_dir = node.root / "etc/cdi"
    spec_dir.mkdir(parents=True)
    os.mkfifo(spec_dir / "fifo.yaml")  # a reader that opened it would wait for a writer forever
    (spec_dir / "dir.json").mkdir()
    (spec_dir / "loop.yaml").symlink_to("loop.yaml")
    (spec_dir / "dangling.yaml").symlink_to("/nowhere.yaml")
    files = {f.path: f for f in read_specs(node)}
    for name in ("fifo.yaml", "dir.json", "loop.yaml", "dangling.yaml"):
        assert files[f"/etc/cdi/{name}"].problems, name
    assert "not a regular file" in files["/etc/cdi/fifo.yaml"].problems[0]
    assert unresolvable(node, "nvidia.com/gpu", ["0", "1"]) == []


def test_a_wrongly_typed_file_defines_no_device(node: Host) -> None:
    """A file with a valid device list but a wrong type elsewhere is skipped whole, as by the runtimes:
    its devices are not counted as defined (nor as a conflict with the good file)."""
    doc = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "major": "195"}]}},
        {"name": "7", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia7"}]}},
    ]}  # fmt: skip
    path = node.root / "var/run/cdi/other.json"
    path.write_text(json.dumps(doc))
    problems = {f.path: f.problems for f in read_specs(node)}["/var/run/cdi/other.json"]
    assert problems == ("devices[0].containerEdits.deviceNodes[0].major is a string ('195'), not an integer",)
    assert [d.state for d in list_devices(read_specs(node))] == ["ok", "ok"]  # no conflict on "0"
    assert unresolvable(node, "nvidia.com/gpu", ["0", "7"]) == ["7"]


def test_cdi_list_and_check_report_hostile_files_as_warnings(
    node: Host, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml(profile="pcie-4")
    spec_dir = node.root / "etc/cdi"
    spec_dir.mkdir(parents=True)
    for case in ("devices-an-integer", "edits-a-list", "not-utf8", "alias-bomb"):
        name, content = HOSTILE[case]
        (spec_dir / f"{case}-{name}").write_bytes(content)
    os.mkfifo(spec_dir / "fifo.yaml")
    (spec_dir / "loop.yaml").symlink_to("loop.yaml")  # a foreign self-loop: check refused the run (exit 4)
    assert main(["cdi", "list"], host=node) == ExitCode.OK
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    for case in ("devices-an-integer", "edits-a-list", "not-utf8", "alias-bomb"):
        assert f"/etc/cdi/{case}-" in out and "ignored by the runtimes" in out
    assert main(["cdi", "list", "--json"], host=node) == ExitCode.OK
    listed = json.loads(capsys.readouterr().out)
    assert sum(1 for f in listed["files"] if f["problems"]) == 6
    assert main(["cdi", "check", "--json"], host=node) != ExitCode.CONFIG
    checks = json.loads(capsys.readouterr().out)["checks"]
    warned = [c for c in checks if c["id"] == "cdi.files"]
    assert len(warned) == 6 and all(c["status"] == "warn" for c in warned)
    assert any("/etc/cdi/loop.yaml" in c["summary"] for c in warned)


# -- property tests ------------------------------------------------------------------------------------

# Any value a YAML or JSON document can hold (YAML's dates and floats too), small and nested.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.dates(),
    st.binary(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4),
    ),
    max_leaves=12,
)


def _valid_doc() -> dict[str, Any]:
    return {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "annotations": {"a": "b"},
        "containerEdits": {
            "env": ["A=1"],
            "mounts": [{"hostPath": "/a", "containerPath": "/a", "options": ["ro"], "type": "bind"}],
            "hooks": [{"hookName": "createContainer", "path": "/bin/true", "args": ["true"], "env": ["B=2"]}],
        },
        "devices": [
            {
                "name": "0",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "major": 195, "minor": 0}
                    ]
                },
            }
        ],
    }


def _slots(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in `doc` a value sits (the key or index path to it), the document itself included."""
    found = [path]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += _slots(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += _slots(value, (*path, i))
    return found


SLOTS = _slots(_valid_doc())


def _replaced(path: tuple[Any, ...], value: Any) -> Any:
    doc: Any = _valid_doc()
    if not path:
        return value
    holder = doc
    for step in path[:-1]:
        holder = holder[step]
    holder[path[-1]] = value
    return doc


def test_the_valid_document_has_no_problems() -> None:
    assert cdispec.structure_problems(_valid_doc()) == []
    assert len(SLOTS) > 30  # every level: the document, its fields, each list item and its fields


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SLOTS), _values)
def test_any_value_at_any_level_gives_problems_not_an_exception(path: tuple[Any, ...], value: Any) -> None:
    doc = _replaced(path, value)
    if not isinstance(doc, dict):
        return  # parse() refuses a document that is not a mapping (tested below)
    problems = cdispec.structure_problems(doc)
    assert isinstance(problems, list) and all(isinstance(p, str) and "\n" not in p for p in problems)
    assert len(problems) <= cdispec.MAX_PROBLEMS
    if not problems:  # then a runtime's decoder would take it: every field has its type
        assert cdispec.minimum_version(doc) in ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0")


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.sampled_from(SLOTS), _values)
def test_the_reader_takes_any_document_as_yaml_and_json(path: tuple[Any, ...], value: Any) -> None:
    import yaml

    doc = _replaced(path, value)
    texts = {"/etc/cdi/x.yaml": yaml.safe_dump(doc)}
    with contextlib.suppress(TypeError, ValueError):  # dates and bytes are YAML only
        texts["/etc/cdi/x.json"] = json.dumps(doc)
    for where, text in texts.items():
        try:
            parsed = cdispec.parse(text, where)
        except ConfigError as err:
            assert where in err.message
            continue
        cdispec.structure_problems(parsed)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        st.text(alphabet="[]{}:-&*!|>'\"#,? \n\tab01", max_size=200),
        st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    ),
    st.sampled_from(["/etc/cdi/x.yaml", "/etc/cdi/x.json"]),
)
def test_any_text_is_a_document_or_a_config_error(text: str, where: str) -> None:
    try:
        doc = cdispec.parse(text, where)
    except ConfigError as err:
        assert where in err.message and err.fix
        return
    cdispec.structure_problems(doc)


@pytest.mark.parametrize(
    "text",
    [
        _alias_bomb(),
        "a: &a [" + ", ".join(["x"] * 1000) + "]\nb: [" + ", ".join(["*a"] * 300) + "]\n",
        "a: &a {k: &b [*a]}\n",
        "[" * 150 + "]" * 150,
        "\n".join(" " * i + "a:" for i in range(150)) + " 1\n",
    ],
)
def test_aliases_and_nesting_past_the_bounds_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=r"/etc/cdi/x\.yaml") as err:
        cdispec.parse(text, "/etc/cdi/x.yaml")
    assert len(err.value.message) < 400


def test_aliases_within_the_bounds_are_read() -> None:
    text = _with_devices(
        "devices:\n- {name: '0', containerEdits: &e {env: [A=1]}}\n- {name: '1', containerEdits: *e}"
    )
    doc = cdispec.parse(text, "/etc/cdi/x.yaml")
    assert cdispec.structure_problems(doc) == []


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    st.sampled_from(SLOTS),
    st.integers(min_value=1, max_value=3000),
    st.sampled_from(["list", "map", "block"]),
    st.sampled_from(["/etc/cdi/x.yaml", "/etc/cdi/x.json"]),
)
def test_nesting_of_any_depth_at_any_level(path: tuple[Any, ...], depth: int, shape: str, where: str) -> None:
    """A value nested `depth` deep put at any level of a valid spec, as YAML flow, YAML block or JSON: read
    (shallow), or refused with a ConfigError naming the file; never a RecursionError or a crash."""
    import yaml

    marker = "NESTED"
    doc = _replaced(path, marker)
    if where.endswith(".json"):
        nested = "[" * depth + "1" + "]" * depth if shape != "map" else '{"a": ' * depth + "1" + "}" * depth
        text = json.dumps(doc).replace(json.dumps(marker), nested)
    elif shape == "block":  # block mappings, indented one more level each, under a key of the document
        nested = "".join(f"\n{'  ' * (i + 1)}a:" for i in range(depth)) + " 1\n"
        text = yaml.safe_dump(_valid_doc()) + "x:" + nested
    else:
        nested = "[" * depth + "1" + "]" * depth if shape == "list" else "{a: " * depth + "1" + "}" * depth
        text = yaml.safe_dump(doc, default_flow_style=True, width=10**9).replace(marker, nested)
    try:
        parsed = cdispec.parse(text, where)
    except ConfigError as err:
        assert where in err.message and len(err.message) < 500
        return
    problems = cdispec.structure_problems(parsed)
    assert all(len(p) < 400 for p in problems)
