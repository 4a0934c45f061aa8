"""The committed deviceplugin stubs: generated from the committed proto, and shaped as kubelet expects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpunode.plugin.api import deviceplugin_pb2 as pb

REPO = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_generator() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/generate_deviceplugin_stubs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_method_paths_and_field_numbers_match_kubelet() -> None:
    services = {s.full_name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": [
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    }
    assert pb.DESCRIPTOR.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming
    expected = {
        "DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
        "RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
        "ListAndWatchResponse": {"devices": 1},
        "TopologyInfo": {"nodes": 1},
        "NUMANode": {"ID": 1},
        "Device": {"ID": 1, "health": 2, "topology": 3},
        "PreStartContainerRequest": {"devices_ids": 1},
        "PreferredAllocationRequest": {"container_requests": 1},
        "ContainerPreferredAllocationRequest": {
            "available_deviceIDs": 1,
            "must_include_deviceIDs": 2,
            "allocation_size": 3,
        },
        "PreferredAllocationResponse": {"container_responses": 1},
        "ContainerPreferredAllocationResponse": {"deviceIDs": 1},
        "AllocateRequest": {"container_requests": 1},
        "ContainerAllocateRequest": {"devices_ids": 1},
        "AllocateResponse": {"container_responses": 1},
        "ContainerAllocateResponse": {
            "envs": 1,
            "mounts": 2,
            "devices": 3,
            "annotations": 4,
            "cdi_devices": 5,
        },
        "Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
        "DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
        "CDIDevice": {"name": 1},
    }
    for message, fields in expected.items():
        descriptor = pb.DESCRIPTOR.message_types_by_name[message]
        assert {f.name: f.number for f in descriptor.fields} == fields, message
    assert pb.DESCRIPTOR.package == "v1beta1"
