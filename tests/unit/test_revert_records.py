"""`configure-runtime --revert` tells the truth about what it finds (issue 23): the only copy of an
original is never deleted, and a file gpunode made is removed only while it is still what gpunode wrote."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gpunode.cli.main import main
from gpunode.down import DownOptions, plan_down
from gpunode.errors import GpunodeError
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import containerd, k3s, records
from gpunode.runtimes.configure import apply, plan_configure, plan_revert, will_restart
from gpunode.runtimes.plan import ConfigureOptions, RuntimePlan

K3S_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "containerd" / "k3s"
K3S_1_32 = "k3s version v1.32.2+k3s1 (381620ef)\ngo version go1.23.6\n"
ORIGINAL = '{\n  "log-driver": "journald"\n}\n'
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"


def put(root: Path, host_path: str, text: str) -> Path:
    target = root / host_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def configure(host: Host, runtime: str, **options: Any) -> RuntimePlan:
    plan = plan_configure(host, runtime, ConfigureOptions(**options))
    apply(host, plan, restart=False)
    return plan


def revert(host: Host, runtime: str) -> RuntimePlan:
    plan = plan_revert(host, runtime, ConfigureOptions())
    apply(host, plan, restart=False)
    return plan


def k3s_node(root: Path) -> Host:
    put(root, containerd.K3S_CONFIG, (K3S_FIXTURES / "v3-k3s-v1.32.toml").read_text())
    runner = ScriptedRunner()
    runner.answer(["k3s", "--version"], K3S_1_32)
    return Host(root=root, runner=runner)


def edit_record(root: Path, change: Any) -> None:
    path = root / records.RECORDS.lstrip("/")
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# -- 1. a file deleted after gpunode changed it ----------------------------------------------------------


def test_a_deleted_file_gets_its_original_back_from_the_backup(tmp_path: Path) -> None:
    daemon = put(tmp_path, "/etc/docker/daemon.json", ORIGINAL)
    daemon.chmod(0o640)
    host = Host(root=tmp_path, runner=ScriptedRunner())
    configure(host, "docker")
    backup = tmp_path / records.backup_path("/etc/docker/daemon.json").lstrip("/")
    assert backup.read_text() == ORIGINAL
    daemon.unlink()

    plan = plan_revert(host, "docker", ConfigureOptions())
    assert [(c.before, c.after) for c in plan.pending] == [(None, ORIGINAL)]
    assert any("was removed since" in m and "put back" in m for m in plan.messages)
    apply(host, plan, restart=False)
    assert daemon.read_text() == ORIGINAL  # the original is in place before its only copy goes
    assert daemon.stat().st_mode & 0o777 == 0o640  # the backup kept the original's mode
    assert not backup.exists()
    assert records.load(host).files == {}


def test_cli_revert_of_a_deleted_file_restores_it_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = put(tmp_path, "/etc/docker/daemon.json", ORIGINAL)
    host = Host(root=tmp_path, runner=ScriptedRunner())
    configure(host, "docker")
    daemon.unlink()
    capsys.readouterr()
    assert main(["configure-runtime", "docker", "--revert", "--no-restart"], host=host) == 0
    out = capsys.readouterr().out
    assert "nothing to revert" not in out
    assert "restored /etc/docker/daemon.json" in out
    assert daemon.read_text() == ORIGINAL


# -- 2. a file gpunode made, no longer what it wrote -------------------------------------------------------


def test_a_template_with_the_operators_lines_is_kept_and_said_so(tmp_path: Path) -> None:
    host = k3s_node(tmp_path)
    configure(host, "containerd")
    template = tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")
    assert k3s.is_gpunodes(template.read_text())
    edited = template.read_text() + '\n[plugins."io.containerd.cri.v1.images"]\n  # the operator\'s own\n'
    template.write_text(edited)

    plan = revert(host, "containerd")
    assert template.read_text() == edited  # not deleted: those lines are the operator's
    assert plan.kept == (containerd.K3S_TEMPLATE_V3,)
    assert any("kept as it is" in m and "no longer what gpunode wrote" in m for m in plan.messages)
    assert records.load(host).files == {}


def test_a_record_pointed_at_another_file_does_not_delete_it(tmp_path: Path) -> None:
    host = k3s_node(tmp_path)
    configure(host, "containerd")
    passwd = put(tmp_path, "/etc/passwd", "root:x:0:0:root:/root:/bin/bash\n")

    def point_at_passwd(data: dict[str, Any]) -> None:
        data["files"]["/etc/passwd"] = data["files"].pop(containerd.K3S_TEMPLATE_V3)

    edit_record(tmp_path, point_at_passwd)
    plan = revert(host, "containerd")
    assert passwd.read_text() == "root:x:0:0:root:/root:/bin/bash\n"
    assert plan.kept == ("/etc/passwd",)


def test_an_unchanged_template_is_still_removed(tmp_path: Path) -> None:
    host = k3s_node(tmp_path)
    configure(host, "containerd")
    plan = revert(host, "containerd")
    assert plan.kept == ()
    assert not (tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")).exists()


def test_a_record_without_a_checksum_of_what_was_written_loads_and_keeps_the_file(tmp_path: Path) -> None:
    host = k3s_node(tmp_path)
    configure(host, "containerd")
    template = tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")
    written = template.read_text()
    assert records.load(host).files[containerd.K3S_TEMPLATE_V3].written_sha256 == (
        hashlib.sha256(written.encode()).hexdigest()
    )

    def older_format(data: dict[str, Any]) -> None:
        del data["files"][containerd.K3S_TEMPLATE_V3]["written_sha256"]

    edit_record(tmp_path, older_format)
    loaded = records.load(host).files[containerd.K3S_TEMPLATE_V3]
    assert not loaded.written_known
    assert "written_sha256" not in loaded.to_json()  # saved again, it still says it does not know
    plan = revert(host, "containerd")
    assert template.read_text() == written
    assert plan.kept == (containerd.K3S_TEMPLATE_V3,)
    assert any("older gpunode" in m for m in plan.messages)


def test_json_revert_lists_the_kept_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = k3s_node(tmp_path)
    configure(host, "containerd")
    template = tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")
    template.write_text(template.read_text() + "# mine\n")
    capsys.readouterr()
    argv = ["configure-runtime", "containerd", "--revert", "--no-restart", "--json"]
    assert main(argv, host=host) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kept"] == [containerd.K3S_TEMPLATE_V3]
    assert any("kept as it is" in m for m in doc["messages"])
    assert template.exists()


# -- 3. and 4. a restart only for the service that reads the file ------------------------------------------

K3S_1_35 = "k3s version v1.35.3+k3s1 (0f6e2f1c)\ngo version go1.25.7\n"


def restarts_by_default(host: Host, plan: RuntimePlan) -> bool:
    """What `down` and `configure-runtime` decide on the real root (`host.is_real_root and ...`)."""
    return will_restart(host, plan, plan.standard_location)


def test_a_scratch_config_leaves_no_restart_pending_and_its_revert_restarts_nothing(tmp_path: Path) -> None:
    scratch = put(tmp_path, "/tmp/scratch/daemon.json", ORIGINAL)
    put(tmp_path, "/etc/docker/daemon.json", ORIGINAL)  # the file dockerd does read, untouched
    host = Host(root=tmp_path, runner=ScriptedRunner())
    plan = configure(host, "docker", config="/tmp/scratch/daemon.json")
    assert not plan.standard_location
    assert any("does not read /tmp/scratch/daemon.json" in m for m in plan.messages)
    assert records.load(host).restart_pending == set()

    undo = plan_revert(host, "docker", ConfigureOptions())
    assert not restarts_by_default(host, undo)
    scratch.unlink()  # even once the scratch file is gone
    undo = plan_revert(host, "docker", ConfigureOptions())
    assert not restarts_by_default(host, undo)
    assert any("does not read" in m for m in undo.messages)


def test_a_restart_left_pending_by_an_older_gpunode_for_a_scratch_file_is_not_done(
    tmp_path: Path,
) -> None:
    put(tmp_path, "/tmp/scratch/daemon.json", ORIGINAL)
    host = Host(root=tmp_path, runner=ScriptedRunner())
    configure(host, "docker", config="/tmp/scratch/daemon.json")
    edit_record(tmp_path, lambda data: data.update(restart_pending=["docker"]))
    assert not restarts_by_default(host, plan_revert(host, "docker", ConfigureOptions()))


def test_the_default_daemon_json_still_restarts_docker(tmp_path: Path) -> None:
    put(tmp_path, "/etc/docker/daemon.json", ORIGINAL)
    host = Host(root=tmp_path, runner=ScriptedRunner())
    plan = configure(host, "docker")
    assert plan.standard_location and records.load(host).restart_pending == {"docker"}
    undo = plan_revert(host, "docker", ConfigureOptions())
    assert restarts_by_default(host, undo) and undo.unit == "docker.service"


@pytest.mark.parametrize(
    "spelling", ["/etc/docker/./daemon.json", "/etc/docker//daemon.json", "/etc/dl.json"]
)
def test_daemon_json_however_spelled_still_records_the_restart(tmp_path: Path, spelling: str) -> None:
    # The raw string was compared: a restart note was printed but no restart recorded as pending.
    put(tmp_path, "/etc/docker/daemon.json", ORIGINAL)
    (tmp_path / "etc/dl.json").symlink_to("docker/daemon.json")
    host = Host(root=tmp_path, runner=ScriptedRunner())
    plan = configure(host, "docker", config=spelling)
    assert plan.standard_location and records.load(host).restart_pending == {"docker"}
    assert restarts_by_default(host, plan_revert(host, "docker", ConfigureOptions()))


def test_cli_configure_of_a_scratch_file_says_docker_does_not_read_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    put(tmp_path, "/tmp/scratch/daemon.json", ORIGINAL)
    host = Host(root=tmp_path, runner=ScriptedRunner())
    argv = ["configure-runtime", "docker", "--config", "/tmp/scratch/daemon.json"]
    assert main(argv, host=host) == 0
    out = capsys.readouterr().out
    assert "docker.service does not read /tmp/scratch/daemon.json" in out
    assert "for the change to take effect" not in out


def k3s_dropin_node(root: Path) -> Host:
    put(root, containerd.K3S_CONFIG, (K3S_FIXTURES / "v3-k3s-v1.35-dropin.toml").read_text())
    runner = ScriptedRunner()
    runner.answer(["k3s", "--version"], K3S_1_35)
    return Host(root=root, runner=runner)


def test_a_k3s_drop_in_restarts_k3s_and_nothing_once_k3s_is_gone(tmp_path: Path) -> None:
    host = k3s_dropin_node(tmp_path)
    put(tmp_path, "/etc/systemd/system/k3s-agent.service", "[Service]\nExecStart=/usr/local/bin/k3s agent\n")
    put(tmp_path, "/etc/containerd/config.toml", "version = 2\n")  # a containerd of its own beside k3s
    configure(host, "containerd")
    undo = plan_revert(host, "containerd", ConfigureOptions())
    assert undo.unit == "k3s-agent.service" and undo.flavour == "k3s" and restarts_by_default(host, undo)

    shutil.rmtree(tmp_path / "var/lib/rancher")  # k3s-uninstall.sh / k3s-agent-uninstall.sh
    (tmp_path / "etc/systemd/system/k3s-agent.service").unlink()
    undo = plan_revert(host, "containerd", ConfigureOptions())
    assert not restarts_by_default(host, undo)
    assert any("k3s, which is no longer installed" in m for m in undo.messages)


@pytest.mark.parametrize("as_json", [False, True])
def test_an_explicit_revert_restart_for_a_k3s_drop_in_after_k3s_is_gone_restarts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    host = k3s_dropin_node(tmp_path)
    put(tmp_path, "/etc/systemd/system/k3s-agent.service", "[Service]\nExecStart=/usr/local/bin/k3s agent\n")
    put(tmp_path, "/etc/containerd/config.toml", "version = 2\n")  # containerd.service stays installed
    put(tmp_path, "/etc/systemd/system/containerd.service", "[Service]\nExecStart=/usr/bin/containerd\n")
    configure(host, "containerd")
    assert records.load(host).restart_pending == {"containerd"}  # k3s had not been restarted
    shutil.rmtree(tmp_path / "var/lib/rancher")  # k3s-agent-uninstall.sh
    (tmp_path / "etc/systemd/system/k3s-agent.service").unlink()
    runner = host.runner
    assert isinstance(runner, ScriptedRunner)
    runner.answer(["systemctl"])
    runner.calls.clear()

    undo = plan_revert(host, "containerd", ConfigureOptions())
    # containerd.service is installed now, but it never read k3s's drop-in: no restart, even asked for.
    assert not will_restart(host, undo, True)
    argv = ["configure-runtime", "containerd", "--revert", "--restart", "--yes"]
    code = main(argv + (["--json"] if as_json else []), host=host)
    out = capsys.readouterr().out
    assert code == 0, out
    assert not [c for c in runner.calls if c[0] == "systemctl"], runner.calls
    assert records.load(host).files == {} and not records.load(host).restart_pending
    if as_json:
        doc = json.loads(out)
        assert doc["commands"] == [] and doc["restarted"] is None and doc["restart"] is None
        out = " ".join(doc["messages"])
    assert "k3s, which is no longer installed" in out and "nothing to restart" in out
    assert "containerd.service" not in out


def test_a_containerd_drop_in_it_imports_restarts_containerd(tmp_path: Path) -> None:
    put(tmp_path, "/etc/containerd/config.toml", "version = 2\n")
    host = Host(root=tmp_path, runner=ScriptedRunner())
    host.runner.answer(["containerd", "--version"], CONTAINERD_1_6)  # type: ignore[attr-defined]
    configure(host, "containerd", drop_in="/etc/containerd/conf.d/99-nvidia.toml")
    undo = plan_revert(host, "containerd", ConfigureOptions())
    assert undo.unit == "containerd.service" and restarts_by_default(host, undo)


def test_down_reports_the_template_it_kept(tmp_path: Path) -> None:
    host = k3s_node(tmp_path)
    configure(host, "containerd")
    template = tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")
    template.write_text(template.read_text() + "# mine\n")
    step = next(s for s in plan_down(host, DownOptions()) if s.name == "runtime")
    assert step.needed and step.apply is not None
    assert any(d.startswith("note: ") and "kept as it is" in d for d in step.details)
    assert f"kept {containerd.K3S_TEMPLATE_V3}" in step.apply()
    assert template.exists()


def test_a_deleted_file_whose_directory_is_gone_gets_both_back(tmp_path: Path) -> None:
    """`rm -r /etc/docker` after gpunode configured docker: the revert makes the directory again (0755,
    said in the plan) and puts the original back from the backup, which goes only once the original is
    in place."""
    put(tmp_path, "/etc/docker/daemon.json", ORIGINAL)
    host = Host(root=tmp_path, runner=ScriptedRunner())
    configure(host, "docker")
    backup = tmp_path / records.backup_path("/etc/docker/daemon.json").lstrip("/")
    shutil.rmtree(tmp_path / "etc/docker")

    plan = plan_revert(host, "docker", ConfigureOptions())
    assert "will create directory /etc/docker (mode 0755) for /etc/docker/daemon.json" in plan.messages
    assert not (tmp_path / "etc/docker").exists()  # planning changes nothing
    apply(host, plan, restart=False)
    assert (tmp_path / "etc/docker/daemon.json").read_text() == ORIGINAL
    assert (tmp_path / "etc/docker").stat().st_mode & 0o777 == 0o755
    assert not backup.exists()
    assert records.load(host).files == {}


def test_a_failed_put_back_keeps_the_backup(tmp_path: Path) -> None:
    """The directory cannot be made again (a file stands where it was): the revert fails, and the backup,
    the only copy of the original, is still there with its record."""
    put(tmp_path, "/etc/docker/daemon.json", ORIGINAL)
    host = Host(root=tmp_path, runner=ScriptedRunner())
    configure(host, "docker")
    backup = tmp_path / records.backup_path("/etc/docker/daemon.json").lstrip("/")
    shutil.rmtree(tmp_path / "etc/docker")
    plan = plan_revert(host, "docker", ConfigureOptions())
    (tmp_path / "etc/docker").write_text("not a directory\n")
    with pytest.raises(GpunodeError):
        apply(host, plan, restart=False)
    assert backup.read_text() == ORIGINAL
    assert "/etc/docker/daemon.json" in records.load(host).files
