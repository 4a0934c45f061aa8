"""Plan the CRI-O drop-in that adds the nvidia runtime (crio.conf.d/99-nvidia.toml by default).

The nvidia runtime is a copy of the default runtime with runtime_path replaced, runtime_type and the
monitor settings included: CRI-O ties the monitor to the type (pkg/config/config.go). "oci" runs
monitor_path as conmon and checks it at start (`conmon --version`), with monitor_cgroup a systemd slice or
"pod"; "pod" starts monitor_path as the conmon-rs server of each pod (internal/oci/runtime_pod.go). A copy
of a "pod" default with conmon-rs therefore stays "pod" with the same conmon-rs: the one monitor known to be
installed and to work on this node. Writing "oci" there instead would either name conmon-rs as conmon
(CRI-O refuses to start) or leave monitor_path empty, and CRI-O then looks for "conmon" on $PATH, where
packaged CRI-O does not put it: "failed to translate monitor fields for runtime nvidia", and CRI-O stops.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from gpunode.errors import ConfigError, NotFound, UsageError
from gpunode.host import Host
from gpunode.runtimes import crio
from gpunode.runtimes.containerd import parse_toml
from gpunode.runtimes.edits import ABSENT, Editor, TomlFormat, lookup, new_toml_document
from gpunode.runtimes.plan import ConfigureOptions, FileChange, RuntimePlan
from gpunode.runtimes.tomlread import plain

DROPIN = f"{crio.DROPIN_DIR}/99-nvidia.toml"
UNIT = "crio.service"
SOCKET = crio.SOCKET
# Never copied from the default runtime: each would make CRI-O run another binary than runtime_path
# (inherit_default_runtime takes the default's runtime_path at load; platform_runtime_paths replaces it for
# the image's platform) or is only valid for runtime_type "vm".
NOT_COPIED = ("runtime_path", "inherit_default_runtime", "platform_runtime_paths", "runtime_config_path")
HEADER = (
    "Written by `gpunode configure-runtime crio`: the NVIDIA runtime for CRI-O.\n"
    "`gpunode configure-runtime crio --revert` removes this file."
)


def plan_crio(host: Host, opts: ConfigureOptions) -> RuntimePlan:
    main = opts.config or crio.CRIO_CONF
    target = main if opts.in_place else opts.drop_in or DROPIN
    if not posixpath.isabs(target):
        raise UsageError(f"--drop-in needs an absolute path, not {target!r}")
    messages: list[str] = []
    if posixpath.dirname(target) == crio.WRONG_DROPIN_DIR:
        raise UsageError(
            f"CRI-O does not read {crio.WRONG_DROPIN_DIR}", f"use a file in {crio.DROPIN_DIR} instead"
        )
    fmt = TomlFormat()
    text = host.read_text_if_exists(target)
    doc = fmt.parse(text, target) if text is not None else new_toml_document(HEADER)

    # The effective configuration today: crio.conf, then every drop-in in the order CRI-O reads them; with
    # --effective, as CRI-O itself computes it (`crio config`).
    runtimes, default, global_conmon = _current(host, main, opts)

    editor = Editor(fmt, doc)
    entry_path = (*crio.RUNTIMES_PATH, opts.runtime_name)
    existing = lookup(doc, entry_path)
    if existing is ABSENT:
        # A runtime entry in a later file replaces the whole earlier one: start from what is there.
        found = runtimes.get(opts.runtime_name)
        base, source = (
            (found, opts.runtime_name) if found else _reference(runtimes, default, opts.runtime_name)
        )
        entry = {k: v for k, v in plain(base).items() if k not in NOT_COPIED and k != "runtime_type"}
        if opts.effective:  # CRI-O prints every field; its empty ones are its defaults anyway
            entry = {k: v for k, v in entry.items() if v not in ("", [], {}, False)}
        rtype = str(base.get("runtime_type") or "oci")
        entry = {"runtime_path": opts.runtime_path, "runtime_type": rtype, **entry}
        if source and source != opts.runtime_name:
            messages.append(_copied_note(opts.runtime_name, source, entry))
    else:
        editor.set((*entry_path, "runtime_path"), opts.runtime_path)
        entry = plain(existing)
        _repair_existing(editor, entry_path, entry, messages)
        entry = plain(lookup(doc, entry_path))
    monitor = _conmon_for(host, entry, global_conmon, opts.runtime_name, messages)
    if existing is ABSENT:
        editor.set(entry_path, {**entry, **monitor})
    elif monitor:
        editor.set((*entry_path, "monitor_path"), monitor["monitor_path"])
    if opts.set_as_default:
        editor.set(("crio", "runtime", "default_runtime"), opts.runtime_name)
    model = _reference(runtimes, default, opts.runtime_name)[0].get("runtime_path")
    low_level = crio.low_level_runtime_note(host, model if isinstance(model, str) and model else None)
    if low_level:
        messages.append(low_level)
    if opts.cdi:
        messages.append("CRI-O always has CDI enabled; --cdi changes nothing for it")
    after = fmt.render(doc, text) if editor.edits else text
    _check_effect(host, main, target, after, opts)
    _check_rules(host, main, target, after, opts, messages=messages)
    return RuntimePlan(
        runtime="crio",
        changes=(
            FileChange(
                target,
                text,
                after,
                tuple(editor.edits),
                owned=text is None,
                temp_dir=_outside_dropins(target),
            ),
        ),
        messages=tuple(messages),
        unit=UNIT,
        socket=SOCKET,
        standard_location=opts.config is None and opts.drop_in in (None, DROPIN),
        expect=(opts.runtime_name, opts.set_as_default),
    )


def _outside_dropins(target: str) -> str | None:
    """Where the temp file of a write goes: not in crio.conf.d (or under it), which CRI-O reads whole."""
    if target.startswith(f"{crio.DROPIN_DIR}/"):
        return posixpath.dirname(crio.DROPIN_DIR)
    return None


def _current(
    host: Host, main: str, opts: ConfigureOptions
) -> tuple[Mapping[str, Mapping[str, Any]], str, str]:
    """(runtimes, default runtime, the global `conmon`) as CRI-O will see them before gpunode's change."""
    if opts.effective:
        if not host.commands_reach_root:
            raise UsageError(
                "--effective asks the crio program, and under --root gpunode runs no program (neither this "
                "machine's nor the image's)",
                "leave out --effective: gpunode then merges the files as CRI-O does",
            )
        seen = crio.effective_config(host, main, crio.DROPIN_DIR)
        if seen is None:
            raise NotFound(
                "--effective asks CRI-O for its configuration, but the crio program is not installed here",
                "leave out --effective: gpunode then merges the files as CRI-O does",
            )
        doc: Mapping[str, Any] = seen.doc
        runtimes, default = seen.runtimes, seen.default
    else:
        files = [main] if host.is_file(main) else []
        files += [f for f in crio.dropin_files(host) if f != main]
        merged: dict[str, Any] = {}
        for file in files:
            merged = crio.merge_dropin(merged, parse_toml(host.read_text(file), file))
        doc = merged
        runtimes = crio.configured_runtimes(merged, main)
        default = crio.default_runtime(merged, runtimes)
    conmon = lookup(doc, ("crio", "runtime", "conmon"))
    return runtimes, default, conmon if isinstance(conmon, str) else ""


def _reference(
    runtimes: Mapping[str, Mapping[str, Any]], default: str, name: str
) -> tuple[Mapping[str, Any], str | None]:
    """(entry, its name) of the runtime to copy: the default, else crun, else runc. A "vm" runtime (Kata)
    is no model for an OCI runtime wrapper; "oci" and "pod" are."""
    for candidate in (default, "crun", "runc"):
        entry = runtimes.get(candidate)
        if candidate != name and entry is not None and entry.get("runtime_type", "oci") in ("", "oci", "pod"):
            return entry, candidate
    return {}, None


def _copied_note(name: str, source: str, entry: Mapping[str, Any]) -> str:
    monitor = entry.get("monitor_path") or "(found on $PATH)"
    kind = "conmon-rs" if entry["runtime_type"] == "pod" else "conmon"
    return (
        f'the "{name}" runtime copies the options of "{source}": runtime_type "{entry["runtime_type"]}" '
        f"with {kind} {monitor} as its monitor, as CRI-O requires for that type"
    )


def _repair_existing(
    editor: Editor, entry_path: tuple[str, ...], entry: Mapping[str, Any], messages: list[str]
) -> None:
    """An entry gpunode's file already has: repair what stops CRI-O or bypasses runtime_path."""
    monitor = str(entry.get("monitor_path") or "")
    rtype = str(entry.get("runtime_type") or "oci")
    kind = crio.monitor_kind(monitor)
    wanted = {"conmon": "oci", "conmon-rs": "pod"}.get(kind or "", rtype)
    if wanted != rtype and rtype in ("oci", "pod"):
        editor.set((*entry_path, "runtime_type"), wanted)
        messages.append(
            f'runtime_type "{rtype}" cannot run with {monitor} ({kind}): set to "{wanted}", the type CRI-O '
            "runs that monitor with"
        )
    if entry.get("inherit_default_runtime") is True:
        editor.set((*entry_path, "inherit_default_runtime"), False)
        messages.append(
            "inherit_default_runtime = true made CRI-O replace runtime_path with the default runtime's: "
            "set to false"
        )
    if entry.get("platform_runtime_paths"):
        raise ConfigError(
            f"{'.'.join(entry_path)} has platform_runtime_paths, which CRI-O runs instead of runtime_path "
            "for those platforms: containers there would not get nvidia-container-runtime",
            "remove platform_runtime_paths from that entry, then run the command again",
        )


def _conmon_for(
    host: Host, entry: Mapping[str, Any], global_conmon: str, name: str, messages: list[str]
) -> dict[str, str]:
    """{"monitor_path": conmon} for an "oci" entry CRI-O would otherwise look for conmon on $PATH for,
    when conmon is installed elsewhere (packaged CRI-O keeps it in /usr/libexec/crio); else {}."""
    if str(entry.get("runtime_type") or "oci") != "oci" or entry.get("monitor_path") or global_conmon:
        return {}
    found = crio.find_conmon(host)
    if found is not None:
        return {"monitor_path": found}
    if host.which("conmon") is None:
        messages.append(
            f'the "{name}" runtime has no monitor_path and conmon is not on $PATH: CRI-O will not start '
            "until conmon is installed (CRI-O's packages ship it)"
        )
    return {}


def _check_rules(
    host: Host, main: str, target: str, after: str | None, opts: ConfigureOptions, *, messages: list[str]
) -> None:
    """Judge the configuration as it will be, by CRI-O's rules (and by CRI-O itself with --effective),
    before anything is written: a result CRI-O refuses, or one without the runtime as asked, is refused."""
    if after is None:
        return
    dropins = [f for f in crio.dropin_files(host) if f != main]
    if target.startswith(f"{crio.DROPIN_DIR}/") and target not in dropins:
        # filepath.Walk's order: names sorted at each level, so paths compare component by component.
        dropins = sorted([*dropins, target], key=lambda f: f.split("/"))
    files = ([main] if host.is_file(main) or main == target else []) + dropins
    merged: dict[str, Any] = {}
    for file in files:
        text = after if file == target else host.read_text(file)
        merged = crio.merge_dropin(merged, parse_toml(text, file))
    problems = [p for p in crio.config_problems(merged, main) if p.fatal or p.runtime == opts.runtime_name]
    if opts.effective:
        seen = crio.effective_config(host, main, crio.DROPIN_DIR, planned={target: after})
        if seen is not None:
            problems += [
                p
                for p in crio.config_problems(seen.doc, seen.source)
                if p.fatal or p.runtime == opts.runtime_name
            ]
            problems += _effective_mismatch(seen, opts)
            if not problems:
                messages.append(f"{seen.describe(opts.runtime_name)}: as intended")
    if problems:
        raise ConfigError(
            "CRI-O would not run the configuration as planned: "
            + "; ".join(dict.fromkeys(p.message for p in problems)),
            "correct what is named (gpunode wrote nothing), then run the command again",
        )


def _effective_mismatch(seen: crio.EffectiveConfig, opts: ConfigureOptions) -> list[crio.ConfigProblem]:
    entry = seen.runtimes.get(opts.runtime_name)
    name = opts.runtime_name
    if entry is None:
        return [crio.ConfigProblem(name, f"{seen.source} does not list the {name} runtime", True)]
    found: list[crio.ConfigProblem] = []
    if entry.get("runtime_path") != opts.runtime_path:
        found.append(
            crio.ConfigProblem(
                name,
                f"{seen.source} runs {entry.get('runtime_path')!r} for {name}, not {opts.runtime_path}",
                True,
            )
        )
    if opts.set_as_default and seen.default != name:
        found.append(crio.ConfigProblem(name, f"{seen.source} keeps {seen.default!r} as the default", True))
    return found


def _check_effect(host: Host, main: str, target: str, after: str | None, opts: ConfigureOptions) -> None:
    """A drop-in CRI-O reads after gpunode's could undo it; say which, rather than report success."""
    if after is None:
        return
    later = [f for f in crio.dropin_files(host) if f != target and (target == main or f > target)]
    for file in later:
        doc = parse_toml(host.read_text(file), file)
        default = lookup(doc, ("crio", "runtime", "default_runtime"))
        if opts.set_as_default and default not in (ABSENT, opts.runtime_name):
            raise ConfigError(
                f"{file} is read after {target} and sets default_runtime = {default!r}, which would override "
                "gpunode's",
                f"remove default_runtime from {file}, or write the drop-in after it with --drop-in",
            )
        if lookup(doc, (*crio.RUNTIMES_PATH, opts.runtime_name)) is not ABSENT:
            raise ConfigError(
                f"{file} is read after {target} and defines runtime {opts.runtime_name!r} itself, replacing "
                "gpunode's entry",
                f"remove that entry from {file}, or let gpunode edit it with --drop-in {file}",
            )
