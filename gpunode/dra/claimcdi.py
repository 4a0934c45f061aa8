"""One CDI spec per prepared claim, as NVIDIA's DRA driver writes them (shared/specs/dra-nvidia-compat.md
section 5): `/var/run/cdi/k8s.gpu.nvidia.com-claim_<claimUID>.yaml`, kind `k8s.gpu.nvidia.com/claim`,
a device `<claimUID>-<deviceName>` per prepared device, so the IDs a claim's containers get are
`k8s.gpu.nvidia.com/claim=<claimUID>-<deviceName>` and a runtime caching specs never confuses two claims.

The edits are gpunode's own CDI generation (gpunode/cdi/generate.py build_spec over the same host facts):
each device's edits are those build_spec gives that GPU or MIG device (found by UUID), the spec-wide edits
(control nodes, driver libraries, programs, firmware, sockets, ldcache hook, NVIDIA_VISIBLE_DEVICES=void)
are build_spec's too, so `cdi generate` and a claim's spec never differ in what a GPU needs.

The text is a pure function of the claim and the node (no time stamps), so a repeated Prepare writes the
same bytes, and the checkpoint can name the spec by checksum before it is written; Unprepare removes the
file only while it still holds exactly those bytes.

MPS edits (CUDA_MPS_PIPE_DIRECTORY, the daemon's pipe and shm directories) are not built: MPS sharing is
refused for claims until gpunode's MPS supervision can run a daemon per claim (see prepare.py).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpunode import __version__
from gpunode.cdi import generate
from gpunode.cdi import spec as cdispec
from gpunode.cdi.hostfacts import HostFacts
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.nvml.model import Inventory

log = logging.getLogger("gpunode.dra")

VENDOR = "k8s.gpu.nvidia.com"
KIND = f"{VENDOR}/claim"
DIRECTORY = generate.DYNAMIC_DIR
PREFIX = f"{VENDOR}-claim_"
HEADER_FIRST = "Written by gpunode"  # ownership.MARKER's words: a spec gpunode wrote starts with them
_CLAIM_LINE = re.compile(r"^# For ResourceClaim (\S+)/(\S+) \(uid (\S+)\)\.$", re.MULTILINE)


def spec_path(uid: str, directory: str = DIRECTORY) -> str:
    return f"{directory}/{PREFIX}{uid}.yaml"


def device_id(uid: str, device: str) -> str:
    return cdispec.qualified(KIND, f"{uid}-{device}")


@dataclass(frozen=True)
class ClaimDevice:
    name: str  # the slice's device name (gpu-0, gpu-0-mig-...)
    uuid: str  # the GPU's or MIG device's UUID: what build_spec names its edits by


@dataclass(frozen=True)
class ClaimSpec:
    path: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def build(
    inventory: Inventory,
    facts: HostFacts,
    *,
    uid: str,
    namespace: str,
    name: str,
    devices: Sequence[ClaimDevice],
    directory: str = DIRECTORY,
) -> ClaimSpec:
    """The claim's spec text (nothing is written)."""
    node = generate.build_spec(inventory, facts, generate.DEFAULT_KIND)
    edits: dict[str, Any] = {d["name"]: d["containerEdits"] for d in node["devices"]}
    claim_devices = []
    for device in devices:
        found = edits.get(device.uuid)
        if found is None:
            raise GpunodeError(
                f"device {device.name} ({device.uuid}) has no device node on this node",
                "check `gpunode doctor`: its /dev/nvidia<minor> node is missing or not that GPU's",
            )
        claim_devices.append({"name": f"{uid}-{device.name}", "containerEdits": found})
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": KIND,
        "devices": claim_devices,
        "containerEdits": node["containerEdits"],
    }
    spec["cdiVersion"] = cdispec.minimum_version(spec)
    header = (
        f"{HEADER_FIRST} {__version__} (`gpunode dra run`) when it prepared the claim.\n"
        f"For ResourceClaim {namespace}/{name} (uid {uid}).\n"
        "Removed when kubelet unprepares the claim; do not edit it."
    )
    return ClaimSpec(spec_path(uid, directory), cdispec.render(spec, "yaml", header))


def claim_of(text: str) -> tuple[str, str, str] | None:
    """(namespace, name, uid) of a claim spec gpunode wrote, from its header; None for any other text."""
    if not text.startswith(f"# {HEADER_FIRST}"):
        return None
    match = _CLAIM_LINE.search(text)
    return (match.group(1), match.group(2), match.group(3)) if match else None


def write(host: Host, spec: ClaimSpec) -> bool:
    """Write the spec atomically; False when it already holds exactly this text."""
    return host.write_file(spec.path, spec.text, mode=0o644, make_parents=True).changed


def remove(host: Host, path: str, sha256: str | None) -> bool:
    """Remove a claim's spec only while it holds what gpunode wrote (its checksum); True when it is gone.
    A file changed since (by whom?) is left where it is, with a log line: never deleted unseen."""
    data = host.read_bytes(path)
    if data is None:
        # Never written, or gone: the temp file of a write killed midway may be there (Host.remove_file
        # clears those of this very file, under the directory's lock).
        host.remove_file(path)
        return True
    if sha256 is None or hashlib.sha256(data).hexdigest() != sha256:
        log.warning("%s is not the CDI spec gpunode wrote for its claim (changed since); left in place", path)
        return False
    host.remove_file(path)
    return True


def written_claims(host: Host, directory: str = DIRECTORY) -> list[tuple[str, str]]:
    """The claim specs gpunode wrote in `directory`: (path, text), by name."""
    if not host.is_dir(directory):
        return []
    found = []
    for entry in sorted(host.listdir(directory)):
        if not (entry.startswith(PREFIX) and entry.endswith(".yaml")):
            continue
        path = f"{directory}/{entry}"
        try:
            data = host.read_bytes(path)
        except GpunodeError:
            continue
        if data is not None and claim_of(data.decode("utf-8", "replace")) is not None:
            found.append((path, data.decode("utf-8", "replace")))
    return found


def devices_in(text: str, uid: str) -> list[str]:
    """The device names a claim spec holds (`<uid>-<name>` entries)."""
    spec = cdispec.parse(text, "claim spec")
    names = [str(d.get("name", "")) for d in spec.get("devices") or [] if isinstance(d, dict)]
    return [n[len(uid) + 1 :] for n in names if n.startswith(f"{uid}-")]
