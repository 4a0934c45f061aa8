"""The CDI format rules gpunode follows: kinds, device names, annotation keys, the lowest cdiVersion."""

from __future__ import annotations

import pytest

from gpunode.cdi import spec as cdispec
from gpunode.errors import UsageError


@pytest.mark.parametrize("kind", ["nvidia.com/gpu", "example.com/my_class-1", "a/b", "vendor-x/gpu.v2"])
def test_valid_kinds(kind: str) -> None:
    assert cdispec.kind_problem(kind) is None


@pytest.mark.parametrize(
    "kind",
    ["nvidia.com", "nvidia.com/", "/gpu", "1vendor/gpu", "nvidia.com/1gpu", "nvidia.com/gpu-", "nv idia/gpu"],
)
def test_invalid_kinds(kind: str) -> None:
    assert cdispec.kind_problem(kind) is not None
    with pytest.raises(UsageError):
        cdispec.check_kind(kind)


@pytest.mark.parametrize(
    "name", ["0", "7", "all", "0:6", "GPU-349398b1-083c-a0d2-bfc7-b148d04be75b", "MIG-1ef28e99-f731", "a.b_c"]
)
def test_valid_device_names(name: str) -> None:
    assert cdispec.device_name_problem(name) is None


@pytest.mark.parametrize("name", ["", ":0", "0:", "-a", "a b", "gpu/0", "a=b"])
def test_invalid_device_names(name: str) -> None:
    assert cdispec.device_name_problem(name) is not None


def test_qualified_names_round_trip() -> None:
    name = cdispec.qualified("nvidia.com/gpu", "0:1")
    assert name == "nvidia.com/gpu=0:1"
    assert cdispec.parse_qualified(name) == ("nvidia.com/gpu", "0:1")
    assert cdispec.parse_qualified("nvidia.com/gpu") is None
    assert cdispec.parse_qualified("nvidia.com/gpu=") is None


def _spec(**extra: object) -> dict[str, object]:
    return {"cdiVersion": "0.3.0", "kind": "nvidia.com/gpu", "devices": [], **extra}


@pytest.mark.parametrize(
    ("spec", "version"),
    [
        (_spec(devices=[{"name": "gpu0", "containerEdits": {"deviceNodes": [{"path": "/dev/x"}]}}]), "0.3.0"),
        (_spec(containerEdits={"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "b"}]}), "0.4.0"),
        (_spec(devices=[{"name": "0", "containerEdits": {}}]), "0.5.0"),
        (_spec(containerEdits={"deviceNodes": [{"path": "/dev/x", "hostPath": "/r/dev/x"}]}), "0.5.0"),
        (_spec(kind="nvidia.com/gpu.v2"), "0.6.0"),
        (_spec(annotations={"a": "b"}), "0.6.0"),
        (_spec(devices=[{"name": "gpu", "annotations": {"a": "b"}, "containerEdits": {}}]), "0.6.0"),
        (_spec(containerEdits={"additionalGids": [44]}), "0.7.0"),
    ],
)
def test_minimum_version_is_the_lowest_the_content_needs(spec: dict[str, object], version: str) -> None:
    assert cdispec.minimum_version(spec) == version


def test_a_declared_version_below_what_the_content_needs_is_a_problem() -> None:
    spec = _spec(devices=[{"name": "0", "containerEdits": {}}])
    problems = cdispec.structure_problems(spec)
    assert problems == ["cdiVersion 0.3.0 is lower than 0.5.0, which its content needs"]
    spec["cdiVersion"] = "0.5.0"
    assert cdispec.structure_problems(spec) == []


def test_structure_problems_name_each_fault() -> None:
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {"name": "0", "containerEdits": {"env": ["NOEQUALS"]}},
            {"name": "0", "containerEdits": {}},
            {"name": "bad name", "containerEdits": {"deviceNodes": [{"path": "dev/x"}]}},
        ],
    }
    problems = cdispec.structure_problems(spec)
    assert "device '0' is defined twice" in problems
    assert "env entry 'NOEQUALS' is not KEY=VALUE" in problems
    assert any("bad name" in p for p in problems)
    assert any("no absolute path" in p for p in problems)
    assert cdispec.structure_problems({"kind": "x"})[:2] == ["no 'cdiVersion'", "no 'devices'"]


def test_annotation_keys_follow_the_cdi_rules() -> None:
    uuid = "GPU-349398b1-083c-a0d2-bfc7-b148d04be75b"
    assert cdispec.annotation_key("gpunode", uuid) == f"cdi.k8s.io/gpunode_{uuid}"
    # "/" becomes "_" (the rule); ":" of an index-named MIG device is not allowed, so it becomes "-".
    assert cdispec.annotation_key("gpunode", "a/b") == "cdi.k8s.io/gpunode_a_b"
    assert cdispec.annotation_key("gpunode", "0:1") == "cdi.k8s.io/gpunode_0-1"


def test_a_long_annotation_key_is_cut_to_63_characters_and_stays_unique() -> None:
    a = cdispec.annotation_key("gpunode", "MIG-" + "a" * 80)
    b = cdispec.annotation_key("gpunode", "MIG-" + "a" * 79 + "b")
    for key in (a, b):
        name = key.removeprefix(cdispec.ANNOTATION_PREFIX)
        assert len(name) <= 63 and name[0].isalnum() and name[-1].isalnum()
    assert a != b
    assert a == cdispec.annotation_key("gpunode", "MIG-" + "a" * 80)  # stable


def test_render_and_parse_both_formats() -> None:
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"name": "0", "containerEdits": {}}]}
    yaml_text = cdispec.render(spec, "yaml", "line one\nline two")
    assert yaml_text.startswith("# line one\n# line two\n")
    assert "&" not in yaml_text and "*id" not in yaml_text
    assert cdispec.parse(yaml_text, "/x.yaml") == spec
    assert cdispec.parse(cdispec.render(spec, "json"), "/x.json") == spec
    assert cdispec.format_of("/var/run/cdi/a.json") == "json"
    with pytest.raises(UsageError, match=r"\.yaml or \.json"):
        cdispec.format_of("/var/run/cdi/a.yml")
