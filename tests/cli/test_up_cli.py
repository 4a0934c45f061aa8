"""`gpunode up` end to end on a fresh GPU node under a temp root: the real pynvml over the fake NVML, a
package manager and systemd that behave like the real ones for what gpunode does (tests/pkgfake.py and
FakeSystemd below), and the test API server in `kubectl proxy` mode for the labels."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import CommandResult, Host
from gpunode.toolkit import install as toolkit_install
from gpunode.toolkit.managers import APT_KEYRING, DEFAULT_REPO_URL, PACKAGES
from tests.kubeapi.apiserver import ApiServer
from tests.pkgfake import FakePackages

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KEY = FIXTURES / "toolkit/test-key-rsa.asc"
KEY_FPR = "BEAA704E2C010DC785031E04262B7125F6CCD064"
NODE = "gpu-node-7"
UNITS_WATCHED = ("containerd.service", "docker.service", "crio.service", "kubelet.service")
CONTAINERD_VERSION = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"


@dataclass
class FakeSystemd:
    """systemctl as gpunode uses it: is-active for doctor, show for the plugin service's state, and
    daemon-reload / enable / start; a started Type=notify plugin turns active (it registered)."""

    active: dict[str, str] = field(
        default_factory=lambda: {"containerd.service": "active", "kubelet.service": "active"}
    )
    enabled: set[str] = field(default_factory=set)
    calls: list[tuple[str, ...]] = field(default_factory=list)
    # A started unit stays "activating" for this many `show`s (a plugin that takes a while to register).
    activating_shows: int = 0

    def run(self, argv: tuple[str, ...]) -> CommandResult:
        self.calls.append(argv)
        verb = argv[1]
        units = [a for a in argv[2:] if not a.startswith("-")]
        if verb == "is-active":
            return CommandResult(argv, 0, "".join(f"{self.active.get(u, 'inactive')}\n" for u in units), "")
        if verb == "show":
            unit = units[0]
            state = self.active.get(unit, "inactive")
            if state == "activating":
                self.activating_shows -= 1
                if self.activating_shows < 0:
                    state = self.active[unit] = "active"
            text = (
                f"ActiveState={state}\nSubState={'running' if state == 'active' else 'dead'}\n"
                f"UnitFileState={'enabled' if unit in self.enabled else 'disabled'}\n"
                "StatusText=nvidia.com/gpu: 8/8 healthy, registered\n"
                "MainPID=4242\nNRestarts=0\nResult=success\n"
            )
            return CommandResult(argv, 0, text, "")
        if verb == "enable":
            self.enabled.update(units)
        elif verb == "disable":
            self.enabled.difference_update(units)
            if "--now" in argv:
                self.active.update(dict.fromkeys(units, "inactive"))
        elif verb in ("start", "restart"):
            self.active.update(dict.fromkeys(units, "activating" if self.activating_shows else "active"))
        elif verb != "daemon-reload":
            raise AssertionError(f"unexpected systemctl call {argv}")
        return CommandResult(argv, 0, "", "")


@dataclass
class NodeRunner:
    """Every command the node answers: the package manager, systemctl, and `--version`s."""

    packages: FakePackages
    systemd: FakeSystemd
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult:
        key = tuple(argv)
        self.calls.append(key)
        program = os.path.basename(key[0])
        if program in ("apt-get", "rpm"):
            return self.packages.run(argv, timeout=timeout, env=env)
        if program == "systemctl":
            return self.systemd.run(key)
        if program == "journalctl":
            return CommandResult(key, 0, "", "")
        if program == "containerd" and key[1:] == ("--version",):
            return CommandResult(key, 0, CONTAINERD_VERSION, "")
        if program in ("nvidia-ctk", "nvidia-container-runtime") and key[1:] == ("--version",):
            # the script FakePackages installed says what it is
            text = self.packages.root.joinpath(key[0].lstrip("/")).read_text().split("'")[1]
            return CommandResult(key, 0, text + "\n", "")
        raise AssertionError(f"unexpected command {key}")

    @property
    def changes(self) -> list[tuple[str, ...]]:
        """The commands that change something (not the reads doctor and the planners make)."""
        reads = {"is-active", "show", "--version", "-q"}
        return [
            c for c in self.calls if not reads.intersection(c[1:2]) and os.path.basename(c[0]) != "journalctl"
        ]


def fresh_node(root: Path) -> Host:
    """A GPU node as it is after the driver and kubelet were installed: nothing else of gpunode's."""

    def put(path: str, text: str, mode: int = 0o644) -> None:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    put("/etc/os-release", (FIXTURES / "os-release/ubuntu-22.04").read_text())
    put("/etc/hostname", f"{NODE}\n")
    (root / "sys/module/nvidia").mkdir(parents=True)
    put(
        "/proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n",
    )
    for dev in ["/dev/nvidiactl", "/dev/nvidia-uvm", *[f"/dev/nvidia{i}" for i in range(8)]]:
        (root / dev.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        os.mknod(root / dev.lstrip("/"), stat.S_IFCHR | 0o666, os.makedev(195, 0))
    for program in ("apt-get", "containerd", "kubelet"):
        put(f"/usr/bin/{program}", "#!/bin/sh\n", 0o755)
    put(
        "/var/lib/kubelet/kubeadm-flags.env",
        'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///run/containerd/containerd.sock"\n',
    )
    (root / "var/lib/kubelet/device-plugins").mkdir(parents=True)
    os.mknod(root / "var/lib/kubelet/device-plugins/kubelet.sock", stat.S_IFSOCK | 0o600)
    (root / "run/systemd/system").mkdir(parents=True)
    put("/etc/containerd/config.toml", (FIXTURES / "containerd/default-v2.toml").read_text())
    runner = NodeRunner(FakePackages(root=root, manager="apt"), FakeSystemd())
    return Host(root=root, runner=runner, env={"PATH": "/usr/sbin:/usr/bin"}, euid=0)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer(allow=[("admin", "*", "*")]) as server:  # plain HTTP, like `kubectl proxy`
        server.add_node(NODE)
        yield server


@pytest.fixture
def node(tmp_path: Path, fake_nvml: Callable[..., None]) -> Host:
    fake_nvml(profile="dgx-a100")
    return fresh_node(tmp_path / "root")


def up(host: Host, api: ApiServer, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    args = ["up", "--key-file", str(KEY), "--key-fingerprint", KEY_FPR, "--server", api.url, *extra]
    code = main(args, host=host)
    out, err = capsys.readouterr()
    return code, out, err


def runner(host: Host) -> NodeRunner:
    assert isinstance(host.runner, NodeRunner)
    return host.runner


def test_dry_run_prints_the_whole_plan_and_changes_nothing(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(p.relative_to(node.root) for p in node.root.rglob("*"))
    code, out, err = up(node, api, capsys, "--dry-run")
    assert code == ExitCode.OK, err
    assert "[   done] preflight: driver, NVML and kubelet are fine" in out
    assert "[  to do] toolkit: install nvidia-container-toolkit (newest) with apt" in out
    assert "write /etc/apt/sources.list.d/nvidia-container-toolkit.list" in out
    assert "run: DEBIAN_FRONTEND=noninteractive" in out and "apt-get update" in out
    assert "[  to do] runtime: configure containerd for the nvidia runtime, as the default" in out
    assert '+      default_runtime_name = "nvidia"' in out  # the diff, in full
    assert "[  to do] plugin: install and start gpunode-device-plugin.service" in out
    assert "run: systemctl enable gpunode-device-plugin.service" in out
    assert f"[  to do] labels: label node {NODE}" in out and "label nvidia.com/gpu.count=8" in out
    assert "dry run: nothing was changed" in out
    assert sorted(p.relative_to(node.root) for p in node.root.rglob("*")) == before
    assert runner(node).changes == []
    assert [r.method for r in api.requests] == ["GET"]


def test_dry_run_plans_the_toolkit_offline_and_applying_checks_the_key(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No --key-file: the key is NVIDIA's URL. The download is stood in for, and counted.
    fetched: list[str] = []

    def fetch(url: str) -> bytes:
        fetched.append(url)
        return KEY.read_bytes()

    defaults = toolkit_install.plan_install.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "fetch", fetch)
    args = ["up", "--key-fingerprint", KEY_FPR, "--server", api.url]
    code = main([*args, "--dry-run"], host=node)
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    assert fetched == []  # a dry run plans offline
    assert (
        f"download the signing key from {DEFAULT_REPO_URL}/gpgkey when applying, check it is the key with "
        f"fingerprint {KEY_FPR}, then write {APT_KEYRING} (not downloaded in a dry run)"
    ) in out
    assert "write /etc/apt/sources.list.d/nvidia-container-toolkit.list" in out
    assert not node.path(APT_KEYRING).exists()

    code = main([*args, "--yes"], host=node)
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    assert fetched == [f"{DEFAULT_REPO_URL}/gpgkey"]  # downloaded, and checked, only when applying
    assert node.path(APT_KEYRING).is_file()


def test_up_sets_the_node_up_and_a_second_run_changes_nothing(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    fake = runner(node)
    assert fake.packages.installed == dict.fromkeys(PACKAGES, "1.17.8-1")
    assert "==> [1/4] toolkit:" in out and "==> [4/4] labels:" in out
    assert "    | install: done" in out  # the package manager's output, streamed
    config = node.path("/etc/containerd/config.toml").read_text()
    assert 'default_runtime_name = "nvidia"' in config and "/usr/bin/nvidia-container-runtime" in config
    assert node.path("/etc/systemd/system/gpunode-device-plugin.service").exists()
    assert fake.systemd.active["gpunode-device-plugin.service"] == "active"
    labels = api.node(NODE)["metadata"]["labels"]
    assert labels["nvidia.com/gpu.count"] == "8" and labels["nvidia.com/gpu.present"] == "true"
    assert "nvidia.com/gpu" not in api.node(NODE)["status"]["capacity"]  # the plugin's, not up's
    assert "the node is set up" in out

    fake.calls.clear()
    patches = len([r for r in api.requests if r.method == "PATCH"])
    files = {p: p.stat().st_mtime_ns for p in node.root.rglob("*") if p.is_file()}
    code, out, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    assert "the node is already set up: nothing to change" in out
    assert "[   done] toolkit: nvidia-container-toolkit 1.17.8-1 is installed" in out
    assert "[   done] runtime: containerd is configured" in out
    assert "[   done] plugin: gpunode-device-plugin.service is installed and running" in out
    assert f"[   done] labels: node {NODE} has its GPU labels" in out
    assert fake.changes == []
    assert len([r for r in api.requests if r.method == "PATCH"]) == patches
    assert {p: p.stat().st_mtime_ns for p in node.root.rglob("*") if p.is_file()} == files


def test_without_credentials_labels_are_skipped_not_failed(
    node: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["up", "--key-file", str(KEY), "--key-fingerprint", KEY_FPR, "--yes"], host=node)
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    assert "[skipped] labels: no Kubernetes API credentials on this node" in out
    assert "[   done] labels" not in out
    assert "fix: pass --kubeconfig PATH" in out


def test_preflight_stops_before_anything_changes(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str], fake_nvml: Callable[..., None]
) -> None:
    fake_nvml(profile="no-driver")
    for path in ("sys/module/nvidia", "proc/driver/nvidia/version"):
        target = node.root / path
        target.rmdir() if target.is_dir() else target.unlink()
    code, out, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.UNHEALTHY
    assert "[blocked] preflight:" in out
    assert (
        "gpunode: error: step preflight: the nvidia kernel module is not loaded; gpunode up changed nothing"
        in err
    )
    assert runner(node).changes == []
    assert all(r.method == "GET" for r in api.requests)


def test_a_failed_step_stops_up_with_its_fix(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    runner(node).packages.fail["install"] = (100, "E: Unable to locate package nvidia-container-toolkit\n")
    code, _, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.COMMAND_FAILED
    assert "gpunode: error: step toolkit failed: install the packages failed:" in err
    assert "not done: runtime, plugin, labels" in err
    assert "fix: the repository has no such package or version" in err
    assert 'default_runtime_name = "runc"' in node.path("/etc/containerd/config.toml").read_text()
    assert not node.path("/etc/apt/sources.list.d/nvidia-container-toolkit.list").exists()  # rolled back


def test_a_toolkit_installed_by_hand_is_kept(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    runner(node).packages.run(["apt-get", "install", "-y", *(f"{p}=1.16.2-1" for p in PACKAGES)], timeout=5)
    code, out, _ = up(node, api, capsys, "--dry-run")
    assert code == ExitCode.OK
    assert "[   done] toolkit: nvidia-container-toolkit 1.16.2-1 is installed" in out
    code, out, _ = up(node, api, capsys, "--dry-run", "--toolkit-version", "1.17.8")
    assert "[  to do] toolkit: install nvidia-container-toolkit 1.17.8-1 with apt" in out


def test_up_repairs_repository_files_that_drifted(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A source that bypasses signatures added to gpunode's list after up: the toolkit step is to do again
    (a repair, no package command), and up rewrites the list."""
    code, _, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    listing = node.path("/etc/apt/sources.list.d/nvidia-container-toolkit.list")
    good = listing.read_text()
    listing.write_text(good + "deb [trusted=yes] http://mirror.invalid/ /\n")
    code, out, err = up(node, api, capsys, "--dry-run")
    assert code == ExitCode.OK, err
    assert "[  to do] toolkit: repair the repository files of nvidia-container-toolkit" in out
    runner(node).calls.clear()
    code, out, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    assert listing.read_text() == good
    assert not [c for c in runner(node).changes if "apt-get" in c[0] and "install" in c]


def test_up_shows_the_wait_for_the_plugin_and_ctrl_c_there_leaves_it_installed(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpunode.systemd import service

    # No real time: each pause moves a fake clock on by its length; the 41st is Ctrl-C.
    now = [0.0]

    def pause(seconds: float) -> None:
        if now[0] >= 20.0:
            raise KeyboardInterrupt
        now[0] += seconds

    monkeypatch.setattr(service, "monotonic", lambda: now[0])
    monkeypatch.setattr(service, "pause", pause)
    runner(node).systemd.activating_shows = 1000
    code, out, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.INTERRUPTED
    # The progress, on stderr (not a terminal here: a plain line every 10 s).
    wait = "waiting for gpunode-device-plugin.service to register with kubelet"
    assert f"{wait} (10 s of at most 120 s)\n{wait} (20 s of at most 120 s)\n" in err
    assert wait not in out
    assert (
        "gpunode: error: step plugin failed: interrupted while waiting: gpunode-device-plugin.service is "
        "installed and started; check it with `gpunode plugin status` / `journalctl -u gpunode-device-plugin`"
    ) in err
    assert "not done: labels" in err
    assert node.path("/etc/systemd/system/gpunode-device-plugin.service").exists()
    assert runner(node).systemd.active["gpunode-device-plugin.service"] == "activating"  # not stopped
    assert "gpunode-device-plugin.service" in runner(node).systemd.enabled


def test_up_says_how_long_the_plugin_took_to_register(
    node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpunode.systemd import service

    now = [0.0]
    monkeypatch.setattr(service, "monotonic", lambda: now[0])
    monkeypatch.setattr(service, "pause", lambda seconds: now.__setitem__(0, now[0] + seconds))
    runner(node).systemd.activating_shows = 24  # registered after 12 s
    code, out, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    assert "    plugin: gpunode-device-plugin.service is active: " in out and "(after 12 s)\n" in out
    assert err.count("waiting for gpunode-device-plugin.service") == 1  # the 10 s line
