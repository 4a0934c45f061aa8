"""What a CDI spec points at on the host: device nodes, the driver's user-space files, sockets, the hook.

Everything is read through the Host. Two roots shape the paths: the driver root (where the driver's files
are: "/" on a normal node, /run/nvidia/driver under a driver container) and the device root (where its
/dev is; the driver root unless told). A spec's container paths are the paths inside those roots, and its
host paths are the same paths with the root in front, as the runtime on this host sees them.

The driver's libraries are not a fixed list: they are the files named `*.so.<driver version>` that the
dynamic linker's cache (ld.so.cache, under the driver root) knows, plus those next to the NVML library this
process loaded and next to any of them. A list would miss the libraries a newer driver adds, and pick up a
stale copy an older driver left behind.
"""

from __future__ import annotations

import os
import platform
import posixpath
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpunode.errors import GpunodeError, NotFound
from gpunode.host import Host
from gpunode.nvml.capabilities import cap_minor
from gpunode.nvml.model import Gpu, Inventory, MigDevice

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/sbin")
FIRMWARE_DIRS = ("/lib/firmware/nvidia", "/usr/lib/firmware/nvidia")
SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")
MPS_PIPE_DIR = "/tmp/nvidia-mps"  # noqa: S108 (the MPS daemon's fixed pipe directory, only mounted)
LD_CACHE = "/etc/ld.so.cache"
HOOK_PROGRAMS = ("nvidia-cdi-hook", "nvidia-ctk")  # the newer toolkit's own hook program first

# ld.so.cache entry flags: the ELF class and machine of each library (glibc's elf/cache.c). A 64-bit
# x86 or arm node mounts its own machine's libraries, never the 32-bit ones next to them.
_FLAG_ELF_LIBC6 = 0x0003
_NATIVE_FLAGS = {"x86_64": 0x0300 | _FLAG_ELF_LIBC6, "aarch64": 0x0A00 | _FLAG_ELF_LIBC6}
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_MAGIC = b"ld.so-1.7.0"


@dataclass(frozen=True)
class DeviceNode:
    path: str  # in the container
    host_path: str  # on the host (the device root in front)
    major: int
    minor: int

    def to_spec(self) -> dict[str, object]:
        node: dict[str, object] = {"path": self.path}
        if self.host_path != self.path:
            node["hostPath"] = self.host_path
        node.update({"type": "c", "major": self.major, "minor": self.minor})
        return node


@dataclass(frozen=True)
class Roots:
    driver_root: str = "/"
    dev_root: str = "/"

    def driver(self, path: str) -> str:
        return _under(self.driver_root, path)

    def dev(self, path: str) -> str:
        return _under(self.dev_root, path)


def _under(root: str, path: str) -> str:
    return path if root == "/" else posixpath.join(root, path.lstrip("/"))


@dataclass(frozen=True)
class HostFacts:
    roots: Roots
    gpu_nodes: dict[int, DeviceNode]  # by GPU index
    mig_nodes: dict[str, tuple[DeviceNode, ...]]  # MIG UUID -> its capability nodes
    control: tuple[DeviceNode, ...]
    libraries: tuple[str, ...]  # container paths
    binaries: tuple[str, ...]
    firmware: tuple[str, ...]
    sockets: tuple[str, ...]
    mps_dir: str | None
    hook: tuple[str, tuple[str, ...]] | None  # (program, argv) of the ldcache update
    warnings: tuple[str, ...] = field(default=())

    @property
    def library_dirs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(posixpath.dirname(p) for p in self.libraries))


def char_device(host: Host, host_path: str) -> tuple[int, int] | None:
    """(major, minor) of a character device node, or None when it is not one (or not there)."""
    try:
        st = os.stat(host.path(host_path))
    except (OSError, GpunodeError):
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def proc_devices(host: Host) -> dict[str, int]:
    """Character-device majors by driver name, from /proc/devices (nvidia-frontend, nvidia-uvm, ...)."""
    try:
        text = host.read_text_if_exists("/proc/devices") or ""
    except GpunodeError:
        return {}
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.strip().startswith("Character devices"):
            in_char = True
            continue
        if line.strip().startswith("Block devices"):
            break
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


# The drivers whose majors a node must have, by the name /proc/devices gives them. The GPUs' and the control
# nodes' driver is "nvidia-frontend" (older drivers) or "nvidia"; nvidia-uvm and nvidia-caps have their own.
NVIDIA_DRIVER_NAMES = ("nvidia-frontend", "nvidia")
REMAKE_NODE = (
    "make the node again as the driver defines it: remove it and run `nvidia-modprobe` (`-c <minor>` for a "
    "GPU, `-u -c 0` for nvidia-uvm, `-f /proc/driver/nvidia/capabilities/...` for nvidia-caps), or let udev "
    "make it (`udevadm trigger --subsystem-match=nvidia`)"
)
NODE_FIX = REMAKE_NODE + "; then run the command again"


def nvidia_major(majors: dict[str, int]) -> int | None:
    return next((majors[n] for n in NVIDIA_DRIVER_NAMES if n in majors), None)


def expected_node(path: str, majors: dict[str, int]) -> tuple[str, int | None, int] | None:
    """(driver, major, minor) the NVIDIA node at container path `path` must have: its name says which
    (/dev/nvidia<N> is the GPU of minor N, nvidiactl is 255, nvidia-uvm 0 of nvidia-uvm's major, ...).
    The major is None when /proc/devices does not list the driver; None for a path that is no NVIDIA node."""
    name = posixpath.basename(path)
    directory = posixpath.dirname(path)
    if directory == "/dev":
        fixed = {"nvidiactl": ("nvidia", 255), "nvidia-modeset": ("nvidia", 254),
                 "nvidia-uvm": ("nvidia-uvm", 0), "nvidia-uvm-tools": ("nvidia-uvm", 1)}  # fmt: skip
        if name in fixed:
            driver, minor = fixed[name]
            major = nvidia_major(majors) if driver == "nvidia" else majors.get(driver)
            return driver, major, minor
        if name.startswith("nvidia") and name[6:].isdigit():
            return "nvidia", nvidia_major(majors), int(name[6:])
    if directory == "/dev/nvidia-caps" and name.startswith("nvidia-cap") and name[10:].isdigit():
        return "nvidia-caps", majors.get("nvidia-caps"), int(name[10:])
    return None


def node_problem(
    host: Host, path: str, host_path: str, majors: dict[str, int], *, what: str | None = None
) -> str | None:
    """Why the node at `host_path` (container path `path`) is not the NVIDIA device its name says, or None:
    a link (to another node: /dev/nvidia0 -> nvidia1 would give a pod GPU 1), not a character device, or
    another major or minor than the driver's. A node that does not exist is no problem here."""
    try:
        st = os.lstat(host.path(host_path, follow_last=False))
    except (OSError, GpunodeError, ValueError):
        return None
    label = f"{what} {host_path}" if what else host_path
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(host.path(host_path, follow_last=False))
        except OSError:
            target = "?"
        return f"{label} is a symbolic link to {target}; a device node must be the node itself"
    if not stat.S_ISCHR(st.st_mode):
        return f"{label} is not a character device"
    expected = expected_node(path, majors)
    if expected is None:
        return None
    driver, major, minor = expected
    have = (os.major(st.st_rdev), os.minor(st.st_rdev))
    if have[1] != minor or (major is not None and have[0] != major):
        want = f"{major if major is not None else '<major of ' + driver + '>'}:{minor}"
        return (
            f"{label} is the device {have[0]}:{have[1]}; it must be {want} ({driver}'s major in "
            f"/proc/devices, minor {minor})"
        )
    return None


def read_host_facts(
    host: Host,
    inventory: Inventory,
    roots: Roots,
    *,
    hook_program: str | None = None,
    loaded_nvml: Sequence[str] = (),
) -> HostFacts:
    warnings: list[str] = []
    gpu_nodes: dict[int, DeviceNode] = {}
    mig_nodes: dict[str, tuple[DeviceNode, ...]] = {}
    # The kernel's table of majors: the same /proc whatever the driver and device roots (the capability
    # files below are read from it too).
    majors = proc_devices(host)
    caps_major = majors.get("nvidia-caps") if any(g.mig_devices for g in inventory.gpus) else None
    if nvidia_major(majors) is None and any(g.usable for g in inventory.gpus):
        warnings.append(
            "/proc/devices lists no nvidia driver: the device nodes' majors are not checked (their minors "
            "are)"
        )
    for gpu in inventory.gpus:
        if not gpu.usable or gpu.minor is None:
            warnings.append(f"GPU {gpu.index} is left out: {gpu.error or 'lost from the bus'}")
            continue
        gpu_nodes[gpu.index] = _gpu_node(host, roots, gpu, majors)
        for mig in gpu.mig_devices:
            mig_nodes[mig.uuid] = _mig_nodes(
                host, roots, gpu, mig, majors=majors, caps_major=caps_major, warnings=warnings
            )
    control = []
    for path in CONTROL_NODES:
        _refuse_wrong_node(host, path, roots.dev(path), majors)
        numbers = char_device(host, roots.dev(path))
        if numbers is not None:
            control.append(DeviceNode(path, roots.dev(path), *numbers))
    version = inventory.driver_version
    if not version:
        raise NotFound(
            "NVML did not report the driver version, which names the driver's libraries",
            "check `nvidia-smi`; the driver may be half installed",
        )
    libraries = find_libraries(host, roots, version, loaded_nvml)
    if not libraries:
        raise NotFound(
            f"no library of driver {version} (lib*.so.{version}) was found in "
            f"{roots.driver(LD_CACHE)} or next to libnvidia-ml",
            "run `ldconfig` (the linker cache may be stale), or point --driver-root at where the driver is "
            "installed",
        )
    hook = _hook(host, hook_program, libraries)
    if hook is None:
        warnings.append(
            "neither nvidia-cdi-hook nor nvidia-ctk was found: containers' linker caches will not list the "
            "driver's libraries (install nvidia-container-toolkit, or give --hook-program)"
        )
    return HostFacts(
        roots=roots,
        gpu_nodes=gpu_nodes,
        mig_nodes=mig_nodes,
        control=tuple(control),
        libraries=libraries,
        binaries=_binaries(host, roots),
        firmware=_firmware(host, roots, version),
        sockets=tuple(p for p in SOCKETS if host.is_socket(roots.driver(p))),
        mps_dir=MPS_PIPE_DIR if host.is_dir(roots.driver(MPS_PIPE_DIR)) else None,
        hook=hook,
        warnings=tuple(warnings),
    )


def _refuse_wrong_node(
    host: Host, path: str, host_path: str, majors: dict[str, int], *, what: str | None = None
) -> None:
    """A node that is not the device its name says would give a pod another device than it was allocated
    (or none it can use): refused, never written into the spec."""
    problem = node_problem(host, path, host_path, majors, what=what)
    if problem is not None:
        raise NotFound(problem, NODE_FIX)


def _gpu_node(host: Host, roots: Roots, gpu: Gpu, majors: dict[str, int]) -> DeviceNode:
    path = f"/dev/nvidia{gpu.minor}"
    # Its minor must be NVML's minor number of this GPU: the node's name is made from it.
    _refuse_wrong_node(host, path, roots.dev(path), majors, what=f"GPU {gpu.index}'s device node")
    numbers = char_device(host, roots.dev(path))
    if numbers is None:
        raise NotFound(
            f"GPU {gpu.index}'s device node {roots.dev(path)} does not exist (or is not a character device)",
            f"create it with `nvidia-modprobe -c {gpu.minor}` (or load the driver so udev does), or point "
            "--dev-root at the /dev the driver uses",
        )
    return DeviceNode(path, roots.dev(path), *numbers)


def _mig_nodes(
    host: Host,
    roots: Roots,
    gpu: Gpu,
    mig: MigDevice,
    *,
    majors: dict[str, int],
    caps_major: int | None,
    warnings: list[str],
) -> tuple[DeviceNode, ...]:
    """The capability nodes that give access to one MIG instance: its GPU instance's and its compute
    instance's, whose minors the driver publishes under /proc/driver/nvidia/capabilities."""
    if mig.gpu_instance_id is None or mig.compute_instance_id is None:
        warnings.append(f"MIG device {mig.uuid}: NVML did not give its instance IDs; no capability nodes")
        return ()
    base = f"/proc/driver/nvidia/capabilities/gpu{gpu.minor}/mig/gi{mig.gpu_instance_id}"
    nodes: list[DeviceNode] = []
    for access in (f"{base}/access", f"{base}/ci{mig.compute_instance_id}/access"):
        minor = cap_minor(host, access)
        if minor is None:
            warnings.append(f"MIG device {mig.uuid}: {access} is missing; its capability node is left out")
            continue
        path = f"/dev/nvidia-caps/nvidia-cap{minor}"
        _refuse_wrong_node(
            host, path, roots.dev(path), majors, what=f"MIG device {mig.uuid}'s capability node"
        )
        numbers = char_device(host, roots.dev(path))
        if numbers is None:
            if caps_major is None:
                warnings.append(f"MIG device {mig.uuid}: {path} does not exist and nvidia-caps has no major")
                continue
            numbers = (caps_major, minor)  # nvidia-modprobe makes these on demand; the runtime makes it
        nodes.append(DeviceNode(path, roots.dev(path), *numbers))
    return tuple(nodes)


def read_ld_cache(data: bytes) -> list[tuple[int, str, str]]:
    """(flags, name, path) of every entry of a glibc ld.so.cache (the 1.1 format, alone or after the old
    one). An unknown or damaged file gives []: the libraries are then found next to NVML only."""
    start = data.find(_NEW_MAGIC)
    if start < 0 or (start and not data.startswith(_OLD_MAGIC)):
        return []
    header = struct.Struct("<II")
    if len(data) < start + 48:
        return []
    nlibs, _strings = header.unpack_from(data, start + len(_NEW_MAGIC))
    entry = struct.Struct("<iIIIQ")
    entries: list[tuple[int, str, str]] = []
    offset = start + 48
    for _ in range(nlibs):
        if offset + entry.size > len(data):
            break
        flags, key, value, _osversion, _hwcap = entry.unpack_from(data, offset)
        offset += entry.size
        name, path = _cstring(data, start + key), _cstring(data, start + value)
        if name and path:
            entries.append((flags, name, path))
    return entries


def _cstring(data: bytes, at: int) -> str:
    end = data.find(b"\0", at)
    if at >= len(data) or end < 0:
        return ""
    return data[at:end].decode("utf-8", "replace")


def find_libraries(
    host: Host, roots: Roots, version: str, loaded_nvml: Sequence[str] = ()
) -> tuple[str, ...]:
    """Container paths of the driver's libraries of `version` (see the module's docstring)."""
    suffix = f".so.{version}"
    native = _NATIVE_FLAGS.get(platform.machine())
    found: list[str] = []
    try:
        cache = host.read_bytes(roots.driver(LD_CACHE)) or b""
    except GpunodeError:
        cache = b""
    for flags, name, path in read_ld_cache(cache):
        if native is not None and flags != native:
            continue
        # The cache is keyed by soname (libcuda.so.1), a link to the versioned file the driver installed.
        real = name if name.endswith(suffix) else posixpath.basename(_container_path(host, roots, path))
        if real.endswith(suffix):
            found.append(path)
    directories = [posixpath.dirname(p) for p in found]
    directories += [posixpath.dirname(p) for p in loaded_nvml]
    for directory in dict.fromkeys(directories):
        try:
            names = host.listdir(roots.driver(directory))
        except GpunodeError:
            continue
        found.extend(f"{directory}/{n}" for n in names if n.endswith(suffix))
    libraries: set[str] = set()
    for path in found:
        if not host.is_file(roots.driver(path)):
            continue  # a cache entry for a file that is gone: ldconfig was not run since
        # The file itself, by its one name: a soname link is made in the container by the ldcache hook,
        # and a file reached by two names (/lib is a link to /usr/lib) is mounted once.
        libraries.add(_container_path(host, roots, path))
    return tuple(sorted(p for p in libraries if posixpath.basename(p).endswith(suffix)))


def _container_path(host: Host, roots: Roots, path: str) -> str:
    """`path` (inside the driver root) with every link resolved, still as a path inside the root."""
    try:
        real = host.canonical(roots.driver(path))
    except (GpunodeError, OSError, ValueError):
        return path
    if roots.driver_root == "/":
        return real
    root = roots.driver_root.rstrip("/")
    return real[len(root) :] if real.startswith(root + "/") else path


def loaded_nvml_paths(host: Host) -> tuple[str, ...]:
    """Where the libnvidia-ml this process loaded lives (from /proc/self/maps): the driver's own
    directory, even when the linker cache is stale. Only meaningful on the real root."""
    if not host.is_real_root:
        return ()
    try:
        maps = host.read_text_if_exists("/proc/self/maps") or ""
    except GpunodeError:
        return ()
    paths = {line.split()[-1] for line in maps.splitlines() if "libnvidia-ml.so" in line}
    return tuple(sorted(p for p in paths if p.startswith("/")))


def _binaries(host: Host, roots: Roots) -> tuple[str, ...]:
    found: list[str] = []
    for program in BINARIES:
        for directory in BINARY_DIRS:
            path = f"{directory}/{program}"
            if host.is_file(roots.driver(path)):
                found.append(path)
                break
    return tuple(found)


def _firmware(host: Host, roots: Roots, version: str) -> tuple[str, ...]:
    files: dict[str, str] = {}
    for base in FIRMWARE_DIRS:
        directory = f"{base}/{version}"
        try:
            names = host.listdir(roots.driver(directory))
        except GpunodeError:
            continue
        for name in names:
            path = f"{directory}/{name}"
            if name.endswith(".bin") and host.is_file(roots.driver(path)):
                files.setdefault(host.canonical(roots.driver(path)), path)
    return tuple(sorted(files.values()))


def _hook(host: Host, program: str | None, libraries: Iterable[str]) -> tuple[str, tuple[str, ...]] | None:
    """The createContainer hook that runs ldconfig in the container over the mounted library folders
    (nvidia-cdi-hook update-ldcache, or `nvidia-ctk hook update-ldcache` of older toolkits)."""
    path = program or next((p for p in (host.which(n) for n in HOOK_PROGRAMS) if p), None)
    if path is None:
        return None
    folders: list[str] = []
    for directory in dict.fromkeys(posixpath.dirname(p) for p in libraries):
        folders += ["--folder", directory]
    name = posixpath.basename(path)
    if name == "nvidia-ctk":
        return path, (name, "hook", "update-ldcache", *folders)
    return path, (name, "update-ldcache", *folders)


# -- a simulated node (`cdi generate --simulate`) -----------------------------------------------------------
# What a real node of the simulated node's shape has, as the driver makes it: none of it is on this host,
# so nothing is looked for. The majors of nvidia-uvm and nvidia-caps are given by the kernel at load time;
# these are typical values, and the generated spec's header says the file is a simulation's.
SIMULATED_MAJORS = {"nvidia": 195, "nvidia-uvm": 510, "nvidia-caps": 511}
SIMULATED_LIBRARIES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-gpucomp.so",
    "libnvidia-ml.so",
    "libnvidia-nvvm.so",
    "libnvidia-opencl.so",
    "libnvidia-ptxjitcompiler.so",
)
SIMULATED_FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
SIMULATED_HOOK = "/usr/bin/nvidia-cdi-hook"  # where nvidia-container-toolkit's packages install it
_MULTIARCH = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
# nvidia-caps minors (/proc/driver/nvidia-caps/mig-minors): config 1, monitor 2, then per GPU 15 GPU
# instances of 9 minors each (the instance's access, then its 8 compute instances').
_CAPS_FIRST, _CAPS_PER_GI, _CAPS_GIS = 3, 9, 15


def simulated_host_facts(inventory: Inventory, roots: Roots, *, hook_program: str | None = None) -> HostFacts:
    """The device nodes and driver files a real node with `inventory`'s GPUs and driver has (Debian /
    Ubuntu paths for this machine's architecture), unchecked: a simulated node's are not on this host."""
    version = inventory.driver_version
    if not version:
        raise NotFound(
            "the simulated node reports no driver version, which names the driver's libraries",
            "pick a simulated node with a driver (dgx-a100, pcie-4, pairs-4, mig, h100)",
        )
    nvidia, uvm, caps = (SIMULATED_MAJORS[n] for n in ("nvidia", "nvidia-uvm", "nvidia-caps"))

    def node(path: str, major: int, minor: int) -> DeviceNode:
        return DeviceNode(path, roots.dev(path), major, minor)

    warnings: list[str] = []
    gpu_nodes: dict[int, DeviceNode] = {}
    mig_nodes: dict[str, tuple[DeviceNode, ...]] = {}
    for gpu in inventory.gpus:
        if not gpu.usable or gpu.minor is None:
            warnings.append(f"GPU {gpu.index} is left out: {gpu.error or 'lost from the bus'}")
            continue
        gpu_nodes[gpu.index] = node(f"/dev/nvidia{gpu.minor}", nvidia, gpu.minor)
        for mig in gpu.mig_devices:
            if mig.gpu_instance_id is None or mig.compute_instance_id is None:
                warnings.append(f"MIG device {mig.uuid}: no instance IDs; no capability nodes")
                continue
            gi = _CAPS_FIRST + (gpu.minor * _CAPS_GIS + mig.gpu_instance_id) * _CAPS_PER_GI
            ci = gi + 1 + mig.compute_instance_id
            mig_nodes[mig.uuid] = tuple(node(f"/dev/nvidia-caps/nvidia-cap{m}", caps, m) for m in (gi, ci))
    control = (
        node("/dev/nvidiactl", nvidia, 255),
        node("/dev/nvidia-uvm", uvm, 0),
        node("/dev/nvidia-uvm-tools", uvm, 1),
        node("/dev/nvidia-modeset", nvidia, 254),
    )
    libdir = f"/usr/lib/{_MULTIARCH.get(platform.machine(), 'x86_64-linux-gnu')}"
    libraries = tuple(f"{libdir}/{name}.{version}" for name in SIMULATED_LIBRARIES)
    program = hook_program or SIMULATED_HOOK
    folders = ("--folder", libdir)
    name = posixpath.basename(program)
    hook_args = (
        (name, "hook", "update-ldcache", *folders)
        if name == "nvidia-ctk"
        else (name, "update-ldcache", *folders)
    )
    return HostFacts(
        roots=roots,
        gpu_nodes=gpu_nodes,
        mig_nodes=mig_nodes,
        control=control,
        libraries=libraries,
        binaries=tuple(f"/usr/bin/{b}" for b in BINARIES),
        firmware=tuple(f"{FIRMWARE_DIRS[0]}/{version}/{f}" for f in SIMULATED_FIRMWARE),
        sockets=(SOCKETS[0],),  # nvidia-persistenced's: persistence mode is on on the simulated GPUs
        mps_dir=None,
        hook=(program, hook_args),
        warnings=tuple(warnings),
    )
