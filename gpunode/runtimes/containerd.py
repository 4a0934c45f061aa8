"""Read containerd's configuration the way containerd does (read-only).

The pieces `configure-runtime` needs too are public and pure where possible: config version detection,
the CRI plugin table path, import resolution and merging, where k3s / RKE2 / microk8s keep the file.
Documents are any Mapping, so a tomlkit document being edited works as well as a plain dict.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

from gpunode.errors import CommandFailed, ConfigError
from gpunode.host import CommandResult, Host
from gpunode.runtimes.model import DEFAULT_NVIDIA_RUNTIME_NAME, RuntimeConfigState
from gpunode.runtimes.tomlread import plain, read_toml

DEFAULT_CONFIG = "/etc/containerd/config.toml"
K3S_DIR = "/var/lib/rancher/k3s/agent/etc/containerd"
K3S_CONFIG = f"{K3S_DIR}/config.toml"
K3S_TEMPLATE = f"{K3S_DIR}/config.toml.tmpl"
K3S_TEMPLATE_V3 = f"{K3S_DIR}/config-v3.toml.tmpl"
RKE2_DIR = "/var/lib/rancher/rke2/agent/etc/containerd"
RKE2_CONFIG = f"{RKE2_DIR}/config.toml"
RKE2_TEMPLATE = f"{RKE2_DIR}/config.toml.tmpl"
RKE2_TEMPLATE_V3 = f"{RKE2_DIR}/config-v3.toml.tmpl"
MICROK8S_DIR = "/var/snap/microk8s/current/args"
MICROK8S_CONFIG = f"{MICROK8S_DIR}/containerd.toml"
MICROK8S_TEMPLATE = f"{MICROK8S_DIR}/containerd-template.toml"

BUILTIN_DEFAULT_RUNTIME = "runc"
NVIDIA_RUNTIME_BINARY = "nvidia-container-runtime"
VERSION_TIMEOUT = 5.0
DUMP_TIMEOUT = 30.0

CRI_TABLES: Mapping[int, tuple[str, ...]] = {
    1: ("plugins", "cri"),
    2: ("plugins", "io.containerd.grpc.v1.cri"),
    3: ("plugins", "io.containerd.cri.v1.runtime"),
}
CRI_PLUGIN_IDS = frozenset({"cri", "io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime"})
# Top-level tables whose entries containerd < 2.1 replaces wholesale when a file is imported.
REPLACED_TABLES = ("plugins", "proxy_plugins", "stream_processors")
# The runtime v1 shim takes its binary from this plugin when a runtime entry names none.
LINUX_PLUGIN = {1: ("plugins", "linux"), 2: ("plugins", "io.containerd.runtime.v1.linux")}
RUNTIME_V1_LINUX = "io.containerd.runtime.v1.linux"


# -- where the file is ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigLocation:
    flavour: str  # "containerd", "k3s", "rke2" or "microk8s"
    config_path: str  # the file containerd itself is started with
    template_path: str | None  # the existing template the distribution renders config_path from
    template_candidates: tuple[str, ...] = ()  # where such a template goes (edits belong there)
    note: str | None = None

    @property
    def regenerated(self) -> bool:
        """True when config_path is rewritten by the distribution, so editing it is lost on restart."""
        return bool(self.template_candidates)


def detect_location(host: Host) -> ConfigLocation:
    for flavour, directory, config, templates in (
        ("k3s", K3S_DIR, K3S_CONFIG, (K3S_TEMPLATE_V3, K3S_TEMPLATE)),
        ("rke2", RKE2_DIR, RKE2_CONFIG, (RKE2_TEMPLATE_V3, RKE2_TEMPLATE)),
    ):
        if host.is_dir(directory):
            template = next((t for t in templates if host.is_file(t)), None)
            return ConfigLocation(
                flavour, config, template, templates, _template_note(flavour, config, template)
            )
    if host.is_dir(MICROK8S_DIR) and host.exists(MICROK8S_TEMPLATE):
        note = (
            f"microk8s renders {MICROK8S_CONFIG} from {MICROK8S_TEMPLATE} when it starts; "
            "changes belong in the template"
        )
        return ConfigLocation("microk8s", MICROK8S_CONFIG, MICROK8S_TEMPLATE, (MICROK8S_TEMPLATE,), note)
    return ConfigLocation("containerd", DEFAULT_CONFIG, None)


def _template_note(flavour: str, config: str, template: str | None) -> str:
    if template is None:
        return (
            f"{flavour} regenerates {config} every time it starts; changes made there are lost "
            f"(customise through config.toml.tmpl, or config-v3.toml.tmpl with containerd 2.x, next to it)"
        )
    return (
        f"{flavour} regenerates {config} from {template} every time it starts; changes belong in the template"
    )


def detect_config_path(host: Host) -> tuple[str, str | None]:
    """The file to read for the effective configuration, and a note on who is in charge of it.

    The rendered config.toml is what containerd runs with, so it is preferred; the template is read only
    when nothing has been rendered yet.
    """
    location = detect_location(host)
    if host.exists(location.config_path) or location.template_path is None:
        return location.config_path, location.note
    note = f"{location.config_path} is not rendered yet; gpunode reads the template {location.template_path}"
    return location.template_path, note if location.note is None else f"{location.note}; {note}"


def has_go_template_syntax(text: str) -> bool:
    return "{{" in text


# -- parsing and versions ---------------------------------------------------------------------------


def parse_toml(text: str, path: str) -> dict[str, Any]:
    """Parse TOML into plain Python values; syntax errors name the file, line and column."""
    return read_toml(text, path)


def detect_version(doc: Mapping[str, Any], installed_major: int | None, *, path: str | None = None) -> int:
    """The config version containerd reads `doc` as.

    An empty document takes the version the installed containerd writes by default. Unknown: 2, because
    containerd 2.x migrates a version 2 file on load while 1.x cannot read version 3.
    """
    if "version" in doc:
        version = doc["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version not in CRI_TABLES:
            raise ConfigError(
                f"{path or 'the containerd configuration'}: unknown config version {version!r} "
                "(containerd knows 1, 2 and 3)",
                "set `version = 2` for containerd 1.x, `version = 3` for containerd 2.x",
            )
        return int(version)
    if doc:
        return 1
    return 3 if installed_major is not None and installed_major >= 2 else 2


def cri_table_path(version: int) -> tuple[str, ...]:
    try:
        return CRI_TABLES[version]
    except KeyError:
        raise ValueError(f"containerd config version {version} has no known CRI plugin table") from None


def parse_containerd_version(output: str) -> tuple[int, int] | None:
    """(major, minor) from `containerd --version`: the first word that looks like [v]X.Y[.Z...]. None for
    anything else, garbage and U+FFFD (undecodable bytes) included: ASCII digits only, at most 9 each (\\d
    takes every script's digits, and int() raises past 4,300 of them)."""
    for word in output.split()[1:]:
        found = re.match(r"v?([0-9]{1,9})\.([0-9]{1,9})(?:[.~+-]|$)", word)
        if found:
            return int(found.group(1)), int(found.group(2))
    return None


def installed_containerd_version(host: Host) -> tuple[int, int] | None:
    """The version of the containerd that reads the files; None when unknown. Under --root, R's package
    database says, and no program runs (gpunode.runtimes.probe); with none there, callers choose
    what every version reads (a config version 2 for an empty file)."""
    from gpunode.runtimes import probe

    result, _ = probe.run(host, "containerd", ["--version"], timeout=VERSION_TIMEOUT)
    return _version_of(result)


def _version_of(result: CommandResult | CommandFailed | None) -> tuple[int, int] | None:
    if not isinstance(result, CommandResult) or not result.ok:
        return None
    return parse_containerd_version(result.stdout)


def installed_containerd_major(host: Host) -> int | None:
    version = installed_containerd_version(host)
    return version[0] if version else None


# -- imports ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedImports:
    paths: tuple[str, ...]  # files to load, in containerd's order
    missing: tuple[str, ...]  # non-glob imports that do not exist (containerd refuses to start)
    notes: tuple[str, ...]


def resolve_imports(host: Host, config_path: str, imports: object) -> ResolvedImports:
    """Resolve one file's `imports`: relative entries against that file's directory, `*` as a glob."""
    if imports is None:
        return ResolvedImports((), (), ())
    if (
        not isinstance(imports, Sequence)
        or isinstance(imports, str)
        or not all(isinstance(i, str) for i in imports)
    ):
        raise ConfigError(f"{config_path}: `imports` must be a list of paths (strings)")
    paths: list[str] = []
    missing: list[str] = []
    notes: list[str] = []
    base = posixpath.dirname(config_path)
    for entry in imports:
        absolute = posixpath.normpath(posixpath.join(base, entry))
        if not posixpath.isabs(entry):
            notes.append(
                f'{config_path}: relative import "{entry}" read as {absolute}; relative imports are '
                "fragile (containerd 1.6 resolves relative glob patterns against its working directory, "
                "not the config file's directory): use an absolute path"
            )
        # containerd treats an entry as a pattern only when it has a `*`, so do the same.
        if "*" in entry:
            paths.extend(glob_host(host, absolute))
        elif host.is_file(absolute):
            paths.append(absolute)
        else:
            missing.append(absolute)
    return ResolvedImports(tuple(paths), tuple(missing), tuple(notes))


def glob_host(host: Host, pattern: str) -> list[str]:
    """Expand a pattern like Go's filepath.Glob: wildcards match within one path component, dotfiles too."""
    matches = ["/"]
    for part in PurePosixPath(pattern).parts[1:]:
        if not any(c in part for c in "*?["):
            matches = [posixpath.join(m, part) for m in matches if host.exists(posixpath.join(m, part))]
            continue
        matches = [
            posixpath.join(m, name)
            for m in matches
            for name in host.listdir(m)
            if fnmatch.fnmatchcase(name, part)
        ]
    return matches


def merge_config(
    base: Mapping[str, Any], imported: Mapping[str, Any], *, replace_plugins: bool
) -> dict[str, Any]:
    """Merge an imported file into the configuration loaded so far.

    Mirrors containerd's mergo merge: non-empty values override, lists append, tables merge key by key;
    before containerd 2.1 each entry of `plugins` (and proxy_plugins, stream_processors) is REPLACED by the
    imported one, which silently drops whatever the imported table leaves out.
    """
    merged = dict(base)
    for key, value in imported.items():
        old = merged.get(key)
        if (
            key in REPLACED_TABLES
            and replace_plugins
            and isinstance(value, Mapping)
            and isinstance(old, Mapping)
        ):
            merged[key] = {**old, **value}
        elif isinstance(value, Mapping) and isinstance(old, Mapping):
            merged[key] = _deep_merge(old, value)
        elif isinstance(value, list) and isinstance(old, list):
            merged[key] = [*old, *value]
        elif not _is_zero(value) or key not in merged:
            merged[key] = value
    return merged


def _deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        old = merged.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            merged[key] = _deep_merge(old, value)
        elif not _is_zero(value) or key not in merged:
            merged[key] = value
    return merged


def _is_zero(value: object) -> bool:
    # Go's zero values, which mergo does not let override what an earlier file set.
    return value is False or value in (0, "", [], {})


@dataclass(frozen=True)
class LoadedConfig:
    path: str  # the main file
    exists: bool  # False: missing, empty or comments only; containerd runs on built-in defaults
    main: dict[str, Any]  # the main file alone
    merged: dict[str, Any]  # the main file with every import merged in
    version: int
    files: tuple[str, ...]  # every file read, in merge order
    notes: tuple[str, ...]
    problems: tuple[str, ...] = ()  # the notes that stop containerd or lose settings


def load_config(host: Host, path: str, installed: tuple[int, int] | None = None) -> LoadedConfig:
    """Load a config file and its imports breadth-first, like containerd (each file once)."""
    text = host.read_text_if_exists(path)
    main = parse_toml(text, path) if text is not None else {}
    version = detect_version(main, installed[0] if installed else None, path=path)
    replace_plugins = installed is None or installed < (2, 1)
    merged = dict(main)
    files = [path] if text is not None else []
    notes: list[str] = []
    problems: list[str] = []
    pending = list(_follow_imports(host, path, main, notes, problems))
    while pending:
        current = pending.pop(0)
        if current in files:
            continue
        doc = parse_toml(host.read_text(current), current)
        other = doc.get("version")
        if other is not None and other != version:
            notes.append(
                f"{current} is a version {other} file imported into a version {version} configuration; "
                "its plugin tables have other names and may be ignored"
            )
        before = configured_runtimes(merged, version, path)
        merged = merge_config(merged, doc, replace_plugins=replace_plugins)
        lost = [name for name in before if name not in configured_runtimes(merged, version, current)]
        if lost and replace_plugins:
            problems.append(
                f"{current} replaces the whole CRI plugin table (containerd before 2.1 does not merge "
                f"imported plugin tables): runtime(s) {', '.join(lost)} and every CRI setting it leaves out "
                "are lost"
            )
        files.append(current)
        pending.extend(_follow_imports(host, current, doc, notes, problems))
    return LoadedConfig(
        path, bool(main), main, merged, version, tuple(files), tuple(notes + problems), tuple(problems)
    )


def _follow_imports(
    host: Host, path: str, doc: Mapping[str, Any], notes: list[str], problems: list[str]
) -> tuple[str, ...]:
    resolved = resolve_imports(host, path, doc.get("imports"))
    notes.extend(resolved.notes)
    problems.extend(
        f"{path} imports {m}, which does not exist: containerd refuses to start with this configuration"
        for m in resolved.missing
    )
    return resolved.paths


# -- the CRI plugin ---------------------------------------------------------------------------------


def get_table(
    doc: Mapping[str, Any], keys: Sequence[str], path: str | None = None
) -> Mapping[str, Any] | None:
    """The table at `keys`, None when absent; a non-table on the way is a ConfigError."""
    current: Mapping[str, Any] = doc
    for depth, key in enumerate(keys):
        if key not in current:
            return None
        value = current[key]
        if not isinstance(value, Mapping):
            dotted = ".".join(f'"{k}"' if "." in k else k for k in keys[: depth + 1])
            raise ConfigError(f"{path or 'the containerd configuration'}: {dotted} must be a table")
        current = value
    return current


def cri_table(doc: Mapping[str, Any], version: int, path: str | None = None) -> Mapping[str, Any]:
    return get_table(doc, cri_table_path(version), path) or {}


def configured_runtimes(
    doc: Mapping[str, Any], version: int, path: str | None = None
) -> dict[str, Mapping[str, Any]]:
    """The runtimes containerd's CRI plugin will have, by name.

    A `runtimes` table replaces containerd's built-in one (runc included); without one, runc is built in.
    Version 1/2 files may also use the deprecated `default_runtime` / `untrusted_workload_runtime` tables,
    which containerd turns into runtimes named "default" / "untrusted".
    """
    containerd = get_table(cri_table(doc, version, path), ("containerd",), path) or {}
    table = get_table(containerd, ("runtimes",), path)
    runtimes: dict[str, Mapping[str, Any]] = {}
    for name, entry in (table or {}).items():
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{path or 'the containerd configuration'}: runtime {name!r} must be a table")
        runtimes[name] = entry
    if version < 3:
        for key, name in (("untrusted_workload_runtime", "untrusted"), ("default_runtime", "default")):
            legacy = get_table(containerd, (key,), path)
            if legacy and legacy.get("runtime_type"):
                runtimes[name] = legacy
    return runtimes


def defines_runtimes_table(doc: Mapping[str, Any], version: int, path: str | None = None) -> bool:
    containerd = get_table(cri_table(doc, version, path), ("containerd",), path) or {}
    return "runtimes" in containerd


def default_runtime_name(doc: Mapping[str, Any], version: int, path: str | None = None) -> str:
    containerd = get_table(cri_table(doc, version, path), ("containerd",), path) or {}
    legacy = get_table(containerd, ("default_runtime",), path) if version < 3 else None
    if legacy and legacy.get("runtime_type"):
        return "default"  # containerd lets the deprecated table win over default_runtime_name
    name = containerd.get("default_runtime_name")
    return name if isinstance(name, str) and name else BUILTIN_DEFAULT_RUNTIME


def runtime_options(entry: Mapping[str, Any]) -> dict[str, Any]:
    options = entry.get("options")
    return plain(options) if isinstance(options, Mapping) else {}


def default_runtime_options(doc: Mapping[str, Any], version: int) -> dict[str, Any]:
    """Options of the runtime pods get today (default_runtime_name, else runc, else crun), as plain values.

    The nvidia runtime must carry the same ones, above all SystemdCgroup.
    """
    runtimes = configured_runtimes(doc, version)
    for name in (default_runtime_name(doc, version), "runc", "crun"):
        if name in runtimes:
            return runtime_options(runtimes[name])
    return {}


def runtime_binary(entry: Mapping[str, Any], doc: Mapping[str, Any], version: int) -> str | None:
    """The OCI runtime binary an entry runs, where the configuration says."""
    binary = runtime_options(entry).get("BinaryName")
    if isinstance(binary, str) and binary:
        return binary
    engine = entry.get("runtime_engine")
    if isinstance(engine, str) and engine:
        return engine
    if entry.get("runtime_type") == RUNTIME_V1_LINUX and version in LINUX_PLUGIN:
        linux = get_table(doc, LINUX_PLUGIN[version]) or {}
        runtime = linux.get("runtime")
        return runtime if isinstance(runtime, str) and runtime else None
    return None


def find_nvidia_runtime(
    runtimes: Mapping[str, Mapping[str, Any]], doc: Mapping[str, Any], version: int, default: str
) -> tuple[str, str] | None:
    """(name, binary) of the runtime that runs nvidia-container-runtime: the default one if it does,
    else the one called "nvidia", else the first."""
    found: dict[str, str] = {}
    for name, entry in runtimes.items():
        binary = runtime_binary(entry, doc, version)
        if binary and PurePosixPath(binary).name == NVIDIA_RUNTIME_BINARY:
            found[name] = binary
    for preferred in (default, DEFAULT_NVIDIA_RUNTIME_NAME):
        if preferred in found:
            return preferred, found[preferred]
    return next(iter(found.items()), None)


def cri_disabled(doc: Mapping[str, Any]) -> bool:
    disabled = doc.get("disabled_plugins")
    return isinstance(disabled, list) and any(p in CRI_PLUGIN_IDS for p in disabled)


def cdi_enabled(doc: Mapping[str, Any], version: int, path: str | None = None) -> bool | None:
    value = cri_table(doc, version, path).get("enable_cdi")
    return value if isinstance(value, bool) else None


# -- the state doctor reports -----------------------------------------------------------------------


@dataclass(frozen=True)
class Dump:
    """containerd's own view of a configuration: `containerd --config FILE config dump`."""

    doc: dict[str, Any]
    version: int
    warnings: tuple[str, ...]  # its "Ignoring unknown key" lines: keys the daemon will not read


def effective_config(host: Host, path: str) -> Dump | None:
    """Ask the installed containerd how it reads `path` (imports, defaults and migration included).

    None where it cannot be asked: not the real root (the program would read this machine's files, not the
    image's), no containerd program, or no file. A file containerd itself refuses raises ConfigError with
    containerd's own words.
    """
    argv = _dump_argv(host, path)
    return None if argv is None else _dump_of(host.run(argv, timeout=DUMP_TIMEOUT), path)


def _dump_argv(host: Host, path: str) -> list[str] | None:
    program = host.which("containerd")
    if not host.is_real_root or program is None or not host.exists(path):
        return None
    return [program, "--config", path, "config", "dump"]


def _dump_of(result: CommandResult, path: str) -> Dump:
    if not result.ok:
        said = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ConfigError(
            f"containerd itself cannot read {path} (`containerd --config {path} config dump` exited "
            f"{result.returncode}): {said}",
            f"correct {path} as containerd says; containerd would not start with it",
        )
    doc = parse_toml(result.stdout, f"`containerd config dump` of {path}")
    version = doc.get("version")
    warnings = tuple(
        line for line in result.stderr.splitlines() if "Ignoring unknown key" in line or "deprecated" in line
    )
    return Dump(doc, version if isinstance(version, int) else 2, warnings)


def read_state(host: Host, path: str | None = None, *, effective: bool = False) -> RuntimeConfigState:
    """The runtimes gpunode reads from the files. With `effective`, where containerd can be asked (see
    effective_config), containerd's own dump decides, and a disagreement with the files is a problem."""
    if not effective:
        return _read_files(host, path)
    location_note = None
    if path is None:
        path, location_note = detect_config_path(host)
    dump_argv = _dump_argv(host, path)
    if dump_argv is None:
        return _read_files(host, path, location_note=location_note)
    # `containerd --version` and `config dump` are independent, and most of each is containerd's own
    # start: asked together. Where the dump can be asked (the real root), the version probe runs the same
    # program (gpunode.runtimes.probe).
    version_answer, dump_answer = host.run_together(
        [([dump_argv[0], "--version"], VERSION_TIMEOUT), (dump_argv, DUMP_TIMEOUT)]
    )
    state = _read_files(host, path, location_note=location_note, installed=_version_of(version_answer))
    if isinstance(dump_answer, CommandFailed):
        raise dump_answer  # as host.run raised it when the two ran one after the other
    try:
        dump = _dump_of(dump_answer, path)
    except ConfigError as exc:
        return replace(state, notes=(*state.notes, exc.message), problems=(*state.problems, exc.message))
    runtimes = configured_runtimes(dump.doc, dump.version)
    default = default_runtime_name(dump.doc, dump.version)
    nvidia = find_nvidia_runtime(runtimes, dump.doc, dump.version, default)
    notes = [*state.notes, "as containerd itself reads it (`containerd config dump`)"]
    problems = list(state.problems)
    if state.nvidia_runtime is not None and nvidia is None:
        ignored = [w for w in dump.warnings if state.nvidia_runtime in w]
        problems.append(
            f"the files define the {state.nvidia_runtime!r} runtime, but containerd itself does not see it"
            + (f" ({ignored[0]})" if ignored else "")
        )
    notes += [w for w in dump.warnings if "runtimes" in w]
    return replace(
        state,
        runtimes=tuple(runtimes),
        default_runtime=default,
        nvidia_runtime=nvidia[0] if nvidia else None,
        nvidia_binary=nvidia[1] if nvidia else None,
        notes=tuple(dict.fromkeys([*notes, *problems])),
        problems=tuple(problems),
    )


class _Ask:
    """_read_files' `installed` when nobody asked yet: it runs `containerd --version` itself."""


_ASK = _Ask()


def _read_files(
    host: Host,
    path: str | None = None,
    *,
    location_note: str | None = None,
    installed: tuple[int, int] | _Ask | None = _ASK,
) -> RuntimeConfigState:
    notes: list[str] = [location_note] if location_note else []
    if path is None:
        path, location_note = detect_config_path(host)
        notes.extend([location_note] if location_note else [])
    if isinstance(installed, _Ask):
        installed = installed_containerd_version(host)
    text = host.read_text_if_exists(path)
    if text is not None and _is_template(path) and has_go_template_syntax(text):
        notes.append(
            f"{path} is a Go template (it contains {{{{ }}}}): its runtimes are known once it is rendered"
        )
        return RuntimeConfigState(
            "containerd", path, True, (), None, None, None, None, files=(path,), notes=tuple(notes)
        )
    loaded = load_config(host, path, installed)
    notes.extend(n for n in loaded.notes if n not in loaded.problems)
    doc, version = loaded.merged, loaded.version
    runtimes = configured_runtimes(doc, version, path)
    default = default_runtime_name(doc, version, path)
    nvidia = find_nvidia_runtime(runtimes, doc, version, default)
    problems = [*loaded.problems, *_version_notes(path, loaded, installed)]
    problems += _cri_notes(path, doc, version, runtimes, default)
    if nvidia:
        problems.extend(_systemd_cgroup_notes(runtimes, nvidia[0], default, cri_table(doc, version, path)))
    notes.extend(problems)
    return RuntimeConfigState(
        runtime="containerd",
        config_path=path,
        exists=loaded.exists,
        runtimes=tuple(runtimes),
        default_runtime=default,
        nvidia_runtime=nvidia[0] if nvidia else None,
        nvidia_binary=nvidia[1] if nvidia else None,
        cdi_enabled=cdi_enabled(doc, version, path),
        version=version,
        files=loaded.files,
        notes=tuple(notes),
        problems=tuple(problems),
    )


def _is_template(path: str) -> bool:
    return path.endswith(".tmpl") or path == MICROK8S_TEMPLATE


def _version_notes(path: str, loaded: LoadedConfig, installed: tuple[int, int] | None) -> list[str]:
    if installed is None or not loaded.exists:
        return []
    major = installed[0]
    if major == 1 and loaded.version == 3:
        return [
            f"{path} is a version 3 file but containerd {major}.{installed[1]} is installed: containerd 1.6 "
            "ignores it without a word and 1.7 refuses to start"
        ]
    if major >= 2 and loaded.version == 1:
        return [f"{path} uses the deprecated version 1 format; containerd {major}.x expects version 3"]
    return []


def _cri_notes(
    path: str, doc: Mapping[str, Any], version: int, runtimes: Mapping[str, Any], default: str
) -> list[str]:
    if cri_disabled(doc):
        return [
            f"{path} disables the CRI plugin (disabled_plugins): kubelet cannot use this containerd "
            "(the containerd.io package ships it this way for Docker)"
        ]
    notes: list[str] = []
    available = set(runtimes) | (
        set() if defines_runtimes_table(doc, version, path) else {BUILTIN_DEFAULT_RUNTIME}
    )
    if default not in available:
        notes.append(
            f'{path}: the default runtime "{default}" is not defined under the CRI runtimes: '
            "containerd's CRI plugin fails to start"
        )
    return notes


RUNC_V2 = "io.containerd.runc.v2"
RUNC_V1 = "io.containerd.runc.v1"  # the same options as v2 (runcoptions.Options)
# Runtimes of the legacy v1 shim. containerd reads their options as runctypes.RuncOptions (Runtime,
# RuntimeRoot, CriuPath, SystemdCgroup), and without an options table from the CRI plugin's own
# `systemd_cgroup`; an explicit "" is the type older configs wrote for the same thing.
LEGACY_TYPES = ("io.containerd.runtime.v1.linux", "")


def systemd_cgroup_settings(
    runtimes: Mapping[str, Mapping[str, Any]], default: str, cri: Mapping[str, Any]
) -> dict[str, bool]:
    """Whether each runc-type candidate (the default, runc, crun: those defined) runs with SystemdCgroup;
    a legacy v1-shim one also through the CRI plugin's `systemd_cgroup`. Others (Kata, ...) are no model."""
    settings: dict[str, bool] = {}
    for candidate in (default, "runc", "crun"):
        entry = runtimes.get(candidate)
        if entry is None:
            continue
        runtime_type = entry.get("runtime_type", RUNC_V2)
        systemd = runtime_options(entry).get("SystemdCgroup") is True
        if runtime_type in (RUNC_V2, RUNC_V1):
            settings[candidate] = systemd
        elif runtime_type in LEGACY_TYPES:
            settings[candidate] = systemd or cri.get("systemd_cgroup") is True
    return settings


def systemd_cgroup_reference(settings: Mapping[str, bool], default: str, nvidia: str) -> str | None:
    """The runtime whose SystemdCgroup the nvidia runtime must match, from each candidate's setting (the
    default, runc, crun where defined). The editor and doctor's reader both ask this, so a file gpunode
    wrote never fails its own check.

    While nvidia is not the default, the default: pods run with it, and gpunode copies it. Once nvidia is
    the default, the runtime it was copied from is no longer known: runc, else crun — but where those two
    disagree (a crun default without SystemdCgroup beside a runc with it), nvidia matches the one it was
    copied from and nothing can tell which is right; a second run must not flip it either."""
    names = [n for n in (default, "runc", "crun") if n != nvidia and n in settings]
    if not names:
        return None
    if default == nvidia and len({settings[n] for n in names}) > 1:
        return None
    return names[0]


def _systemd_cgroup_notes(
    runtimes: Mapping[str, Mapping[str, Any]], nvidia: str, default: str, cri: Mapping[str, Any]
) -> list[str]:
    settings = systemd_cgroup_settings(runtimes, default, cri)
    reference = systemd_cgroup_reference(settings, default, nvidia)
    if reference is None:
        return []
    if settings[reference] and (runtime_options(runtimes[nvidia]).get("SystemdCgroup") is not True):
        return [
            f'runtime "{nvidia}" lacks `SystemdCgroup = true` while "{reference}" has it: pods run with '
            "it end up in the wrong cgroups and get killed on systemd-cgroup nodes"
        ]
    return []
