"""`configure-runtime RUNTIME --remove`: take the nvidia runtime out of a configuration gpunode did not write.

`--revert` undoes what gpunode recorded; nodes configured by nvidia-ctk, by hand or by an older tool have no
record. `--remove` finds every file the runtime reads that defines the runtime (docker's daemon.json;
containerd's main file and its imports; crio.conf and every CRI-O drop-in), deletes the runtime's entry, and
where it was the default puts the default back: runc for docker (dockerd's built-in default) and containerd
(crun where only crun is defined), and CRI-O's own built-in default (the key is removed). The change goes
through the same apply as any other — backup, record, atomic writes, restart — so `--revert` undoes it.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from gpunode.errors import ConfigError, NotFound
from gpunode.host import Host
from gpunode.runtimes import containerd as ctd
from gpunode.runtimes.edits import Editor, Format, JsonFormat, TomlFormat, lookup
from gpunode.runtimes.plan import ConfigureOptions, FileChange, RuntimePlan


def plan_remove(host: Host, runtime: str, opts: ConfigureOptions) -> RuntimePlan:
    name = opts.runtime_name
    planner = {"docker": _docker, "containerd": _containerd, "crio": _crio}[runtime]
    changes, messages, plan = planner(host, opts)
    if not any(c.changed for c in changes):
        raise NotFound(
            f"no {runtime} configuration gpunode can see defines a runtime named {name!r}: nothing to remove",
            "name the runtime with --runtime-name, or the file with --config",
        )
    return RuntimePlan(
        runtime=runtime,
        changes=tuple(changes),
        messages=tuple(messages),
        unit=plan.unit,
        socket=plan.socket,
        flavour=plan.flavour,
        standard_location=plan.standard_location,
        expect=None,  # the runtime only has to come back
    )


def _edit(
    host: Host,
    fmt: Format,
    path: str,
    edit: Callable[[Editor, MutableMapping[str, Any]], None],
    messages: list[str],
) -> FileChange | None:
    text = host.read_text_if_exists(path)
    if text is None:
        return None
    doc = fmt.parse(text, path)
    editor = Editor(fmt, doc)
    edit(editor, doc)
    if not editor.edits:
        return None
    after = fmt.render(doc, text)
    messages.extend(f"{path}: removed {e.describe()}" for e in editor.edits if e.op == "delete")
    messages.extend(f"{path}: {e.describe()} set back to {e.after!r}" for e in editor.edits if e.op == "set")
    return FileChange(path, text, after, tuple(editor.edits))


def _docker(host: Host, opts: ConfigureOptions) -> tuple[list[FileChange], list[str], RuntimePlan]:
    from gpunode.runtimes import docker, docker_editor

    path = opts.config or docker.DAEMON_JSON
    name = opts.runtime_name
    messages: list[str] = []

    def edit(editor: Editor, doc: MutableMapping[str, Any]) -> None:
        editor.delete(("runtimes", name))
        if lookup(doc, ("runtimes",)) == {}:
            editor.delete(("runtimes",))
        if lookup(doc, ("default-runtime",)) == name:
            editor.delete(("default-runtime",))  # dockerd's built-in default is runc

    change = _edit(host, JsonFormat(), path, edit, messages)
    plan = RuntimePlan(
        runtime="docker",
        changes=(),
        unit=docker_editor.UNIT,
        socket=docker_editor.SOCKET,
        standard_location=docker.is_daemon_json(host, opts.config),
    )
    return [change] if change else [], messages, plan


def _containerd(host: Host, opts: ConfigureOptions) -> tuple[list[FileChange], list[str], RuntimePlan]:
    from gpunode.runtimes.containerd_units import SOCKETS, unit_for

    installed = ctd.installed_containerd_version(host)
    location = ctd.detect_location(host)
    main = opts.config or (location.template_path or location.config_path)
    loaded = ctd.load_config(host, main, installed)
    cri = ctd.cri_table_path(loaded.version)
    runtimes = ctd.configured_runtimes(loaded.merged, loaded.version)
    fallback = "runc" if "runc" in runtimes or "crun" not in runtimes else "crun"
    name = opts.runtime_name
    default = ctd.default_runtime_name(loaded.merged, loaded.version)
    if name in runtimes and default == name and fallback == name:
        # The default goes back to runc (else crun); taking out that very runtime would leave a default
        # that names nothing, and containerd's CRI plugin does not load then.
        raise ConfigError(
            f"{name!r} is containerd's default runtime ({main} and what it imports): removing it would "
            "leave a default that names no runtime, and containerd's CRI plugin would not load",
            f"make another runtime the default first (e.g. `gpunode configure-runtime containerd "
            f"--set-as-default` for nvidia, or set default_runtime_name by hand), then remove {name!r}",
        )
    messages: list[str] = []

    def edit(editor: Editor, doc: MutableMapping[str, Any]) -> None:
        editor.delete((*cri, "containerd", "runtimes", name))
        if lookup(doc, (*cri, "containerd", "default_runtime_name")) == name:
            editor.set((*cri, "containerd", "default_runtime_name"), fallback)

    changes = [c for c in (_edit(host, TomlFormat(), f, edit, messages) for f in loaded.files) if c]
    _refuse_generated(host, location, changes)
    flavour = location.flavour if opts.config is None else "containerd"
    plan = RuntimePlan(
        runtime="containerd",
        changes=(),
        unit=unit_for(host, flavour),
        socket=SOCKETS[flavour],
        flavour=flavour,
        standard_location=opts.config is None,
    )
    return changes, messages, plan


def _refuse_generated(host: Host, location: ctd.ConfigLocation, changes: list[FileChange]) -> None:
    """k3s / RKE2 / microk8s write their config.toml again from a template at every start: a removal made
    there is undone at the next start, so reporting it as done would be a false success."""
    if not location.regenerated:
        return
    generated = host.canonical(location.config_path)
    if not any(host.canonical(c.path) == generated for c in changes):
        return
    flavour = location.flavour
    templates = " or ".join(location.template_candidates)
    fix = (
        "if gpunode added it, `gpunode configure-runtime containerd --revert` takes it out; if it comes "
        f"from a template of yours ({templates}), delete it there (or remove the template); {flavour} itself "
        "adds an nvidia runtime whenever it finds nvidia-container-runtime, so uninstall that to lose it "
        f"for good; then restart {flavour}"
    )
    raise ConfigError(
        f"{location.config_path} is generated by {flavour}, which writes it again from its template at every "
        "start: a runtime removed from it comes back at the next start, so gpunode does not edit it",
        fix,
    )


def _crio(host: Host, opts: ConfigureOptions) -> tuple[list[FileChange], list[str], RuntimePlan]:
    from gpunode.runtimes import crio, crio_editor

    name = opts.runtime_name
    messages: list[str] = []

    def edit(editor: Editor, doc: MutableMapping[str, Any]) -> None:
        editor.delete(("crio", "runtime", "runtimes", name))
        if lookup(doc, ("crio", "runtime", "default_runtime")) == name:
            editor.delete(("crio", "runtime", "default_runtime"))  # CRI-O's built-in default applies

    files = [opts.config or crio.CRIO_CONF, *crio.dropin_files(host)]
    changes = [c for c in (_edit(host, TomlFormat(), f, edit, messages) for f in files) if c]
    plan = RuntimePlan(
        runtime="crio",
        changes=(),
        unit=crio_editor.UNIT,
        socket=crio_editor.SOCKET,
        standard_location=opts.config is None,
    )
    return changes, messages, plan
