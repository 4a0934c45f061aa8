"""Plan the changes to Docker's daemon.json that add the nvidia runtime (merged into the user's file)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpunode.errors import ConfigError, UsageError
from gpunode.host import Host
from gpunode.runtimes import docker
from gpunode.runtimes.edits import Editor, JsonFormat
from gpunode.runtimes.plan import ConfigureOptions, FileChange, RuntimePlan

UNIT = "docker.service"
SOCKET = "/var/run/docker.sock"


def plan_docker(host: Host, opts: ConfigureOptions) -> RuntimePlan:
    if opts.drop_in is not None:
        raise UsageError("dockerd has no drop-in directory: --drop-in is for containerd and CRI-O")
    if opts.runtime_name == docker.BUILTIN_DEFAULT_RUNTIME:
        raise UsageError(
            'the runtime cannot be called "runc": dockerd reserves that name', "choose another --runtime-name"
        )
    path = opts.config or docker.DAEMON_JSON
    fmt = JsonFormat()
    text = host.read_text_if_exists(path)
    doc = fmt.parse(text or "", path)
    _refuse_what_dockerd_refuses(text, doc, path, opts)

    editor = Editor(fmt, doc)
    messages: list[str] = []
    entry = docker.configured_runtimes(doc, path).get(opts.runtime_name)
    if entry is None:
        editor.set(("runtimes", opts.runtime_name), {"path": opts.runtime_path, "args": []})
    else:
        editor.set(("runtimes", opts.runtime_name, "path"), opts.runtime_path)
    if opts.set_as_default:
        editor.set(("default-runtime",), opts.runtime_name)
    if opts.cdi:
        # Merged into `features`: replacing that object would drop the user's other feature flags.
        editor.set(("features", "cdi"), True)
        messages.append("CDI in dockerd needs Docker 25 or later; older releases ignore features.cdi")
    if text is not None and not text.strip():
        messages.append(f"{path} was empty, which dockerd refuses; gpunode writes a valid file")
    after = fmt.render(doc, text) if editor.edits or (text is not None and not text.strip()) else text
    change = FileChange(path, text, after, tuple(editor.edits))
    return RuntimePlan(
        runtime="docker",
        changes=(change,),
        messages=tuple(messages),
        unit=UNIT,
        socket=SOCKET,
        standard_location=opts.config in (None, docker.DAEMON_JSON),
        expect=(opts.runtime_name, opts.set_as_default),
    )


def _refuse_what_dockerd_refuses(
    text: str | None, doc: Mapping[str, Any], path: str, opts: ConfigureOptions
) -> None:
    """A file dockerd would not start with is the user's to fix: gpunode does not guess what was meant.

    Two problems gpunode repairs itself: an empty file, and a default runtime that is the one being added.
    """
    problems = docker.startup_problems(text or "{}", doc, path)
    default = docker.default_runtime(doc, path)
    problems = [p for p in problems if not (default == opts.runtime_name and f'"{default}"' in p)]
    docker.cdi_enabled(doc, path)  # raises on a `features` that is not an object
    if problems:
        raise ConfigError(
            "; ".join(problems),
            f"correct {path} first (gpunode left it untouched), then run the command again",
        )
