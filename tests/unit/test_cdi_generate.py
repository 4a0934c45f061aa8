"""`gpunode cdi generate` and `check` on a node made under a temp root: device nodes made with mknod, a
driver's stand-in libraries listed in a real-format ld.so.cache, the fake NVML library as the GPUs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpunode.cdi import spec as cdispec
from gpunode.cdi.check import check_cdi, check_envvar_exposure
from gpunode.cdi.generate import GenerateOptions, default_output, generate, write_spec
from gpunode.cdi.hostfacts import Roots, find_libraries, read_ld_cache
from gpunode.cdi.install import plan_install
from gpunode.cdi.registry import list_devices, read_specs
from gpunode.doctor.model import Finding, Status
from gpunode.errors import NotFound, NvmlError
from gpunode.host import Host, ScriptedRunner
from gpunode.nvml import discover
from gpunode.nvml.model import Inventory
from tests import cdinode, fakenvml

SCHEMA = json.loads((Path(__file__).parent.parent / "fixtures/cdi/schema.json").read_text())
VERSION = "550.54.15"  # the fake NVML's dgx-a100 and mig profiles


def node_host(root: Path) -> Host:
    return Host(root=root, runner=ScriptedRunner(), env={"PATH": "/usr/bin:/usr/sbin"})


@pytest.fixture
def dgx(tmp_path: Path, fake_nvml: Callable[..., None]) -> Host:
    fake_nvml(profile="dgx-a100")
    cdinode.make_driver(tmp_path, VERSION, gpus=range(8))
    return node_host(tmp_path)


def by_name(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in spec["devices"]}


def nodes(device: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [(n["path"], n["major"], n["minor"]) for n in device["containerEdits"]["deviceNodes"]]


def findings(host: Host, options: GenerateOptions | None = None) -> dict[str, Finding]:
    def inventory() -> Inventory | NvmlError:
        try:
            return discover(host)
        except NvmlError as err:
            return err

    return {f.id: f for f in check_cdi(host, inventory, options or GenerateOptions(), runtimes=False)}


def test_eight_gpus_by_index_uuid_and_all(dgx: Host) -> None:
    inventory = discover(dgx)
    generated = generate(dgx, inventory, GenerateOptions())
    spec = generated.spec
    jsonschema.validate(spec, SCHEMA)
    assert cdispec.structure_problems(spec) == []
    assert spec["cdiVersion"] == "0.5.0"  # names that start with a digit need 0.5.0, nothing more
    assert spec["kind"] == "nvidia.com/gpu"
    devices = by_name(spec)
    uuids = [g.uuid for g in inventory.gpus]
    assert list(devices) == [n for g in inventory.gpus for n in (str(g.index), g.uuid)] + ["all"]
    for gpu in inventory.gpus:
        expected = [(f"/dev/nvidia{gpu.minor}", cdinode.NVIDIA_MAJOR, gpu.minor)]
        assert nodes(devices[str(gpu.index)]) == expected
        assert nodes(devices[str(gpu.uuid)]) == expected
    assert len(nodes(devices["all"])) == 8 and len(uuids) == 8
    common = spec["containerEdits"]
    assert [(n["path"], n["major"], n["minor"]) for n in common["deviceNodes"]] == [
        ("/dev/nvidiactl", 195, 255),
        ("/dev/nvidia-uvm", cdinode.UVM_MAJOR, 0),
        ("/dev/nvidia-uvm-tools", cdinode.UVM_MAJOR, 1),
    ]
    assert common["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    mounted = [m["containerPath"] for m in common["mounts"]]
    lib = cdinode.LIB_DIR
    for soname, file_pattern in cdinode.LIBRARIES:
        assert f"{lib}/{file_pattern.format(v=VERSION)}" in mounted
        if soname != file_pattern.format(v=VERSION):
            assert f"{lib}/{soname}" not in mounted  # the soname link is the ldcache hook's to make
    assert "/usr/bin/nvidia-smi" in mounted
    assert f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin" in mounted
    assert all(m["options"][:1] == ["ro"] for m in common["mounts"])
    assert common["hooks"] == [
        {
            "hookName": "createContainer",
            "path": "/usr/bin/nvidia-ctk",
            "args": ["nvidia-ctk", "hook", "update-ldcache", "--folder", lib],
        }
    ]
    assert generated.qualified_names[0] == "nvidia.com/gpu=0"
    assert generated.path == "/var/run/cdi/gpunode-nvidia.com-gpu.yaml"


def test_mig_devices_by_gpu_slot_and_uuid_with_their_capability_nodes(
    tmp_path: Path, fake_nvml: Callable[..., None]
) -> None:
    fake_nvml(profile="mig")
    # GPU 0 has MIG devices in GPU instances 7, 8 and 3 (compute instance 0 each).
    caps = {7: (66, 67), 8: (75, 76), 3: (30, 31)}
    cdinode.make_driver(
        tmp_path, VERSION, gpus=range(2), mig_caps=[m for pair in caps.values() for m in pair]
    )
    for gi, minors in caps.items():
        cdinode.mig_proc(tmp_path, 0, gi, 0, minors=minors)
    host = node_host(tmp_path)
    inventory = discover(host)
    generated = generate(host, inventory, GenerateOptions())
    jsonschema.validate(generated.spec, SCHEMA)
    assert generated.warnings == ()
    devices = by_name(generated.spec)
    migs = inventory.gpus[0].mig_devices
    assert [m.gpu_instance_id for m in migs] == [7, 8, 3]
    for mig in migs:
        gi_minor, ci_minor = caps[mig.gpu_instance_id or 0]
        expected = [
            ("/dev/nvidia0", 195, 0),
            (f"/dev/nvidia-caps/nvidia-cap{gi_minor}", cdinode.CAPS_MAJOR, gi_minor),
            (f"/dev/nvidia-caps/nvidia-cap{ci_minor}", cdinode.CAPS_MAJOR, ci_minor),
        ]
        assert nodes(devices[f"0:{mig.index}"]) == expected
        assert nodes(devices[mig.uuid]) == expected
    assert "1" in devices and "1:0" not in devices  # GPU 1 is MIG capable with MIG off
    assert generated.mig_devices == 3 and generated.gpus == 2


def test_libraries_come_from_the_linker_cache_and_from_beside_the_loaded_nvml(tmp_path: Path) -> None:
    host = node_host(tmp_path)
    cdinode.set_driver_version(tmp_path, VERSION)
    lib = tmp_path / cdinode.LIB_DIR.lstrip("/")
    # Not in the cache: found because it sits next to libnvidia-ml, which this process loaded.
    (lib / f"libnvidia-allocator.so.{VERSION}").write_bytes(b"x")
    # In the cache, but of another version (an old driver's leftover) or of another machine (32-bit).
    (lib / "libnvidia-old.so.535.104.05").write_bytes(b"x")
    (tmp_path / "usr/lib/i386-linux-gnu").mkdir(parents=True)
    (tmp_path / f"usr/lib/i386-linux-gnu/libcuda.so.{VERSION}").write_bytes(b"x")
    entries = [(s, f"{cdinode.LIB_DIR}/{s}") for s, _ in cdinode.LIBRARIES]
    entries.append(("libnvidia-old.so.1", f"{cdinode.LIB_DIR}/libnvidia-old.so.535.104.05"))
    entries.append(("libgone.so.1", f"{cdinode.LIB_DIR}/libgone.so.{VERSION}"))  # ldconfig not run since
    i386 = ("libcuda.so.1", f"/usr/lib/i386-linux-gnu/libcuda.so.{VERSION}", 0x0003)
    cdinode.write_ld_cache(tmp_path / "etc/ld.so.cache", entries, other=[i386])
    cache = read_ld_cache((tmp_path / "etc/ld.so.cache").read_bytes())
    assert ("libcuda.so.1", f"{cdinode.LIB_DIR}/libcuda.so.1") in [(n, p) for _, n, p in cache]
    assert (0x0003, *i386[:2]) in cache  # read, and left out below: not this machine's

    without_nvml = find_libraries(host, Roots(), VERSION)
    assert i386[1] not in without_nvml and all(p.startswith(cdinode.LIB_DIR) for p in without_nvml)
    assert f"{cdinode.LIB_DIR}/libnvidia-allocator.so.{VERSION}" in without_nvml  # beside a cached one
    names = {p.rsplit("/", 1)[1] for p in without_nvml}
    assert names == {f.format(v=VERSION) for _, f in cdinode.LIBRARIES} | {
        f"libnvidia-allocator.so.{VERSION}"
    }

    (tmp_path / "etc/ld.so.cache").write_bytes(b"not a cache")
    assert find_libraries(host, Roots(), VERSION) == ()
    beside = find_libraries(host, Roots(), VERSION, [f"{cdinode.LIB_DIR}/libnvidia-ml.so.{VERSION}"])
    assert len(beside) == len(cdinode.LIBRARIES) + 1


def test_a_driver_root_puts_the_root_in_front_of_host_paths_only(
    tmp_path: Path, fake_nvml: Callable[..., None]
) -> None:
    fake_nvml(profile="h100")
    driver = tmp_path / "run/nvidia/driver"
    cdinode.make_driver(driver, "560.35.03", gpus=[0])
    host = node_host(tmp_path)
    generated = generate(host, discover(host), GenerateOptions(driver_root="/run/nvidia/driver"))
    spec = generated.spec
    assert by_name(spec)["0"]["containerEdits"]["deviceNodes"][0] == {
        "path": "/dev/nvidia0",
        "hostPath": "/run/nvidia/driver/dev/nvidia0",
        "type": "c",
        "major": 195,
        "minor": 0,
    }
    cuda = [m for m in spec["containerEdits"]["mounts"] if "libcuda" in m["containerPath"]]
    assert cuda == [
        {
            "hostPath": f"/run/nvidia/driver{cdinode.LIB_DIR}/libcuda.so.560.35.03",
            "containerPath": f"{cdinode.LIB_DIR}/libcuda.so.560.35.03",
            "options": ["ro", "nosuid", "nodev", "bind"],
        }
    ]
    assert spec["cdiVersion"] == "0.5.0"


def test_a_missing_device_node_is_an_error_with_the_fix(
    tmp_path: Path, fake_nvml: Callable[..., None]
) -> None:
    fake_nvml(profile="pcie-4")
    cdinode.make_driver(tmp_path, VERSION, gpus=[0, 1, 2])  # /dev/nvidia3 is missing
    host = node_host(tmp_path)
    with pytest.raises(NotFound, match="/dev/nvidia3") as err:
        generate(host, discover(host), GenerateOptions())
    assert err.value.fix and "nvidia-modprobe -c 3" in err.value.fix


def test_no_libraries_of_the_driver_version_is_an_error(
    tmp_path: Path, fake_nvml: Callable[..., None]
) -> None:
    fake_nvml(profile="h100")  # driver 560.35.03; the files are 550's
    cdinode.make_driver(tmp_path, VERSION, gpus=[0])
    host = node_host(tmp_path)
    with pytest.raises(NotFound, match=r"lib\*\.so\.560\.35\.03") as err:
        generate(host, discover(host), GenerateOptions())
    assert err.value.fix and "ldconfig" in err.value.fix


def test_regenerating_an_unchanged_node_does_not_rewrite_the_file(dgx: Host) -> None:
    options = GenerateOptions()
    assert write_spec(dgx, generate(dgx, discover(dgx), options)) is True
    local = dgx.path(options.path)
    before = local.stat()
    os.utime(local, ns=(before.st_atime_ns, before.st_mtime_ns - 10**9))  # a second earlier
    marked = local.stat().st_mtime_ns
    assert write_spec(dgx, generate(dgx, discover(dgx), options)) is False
    assert local.stat().st_mtime_ns == marked and local.stat().st_ino == before.st_ino
    json_options = GenerateOptions(output="/etc/cdi/nvidia.json")
    assert write_spec(dgx, generate(dgx, discover(dgx), json_options)) is True
    assert json.loads(dgx.path("/etc/cdi/nvidia.json").read_text())["kind"] == "nvidia.com/gpu"


def test_check_passes_on_a_fresh_spec(dgx: Host) -> None:
    write_spec(dgx, generate(dgx, discover(dgx), GenerateOptions()))
    found = findings(dgx)
    statuses = {k: f.status for k, f in found.items()}
    assert statuses == {
        "cdi.spec": Status.OK,
        "cdi.current": Status.OK,
        "cdi.nodes": Status.OK,
        "cdi.paths": Status.OK,
        "cdi.conflicts": Status.OK,
        "cdi.envvar": Status.SKIP,
    }


def test_check_finds_a_missing_spec(dgx: Host) -> None:
    found = findings(dgx)
    assert found["cdi.spec"].status is Status.FAIL
    assert found["cdi.spec"].fix and "gpunode cdi generate" in found["cdi.spec"].fix


def test_check_finds_a_driver_upgrade(tmp_path: Path, fake_nvml: Callable[..., None]) -> None:
    config = tmp_path / "machine.ini"
    config.write_text(
        f"[system]\ndriver_version = {VERSION}\n[gpu]\nname = NVIDIA L4\n[gpu]\nname = NVIDIA L4\n"
    )
    fake_nvml(config=config)
    cdinode.make_driver(tmp_path / "root", VERSION, gpus=range(2))
    host = node_host(tmp_path / "root")
    write_spec(host, generate(host, discover(host), GenerateOptions()))
    # The package manager puts 560's libraries in place (550's go) and runs ldconfig; NVML says 560.
    cdinode.set_driver_version(tmp_path / "root", "560.35.03")
    config.write_text(config.read_text().replace(VERSION, "560.35.03"))
    fake_nvml(config=config)
    found = findings(host)
    assert found["cdi.current"].status is Status.FAIL
    assert f"made for driver {VERSION}; the driver now is 560.35.03" in (found["cdi.current"].detail or "")
    assert found["cdi.paths"].status is Status.FAIL
    assert f"libcuda.so.{VERSION}" in (found["cdi.paths"].detail or "")
    # Regenerating mends both, and a second run changes nothing.
    assert write_spec(host, generate(host, discover(host), GenerateOptions())) is True
    again = findings(host)
    assert again["cdi.current"].status is Status.OK and again["cdi.paths"].status is Status.OK


def test_check_finds_a_mig_change_and_renumbered_nodes(
    tmp_path: Path, fake_nvml: Callable[..., None]
) -> None:
    control = tmp_path / "control"
    control.write_text("")
    fake_nvml(profile="mig", control=control)
    root = tmp_path / "root"
    caps = {7: (66, 67), 8: (75, 76), 3: (30, 31)}
    cdinode.make_driver(root, VERSION, gpus=range(2), mig_caps=[m for pair in caps.values() for m in pair])
    for gi, minors in caps.items():
        cdinode.mig_proc(root, 0, gi, 0, minors=minors)
    host = node_host(root)
    write_spec(host, generate(host, discover(host), GenerateOptions()))
    fakenvml.inject(control, "mig 0 0")  # MIG off on GPU 0: its three MIG devices are gone
    found = findings(host)
    assert found["cdi.current"].status is Status.FAIL
    assert "devices in the spec the node no longer has: 0:0, MIG-" in (found["cdi.current"].detail or "")
    assert found["cdi.nodes"].status is Status.OK
    major = cdinode.NVIDIA_MAJOR
    cdinode.mknod(root / "dev/nvidia1", major, 9)  # and a node that is not what the spec recorded
    found = findings(host)
    # Not the node of GPU 1 (minor 1): no spec is made from it, and the spec's record of it is wrong too.
    assert found["cdi.current"].status is Status.FAIL
    assert f"/dev/nvidia1 is the device {major}:9; it must be {major}:1" in (
        found["cdi.current"].detail or ""
    )
    assert found["cdi.nodes"].status is Status.FAIL
    assert f"/dev/nvidia1 is the device {major}:9; it must be {major}:1" in (found["cdi.nodes"].detail or "")


def _other_spec(host: Host, path: str, names: list[str]) -> None:
    doc = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}} for n in names
        ],
    }
    host.write_file(path, json.dumps(doc), make_parents=True)


def test_conflicting_and_shadowed_specs(dgx: Host) -> None:
    write_spec(dgx, generate(dgx, discover(dgx), GenerateOptions()))
    # An older nvidia-ctk output in /etc/cdi: gpunode's (in /var/run/cdi) wins; a warning to tidy up.
    _other_spec(dgx, "/etc/cdi/nvidia.yaml", ["0", "all"])
    found = findings(dgx)
    assert found["cdi.conflicts"].status is Status.WARN
    assert found["cdi.conflicts"].fix and "/etc/cdi/nvidia.yaml" in found["cdi.conflicts"].fix
    listed = {(d.name, d.path): d.state for d in list_devices(read_specs(dgx))}
    assert listed[("nvidia.com/gpu=0", "/etc/cdi/nvidia.yaml")] == "shadowed"
    assert listed[("nvidia.com/gpu=0", default_output())] == "ok"
    # The same device twice in /var/run/cdi: the runtime drops it.
    _other_spec(dgx, "/var/run/cdi/nvidia.json", ["0"])
    found = findings(dgx)
    assert found["cdi.conflicts"].status is Status.FAIL
    assert "nvidia.com/gpu=0: gpunode's definition is conflict" in (found["cdi.conflicts"].detail or "")
    listed = {(d.name, d.path): d.state for d in list_devices(read_specs(dgx))}
    assert listed[("nvidia.com/gpu=0", "/var/run/cdi/nvidia.json")] == "conflict"
    assert listed[("nvidia.com/gpu=1", default_output())] == "ok"
    # A file the runtimes cannot read is reported, not trusted.
    dgx.write_file("/var/run/cdi/broken.yaml", "kind: [", make_parents=True)
    assert any(f.path == "/var/run/cdi/broken.yaml" and f.problems for f in read_specs(dgx))


def test_envvar_exposure_is_reported_until_closed(tmp_path: Path) -> None:
    host = node_host(tmp_path)
    config = "/etc/nvidia-container-runtime/config.toml"
    host.write_file(
        config, '#comment\n[nvidia-container-cli]\nldconfig = "@/sbin/ldconfig"\n', make_parents=True
    )
    assert check_envvar_exposure(host).status is Status.WARN
    plan = plan_install(host, GenerateOptions(), "/usr/local/bin/gpunode", restrict_envvar=True)
    changed = {c.path: c for c in plan.files if c.changed}
    new = changed[config].content
    assert new.startswith("#comment\naccept-nvidia-visible-devices-envvar-when-unprivileged = false\n")
    host.write_file(config, new)
    assert check_envvar_exposure(host).status is Status.OK
    again = plan_install(host, GenerateOptions(), "/usr/local/bin/gpunode", restrict_envvar=True)
    assert config not in {c.path for c in again.files}


def test_install_units_run_generate_at_boot_and_when_the_linker_cache_changes(tmp_path: Path) -> None:
    host = node_host(tmp_path)
    options = GenerateOptions(driver_root="/run/nvidia/driver", output="/etc/cdi/gpu.json")
    plan = plan_install(host, options, "/usr/local/bin/gpunode", restrict_envvar=False)
    units = {c.path.rsplit("/", 1)[1]: c.content for c in plan.files}
    service, path_unit = units["gpunode-cdi.service"], units["gpunode-cdi.path"]
    assert (
        "ExecStart=/usr/local/bin/gpunode cdi generate --driver-root /run/nvidia/driver "
        "--output /etc/cdi/gpu.json\n" in service
    )
    assert "Type=oneshot" in service and "Before=containerd.service" in service
    assert "PathChanged=/run/nvidia/driver/etc/ld.so.cache\nUnit=gpunode-cdi.service\n" in path_unit
    # No systemd running under this root: the units are enabled by their links, for the next boot; no
    # systemctl is asked (`systemctl --root=` would be this machine's program, its version and presets).
    assert plan.commands == () and plan.next_steps == ()
    units_dir = "/etc/systemd/system"
    assert [(link.path, link.target, link.action) for link in plan.links] == [
        (f"{units_dir}/multi-user.target.wants/{name}", f"{units_dir}/{name}", "create")
        for name in ("gpunode-cdi.service", "gpunode-cdi.path")
    ]
    assert any("systemd is not running here" in note for note in plan.notes)
