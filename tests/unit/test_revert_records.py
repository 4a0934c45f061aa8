"""`configure-runtime --revert` tells the truth about what it finds (issue 23): the only copy of an
original is never deleted, and a file gpunode made is removed only while it is still what gpunode wrote."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from gpunode.cli.main import main
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import containerd, k3s, records
from gpunode.runtimes.configure import apply, plan_configure, plan_revert
from gpunode.runtimes.plan import ConfigureOptions, RuntimePlan

K3S_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "containerd" / "k3s"
K3S_1_32 = "k3s version v1.32.2+k3s1 (381620ef)\ngo version go1.23.6\n"
ORIGINAL = '{\n  "log-driver": "journald"\n}\n'


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
