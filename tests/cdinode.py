"""A driver's files for CDI tests and benchmarks, made under a directory: device nodes (mknod, with chosen
majors and minors), stand-in libraries named as a driver names them, a glibc ld.so.cache that lists them
by soname, firmware, programs.

The device nodes are real character devices (so the spec's major/minor are read from the host the way
they are on a GPU node) but their majors need not belong to a loaded driver: nothing opens them.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterable
from pathlib import Path


def _this_machines_majors() -> dict[str, int]:
    """The NVIDIA majors of this machine's /proc/devices, where its driver is loaded: a test that reads the
    real /proc (gpunode on the real root, a fake driver root) then finds nodes with the majors it expects."""
    majors: dict[str, int] = {}
    try:
        lines = Path("/proc/devices").read_text().split("Block devices")[0].splitlines()
    except OSError:
        return majors
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


_REAL = _this_machines_majors()
NVIDIA_MAJOR = _REAL.get("nvidia-frontend", _REAL.get("nvidia", 195))
UVM_MAJOR = _REAL.get("nvidia-uvm", 235)
CAPS_MAJOR = _REAL.get("nvidia-caps", 236)
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
# (soname, file) pairs of the stand-in driver: what `ldconfig` would list for a 550 driver.
LIBRARIES = (
    ("libcuda.so.1", "libcuda.so.{v}"),
    ("libnvidia-ml.so.1", "libnvidia-ml.so.{v}"),
    ("libnvidia-ptxjitcompiler.so.1", "libnvidia-ptxjitcompiler.so.{v}"),
    ("libnvidia-nvvm.so.4", "libnvidia-nvvm.so.{v}"),
    ("libnvidia-gpucomp.so.{v}", "libnvidia-gpucomp.so.{v}"),
)
FLAGS_X86_64 = 0x0303


def mknod(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def write_ld_cache(
    path: Path,
    entries: Iterable[tuple[str, str]],
    flags: int = FLAGS_X86_64,
    *,
    other: Iterable[tuple[str, str, int]] = (),
) -> None:
    """A glibc ld.so.cache (format 1.1) listing (soname, path) entries, as `ldconfig` writes it; `other`
    adds (soname, path, flags) entries of another machine (0x0003: 32-bit x86)."""
    items = sorted([(n, p, flags) for n, p in entries] + list(other), reverse=True)
    header_size, entry_size = 48, 24
    strings = bytearray()
    offsets: list[tuple[int, int]] = []
    base = header_size + entry_size * len(items)
    for name, target, _ in items:
        key = base + len(strings)
        strings += name.encode() + b"\0"
        value = base + len(strings)
        strings += target.encode() + b"\0"
        offsets.append((key, value))
    data = bytearray(b"glibc-ld.so.cache1.1")
    data += struct.pack("<IIB3xI12x", len(items), len(strings), 2, 0)
    for (key, value), (_, _, entry_flags) in zip(offsets, items, strict=True):
        data += struct.pack("<iIIIQ", entry_flags, key, value, 0, 0)
    data += strings
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(data))


def make_driver(
    root: Path,
    version: str = "550.54.15",
    gpus: Iterable[int] = range(8),
    *,
    control: bool = True,
    hook: bool = True,
    firmware: bool = True,
    mig_caps: Iterable[int] = (),
) -> None:
    """The driver's files under `root` (a node's root or a driver root): /dev nodes for GPU minors `gpus`,
    the libraries and their ld.so.cache, nvidia-smi, firmware and (with `hook`) a stand-in nvidia-ctk.
    `mig_caps`: MIG capability minors, made as /dev/nvidia-caps/nvidia-cap<minor>."""
    for minor in gpus:
        mknod(root / f"dev/nvidia{minor}", NVIDIA_MAJOR, minor)
    if control:
        mknod(root / "dev/nvidiactl", NVIDIA_MAJOR, 255)
        mknod(root / "dev/nvidia-uvm", UVM_MAJOR, 0)
        mknod(root / "dev/nvidia-uvm-tools", UVM_MAJOR, 1)
    for minor in mig_caps:
        mknod(root / f"dev/nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, minor)
    write_proc_devices(root)
    set_driver_version(root, version)
    smi = root / "usr/bin/nvidia-smi"
    smi.parent.mkdir(parents=True, exist_ok=True)
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    if firmware:
        fw = root / f"lib/firmware/nvidia/{version}"
        fw.mkdir(parents=True, exist_ok=True)
        (fw / "gsp_ga10x.bin").write_bytes(b"\0" * 16)
    if hook:
        ctk = root / "usr/bin/nvidia-ctk"
        ctk.write_text("#!/bin/sh\nexit 0\n")
        ctk.chmod(0o755)


def write_proc_devices(root: Path, majors: dict[str, int] | None = None) -> None:
    """The kernel's /proc/devices under `root` as a loaded driver makes it: the majors gpunode checks each
    device node against (`majors` replaces the NVIDIA ones; a value of 0 leaves that driver out)."""
    wanted = {"nvidia-frontend": NVIDIA_MAJOR, "nvidia-uvm": UVM_MAJOR, "nvidia-caps": CAPS_MAJOR}
    wanted.update(majors or {})
    lines = ["Character devices:", "  1 mem", "  4 /dev/vc/0", "  5 /dev/tty"]
    lines += [f"{major:3d} {name}" for name, major in sorted(wanted.items(), key=lambda i: i[1]) if major]
    lines += ["", "Block devices:", "  7 loop", "  8 sd", ""]
    path = root / "proc/devices"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def set_driver_version(root: Path, version: str) -> None:
    """Install the stand-in libraries of `version` (the old version's files removed) and the cache."""
    lib = root / LIB_DIR.lstrip("/")
    lib.mkdir(parents=True, exist_ok=True)
    for old in lib.glob("lib*.so*"):
        old.unlink()
    entries = []
    for soname, file_pattern in LIBRARIES:
        file_name = file_pattern.format(v=version)
        (lib / file_name).write_bytes(b"\x7fELF stand-in " + file_name.encode())
        if soname != file_name:
            (lib / soname).symlink_to(file_name)
        entries.append((soname, f"{LIB_DIR}/{soname}"))
    write_ld_cache(root / "etc/ld.so.cache", entries)


def mig_proc(root: Path, gpu_minor: int, gi: int, ci: int, *, minors: tuple[int, int]) -> None:
    """The driver's /proc/driver/nvidia/capabilities entries of one MIG instance: `minors` are the
    capability minors of its GPU instance and its compute instance."""
    gi_minor, ci_minor = minors
    base = root / f"proc/driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi}"
    (base / f"ci{ci}").mkdir(parents=True, exist_ok=True)
    (base / "access").write_text(f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292\n")
    (base / f"ci{ci}" / "access").write_text(f"DeviceFileMinor: {ci_minor}\nDeviceFileMode: 292\n")


def write_spec(directory: Path, names: Iterable[str], kind: str = "nvidia.com/gpu") -> Path:
    """A minimal valid CDI spec defining `names` (each with one device node), for tests that need a spec
    to exist rather than one true to a driver."""
    devices = [{"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/null"}]}} for n in names]
    path = directory / f"test-{kind.replace('/', '-')}.json"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": kind, "devices": devices}))
    return path
