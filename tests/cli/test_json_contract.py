"""The --json contract: every command that reports or changes something prints one document that validates
against the schema gpunode ships (gpunode/schemas), with a truthful `changed`, on success, on a dry run and
on failure (issue 15)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpunode import schemas
from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from tests.cli.test_up_cli import KEY, KEY_FPR, NODE, fresh_node
from tests.kubeapi.apiserver import ApiServer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"


def run_json(
    command: str, argv: list[str], host: Host, capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, Any]]:
    code = main(argv, host=host)
    out, err = capsys.readouterr()
    try:
        doc = json.loads(out)  # the whole of stdout is one document
    except ValueError as exc:
        raise AssertionError(
            f"{argv} did not print one JSON document ({exc}):\n{out}\nstderr:\n{err}"
        ) from None
    jsonschema.validate(doc, schemas.load(command))
    assert doc["schema"] == f"gpunode.{command}/v1"
    if code == ExitCode.OK:
        assert doc["error"] is None
    elif code != ExitCode.UNHEALTHY or doc["error"] is not None:  # 1 from a report is a finding, no error
        assert doc["error"]["exit_code"] == code
    return code, doc


def node(root: Path) -> Host:
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], CONTAINERD_1_6)
    return Host(root=root, runner=runner)


def test_configure_runtime(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text((FIXTURES / "containerd/default-v2.toml").read_text())
    base = ["configure-runtime", "containerd", "--set-as-default", "--json"]
    code, plan = run_json("configure-runtime", [*base, "--dry-run"], node(tmp_path), capsys)
    assert code == 0 and plan["dry_run"] and not plan["changed"]
    assert (
        plan["files"][0]["action"] == "write"
        and '+      default_runtime_name = "nvidia"' in plan["files"][0]["diff"]
    )
    code, done = run_json("configure-runtime", [*base, "--no-restart"], node(tmp_path), capsys)
    assert code == 0 and done["changed"] and done["backups"] and done["undo"].endswith("--revert")
    code, again = run_json("configure-runtime", [*base, "--no-restart"], node(tmp_path), capsys)
    assert code == 0 and not again["changed"] and again["files"][0]["action"] == "unchanged"
    code, back = run_json(
        "configure-runtime",
        ["configure-runtime", "containerd", "--revert", "--no-restart", "--json"],
        node(tmp_path),
        capsys,
    )
    assert code == 0 and back["changed"] and back["operation"] == "revert"
    code, failed = run_json(
        "configure-runtime",
        ["configure-runtime", "containerd", "--revert", "--no-restart", "--json"],
        node(tmp_path),
        capsys,
    )
    assert (
        code == ExitCode.NOT_FOUND
        and not failed["changed"]
        and "nothing to revert" in failed["error"]["message"]
    )
    # A restart needs a confirmation --json cannot ask for.
    code, refused = run_json("configure-runtime", [*base, "--restart"], node(tmp_path), capsys)
    assert code == ExitCode.USAGE and "--yes" in refused["error"]["fix"]


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer(allow=[("admin", "*", "*")]) as server:
        server.add_node(NODE)
        yield server


@pytest.fixture
def gpu_node(tmp_path: Path, fake_nvml: Callable[..., None]) -> Host:
    fake_nvml(profile="dgx-a100")
    return fresh_node(tmp_path / "root")


def test_up_and_down(gpu_node: Host, api: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    up = ["up", "--key-file", str(KEY), "--key-fingerprint", KEY_FPR, "--server", api.url, "--json"]
    code, plan = run_json("up", [*up, "--dry-run"], gpu_node, capsys)
    assert code == 0 and not plan["changed"]
    assert [s["status"] for s in plan["steps"]] == ["done", "to do", "to do", "to do", "to do"]
    code, refused = run_json("up", up, gpu_node, capsys)
    assert code == ExitCode.USAGE and not refused["changed"]
    code, done = run_json("up", [*up, "--yes"], gpu_node, capsys)
    assert code == 0 and done["changed"]
    assert [s["status"] for s in done["steps"]] == ["done", "done now", "done now", "done now", "done now"]
    code, again = run_json("up", [*up, "--yes"], gpu_node, capsys)
    assert code == 0 and not again["changed"]

    down = ["down", "--server", api.url, "--json"]
    code, plan = run_json("down", [*down, "--dry-run"], gpu_node, capsys)
    assert code == 0 and not plan["changed"]
    assert [s["name"] for s in plan["steps"]] == ["plugin", "node", "cdi", "runtime", "toolkit"]
    code, done = run_json("down", [*down, "--yes"], gpu_node, capsys)
    assert code == 0 and done["changed"]
    code, again = run_json("down", [*down, "--yes"], gpu_node, capsys)
    assert code == 0 and not again["changed"]


def test_every_schema_file_is_a_valid_json_schema() -> None:
    directory = Path(schemas.__file__).parent
    names = sorted(p.name.removesuffix(".v1.json") for p in directory.glob("*.v1.json"))
    assert names, "no schemas shipped"
    for name in names:
        jsonschema.Draft202012Validator.check_schema(schemas.load(name))


def cdi_node(root: Path) -> Host:
    from tests import cdinode

    cdinode.make_driver(root, "550.54.15", gpus=range(8))
    return Host(root=root, runner=ScriptedRunner(), env={"PATH": "/usr/bin"})


def test_cdi_generate_list_and_check(
    tmp_path: Path, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml(profile="dgx-a100")
    host = cdi_node(tmp_path)
    code, plan = run_json("cdi-generate", ["cdi", "generate", "--dry-run", "--json"], host, capsys)
    assert code == 0 and plan["dry_run"] and not plan["changed"]
    assert plan["devices"][:2] == ["nvidia.com/gpu=0", plan["devices"][1]] and plan["devices"][-1].endswith(
        "=all"
    )
    assert plan["cdi_version"] == "0.5.0" and plan["gpus"] == 8 and not (tmp_path / "var/run/cdi").exists()
    code, done = run_json("cdi-generate", ["cdi", "generate", "--json"], host, capsys)
    assert code == 0 and done["changed"] and done["spec"] == plan["spec"]
    code, again = run_json("cdi-generate", ["cdi", "generate", "--json"], host, capsys)
    assert code == 0 and not again["changed"]

    code, listed = run_json("cdi-list", ["cdi", "list", "--json"], host, capsys)
    assert code == 0 and len(listed["devices"]) == 17
    assert {d["file"] for d in listed["devices"]} == {done["path"]}

    code, checked = run_json("cdi-check", ["cdi", "check", "--json"], host, capsys)
    assert code == 0 and checked["healthy"] and checked["counts"]["fail"] == 0

    (tmp_path / "dev/nvidia3").unlink()  # a GPU's node gone: the spec no longer holds
    # Unhealthy is a finding, not an error: exit 1 with the document's error null (as doctor does).
    code = main(["cdi", "check", "--json"], host=host)
    failed = json.loads(capsys.readouterr().out)
    jsonschema.validate(failed, schemas.load("cdi-check"))
    assert code == ExitCode.UNHEALTHY and not failed["healthy"] and failed["error"] is None
    assert "cdi.nodes" in [c["id"] for c in failed["checks"] if c["status"] == "fail"]
    code, refused = run_json("cdi-generate", ["cdi", "generate", "--json"], host, capsys)
    assert (
        code == ExitCode.NOT_FOUND
        and not refused["changed"]
        and "/dev/nvidia3" in refused["error"]["message"]
    )


def test_toolkit_install_status_uninstall(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli.test_toolkit_cli import install_args, make_node

    host, fake = make_node(tmp_path, "apt")
    args = ["toolkit", *install_args(tmp_path, "--version", "1.17.8"), "--json"]
    code, plan = run_json("toolkit-install", [*args, "--dry-run"], host, capsys)
    assert code == 0 and plan["dry_run"] and not plan["changed"] and plan["commands"]
    assert {f["action"] for f in plan["files"]} == {"write"} and any(f["diff"] for f in plan["files"])
    code, done = run_json("toolkit-install", args, host, capsys)
    assert code == 0 and done["changed"] and done["version"] == "1.17.8-1"
    code, again = run_json("toolkit-install", args, host, capsys)
    assert code == 0 and not again["changed"] and not again["commands"]
    code, status = run_json("toolkit-status", ["toolkit", "status", "--json"], host, capsys)
    assert code == 0 and status["healthy"] and not status["changed"]
    code, refused = run_json("toolkit-uninstall", ["toolkit", "uninstall", "--json"], host, capsys)
    assert code == ExitCode.USAGE and "--yes" in refused["error"]["fix"]
    code, gone = run_json("toolkit-uninstall", ["toolkit", "uninstall", "--json", "--yes"], host, capsys)
    assert code == 0 and gone["changed"] and not any(fake.installed.get(p) for p in gone["packages"])
    code, status = run_json("toolkit-status", ["toolkit", "status", "--json"], host, capsys)
    assert code == ExitCode.UNHEALTHY and not status["healthy"]


def test_doctor(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_nvml: Callable[..., None]) -> None:
    fake_nvml(profile="dgx-a100")
    host = fresh_node(tmp_path / "root")
    code, report = run_json("doctor", ["doctor", "--json"], host, capsys)
    assert code in (ExitCode.OK, ExitCode.UNHEALTHY) and not report["changed"]
    assert report["healthy"] is (code == ExitCode.OK)
    assert sum(report["counts"].values()) == len(report["checks"]) > 0


def test_every_command_that_reports_or_changes_has_json_and_a_schema() -> None:
    """Each command with --json ships its schema (the README documents the same list)."""
    import click

    from gpunode.cli.main import cli as app

    def walk(
        command: click.Command, path: tuple[str, ...]
    ) -> Iterator[tuple[tuple[str, ...], click.Command]]:
        if isinstance(command, click.Group):
            for name in command.list_commands(click.Context(command)):
                sub = command.get_command(click.Context(command), name)
                if sub is not None:
                    yield from walk(sub, (*path, name))
        else:
            yield path, command

    with_json = {
        "-".join(path) for path, command in walk(app, ()) if any("--json" in p.opts for p in command.params)
    }
    shipped = {p.name.removesuffix(".v1.json") for p in Path(schemas.__file__).parent.glob("*.v1.json")}
    assert with_json <= shipped, f"--json without a schema: {sorted(with_json - shipped)}"
    must = {"doctor", "configure-runtime", "toolkit-install", "toolkit-uninstall", "toolkit-status"}
    must |= {"node-advertise", "node-withdraw", "up", "down"}
    assert must <= with_json, f"commands without --json: {sorted(must - with_json)}"


def test_plugin_run_show_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUNODE_REPLICAS", "2")
    monkeypatch.delenv("GPUNODE_PLUGIN_CONFIG", raising=False)
    host = Host(root=tmp_path, env={})
    argv = ["plugin", "run", "--show-config", "--json", "--mig-strategy", "mixed"]
    code, doc = run_json("plugin-run", argv, host, capsys)
    assert code == 0 and not doc["changed"] and not doc["all_xids_critical"]
    settings = {s["key"]: s for s in doc["settings"]}
    assert (
        settings["mig-strategy"]["value"] == "mixed"
        and settings["mig-strategy"]["origin"] == "flag --mig-strategy"
    )
    assert settings["time-slicing.replicas"] == {
        "key": "time-slicing.replicas",
        "value": 2,
        "origin": "env GPUNODE_REPLICAS",
        "env": "GPUNODE_REPLICAS",
        "flag": "--replicas",
    }
    assert settings["health.ignored-xids"]["value"] == [13, 31, 43, 45, 68, 109]
    code, failed = run_json("plugin-run", [*argv[:4], "--mig-strategy", "all"], host, capsys)
    assert code == ExitCode.USAGE and "--mig-strategy" in failed["error"]["message"]  # a flag: usage


def test_plugin_install_status_uninstall(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from tests.unit.test_service_plan import FakeSystemctl

    systemctl = FakeSystemctl()
    host = Host(root=tmp_path, runner=systemctl, env={}, euid=0)
    code, plan = run_json("plugin-install", ["plugin", "install", "--dry-run", "--json"], host, capsys)
    assert code == 0 and plan["dry_run"] and not plan["changed"] and "state" not in plan
    assert plan["files"][0]["action"] == "create" and "ExecStart=" in plan["files"][0]["content"]
    assert ["systemctl", "start", "--no-block", "gpunode-device-plugin.service"] in plan["commands"]
    assert not (tmp_path / "etc").exists()

    code, done = run_json("plugin-install", ["plugin", "install", "--json"], host, capsys)
    assert code == 0 and done["changed"] and done["state"]["service"]["active_state"] == "active"
    code, again = run_json("plugin-install", ["plugin", "install", "--json"], host, capsys)
    assert code == 0 and not again["changed"] and again["files"][0]["action"] == "unchanged"

    # Active, but no status file yet: not ready (exit 1), the document says where it looked.
    code = main(["plugin", "status", "--json"], host=host)
    waiting = json.loads(capsys.readouterr().out)
    jsonschema.validate(waiting, schemas.load("plugin-status"))
    assert code == ExitCode.UNHEALTHY and not waiting["ready"] and waiting["error"] is None
    assert waiting["status_file"] is None
    assert waiting["looked"] == [{"path": "/run/gpunode/plugin-status.json", "source": "default"}]
    status = tmp_path / "run/gpunode/plugin-status.json"
    status.parent.mkdir(parents=True)
    resource = {"name": "nvidia.com/gpu", "socket": "gpunode-nvidia.com-gpu.sock", "devices": 4, "healthy": 4,
                "registered": True, "refused": None}  # fmt: skip
    status.write_text(json.dumps({"pid": os.getpid(), "ready": True, "waiting_for": None, "nvml_error": None,
                                  "summary": "nvidia.com/gpu: 4/4 healthy, registered",
                                  "resources": [resource], "unmonitored": []}))  # fmt: skip
    code, ready = run_json("plugin-status", ["plugin", "status", "--json"], host, capsys)
    assert (
        code == 0 and ready["ready"] and ready["pid_running"] and ready["plugin"]["resources"] == [resource]
    )
    assert ready["status_file"] == {"path": "/run/gpunode/plugin-status.json", "source": "default"}

    code, plan = run_json("plugin-uninstall", ["plugin", "uninstall", "--dry-run", "--json"], host, capsys)
    assert (
        code == 0
        and not plan["changed"]
        and "/etc/systemd/system/gpunode-device-plugin.service" in plan["remove"]
    )
    code, removed = run_json("plugin-uninstall", ["plugin", "uninstall", "--json"], host, capsys)
    assert code == 0 and removed["changed"]
    assert not (tmp_path / "etc/systemd/system/gpunode-device-plugin.service").exists()
    code, again = run_json("plugin-uninstall", ["plugin", "uninstall", "--json"], host, capsys)
    assert code == 0 and not again["changed"] and again["commands"] == [] and again["remove"] == []

    not_root = Host(root=tmp_path, runner=systemctl, env={}, euid=1000)
    code, refused = run_json("plugin-install", ["plugin", "install", "--json"], not_root, capsys)
    assert code == ExitCode.PERMISSION and not refused["changed"] and "root" in refused["error"]["message"]


def test_plugin_commands_have_json() -> None:
    import click

    from gpunode.cli.plugin import app

    for name in ("install", "uninstall", "status", "run"):
        command = app.get_command(click.Context(app), name)
        assert command is not None and any("--json" in p.opts for p in command.params), name


def test_plugin_run_json_without_show_config_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_json("plugin-run", ["plugin", "run", "--json"], Host(root=tmp_path, env={}), capsys)
    assert code == ExitCode.USAGE and not doc["changed"]
    assert doc["error"]["fix"] == "add --show-config" and "settings" not in doc


def test_cdi_install_and_uninstall(
    tmp_path: Path, fake_nvml: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_nvml(profile="dgx-a100")
    host = cdi_node(tmp_path)
    assert isinstance(host.runner, ScriptedRunner)
    # No systemd running under this root: nothing is asked of any systemctl (no answer is scripted, so a
    # call would fail); the units are enabled and disabled by their links.
    code, plan = run_json("cdi-install", ["cdi", "install", "--dry-run", "--json"], host, capsys)
    assert code == 0 and plan["dry_run"] and not plan["changed"]
    assert {f["action"] for f in plan["files"]} == {"write"}
    assert not (tmp_path / "etc/systemd/system/gpunode-cdi.service").exists()
    code, done = run_json("cdi-install", ["cdi", "install", "--json"], host, capsys)
    assert code == 0 and done["changed"] and (tmp_path / "etc/systemd/system/gpunode-cdi.path").exists()
    wants = tmp_path / "etc/systemd/system/multi-user.target.wants"
    assert os.readlink(wants / "gpunode-cdi.path") == "/etc/systemd/system/gpunode-cdi.path"
    assert done["commands"] == [] and done["next_steps"] == []
    code, again = run_json("cdi-install", ["cdi", "install", "--json"], host, capsys)
    assert code == 0 and not again["changed"]
    code, plan = run_json("cdi-uninstall", ["cdi", "uninstall", "--dry-run", "--json"], host, capsys)
    assert code == 0 and not plan["changed"] and "/etc/systemd/system/gpunode-cdi.path" in plan["remove"]
    code, gone = run_json("cdi-uninstall", ["cdi", "uninstall", "--json"], host, capsys)
    assert code == 0 and gone["changed"] and not (tmp_path / "etc/systemd/system/gpunode-cdi.path").exists()
    assert not (wants / "gpunode-cdi.path").is_symlink() and not (wants / "gpunode-cdi.service").is_symlink()
    code, again = run_json("cdi-uninstall", ["cdi", "uninstall", "--json"], host, capsys)
    assert code == 0 and not again["changed"] and again["remove"] == []
    assert not [argv for argv in host.runner.calls if argv[0] == "systemctl"], host.runner.calls
