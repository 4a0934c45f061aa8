"""The NVIDIA runtime on k3s and RKE2: their embedded containerd and the layout each release reads.

k3s (and RKE2, which runs k3s's agent code) renders containerd's config.toml at every start, from its
built-in "base" template or from a template the user puts next to it. A copy of the rendered file used as a
template freezes k3s's own settings (CNI paths, pause image, registry settings...), so later k3s upgrades
and flag changes stop reaching containerd: gpunode never writes one. What it writes instead, by what the
node's k3s supports (k3s-io/k3s pkg/agent/containerd/config.go, pkg/agent/templates; docs.k3s.io
"Advanced options / Configuring containerd"):

- **drop-in** — k3s releases that import `<dir>/config-v3.toml.d/*.toml` (or `config.toml.d/*.toml` for a
  version 2 config) from the config they generate (k3s PR #13680, 2026): a drop-in there with only the
  runtime. Seen in the generated config itself, whatever the version number says.
- **base template** — k3s v1.24.17, v1.25.13, v1.26.8, v1.27.5, v1.28.1 and later (k3s PR #7991): a
  template that is `{{ template "base" . }}` plus the runtime, so k3s renders its own configuration first.
  `config-v3.toml.tmpl` when k3s generates version 3 (containerd 2.x, k3s v1.31.6 / v1.32.2 and later),
  else `config.toml.tmpl`: k3s picks the base template (v3 or v2) by the file name.

k3s also adds an `nvidia` runtime by itself when it finds nvidia-container-runtime (on its PATH in current
releases; /usr/local/nvidia/toolkit or /usr/bin in older ones). gpunode reads the generated config first
and leaves that runtime alone; the template's runtime is rendered only while k3s has not added one of the
same name, since TOML refuses a table defined twice and containerd would not start.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.errors import ConfigError, NotFound
from gpunode.host import Host
from gpunode.runtimes import containerd as ctd
from gpunode.runtimes import probe, records
from gpunode.runtimes.containerd_units import SOCKETS, unit_for
from gpunode.runtimes.edits import Edit, Editor, TomlFormat, new_toml_document
from gpunode.runtimes.plan import ConfigureOptions, FileChange, RuntimePlan

RUNC_V2 = ctd.RUNC_V2
DROPIN_NAME = "99-gpunode-nvidia.toml"  # sorts after other drop-ins: containerd merges them in name order
VERSION_TIMEOUT = 10.0
# The first release of each Kubernetes minor with `{{ template "base" . }}` (docs.k3s.io, "Base template"
# version gate: the September 2023 releases). Minors after 1.28 all have it.
BASE_TEMPLATE_SINCE = {24: 17, 25: 13, 26: 8, 27: 5, 28: 1}
# The containerd k3s / RKE2 embed (not the host's `containerd`): imported plugin tables merge from 2.1 on.
EMBEDDED_CONTAINERD = {
    "k3s": "/var/lib/rancher/k3s/data/current/bin/containerd",
    "rke2": "/var/lib/rancher/rke2/bin/containerd",
}
# The first line of every file gpunode writes here: how it knows its own file from the user's.
MARKER = "# Written by `gpunode configure-runtime containerd`"
TEMPLATE_HEADER = (
    f"{MARKER}: the NVIDIA runtime for {{flavour}}.\n"
    "# {flavour} renders this template into config.toml at every start. Its own configuration comes first,\n"
    "# from its built-in base template, so {flavour} upgrades and flag changes still reach containerd; then\n"
    "# the runtime, unless {flavour} found the runtime binary itself and added one of that name already.\n"
    "# `gpunode configure-runtime containerd --revert` removes this file.\n"
)
DROPIN_HEADER = (
    "Written by `gpunode configure-runtime containerd`: the NVIDIA runtime for {flavour}.\n"
    "{flavour} generates config.toml at every start and imports this directory from it; containerd merges\n"
    "this file into it. `gpunode configure-runtime containerd --revert` removes this file."
)


@dataclass(frozen=True)
class Layout:
    """What the node's k3s / RKE2 reads, as seen from its generated config and its version."""

    flavour: str  # "k3s" or "rke2"
    directory: str  # where config.toml and its templates live
    generated: str  # the config.toml k3s rendered last
    text: str  # its text
    doc: dict[str, Any]  # its content
    version: int  # its containerd config version (2 or 3)
    release: tuple[int, int, int] | None  # `k3s --version` / `rke2 --version`, None when unknown
    dropin_dir: str | None  # the directory the generated config imports, where k3s has one
    embedded: tuple[int, int] | None  # the embedded containerd's version, None when unknown

    @property
    def template(self) -> str:
        # k3s reads config-v3.toml.tmpl with the v3 base template, config.toml.tmpl with the v2 one.
        name = "config-v3.toml.tmpl" if self.version == 3 else "config.toml.tmpl"
        return posixpath.join(self.directory, name)

    @property
    def has_base_template(self) -> bool:
        if self.release is None:
            # Version 3 configs came with containerd 2.0 (k3s v1.31.6, v1.32.2), long after the base template.
            return self.version == 3
        return has_base_template(self.release)


def parse_release(output: str) -> tuple[int, int, int] | None:
    """(1, 33, 1) from `k3s version v1.33.1+k3s1 (99d91538)` or `rke2 version v1.33.1+rke2r1 (...)`."""
    # ASCII digits, at most 9 each: \d takes every script's digits, and int() raises past 4,300 of them.
    found = re.search(r"\bv?([0-9]{1,9})\.([0-9]{1,9})\.([0-9]{1,9})(?![0-9])", output)
    return (int(found.group(1)), int(found.group(2)), int(found.group(3))) if found else None


def has_base_template(release: tuple[int, int, int]) -> bool:
    major, minor, patch = release
    if (major, minor) > (1, 28):
        return True
    return major == 1 and minor in BASE_TEMPLATE_SINCE and patch >= BASE_TEMPLATE_SINCE[minor]


def installed_release(host: Host, flavour: str) -> tuple[int, int, int] | None:
    """`k3s --version` / `rke2 --version`; under --root no program runs (gpunode.runtimes.probe)."""
    result, _ = probe.run(host, flavour, ["--version"], timeout=VERSION_TIMEOUT)
    return parse_release(result.stdout) if result is not None and result.ok else None


def embedded_containerd(host: Host, flavour: str) -> tuple[int, int] | None:
    """The embedded containerd's version, run from its path in the root (under --root nothing runs)."""
    result, _ = probe.run(host, EMBEDDED_CONTAINERD[flavour], ["--version"], timeout=VERSION_TIMEOUT)
    return ctd.parse_containerd_version(result.stdout) if result is not None and result.ok else None


def imported_dropin_dir(doc: Mapping[str, Any], directory: str) -> str | None:
    """The drop-in directory k3s's base template imports (`<dir>/config-v3.toml.d/*.toml` or
    `<dir>/config.toml.d/*.toml`), when the generated config has that import."""
    imports = doc.get("imports")
    if not isinstance(imports, list):
        return None
    for entry in imports:
        if not isinstance(entry, str):
            continue
        folder, pattern = posixpath.split(posixpath.normpath(entry))
        if (
            pattern == "*.toml"
            and posixpath.dirname(folder) == posixpath.normpath(directory)
            and posixpath.basename(folder) in ("config-v3.toml.d", "config.toml.d")
        ):
            return folder
    return None


def detect_layout(host: Host, location: ctd.ConfigLocation) -> Layout:
    text = host.read_text_if_exists(location.config_path)
    if text is None:
        raise NotFound(
            f"{location.flavour} has not generated {location.config_path} yet",
            f"start {location.flavour} once so that it writes its containerd configuration (gpunode reads "
            "it to know what this release supports), then run this command again",
        )
    doc = ctd.parse_toml(text, location.config_path)
    version = ctd.detect_version(doc, None, path=location.config_path)
    directory = posixpath.dirname(location.config_path)
    return Layout(
        flavour=location.flavour,
        directory=directory,
        generated=location.config_path,
        text=text,
        doc=doc,
        version=version,
        release=installed_release(host, location.flavour),
        dropin_dir=imported_dropin_dir(doc, directory),
        embedded=embedded_containerd(host, location.flavour),
    )


def is_gpunodes(text: str | None) -> bool:
    return text is not None and text.startswith(MARKER)


# -- the plan -----------------------------------------------------------------------------------------


def plan_k3s(host: Host, location: ctd.ConfigLocation, opts: ConfigureOptions) -> RuntimePlan | None:
    """The plan for k3s / RKE2, or None when the user's own plain-TOML template is in charge (it is edited
    as any containerd file is)."""
    layout = detect_layout(host, location)
    messages: list[str] = []
    user_template = next(
        (t for t in location.template_candidates if host.is_file(t) and not is_gpunodes(host.read_text(t))),
        None,
    )
    if user_template is not None:
        _refuse_frozen_copy(host, user_template, layout)
    use_dropin = layout.dropin_dir is not None and not _replaces_plugin_tables(layout, messages)
    if user_template is not None and not use_dropin:
        user_text = host.read_text(user_template)
        if not ctd.has_go_template_syntax(user_text):
            return None
        raise ConfigError(
            f"{user_template} is a Go template ({{{{ ... }}}}) of your own, which gpunode cannot edit safely "
            f"as TOML, and this {layout.flavour} imports no drop-in directory gpunode could use instead",
            "add the runtime to the template by hand (`gpunode configure-runtime containerd --dry-run "
            "--config /tmp/config.toml` shows the TOML to add), or upgrade "
            f"{layout.flavour} to a release whose generated config.toml imports config-v3.toml.d",
        )
    if user_template is not None:
        messages.append(f"{user_template} is yours and stays as it is; the runtime goes in a drop-in")

    runtimes = ctd.configured_runtimes(layout.doc, layout.version, layout.generated)
    own = runtimes.get(opts.runtime_name)
    own_binary = ctd.runtime_binary(own, layout.doc, layout.version) if own is not None else None
    reference = _reference_options(runtimes, layout, opts.runtime_name)

    if use_dropin:
        assert layout.dropin_dir is not None  # noqa: S101 (use_dropin says so)
        path = posixpath.join(layout.dropin_dir, DROPIN_NAME)
        wanted = _dropin_content(
            layout,
            opts,
            path=path,
            current=host.read_text_if_exists(path),
            own=own,
            own_binary=own_binary,
            reference=reference,
            messages=messages,
        )
        change = _owned_change(host, path, wanted, layout, dropin=True)
    else:
        if is_gpunodes(host.read_text_if_exists(layout.template)):
            # The generated config has the runtime because k3s rendered it from gpunode's template: what
            # gpunode wants is the same template again, not "k3s found it itself".
            own = own_binary = None
        entry = _template_entry(
            layout, opts, own=own, own_binary=own_binary, reference=reference, messages=messages
        )
        if entry is not None and not layout.has_base_template:
            raise ConfigError(
                f"{layout.flavour} {_release_text(layout)} has no base template, and editing a copy of "
                f"{layout.generated} would freeze {layout.flavour}'s own settings against later upgrades",
                f"upgrade {layout.flavour} to v1.28.1 or later (or v1.24.17, v1.25.13, v1.26.8, v1.27.5 "
                "on older lines), then run this command again",
            )
        change = _owned_change(host, layout.template, entry, layout, dropin=False)
        if entry is not None:
            messages.append(f"{layout.flavour} renders config.toml from {layout.template} when it restarts")
    return RuntimePlan(
        runtime="containerd",
        changes=(change,)
        if change is not None
        else (FileChange(layout.generated, layout.text, layout.text),),
        messages=tuple(messages),
        unit=unit_for(host, layout.flavour),
        socket=SOCKETS[layout.flavour],
        flavour=layout.flavour,
        standard_location=True,
        expect=(opts.runtime_name, opts.set_as_default),
    )


def _release_text(layout: Layout) -> str:
    return "v" + ".".join(map(str, layout.release)) if layout.release else "(version unknown)"


def _refuse_frozen_copy(host: Host, template: str, layout: Layout) -> None:
    """Earlier gpunode releases created the template as a copy of config.toml: editing that copy again
    would keep k3s's settings frozen. Its record says gpunode created it; --revert removes it."""
    record = records.load(host).files.get(host.canonical(template))
    if record is not None and record.original_sha256 is None:
        raise ConfigError(
            f"{template} is a copy of {layout.generated} that an earlier gpunode release made: it freezes "
            f"{layout.flavour}'s own settings, so that upgrades and flag changes no longer reach containerd",
            "run `gpunode configure-runtime containerd --revert` (it removes that copy), then this command "
            f"again: gpunode now writes the layout this {layout.flavour} release reads",
        )


def _replaces_plugin_tables(layout: Layout, messages: list[str]) -> bool:
    """True when the embedded containerd is older than 2.1, which replaces a whole plugin table from an
    imported file (the CRI settings k3s wrote would be lost): the template is used then."""
    if layout.embedded is None or layout.embedded >= (2, 1):
        return False
    messages.append(
        f"{layout.flavour}'s containerd {layout.embedded[0]}.{layout.embedded[1]} replaces imported plugin "
        "tables instead of merging them: gpunode uses the base template, not the drop-in directory"
    )
    return True


def _reference_options(
    runtimes: Mapping[str, Mapping[str, Any]], layout: Layout, name: str
) -> dict[str, Any]:
    """The options of the runtime pods get today (runc, as k3s writes it): SystemdCgroup above all."""
    default = ctd.default_runtime_name(layout.doc, layout.version)
    for candidate in (default, "runc", "crun"):
        entry = runtimes.get(candidate)
        if candidate != name and entry is not None and entry.get("runtime_type", RUNC_V2) == RUNC_V2:
            return ctd.runtime_options(entry)
    return {}


def _new_entry(opts: ConfigureOptions, reference: Mapping[str, Any]) -> dict[str, Any]:
    options = dict(reference)
    options["BinaryName"] = opts.runtime_path
    return {"runtime_type": RUNC_V2, "options": options}


def _dropin_content(
    layout: Layout,
    opts: ConfigureOptions,
    *,
    path: str,
    current: str | None,
    own: Mapping[str, Any] | None,
    own_binary: str | None,
    reference: Mapping[str, Any],
    messages: list[str],
) -> tuple[str, tuple[Edit, ...]] | None:
    """The drop-in's text and edits; None when nothing is to be added (k3s's own configuration, or
    gpunode's drop-in from an earlier run, already has everything asked).

    An earlier drop-in of gpunode's is added to, as a main file would be: a run without --set-as-default
    does not take back the default an earlier run set (--revert does).
    """
    fmt = TomlFormat()
    if is_gpunodes(current):
        assert current is not None  # noqa: S101 (is_gpunodes says so)
        doc = fmt.parse(current, path)
    else:
        doc = new_toml_document(DROPIN_HEADER.format(flavour=layout.flavour))
        doc["version"] = layout.version  # containerd 2.x skips a drop-in newer than the main file
    editor = Editor(fmt, doc)
    cri = ctd.cri_table_path(layout.version)
    entry_path = (*cri, "containerd", "runtimes", opts.runtime_name)
    if own is not None and own_binary == opts.runtime_path:
        messages.append(
            f'{layout.flavour} already adds the "{opts.runtime_name}" runtime itself ({own_binary}): '
            "gpunode leaves it as it is"
        )
        if (
            reference.get("SystemdCgroup") is True
            and ctd.runtime_options(own).get("SystemdCgroup") is not True
        ):
            editor.set((*entry_path, "options", "SystemdCgroup"), True)
            messages.append(
                f'added SystemdCgroup = true to "{opts.runtime_name}", as runc has it: without it pods are '
                "killed on systemd-cgroup nodes"
            )
    else:
        if own is not None:
            messages.append(
                f'{layout.flavour} adds a "{opts.runtime_name}" runtime for {own_binary}; the drop-in, '
                f"merged after it, makes it run {opts.runtime_path}"
            )
        editor.set(entry_path, _new_entry(opts, reference))
        if reference:
            messages.append(f'the "{opts.runtime_name}" runtime copies the options of runc')
    if opts.set_as_default and ctd.default_runtime_name(layout.doc, layout.version) != opts.runtime_name:
        editor.set((*cri, "containerd", "default_runtime_name"), opts.runtime_name)
    if opts.cdi and ctd.cdi_enabled(layout.doc, layout.version) is not True:
        editor.set((*cri, "enable_cdi"), True)
    if not editor.edits:
        return None
    return fmt.render(doc, current), tuple(editor.edits)


def _template_entry(
    layout: Layout,
    opts: ConfigureOptions,
    *,
    own: Mapping[str, Any] | None,
    own_binary: str | None,
    reference: Mapping[str, Any],
    messages: list[str],
) -> tuple[str, tuple[Edit, ...]] | None:
    """The template's text and edits; None when k3s's own configuration already has everything asked.

    The template can only add tables k3s's base template does not write: TOML refuses a table defined
    twice (docs issue k3s-io/docs#566), and the base writes the CRI table and its `containerd` table. So a
    default runtime or CDI switch cannot go here.
    """
    flavour = layout.flavour
    if opts.set_as_default and ctd.default_runtime_name(layout.doc, layout.version) != opts.runtime_name:
        config_yaml = f"/etc/rancher/{flavour}/config.yaml"
        raise ConfigError(
            f"{flavour} {_release_text(layout)} has no containerd drop-in directory, and its base template "
            "already writes the table that holds the default runtime (a template cannot set it twice)",
            f"set it the way {flavour} keeps it: `default-runtime: {opts.runtime_name}` in {config_yaml} "
            f"(the --default-runtime flag), then run this command again without --set-as-default and "
            f"restart {flavour}",
        )
    if opts.cdi and ctd.cdi_enabled(layout.doc, layout.version) is not True:
        if layout.version == 3 and ctd.cdi_enabled(layout.doc, layout.version) is None:
            messages.append("containerd 2.x enables CDI by default: nothing to set for --cdi")
        else:
            raise ConfigError(
                f"{flavour} {_release_text(layout)} writes the CRI table itself, so a template cannot switch "
                "CDI on (a table cannot be defined twice)",
                f"upgrade {flavour} to a release with containerd 2.x (CDI is on by default there), or leave "
                "out --cdi",
            )
    if own is not None and own_binary == opts.runtime_path:
        if (
            reference.get("SystemdCgroup") is True
            and ctd.runtime_options(own).get("SystemdCgroup") is not True
        ):
            # "Already configured" would be a success the node does not have: pods on this runtime get
            # the cgroupfs driver on a systemd-cgroup node, and kubelet kills them. A template cannot
            # repair k3s's own table (it would define it twice), so gpunode says how instead.
            raise ConfigError(
                f'{flavour} {_release_text(layout)} adds the "{opts.runtime_name}" runtime itself without '
                "SystemdCgroup = true while runc has it: on this systemd-cgroup node its pods would be "
                "killed, and a template cannot add the option to a table k3s writes",
                f"upgrade {flavour} to a release whose nvidia runtime copies runc's SystemdCgroup (or to one "
                "that imports config-v3.toml.d, where gpunode adds the option), or let gpunode write its own "
                f"runtime in a template under another name: `gpunode configure-runtime containerd "
                f"--runtime-name {opts.runtime_name}-systemd` (then use that name as the RuntimeClass "
                "handler)",
            )
        messages.append(
            f'{flavour} already adds the "{opts.runtime_name}" runtime itself ({own_binary}): nothing to add'
        )
        return None
    if own is not None:
        raise ConfigError(
            f'{flavour} already adds a "{opts.runtime_name}" runtime for {own_binary}, and a template cannot '
            "define that runtime a second time",
            f"use that binary (--runtime-path {own_binary}), or another name (--runtime-name "
            f"{opts.runtime_name}-2)",
        )
    fmt = TomlFormat()
    doc = new_toml_document()
    editor = Editor(fmt, doc)
    runtimes_path = (*ctd.cri_table_path(layout.version), "containerd", "runtimes")
    editor.set((*runtimes_path, opts.runtime_name), _new_entry(opts, reference))
    if reference:
        messages.append(f'the "{opts.runtime_name}" runtime copies the options of runc')
    tables = fmt.render(doc, None)
    if "{{" in tables or "}}" in tables:
        # k3s would execute it as a template action: a path or option must not become template code.
        raise ConfigError(
            f"the runtime's settings contain {{{{ or }}}} ({opts.runtime_path}), which k3s would read as "
            "template code",
            "give a --runtime-path without braces",
        )
    return render_template(flavour, opts.runtime_name, tables), tuple(editor.edits)


def render_template(flavour: str, name: str, tables: str) -> str:
    """The template: k3s's base, then the runtime's tables while k3s has not added a runtime of that name.

    Every Go template action sits in a TOML comment, so the file is valid TOML as it is (gpunode reads back
    what it writes) and renders, with k3s's text/template, to the base output followed by the tables.
    `{{ "\\n" }}` ends the comment line before the base output; ExtraRuntimes is k3s's map of the runtimes
    it found itself (its zero value has an empty BinaryName).
    """
    return (
        TEMPLATE_HEADER.format(flavour=flavour)
        + f'# {flavour}\'s own configuration:{{{{ "\\n" }}}}{{{{ template "base" . }}}}\n'
        + f'# the NVIDIA runtime, unless {flavour} added "{name}" itself:'
        + f'{{{{ if not (index .ExtraRuntimes "{name}").BinaryName }}}}\n'
        + tables.strip("\n")
        + "\n# end of the NVIDIA runtime{{ end }}\n"
    )


def _owned_change(
    host: Host,
    path: str,
    wanted: tuple[str, tuple[Edit, ...]] | None,
    layout: Layout,
    *,
    dropin: bool,
) -> FileChange | None:
    """The change to a file that exists only for gpunode (created, or rewritten when gpunode's own)."""
    current = host.read_text_if_exists(path)
    if current is not None and not is_gpunodes(current):
        raise ConfigError(
            f"{path} exists and was not written by gpunode",
            "move it away (or merge the runtime into it by hand), then run this command again",
        )
    if wanted is None:
        if current is None:
            return None
        return FileChange(path, current, current)  # already gpunode's, and nothing more is needed
    text, edits = wanted
    return FileChange(
        path,
        current,
        text,
        edits,
        owned=True,
        # A drop-in's temp file is made outside the imported directory: the glob would read it meanwhile.
        temp_dir=layout.directory if dropin else None,
    )
