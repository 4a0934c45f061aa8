"""`--simulate NAME` beyond `plugin run`: doctor, `cdi generate --dry-run` and `up --dry-run` read a built-in
simulated node (gpunode/plugin/simulate.py) instead of NVML, on a host without a GPU, and write nothing.

The host is a node's files under a temp root (tests/conftest.py) with every trace of a driver removed, and
NVML's discovery is replaced by one that fails the test: a simulated run must never ask NVML."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpunode import schemas
from gpunode.cdi import spec as cdispec
from gpunode.cdi.generate import GenerateOptions, generate
from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from gpunode.nvml.discovery import discover
from tests import cdinode
from tests.conftest import Node

CDI_SCHEMA = json.loads((Path(__file__).parent.parent / "fixtures/cdi/schema.json").read_text())

TAG = "(simulated: dgx-a100)"


@pytest.fixture
def gpu_less(node: Node, monkeypatch: pytest.MonkeyPatch) -> Node:
    """The healthy node's files without a driver, a device node or a GPU; NVML must not be asked."""
    for path in ("/sys/module/nvidia", "/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        node.remove(path)
    for i in range(8):
        node.remove(f"/dev/nvidia{i}")

    def no_nvml(*args: object, **kwargs: object) -> None:
        raise AssertionError("a simulated run asked NVML")

    monkeypatch.setattr("gpunode.nvml.discovery.discover", no_nvml)
    monkeypatch.setattr("gpunode.nvml.discover", no_nvml)
    return node


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def doctor_json(node: Node, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["doctor", "--json", *args], host=node.host())
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, schemas.load("doctor"))
    return code, doc


def by_id(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in report["checks"]}


# -- doctor -------------------------------------------------------------------------------------------------


def test_doctor_reads_the_simulated_gpus_and_the_hosts_own_runtime(
    gpu_less: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    before = files_under(gpu_less.root)
    code, report = doctor_json(gpu_less, capsys, "--simulate", "dgx-a100")
    checks = by_id(report)
    assert report["simulated"] == "dgx-a100"
    assert checks["driver.module"]["status"] == "ok"
    assert checks["driver.module"]["summary"] == f"nvidia kernel module loaded (version 550.54.15) {TAG}"
    assert checks["nvml.init"]["summary"] == f"NVML initialised: driver 550.54.15, CUDA 12.4 {TAG}"
    assert checks["gpu.count"]["summary"] == f"8 GPUs found {TAG}"
    assert checks["gpu.7"]["summary"] == f"GPU 7: NVIDIA A100-SXM4-80GB, 80 GiB, MIG off {TAG}"
    # The simulated node's /dev/nvidia* are not on this host: not looked for, and named as a real node's.
    assert checks["devices.nodes"]["status"] == "skip" and checks["devices.nodes"]["summary"].endswith(TAG)
    assert "/dev/nvidia7" in checks["devices.nodes"]["detail"]
    simulated = {c["id"] for c in report["checks"] if TAG in c["summary"]}
    nvml = {"driver.module", "nvml.init", "devices.nodes", "gpu.count", "gpu.persistence"}
    # node.capacity: the real node's advertised GPUs are not compared with simulated ones (skipped, said why).
    assert simulated == nvml | {f"gpu.{i}" for i in range(8)} | {"node.capacity"}
    # The host's own checks read the host as they are: its containerd, kubelet and plugin.
    assert checks["runtime.containerd"]["status"] == "ok"
    assert checks["kubelet"]["status"] == "ok" and checks["plugin"]["status"] == "ok"
    assert code == ExitCode.OK and report["healthy"] is True
    assert files_under(gpu_less.root) == before


def test_doctor_simulated_node_without_a_driver(gpu_less: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = doctor_json(gpu_less, capsys, "--simulate", "no-driver")
    checks = by_id(report)
    assert code == ExitCode.UNHEALTHY
    assert checks["driver.module"]["status"] == "fail"
    assert checks["driver.module"]["summary"].endswith("(simulated: no-driver)")
    assert checks["nvml.init"]["status"] == "fail" and "Driver Not Loaded" in checks["nvml.init"]["detail"]
    assert checks["devices.nodes"]["status"] == "skip"


def test_doctor_real_run_says_nothing_is_simulated(
    node: Node, fake_nvml: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    _, report = doctor_json(node, capsys)
    assert report["simulated"] is None
    assert not any("simulated" in c["summary"] for c in report["checks"])


def test_doctor_does_not_compare_real_capacity_or_cdi_spec_with_simulated_gpus(
    gpu_less: Node, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kubeconfig would send doctor to the API server; with simulated GPUs it must not even look.
    def no_api(*args: object, **kwargs: object) -> None:
        raise AssertionError("doctor --simulate read the node's capacity")

    monkeypatch.setattr("gpunode.kube.credentials.resolve_credentials", no_api)
    gpu_less.file("/var/run/cdi/gpunode-nvidia.com-gpu.yaml", "cdiVersion: 0.5.0\n")
    _, report = doctor_json(gpu_less, capsys, "--simulate", "dgx-a100")
    checks = by_id(report)
    assert checks["node.capacity"]["status"] == "skip" and checks["node.capacity"]["summary"].endswith(TAG)
    assert checks["cdi"]["status"] == "skip" and checks["cdi"]["summary"].endswith(TAG)
    assert "gpunode cdi generate --simulate dgx-a100 --dry-run" in checks["cdi"]["detail"]


def test_doctor_unknown_name_is_a_usage_error(gpu_less: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--simulate", "dgx-z"], host=gpu_less.host())
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE
    assert "unknown simulation profile 'dgx-z'" in err and "dgx-a100" in err and "fix:" in err


def test_doctor_simulated_findings_are_never_published_as_metrics(
    gpu_less: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prom = tmp_path / "gpunode_doctor.prom"
    code = main(["doctor", "--simulate", "dgx-a100", "--prometheus", str(prom)], host=gpu_less.host())
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE and "drop --prometheus" in err
    assert not prom.exists()


# -- cdi generate -------------------------------------------------------------------------------------------


def test_cdi_generate_simulated_spec_is_printed_never_written(
    gpu_less: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    before = files_under(gpu_less.root)
    code = main(["cdi", "generate", "--simulate", "mig", "--dry-run", "--json"], host=gpu_less.host())
    doc = json.loads(capsys.readouterr().out)
    assert code == ExitCode.OK
    jsonschema.validate(doc, schemas.load("cdi-generate"))
    jsonschema.validate(doc["spec"], CDI_SCHEMA)
    assert cdispec.structure_problems(doc["spec"]) == []
    assert doc["simulated"] == "mig" and doc["changed"] is False and doc["dry_run"] is True
    assert (doc["gpus"], doc["mig_devices"], doc["driver_version"]) == (2, 3, "550.54.15")
    devices = {d["name"]: d["containerEdits"]["deviceNodes"] for d in doc["spec"]["devices"]}
    assert set(devices) == {"0", "1", "0:0", "0:1", "0:2", "all"} | {
        n for n in devices if n.startswith(("GPU-", "MIG-"))
    }
    # A real node's numbers: GPU 0 is 195:0; its MIG slot 0 (GPU instance 7, compute instance 0) gets the
    # nvidia-caps minors the driver gives gpu0/gi7/access and gpu0/gi7/ci0/access (3 + 7 * 9, then + 1).
    assert [(n["path"], n["major"], n["minor"]) for n in devices["0:0"]] == [
        ("/dev/nvidia0", 195, 0),
        ("/dev/nvidia-caps/nvidia-cap66", 511, 66),
        ("/dev/nvidia-caps/nvidia-cap67", 511, 67),
    ]
    mounts = [m["containerPath"] for m in doc["spec"]["containerEdits"]["mounts"]]
    assert any(m.endswith("/libcuda.so.550.54.15") for m in mounts)
    assert any(m.endswith("/libnvidia-ml.so.550.54.15") for m in mounts)
    # None of it is on this host, and nothing was looked for or written.
    assert not (gpu_less.root / "dev/nvidia0").exists()
    assert files_under(gpu_less.root) == before


def test_cdi_generate_simulated_header_says_so(gpu_less: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["cdi", "generate", "--simulate", "dgx-a100", "--dry-run"], host=gpu_less.host())
    out = capsys.readouterr().out
    assert code == ExitCode.OK
    header = [line for line in out.splitlines() if line.startswith("#")]
    assert "`gpunode cdi generate --simulate dgx-a100`" in header[0] and "8 GPUs" in header[0]
    assert "a real node of this shape has, none checked here" in "\n".join(header)
    spec = cdispec.parse(out, "stdout")
    assert [d["name"] for d in spec["devices"]][:2] == ["0", spec["devices"][1]["name"]]
    assert len(spec["devices"]) == 8 * 2 + 1


def test_cdi_generate_simulated_matches_the_real_spec_of_the_same_node(
    tmp_path: Path, fake_nvml: Any, gpu_less: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same machine through the fake NVML library on a node with its driver's files: the same device
    # names and GPU nodes (the simulated inventory is discovery's, tests/unit/test_plugin_simulate.py).
    fake_nvml("dgx-a100")
    real_root = tmp_path / "real"
    cdinode.make_driver(real_root, "550.54.15", gpus=range(8))
    real = generate(
        Host(root=real_root, runner=ScriptedRunner(), env={"PATH": "/usr/bin"}),
        discover(Host(root=real_root)),
        GenerateOptions(),
    )
    code = main(["cdi", "generate", "--simulate", "dgx-a100", "--dry-run", "--json"], host=gpu_less.host())
    simulated = json.loads(capsys.readouterr().out)["spec"]
    assert code == ExitCode.OK
    assert [d["name"] for d in simulated["devices"]] == real.device_names

    def gpu_nodes(spec: dict[str, Any]) -> list[tuple[str, int]]:
        return [(n["path"], n["minor"]) for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]

    assert gpu_nodes(simulated) == gpu_nodes(real.spec)


def test_cdi_generate_simulate_without_dry_run_is_refused(
    gpu_less: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    before = files_under(gpu_less.root)
    code = main(["cdi", "generate", "--simulate", "dgx-a100"], host=gpu_less.host())
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE
    assert "never written" in err and "fix: add --dry-run" in err
    assert files_under(gpu_less.root) == before
    code = main(["cdi", "generate", "--simulate", "dgx-z", "--dry-run"], host=gpu_less.host())
    assert code == ExitCode.USAGE and "unknown simulation profile 'dgx-z'" in capsys.readouterr().err


# -- up --dry-run -------------------------------------------------------------------------------------------


def test_up_dry_run_plans_for_the_simulated_node(gpu_less: Node, capsys: pytest.CaptureFixture[str]) -> None:
    gpu_less.file("/var/lib/dpkg/status")  # apt's database, so the toolkit step can be planned
    before = files_under(gpu_less.root)
    argv = ["up", "--simulate", "dgx-a100", "--dry-run", "--cdi", "--no-labels", "--json"]
    code = main(argv, host=gpu_less.host())
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, schemas.load("up"))
    steps = {s["name"]: s for s in doc["steps"]}
    # Preflight passes on the simulated driver and GPUs (this host has neither) and the host's kubelet.
    assert steps["preflight"]["status"] == "done", steps["preflight"]
    assert "simulated: dgx-a100" in steps["preflight"]["summary"]
    # The CDI step plans the simulated node's spec: its 8 GPUs, no device node looked for on this host.
    assert steps["cdi"]["status"] == "to do"
    assert "write /var/run/cdi/gpunode-nvidia.com-gpu.yaml (17 devices)" in steps["cdi"]["details"]
    assert code == ExitCode.OK and doc["changed"] is False and doc["dry_run"] is True
    assert files_under(gpu_less.root) == before


def test_up_simulate_needs_dry_run(gpu_less: Node, capsys: pytest.CaptureFixture[str]) -> None:
    before = files_under(gpu_less.root)
    code = main(["up", "--simulate", "dgx-a100", "--yes"], host=gpu_less.host())
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE and "fix: add --dry-run" in err
    assert files_under(gpu_less.root) == before


# -- the README's "Try it without a GPU" -------------------------------------------------------------------


def readme_try_commands() -> list[list[str]]:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### Try it without a GPU", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.splitlines():
        for part in line.split("#", 1)[0].split("&&"):
            words = shlex.split(part)
            if words and words[0] == "gpunode":
                commands.append(words[1:])
    return commands


def test_readme_try_it_without_a_gpu_commands_work(
    gpu_less: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = readme_try_commands()
    assert [c[:2] for c in commands] == [
        ["doctor", "--simulate"],
        ["cdi", "generate"],
        ["up", "--simulate"],
        ["plugin", "run"],
    ]
    gpu_less.file("/var/lib/dpkg/status")  # a Debian machine's apt database: the toolkit step is planned
    before = files_under(gpu_less.root)
    for argv in commands[:3]:  # plugin run serves until stopped: tests/integration runs it with --simulate
        code = main(argv, host=gpu_less.host())
        out = capsys.readouterr().out
        assert code in (ExitCode.OK, ExitCode.UNHEALTHY), (argv, code)
        assert "dgx-a100" in out or "simulated" in out, argv
    assert files_under(gpu_less.root) == before
    # The plugin's command line is one its parser takes, with the simulated node.
    from gpunode.plugin.argv import parse

    parsed = parse(commands[3][2:])
    assert parsed is not None and parsed.simulate == "dgx-a100"
    assert parsed.status_file == "/tmp/dp-status.json"


def test_the_shell_completes_the_names_for_each_command() -> None:
    from tests.cli.test_cli_surface import completions

    for command in (["doctor"], ["cdi", "generate"], ["up"]):
        assert completions(["gpunode", *command, "--simulate", "p"]) == ["pcie-4", "pairs-4"], command
