"""Build gpunode's CDI spec from NVML's inventory and the host's files, and write it (only when it differs).

The spec names each GPU by index ("0") and UUID, each MIG device by "<gpu>:<mig slot>" (the plugin's
index form) and by MIG UUID, and "all". Every device carries its own device nodes; what every GPU
container needs besides (control nodes, the driver's libraries and programs, firmware, sockets, the
ldcache hook, NVIDIA_VISIBLE_DEVICES=void so the legacy hook stands aside) is in the spec's common edits.

The text is a pure function of what was read: no time stamps, stable order. So regenerating an unchanged
node gives the same bytes, and Host.write_file leaves the file (and its mtime) alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpunode import __version__
from gpunode.cdi import ownership
from gpunode.cdi import spec as cdispec
from gpunode.cdi.hostfacts import (
    SIMULATED_MAJORS,
    DeviceNode,
    HostFacts,
    Roots,
    loaded_nvml_paths,
    read_host_facts,
    simulated_host_facts,
)
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.nvml.model import Inventory

DEFAULT_KIND = "nvidia.com/gpu"
STATIC_DIR = "/etc/cdi"
DYNAMIC_DIR = "/var/run/cdi"
SPEC_DIRS = (STATIC_DIR, DYNAMIC_DIR)  # in rising priority: a device in the later one wins
LIBRARY_OPTIONS = ["ro", "nosuid", "nodev", "bind"]
SOCKET_OPTIONS = ["ro", "nosuid", "nodev", "bind", "noexec"]
MPS_OPTIONS = ["rw", "nosuid", "nodev", "bind", "noexec"]


def default_output(kind: str = DEFAULT_KIND) -> str:
    """/var/run/cdi/gpunode-<vendor>-<class>.yaml: one file per kind, named so an operator sees whose."""
    vendor, _, klass = kind.partition("/")
    return f"{DYNAMIC_DIR}/gpunode-{vendor}-{klass}.yaml"


@dataclass(frozen=True)
class GenerateOptions:
    kind: str = DEFAULT_KIND
    driver_root: str = "/"
    dev_root: str | None = None  # None: the driver root
    output: str | None = None  # None: default_output(kind)
    hook_program: str | None = None
    # A built-in simulated node (`--simulate`): its spec is made from the files a real node of its shape
    # has, none checked on this host (hostfacts.simulated_host_facts). Never written.
    simulate: str | None = None

    @property
    def roots(self) -> Roots:
        return Roots(self.driver_root, self.dev_root or self.driver_root)

    @property
    def path(self) -> str:
        return self.output or default_output(self.kind)


@dataclass(frozen=True)
class Generated:
    path: str
    fmt: str
    spec: dict[str, Any]
    text: str
    driver_version: str
    gpus: int
    mig_devices: int
    warnings: tuple[str, ...] = field(default=())

    @property
    def device_names(self) -> list[str]:
        return [d["name"] for d in self.spec["devices"]]

    @property
    def qualified_names(self) -> list[str]:
        return [cdispec.qualified(self.spec["kind"], n) for n in self.device_names]


def _nodes(nodes: Sequence[DeviceNode]) -> list[dict[str, object]]:
    return [n.to_spec() for n in dict.fromkeys(nodes)]


def _mount(roots: Roots, path: str, options: list[str]) -> dict[str, object]:
    return {"hostPath": roots.driver(path), "containerPath": path, "options": list(options)}


def build_spec(inventory: Inventory, facts: HostFacts, kind: str) -> dict[str, Any]:
    """The spec as a document (pure: everything it needs was read before)."""
    devices: list[dict[str, Any]] = []
    everything: list[DeviceNode] = []
    for gpu in inventory.gpus:
        node = facts.gpu_nodes.get(gpu.index)
        if node is None:
            continue
        names = [str(gpu.index), *([gpu.uuid] if gpu.uuid else [])]
        devices.extend({"name": name, "containerEdits": {"deviceNodes": _nodes([node])}} for name in names)
        everything.append(node)
        for mig in gpu.mig_devices:
            mig_nodes = [node, *facts.mig_nodes.get(mig.uuid, ())]
            names = [f"{gpu.index}:{mig.index}", *([mig.uuid] if mig.uuid else [])]
            devices.extend(
                {"name": name, "containerEdits": {"deviceNodes": _nodes(mig_nodes)}} for name in names
            )
            everything.extend(mig_nodes)
    if devices:
        devices.append({"name": "all", "containerEdits": {"deviceNodes": _nodes(everything)}})
    roots = facts.roots
    mounts = [_mount(roots, p, LIBRARY_OPTIONS) for p in (*facts.libraries, *facts.binaries, *facts.firmware)]
    mounts += [_mount(roots, p, SOCKET_OPTIONS) for p in facts.sockets]
    if facts.mps_dir:
        mounts.append(_mount(roots, facts.mps_dir, MPS_OPTIONS))
    common: dict[str, Any] = {
        # The legacy nvidia-container-runtime-hook reads this; "void" makes it inject nothing on top of CDI.
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": _nodes(facts.control),
        "mounts": mounts,
    }
    if facts.hook is not None:
        program, args = facts.hook
        common["hooks"] = [{"hookName": "createContainer", "path": program, "args": list(args)}]
    spec: dict[str, Any] = {"cdiVersion": "", "kind": kind, "devices": devices, "containerEdits": common}
    spec["cdiVersion"] = cdispec.minimum_version(spec)
    return spec


def generate(
    host: Host, inventory: Inventory, options: GenerateOptions, *, loaded_nvml: Sequence[str] | None = None
) -> Generated:
    """Read the host and build the spec text; nothing is written."""
    cdispec.check_kind(options.kind)
    fmt = cdispec.format_of(options.path)
    if options.simulate:
        facts = simulated_host_facts(inventory, options.roots, hook_program=options.hook_program)
    else:
        nvml_paths = loaded_nvml_paths(host) if loaded_nvml is None else tuple(loaded_nvml)
        facts = read_host_facts(
            host, inventory, options.roots, hook_program=options.hook_program, loaded_nvml=nvml_paths
        )
    spec = build_spec(inventory, facts, options.kind)
    gpus = sum(1 for g in inventory.gpus if g.index in facts.gpu_nodes)
    migs = sum(len(g.mig_devices) for g in inventory.gpus if g.index in facts.gpu_nodes)
    version = inventory.driver_version or "unknown"
    counts = f"{gpus} GPU{'s' if gpus != 1 else ''}, {migs} MIG device{'s' if migs != 1 else ''}"
    header = (
        f"Written by gpunode {__version__} (`gpunode cdi generate`) from NVML: driver {version}, {counts}.\n"
        "Regenerate it rather than edit it: `gpunode cdi generate`; `gpunode cdi check` says if it is stale."
    )
    if options.simulate:
        majors = ", ".join(f"{name} {major}" for name, major in SIMULATED_MAJORS.items())
        header = (
            f"Simulated by gpunode {__version__} (`gpunode cdi generate --simulate {options.simulate}`): "
            f"driver {version}, {counts}.\n"
            "The device nodes and driver files are those a real node of this shape has, none checked here:\n"
            f"Debian / Ubuntu paths; device majors {majors} (the last two: given at load time).\n"
            "Not for use on a node: `gpunode cdi generate` there reads its own."
        )
    return Generated(
        path=options.path,
        fmt=fmt,
        spec=spec,
        text=cdispec.render(spec, fmt, header),
        driver_version=version,
        gpus=gpus,
        mig_devices=migs,
        warnings=facts.warnings,
    )


@dataclass(frozen=True)
class SpecWrite:
    changed: bool
    backup: str | None = None  # where the file --force replaced was kept


def check_writable(host: Host, generated: Generated, *, force: bool = False) -> ownership.Current:
    """Refuse to write the spec over a file gpunode did not write (unless `force`), or through a link out of
    the spec directory (always); what is there now otherwise. Run before a dry run's output too."""
    path = generated.path
    ownership.refuse_escaping_link(host, path)
    now = ownership.current(host, path)
    if now.exists and not now.ours and not force and now.data != generated.text.encode():
        default = default_output(generated.spec["kind"])
        raise GpunodeError(
            f"{path} holds a file gpunode did not write (no gpunode header, no record of it in "
            f"{ownership.RECORD}): another tool's CDI spec, such as nvidia-ctk's, is not replaced",
            f"give --output another path (the default, {default}, is gpunode's own), or add --force to "
            f"replace it (the original is copied to {ownership.BACKUP_DIR}{host.canonical(path)}.<sha256> "
            "first)",
        )
    return now


def write_spec_file(host: Host, generated: Generated, *, force: bool = False) -> SpecWrite:
    """Write the spec atomically, only over a spec gpunode wrote (or, with `force`, over any file, kept
    first); unchanged when the file already holds exactly this text (left untouched, mtime too)."""
    now = check_writable(host, generated, force=force)
    data = generated.text.encode()
    if now.data == data:
        return SpecWrite(changed=False)
    # Another tool's file (replaced with force) is kept first; an empty one too: it may mean something.
    foreign = now.data is not None and not now.ours
    backup = (
        ownership.backup_path(host, generated.path, now.data) if foreign and now.data is not None else None
    )
    outcome = host.write_file(
        generated.path,
        generated.text,
        mode=0o644,
        make_parents=True,
        backup_to=backup,
        expect=now.data,
    )
    if generated.fmt == "json" or backup is not None:
        # A YAML spec is known by its header; the record is for what has none (JSON) and for the way back
        # to a file --force replaced. Not written otherwise: a spec written anywhere (a test's temp
        # directory) leaves nothing in /var/lib/gpunode.
        ownership.record(host, generated.path, data, backup)
    return SpecWrite(changed=outcome.changed, backup=backup)


def write_spec(host: Host, generated: Generated, *, force: bool = False) -> bool:
    """write_spec_file's `changed`: False when the file already holds exactly this text."""
    return write_spec_file(host, generated, force=force).changed


def spec_driver_version(spec: dict[str, Any]) -> str | None:
    """The driver version a spec was made for, read from its libraries' names (libcuda.so.<version>):
    JSON has no comments, and annotations would raise the cdiVersion the file needs."""
    for mount in (spec.get("containerEdits") or {}).get("mounts") or []:
        path = str(mount.get("containerPath", "")) if isinstance(mount, dict) else ""
        name = path.rsplit("/", 1)[-1]
        for prefix in ("libcuda.so.", "libnvidia-ml.so."):
            if name.startswith(prefix) and name[len(prefix) :].count(".") >= 1:
                return name[len(prefix) :]
    return None
