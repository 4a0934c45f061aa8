"""The committed DRA kubelet-plugin stubs: generated from the committed protos, shaped as kubelet expects.

Every package, method path and field number below is from shared/specs/dra-kubelet-plugin.md; a drift in a
proto would make kubelet and the driver talk past each other without any error.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpunode.dra.api import dra_health_v1alpha1_pb2 as health_pb
from gpunode.dra.api import dra_v1_pb2 as v1_pb
from gpunode.dra.api import dra_v1beta1_pb2 as v1beta1_pb
from gpunode.dra.api import pluginregistration_pb2 as reg_pb

REPO = Path(__file__).resolve().parents[2]

DRA_FIELDS: dict[str, dict[str, int]] = {
    "NodePrepareResourcesRequest": {"claims": 1},
    "NodeUnprepareResourcesRequest": {"claims": 1},
    "Claim": {"namespace": 1, "uid": 2, "name": 3},
    "NodePrepareResourcesResponse": {"claims": 1},
    "NodePrepareResourceResponse": {"devices": 1, "error": 2},
    "Device": {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4},
    "NodeUnprepareResourcesResponse": {"claims": 1},
    "NodeUnprepareResourceResponse": {"error": 1},
}


def _fields(module: Any, message: str) -> dict[str, int]:
    return {f.name: f.number for f in module.DESCRIPTOR.message_types_by_name[message].fields}


def _methods(module: Any) -> dict[str, list[str]]:
    return {
        s.full_name: [f"/{s.full_name}/{m.name}" for m in s.methods]
        for s in module.DESCRIPTOR.services_by_name.values()
    }


def test_committed_stubs_match_the_generator() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/generate_grpc_stubs.py"), "--check", "gpunode/dra/api"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_check_finds_a_stale_stub(tmp_path: Path) -> None:
    # The check above is only worth something if it fails on a difference: run the generator's own
    # comparison against a copy of the repository's API directory with one stub changed.
    script = REPO / "scripts/generate_grpc_stubs.py"
    spec = importlib.util.spec_from_file_location("generate_grpc_stubs", script)
    assert spec is not None and spec.loader is not None
    gen: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    copy = tmp_path / "gpunode" / "dra" / "api"
    copy.mkdir(parents=True)
    for proto in gen.APIS["gpunode/dra/api"]:
        (copy / proto).write_bytes((REPO / "gpunode/dra/api" / proto).read_bytes())
        for name in gen.outputs(proto):
            (copy / name).write_bytes((REPO / "gpunode/dra/api" / name).read_bytes())
    (copy / "dra_v1_pb2.pyi").write_text("# edited by hand\n")
    gen.REPO = tmp_path  # this module object is the test's own copy: nothing else sees the change
    assert gen.stale("gpunode/dra/api") == ["gpunode/dra/api/dra_v1_pb2.pyi"]


def test_registration_matches_kubelet() -> None:
    assert reg_pb.DESCRIPTOR.package == "pluginregistration"
    assert _methods(reg_pb) == {
        "pluginregistration.Registration": [
            "/pluginregistration.Registration/GetInfo",
            "/pluginregistration.Registration/NotifyRegistrationStatus",
        ]
    }
    assert _fields(reg_pb, "InfoRequest") == {}
    assert _fields(reg_pb, "RegistrationStatusResponse") == {}
    assert _fields(reg_pb, "PluginInfo") == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert _fields(reg_pb, "RegistrationStatus") == {"plugin_registered": 1, "error": 2}


@pytest.mark.parametrize(("module", "version"), [(v1_pb, "v1"), (v1beta1_pb, "v1beta1")])
def test_dra_service_matches_kubelet(module: Any, version: str) -> None:
    package = f"k8s.io.kubelet.pkg.apis.dra.{version}"
    assert module.DESCRIPTOR.package == package
    assert _methods(module) == {
        f"{package}.DRAPlugin": [
            f"/{package}.DRAPlugin/NodePrepareResources",
            f"/{package}.DRAPlugin/NodeUnprepareResources",
        ]
    }
    expected = {name: dict(fields) for name, fields in DRA_FIELDS.items()}
    if version == "v1":
        expected["Device"]["share_id"] = 5  # only v1 has it
    for message, fields in expected.items():
        assert _fields(module, message) == fields, message
    for response in ("NodePrepareResourcesResponse", "NodeUnprepareResourcesResponse"):
        claims = module.DESCRIPTOR.message_types_by_name[response].fields_by_name["claims"]
        assert claims.message_type.GetOptions().map_entry, f"{response}.claims is a map"
        assert claims.message_type.fields_by_name["key"].type == claims.TYPE_STRING


def test_v1_share_id_has_presence() -> None:
    # "optional": an unset share_id is absent, not "", as kubelet tells a shared from an unshared device.
    device = v1_pb.Device(device_name="gpu-0")
    assert not device.HasField("share_id")
    device.share_id = ""
    assert device.HasField("share_id")


def test_health_service_matches_kubelet() -> None:
    assert health_pb.DESCRIPTOR.package == "v1alpha1"
    assert _methods(health_pb) == {
        "v1alpha1.DRAResourceHealth": ["/v1alpha1.DRAResourceHealth/NodeWatchResources"]
    }
    method = health_pb.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name["NodeWatchResources"]
    assert method.server_streaming and not method.client_streaming
    assert {v.name: v.number for v in health_pb.DESCRIPTOR.enum_types_by_name["HealthStatus"].values} == {
        "UNKNOWN": 0,
        "HEALTHY": 1,
        "UNHEALTHY": 2,
    }
    assert _fields(health_pb, "NodeWatchResourcesRequest") == {}
    assert _fields(health_pb, "DeviceIdentifier") == {"pool_name": 1, "device_name": 2}
    assert _fields(health_pb, "DeviceHealth") == {
        "device": 1,
        "health": 2,
        "last_updated_time": 3,
        "health_check_timeout_seconds": 4,
        "message": 5,
    }
    assert _fields(health_pb, "NodeWatchResourcesResponse") == {"devices": 1}
    fields = health_pb.DESCRIPTOR.message_types_by_name["DeviceHealth"].fields_by_name
    assert fields["last_updated_time"].type == fields["last_updated_time"].TYPE_INT64
    assert fields["health_check_timeout_seconds"].type == fields["last_updated_time"].TYPE_INT64
