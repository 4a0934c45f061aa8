"""`gpunode down` end to end: undo what `gpunode up` did on the node of tests/cli/test_up_cli.py (the real
pynvml over the fake NVML, FakePackages, FakeSystemd, the test API server), in reverse, plan first."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from gpunode.runtimes import records
from gpunode.toolkit.managers import PACKAGES
from tests.cli.test_up_cli import FIXTURES, NODE, fresh_node, runner, up
from tests.kubeapi.apiserver import ApiServer

UNIT = "/etc/systemd/system/gpunode-device-plugin.service"
STOCK = (FIXTURES / "containerd/default-v2.toml").read_text()


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer(allow=[("admin", "*", "*")]) as server:  # plain HTTP, like `kubectl proxy`
        server.add_node(NODE)
        yield server


@pytest.fixture
def node(tmp_path: Path, fake_nvml: Callable[..., None]) -> Host:
    fake_nvml(profile="dgx-a100")
    return fresh_node(tmp_path / "root")


def down(host: Host, api: ApiServer, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["down", "--server", api.url, *extra], host=host)
    out, err = capsys.readouterr()
    return code, out, err


def files(host: Host) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in host.root.rglob("*") if p.is_file()}


@pytest.fixture
def set_up(node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]) -> Host:
    code, _, err = up(node, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    assert api.node(NODE)["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    runner(node).calls.clear()
    return node


def test_dry_run_prints_every_step_in_reverse_and_changes_nothing(
    set_up: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    before = files(set_up)
    requests = len(api.requests)
    code, out, err = down(set_up, api, capsys, "--dry-run")
    assert code == ExitCode.OK, err
    lines = [line for line in out.splitlines() if line.startswith("  [")]
    assert [line.split("]")[1].split(":")[0].strip() for line in lines] == [
        "plugin",
        "node",
        "cdi",
        "runtime",
        "toolkit",
    ]
    assert "[  to do] plugin: stop, disable and remove gpunode-device-plugin.service" in out
    assert "run: systemctl disable --now gpunode-device-plugin.service" in out and f"remove {UNIT}" in out
    assert f"[  to do] node: withdraw what gpunode advertised on node {NODE}" in out
    assert "remove label nvidia.com/gpu.present" in out
    assert "[  to do] runtime: revert gpunode's changes to containerd" in out
    assert '-      default_runtime_name = "nvidia"' in out  # the diff back, in full
    assert "[skipped] toolkit: left installed (add --toolkit to remove it)" in out
    assert "dry run: nothing was changed" in out
    assert files(set_up) == before
    assert runner(set_up).changes == []
    assert all(r.method == "GET" for r in api.requests[requests:])


def test_down_undoes_up_and_a_second_run_changes_nothing(
    set_up: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = down(set_up, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    assert "==> [1/3] plugin:" in out and "==> [3/3] runtime:" in out
    fake = runner(set_up)
    assert ("systemctl", "disable", "--now", "gpunode-device-plugin.service") in fake.calls
    assert fake.systemd.active["gpunode-device-plugin.service"] == "inactive"
    assert not set_up.path(UNIT).exists()
    labels = api.node(NODE)["metadata"].get("labels", {})
    assert not [k for k in labels if k.startswith("nvidia.com/")]
    assert set_up.path("/etc/containerd/config.toml").read_text() == STOCK  # byte for byte
    assert not set_up.path(records.RECORDS).exists()
    assert fake.packages.installed == dict.fromkeys(PACKAGES, "1.17.8-1")  # not without --toolkit

    fake.calls.clear()
    before = files(set_up)
    code, out, err = down(set_up, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    assert "nothing of gpunode's is left to undo" in out
    assert fake.changes == [] and files(set_up) == before


def test_down_with_toolkit_removes_the_packages_and_repository_files(
    set_up: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = down(set_up, api, capsys, "--yes", "--toolkit")
    assert code == ExitCode.OK, err
    assert "==> [4/4] toolkit:" in out
    assert not any(runner(set_up).packages.installed.get(p) for p in PACKAGES)
    assert not set_up.path("/etc/apt/sources.list.d/nvidia-container-toolkit.list").exists()


def test_down_asks_first_declining_exits_1_and_no_terminal_exits_2(
    set_up: Host, api: ApiServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = files(set_up)
    code, _, err = down(set_up, api, capsys)  # pytest's stdin is no terminal
    assert code == ExitCode.USAGE and "add --yes" in err

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    code, out, err = down(set_up, api, capsys)
    assert code == ExitCode.DECLINED and int(code) == 1, err
    assert "Go ahead?" in out and "nothing was changed" in out
    assert files(set_up) == before and runner(set_up).changes == []


def test_down_on_a_node_up_never_touched_has_nothing_to_do(
    node: Host,
    api: ApiServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = files(node)
    code, out, err = down(node, api, capsys, "--yes")
    assert code == ExitCode.OK, err
    assert "[skipped] plugin:" in out and "[   done] runtime: gpunode has not changed" in out
    assert "nothing of gpunode's is left to undo" in out
    assert files(node) == before
