"""`cdi generate` and `cdi check` trust no device node blindly: a node that is a link to another node, or has
another major or minor than the driver gives it, would put another GPU (or another device) into every pod
given its name. Each node is checked against /proc/devices (the driver's majors) and NVML (the GPU's minor);
a wrong one is refused, naming the node, what it is, what it must be, and the fix."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.cdi.check import check_cdi
from gpunode.cdi.generate import GenerateOptions, default_output, generate, write_spec
from gpunode.cli.main import main
from gpunode.doctor.model import Finding, Status
from gpunode.errors import ExitCode, NotFound, NvmlError
from gpunode.host import Host, ScriptedRunner
from gpunode.nvml import discover
from gpunode.nvml.model import Inventory
from tests import cdinode

VERSION = "550.54.15"
NV, UVM, CAPS = cdinode.NVIDIA_MAJOR, cdinode.UVM_MAJOR, cdinode.CAPS_MAJOR


def node_host(root: Path) -> Host:
    return Host(root=root, runner=ScriptedRunner(), env={"PATH": "/usr/bin:/usr/sbin"})


@pytest.fixture
def pcie(tmp_path: Path, fake_nvml: Callable[..., None]) -> Host:
    """Four GPUs, minors 0-3, their nodes and the driver's /proc/devices."""
    fake_nvml(profile="pcie-4")
    cdinode.make_driver(tmp_path, VERSION, gpus=range(4))
    return node_host(tmp_path)


def refused(host: Host) -> NotFound:
    with pytest.raises(NotFound) as err:
        generate(host, discover(host), GenerateOptions())
    assert err.value.fix and "nvidia-modprobe" in err.value.fix and "udev" in err.value.fix
    return err.value


def test_true_nodes_are_accepted_with_their_numbers(pcie: Host) -> None:
    generated = generate(pcie, discover(pcie), GenerateOptions())
    assert generated.warnings == ()
    nodes = {n["path"]: (n["major"], n["minor"]) for n in generated.spec["containerEdits"]["deviceNodes"]}
    assert nodes == {
        "/dev/nvidiactl": (NV, 255),
        "/dev/nvidia-uvm": (UVM, 0),
        "/dev/nvidia-uvm-tools": (UVM, 1),
    }


def test_a_gpu_node_that_links_to_another_gpu_is_refused(pcie: Host) -> None:
    node = pcie.root / "dev/nvidia0"
    node.unlink()
    node.symlink_to("nvidia1")  # followed, it would record 195:1 for GPU 0: a pod asking for 0 gets GPU 1
    err = refused(pcie)
    assert err.message == (
        "GPU 0's device node /dev/nvidia0 is a symbolic link to nvidia1; a device node must be the node "
        "itself"
    )


@pytest.mark.parametrize(
    ("numbers", "shown"),
    [((NV, 1), f"{NV}:1"), ((10, 0), "10:0"), ((UVM, 0), f"{UVM}:0")],
    ids=["another-gpus-minor", "another-major", "uvms-major"],
)
def test_a_gpu_node_with_another_major_or_minor_is_refused(
    pcie: Host, numbers: tuple[int, int], shown: str
) -> None:
    cdinode.mknod(pcie.root / "dev/nvidia0", *numbers)
    err = refused(pcie)
    assert err.message == (
        f"GPU 0's device node /dev/nvidia0 is the device {shown}; it must be {NV}:0 (nvidia's major in "
        "/proc/devices, minor 0)"
    )
    assert exit_of(pcie, ["cdi", "generate"]) == ExitCode.NOT_FOUND
    assert not pcie.path(default_output()).exists()  # nothing written


def test_a_node_that_is_not_a_character_device_is_refused(pcie: Host) -> None:
    node = pcie.root / "dev/nvidia2"
    node.unlink()
    node.write_text("")
    assert "/dev/nvidia2 is not a character device" in refused(pcie).message


@pytest.mark.parametrize(
    ("name", "numbers", "want"),
    [
        ("nvidiactl", (NV, 0), f"{NV}:255"),
        ("nvidia-uvm", (NV, 0), f"{UVM}:0"),
        ("nvidia-uvm-tools", (UVM, 0), f"{UVM}:1"),
        ("nvidia-modeset", (NV, 255), f"{NV}:254"),
    ],
)
def test_control_nodes_must_be_the_drivers(
    pcie: Host, name: str, numbers: tuple[int, int], want: str
) -> None:
    cdinode.mknod(pcie.root / f"dev/{name}", *numbers)
    message = refused(pcie).message
    assert message.startswith(f"/dev/{name} is the device {numbers[0]}:{numbers[1]}; it must be {want}")


def test_a_control_node_that_is_a_link_is_refused(pcie: Host) -> None:
    (pcie.root / "dev/nvidiactl").unlink()
    (pcie.root / "dev/nvidiactl").symlink_to("nvidia0")
    assert "/dev/nvidiactl is a symbolic link to nvidia0" in refused(pcie).message


def test_mig_capability_nodes_must_have_nvidia_caps_major(
    tmp_path: Path, fake_nvml: Callable[..., None]
) -> None:
    fake_nvml(profile="mig")
    caps = {7: (66, 67), 8: (75, 76), 3: (30, 31)}
    cdinode.make_driver(
        tmp_path, VERSION, gpus=range(2), mig_caps=[m for pair in caps.values() for m in pair]
    )
    for gi, minors in caps.items():
        cdinode.mig_proc(tmp_path, 0, gi, 0, minors=minors)
    host = node_host(tmp_path)
    generate(host, discover(host), GenerateOptions())  # true nodes: accepted
    cdinode.mknod(tmp_path / "dev/nvidia-caps/nvidia-cap66", NV, 66)
    message = refused(host).message
    assert "capability node /dev/nvidia-caps/nvidia-cap66 is the device" in message
    assert f"it must be {CAPS}:66 (nvidia-caps's major" in message


def test_the_nvidia_name_of_older_and_newer_drivers(pcie: Host) -> None:
    """/proc/devices calls the driver nvidia-frontend (older drivers) or nvidia (newer ones)."""
    cdinode.write_proc_devices(pcie.root, {"nvidia-frontend": 0, "nvidia": NV})
    generate(pcie, discover(pcie), GenerateOptions())
    cdinode.mknod(pcie.root / "dev/nvidia3", 10, 3)
    assert "it must be" in refused(pcie).message


def test_without_the_drivers_majors_the_minors_are_still_checked(pcie: Host) -> None:
    (pcie.root / "proc/devices").unlink()
    cdinode.mknod(pcie.root / "dev/nvidia1", 10, 1)  # another major: cannot be told without /proc/devices
    generated = generate(pcie, discover(pcie), GenerateOptions())
    assert any("/proc/devices lists no nvidia driver" in w for w in generated.warnings)
    cdinode.mknod(pcie.root / "dev/nvidia1", 10, 2)
    assert "it must be <major of nvidia>:1" in refused(pcie).message


def exit_of(host: Host, argv: list[str]) -> int:
    return main(argv, host=host)


def findings(host: Host) -> dict[str, Finding]:
    def inventory() -> Inventory | NvmlError:
        return discover(host)

    return {f.id: f for f in check_cdi(host, inventory, GenerateOptions(), runtimes=False)}


def test_check_finds_a_node_replaced_after_the_spec_was_written(pcie: Host) -> None:
    write_spec(pcie, generate(pcie, discover(pcie), GenerateOptions()))
    assert findings(pcie)["cdi.nodes"].status is Status.OK
    (pcie.root / "dev/nvidia1").unlink()
    (pcie.root / "dev/nvidia1").symlink_to("nvidia0")  # numbers as recorded for... no GPU: still wrong
    cdinode.mknod(pcie.root / "dev/nvidia-uvm", 10, 0)
    found = findings(pcie)
    nodes = found["cdi.nodes"]
    assert nodes.status is Status.FAIL
    assert "/dev/nvidia1 is a symbolic link to nvidia0" in (nodes.detail or "")
    assert f"/dev/nvidia-uvm is the device 10:0; it must be {UVM}:0" in (nodes.detail or "")
    assert nodes.fix and "nvidia-modprobe" in nodes.fix and "gpunode cdi generate" in nodes.fix
    # Regenerating is refused too, and says why: the spec cannot be made true from these nodes.
    assert found["cdi.current"].status is Status.FAIL
    assert "symbolic link" in (found["cdi.current"].detail or "")


def test_the_json_error_document_names_the_node(pcie: Host, capsys: pytest.CaptureFixture[str]) -> None:
    cdinode.mknod(pcie.root / "dev/nvidia0", NV, 3)
    assert exit_of(pcie, ["cdi", "generate", "--json"]) == ExitCode.NOT_FOUND
    doc = json.loads(capsys.readouterr().out)
    assert "/dev/nvidia0 is the device" in json.dumps(doc)
