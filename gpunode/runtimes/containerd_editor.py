"""Plan the changes to containerd's configuration that add the nvidia runtime.

In place (the default) the main file's CRI table gains the runtime; with a drop-in, a separate file
carries it and the main file gains an absolute `imports` entry. k3s and RKE2 regenerate config.toml at
every start, so their template is edited instead (made from the generated file when there is none yet).
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Mapping, MutableMapping
from typing import Any

from gpunode.errors import ConfigError, NotFound, UsageError
from gpunode.host import Host
from gpunode.runtimes import containerd as ctd
from gpunode.runtimes import k3s
from gpunode.runtimes.containerd_units import SOCKETS, unit_for
from gpunode.runtimes.edits import ABSENT, Editor, TomlFormat, lookup, new_toml_document
from gpunode.runtimes.plan import ConfigureOptions, FileChange, RuntimePlan
from gpunode.runtimes.tomlread import plain

RUNC_V2 = ctd.RUNC_V2
DROPIN_HEADER = (
    "Written by `gpunode configure-runtime containerd --drop-in`: the NVIDIA runtime.\n"
    "containerd before 2.1 replaces the whole CRI plugin table from an imported file, so this file carries\n"
    "a complete copy of it: change CRI settings here, not in the main file.\n"
    "`gpunode configure-runtime containerd --revert` removes this file and its imports entry."
)


def plan_containerd(host: Host, opts: ConfigureOptions) -> RuntimePlan:
    installed = ctd.installed_containerd_version(host)
    messages: list[str] = []
    flavour = "containerd"
    if opts.config is not None:
        path, base_text = opts.config, host.read_text_if_exists(opts.config)
    else:
        location = ctd.detect_location(host)
        flavour = location.flavour
        if flavour in ("k3s", "rke2"):
            k3s_plan = k3s.plan_k3s(host, location, opts)
            if k3s_plan is not None:
                return k3s_plan  # None: the user's own plain-TOML template, edited below like any file
        path, base_text = _target(host, location, messages)
    text = host.read_text_if_exists(path)
    if (path.endswith(".tmpl") or path == ctd.MICROK8S_TEMPLATE) and ctd.has_go_template_syntax(
        base_text or ""
    ):
        raise ConfigError(
            f"{path} is a Go template ({{{{ ... }}}}), which gpunode cannot edit safely as TOML",
            "add the runtime to the template by hand (see `gpunode configure-runtime containerd --dry-run "
            "--config /tmp/config.toml` for the TOML to add), or remove the template syntax",
        )
    fmt = TomlFormat()
    doc = fmt.parse(base_text or "", path)
    current = plain(doc)  # plain values once: reading through tomlkit items is slow
    version = ctd.detect_version(current, installed[0] if installed else None, path=path)
    _check_version(path, version, installed)
    if ctd.cri_disabled(current):
        raise ConfigError(
            f"{path} disables the CRI plugin (disabled_plugins): kubelet cannot use this containerd, so "
            "adding a runtime to it would change nothing",
            f'remove "cri" from disabled_plugins in {path} if kubelet should use this containerd',
        )
    if not current:
        doc["version"] = version
        current = {"version": version}
        if base_text is not None and base_text.strip():
            messages.append(f"{path} holds only comments; gpunode writes a version {version} configuration")
    merged = _merged(host, path, current, installed)
    if opts.effective:
        merged = _effective(host, path, merged, version, messages)

    changes: list[FileChange] = []
    if opts.drop_in is None:
        _refuse_overriding_imports(host, path, current, version, installed)
        editor = Editor(fmt, doc)
        _add_nvidia(editor, merged, version, opts, messages)
        after = fmt.render(doc, text) if editor.edits or text != base_text else text
        changes.append(FileChange(path, text, after, tuple(editor.edits)))
    else:
        changes.extend(
            _drop_in_changes(
                host,
                fmt=fmt,
                path=path,
                text=text,
                main_doc=doc,
                merged=merged,
                version=version,
                installed=installed,
                opts=opts,
                messages=messages,
            )
        )
    if opts.cdi and installed is not None and installed < (1, 7):
        messages.append(
            f"containerd {installed[0]}.{installed[1]} ignores enable_cdi: CDI needs containerd 1.7 or later"
        )
    if flavour in ("k3s", "rke2"):
        messages.append(f"{flavour} renders config.toml from the template when it restarts")
    return RuntimePlan(
        runtime="containerd",
        changes=tuple(changes),
        messages=tuple(messages),
        unit=unit_for(host, flavour),
        socket=SOCKETS[flavour],
        flavour=flavour,
        standard_location=opts.config is None,
        expect=(opts.runtime_name, opts.set_as_default),
    )


def _target(host: Host, location: ctd.ConfigLocation, messages: list[str]) -> tuple[str, str | None]:
    """(the file to edit, its current text or the text it starts from)."""
    if not location.regenerated:
        return location.config_path, host.read_text_if_exists(location.config_path)
    if location.template_path is None:
        # k3s / RKE2 without a template are planned by gpunode.runtimes.k3s: never a frozen copy of
        # config.toml, whose k3s settings would no longer follow k3s upgrades.
        raise NotFound(f"{location.flavour} has no template at {', '.join(location.template_candidates)}")
    return location.template_path, host.read_text(location.template_path)


def _check_version(path: str, version: int, installed: tuple[int, int] | None) -> None:
    if installed is None:
        return
    if installed[0] >= 2 and version == 1:
        # containerd 2.x reads plugins.cri keys as unknown ("Ignoring unknown key in TOML ... containerd
        # runtimes nvidia"): the node would end without an nvidia runtime while gpunode reported success.
        raise ConfigError(
            f"{path} is a version 1 configuration (no `version` key, or version = 1), but containerd "
            f"{installed[0]}.{installed[1]} is installed, which ignores its CRI settings: a runtime added "
            "there would never be seen",
            "migrate it first: `containerd config migrate > /tmp/config.toml`, review it, move it to "
            f"{path}, then run this command again",
        )
    if installed[0] < 2 and version == 3:
        raise ConfigError(
            f"{path} is a version 3 configuration, but containerd {installed[0]}.{installed[1]} is "
            "installed: 1.6 ignores such a file without a word and 1.7 refuses to start",
            f"write {path} as version 2 (`containerd config default` prints one)",
        )


def _effective(
    host: Host, path: str, merged: dict[str, Any], version: int, messages: list[str]
) -> dict[str, Any]:
    """With --effective, containerd's own `config dump` decides what the runtimes and the default are today
    (imports, defaults and what it ignores included), in place of gpunode's merge of the files."""
    dump = ctd.effective_config(host, path)
    if dump is None:
        raise NotFound(
            "--effective asks containerd for its configuration (`containerd config dump`), which needs the "
            "containerd program on this machine's own root",
            "leave out --effective: gpunode then merges the files as containerd does",
        )
    if dump.version != version:
        # containerd 2.x dumps a version 2 file as version 3: the tables have other names than the file's.
        messages.append(
            f"containerd reads {path} (version {version}) as a version {dump.version} configuration: its "
            "dump is shown by doctor, and gpunode decides from the files"
        )
        return merged
    messages.append("decided from containerd's own view (`containerd config dump`)")
    return dump.doc


def _merged(
    host: Host, path: str, main: Mapping[str, Any], installed: tuple[int, int] | None
) -> dict[str, Any]:
    """The effective configuration: the main file (as it is being edited) with its imports merged in."""
    merged = dict(main)
    replace = installed is None or installed < (2, 1)
    seen = {path}
    pending = list(ctd.resolve_imports(host, path, main.get("imports")).paths)
    while pending:
        current = pending.pop(0)
        if current in seen:
            continue
        seen.add(current)
        doc = ctd.parse_toml(host.read_text(current), current)
        merged = ctd.merge_config(merged, doc, replace_plugins=replace)
        pending.extend(ctd.resolve_imports(host, current, doc.get("imports")).paths)
    return merged


def _refuse_overriding_imports(
    host: Host, path: str, main: Mapping[str, Any], version: int, installed: tuple[int, int] | None
) -> None:
    if installed is not None and installed >= (2, 1):
        return
    cri = ctd.cri_table_path(version)
    for imported in ctd.resolve_imports(host, path, main.get("imports")).paths:
        doc = ctd.parse_toml(host.read_text(imported), imported)
        if lookup(doc, cri[:2]) is not ABSENT:
            raise ConfigError(
                f"{imported}, imported by {path}, defines the CRI plugin table, which replaces the main "
                "file's (containerd before 2.1 does not merge imported plugin tables): a runtime added to "
                f"{path} would be ignored",
                f"configure that file instead (--config {imported}), or use --drop-in to write a complete "
                "CRI table imported after it",
            )


RUNC_V1 = ctd.RUNC_V1
LEGACY_TYPES = ctd.LEGACY_TYPES
V1_SHIM_KEYS = ("runtime_engine", "runtime_root")


def _reference_runtime(
    runtimes: Mapping[str, Mapping[str, Any]], default: str, name: str, cri: Mapping[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """The runtime pods get today (default, else runc, else crun) if it is a runc-type runtime, and the
    legacy type it was converted from (None when it needed no conversion): the nvidia runtime is a copy of
    it with another binary, so it keeps SystemdCgroup and every other option."""
    for candidate in (default, "runc", "crun"):
        entry = runtimes.get(candidate)
        if candidate == name or entry is None:
            continue
        runtime_type = entry.get("runtime_type", RUNC_V2)
        if runtime_type in (RUNC_V2, RUNC_V1):
            return dict(plain(entry)), None
        if runtime_type in LEGACY_TYPES:
            return _from_legacy_shim(plain(entry), cri), str(runtime_type)
    return {}, None


def _from_legacy_shim(entry: Mapping[str, Any], cri: Mapping[str, Any]) -> dict[str, Any]:
    """A legacy v1-shim runtime as the runc v2 shim understands it: RuntimeRoot becomes Root, SystemdCgroup
    comes from its options or from the CRI plugin's `systemd_cgroup`, and the v1-only keys (runtime_engine,
    runtime_root: containerd refuses them on any other runtime type) are left out."""
    options = entry.get("options") if isinstance(entry.get("options"), Mapping) else {}
    assert isinstance(options, Mapping)  # noqa: S101 (narrowed just above)
    converted: dict[str, Any] = {}
    root = options.get("RuntimeRoot") or entry.get("runtime_root")
    if root:
        converted["Root"] = root
    if options.get("CriuPath"):
        converted["CriuPath"] = options["CriuPath"]
    if options.get("SystemdCgroup") is True or cri.get("systemd_cgroup") is True:
        converted["SystemdCgroup"] = True
    kept = {k: v for k, v in entry.items() if k not in ("options", "runtime_type", *V1_SHIM_KEYS)}
    return {**kept, "options": converted}


def _add_nvidia(
    editor: Editor,
    merged: Mapping[str, Any],
    version: int,
    opts: ConfigureOptions,
    messages: list[str],
) -> None:
    cri = ctd.cri_table_path(version)
    runtimes_path = (*cri, "containerd", "runtimes")
    runtimes = ctd.configured_runtimes(merged, version)
    default = ctd.default_runtime_name(merged, version)
    cri_table = ctd.cri_table(merged, version)
    reference, converted_from = _reference_runtime(runtimes, default, opts.runtime_name, cri_table)
    if converted_from is not None:
        cgroup = "SystemdCgroup = true" if reference["options"].get("SystemdCgroup") else "cgroupfs"
        messages.append(
            f'the default runtime uses the legacy v1 shim (runtime_type = "{converted_from}"): the '
            f'"{opts.runtime_name}" runtime is a runc v2 runtime with its settings converted ({cgroup})'
        )
    if not ctd.defines_runtimes_table(merged, version):
        # Without a runtimes table containerd has runc built in; a table with only nvidia would lose it.
        editor.set((*runtimes_path, ctd.BUILTIN_DEFAULT_RUNTIME), {"runtime_type": RUNC_V2})
    existing = lookup(editor.doc, (*runtimes_path, opts.runtime_name))
    if existing is ABSENT:
        # runtime_engine / runtime_root belong to the v1 shim only: containerd 1.x refuses them (non-empty)
        # on a runc v2 runtime and 2.x does not know them at all.
        entry = {k: v for k, v in reference.items() if k not in ("options", *V1_SHIM_KEYS)}
        entry["runtime_type"] = RUNC_V2
        options = dict(reference.get("options") or {})
        options["BinaryName"] = opts.runtime_path
        entry["options"] = options
        editor.set((*runtimes_path, opts.runtime_name), entry)
        if reference:
            messages.append(f'the "{opts.runtime_name}" runtime copies the options of the current default')
    else:
        entry_path = (*runtimes_path, opts.runtime_name)
        if not isinstance(existing, dict):
            raise ConfigError(f"runtime {opts.runtime_name!r} must be a table")
        if existing.get("runtime_type") != RUNC_V2:
            editor.set((*entry_path, "runtime_type"), RUNC_V2)
        editor.set((*entry_path, "options", "BinaryName"), opts.runtime_path)
        settings = ctd.systemd_cgroup_settings(runtimes, default, cri_table)
        ref = ctd.systemd_cgroup_reference(settings, default, opts.runtime_name)
        if ref is not None and settings[ref] and editor.set((*entry_path, "options", "SystemdCgroup"), True):
            messages.append(
                f'added SystemdCgroup = true to "{opts.runtime_name}", as "{ref}" has it: '
                "without it pods are killed on systemd-cgroup nodes"
            )
    if opts.set_as_default and version < 3 and cri_table.get("systemd_cgroup") is True:
        # containerd validates this itself: "invalid plugin config: `systemd_cgroup` only works for runtime
        # io.containerd.runtime.v1.linux" — its CRI plugin would not load at all.
        raise ConfigError(
            "the CRI plugin sets systemd_cgroup = true, which containerd accepts only while the default "
            "runtime is on the legacy v1 shim (io.containerd.runtime.v1.linux); with nvidia (runc v2) as the "
            "default, containerd's CRI plugin would refuse to load",
            'move runc to runtime_type = "io.containerd.runc.v2" with [...runtimes.runc.options] '
            "SystemdCgroup = true, remove systemd_cgroup, then run again — or leave out --set-as-default",
        )
    if opts.set_as_default:
        containerd_table = ctd.get_table(cri_table, ("containerd",)) or {}
        legacy = containerd_table.get("default_runtime") if version < 3 else None
        if isinstance(legacy, Mapping) and legacy.get("runtime_type"):
            raise ConfigError(
                "the deprecated [...containerd.default_runtime] table is set, and containerd lets it win "
                "over default_runtime_name",
                "remove that table (move its settings to a named runtime under runtimes), then run again",
            )
        editor.set((*cri, "containerd", "default_runtime_name"), opts.runtime_name)
    if opts.cdi:
        if version == 1:
            raise ConfigError(
                "CDI needs a version 2 (or 3) containerd configuration; this one is version 1",
                "convert the file to version 2 (`containerd config migrate`), or leave out --cdi",
            )
        editor.set((*cri, "enable_cdi"), True)


def _drop_in_changes(
    host: Host,
    *,
    fmt: TomlFormat,
    path: str,
    text: str | None,
    main_doc: MutableMapping[str, Any],
    merged: Mapping[str, Any],
    version: int,
    installed: tuple[int, int] | None,
    opts: ConfigureOptions,
    messages: list[str],
) -> list[FileChange]:
    dropin = opts.drop_in or ""
    if not posixpath.isabs(dropin):
        raise UsageError(
            f"--drop-in needs an absolute path, not {dropin!r}",
            "containerd 1.6 resolves relative imports against its working directory",
        )
    if dropin == path:
        raise UsageError("--drop-in must name a file other than the main configuration")
    drop_text = host.read_text_if_exists(dropin)
    drop_doc = fmt.parse(drop_text, dropin) if drop_text is not None else new_toml_document(DROPIN_HEADER)
    if drop_text is None:
        drop_doc["version"] = version
    drop_editor = Editor(fmt, drop_doc)
    cri = ctd.cri_table_path(version)
    if installed is None or installed < (2, 1):
        # The drop-in's CRI table replaces the merged one wholesale: carry every setting over.
        for key, value in plain(ctd.cri_table(merged, version)).items():
            if lookup(drop_doc, (*cri, key)) is ABSENT:
                drop_editor.set((*cri, key), value)
        messages.append(
            f"{dropin} carries a complete copy of the CRI plugin table (containerd before 2.1 replaces "
            "imported plugin tables)"
        )
    _add_nvidia(drop_editor, merged, version, opts, messages)
    after = fmt.render(drop_doc, drop_text) if drop_editor.edits else drop_text
    # The temp file goes one level up: an import glob such as conf.d/* would read it while it exists.
    changes = [
        FileChange(
            dropin,
            drop_text,
            after,
            tuple(drop_editor.edits),
            owned=drop_text is None,
            temp_dir=posixpath.dirname(posixpath.dirname(dropin)),
        )
    ]

    main_editor = Editor(fmt, main_doc)
    imports = ctd.resolve_imports(host, path, main_doc.get("imports"))
    already = dropin in imports.paths or any(_glob_matches(p, dropin) for p in _import_patterns(main_doc))
    if not already:
        main_editor.append(("imports",), dropin)
    main_after = fmt.render(main_doc, text) if main_editor.edits or text is None else text
    changes.append(FileChange(path, text, main_after, tuple(main_editor.edits)))
    return changes


def _import_patterns(doc: Mapping[str, Any]) -> list[str]:
    imports = doc.get("imports")
    return [p for p in plain(imports) if isinstance(p, str)] if isinstance(imports, list) else []


def _glob_matches(pattern: str, path: str) -> bool:
    return posixpath.isabs(pattern) and fnmatch.fnmatchcase(path, pattern)
