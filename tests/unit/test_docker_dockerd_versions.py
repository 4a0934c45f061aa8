"""daemon.json as the dockerd that reads it sees it: a UTF-8 BOM, the keys of a runtime entry, old records.

gpunode asks the installed `dockerd --version` (scripted here; tests/integration/test_dockerd_versions.py runs
the real 20.10, 26 and 28): dockerd reads a leading BOM from 23.0 on and stops on one before. A runtime entry
holds what dockerd reads — `path` (and the user's `runtimeArgs`) — never nvidia-ctk's `"args": []`, which
dockerd ignores; a record an older gpunode left with such an edit is still undone.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpunode.errors import ConfigError
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import docker, records
from gpunode.runtimes.configure import apply, plan_configure, plan_revert
from gpunode.runtimes.plan import ConfigureOptions, RuntimePlan

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "docker"
DAEMON_JSON = "/etc/docker/daemon.json"
NVIDIA = "/usr/bin/nvidia-container-runtime"
BOM = b"\xef\xbb\xbf"
DOCKERD_20 = "Docker version 20.10.24+dfsg1, build 5d6db84\n"
DOCKERD_26 = "Docker version 26.1.5+dfsg1, build 411e817\n"
DOCKERD_28 = "Docker version 28.5.2+dfsg4, build 3ef3c07c883be49a2e8097bcf6d2952fce1d70eb\n"


def node(root: Path, dockerd: str | None, data: bytes | None) -> tuple[Host, ScriptedRunner, Path]:
    """A root with daemon.json holding `data` (None: none) and, unless `dockerd` is None, a dockerd
    program whose `--version` says `dockerd`."""
    runner = ScriptedRunner()
    if dockerd is not None:
        program = root / "usr/sbin/dockerd"
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text("#!/bin/sh\nexit 1\n")  # found by Host.which; the runner answers for it
        program.chmod(0o755)
        runner.answer(["dockerd", "--version"], dockerd)
    path = root / DAEMON_JSON.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    if data is not None:
        path.write_bytes(data)
    return Host(root=root, runner=runner), runner, path


def configure(host: Host, **options: Any) -> RuntimePlan:
    plan = plan_configure(host, "docker", ConfigureOptions(**options))
    apply(host, plan, restart=False)
    return plan


def revert(host: Host) -> RuntimePlan:
    plan = plan_revert(host, "docker", ConfigureOptions())
    apply(host, plan, restart=False)
    return plan


def loads(data: bytes) -> Any:
    return json.loads(data.removeprefix(BOM))


# -- a UTF-8 byte order mark ------------------------------------------------------------------------


@pytest.mark.parametrize("version", [DOCKERD_26, DOCKERD_28], ids=["dockerd-26", "dockerd-28"])
def test_a_bom_is_kept_where_dockerd_reads_it(tmp_path: Path, version: str) -> None:
    original = (FIXTURES / "bom.json").read_bytes()
    host, runner, path = node(tmp_path, version, original)
    configure(host, set_as_default=True)

    written = path.read_bytes()
    assert written.startswith(BOM) and not written.startswith(BOM * 2)
    doc = loads(written)
    assert doc["runtimes"] == {"nvidia": {"path": NVIDIA}}
    assert doc["default-runtime"] == "nvidia"
    assert {k: doc[k] for k in ("log-driver", "log-opts", "live-restore")} == loads(original)
    assert b'\n    "log-driver"' in written  # the file's own indentation
    assert ("dockerd", "--version") in runner.calls

    state = docker.read_state(host)
    assert state.problems == ()
    assert state.nvidia_runtime == "nvidia" and state.nvidia_is_default

    revert(host)
    assert path.read_bytes() == original


def test_a_bom_only_file_is_repaired_like_an_empty_one_and_keeps_its_bom(tmp_path: Path) -> None:
    host, _, path = node(tmp_path, DOCKERD_28, BOM)
    configure(host)
    written = path.read_bytes()
    assert written.startswith(BOM)
    assert loads(written) == {"runtimes": {"nvidia": {"path": NVIDIA}}}


@pytest.mark.parametrize(
    ("version", "said"),
    [(DOCKERD_20, "dockerd 20.10 refuses"), (None, "cannot tell which dockerd reads the file")],
    ids=["dockerd-20.10", "no-dockerd"],
)
def test_a_bom_is_refused_with_its_fix_where_dockerd_stops_on_it(
    tmp_path: Path, version: str | None, said: str
) -> None:
    original = (FIXTURES / "bom.json").read_bytes()
    host, _, path = node(tmp_path, version, original)
    with pytest.raises(ConfigError) as refused:
        plan_configure(host, "docker", ConfigureOptions(set_as_default=True))
    assert "byte order mark" in refused.value.message
    assert said in refused.value.message
    assert refused.value.fix is not None
    assert f"sed -i '1s/^\\xEF\\xBB\\xBF//' {DAEMON_JSON}" in refused.value.fix
    assert path.read_bytes() == original
    assert not (tmp_path / "var/lib/gpunode").exists()


def test_the_fix_given_for_a_bom_removes_exactly_the_bom(tmp_path: Path) -> None:
    original = (FIXTURES / "bom.json").read_bytes()
    host, _, path = node(tmp_path, DOCKERD_20, original)
    with pytest.raises(ConfigError) as refused:
        plan_configure(host, "docker", ConfigureOptions())
    assert refused.value.fix is not None
    command = refused.value.fix.split(": ", 1)[1].split(" (or", 1)[0]
    argv = [word.replace(DAEMON_JSON, str(path)) for word in shlex.split(command)]
    assert argv[0] == "sed"
    subprocess.run(argv, check=True, timeout=60)
    assert path.read_bytes() == original.removeprefix(BOM)
    configure(host)  # now dockerd 20.10 can read it, and gpunode writes it
    assert loads(path.read_bytes())["runtimes"]["nvidia"] == {"path": NVIDIA}


def test_doctor_reports_a_bom_only_where_dockerd_stops_on_it(tmp_path: Path) -> None:
    data = BOM + b'{"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}}}\n'
    for version, refused in ((DOCKERD_20, True), (DOCKERD_26, False), (DOCKERD_28, False)):
        host, _, _ = node(tmp_path, version, data)
        state = docker.read_state(host)
        assert state.nvidia_runtime == "nvidia"
        assert any("byte order mark" in p for p in state.problems) == refused, (version, state.problems)


def test_dockerd_is_asked_its_version_only_when_the_answer_matters(tmp_path: Path) -> None:
    host, runner, _ = node(tmp_path, DOCKERD_28, b'{"debug": true}\n')
    docker.read_state(host)
    configure(host)
    assert ("dockerd", "--version") not in runner.calls


@pytest.mark.parametrize(
    ("output", "version"),
    [
        (DOCKERD_20, (20, 10)),
        (DOCKERD_28, (28, 5)),
        ("Docker version 1.13.1, build 092cba3\n", (1, 13)),
        ("dockerd: unknown flag\n", None),
    ],
    ids=["20.10", "28", "1.13", "no-version"],
)
def test_dockerd_version_is_read_from_its_output(output: str, version: tuple[int, int] | None) -> None:
    assert docker.parse_dockerd_version(output) == version


# -- the keys of a runtime entry --------------------------------------------------------------------


def test_a_new_runtime_entry_holds_only_what_dockerd_reads(tmp_path: Path) -> None:
    host, _, path = node(tmp_path, None, b'{"debug": true}\n')
    configure(host, runtime_name="gpu")
    assert json.loads(path.read_bytes())["runtimes"] == {"gpu": {"path": NVIDIA}}


def test_an_existing_entry_keeps_its_own_keys(tmp_path: Path) -> None:
    entry = {"path": "/opt/old/nvidia-container-runtime", "runtimeArgs": ["--debug"], "args": []}
    host, _, path = node(tmp_path, None, json.dumps({"runtimes": {"nvidia": entry}}).encode())
    configure(host)
    assert json.loads(path.read_bytes())["runtimes"]["nvidia"] == {**entry, "path": NVIDIA}


def test_an_nvidia_ctk_file_gets_the_path_and_keeps_the_rest(tmp_path: Path) -> None:
    original = (FIXTURES / "nvidia-ctk.json").read_bytes()
    host, _, path = node(tmp_path, None, original)
    configure(host, set_as_default=True)
    assert json.loads(path.read_bytes()) == {
        "default-runtime": "nvidia",
        "runtimes": {"nvidia": {"args": [], "path": NVIDIA}},
    }
    revert(host)
    assert path.read_bytes() == original


@pytest.mark.parametrize("version", [DOCKERD_20, DOCKERD_28, None], ids=["20.10", "28", "none"])
def test_a_shim_runtime_entry_is_refused_not_given_a_path(tmp_path: Path, version: str | None) -> None:
    original = (FIXTURES / "shim-runtime.json").read_bytes()
    host, _, path = node(tmp_path, version, original)
    with pytest.raises(ConfigError) as refused:
        plan_configure(host, "docker", ConfigureOptions())
    assert "runtimes.nvidia is a containerd shim (runtimeType and options)" in refused.value.message
    assert refused.value.fix is not None and "--runtime-name" in refused.value.fix
    assert path.read_bytes() == original
    configure(host, runtime_name="gpu")  # another name is fine: the shim entry stays as it was
    doc = json.loads(path.read_bytes())
    assert doc["runtimes"]["nvidia"] == json.loads(original)["runtimes"]["nvidia"]
    assert doc["runtimes"]["gpu"] == {"path": NVIDIA}


@pytest.mark.parametrize(
    ("version", "refused"),
    [(DOCKERD_20, False), (DOCKERD_26, True), (None, True)],
    ids=["20.10", "26", "none"],
)
def test_a_path_next_to_shim_keys_is_refused_where_dockerd_knows_them(
    tmp_path: Path, version: str | None, refused: bool
) -> None:
    entry = {"path": "/usr/bin/kata-runtime", "runtimeType": "io.containerd.kata.v2"}
    host, _, _ = node(tmp_path, version, json.dumps({"runtimes": {"kata": entry}}).encode())
    if not refused:
        configure(host)  # dockerd 20.10 ignores runtimeType: the file is fine for it
        return
    with pytest.raises(ConfigError, match=r"runtimes.kata has both path and runtimeType: dockerd refuses"):
        plan_configure(host, "docker", ConfigureOptions())


# -- records an older gpunode wrote (it added "args": []) ------------------------------------------


def old_gpunode_run(root: Path, original: bytes) -> tuple[Host, Path, bytes]:
    """The state a gpunode that wrote `{"path": ..., "args": []}` left: its file, backup and record (the
    record as that version wrote it: the created `runtimes` table, then the entry)."""
    host, _, path = node(root, None, original)
    doc = json.loads(original)
    created_table = "runtimes" not in doc
    doc.setdefault("runtimes", {})["nvidia"] = {"path": NVIDIA, "args": []}
    written = (json.dumps(doc, indent=4) + "\n").encode()
    path.write_bytes(written)
    backup = root / records.backup_path(DAEMON_JSON).lstrip("/")
    backup.parent.mkdir(parents=True)
    backup.write_bytes(original)
    edits: list[dict[str, Any]] = []
    if created_table:
        edits.append({"path": ["runtimes"], "op": "table", "after": {}})
    edits.append({"path": ["runtimes", "nvidia"], "op": "set", "after": {"path": NVIDIA, "args": []}})
    record = {
        "version": 1,
        "files": {
            DAEMON_JSON: {
                "runtime": "docker",
                "original_sha256": records.sha256(original),
                "written_sha256": records.sha256(written),
                "backup": records.backup_path(DAEMON_JSON),
                "owned": False,
                "edits": edits,
            }
        },
    }
    (root / records.RECORDS.lstrip("/")).write_text(json.dumps(record, indent=2) + "\n")
    return host, path, written


@pytest.mark.parametrize("original", [b'{"debug": true}\n', b'{"runtimes": {"kata": {"path": "/k"}}}\n'])
def test_an_old_record_with_args_is_reverted_byte_for_byte(tmp_path: Path, original: bytes) -> None:
    host, path, _ = old_gpunode_run(tmp_path, original)
    configure(host)  # today's gpunode finds the entry in place: nothing to change, the record stays
    revert(host)
    assert path.read_bytes() == original
    assert records.load(host).files == {}


def test_an_old_record_with_args_is_undone_in_a_file_edited_since(tmp_path: Path) -> None:
    host, path, written = old_gpunode_run(tmp_path, b'{"debug": true}\n')
    doc = json.loads(written)
    doc["log-level"] = "warn"  # the user's change after gpunode's
    path.write_text(json.dumps(doc) + "\n")
    plan = revert(host)
    assert json.loads(path.read_bytes()) == {"debug": True, "log-level": "warn"}
    assert any("edited since" in m for m in plan.messages)
