"""The opaque config of a claim (gpunode/dra/opaque.py): strict decoding as NVIDIA's driver decodes
GpuConfig and MigDeviceConfig, quantities, the 10 KiB bound, and which config entry a device gets."""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.dra import opaque
from gpunode.dra.opaque import OpaqueConfigError, configs_for, decode, main_request_name, mebibytes

DRIVER = "gpu.nvidia.com"


def params(kind: str = "GpuConfig", **sharing: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"apiVersion": opaque.API_VERSION, "kind": kind}
    if sharing:
        out["sharing"] = sharing
    return out


def entry(
    source: str, requests: list[str], parameters: dict[str, Any], driver: str = DRIVER
) -> dict[str, Any]:
    return {"source": source, "requests": requests, "opaque": {"driver": driver, "parameters": parameters}}


def test_defaults_and_time_slicing() -> None:
    assert decode(params()).sharing == opaque.Sharing("TimeSlicing", interval="Default")
    assert decode(params("MigDeviceConfig")).sharing == opaque.Sharing("TimeSlicing")
    assert decode(params(strategy="TimeSlicing")).sharing.interval == "Default"
    sliced = decode(params(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"}))
    assert sliced.sharing.interval == "Short"


def test_mps_config() -> None:
    got = decode(
        params(
            strategy="MPS",
            mpsConfig={
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
                "defaultPerDevicePinnedMemoryLimit": {"0": "512Mi", "GPU-1234-abcd": 2147483648},
            },
        )
    )
    assert got.sharing.mps == opaque.MpsConfig(50, 10240, {"0": 512, "GPU-1234-abcd": 2048})


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (params(sharing_typo=1), "unknown field 'sharing_typo'"),
        (params(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 101}), "from 0 to 100"),
        (params(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": True}), "from 0 to 100"),
        (params(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "512Ki"}), "less than 1Mi"),
        (params(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "lots"}), "not a quantity"),
        (params(strategy="MPS", mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"gpu0": "1Gi"}}), "'gpu0'"),
        (params(strategy="MPS", timeSlicingConfig={"interval": "Long"}), "strategy is MPS"),
        (params(strategy="TimeSlicing", mpsConfig={}), "strategy is TimeSlicing"),
        (params("MigDeviceConfig", strategy="TimeSlicing", timeSlicingConfig={}), "'timeSlicingConfig'"),
        (params("VfioDeviceConfig"), "no VFIO"),
        (params("Other"), "kind 'Other'"),
        ({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}, "reads resource.nvidia.com/v1beta1"),
        ({**params(), "extra": "x" * (opaque.MAX_PARAMETERS + 1)}, "at most 10240"),
        ("GpuConfig", "must be an object"),
    ],
)
def test_refused(parameters: Any, message: str) -> None:
    with pytest.raises(OpaqueConfigError) as raised:
        decode(parameters)
    assert message in raised.value.message


def test_quantities() -> None:
    assert mebibytes("1Gi", "x") == 1024
    assert mebibytes("1.5Gi", "x") == 1536
    assert mebibytes("2G", "x") == 1907  # 2e9 bytes, rounded down to whole MiB
    assert mebibytes(1048576, "x") == 1


def test_precedence_class_then_claim_later_wins() -> None:
    short = params(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"})
    long = params(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"})
    medium = params(strategy="TimeSlicing", timeSlicingConfig={"interval": "Medium"})
    # As listed by the scheduler: the class's entry may come anywhere; it ranks below every claim entry.
    entries = [
        entry("FromClaim", [], medium),
        entry("FromClass", [], short),
        entry("FromClaim", ["a"], long),
        entry("FromClaim", [], params(), driver="other.example.com"),
    ]
    got = configs_for(entries, DRIVER, [("a", "gpu"), ("b", "gpu"), ("a/sub", "gpu")])
    assert [(a.entry, a.config.sharing.interval if a.config else None) for a in got] == [
        (2, "Long"),
        (0, "Medium"),
        (0, "Medium"),  # "a" does not reach the firstAvailable result "a/sub"; the empty entry does
    ]
    # The highest entry that fits wins, exact or empty: a later empty entry outranks an earlier exact one.
    later = configs_for(
        [entry("FromClaim", ["a"], long), entry("FromClaim", [], medium)], DRIVER, [("a", "gpu")]
    )
    assert later[0].entry == 1
    only_class = configs_for([entry("FromClass", [], short)], DRIVER, [("a", "gpu")])
    assert only_class[0].config is not None and only_class[0].config.sharing.interval == "Short"


def test_wrong_kind() -> None:
    mig = params("MigDeviceConfig")
    assert configs_for([entry("FromClaim", [], mig)], DRIVER, [("a", "gpu")]) == [opaque.Applied(None, None)]
    with pytest.raises(OpaqueConfigError, match="is a MigDeviceConfig"):
        configs_for([entry("FromClaim", ["a"], mig)], DRIVER, [("a", "gpu")])
    with pytest.raises(OpaqueConfigError, match=r"config entry 0 \(FromClaim\): .*unknown field 'bad'"):
        configs_for([entry("FromClaim", [], {**params(), "bad": 1})], DRIVER, [("a", "gpu")])


def test_main_request_name() -> None:
    assert main_request_name("gpu/large") == "gpu"
    assert main_request_name("gpu") == "gpu"
