"""`gpunode doctor` end to end: the CLI, a node's files under a temp root, the real pynvml on the fake
libnvidia-ml.so.1, and scripted answers only for commands (systemctl, --version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpunode.cli.main import main
from gpunode.doctor import run_doctor
from gpunode.errors import ExitCode
from tests import fakenvml
from tests.conftest import Node

REPO = Path(__file__).resolve().parents[2]


def doctor_json(node: Node, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = main(["doctor", "--json"], host=node.host())
    out = capsys.readouterr().out
    return code, json.loads(out)


def by_id(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in report["checks"]}


def test_healthy_eight_gpu_node(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("dgx-a100")
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.OK and report["healthy"] is True
    assert [c["status"] for c in report["checks"]].count("fail") == 0
    assert checks["os.distribution"]["summary"] == "Ubuntu 22.04.4 LTS"
    assert checks["driver.module"]["summary"] == "nvidia kernel module loaded (version 550.54.15)"
    assert checks["nvml.init"]["summary"] == "NVML initialised: driver 550.54.15, CUDA 12.4"
    assert checks["gpu.count"]["summary"] == "8 GPUs found"
    assert checks["gpu.7"]["summary"] == "GPU 7: NVIDIA A100-SXM4-80GB, 80 GiB, MIG off"
    assert "UUID GPU-" in checks["gpu.7"]["detail"]
    assert checks["devices.nodes"]["status"] == "ok"
    assert checks["toolkit"]["summary"] == (
        "nvidia-container-toolkit installed: nvidia-ctk 1.16.2, nvidia-container-runtime 1.16.2"
    )
    assert checks["runtime.containerd"]["status"] == "ok"
    assert "nvidia runtime 'nvidia' configured and is the default" in checks["runtime.containerd"]["summary"]
    assert checks["runtime.docker"]["status"] == "skip"
    assert checks["kubelet"]["status"] == "ok" and checks["kubelet.socket"]["status"] == "ok"
    assert checks["plugin"]["status"] == "ok"


def test_json_schema_is_stable(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    _, report = doctor_json(node, capsys)
    # The v1 keys stay; the common envelope (changed, dry_run, error) and `simulated` were added beside them.
    envelope = {"schema", "changed", "dry_run", "error"}
    assert set(report) == envelope | {"healthy", "counts", "checks", "simulated"}
    assert report["changed"] is False and report["error"] is None
    assert report["schema"] == "gpunode.doctor/v1"
    assert set(report["counts"]) == {"ok", "warn", "fail", "skip"}
    assert sum(report["counts"].values()) == len(report["checks"])
    for check in report["checks"]:
        assert set(check) == {"id", "status", "summary", "detail", "fix"}
        assert check["status"] in ("ok", "warn", "fail", "skip")
        assert isinstance(check["summary"], str) and check["summary"]
        if check["status"] in ("warn", "fail"):
            assert check["fix"], f"{check['id']} has no fix"
    assert len({c["id"] for c in report["checks"]}) == len(report["checks"])


def test_no_driver(node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]) -> None:
    fake_nvml("no-driver")
    node.remove("/sys/module/nvidia")
    node.remove("/proc/driver/nvidia")
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.UNHEALTHY and report["healthy"] is False
    assert checks["driver.module"]["status"] == "fail"
    assert "modprobe nvidia" in checks["driver.module"]["fix"]
    assert checks["nvml.init"]["status"] == "fail" and "Driver Not Loaded" in checks["nvml.init"]["detail"]
    assert checks["gpu.count"]["status"] == "skip"
    assert checks["devices.nodes"]["status"] == "skip"


def test_driver_loaded_but_nvml_init_fails(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("init-fail")
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.UNHEALTHY
    assert checks["driver.module"]["status"] == "ok"
    assert checks["nvml.init"]["status"] == "fail"
    assert "version mismatch" in checks["nvml.init"]["detail"] and "reboot" in checks["nvml.init"]["fix"]


def test_mig_node(node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]) -> None:
    fake_nvml("mig")
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.OK
    assert checks["gpu.0"]["summary"] == "GPU 0: NVIDIA A100-SXM4-40GB, 40 GiB, MIG on"
    assert checks["gpu.0"]["detail"].count("MIG 1g.5gb: MIG-") == 2
    assert checks["gpu.1"]["summary"].endswith("MIG off")


def test_lost_gpu_and_missing_device_node(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("lost-gpu")
    node.remove("/dev/nvidia-uvm")
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.UNHEALTHY
    assert checks["gpu.2"]["status"] == "fail" and "fallen off the bus" in checks["gpu.2"]["summary"]
    assert checks["devices.nodes"]["summary"] == "missing device node: /dev/nvidia-uvm"
    assert "nvidia-modprobe" in checks["devices.nodes"]["fix"]


def test_gpu_health_problems_from_nvml(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "nvml.conf"
    config.write_text(
        "[gpu]\nname = NVIDIA A10\nmemory_total = 24 GiB\npersistence = 0\nretired_pages_pending = 1\n"
        "ecc_uncorrected = 2\n"
        "[gpu]\nname = NVIDIA A10\nmemory_total = 24 GiB\nremapped_failure = 1\n"
    )
    fake_nvml(config=config)
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.UNHEALTHY
    assert checks["gpu.0"]["status"] == "warn"
    assert "2 uncorrectable ECC errors" in checks["gpu.0"]["summary"]
    assert "page retirement / row remapping is pending" in checks["gpu.0"]["summary"]
    assert checks["gpu.1"]["status"] == "fail" and "RMA" in checks["gpu.1"]["fix"]
    assert (
        checks["gpu.persistence"]["status"] == "warn"
        and "nvidia-persistenced" in checks["gpu.persistence"]["fix"]
    )


def test_old_driver_still_diagnoses(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("old-driver")
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.OK
    assert checks["nvml.init"]["status"] == "ok"
    assert "persistence mode: not supported" in checks["nvml.init"]["detail"]
    assert "gpu.persistence" not in checks  # unknown, so neither ok nor a warning


def test_runtime_not_configured(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.containerd_config("default-v2.toml")  # `containerd config default`: runc only
    code, report = doctor_json(node, capsys)
    check = by_id(report)["runtime.containerd"]
    assert code == ExitCode.UNHEALTHY
    assert check["status"] == "fail"
    assert (
        check["summary"]
        == "containerd, service active: no nvidia runtime configured (kubelet uses this runtime)"
    )
    assert check["fix"] == "`gpunode configure-runtime containerd` (`--dry-run` first shows the diff)"


def test_runtime_configured_but_not_default(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.file(
        "/etc/docker/daemon.json", (Path(__file__).parents[1] / "fixtures/docker/configured.json").read_text()
    )
    node.program("dockerd")
    node.services["docker.service"] = "active"
    node.file(
        "/var/lib/kubelet/kubeadm-flags.env",
        'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///run/containerd/containerd.sock"\n',
    )
    code, report = doctor_json(node, capsys)
    docker = by_id(report)["runtime.docker"]
    assert code == ExitCode.OK  # docker is not what kubelet uses: a warning, not a failure
    assert docker["status"] == "warn"
    assert "but the default is 'runc'" in docker["summary"]
    assert "runtimeClassName: nvidia" in docker["fix"]


def test_malformed_runtime_config_is_a_finding(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.containerd_config("malformed.toml")
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.UNHEALTHY
    assert checks["runtime.containerd"]["status"] == "fail"
    assert "/etc/containerd/config.toml" in checks["runtime.containerd"]["detail"]
    assert "line" in checks["runtime.containerd"]["detail"]
    assert checks["kubelet"]["status"] == "ok"  # later checks still ran


def test_no_toolkit(node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]) -> None:
    fake_nvml("pcie-4")
    node.remove("/usr/bin/nvidia-ctk")
    node.remove("/usr/bin/nvidia-container-runtime")
    _, report = doctor_json(node, capsys)
    check = by_id(report)["toolkit"]
    assert check["status"] == "fail" and "nvidia-ctk, nvidia-container-runtime not found" in check["summary"]


def test_kubelet_absent(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.remove("/usr/bin/kubelet")
    node.remove("/var/lib/kubelet")
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.OK
    assert (
        checks["kubelet"]["status"] == "warn" and "not a Kubernetes node yet" in checks["kubelet"]["summary"]
    )
    assert "kubelet.socket" not in checks
    assert checks["plugin"]["status"] == "skip"


def test_kubelet_without_registration_socket_and_no_plugin(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.remove("/var/lib/kubelet/device-plugins/kubelet.sock")
    node.remove("/var/lib/kubelet/device-plugins/gpunode-nvidia.com-gpu.sock")
    node.services["kubelet.service"] = "failed"
    node.services["gpunode-device-plugin.service"] = "inactive"
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert code == ExitCode.UNHEALTHY
    assert (
        checks["kubelet"]["status"] == "fail" and checks["kubelet"]["summary"] == "kubelet service is failed"
    )
    assert checks["kubelet.socket"]["status"] == "fail"
    assert checks["plugin"]["status"] == "fail" and "no GPU device plugin" in checks["plugin"]["summary"]


def test_nvidia_device_plugin_counts(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.remove("/var/lib/kubelet/device-plugins/gpunode-nvidia.com-gpu.sock")
    node.services["gpunode-device-plugin.service"] = "inactive"
    node.socket("/var/lib/kubelet/device-plugins/nvidia-gpu.sock")
    _, report = doctor_json(node, capsys)
    assert by_id(report)["plugin"]["summary"].startswith("NVIDIA's device plugin is serving")


def test_without_systemd_and_not_root(node: Node, fake_nvml: Callable[..., None]) -> None:
    fake_nvml("pcie-4")
    node.remove("/run/systemd/system")
    node.euid = 1000
    report = run_doctor(node.host())
    checks = {f.id: f for f in report.findings}
    assert checks["os.privileges"].status.value == "warn"
    assert checks["os.privileges"].fix == "run `gpunode doctor` as root for a complete diagnosis"
    assert checks["kubelet"].summary == "kubelet is installed"  # no systemd: state unknown, not failed
    assert not any(call[0] == "systemctl" for call in node.runner.calls)


def test_table_output(node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]) -> None:
    fake_nvml("pcie-4")
    node.remove("/usr/bin/nvidia-ctk")
    code = main(["doctor"], host=node.host())
    out = capsys.readouterr().out
    assert code == ExitCode.UNHEALTHY
    assert "gpu.3" in out and "NVIDIA L4" in out
    assert "fix: gpunode toolkit install (" in out
    assert "sudo" not in out  # gpunode runs as root (README): a fix line is the command as it is typed there
    assert "node is NOT ready for GPU workloads" in out


# -- the real process --------------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpunode", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )


def test_doctor_process_on_this_machine_with_fake_gpus() -> None:
    env = {**os.environ, **fakenvml.env(profile="dgx-a100")}
    proc = run_cli("doctor", "--json", env=env)
    assert proc.returncode in (ExitCode.OK, ExitCode.UNHEALTHY), proc.stderr
    report = json.loads(proc.stdout)
    assert by_id(report)["gpu.count"]["summary"] == "8 GPUs found"
    assert proc.stderr == ""


def test_usage_errors_exit_2_without_traceback() -> None:
    proc = run_cli("doctor", "--no-such-flag")
    assert proc.returncode == ExitCode.USAGE
    assert "No such option" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("--root", "/nonexistent/root", "doctor")
    assert proc.returncode == ExitCode.USAGE and "does not exist" in proc.stderr


def test_help_and_version() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0 and "doctor" in proc.stdout
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("gpunode ")


def test_k3s_node_with_embedded_containerd_and_kubelet(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.remove("/usr/bin/containerd")
    node.remove("/usr/bin/kubelet")
    node.remove("/etc/containerd")
    node.program("k3s")
    node.services.update({"containerd.service": "inactive", "kubelet.service": "inactive"})
    k3s = "/var/lib/rancher/k3s/agent/etc/containerd"
    node.file(
        f"{k3s}/config.toml", (Path(__file__).parents[1] / "fixtures/containerd/k3s-config.toml").read_text()
    )
    code, report = doctor_json(node, capsys)
    checks = by_id(report)
    # k3s has no containerd.service or kubelet.service: their "inactive" must not count as down.
    assert (
        checks["kubelet"]["status"] == "ok"
        and checks["kubelet"]["summary"] == "kubelet is embedded in k3s / RKE2"
    )
    containerd = checks["runtime.containerd"]
    assert "service" not in containerd["summary"]
    assert f"{k3s}/config.toml" in containerd["detail"] and "k3s regenerates" in containerd["detail"]
    # k3s finds the nvidia runtime by itself but keeps runc as the default.
    assert containerd["status"] == "warn" and "but the default is 'runc'" in containerd["summary"]
    assert code == ExitCode.OK


# -- odd hosts: doctor degrades per fact, never crashes, never reads outside the root --------------


def test_a_check_that_breaks_does_not_stop_the_others(
    node: Node, fake_nvml: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpunode.doctor import context

    fake_nvml("pcie-4")

    def broken(host: object) -> str:
        raise KeyError("boom")

    monkeypatch.setattr(context, "kubelet_present", broken)
    report = run_doctor(node.host())
    ids = [f.id for f in report.findings]
    assert "runtime.error" in ids and "gpu.3" in ids
    bug = next(f for f in report.findings if f.id == "runtime.error")
    assert bug.status.value == "fail" and "KeyError" in (bug.detail or "") and "--debug" in (bug.fix or "")
    with pytest.raises(KeyError):
        run_doctor(node.host(), raise_bugs=True)


def test_one_failing_nvml_query_loses_one_fact(
    node: Node, fake_nvml: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pynvml

    fake_nvml("pcie-4")
    real = pynvml.nvmlDeviceGetTotalEccErrors

    def flaky(handle: object, *args: object) -> object:
        if pynvml.nvmlDeviceGetIndex(handle) == 1:
            raise pynvml.NVMLError(999)
        return real(handle, *args)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEccErrors", flaky)
    checks = {f.id: f for f in run_doctor(node.host()).findings}
    assert checks["gpu.count"].summary == "4 GPUs found"
    assert checks["gpu.1"].status.value == "ok"
    assert "GPU 1 ECC errors: failed (Unknown Error)" in (checks["nvml.init"].detail or "")


def test_kubelet_flags_in_comments_do_not_count(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.program("dockerd")
    node.file(
        "/etc/default/kubelet",
        "# KUBELET_EXTRA_ARGS=--container-runtime-endpoint=unix:///run/cri-dockerd.sock\n",
    )
    node.file(
        "/var/lib/kubelet/config.yaml", "containerRuntimeEndpoint: unix:///run/containerd/containerd.sock\n"
    )
    _, report = doctor_json(node, capsys)
    checks = by_id(report)
    assert "kubelet uses" not in checks["runtime.docker"]["summary"]
    assert checks["runtime.docker"]["status"] == "warn"


def test_kubelet_runtime_not_installed(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.file(
        "/var/lib/kubelet/kubeadm-flags.env",
        'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///var/run/crio/crio.sock"\n',
    )
    code, report = doctor_json(node, capsys)
    crio = by_id(report)["runtime.crio"]
    assert code == ExitCode.UNHEALTHY
    assert (
        crio["status"] == "fail"
        and crio["summary"] == "kubelet is configured for crio, which is not installed"
    )


def test_unreadable_config_of_a_runtime_kubelet_does_not_use_only_warns(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.program("dockerd")
    (node.root / "etc/docker/daemon.json").mkdir(parents=True)
    code, report = doctor_json(node, capsys)
    docker = by_id(report)["runtime.docker"]
    assert code == ExitCode.OK
    assert docker["status"] == "warn" and "is a directory" in docker["detail"]


def test_root_image_with_absolute_symlinks(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    node.remove("/etc/os-release")
    node.file(
        "/usr/lib/os-release",
        'NAME="Rocky Linux"\nVERSION_ID="9.4"\nID=rocky\nID_LIKE="rhel centos fedora"\n'
        'PRETTY_NAME="Rocky Linux 9.4 (Blue Onyx)"\n',
    )
    (node.root / "etc/os-release").symlink_to("/usr/lib/os-release")  # a host path: must stay in the image
    _, report = doctor_json(node, capsys)
    assert by_id(report)["os.distribution"]["summary"] == "Rocky Linux 9.4 (Blue Onyx)"


def test_old_and_unreadable_distributions(node: Node, fake_nvml: Callable[..., None]) -> None:
    fake_nvml("pcie-4")
    node.file(
        "/etc/os-release", 'NAME="Ubuntu"\nVERSION_ID="18.04"\nID=ubuntu\nPRETTY_NAME="Ubuntu 18.04.6 LTS"\n'
    )
    old = {f.id: f for f in run_doctor(node.host()).findings}["os.distribution"]
    assert old.status.value == "warn" and old.summary == "Ubuntu 18.04.6 LTS is older than gpunode supports"
    (node.root / "etc/os-release").write_bytes(b'PRETTY_NAME="Ubunt\xe9"\nID=ubuntu\n')
    bad = {f.id: f for f in run_doctor(node.host()).findings}["os.distribution"]
    assert bad.status.value == "warn" and "not a UTF-8 text file" in (bad.detail or "")


def test_garbage_driver_version_file(node: Node, fake_nvml: Callable[..., None]) -> None:
    fake_nvml("pcie-4")
    (node.root / "proc/driver/nvidia/version").write_bytes(b"\xff\x00\xfe")
    checks = {f.id: f for f in run_doctor(node.host()).findings}
    assert (
        checks["driver.module"].status.value == "ok"
        and checks["driver.module"].summary == "nvidia kernel module loaded"
    )
    assert "driver.nouveau" in checks


def test_missing_containerd_import_is_a_failure(
    node: Node, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml("pcie-4")
    text = (node.root / "etc/containerd/config.toml").read_text()
    node.file("/etc/containerd/config.toml", 'imports = ["/etc/containerd/conf.d/nope.toml"]\n' + text)
    _, report = doctor_json(node, capsys)
    check = by_id(report)["runtime.containerd"]
    assert (
        check["status"] == "fail" and "which does not exist: containerd refuses to start" in check["summary"]
    )


def test_crio_dropin_link_loop_and_fifo_config_do_not_hang(
    node: Node, fake_nvml: Callable[..., None]
) -> None:
    fake_nvml("pcie-4")
    node.program("crio")
    node.file("/etc/crio/crio.conf.d/10-crio.conf", '[crio.runtime]\ndefault_runtime = "crun"\n')
    (node.root / "etc/crio/crio.conf.d/a").symlink_to(".")
    (node.root / "etc/crio/crio.conf.d/b").symlink_to(".")
    node.remove("/etc/containerd/config.toml")
    os.mkfifo(node.root / "etc/containerd/config.toml")
    checks = {f.id: f for f in run_doctor(node.host()).findings}
    assert (
        checks["runtime.crio"].detail is not None and checks["runtime.crio"].detail.count("10-crio.conf") == 1
    )
    assert checks["runtime.containerd"].status.value == "fail"
    assert "not a regular file" in (checks["runtime.containerd"].detail or "")
