#!/usr/bin/env python3
"""Generate gpunode/plugin/api/deviceplugin_pb2{,_grpc}.py(i) from deviceplugin.proto.

Run with the repository's venv (`.venv/bin/python scripts/generate_deviceplugin_stubs.py`); it refuses any
grpcio-tools other than the pinned one so the committed stubs are reproducible. `--check` generates into a
temp dir and exits 1 if the committed files differ (tests/unit/test_plugin_api.py runs it).
"""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

GRPCIO_TOOLS = "1.85.1"  # keep equal to the pin in pyproject.toml's dev extra
API = Path(__file__).resolve().parent.parent / "gpunode" / "plugin" / "api"
OUTPUTS = ("deviceplugin_pb2.py", "deviceplugin_pb2.pyi", "deviceplugin_pb2_grpc.py")


def generate(out: Path) -> None:
    have = version("grpcio-tools")
    if have != GRPCIO_TOOLS:
        sys.exit(
            f"grpcio-tools {GRPCIO_TOOLS} is required (found {have}): "
            f"pip install grpcio-tools=={GRPCIO_TOOLS}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        # Compile from a directory named like the package so the generated import lines are absolute
        # ("from gpunode.plugin.api import deviceplugin_pb2").
        src = Path(tmp) / "gpunode" / "plugin" / "api"
        src.mkdir(parents=True)
        shutil.copy(API / "deviceplugin.proto", src / "deviceplugin.proto")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{tmp}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                "gpunode/plugin/api/deviceplugin.proto",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            sys.exit(f"protoc failed ({proc.returncode}):\n{proc.stderr}")
        for name in OUTPUTS:
            shutil.copy(src / name, out / name)


def main() -> int:
    if "--check" in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            stale = [
                n
                for n in OUTPUTS
                if not (API / n).exists() or not filecmp.cmp(Path(tmp) / n, API / n, shallow=False)
            ]
        if stale:
            print(
                "stale generated stubs: " + ", ".join(stale) + "; run scripts/generate_deviceplugin_stubs.py",
                file=sys.stderr,
            )
            return 1
        return 0
    generate(API)
    print("generated " + ", ".join(OUTPUTS) + f" in {API}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
