"""The CDI spec format: names, the lowest cdiVersion that a content needs, and its YAML/JSON text.

Facts from the CDI project's SPEC.md and its Go reference (specs-go): a kind is "vendor/class"; vendor and
class start with a letter and hold letters, digits, `_`, `-` and `.`; a device name starts with a letter or
a digit and may also hold `_`, `-`, `.` and `:`. A writer declares the lowest version its content needs,
because a runtime whose CDI library is older than the declared version refuses the whole file:

- 0.3.0 the base (devices, env, deviceNodes, mounts, hooks);
- 0.4.0 a mount's `type`;
- 0.5.0 a device name that starts with a digit, a device node's `hostPath`;
- 0.6.0 annotations, a `.` in the class;
- 0.7.0 `additionalGids`, `intelRdt`.

gpunode's own content never needs more than 0.5.0 (index names such as "0" and `hostPath` need exactly
that), so containerd 1.7's vendored CDI library reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from gpunode.errors import ConfigError, UsageError

ANNOTATION_PREFIX = "cdi.k8s.io/"
ANNOTATION_NAME_MAX = 63  # the part after the prefix

_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ANNOTATION_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")

Spec = dict[str, Any]  # the document as JSON/YAML sees it


def kind_problem(kind: str) -> str | None:
    """Why `kind` is not a valid CDI kind ("vendor/class"), or None."""
    vendor, slash, klass = kind.partition("/")
    if not slash:
        return f"CDI kind {kind!r} must be vendor/class, e.g. nvidia.com/gpu"
    if not _VENDOR_OR_CLASS.match(vendor):
        return (
            f"CDI vendor {vendor!r} must start with a letter, end with a letter or digit, and hold only "
            "letters, digits, '_', '-' and '.'"
        )
    if not _VENDOR_OR_CLASS.match(klass):
        return (
            f"CDI class {klass!r} must start with a letter, end with a letter or digit, and hold only "
            "letters, digits, '_', '-' and '.'"
        )
    return None


def check_kind(kind: str) -> str:
    problem = kind_problem(kind)
    if problem:
        raise UsageError(problem, "use a kind such as nvidia.com/gpu")
    return kind


def device_name_problem(name: str) -> str | None:
    if not _DEVICE.match(name):
        return (
            f"CDI device name {name!r} must start with a letter or digit, end with one, and hold only "
            "letters, digits, '_', '-', '.' and ':'"
        )
    return None


def qualified(kind: str, name: str) -> str:
    """The fully-qualified device name a runtime is asked for: vendor/class=name."""
    return f"{kind}={name}"


def parse_qualified(text: str) -> tuple[str, str] | None:
    """(kind, name) of a fully-qualified name, or None when it is not one."""
    kind, eq, name = text.partition("=")
    if not eq or kind_problem(kind) or device_name_problem(name):
        return None
    return kind, name


def annotation_key(plugin: str, device_id: str) -> str:
    """The annotation key for one allocation, as the CDI rules make it: `cdi.k8s.io/<plugin>_<id>`, `/`
    in the ID turned into `_`, at most 63 characters after the prefix, letters, digits and `_-.` inside.

    Characters the rules do not allow (a `:` of an index-named MIG device) become `-`; a name that would
    be too long keeps its start and ends with a short digest of the whole, so it stays unique."""
    name = f"{plugin}_{device_id.replace('/', '_')}"
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", name).strip("-_.")
    if len(name) > ANNOTATION_NAME_MAX:
        import hashlib

        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = f"{name[: ANNOTATION_NAME_MAX - 13].rstrip('-_.')}_{digest}"
    if not _ANNOTATION_NAME.match(name):
        raise ValueError(f"cannot make a CDI annotation key of {plugin!r} and {device_id!r}")
    return ANNOTATION_PREFIX + name


def _edits(spec: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    """Every containerEdits mapping of the document; values of another type are skipped (structure_problems
    names them), so a hostile file cannot make a reader fail."""
    if isinstance(spec.get("containerEdits"), dict):
        yield spec["containerEdits"]
    for device in _list(spec.get("devices")):
        if isinstance(device, dict) and isinstance(device.get("containerEdits"), dict):
            yield device["containerEdits"]


def _list(value: Any) -> list[Any]:
    """`value` when it is a list, else [] (a wrong type is a problem structure_problems names)."""
    return value if isinstance(value, list) else []


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in _list(value) if isinstance(v, dict)]


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that can hold this content (see the module's docstring)."""
    devices = _dicts(spec.get("devices"))
    edits = list(_edits(spec))
    if any(e.get("additionalGids") or e.get("intelRdt") for e in edits):
        return "0.7.0"
    annotated = bool(spec.get("annotations")) or any(d.get("annotations") for d in devices)
    if annotated or "." in str(spec.get("kind", "")).partition("/")[2]:
        return "0.6.0"
    digit_name = any(str(d.get("name", ""))[:1].isdigit() for d in devices)
    if digit_name or any(n.get("hostPath") for e in edits for n in _dicts(e.get("deviceNodes"))):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in _dicts(e.get("mounts"))):
        return "0.4.0"
    return "0.3.0"


# The type of every field a runtime's CDI library (specs-go, read through sigs.k8s.io/yaml) decodes: a value
# of another type fails its decoding, and the runtime skips the whole file. "list:x" is a list of x; a
# mapping's name is one of the tables below; None (null) is an absent field.
_FIELDS: dict[str, dict[str, str]] = {
    "spec": {"cdiVersion": "str", "kind": "str", "annotations": "strmap", "devices": "list:device",
             "containerEdits": "edits"},
    "device": {"name": "str", "annotations": "strmap", "containerEdits": "edits"},
    "edits": {"env": "list:str", "deviceNodes": "list:node", "hooks": "list:hook", "mounts": "list:mount",
              "intelRdt": "map", "additionalGids": "list:int"},
    "node": {"path": "str", "hostPath": "str", "type": "str", "major": "int", "minor": "int",
             "fileMode": "int", "permissions": "str", "uid": "int", "gid": "int"},
    "mount": {"hostPath": "str", "containerPath": "str", "options": "list:str", "type": "str"},
    "hook": {"hookName": "str", "path": "str", "args": "list:str", "env": "list:str", "timeout": "int"},
}  # fmt: skip
_TYPE_WORDS = {"str": "a string", "int": "an integer", "map": "a mapping", "strmap": "a mapping of strings"}
MAX_PROBLEMS = 20  # a hostile file could have a million; the first ones say enough


def shown(value: Any, limit: int = 60) -> str:
    """A value of a spec in a message: one line, at most about `limit` characters, however big or nested
    the value (a YAML alias bomb is shown by its start only)."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 2, limit, limit
    short.maxlist = short.maxdict = short.maxtuple = short.maxset = 4
    text = short.repr(value)
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit * 2 else text[: limit * 2] + "..."


def _type_name(value: Any) -> str:
    if value is True or value is False:
        return "a boolean"
    for kind, word in (
        (str, "a string"), (int, "an integer"), (float, "a number"), (list, "a list"), (dict, "a mapping")
    ):  # fmt: skip
        if isinstance(value, kind):
            return word
    return f"a {type(value).__name__}"


def _type_problem(value: Any, expected: str, where: str, problems: list[str]) -> bool:
    """Append why `value` is not of `expected` (a _FIELDS type); True when it is."""
    if expected.startswith("list:"):
        item = expected[5:]
        if not isinstance(value, list):
            problems.append(f"{where} is {_type_name(value)} ({shown(value)}), not a list")
            return False
        ok = True
        for i, entry in enumerate(value):
            ok = _type_problem(entry, item, f"{where}[{i}]", problems) and ok
            if len(problems) >= MAX_PROBLEMS:
                break
        return ok
    if expected in _FIELDS:
        if not isinstance(value, dict):
            problems.append(f"{where} is {_type_name(value)} ({shown(value)}), not a mapping")
            return False
        ok = True
        for key, field_type in _FIELDS[expected].items():
            if value.get(key) is not None:
                inner = f"{where}.{key}" if where else key
                ok = _type_problem(value[key], field_type, inner, problems) and ok
        return ok
    if expected == "int":
        good = isinstance(value, int) and not isinstance(value, bool)
    elif expected == "str":
        good = isinstance(value, str)
    elif expected == "map":
        good = isinstance(value, dict)
    else:  # strmap
        good = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    if not good:
        problems.append(f"{where} is {_type_name(value)} ({shown(value)}), not {_TYPE_WORDS[expected]}")
    return good


def structure_problems(spec: Mapping[str, Any]) -> list[str]:
    """What makes this document an invalid CDI spec (empty when it is valid): the checks a runtime's CDI
    library makes before it uses a file, and which make it drop the file whole. Any document (the data of
    any YAML or JSON file) gets an answer: a field of the wrong type is a problem, never an exception."""
    problems: list[str] = []
    for key in ("cdiVersion", "kind", "devices"):
        if key not in spec:
            problems.append(f"no {key!r}")
    typed: list[str] = []
    _type_problem(dict(spec), "spec", "", typed)
    problems += typed
    if typed:
        return problems[:MAX_PROBLEMS]  # the semantic checks below would only repeat the same fault
    kind = spec.get("kind")
    if isinstance(kind, str):
        problem = kind_problem(kind)
        if problem:
            problems.append(problem)
    seen: set[str] = set()
    for device in _dicts(spec.get("devices")):
        name = device.get("name")
        if not isinstance(name, str):
            problems.append("a device without a name")
            continue
        problem = device_name_problem(name)
        if problem:
            problems.append(problem)
        if name in seen:
            problems.append(f"device {name!r} is defined twice")
        seen.add(name)
        if not isinstance(device.get("containerEdits"), dict):
            problems.append(f"device {name!r} has no containerEdits")
    for edits in _edits(spec):
        for env in _list(edits.get("env")):
            if "=" not in env:
                problems.append(f"env entry {shown(env)} is not KEY=VALUE")
        for node in _dicts(edits.get("deviceNodes")):
            if not str(node.get("path") or "").startswith("/"):
                problems.append(f"device node {shown(node)} has no absolute path")
        for mount in _dicts(edits.get("mounts")):
            if not mount.get("hostPath") or not mount.get("containerPath"):
                problems.append(f"mount {shown(mount)} needs hostPath and containerPath")
        for hook in _dicts(edits.get("hooks")):
            if not hook.get("hookName") or not hook.get("path"):
                problems.append(f"hook {shown(hook)} needs hookName and path")
        if len(problems) >= MAX_PROBLEMS:
            break
    version = spec.get("cdiVersion")
    if isinstance(version, str) and isinstance(kind, str) and not problems:
        needed = minimum_version(spec)
        if _version_tuple(version) < _version_tuple(needed):
            problems.append(f"cdiVersion {version} is lower than {needed}, which its content needs")
    return problems[:MAX_PROBLEMS]


def _version_tuple(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in version.split("."))
    except ValueError:
        return (0,)


def render(spec: Spec, fmt: str, header: str = "") -> str:
    """The spec as text: JSON, or YAML with `header` as comment lines (a runtime ignores comments)."""
    if fmt == "json":
        return json.dumps(spec, indent=2) + "\n"
    import yaml

    # libyaml's emitter where PyYAML has it: ~6x faster on a spec of 8 x 7 MIG devices.
    base: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

    class Dumper(base):  # type: ignore[misc]
        def ignore_aliases(self, data: Any) -> bool:
            return True  # plain repeated values, never &anchors: every reader must see the same thing

    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + yaml.dump(spec, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1000)


# Bounds on what a spec file may hold: any file in the spec directories is read (by the plugin at start too),
# so a hostile one must cost little. Real specs are far below them: nvidia-ctk's for 8 GPUs with MIG is about
# 100 KB and 20,000 values.
MAX_SPEC_BYTES = 4 * 2**20
MAX_DEPTH = 100
MAX_VALUES = 200_000  # every scalar, list and mapping, a YAML alias counted as all it names


def parse(text: str, where: str) -> Spec:
    """A spec file's document (YAML is a superset of JSON; both are read by the YAML parser). Whatever the
    text, the answer is the document or a ConfigError naming the file: never another exception, and never
    more work than the bounds above allow."""
    fix = f"fix or remove {where}"
    if len(text) > MAX_SPEC_BYTES:
        raise ConfigError(f"{where} is larger than {MAX_SPEC_BYTES // 2**20} MiB: not a CDI spec", fix)
    if where.endswith(".json"):
        try:
            data = json.loads(text)
        except RecursionError as exc:
            raise ConfigError(f"{where} is not a CDI spec: nested too deeply", fix) from exc
        except ValueError as exc:
            raise ConfigError(f"{where} is not valid JSON: {one_line(exc)}", fix) from exc
    else:
        from gpunode import safeyaml

        # The one bounded loader (depth, aliases expanded, duplicate keys): a 2 KB file of nested aliases is
        # a billion values to whoever walks it.
        data = safeyaml.load_yaml(text, where, max_bytes=MAX_SPEC_BYTES)
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is not a CDI spec (not a mapping)", fix)
    if where.endswith(".json"):
        _check_bounds_json(data, where)
    return data


def one_line(text: object, limit: int = 200) -> str:
    """A parser's message or a file name on one line (PyYAML's messages span several; a file name may hold a
    newline), escaped and cut short: the plugin logs it as one line."""
    text = " ".join(str(text).split())
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


def _check_bounds_json(data: Any, where: str) -> None:
    """JSON has no aliases, but its values can still be more than a spec holds (a 4 MiB list of zeros)."""
    pending, count = [data], 0
    while pending:
        value = pending.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(
                f"{where} is not a CDI spec: more than {MAX_VALUES} values", f"fix or remove {where}"
            )
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


def format_of(path: str) -> str:
    if path.endswith(".json"):
        return "json"
    if path.endswith(".yaml"):  # the CDI libraries read *.yaml and *.json only (never .yml)
        return "yaml"
    raise UsageError(
        f"{path}: a CDI spec file must end in .yaml or .json (runtimes ignore other files)",
        "name the output file …/<name>.yaml or …/<name>.json",
    )
