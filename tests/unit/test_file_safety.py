"""The files gpunode changes, and the way back, under hostile or unlucky conditions (issue 13).

One file under two names, links on the real root and under --root, a dangling link, another program writing
the file meanwhile, extended attributes and ACLs, records that lie, `--restart` after a run that did not
restart, and a revert killed (SIGKILL, a real process) at every write, fsync, rename and unlink.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpunode.host
from gpunode.cli.main import main
from gpunode.errors import ConcurrentChange, ExitCode, NotFound
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import configure, containerd, docker, records, service
from gpunode.runtimes.plan import ConfigureOptions
from tests.killharness import fake_containerd_env, gpunode_process

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20 1.6.20~ds1-1\n"
STOCK = (FIXTURES / "containerd/default-v2.toml").read_bytes()
CONFIG = containerd.DEFAULT_CONFIG
DAEMON_JSON = docker.DAEMON_JSON
COMPACT_DAEMON_JSON = b'{"log-driver":"journald","live-restore":true}'


def node(root: Path) -> tuple[Host, ScriptedRunner]:
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], CONTAINERD_1_6)
    return Host(root=root, runner=runner), runner


def local(root: Path, host_path: str) -> Path:
    return root / host_path.lstrip("/")


def put(root: Path, host_path: str, data: bytes) -> Path:
    path = local(root, host_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def cli(host: Host, *args: str) -> int:
    return main(["configure-runtime", *args], host=host)


# -- one file, one identity ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("/etc/containerd/config.toml", "/etc/containerd//config.toml"),
        ("/etc/containerd/./config.toml", "/etc/containerd/../containerd/config.toml"),
        ("/etc/containerd/link.toml", "/etc/containerd/config.toml"),  # a link, then its target
        ("/etc/containerd/config.toml", "/etc/containerd/link.toml"),  # the target, then a link
    ],
)
def test_one_file_under_two_names_keeps_the_original_backup(tmp_path: Path, first: str, second: str) -> None:
    put(tmp_path, CONFIG, STOCK)
    os.symlink("config.toml", local(tmp_path, "/etc/containerd/link.toml"))
    host, _ = node(tmp_path)
    assert cli(host, "containerd", "--config", first, "--no-restart") == ExitCode.OK
    configured = local(tmp_path, CONFIG).read_bytes()
    assert cli(host, "containerd", "--config", second, "--set-as-default", "--no-restart") == ExitCode.OK
    assert local(tmp_path, CONFIG).read_bytes() != configured
    assert list(records.load(host).files) == [CONFIG]
    assert local(tmp_path, records.backup_path(CONFIG)).read_bytes() == STOCK
    # Reverting under either name, or without naming the file, gives back the original byte for byte.
    assert cli(host, "containerd", "--revert", "--config", second, "--no-restart") == ExitCode.OK
    assert local(tmp_path, CONFIG).read_bytes() == STOCK
    assert os.path.islink(local(tmp_path, "/etc/containerd/link.toml"))
    assert not local(tmp_path, records.RECORDS).exists()


# -- links are written through, never replaced ---------------------------------------------------------


def test_a_link_on_the_real_root_is_written_through(tmp_path: Path) -> None:
    """Host() is the real root: there the kernel, not gpunode, resolved the path, and the rename used to
    replace the link with a regular file."""
    target = tmp_path / "real" / "daemon.json"
    target.parent.mkdir()
    target.write_bytes(COMPACT_DAEMON_JSON)
    link = tmp_path / "daemon.json"
    link.symlink_to(target)
    host = Host()
    outcome = host.write_file(str(link), b"{}\n", backup_to=str(tmp_path / "backups" / "daemon.json"))
    assert outcome.changed
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == b"{}\n"
    assert (tmp_path / "backups" / "daemon.json").read_bytes() == COMPACT_DAEMON_JSON
    assert host.canonical(str(link)) == str(target)
    assert host.canonical(str(tmp_path / "real" / ".." / "real" / "daemon.json")) == str(target)


def test_a_link_to_a_link_on_the_real_root_reaches_the_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("old\n")
    (tmp_path / "one").symlink_to("file")
    (tmp_path / "two").symlink_to(tmp_path / "one")
    Host().write_file(str(tmp_path / "two"), "new\n")
    assert (tmp_path / "two").is_symlink() and (tmp_path / "one").is_symlink()
    assert (tmp_path / "file").read_text() == "new\n"


@pytest.mark.parametrize("real_root", [True, False], ids=["real-root", "under-root"])
def test_a_dangling_link_is_refused_and_left_in_place(tmp_path: Path, real_root: bool) -> None:
    link = tmp_path / "etc" / "docker" / "daemon.json"
    link.parent.mkdir(parents=True)
    link.symlink_to("/nonexistent/daemon.json" if not real_root else str(tmp_path / "missing.json"))
    host = Host() if real_root else Host(root=tmp_path)
    path = str(link) if real_root else DAEMON_JSON
    with pytest.raises(NotFound, match=r"symbolic link to .*which does not exist"):
        host.write_file(path, "{}\n")
    assert link.is_symlink() and not link.exists()
    assert not (tmp_path / "missing.json").exists() and not (tmp_path / "nonexistent").exists()


def test_configure_refuses_a_dangling_link_in_the_plan_dry_run_included(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local(tmp_path, DAEMON_JSON).parent.mkdir(parents=True)
    os.symlink("/srv/docker/daemon.json", local(tmp_path, DAEMON_JSON))
    host, _ = node(tmp_path)
    for extra in (("--dry-run",), ("--no-restart",)):
        assert cli(host, "docker", *extra) == ExitCode.NOT_FOUND
        err = capsys.readouterr().err
        assert "/etc/docker/daemon.json is a symbolic link to /srv/docker/daemon.json" in err
        assert "fix:" in err and "Traceback" not in err
    assert local(tmp_path, DAEMON_JSON).is_symlink()
    assert not (tmp_path / "srv").exists() and not local(tmp_path, records.RECORDS).exists()


def test_revert_and_rollback_never_delete_a_link(tmp_path: Path) -> None:
    put(tmp_path, "/srv/daemon.json", COMPACT_DAEMON_JSON)
    os.makedirs(local(tmp_path, "/etc/docker"))
    os.symlink("/srv/daemon.json", local(tmp_path, DAEMON_JSON))
    host, _ = node(tmp_path)
    assert cli(host, "docker", "--set-as-default", "--no-restart") == ExitCode.OK
    assert local(tmp_path, DAEMON_JSON).is_symlink()
    assert cli(host, "docker", "--revert", "--no-restart") == ExitCode.OK
    assert local(tmp_path, DAEMON_JSON).is_symlink()
    assert local(tmp_path, "/srv/daemon.json").read_bytes() == COMPACT_DAEMON_JSON
    with pytest.raises(gpunode.errors.ConfigError, match="symbolic link"):
        host.remove_file(DAEMON_JSON)
    assert local(tmp_path, DAEMON_JSON).is_symlink()


def test_exact_mode_gives_gpunodes_own_files_their_mode_whatever_was_there(tmp_path: Path) -> None:
    """A keyring or a unit file: its mode is gpunode's choice, not that of the file (or link target) it
    replaces; the same content with a wrong mode is rewritten."""
    keyring = tmp_path / "keyring.gpg"
    keyring.write_bytes(b"key")
    keyring.chmod(0o600)
    link = tmp_path / "link.gpg"
    link.symlink_to(keyring)
    host = Host()
    assert host.write_file(str(link), b"key", mode=0o644, exact_mode=True).changed
    assert stat.S_IMODE(keyring.stat().st_mode) == 0o644 and link.is_symlink()
    assert not host.write_file(str(link), b"key", mode=0o644, exact_mode=True).changed
    unit = tmp_path / "unit.service"
    unit.write_text("[Unit]\n")
    unit.chmod(0o666)
    host.write_file(str(unit), "[Unit]\nDescription=x\n", mode=0o644, exact_mode=True)
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    # Without exact_mode an operator's file keeps its own mode.
    host.write_file(str(unit), "[Unit]\n")
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644


# -- concurrent edits are never lost -----------------------------------------------------------------


def test_a_file_changed_between_plan_and_write_is_not_overwritten(tmp_path: Path) -> None:
    put(tmp_path, DAEMON_JSON, COMPACT_DAEMON_JSON)
    host, _ = node(tmp_path)
    plan = configure.plan_configure(host, "docker", ConfigureOptions(set_as_default=True))
    put(tmp_path, DAEMON_JSON, b'{"debug": true}\n')  # an editor saves while gpunode plans
    with pytest.raises(ConcurrentChange, match="changed by another program"):
        configure.apply(host, plan, restart=False)
    assert local(tmp_path, DAEMON_JSON).read_bytes() == b'{"debug": true}\n'
    assert not local(tmp_path, records.RECORDS).exists()
    assert not local(tmp_path, records.backup_path(DAEMON_JSON)).exists()


def test_a_change_right_before_the_rename_stops_the_write_and_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last check is under the lock, after the temp file is complete: another writer that does not take
    gpunode's lock and saves in that instant still wins, and the files this run wrote before go back."""
    put(tmp_path, CONFIG, b"version = 2\n")
    host, _ = node(tmp_path)
    opts = ConfigureOptions(set_as_default=True, drop_in="/etc/containerd/conf.d/99-nvidia.toml")
    plan = configure.plan_configure(host, "containerd", opts)
    assert [c.path for c in plan.pending] == ["/etc/containerd/conf.d/99-nvidia.toml", CONFIG]
    real_write = gpunode.host._atomic_write

    def racing(target: Path, *args: object, **kwargs: object) -> None:
        if target == local(tmp_path, CONFIG):
            target.write_bytes(b"version = 2\n# edited meanwhile\n")
        real_write(target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gpunode.host, "_atomic_write", racing)
    with pytest.raises(ConcurrentChange) as caught:
        configure.apply(host, plan, restart=False)
    assert "put back the previous content" in caught.value.message
    assert local(tmp_path, CONFIG).read_bytes() == b"version = 2\n# edited meanwhile\n"
    assert not local(tmp_path, "/etc/containerd/conf.d/99-nvidia.toml").exists()
    assert not local(tmp_path, records.RECORDS).exists()
    assert not list(tmp_path.rglob("*.gpunode-tmp"))


# -- attributes survive --------------------------------------------------------------------------------


def _require(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is missing: ./install.sh --dev installs it (Debian package acl)")
        pytest.skip(f"{tool} is not installed")
    return found


def test_extended_attributes_acls_and_selinux_label_survive_configure_and_revert(tmp_path: Path) -> None:
    setfacl, getfacl = _require("setfacl"), _require("getfacl")
    path = put(tmp_path, DAEMON_JSON, COMPACT_DAEMON_JSON)
    path.chmod(0o640)
    subprocess.run([setfacl, "-m", "u:65534:r", str(path)], check=True)
    os.setxattr(path, "user.origin", b"cloud-init")
    label = b"system_u:object_r:container_config_t:s0\x00"
    os.setxattr(path, "security.selinux", label)

    def acl() -> str:
        out = subprocess.run([getfacl, "-cpn", str(path)], check=True, capture_output=True, text=True).stdout
        return "".join(sorted(out.splitlines(keepends=True)))

    before = acl()
    assert "user:65534:r--" in before
    host, _ = node(tmp_path)
    for args in (("--set-as-default", "--no-restart"), ("--revert", "--no-restart")):
        assert cli(host, "docker", *args) == ExitCode.OK
        assert acl() == before
        assert os.getxattr(path, "user.origin") == b"cloud-init"
        assert os.getxattr(path, "security.selinux") == label
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.read_bytes() == COMPACT_DAEMON_JSON


# -- records are not trusted blindly ------------------------------------------------------------------


def _configured_docker(tmp_path: Path) -> Host:
    put(tmp_path, DAEMON_JSON, COMPACT_DAEMON_JSON)
    host, _ = node(tmp_path)
    assert cli(host, "docker", "--set-as-default", "--no-restart") == ExitCode.OK
    return host


def test_a_record_pointing_outside_the_backup_directory_stops_revert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = _configured_docker(tmp_path)
    configured = local(tmp_path, DAEMON_JSON).read_bytes()
    put(tmp_path, "/etc/shadow-copy", COMPACT_DAEMON_JSON)
    rec = local(tmp_path, records.RECORDS)
    rec.write_text(rec.read_text().replace(records.backup_path(DAEMON_JSON), "/etc/shadow-copy"))
    capsys.readouterr()
    assert cli(host, "docker", "--revert", "--no-restart") == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "outside /var/lib/gpunode/backups" in err and "fix:" in err
    assert local(tmp_path, DAEMON_JSON).read_bytes() == configured


def test_a_backup_whose_checksum_differs_stops_revert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = _configured_docker(tmp_path)
    configured = local(tmp_path, DAEMON_JSON).read_bytes()
    local(tmp_path, records.backup_path(DAEMON_JSON)).write_bytes(b'{"planted": true}')
    capsys.readouterr()
    assert cli(host, "docker", "--revert", "--no-restart") == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "is not the original gpunode recorded" in err
    assert local(tmp_path, DAEMON_JSON).read_bytes() == configured
    assert local(tmp_path, records.RECORDS).exists()


def test_a_backup_reached_through_a_link_out_of_the_backup_directory_is_refused(tmp_path: Path) -> None:
    host = _configured_docker(tmp_path)
    backup = local(tmp_path, records.backup_path(DAEMON_JSON))
    put(tmp_path, "/srv/evil.json", COMPACT_DAEMON_JSON)
    backup.unlink()
    backup.symlink_to("/srv/evil.json")
    assert cli(host, "docker", "--revert", "--no-restart") == ExitCode.CONFIG


# -- --restart means restart -----------------------------------------------------------------------


def _restarts(runner: ScriptedRunner) -> list[tuple[str, ...]]:
    return [c for c in runner.calls if c[:2] == ("systemctl", "restart")]


def test_restart_after_a_run_that_did_not_restart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    put(tmp_path, DAEMON_JSON, COMPACT_DAEMON_JSON)
    host, runner = node(tmp_path)
    runner.answer(["systemctl", "restart", "docker.service"])
    runner.answer(["docker"], '{"nvidia":{},"runc":{}}\tnvidia\n')
    assert cli(host, "docker", "--set-as-default", "--no-restart") == ExitCode.OK
    assert "run this command again with --restart" in capsys.readouterr().out
    assert records.load(host).restart_pending == {"docker"}
    # Nothing left to write, but the runtime never read the change: --restart restarts it.
    assert cli(host, "docker", "--set-as-default", "--restart", "--yes") == ExitCode.OK
    out = capsys.readouterr().out
    assert "already configured" in out and "restarted docker.service" in out
    assert _restarts(runner) == [("systemctl", "restart", "docker.service")]
    assert records.load(host).restart_pending == set()
    # And once it has, a further --restart has nothing to do.
    assert cli(host, "docker", "--set-as-default", "--restart", "--yes") == ExitCode.OK
    assert len(_restarts(runner)) == 1


def test_a_run_killed_between_the_rename_and_the_restart_is_detected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(tmp_path, DAEMON_JSON, COMPACT_DAEMON_JSON)
    host, runner = node(tmp_path)
    runner.answer(["systemctl", "restart", "docker.service"])
    runner.answer(["docker"], '{"nvidia":{},"runc":{}}\tnvidia\n')

    def killed(*_: object, **__: object) -> None:
        raise KeyboardInterrupt  # the process dies right after the rename, before systemctl ran

    monkeypatch.setattr(service, "restart", killed)
    monkeypatch.setattr(configure, "_roll_back", killed)  # a killed process puts nothing back
    assert cli(host, "docker", "--set-as-default", "--restart", "--yes") == ExitCode.INTERRUPTED
    assert b"nvidia" in local(tmp_path, DAEMON_JSON).read_bytes()
    monkeypatch.undo()
    assert cli(host, "docker", "--set-as-default", "--restart", "--yes") == ExitCode.OK
    assert _restarts(runner) == [("systemctl", "restart", "docker.service")]


def test_a_revert_without_restart_after_a_configure_without_restart_leaves_no_record(tmp_path: Path) -> None:
    put(tmp_path, DAEMON_JSON, COMPACT_DAEMON_JSON)
    host, runner = node(tmp_path)
    assert cli(host, "docker", "--set-as-default", "--no-restart") == ExitCode.OK
    assert cli(host, "docker", "--revert", "--no-restart") == ExitCode.OK
    assert not local(tmp_path, records.RECORDS).exists()
    assert not _restarts(runner)


# -- revert is as crash-safe as apply: a real SIGKILL at every step ----------------------------------


@pytest.fixture(scope="module")
def fake_containerd() -> Iterator[dict[str, str]]:
    with fake_containerd_env() as env:
        yield env


DROP_IN = "/etc/containerd/conf.d/99-nvidia.toml"
CONFIGURE = ("configure-runtime", "containerd", "--set-as-default", "--drop-in", DROP_IN, "--no-restart")
REVERT = ("configure-runtime", "containerd", "--revert", "--no-restart")
ORIGINAL = (
    b"version = 2\n"
    b'[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
    b"SystemdCgroup = true\n"
)


@pytest.mark.parametrize("step", ["fsync", "rename", "write", "unlink"])
def test_revert_killed_at_every_step_is_finished_by_the_next_revert(
    step: str, tmp_path: Path, fake_containerd: dict[str, str]
) -> None:
    """Two files (the main file, restored from its backup, and the drop-in, removed), then the records, then
    the backup: a revert killed anywhere leaves each file old or new, the record still naming every file not
    yet restored, and a second revert that ends with the original bytes and no trace of gpunode."""
    killed = 0
    for n in range(1, 40):
        root = tmp_path / f"{step}-{n}"
        put(root, CONFIG, ORIGINAL)
        assert gpunode_process(root, fake_containerd, *CONFIGURE) == 0
        configured = {p: local(root, p).read_bytes() for p in (CONFIG, DROP_IN)}
        code = gpunode_process(root, fake_containerd, *REVERT, kill=(step, n))
        if code == 0:
            break
        assert code == -signal.SIGKILL, f"revert killed at {step} #{n} exited {code}"
        killed += 1
        main_now = local(root, CONFIG).read_bytes()
        assert main_now in (ORIGINAL, configured[CONFIG]), (
            f"{CONFIG} half-written after a kill at {step} #{n}"
        )
        drop_now = local(root, DROP_IN).read_bytes() if local(root, DROP_IN).exists() else None
        assert drop_now in (None, configured[DROP_IN])
        # The record forgets nothing before the file is restored.
        rec = records.load(Host(root=root)).files if local(root, records.RECORDS).exists() else {}
        if main_now != ORIGINAL:
            assert CONFIG in rec, f"a kill at {step} #{n} lost the record of {CONFIG}"
        if drop_now is not None:
            assert DROP_IN in rec, f"a kill at {step} #{n} lost the record of {DROP_IN}"
        # The second revert completes the job.
        again = gpunode_process(root, fake_containerd, *REVERT)
        assert again in (0, ExitCode.NOT_FOUND), f"second revert after a kill at {step} #{n} exited {again}"
        if again == ExitCode.NOT_FOUND:  # the kill came after the record was gone: nothing was left to do
            assert not rec
        assert local(root, CONFIG).read_bytes() == ORIGINAL
        assert not local(root, DROP_IN).exists()
        assert not local(root, records.RECORDS).exists()
        leftovers = [p for p in root.rglob("*") if p.is_file() and "gpunode" in str(p.relative_to(root))]
        assert not [p for p in leftovers if p.suffix != ".lock"], (
            f"left after a kill at {step} #{n}: {leftovers}"
        )
    else:
        raise AssertionError(f"revert never completed with {step} patched")
    assert killed >= 1


# -- the real root, in a private mount namespace -----------------------------------------------------------

NAMESPACE_CHILD = r"""
import json, os, subprocess, sys

# Private tmpfs over the directories gpunode writes: nothing reaches the host's /etc/docker or /var/lib.
for directory in ("/etc/docker", "/var/lib"):
    os.makedirs(directory, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", directory], check=True)
os.makedirs("/etc/docker/real")
with open("/etc/docker/real/daemon.json", "w") as fh:
    fh.write('{"log-driver":"journald","live-restore":true}')
os.symlink("real/daemon.json", "/etc/docker/daemon.json")
os.symlink("/etc/docker/nowhere.json", "/etc/docker/dangling.json")

from gpunode.cli.main import main

result = {}
result["configure"] = main(["configure-runtime", "docker", "--set-as-default", "--no-restart"])
result["link_kept"] = os.path.islink("/etc/docker/daemon.json")
result["target"] = open("/etc/docker/real/daemon.json").read()
result["backup"] = open("/var/lib/gpunode/backups/etc/docker/real/daemon.json").read()
LINK = "/etc/docker/daemon.json"
result["revert"] = main(["configure-runtime", "docker", "--revert", "--no-restart", "--config", LINK])
result["link_kept_after_revert"] = os.path.islink("/etc/docker/daemon.json")
result["after_revert"] = open("/etc/docker/real/daemon.json").read()
DANGLING = "/etc/docker/dangling.json"
result["dangling"] = main(["configure-runtime", "docker", "--no-restart", "--config", DANGLING])
result["dangling_kept"] = os.path.islink(DANGLING) and not os.path.exists("/etc/docker/nowhere.json")
print("RESULT " + json.dumps(result))
"""


def test_links_on_the_real_root_through_the_cli_in_a_private_mount_namespace() -> None:
    """The CLI on the real root (no --root), where the kernel resolves paths: /etc/docker/daemon.json is a
    link; configure writes through it, keeps the original under the target's canonical name, revert restores
    it through the link's name, and a dangling link is refused and left."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("this test needs root and unshare (util-linux)")
        pytest.skip("needs root and unshare")
    argv = [unshare, "--mount", "--propagation", "private", sys.executable, "-c", NAMESPACE_CHILD]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["configure"] == ExitCode.OK, done.stderr
    assert result["link_kept"] and '"default-runtime": "nvidia"' in result["target"]
    assert result["backup"] == COMPACT_DAEMON_JSON.decode()
    assert result["revert"] == ExitCode.OK, done.stderr
    assert result["link_kept_after_revert"] and result["after_revert"] == COMPACT_DAEMON_JSON.decode()
    assert result["dangling"] == ExitCode.NOT_FOUND and result["dangling_kept"]
    assert "/etc/docker/dangling.json is a symbolic link to /etc/docker/nowhere.json" in done.stderr
