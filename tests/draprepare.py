"""What the DRA Prepare tests share with the child process they SIGKILL: a node's inventory (full GPUs and
MIG), the Preparer built on it under a temp root with a kubelet's client certificate for the test API
server, and `child(argv)`, the driver process of the kill sweep (tests/killharness.py module_process)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpunode.cdi.hostfacts import Roots, simulated_host_facts
from gpunode.dra.prepare import ClaimRef, NodeDevice, Preparer, inventory_devices
from gpunode.host import Host
from gpunode.kube import Credentials, Pem
from gpunode.kube.client import KubeClient, RetryPolicy, Timeouts
from gpunode.nvml.model import Gpu, Inventory, MigDevice, MigMode

DRIVER = "gpu.nvidia.com"
NODE = "n1"
FAST = RetryPolicy(attempts=2, backoff=0.001, max_backoff=0.01, max_retry_after=0.05, conflict_attempts=2)


def uuid_of(index: int) -> str:
    return f"GPU-{index:08d}-1111-2222-3333-444444444444"


def inventory(gpus: int = 8, mig_on: tuple[int, ...] = ()) -> Inventory:
    """`gpus` A100s; those in `mig_on` in MIG mode with two 3g.20gb instances each."""
    out = []
    for index in range(gpus):
        migs: tuple[MigDevice, ...] = ()
        if index in mig_on:
            migs = tuple(
                MigDevice(
                    parent_index=index,
                    index=slot,
                    uuid=f"MIG-{index:04d}{slot:04d}-aaaa-bbbb-cccc-dddddddddddd",
                    name="MIG 3g.20gb",
                    profile="3g.20gb",
                    memory_total=20 * 2**30,
                    gpu_instance_id=1 + slot,
                    compute_instance_id=0,
                )
                for slot in range(2)
            )
        out.append(
            Gpu(
                index=index,
                uuid=uuid_of(index),
                name="NVIDIA A100-SXM4-40GB",
                minor=index,
                mig_mode=MigMode(index in mig_on, index in mig_on),
                mig_devices=migs,
            )
        )
    return Inventory("550.54.15", (12, 4), "12.550.54.15", tuple(out))


def mig_name(gpu: Gpu, mig: MigDevice) -> str:
    """The tests' stand-in for the slices' MIG naming (gpunode/dra/slices.py has the real one)."""
    profile = (mig.profile or "").replace(".", "")
    return f"gpu-{gpu.minor}-mig-{profile}-{mig.gpu_instance_id}-{mig.compute_instance_id}"


def client(api: Mapping[str, str]) -> KubeClient:
    """A kubelet's client: node n1's certificate (the Node authorizer lets it GET its pods' claims)."""
    credentials = Credentials(
        server=api["url"],
        source="kubeconfig /etc/kubernetes/kubelet.conf",
        verify=Pem(api["ca"], path=Path(api["ca"])),
        cert=(Pem(api["cert"], path=Path(api["cert"])), Pem(api["key"], path=Path(api["key"]))),
    )
    return KubeClient(credentials, retry=FAST, timeouts=Timeouts(connect=2, read=5), env={})


def preparer(
    root: Path,
    api: Mapping[str, str],
    *,
    inv: Inventory | None = None,
    unhealthy: Mapping[str, str] | None = None,
) -> Preparer:
    node_inventory = inv or inventory()
    facts = simulated_host_facts(node_inventory, Roots())
    kube = client(api)

    def devices() -> dict[str, NodeDevice]:
        return inventory_devices(node_inventory, unhealthy=unhealthy, mig_name=mig_name)

    return Preparer(
        Host(root),
        DRIVER,
        NODE,
        devices=devices,
        inventory=lambda: node_inventory,
        facts=lambda: facts,
        kube=lambda: kube,
    )


def answer(results: Mapping[str, Any]) -> dict[str, Any]:
    return {uid: result.response() for uid, result in sorted(results.items())}


def child(argv: list[str]) -> int:
    """`prepare|unprepare ROOT API_JSON NS NAME UID`: one call of a fresh driver, its answer on stdout."""
    call, root, api, namespace, name, uid = argv
    driver = preparer(Path(root), json.loads(api))
    ref = ClaimRef(namespace, uid, name)
    results = driver.prepare([ref]) if call == "prepare" else driver.unprepare([ref])
    sys.stdout.write(json.dumps(answer(results)) + "\n")
    return 0
