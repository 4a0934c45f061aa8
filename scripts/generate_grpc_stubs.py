#!/usr/bin/env python3
"""Generate the Python gRPC stubs of every kubelet API gpunode speaks, from its committed .proto files.

- gpunode/plugin/api: deviceplugin.proto (the device plugin API v1beta1);
- gpunode/dra/api: pluginregistration.proto, dra_v1.proto, dra_v1beta1.proto, dra_health_v1alpha1.proto
  (the DRA kubelet plugin; shared/specs/dra-kubelet-plugin.md).

For each proto it writes `<name>_pb2.py`, `<name>_pb2.pyi` (what mypy reads) and `<name>_pb2_grpc.py` next to
it. Run with the repository's venv (`.venv/bin/python scripts/generate_grpc_stubs.py`); it refuses any
grpcio-tools other than the pinned one so the committed stubs are reproducible. `--check` generates into a
temp dir and exits 1 if a committed file differs (tests/unit/test_plugin_api.py and test_dra_api.py run it).
Names after the options limit the run to those API directories (`gpunode/dra/api`).
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
REPO = Path(__file__).resolve().parent.parent
# API directory (relative to the repository, named like its package) → the protos in it.
APIS: dict[str, tuple[str, ...]] = {
    "gpunode/plugin/api": ("deviceplugin.proto",),
    "gpunode/dra/api": (
        "pluginregistration.proto",
        "dra_v1.proto",
        "dra_v1beta1.proto",
        "dra_health_v1alpha1.proto",
    ),
}


def outputs(proto: str) -> tuple[str, str, str]:
    stem = proto.removesuffix(".proto")
    return f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"


def generate(api: str, out: Path) -> None:
    """Compile every proto of `api` and copy the generated modules into `out`."""
    have = version("grpcio-tools")
    if have != GRPCIO_TOOLS:
        sys.exit(
            f"grpcio-tools {GRPCIO_TOOLS} is required (found {have}): "
            f"pip install grpcio-tools=={GRPCIO_TOOLS}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        # Compile from a directory named like the package so the generated import lines are absolute
        # ("from gpunode.dra.api import dra_v1_pb2") and each file's descriptor name is unique in the pool.
        src = Path(tmp) / api
        src.mkdir(parents=True)
        for proto in APIS[api]:
            shutil.copy(REPO / api / proto, src / proto)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{tmp}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *(f"{api}/{proto}" for proto in APIS[api]),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            sys.exit(f"protoc failed ({proc.returncode}):\n{proc.stderr}")
        for proto in APIS[api]:
            for name in outputs(proto):
                shutil.copy(src / name, out / name)


def stale(api: str) -> list[str]:
    """The committed generated files of `api` that differ from what the protos give now."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(api, Path(tmp))
        return [
            f"{api}/{name}"
            for proto in APIS[api]
            for name in outputs(proto)
            if not (REPO / api / name).exists()
            or not filecmp.cmp(Path(tmp) / name, REPO / api / name, shallow=False)
        ]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    apis = [a.rstrip("/") for a in argv if a != "--check"] or list(APIS)
    unknown = [a for a in apis if a not in APIS]
    if unknown:
        print(f"unknown API directory {', '.join(unknown)}; known: {', '.join(APIS)}", file=sys.stderr)
        return 2
    if check:
        found = [name for api in apis for name in stale(api)]
        if found:
            print(
                "stale generated stubs: " + ", ".join(found) + "; run scripts/generate_grpc_stubs.py",
                file=sys.stderr,
            )
            return 1
        return 0
    for api in apis:
        generate(api, REPO / api)
        print(f"generated {', '.join(n for p in APIS[api] for n in outputs(p))} in {api}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
