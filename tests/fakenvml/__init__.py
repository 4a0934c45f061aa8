"""Build and use the fake ``libnvidia-ml.so.1`` (see ``fakenvml.c`` and ``README.md``).

Subprocess (most robust)::

    from tests import fakenvml
    subprocess.run(cmd, env={**os.environ, **fakenvml.env("pcie-4", control=ctl)})

In-process (one process can switch machines between tests)::

    fakenvml.load_into_process("mig")
    pynvml.nvmlInit()      # finds the preloaded library by its soname
    ...
    pynvml.nvmlShutdown()  # then load_into_process("h100") + nvmlInit again

Runtime faults::

    fakenvml.inject(ctl, "xid 3 79")
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "LIBNAME",
    "PROFILES",
    "SOURCE",
    "build",
    "env",
    "inject",
    "last_error",
    "load_into_process",
]

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fakenvml.c"
LIBNAME = "libnvidia-ml.so.1"
DEFAULT_BUILD_ROOT = HERE / ".build"

#: Built-in machines, as named by FAKE_NVML_PROFILE (the default is "dgx-a100").
PROFILES = (
    "dgx-a100",
    "pcie-4",
    "pairs-4",
    "mig",
    "h100",
    "no-gpu",
    "no-driver",
    "init-fail",
    "lost-gpu",
    "old-driver",
)

_CFLAGS = ("-O2", "-Wall", "-Wextra", "-shared", "-fPIC", f"-Wl,-soname,{LIBNAME}")
_LIBS = ("-lpthread",)
_ENV_KEYS = ("FAKE_NVML_PROFILE", "FAKE_NVML_CONFIG", "FAKE_NVML_CONTROL")

_loaded: dict[str, ctypes.CDLL] = {}  # the one preloaded library, by path


def build(out_dir: Path | None = None) -> Path:
    """Compile the fake library (once per source version) and return the directory holding it.

    The result lives in ``<out_dir>/<hash of source and flags>/libnvidia-ml.so.1`` (default
    ``out_dir``: ``tests/fakenvml/.build``), so an edited source rebuilds and concurrent builds
    (pytest-xdist, parallel benchmarks) each write a private temp file and atomically rename it.
    """
    root = Path(out_dir) if out_dir is not None else DEFAULT_BUILD_ROOT
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source)
    digest.update("\0".join(_CFLAGS + _LIBS).encode())
    target_dir = root / digest.hexdigest()[:16]
    target = target_dir / LIBNAME
    if target.is_file():
        return target_dir

    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found on PATH: it is needed to build the fake libnvidia-ml.so.1")
    target_dir.mkdir(parents=True, exist_ok=True)
    # Compile the exact bytes that were hashed, even if the file changes meanwhile.
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".tmp-") as tmp:
        src = Path(tmp) / "fakenvml.c"
        src.write_bytes(source)
        out = Path(tmp) / LIBNAME
        proc = subprocess.run(
            [gcc, *_CFLAGS, "-o", str(out), str(src), *_LIBS],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"building the fake libnvidia-ml.so.1 failed (gcc exit {proc.returncode}):\n{proc.stderr}"
            )
        os.replace(out, target)
    return target_dir


def _settings(profile: str | None, config: Path | None, control: Path | None) -> dict[str, str]:
    # Every key is always present: an empty value means "unset" to the library, which
    # stops a FAKE_NVML_CONFIG inherited from the parent from overriding `profile`.
    return {
        "FAKE_NVML_PROFILE": profile or "",
        "FAKE_NVML_CONFIG": str(config) if config is not None else "",
        "FAKE_NVML_CONTROL": str(control) if control is not None else "",
    }


def env(
    profile: str | None = None, config: Path | None = None, control: Path | None = None
) -> dict[str, str]:
    """Environment variables to add for a subprocess that should see the fake GPUs.

    Use as ``{**os.environ, **env(...)}``.  ``config`` wins over ``profile``; with neither the
    library simulates ``dgx-a100``.
    """
    libdir = str(build())
    current = os.environ.get("LD_LIBRARY_PATH", "")
    return {
        "LD_LIBRARY_PATH": f"{libdir}:{current}" if current else libdir,
        **_settings(profile, config, control),
    }


def load_into_process(
    profile: str | None = None, config: Path | None = None, control: Path | None = None
) -> ctypes.CDLL:
    """Point this process at the fake library and select the machine for the next ``nvmlInit``.

    Sets the FAKE_NVML_* variables in ``os.environ`` and preloads the library by absolute path,
    so pynvml's later ``CDLL("libnvidia-ml.so.1")`` resolves to it by soname.  The library reads
    its configuration at ``nvmlInit``; call this again between ``nvmlShutdown`` and ``nvmlInit``
    to switch machines.  Returns the loaded library (for ``last_error``).
    """
    for key, value in _settings(profile, config, control).items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    if not _loaded:
        path = str(build() / LIBNAME)
        _loaded[path] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return next(iter(_loaded.values()))


def last_error() -> str:
    """Why the last ``nvmlInit`` in this process rejected its config ("" if it did not)."""
    if not _loaded:
        return ""
    fn = next(iter(_loaded.values())).fakeNvmlGetLastError
    fn.restype = ctypes.c_char_p
    value = fn()
    return value.decode() if isinstance(value, bytes) else ""


def inject(control: Path, line: str) -> None:
    """Append one control line (e.g. ``"xid 0 79"``, ``"lost 2"``) for the library to apply."""
    if "\n" in line.rstrip("\n"):
        raise ValueError(f"one control line at a time, got {line!r}")
    with open(control, "a", encoding="utf-8") as fh:
        fh.write(line.rstrip("\n") + "\n")
        fh.flush()
