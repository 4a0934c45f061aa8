"""Read CRI-O's configuration: crio.conf plus the crio.conf.d drop-ins, merged as CRI-O merges them.

CRI-O reads the main file, then every file under crio.conf.d (whatever its name, subdirectories too) in
lexical order; a later file overrides an earlier one option by option, but a runtime entry it defines
replaces the whole earlier entry of that name (its TOML decoder fills a fresh value for each map entry).

It also holds CRI-O's rules for a runtime entry (`config_problems`), written from CRI-O's own validation
(pkg/config/config.go: RuntimeHandler.Validate, TranslateMonitorFields, ValidateDefaultRuntime), and reads
the configuration CRI-O itself computes (`crio config`, `crio status config`) when the crio binary is here.
"""

from __future__ import annotations

import posixpath
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gpunode.errors import CommandFailed, ConfigError
from gpunode.host import Host
from gpunode.runtimes.containerd import parse_toml
from gpunode.runtimes.model import DEFAULT_NVIDIA_RUNTIME_NAME, RuntimeConfigState

CRIO_CONF = "/etc/crio/crio.conf"
DROPIN_DIR = "/etc/crio/crio.conf.d"
WRONG_DROPIN_DIR = (
    "/etc/crio/conf.d"  # where some nvidia-ctk releases wrote their drop-in; CRI-O never reads it
)
NVIDIA_RUNTIME_BINARY = "nvidia-container-runtime"
SOCKET = "/var/run/crio/crio.sock"
RUNTIMES_PATH = ("crio", "runtime", "runtimes")
# Go maps in CRI-O's config struct: their entries are replaced whole, everything else merges key by key.
MAP_TABLES = (RUNTIMES_PATH, ("crio", "runtime", "workloads"))
BACKUP_SUFFIXES = (".gpunode-bak", ".bak", "~", ".orig", ".rpmsave", ".rpmnew", ".dpkg-old", ".dpkg-dist")


def dropin_files(host: Host, directory: str = DROPIN_DIR) -> list[str]:
    """Every file under `directory` in the order CRI-O applies them (a depth-first walk, names sorted).

    Like CRI-O's own walk, a symlink to a directory is not descended into (which also ends link loops).
    """
    files: list[str] = []
    for name in host.listdir(directory):
        path = posixpath.join(directory, name)
        if host.is_dir(path) and not host.is_symlink(path):
            files.extend(dropin_files(host, path))
        elif host.is_file(path):
            files.append(path)
    return files


def merge_dropin(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    return _merge(base, overlay, ())


def _merge(base: Mapping[str, Any], overlay: Mapping[str, Any], at: tuple[str, ...]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        old = merged.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping) and at not in MAP_TABLES:
            merged[key] = _merge(old, value, (*at, key))
        else:
            merged[key] = value
    return merged


def configured_runtimes(doc: Mapping[str, Any], path: str) -> dict[str, Mapping[str, Any]]:
    current: Any = doc
    for key in RUNTIMES_PATH:
        current = current.get(key, {}) if isinstance(current, Mapping) else None
        if not isinstance(current, Mapping):
            raise ConfigError(f"{path}: {'.'.join(RUNTIMES_PATH)} must be a table of tables")
    runtimes: dict[str, Mapping[str, Any]] = {}
    for name, entry in current.items():
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{path}: crio.runtime.runtimes.{name} must be a table")
        runtimes[name] = entry
    return runtimes


def default_runtime(doc: Mapping[str, Any], runtimes: Mapping[str, Any]) -> str:
    """crio.runtime.default_runtime, else CRI-O's built-in default.

    The built-in default moved from runc to crun in CRI-O 1.31, and the version is not known from the
    files. Packaged CRI-O sets default_runtime explicitly (10-crio.conf), so this guess matters only for
    hand-written configs: a config that defines runc most likely comes from a runc-default CRI-O.
    """
    crio = doc.get("crio")
    runtime = crio.get("runtime") if isinstance(crio, Mapping) else None
    name = runtime.get("default_runtime") if isinstance(runtime, Mapping) else None
    if isinstance(name, str) and name:
        return name
    return "runc" if "runc" in runtimes else "crun"


def find_nvidia_runtime(runtimes: Mapping[str, Mapping[str, Any]], default: str) -> tuple[str, str] | None:
    """(name, runtime_path) of the entry running nvidia-container-runtime: the default one, else "nvidia",
    else the first."""
    found = {
        name: entry["runtime_path"]
        for name, entry in runtimes.items()
        if isinstance(entry.get("runtime_path"), str)
        and PurePosixPath(entry["runtime_path"]).name == NVIDIA_RUNTIME_BINARY
    }
    for preferred in (default, DEFAULT_NVIDIA_RUNTIME_NAME):
        if preferred in found:
            return preferred, found[preferred]
    return next(iter(found.items()), None)


def read_state(
    host: Host, path: str = CRIO_CONF, dropin_dir: str = DROPIN_DIR, *, effective: bool = False
) -> RuntimeConfigState:
    """The configuration as the files say (merged as CRI-O merges them). With `effective`, and when the
    crio program is here, CRI-O's own view decides instead: the running CRI-O's (`crio status config`)
    when its socket answers, else `crio config` on the files; where it disagrees with the files, a note
    says so, and another when nvidia-container-runtime will not find the OCI runtime it wraps."""
    files: list[str] = []
    merged: dict[str, Any] = {}
    for file in ([path] if host.is_file(path) else []) + dropin_files(host, dropin_dir):
        merged = merge_dropin(merged, parse_toml(host.read_text(file), file))
        files.append(file)
    runtimes: Mapping[str, Mapping[str, Any]] = configured_runtimes(merged, path)
    default = default_runtime(merged, runtimes)
    nvidia = find_nvidia_runtime(runtimes, default)
    notes, problems = _notes(host, files, dropin_dir, merged, path=path, nvidia=nvidia[0] if nvidia else None)
    if effective:
        seen, more_notes, more_problems = _effective_view(host, path, dropin_dir, runtimes, nvidia)
        notes, problems = notes + more_notes, problems + more_problems
        if seen is not None:
            runtimes, default = seen.runtimes, seen.default
            nvidia = find_nvidia_runtime(runtimes, default)
    if effective and nvidia is not None:  # about the binaries on this host, as doctor sees it
        model = next((runtimes[n] for n in (default, "crun", "runc") if n in runtimes and n != nvidia[0]), {})
        path_of_model = model.get("runtime_path")
        low_level = low_level_runtime_note(
            host, path_of_model if isinstance(path_of_model, str) and path_of_model else None
        )
        notes += [low_level] if low_level else []
    return RuntimeConfigState(
        runtime="crio",
        config_path=path,
        exists=bool(merged),
        runtimes=tuple(runtimes),
        default_runtime=default,
        nvidia_runtime=nvidia[0] if nvidia else None,
        nvidia_binary=nvidia[1] if nvidia else None,
        cdi_enabled=None,  # CRI-O has no switch: CDI is always on
        files=tuple(files),
        notes=tuple(notes),
        problems=tuple(problems),
    )


def _notes(
    host: Host,
    files: list[str],
    dropin_dir: str,
    merged: Mapping[str, Any],
    *,
    path: str,
    nvidia: str | None,
) -> tuple[list[str], list[str]]:
    """(notes, problems): problems are the notes that keep CRI-O from starting or change its config."""
    notes: list[str] = []
    problems: list[str] = []
    ignored = dropin_files(host, WRONG_DROPIN_DIR)
    if ignored:
        notes.append(
            f"CRI-O does not read {WRONG_DROPIN_DIR} (a known nvidia-ctk mistake): {', '.join(ignored)} "
            f"has no effect; drop-ins belong in {dropin_dir}"
        )
    backups = [f for f in files if f.startswith(f"{dropin_dir}/") and f.endswith(BACKUP_SUFFIXES)]
    if backups:
        problems.append(
            f"CRI-O applies every file in {dropin_dir}, backups included: {', '.join(backups)} "
            "override(s) the files sorted before them"
        )
    for problem in config_problems(merged, path):
        if problem.fatal:
            problems.append(f"{problem.message}: CRI-O refuses to start")
        elif problem.runtime is not None and problem.runtime == nvidia:
            problems.append(f"{problem.message}: CRI-O ignores the {nvidia} runtime")
        else:
            notes.append(f"{problem.message}: CRI-O ignores the {problem.runtime} runtime")
    return notes + problems, problems


def _effective_view(
    host: Host,
    path: str,
    dropin_dir: str,
    runtimes: Mapping[str, Mapping[str, Any]],
    nvidia: tuple[str, str] | None,
) -> tuple[EffectiveConfig | None, list[str], list[str]]:
    """(CRI-O's own view or None, notes, problems) for doctor."""
    if host.which("crio") is None:
        return None, [], []
    try:
        seen = running_config(host) or effective_config(host, path, dropin_dir)
    except ConfigError as exc:
        return None, [exc.message], [exc.message]
    except CommandFailed as exc:
        return None, [f"CRI-O's own view of its configuration is not available: {exc.message}"], []
    if seen is None:
        return None, [], []
    name = nvidia[0] if nvidia else None
    notes = [seen.describe(name)]
    problems: list[str] = []
    if nvidia is not None:
        entry = seen.runtimes.get(nvidia[0])
        if entry is None:
            problems.append(
                f"the files define the {nvidia[0]} runtime but {seen.source} does not list it: CRI-O "
                "ignored it as invalid (`journalctl -u crio`), or has not been restarted since it was added"
            )
        elif entry.get("runtime_path") not in (nvidia[1], "") and "status" in seen.source:
            notes.append(
                f"the running CRI-O runs {entry.get('runtime_path')} for {nvidia[0]}, the files say "
                f"{nvidia[1]}: restart CRI-O to use the files"
            )
    for problem in config_problems(seen.doc, seen.source):
        if problem.fatal or problem.runtime == name:
            problems.append(problem.message)
    notes += [p for p in problems if p not in notes]
    return seen, notes, problems


# -- CRI-O's rules for a runtime entry ------------------------------------------------------------------

# The keys of CRI-O's RuntimeHandler with the TOML type its decoder needs. A value of another type makes the
# decoder fail and CRI-O refuse to start ("unable to decode configuration"); keys it does not know it skips.
HANDLER_TYPES: dict[str, type | tuple[type, ...]] = {
    "runtime_path": str,
    "runtime_type": str,
    "runtime_root": str,
    "runtime_config_path": str,
    "inherit_default_runtime": bool,
    "privileged_without_host_devices": bool,
    "allowed_annotations": list,
    "monitor_path": str,
    "monitor_cgroup": str,
    "monitor_env": list,
    "monitor_exec_cgroup": str,
    "platform_runtime_paths": dict,
    "runtime_pull_image": bool,
    "container_min_memory": str,
    "no_sync_log": bool,
    "default_annotations": dict,
    "stream_websockets": bool,
    "exec_cpu_affinity": str,
    "seccomp_profile": str,
    "container_create_timeout": int,
}
RUNTIME_TYPES = ("", "oci", "vm", "pod")  # "" is "oci"
# The monitors by the names CRI-O's packages give them (pkgs.k8s.io: /usr/libexec/crio/conmon[rs], later
# /usr/bin/crio-conmon[rs]; the static bundle: /usr/local/bin/conmon[rs]). Other names are not judged.
CONMON_NAMES = ("conmon", "crio-conmon")
CONMONRS_NAMES = ("conmonrs", "crio-conmonrs", "conmon-rs")
# Where packaged CRI-O puts conmon outside $PATH, in the order gpunode looks for it.
CONMON_LOCATIONS = (
    "/usr/libexec/crio/conmon",
    "/usr/bin/crio-conmon",
    "/usr/local/libexec/crio/conmon",
    "/usr/local/bin/conmon",
    "/usr/bin/conmon",
)
VM_BINARY = re.compile(r"containerd-shim-([a-zA-Z0-9\-\+])+-v2")


@dataclass(frozen=True)
class ConfigProblem:
    """One breach of CRI-O's rules. fatal: CRI-O refuses to start; else the runtime alone is unusable."""

    runtime: str | None
    message: str
    fatal: bool


def monitor_kind(path: str) -> str | None:
    """ "conmon", "conmon-rs", or None for a name gpunode does not know."""
    name = PurePosixPath(path).name
    if name in CONMON_NAMES:
        return "conmon"
    if name in CONMONRS_NAMES:
        return "conmon-rs"
    return None


def _runtime_table(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    crio = doc.get("crio")
    runtime = crio.get("runtime") if isinstance(crio, Mapping) else None
    return runtime if isinstance(runtime, Mapping) else {}


def config_problems(doc: Mapping[str, Any], path: str = CRIO_CONF) -> list[ConfigProblem]:
    """Check a merged configuration (crio.conf and drop-ins, as merge_dropin merges them) as CRI-O does.

    Only what can be judged from the files: whether runtime_path or a monitor binary exists is for CRI-O
    (or `crio config` / `crio status config`) to say.
    """
    runtime = _runtime_table(doc)
    runtimes = configured_runtimes(doc, path)
    default = default_runtime(doc, runtimes)
    problems: list[ConfigProblem] = []
    for key in ("conmon", "conmon_cgroup", "cgroup_manager", "default_runtime"):
        if key in runtime and not isinstance(runtime[key], str):
            problems.append(ConfigProblem(None, f"crio.runtime.{key} must be a string", True))
    if default not in runtimes and default not in ("runc", "crun"):
        # ValidateDefaultRuntime: only an unset default_runtime falls back to the built-in entry.
        problems.append(
            ConfigProblem(
                None,
                f'default_runtime "{default}" has no [crio.runtime.runtimes.{default}] table',
                True,
            )
        )
    for name, entry in runtimes.items():
        problems += _handler_problems(name, entry, runtime, fatal=name == default)
    return problems


def _handler_problems(
    name: str, entry: Mapping[str, Any], runtime: Mapping[str, Any], *, fatal: bool
) -> list[ConfigProblem]:
    """CRI-O's RuntimeHandler.Validate and TranslateMonitorFields for one entry.

    A handler that fails Validate is dropped with a warning, unless it is the default (then CRI-O stops);
    the monitor checks of an "oci" handler stop CRI-O whichever handler it is.
    """
    where = f"crio.runtime.runtimes.{name}"
    found: list[ConfigProblem] = []

    def problem(message: str, *, always_fatal: bool = False) -> None:
        found.append(ConfigProblem(name, f"{where}: {message}", fatal or always_fatal))

    for key, want in HANDLER_TYPES.items():
        value = entry.get(key)
        if value is None:
            continue
        wrong = not isinstance(value, want) or (want is int and isinstance(value, bool))
        if wrong:
            problem(f"{key} must be a {_type_name(want)}, not {value!r}", always_fatal=True)
    if found:
        return found  # the decoder stops at the first wrong type: nothing else is read
    rtype = entry.get("runtime_type", "")
    if rtype not in RUNTIME_TYPES:
        problem(f'runtime_type "{rtype}" is not one of "oci", "vm", "pod"')
        return found
    if entry.get("runtime_config_path") and rtype != "vm":
        problem('runtime_config_path can only be used with runtime_type "vm"')
    vm_binary = PurePosixPath(str(entry.get("runtime_path", ""))).name
    if rtype == "vm" and vm_binary and not VM_BINARY.search(vm_binary):  # Go's MatchString: a search
        problem("a vm runtime_path must be named containerd-shim-<name>-v2")
    if entry.get("no_sync_log") and rtype not in ("", "oci"):
        problem(f'no_sync_log is only allowed with runtime_type "oci", not "{rtype}"')
    if entry.get("stream_websockets") and rtype != "pod":
        problem('stream_websockets needs runtime_type "pod" (conmon-rs)')
    if entry.get("exec_cpu_affinity", "") not in ("", "first"):
        problem(f'exec_cpu_affinity must be "" or "first", not "{entry["exec_cpu_affinity"]}"')
    if entry.get("monitor_exec_cgroup", "") not in ("", "container"):
        # Not checked at start: every exec probe fails ("Unsupported monitor_exec_cgroup value").
        problem(f'monitor_exec_cgroup must be "" or "container", not "{entry["monitor_exec_cgroup"]}"')
    monitor = str(entry.get("monitor_path", ""))
    if rtype in ("", "oci"):
        found += _conmon_problems(name, entry, runtime)
    elif rtype == "pod" and monitor_kind(monitor) == "conmon":
        # runtime_pod.go starts monitor_path as the conmon-rs server of each pod; conmon cannot be one.
        problem(f'runtime_type "pod" starts monitor_path as conmon-rs, but {monitor} is conmon')
    return found


def _conmon_problems(name: str, entry: Mapping[str, Any], runtime: Mapping[str, Any]) -> list[ConfigProblem]:
    """TranslateMonitorFieldsForHandler: an "oci" handler's monitor is conmon, and its cgroup must suit the
    cgroup manager; either failing stops CRI-O ("failed to translate monitor fields for runtime NAME")."""
    where = f"crio.runtime.runtimes.{name}"
    found: list[ConfigProblem] = []
    # The deprecated global options still win over the handler's own.
    monitor = str(runtime.get("conmon") or entry.get("monitor_path", ""))
    if monitor_kind(monitor) == "conmon-rs":
        found.append(
            ConfigProblem(
                name,
                f'{where}: runtime_type "oci" runs {monitor} as conmon (`conmon --version` must name a '
                'conmon version), but it is conmon-rs, which needs runtime_type "pod"',
                True,
            )
        )
    cgroup = str(runtime.get("conmon_cgroup") or entry.get("monitor_cgroup", ""))
    if runtime.get("cgroup_manager", "systemd") == "cgroupfs":
        if cgroup not in ("", "pod", "system.slice"):
            found.append(
                ConfigProblem(name, f"{where}: with cgroupfs monitor_cgroup must be 'pod' or empty", True)
            )
    elif cgroup and cgroup != "pod" and not cgroup.endswith(".slice"):
        found.append(
            ConfigProblem(
                name, f"{where}: monitor_cgroup must be 'pod' or a systemd slice, not {cgroup!r}", True
            )
        )
    return found


def _type_name(want: type | tuple[type, ...]) -> str:
    names = {str: "string", bool: "boolean", list: "list", dict: "table", int: "integer"}
    kinds = want if isinstance(want, tuple) else (want,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def find_conmon(host: Host) -> str | None:
    """conmon as CRI-O would find it for an "oci" runtime without monitor_path: on $PATH. None there: the
    first of the places CRI-O's packages put it (None: not installed)."""
    if host.which("conmon") is not None:
        return None
    return next((p for p in CONMON_LOCATIONS if host.is_file(p)), None)


NVIDIA_RUNTIME_CONFIG = "/etc/nvidia-container-runtime/config.toml"
NVIDIA_LOW_LEVEL_DEFAULT = ("docker-runc", "runc", "crun")  # nvidia-container-runtime's built-in list


def low_level_runtime_note(host: Host, model_path: str | None) -> str | None:
    """A note when nvidia-container-runtime will not find the OCI runtime it wraps.

    It does not take CRI-O's runtime_path of the runtime it replaces: it looks up the names in
    `runtimes` of its own config.toml on $PATH. CRI-O's packages install crun and runc as
    /usr/libexec/crio/crun or /usr/bin/crio-crun, off $PATH or under another name, and every container then
    fails with "no runtime binary found from candidate list".
    """
    candidates: list[str] = list(NVIDIA_LOW_LEVEL_DEFAULT)
    text = host.read_text_if_exists(NVIDIA_RUNTIME_CONFIG)
    if text is not None:
        try:
            section = parse_toml(text, NVIDIA_RUNTIME_CONFIG).get("nvidia-container-runtime")
        except ConfigError:
            return None  # the toolkit's file: `gpunode doctor` and the toolkit judge it
        listed = section.get("runtimes") if isinstance(section, Mapping) else None
        if isinstance(listed, list) and all(isinstance(c, str) for c in listed):
            candidates = listed
    for candidate in candidates:
        if host.is_file(candidate) if candidate.startswith("/") else host.which(candidate):
            return None
    fix = f'runtimes = ["{model_path}"]' if model_path else 'runtimes = ["/path/to/crun"]'
    return (
        f"nvidia-container-runtime looks for the OCI runtime it wraps as {', '.join(candidates)} on $PATH "
        f'(`runtimes` in {NVIDIA_RUNTIME_CONFIG}) and finds none here: containers with it would fail ("no '
        f'runtime binary found from candidate list"); set {fix} under [nvidia-container-runtime] there'
    )


# -- the configuration CRI-O computes itself ---------------------------------------------------------

CONFIG_TIMEOUT = 30.0
# `crio config` comments out every value equal to CRI-O's built-in default ("# default_runtime = \"crun\"");
# the runtimes block is commented out whole when it is the built-in one. The template's own example entry
# is called runtime-handler.
_COMMENTED_DEFAULT = re.compile(r'^# default_runtime = "([^"]*)"$', re.MULTILINE)
_COMMENTED_RUNTIME = re.compile(r"^# \[crio\.runtime\.runtimes\.([^\]]+)\]$")
_TEMPLATE_EXAMPLE = "runtime-handler"


@dataclass(frozen=True)
class EffectiveConfig:
    """What CRI-O itself reads from its files (`crio config`) or runs with (`crio status config`)."""

    source: str  # the command, as shown to the operator
    doc: dict[str, Any]
    runtimes: dict[str, Mapping[str, Any]]
    default: str

    def describe(self, name: str | None) -> str:
        text = f"{self.source}: runtimes {', '.join(self.runtimes) or '(none)'}; default {self.default}"
        entry = self.runtimes.get(name) if name else None
        if entry is not None:
            text += (
                f"; {name} runs {entry.get('runtime_path') or '(its name on $PATH)'} "
                f"(runtime_type {entry.get('runtime_type') or 'oci'}, "
                f"monitor {entry.get('monitor_path') or '(found on $PATH)'})"
            )
        return text


def parse_effective(text: str, source: str) -> EffectiveConfig:
    """Read `crio config` output (values at their default commented out) or `crio status config` output
    (every value written) into the same shape."""
    doc = parse_toml(text, source)
    runtimes = configured_runtimes(doc, source) or _commented_runtimes(text, source)
    default = _runtime_table(doc).get("default_runtime")
    if not isinstance(default, str) or not default:
        commented = _COMMENTED_DEFAULT.search(text)
        default = commented.group(1) if commented else default_runtime(doc, runtimes)
    return EffectiveConfig(source, doc, runtimes, default)


def _commented_runtimes(text: str, source: str) -> dict[str, Mapping[str, Any]]:
    """The built-in runtimes `crio config` prints commented out: each header and the "# key = value" lines
    under it, up to the blank line that ends the entry."""
    found: dict[str, Mapping[str, Any]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        header = _COMMENTED_RUNTIME.match(line)
        if header is None or header.group(1) == _TEMPLATE_EXAMPLE:
            continue
        body = [line[2:]]
        for following in lines[i + 1 :]:
            if not following.startswith("# "):
                break
            body.append(following[2:])
        entry = configured_runtimes(parse_toml("\n".join(body) + "\n", source), source)
        found.update(entry)
    return found


def effective_config(
    host: Host,
    main: str = CRIO_CONF,
    dropin_dir: str = DROPIN_DIR,
    *,
    planned: Mapping[str, str | None] | None = None,
) -> EffectiveConfig | None:
    """`crio config` on the files as they are, or as they will be with `planned` ({host path: new text,
    None: removed}) written. None when the crio program is not installed.

    The planned layout is copied into a private temp directory (crio.conf and crio.conf.d as CRI-O reads
    them) so that CRI-O judges exactly the bytes gpunode would write, before anything is written.
    """
    binary = host.which("crio")
    if binary is None or not host.commands_reach_root:
        # Under --root no program runs: this machine's crio may be another release (or none), and R's own
        # binary is not executed here (gpunode.runtimes.probe). gpunode merges the files as CRI-O does.
        return None
    if planned is None:
        argv = [
            binary,
            "--config",
            str(host.path(main)),
            "--config-dir",
            str(host.path(dropin_dir)),
            "config",
        ]
        return _run_config(host, argv, "`crio config`")
    with tempfile.TemporaryDirectory(prefix="gpunode-crio-") as tmp:
        texts: dict[str, str | None] = {}
        for file in ([main] if host.is_file(main) else []) + dropin_files(host, dropin_dir):
            texts[file] = host.read_text(file)
        texts.update(planned)
        local_main = Path(tmp) / "crio.conf"
        local_dir = Path(tmp) / "crio.conf.d"
        local_dir.mkdir(mode=0o700)
        local_main.write_text(texts.get(main) or "")
        host_dir = dropin_dir.rstrip("/") + "/"
        for file, text in texts.items():
            if file != main and file.startswith(host_dir) and text is not None:
                local = local_dir / file[len(host_dir) :]
                local.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                local.write_text(text)
        argv = [binary, "--config", str(local_main), "--config-dir", str(local_dir), "config"]
        return _run_config(host, argv, "`crio config` on the planned files")


def _run_config(host: Host, argv: list[str], source: str) -> EffectiveConfig:
    result = host.run(argv, timeout=CONFIG_TIMEOUT)
    if not result.ok:
        # `crio config` validates what it prints; a failure here is the error CRI-O would stop with.
        why = (result.stderr or result.stdout).strip().splitlines()
        raise ConfigError(
            f"{source} refuses the configuration (CRI-O would not start): {why[-1] if why else 'no message'}",
            "correct the file it names (gpunode wrote nothing), then run the command again",
        )
    return parse_effective(result.stdout, source)


def running_config(host: Host, socket: str = SOCKET) -> EffectiveConfig | None:
    """The configuration the running CRI-O uses (`crio status config`, `crio-status config` before 1.28),
    after its own validation: a runtime it ignored as invalid is not in it. None: not running here."""
    if not host.is_socket(socket) or not host.commands_reach_root:  # under --root no program runs
        return None
    local = str(host.path(socket))
    for program, argv in (
        ("crio", ["status", "--socket", local, "config"]),
        ("crio-status", ["--socket", local, "config"]),
    ):
        binary = host.which(program)
        if binary is None:
            continue
        try:
            result = host.run([binary, *argv], timeout=CONFIG_TIMEOUT)
        except CommandFailed:
            continue
        if result.ok and result.stdout.strip():
            return parse_effective(
                result.stdout,
                f"`{program} {argv[0]} config`" if program == "crio" else "`crio-status config`",
            )
    return None
