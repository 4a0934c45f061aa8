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
    yield spec.get("containerEdits") or {}
    for device in spec.get("devices") or []:
        yield device.get("containerEdits") or {}


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that can hold this content (see the module's docstring)."""
    devices = spec.get("devices") or []
    edits = list(_edits(spec))
    if any(e.get("additionalGids") or e.get("intelRdt") for e in edits):
        return "0.7.0"
    annotated = bool(spec.get("annotations")) or any(d.get("annotations") for d in devices)
    if annotated or "." in str(spec.get("kind", "")).partition("/")[2]:
        return "0.6.0"
    digit_name = any(str(d.get("name", ""))[:1].isdigit() for d in devices)
    if digit_name or any(n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts") or []):
        return "0.4.0"
    return "0.3.0"


def structure_problems(spec: Mapping[str, Any]) -> list[str]:
    """What makes this document an invalid CDI spec (empty when it is valid): the checks a runtime's CDI
    library makes before it uses a file, and which make it drop the file whole."""
    problems: list[str] = []
    for key in ("cdiVersion", "kind", "devices"):
        if key not in spec:
            problems.append(f"no {key!r}")
    kind = spec.get("kind")
    if isinstance(kind, str):
        problem = kind_problem(kind)
        if problem:
            problems.append(problem)
    elif kind is not None:
        problems.append("'kind' is not a string")
    devices = spec.get("devices")
    if devices is not None and not isinstance(devices, list):
        problems.append("'devices' is not a list")
        devices = []
    seen: set[str] = set()
    for device in devices or []:
        name = device.get("name") if isinstance(device, dict) else None
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
        for env in edits.get("env") or []:
            if not isinstance(env, str) or "=" not in env:
                problems.append(f"env entry {env!r} is not KEY=VALUE")
        for node in edits.get("deviceNodes") or []:
            path = node.get("path") if isinstance(node, dict) else None
            if not isinstance(path, str) or not path.startswith("/"):
                problems.append(f"device node {node!r} has no absolute path")
        for mount in edits.get("mounts") or []:
            if not isinstance(mount, dict) or not mount.get("hostPath") or not mount.get("containerPath"):
                problems.append(f"mount {mount!r} needs hostPath and containerPath")
        for hook in edits.get("hooks") or []:
            if not isinstance(hook, dict) or not hook.get("hookName") or not hook.get("path"):
                problems.append(f"hook {hook!r} needs hookName and path")
    version = spec.get("cdiVersion")
    if isinstance(version, str) and isinstance(kind, str) and not problems:
        needed = minimum_version(spec)
        if _version_tuple(version) < _version_tuple(needed):
            problems.append(f"cdiVersion {version} is lower than {needed}, which its content needs")
    return problems


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


def parse(text: str, where: str) -> Spec:
    """A spec file's document (YAML is a superset of JSON; both are read by the YAML parser)."""
    if where.endswith(".json"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{where} is not valid JSON: {exc}", f"fix or remove {where}") from exc
    else:
        import yaml

        loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        try:
            data = yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader, libyaml's where present)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where} is not valid YAML: {exc}", f"fix or remove {where}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is not a CDI spec (not a mapping)", f"fix or remove {where}")
    return data


def format_of(path: str) -> str:
    if path.endswith(".json"):
        return "json"
    if path.endswith(".yaml"):  # the CDI libraries read *.yaml and *.json only (never .yml)
        return "yaml"
    raise UsageError(
        f"{path}: a CDI spec file must end in .yaml or .json (runtimes ignore other files)",
        "name the output file …/<name>.yaml or …/<name>.json",
    )
