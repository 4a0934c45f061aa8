"""Plan the CRI-O drop-in that adds the nvidia runtime (crio.conf.d/99-nvidia.toml by default)."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from gpunode.errors import ConfigError, UsageError
from gpunode.host import Host
from gpunode.runtimes import crio
from gpunode.runtimes.containerd import parse_toml
from gpunode.runtimes.edits import ABSENT, Editor, TomlFormat, lookup, new_toml_document, plain
from gpunode.runtimes.plan import ConfigureOptions, FileChange, RuntimePlan

DROPIN = f"{crio.DROPIN_DIR}/99-nvidia.toml"
UNIT = "crio.service"
SOCKET = "/var/run/crio/crio.sock"
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

    # The effective configuration today: crio.conf, then every drop-in in the order CRI-O reads them.
    files = [main] if host.is_file(main) else []
    files += [f for f in crio.dropin_files(host) if f != main]
    merged: dict[str, Any] = {}
    for file in files:
        merged = crio.merge_dropin(merged, parse_toml(host.read_text(file), file))
    runtimes = crio.configured_runtimes(merged, main)
    default = crio.default_runtime(merged, runtimes)

    editor = Editor(fmt, doc)
    entry_path = (*crio.RUNTIMES_PATH, opts.runtime_name)
    if lookup(doc, entry_path) is ABSENT:
        # A runtime entry in a later file replaces the whole earlier one: start from what is there.
        base = runtimes.get(opts.runtime_name) or _reference(runtimes, default, opts.runtime_name)
        entry = {k: v for k, v in plain(base).items() if k not in ("runtime_path", "runtime_type")}
        editor.set(entry_path, {"runtime_path": opts.runtime_path, "runtime_type": "oci", **entry})
    else:
        editor.set((*entry_path, "runtime_path"), opts.runtime_path)
    if opts.set_as_default:
        editor.set(("crio", "runtime", "default_runtime"), opts.runtime_name)
    if opts.cdi:
        messages.append("CRI-O always has CDI enabled; --cdi changes nothing for it")
    after = fmt.render(doc, text) if editor.edits else text
    _check_effect(host, main, target, after, opts)
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


def _reference(runtimes: Mapping[str, Mapping[str, Any]], default: str, name: str) -> Mapping[str, Any]:
    for candidate in (default, "crun", "runc"):
        entry = runtimes.get(candidate)
        if candidate != name and entry is not None and entry.get("runtime_type", "oci") == "oci":
            return entry
    return {}


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
