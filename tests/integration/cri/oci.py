"""A tiny sandbox ("pause") image built locally: a static C program packed as an OCI image layout tar.

No registry is reachable from the test machines, and the CRI plugin needs its sandbox image to be present
before it runs a pod; `ctr images import` of this archive provides it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any

# Waits for a signal like the real pause: containerd stops a sandbox with SIGTERM (SIGKILL after a grace).
PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

int main(void) {
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    for (;;) pause();
}
"""

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"


def build_pause(workdir: Path) -> Path:
    source = workdir / "pause.c"
    source.write_text(PAUSE_C)
    binary = workdir / "pause"
    result = subprocess.run(
        ["gcc", "-static", "-Os", "-s", "-o", str(binary), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"gcc -static failed:\n{result.stderr}"
    return binary


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add(archive: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    archive.addfile(info, io.BytesIO(data))


def _descriptor(media_type: str, data: bytes, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": _sha256(data), "size": len(data), **extra}


def write_image_archive(binary: Path, reference: str, out: Path, arch: str = "amd64") -> Path:
    """Write an OCI image layout tar holding one image: /pause from binary, named reference."""
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w", format=tarfile.PAX_FORMAT) as layer:
        _add(layer, "pause", binary.read_bytes(), mode=0o755)
    diff = layer_tar.getvalue()
    layer_blob = gzip.compress(diff, mtime=0)
    config = json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": {"Entrypoint": ["/pause"]},
            "rootfs": {"type": "layers", "diff_ids": [_sha256(diff)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": _descriptor(CONFIG_TYPE, config),
            "layers": [_descriptor(LAYER_TYPE, layer_blob)],
        }
    ).encode()
    # io.containerd.image.name carries the full reference, so the import needs no --base-name.
    index = {
        "schemaVersion": 2,
        "manifests": [
            _descriptor(
                MANIFEST_TYPE,
                manifest,
                annotations={
                    "io.containerd.image.name": reference,
                    "org.opencontainers.image.ref.name": reference.rsplit(":", 1)[-1],
                },
                platform={"architecture": arch, "os": "linux"},
            )
        ],
    }
    with tarfile.open(out, mode="w") as archive:
        _add(archive, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        for blob in (layer_blob, config, manifest):
            _add(archive, f"blobs/sha256/{_sha256(blob).removeprefix('sha256:')}", blob)
        _add(archive, "index.json", json.dumps(index).encode())
    return out
