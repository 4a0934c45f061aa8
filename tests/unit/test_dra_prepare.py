"""NodePrepareResources / NodeUnprepareResources (gpunode/dra/prepare.py) against the test API server over
real TLS with a kubelet's certificate, under a temp root: what the answers hold, the claim's CDI spec, the
checkpoint, the refusals, repeats and restarts, an old and a corrupt checkpoint, and a real SIGKILL at every
write, fsync, rename and unlink of Prepare and Unprepare."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.dra import checkpoint as cp
from gpunode.dra import claimcdi
from gpunode.dra.prepare import ClaimRef
from tests import draprepare
from tests.draprepare import DRIVER, NODE, answer, inventory, preparer
from tests.killharness import module_process
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.dra import CLAIMS
from tests.kubeapi.pki import Pki

CHECKPOINT = f"/var/lib/kubelet/plugins/{DRIVER}/gpunode-checkpoint.json"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> Iterator[tuple[ApiServer, dict[str, str]]]:
    cert = pki.client(f"system:node:{NODE}", ["system:nodes"])
    with ApiServer(pki, tokens={}, allow=[]) as server:
        server.add_node(NODE)
        yield (
            server,
            {"url": server.url, "ca": str(pki.ca.cert), "cert": str(cert.cert), "key": str(cert.key)},
        )


def claim(server: ApiServer, name: str, devices: tuple[str, ...], **kw: Any) -> ClaimRef:
    made = server.dra.allocate_claim("ml", name, node=NODE, driver=DRIVER, devices=devices, **kw)
    return ClaimRef("ml", made["metadata"]["uid"], name)


def gpu_config(**sharing: Any) -> dict[str, Any]:
    parameters: dict[str, Any] = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    if sharing:
        parameters["sharing"] = sharing
    return {"driver": DRIVER, "parameters": parameters}


def spec_of(root: Path, uid: str) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((root / claimcdi.spec_path(uid).lstrip("/")).read_text())
    return spec


def leftovers(root: Path) -> list[str]:
    """Every claim spec and checkpoint entry under the root."""
    cdi = root / "var/run/cdi"
    specs = sorted(p.name for p in cdi.iterdir()) if cdi.is_dir() else []  # temp files of killed writes too
    path = root / CHECKPOINT.lstrip("/")
    entries = sorted(cp.parse(path.read_text())) if path.exists() else []
    return specs + entries


def test_one_gpu(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    ref = claim(server, "one", ("gpu-3",))
    got = answer(preparer(tmp_path, creds).prepare([ref]))
    assert got == {
        ref.uid: {
            "devices": [
                {
                    "request_names": ["gpu"],
                    "pool_name": NODE,
                    "device_name": "gpu-3",
                    "cdi_device_ids": [f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-3"],
                }
            ]
        }
    }
    spec = spec_of(tmp_path, ref.uid)
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{ref.uid}-gpu-3"]
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes == ["/dev/nvidia3"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
    assert "/dev/nvidiactl" in [n["path"] for n in spec["containerEdits"]["deviceNodes"]]
    text = (tmp_path / claimcdi.spec_path(ref.uid).lstrip("/")).read_text()
    assert claimcdi.claim_of(text) == ("ml", "one", ref.uid)
    entry = cp.parse((tmp_path / CHECKPOINT.lstrip("/")).read_text())[ref.uid]
    assert entry.state == cp.COMPLETED
    assert entry.cdi_sha256 == hashlib.sha256(text.encode()).hexdigest()


def test_eight_gpus(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    names = tuple(f"gpu-{i}" for i in range(8))
    ref = claim(server, "eight", names)
    got = answer(preparer(tmp_path, creds).prepare([ref]))[ref.uid]
    assert [d["device_name"] for d in got["devices"]] == list(names)
    spec = spec_of(tmp_path, ref.uid)
    assert [d["containerEdits"]["deviceNodes"][0]["path"] for d in spec["devices"]] == [
        f"/dev/nvidia{i}" for i in range(8)
    ]


def test_mig_device(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    ref = claim(server, "mig", ("gpu-1-mig-3g20gb-2-0",), request="slice")
    driver = preparer(tmp_path, creds, inv=inventory(2, mig_on=(1,)))
    got = answer(driver.prepare([ref]))[ref.uid]
    assert got["devices"][0]["device_name"] == "gpu-1-mig-3g20gb-2-0"
    nodes = [n["path"] for n in spec_of(tmp_path, ref.uid)["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes[0] == "/dev/nvidia1"
    assert len(nodes) == 3 and all(n.startswith("/dev/nvidia-caps/nvidia-cap") for n in nodes[1:])
    # The GPU itself is not a device while MIG is on.
    full = claim(server, "full", ("gpu-1",))
    assert "does not exist on this node" in answer(driver.prepare([full]))[full.uid]["error"]


def test_a_device_goes_to_one_claim_unless_admin_access(
    api: tuple[ApiServer, dict[str, str]], tmp_path: Path
) -> None:
    server, creds = api
    driver = preparer(tmp_path, creds)
    first = claim(server, "first", ("gpu-0", "gpu-1"))
    second = claim(server, "second", ("gpu-1",))
    admin = claim(server, "admin", ("gpu-1",), admin_access=True)
    assert "devices" in answer(driver.prepare([first]))[first.uid]
    refused = answer(driver.prepare([second]))[second.uid]["error"]
    assert f"gpu-1 of pool {NODE} is prepared for claim ml/first ({first.uid})" in refused
    assert "adminAccess" in refused
    assert not (tmp_path / claimcdi.spec_path(second.uid).lstrip("/")).exists()
    assert [d["device_name"] for d in answer(driver.prepare([admin]))[admin.uid]["devices"]] == ["gpu-1"]
    # Once the first is unprepared, the second gets it.
    assert answer(driver.unprepare([first])) == {first.uid: {}}
    assert "devices" in answer(driver.prepare([second]))[second.uid]


def test_refusals_name_the_problem(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    driver = preparer(tmp_path, creds, unhealthy={draprepare.uuid_of(2): "Xid 79 (fell off the bus)"})
    sick = claim(server, "sick", ("gpu-2",))
    missing = claim(server, "missing", ("gpu-9",))
    elsewhere = claim(server, "elsewhere", ("gpu-0",), pool="n2")
    wrong_uid = ClaimRef("ml", "00000000-0000-0000-0000-000000000000", "sick")
    got = answer(driver.prepare([sick, missing, elsewhere, wrong_uid]))
    assert "gpu-2 of pool n1 is unhealthy: Xid 79" in got[sick.uid]["error"]
    assert "gpu-9 of pool n1 does not exist" in got[missing.uid]["error"]
    assert "is not on this node" in got[elsewhere.uid]["error"]
    assert f"has the UID {sick.uid}, not {wrong_uid.uid}" in got[wrong_uid.uid]["error"]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long", "intervall": 1}),
            "'intervall'",
        ),
        (gpu_config(strategy="TimeSlicing", timeSliceConfig={}), "unknown field 'timeSliceConfig'"),
        (gpu_config(strategy="TimeSlicing", timeSlicingConfig={}), "interval must be one of"),
        (gpu_config(strategy="Exclusive"), "strategy must be TimeSlicing or MPS"),
        (gpu_config(strategy="MPS"), "MPS sharing of gpu-0"),
        (
            {
                "driver": DRIVER,
                "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"},
            },
            "is a MigDeviceConfig",
        ),
    ],
)
def test_opaque_config_refused(
    api: tuple[ApiServer, dict[str, str]], tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    server, creds = api
    ref = claim(server, "configured", ("gpu-0",), config=(config,))
    # The scheduler copies class configs with empty requests; a MigDeviceConfig naming no request is skipped
    # for a GPU, so name the request to see the kind refused.
    if config["parameters"]["kind"] == "MigDeviceConfig":
        stored = server.dra.get(CLAIMS, "configured", "ml")
        assert stored is not None
        stored["status"]["allocation"]["devices"]["config"][0]["requests"] = ["gpu"]
        server.dra.remove(CLAIMS, "configured", "ml")
        ref = ClaimRef("ml", server.dra.put(CLAIMS, stored, "ml")["metadata"]["uid"], "configured")
    error = answer(preparer(tmp_path, creds).prepare([ref]))[ref.uid]["error"]
    assert message in error
    assert leftovers(tmp_path) == []


def test_time_slicing_is_recorded(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    ref = claim(
        server,
        "sliced",
        ("gpu-0", "gpu-1"),
        config=(gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}),),
    )
    assert "devices" in answer(preparer(tmp_path, creds).prepare([ref]))[ref.uid]
    entry = cp.parse((tmp_path / CHECKPOINT.lstrip("/")).read_text())[ref.uid]
    assert entry.config == (
        {
            "entry": 0,
            "kind": "GpuConfig",
            "devices": ["gpu-0", "gpu-1"],
            "strategy": "TimeSlicing",
            "interval": "Long",
        },
    )


def test_repeats_and_restarts_answer_identically(
    api: tuple[ApiServer, dict[str, str]], tmp_path: Path
) -> None:
    server, creds = api
    ref = claim(server, "again", ("gpu-0", "gpu-5"))
    driver = preparer(tmp_path, creds)
    first = answer(driver.prepare([ref]))
    spec = tmp_path / claimcdi.spec_path(ref.uid).lstrip("/")
    stamp = spec.stat().st_mtime_ns
    assert answer(driver.prepare([ref])) == first
    assert answer(preparer(tmp_path, creds).prepare([ref])) == first  # a restarted driver
    assert spec.stat().st_mtime_ns == stamp
    # A reboot empties /var/run: the spec is written again, the answer is the same.
    spec.unlink()
    assert answer(preparer(tmp_path, creds).prepare([ref])) == first
    assert spec.exists()


def test_unprepare(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    ref = claim(server, "done", ("gpu-0",))
    driver = preparer(tmp_path, creds)
    unknown = ClaimRef("ml", "11111111-2222-3333-4444-555555555555", "never")
    assert answer(driver.unprepare([unknown])) == {unknown.uid: {}}
    driver.prepare([ref])
    assert leftovers(tmp_path) == [f"{claimcdi.PREFIX}{ref.uid}.yaml", ref.uid]
    assert answer(driver.unprepare([ref])) == {ref.uid: {}}
    assert answer(driver.unprepare([ref])) == {ref.uid: {}}
    assert leftovers(tmp_path) == []


def test_a_spec_changed_by_someone_else_is_left(
    api: tuple[ApiServer, dict[str, str]], tmp_path: Path
) -> None:
    server, creds = api
    ref = claim(server, "edited", ("gpu-0",))
    driver = preparer(tmp_path, creds)
    driver.prepare([ref])
    spec = tmp_path / claimcdi.spec_path(ref.uid).lstrip("/")
    spec.write_text(spec.read_text() + "# an operator's note\n")
    assert answer(driver.unprepare([ref])) == {ref.uid: {}}
    assert spec.exists()
    assert ref.uid not in cp.parse((tmp_path / CHECKPOINT.lstrip("/")).read_text())


def test_a_corrupt_checkpoint_is_set_aside_and_rebuilt_from_the_api(
    api: tuple[ApiServer, dict[str, str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, creds = api
    kept, gone = claim(server, "kept", ("gpu-0",)), claim(server, "gone", ("gpu-1",))
    driver = preparer(tmp_path, creds)
    first = answer(driver.prepare([kept, gone]))
    # `gone` is deleted and made again under its name: another claim, its old spec must go.
    server.dra.remove(CLAIMS, "gone", "ml")
    claim(server, "gone", ("gpu-2",))
    path = tmp_path / CHECKPOINT.lstrip("/")
    damaged = path.read_bytes().replace(b"PrepareCompleted", b"PrepareCompleteD", 1)
    path.write_bytes(damaged)
    restarted = preparer(tmp_path, creds)
    again = answer(restarted.prepare([kept]))
    assert again == {kept.uid: first[kept.uid]}
    aside = Path(f"{path}.corrupt-{hashlib.sha256(damaged).hexdigest()[:12]}")
    assert aside.read_bytes() == damaged
    assert any("moved to" in note and "rebuilt from the API" in note for note in restarted.notes)
    assert "checksum does not match" in caplog.text
    assert leftovers(tmp_path) == [f"{claimcdi.PREFIX}{kept.uid}.yaml", kept.uid]
    # The rebuilt claim still holds its GPU.
    other = claim(server, "other", ("gpu-0",))
    assert "is prepared for claim ml/kept" in answer(restarted.prepare([other]))[other.uid]["error"]


@pytest.mark.parametrize("text", ["{not json", '{"version": 7, "data": {}}', "[]"])
def test_unreadable_checkpoints_never_stop_the_driver(
    api: tuple[ApiServer, dict[str, str]], tmp_path: Path, text: str
) -> None:
    server, creds = api
    path = tmp_path / CHECKPOINT.lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    ref = claim(server, "fresh", ("gpu-0",))
    driver = preparer(tmp_path, creds)
    assert "devices" in answer(driver.prepare([ref]))[ref.uid]
    assert len(list(path.parent.glob("gpunode-checkpoint.json.corrupt-*"))) == 1


def test_a_version_0_checkpoint_is_read(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    device = {
        "requestNames": ["gpu"],
        "pool": NODE,
        "device": "gpu-4",
        "cdiDeviceIDs": ["k8s.gpu.nvidia.com/claim=old-uid-gpu-4"],
    }
    claims = {"old-uid": {"namespace": "ml", "name": "old", "devices": [device]}}
    canonical = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()
    path = tmp_path / CHECKPOINT.lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"checksum": zlib.crc32(canonical), "claims": claims}))
    driver = preparer(tmp_path, creds)
    old = ClaimRef("ml", "old-uid", "old")
    assert answer(driver.prepare([old]))[old.uid]["devices"][0]["device_name"] == "gpu-4"
    newer = claim(server, "newer", ("gpu-4",))
    assert "is prepared for claim ml/old (old-uid)" in answer(driver.prepare([newer]))[newer.uid]["error"]
    assert answer(driver.unprepare([old])) == {old.uid: {}}
    assert json.loads(path.read_text())["version"] == cp.VERSION
    assert "devices" in answer(driver.prepare([newer]))[newer.uid]


def test_a_version_0_checkpoint_with_a_wrong_checksum_is_set_aside(tmp_path: Path) -> None:
    text = json.dumps({"checksum": 1, "claims": {}})
    with pytest.raises(ValueError, match="checksum"):
        cp.parse(text)


# -- SIGKILL at every step -----------------------------------------------------------------------------

STEPS = ("write", "fsync", "rename", "unlink")


def killed(call: str, root: Path, *, creds: dict[str, str], ref: ClaimRef, step: str, n: int) -> bool:
    """Run one call in a driver process killed at the nth `step`; True when the kill came."""
    done = module_process(
        "tests.draprepare",
        dict(os.environ),
        call,
        str(root),
        json.dumps(creds),
        ref.namespace,
        ref.name,
        ref.uid,
        kill=(step, n),
    )
    if done.returncode == -9:
        return True
    assert done.returncode == 0, done.stderr
    return False


def test_sigkill_at_every_step_of_prepare(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    ref = claim(server, "killed", ("gpu-0", "gpu-1"))
    rival = claim(server, "rival", ("gpu-1",))
    reference = answer(preparer(tmp_path / "reference", creds).prepare([ref]))
    kills = 0
    for step in STEPS:
        n = 1
        while True:
            root = tmp_path / f"{step}-{n}"
            if not killed("prepare", root, creds=creds, ref=ref, step=step, n=n):
                break
            kills += 1
            # kubelet may give up on the pod instead of asking again: Unprepare alone leaves nothing.
            given_up = tmp_path / f"{step}-{n}-unprepared"
            shutil.copytree(root, given_up, symlinks=True)
            assert answer(preparer(given_up, creds).unprepare([ref])) == {ref.uid: {}}
            assert leftovers(given_up) == [], (step, n)
            restarted = preparer(root, creds)  # the driver started again
            assert answer(restarted.prepare([ref])) == reference, (step, n)
            assert "is prepared for claim ml/killed" in answer(restarted.prepare([rival]))[rival.uid]["error"]
            assert answer(restarted.unprepare([ref])) == {ref.uid: {}}
            assert leftovers(root) == [], (step, n)
            n += 1
    assert kills >= 10  # three files written whole (entry started, spec, entry completed)


def test_sigkill_at_every_step_of_unprepare(api: tuple[ApiServer, dict[str, str]], tmp_path: Path) -> None:
    server, creds = api
    ref = claim(server, "killed", ("gpu-0",))
    rival = claim(server, "rival", ("gpu-0",))
    kills = 0
    for step in STEPS:
        n = 1
        while True:
            root = tmp_path / f"{step}-{n}"
            before = preparer(root, creds)
            assert "devices" in answer(before.prepare([ref]))[ref.uid]
            if not killed("unprepare", root, creds=creds, ref=ref, step=step, n=n):
                assert leftovers(root) == []
                break
            kills += 1
            restarted = preparer(root, creds)
            assert answer(restarted.unprepare([ref])) == {ref.uid: {}}
            assert leftovers(root) == [], (step, n)
            assert "devices" in answer(restarted.prepare([rival]))[rival.uid]
            assert answer(restarted.unprepare([rival])) == {rival.uid: {}}
            n += 1
    assert kills >= 4  # the spec's unlink, the checkpoint's write, fsyncs and rename
