"""`gpunode cdi check` and doctor's `cdi` checks: is gpunode's spec there, true to the node now, applicable
by the runtimes, and alone? Each problem is a Finding with the fix.

"True to the node now" is decided by regenerating the spec from NVML and the host as they are and
comparing: the device names (GPUs and MIG devices, by index and UUID), the driver version the libraries
carry, each device node's major/minor, and the library paths. A stale spec is the common cause of pods
failing with "unresolvable CDI devices" (a MIG change) or of CUDA failing in the container (a driver
upgrade: the spec mounts libraries that are gone).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gpunode.cdi import spec as cdispec
from gpunode.cdi.generate import Generated, GenerateOptions, generate, spec_driver_version
from gpunode.cdi.hostfacts import REMAKE_NODE, char_device, node_problem, proc_devices
from gpunode.cdi.registry import list_devices, read_specs
from gpunode.doctor.context import RUNTIMES, program_version
from gpunode.doctor.model import Finding, Status
from gpunode.doctor.runtime import read_runtime_state
from gpunode.errors import GpunodeError, NvmlError
from gpunode.host import Host
from gpunode.nvml.model import Inventory

TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
REGENERATE = (
    "run `gpunode cdi generate` (and `gpunode cdi install` so it is regenerated when the node changes)"
)


def check_cdi(
    host: Host,
    inventory: Callable[[], Inventory | NvmlError],
    options: GenerateOptions,
    *,
    runtimes: bool = True,
) -> Iterator[Finding]:
    """Every CDI finding, in reading order."""
    path = options.path
    text = _read(host, path)
    if text is None:
        yield Finding(
            "cdi.spec",
            Status.FAIL,
            f"gpunode's CDI spec {path} does not exist",
            "Pods given CDI device names (the plugin's cdi-cri / cdi-annotations strategies) fail with "
            '"unresolvable CDI devices".',
            REGENERATE,
        )
        written: dict[str, Any] | None = None
    else:
        try:
            written = cdispec.parse(text, path)
        except GpunodeError as err:
            yield Finding(
                "cdi.spec", Status.FAIL, f"{path} cannot be read as a CDI spec", err.message, REGENERATE
            )
            written = None
        if written is not None:
            problems = cdispec.structure_problems(written)
            if problems:
                yield Finding(
                    "cdi.spec",
                    Status.FAIL,
                    f"{path} is not a valid CDI spec: runtimes ignore the whole file",
                    "\n".join(problems),
                    REGENERATE,
                )
                written = None
            else:
                yield Finding(
                    "cdi.spec",
                    Status.OK,
                    f"{path}: {written['kind']}, {len(written.get('devices') or [])} devices, "
                    f"cdiVersion {written['cdiVersion']}",
                )
    if written is not None:
        yield from _current(host, inventory, options, written)
        yield from _paths(host, written)
    yield from _conflicts(host, options)
    if runtimes:
        yield from check_runtimes_cdi(host)
    yield check_envvar_exposure(host)


def _read(host: Host, path: str) -> str | None:
    try:
        return host.read_text_if_exists(path)
    except GpunodeError:
        return None


def _current(
    host: Host,
    inventory: Callable[[], Inventory | NvmlError],
    options: GenerateOptions,
    written: dict[str, Any],
) -> Iterator[Finding]:
    found = inventory()
    if isinstance(found, NvmlError):
        yield Finding(
            "cdi.current",
            Status.SKIP,
            "cannot compare the spec with the GPUs: NVML cannot be used",
            found.message,
        )
        return
    try:
        expected = generate(host, found, options)
    except GpunodeError as err:
        yield Finding(
            "cdi.current",
            Status.FAIL,
            "the spec for this node cannot be made now",
            err.message,
            err.fix or REGENERATE,
        )
        return
    yield from compare(written, expected)


def compare(written: dict[str, Any], expected: Generated) -> Iterator[Finding]:
    """What differs between the spec on disk and the one the node would get now."""
    problems: list[str] = []
    if written.get("kind") != expected.spec["kind"]:
        problems.append(f"kind is {written.get('kind')}, the node's is {expected.spec['kind']}")
    was = spec_driver_version(written)
    now = expected.driver_version
    if was is not None and was != now:
        problems.append(f"made for driver {was}; the driver now is {now}")
    have = {d.get("name"): d for d in written.get("devices") or [] if isinstance(d, dict)}
    want = {d["name"]: d for d in expected.spec["devices"]}
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    if missing:
        problems.append(f"devices the node has but the spec lacks: {', '.join(missing)}")
    if extra:
        problems.append(f"devices in the spec the node no longer has: {', '.join(str(n) for n in extra)}")
    for name in want.keys() & have.keys():
        nodes_now = _node_numbers(want[name])
        nodes_was = _node_numbers(have[name])
        if nodes_now != nodes_was:
            problems.append(
                f"device {name}: device nodes {_show(nodes_was)} in the spec, {_show(nodes_now)} now"
            )
    mounts_was = _mounts(written)
    mounts_now = _mounts(expected.spec)
    if was == now and mounts_was != mounts_now:
        gone = sorted(mounts_was - mounts_now)
        new = sorted(mounts_now - mounts_was)
        problems.append(
            "the driver's files differ: "
            + "; ".join(x for x in (f"no longer there: {', '.join(gone)}" if gone else "",
                                    f"new: {', '.join(new)}" if new else "") if x)
        )  # fmt: skip
    if problems:
        yield Finding(
            "cdi.current",
            Status.FAIL,
            "the CDI spec is stale: it does not match the node as NVML and the driver's files show it now",
            "\n".join(problems),
            REGENERATE,
        )
    else:
        yield Finding(
            "cdi.current",
            Status.OK,
            f"the CDI spec matches the node: driver {now}, {expected.gpus} GPUs, "
            f"{expected.mig_devices} MIG devices",
        )


def _node_numbers(device: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    nodes = (device.get("containerEdits") or {}).get("deviceNodes") or []
    return sorted((str(n.get("path")), n.get("major"), n.get("minor")) for n in nodes if isinstance(n, dict))


def _show(nodes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{p} {major}:{minor}" for p, major, minor in nodes) or "none"


def _mounts(spec: dict[str, Any]) -> set[str]:
    mounts = (spec.get("containerEdits") or {}).get("mounts") or []
    return {str(m.get("hostPath")) for m in mounts if isinstance(m, dict)}


def _all_edits(spec: dict[str, Any]) -> Iterable[dict[str, Any]]:
    yield spec.get("containerEdits") or {}
    for device in spec.get("devices") or []:
        if isinstance(device, dict):
            yield device.get("containerEdits") or {}


def _paths(host: Host, written: dict[str, Any]) -> Iterator[Finding]:
    """The spec's device nodes exist with their recorded numbers and are the devices their names say (no
    link to another node, the driver's major and minor); its mounts' sources and its hook exist."""
    bad_nodes: list[str] = []
    wrong = False
    seen: set[str] = set()
    majors = proc_devices(host)
    for edits in _all_edits(written):
        for node in edits.get("deviceNodes") or []:
            path = str(node.get("hostPath") or node.get("path"))
            if path in seen:
                continue
            seen.add(path)
            problem = node_problem(host, str(node.get("path")), path, majors)
            numbers = char_device(host, path)
            if problem is not None:
                wrong = True
                bad_nodes.append(problem)
            elif numbers is None:
                bad_nodes.append(f"{path} does not exist")
            elif "major" in node and numbers != (node.get("major"), node.get("minor")):
                recorded = f"{node.get('major')}:{node.get('minor')}"
                bad_nodes.append(f"{path} is {numbers[0]}:{numbers[1]}, the spec says {recorded}")
    if bad_nodes:
        yield Finding(
            "cdi.nodes",
            Status.FAIL,
            "device nodes of the CDI spec are missing, have other numbers or are not the devices they name",
            "\n".join(bad_nodes),
            (REMAKE_NODE if wrong else "load the driver (`nvidia-modprobe`, udev makes the nodes)")
            + ", then "
            + REGENERATE,
        )
    else:
        yield Finding("cdi.nodes", Status.OK, f"all {len(seen)} device nodes of the spec exist as recorded")
    missing: list[str] = []
    mounts = 0
    for edits in _all_edits(written):
        for mount in edits.get("mounts") or []:
            mounts += 1
            if not host.exists(str(mount.get("hostPath"))):
                missing.append(str(mount.get("hostPath")))
        for hook in edits.get("hooks") or []:
            hook_path = str(hook.get("path"))
            local = None
            with contextlib.suppress(GpunodeError, ValueError):
                local = host.path(hook_path)
            if local is None or not local.is_file() or not os.access(local, os.X_OK):
                missing.append(f"{hook_path} (the {hook.get('hookName')} hook)")
    if missing:
        yield Finding(
            "cdi.paths",
            Status.FAIL,
            f"{len(missing)} file{'s' if len(missing) != 1 else ''} the CDI spec mounts or runs do not exist",
            "\n".join(missing[:20]) + (f"\n... and {len(missing) - 20} more" if len(missing) > 20 else ""),
            "a driver upgrade removes the old version's files: " + REGENERATE,
        )
    else:
        yield Finding("cdi.paths", Status.OK, f"all {mounts} files the spec mounts exist")


def _conflicts(host: Host, options: GenerateOptions) -> Iterator[Finding]:
    files = read_specs(host)

    def canonical(path: str) -> str:
        # A foreign link loop in /etc/cdi is a file the runtimes skip (a warning below), not a failed run.
        try:
            return host.canonical(path)
        except GpunodeError:
            return path

    ours = canonical(options.path)
    broken = [f for f in files if f.problems and canonical(f.path) != ours]
    for f in broken:
        yield Finding(
            "cdi.files",
            Status.WARN,
            f"{f.path} is not a valid CDI spec: runtimes skip it",
            "\n".join(f.problems),
            f"fix or remove {f.path}",
        )
    listed = list_devices(files)
    ours_devices = {d.name for d in listed if canonical(d.path) == ours}
    trouble: list[str] = []
    status = Status.OK
    for device in listed:
        if device.name not in ours_devices or canonical(device.path) == ours:
            if canonical(device.path) == ours and device.state != "ok":
                status = Status.FAIL
                trouble.append(f"{device.name}: gpunode's definition is {device.state} ({device.detail})")
            continue
        if device.state == "shadowed":
            if status is Status.OK:
                status = Status.WARN
            trouble.append(f"{device.name} is also in {device.path}, which gpunode's spec overrides")
    if status is Status.OK:
        yield Finding(
            "cdi.conflicts", Status.OK, "no other spec in /etc/cdi or /var/run/cdi defines gpunode's devices"
        )
        return
    others = sorted({d.path for d in listed if d.name in ours_devices and canonical(d.path) != ours})
    yield Finding(
        "cdi.conflicts",
        status,
        "another CDI spec defines the same devices"
        + (": the runtime drops or ignores gpunode's" if status is Status.FAIL else ""),
        "\n".join(trouble[:20]) + (f"\n... and {len(trouble) - 20} more" if len(trouble) > 20 else ""),
        f"remove {', '.join(others)} (e.g. an old `nvidia-ctk cdi generate` output), or generate "
        "gpunode's spec with another --kind",
    )


def check_runtimes_cdi(host: Host) -> Iterator[Finding]:
    """Each installed runtime applies CDI: containerd 2.x and CRI-O have it on by default, containerd 1.7
    needs enable_cdi, docker features.cdi."""
    for name, binary, _unit in RUNTIMES:
        if host.which(binary) is None:
            continue
        try:
            state = read_runtime_state(host, name)
        except GpunodeError as err:
            yield Finding(
                f"cdi.runtime.{name}", Status.WARN, f"{name}: cannot tell whether CDI is on", err.message
            )
            continue
        fix = f"`gpunode configure-runtime {name} --cdi`"
        if state.cdi_enabled is True:
            yield Finding(f"cdi.runtime.{name}", Status.OK, f"{name}: CDI is enabled ({state.config_path})")
            continue
        if state.cdi_enabled is False:
            yield Finding(
                f"cdi.runtime.{name}",
                Status.FAIL,
                f"{name}: CDI is turned off in {state.config_path}",
                fix=fix,
            )
            continue
        if name == "crio":
            yield Finding(f"cdi.runtime.{name}", Status.OK, "crio: CDI is always on (CRI-O 1.27 and later)")
            continue
        if name == "containerd":
            _, version = program_version(host, "containerd")
            major = int(version.split(".")[0]) if version and version.split(".")[0].isdigit() else None
            if (major is not None and major >= 2) or state.version == 3:
                yield Finding(f"cdi.runtime.{name}", Status.OK, "containerd 2.x: CDI is on by default")
                continue
            yield Finding(
                f"cdi.runtime.{name}",
                Status.FAIL,
                f"containerd {version or '1.x'}: CDI is off (enable_cdi is not set in {state.config_path})",
                "containerd before 2.0 applies CDI devices only with enable_cdi = true in its CRI plugin.",
                fix,
            )
            continue
        yield Finding(
            f"cdi.runtime.{name}",
            Status.WARN,
            f"{name}: CDI is not enabled (features.cdi is not set in {state.config_path})",
            "docker 25 and later apply CDI devices (`--device nvidia.com/gpu=0`) only with features.cdi.",
            fix,
        )


def check_envvar_exposure(host: Host) -> Finding:
    """With CDI, a container gets the devices it was allocated; but nvidia-container-runtime still honours
    NVIDIA_VISIBLE_DEVICES from any container's environment unless told not to, so an unprivileged pod
    that sets NVIDIA_VISIBLE_DEVICES=all gets every GPU, allocated or not."""
    fid = "cdi.envvar"
    fix = f"`gpunode cdi install` sets {ENVVAR_KEY} = false in {TOOLKIT_CONFIG}"
    try:
        text = host.read_text_if_exists(TOOLKIT_CONFIG)
    except GpunodeError as err:
        return Finding(fid, Status.WARN, f"cannot read {TOOLKIT_CONFIG}", err.message, fix)
    if text is None:
        return Finding(
            fid, Status.SKIP, f"{TOOLKIT_CONFIG} does not exist (nvidia-container-toolkit not installed)"
        )
    value = envvar_setting(text)
    if value is False:
        return Finding(
            fid, Status.OK, "unprivileged containers cannot ask for GPUs with NVIDIA_VISIBLE_DEVICES"
        )
    return Finding(
        fid,
        Status.WARN,
        "an unprivileged pod can get every GPU by setting NVIDIA_VISIBLE_DEVICES=all",
        f"{ENVVAR_KEY} is {'not set (default true)' if value is None else 'true'} in {TOOLKIT_CONFIG}; "
        "with CDI or volume-mounts in use nothing needs it.",
        fix,
    )


def envvar_setting(text: str) -> bool | None:
    """The top-level accept-nvidia-visible-devices-envvar-when-unprivileged of the toolkit's config."""
    import tomlkit

    try:
        value = tomlkit.parse(text).unwrap().get(ENVVAR_KEY)
    except Exception:  # tomlkit's parse errors share no base class worth naming; unreadable means unknown
        return None
    return value if isinstance(value, bool) else None
