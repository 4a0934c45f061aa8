"""The host seam: root mapping, reads with clear errors, atomic writes with backups."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpunode.errors import CommandFailed, ConfigError, NotFound
from gpunode.host import Host, ScriptedRunner, SubprocessRunner


def test_paths_are_mapped_under_the_root(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    assert host.path("/etc/docker/daemon.json") == tmp_path / "etc/docker/daemon.json"
    with pytest.raises(ValueError, match="absolute"):
        host.path("etc/x")


def test_read_errors_name_the_file(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    with pytest.raises(NotFound, match=r"/etc/missing\.conf does not exist"):
        host.read_text("/etc/missing.conf")
    (tmp_path / "etc").mkdir()
    with pytest.raises(ConfigError, match="/etc is a directory where a file was expected"):
        host.read_text("/etc")
    (tmp_path / "etc/bin.conf").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"/etc/bin.conf is not a UTF-8 text file"):
        host.read_text("/etc/bin.conf")
    assert host.read_text_if_exists("/etc/missing.conf") is None


def test_which_looks_under_the_root(tmp_path: Path) -> None:
    host = Host(root=tmp_path, env={"PATH": "/usr/sbin:/usr/bin"})
    assert host.which("nvidia-ctk") is None
    exe = tmp_path / "usr/bin/nvidia-ctk"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    assert host.which("nvidia-ctk") is None  # not executable
    exe.chmod(0o755)
    assert host.which("nvidia-ctk") == "/usr/bin/nvidia-ctk"


def test_write_creates_a_new_file_with_the_given_mode(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    (tmp_path / "etc").mkdir()
    outcome = host.write_file("/etc/new.conf", "hello\n", mode=0o600)
    assert outcome.changed and outcome.backup is None
    assert (tmp_path / "etc/new.conf").read_text() == "hello\n"
    assert stat.S_IMODE((tmp_path / "etc/new.conf").stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / "etc").iterdir()] == ["new.conf"]  # no temp file left behind


def test_write_keeps_mode_owner_and_first_backup(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    target = tmp_path / "daemon.json"
    target.write_text("original\n")
    target.chmod(0o640)
    os.chown(target, 1234, 4321)
    first = host.write_file("/daemon.json", "changed once\n", backup_to="/var/backups/daemon.json")
    assert first.changed and first.backup == tmp_path / "var/backups/daemon.json"
    host.write_file("/daemon.json", "changed twice\n", backup_to="/var/backups/daemon.json")
    st = target.stat()
    assert target.read_text() == "changed twice\n"
    assert stat.S_IMODE(st.st_mode) == 0o640 and (st.st_uid, st.st_gid) == (1234, 4321)
    backup = tmp_path / "var/backups/daemon.json"
    assert stat.S_IMODE(backup.parent.stat().st_mode) == 0o700  # backups may hold secrets (registry auth)
    assert backup.read_text() == "original\n"  # the file as it was before gpunode, never overwritten
    assert stat.S_IMODE(backup.stat().st_mode) == 0o640


def test_unchanged_content_is_not_rewritten(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    target = tmp_path / "config.toml"
    target.write_text("same\n")
    os.utime(target, ns=(1_000_000_000, 1_000_000_000))
    inode = target.stat().st_ino
    outcome = host.write_file("/config.toml", "same\n", backup_to="/bak/config.toml")
    assert not outcome.changed
    assert target.stat().st_mtime_ns == 1_000_000_000 and target.stat().st_ino == inode
    assert not (tmp_path / "bak").exists()


def test_write_follows_symlinks_within_the_root(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    (tmp_path / "etc/containerd").mkdir(parents=True)
    (tmp_path / "opt/conf").mkdir(parents=True)
    (tmp_path / "opt/conf/config.toml").write_text("old\n")
    # An absolute link target is a host path: it must be re-rooted, not followed on this machine.
    (tmp_path / "etc/containerd/config.toml").symlink_to("/opt/conf/config.toml")
    host.write_file("/etc/containerd/config.toml", "new\n")
    assert (tmp_path / "etc/containerd/config.toml").is_symlink()
    assert (tmp_path / "opt/conf/config.toml").read_text() == "new\n"


def test_write_refuses_directories_and_missing_parents(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    (tmp_path / "adir").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        host.write_file("/adir", "x")
    with pytest.raises(NotFound, match="directory /nope does not exist"):
        host.write_file("/nope/file", "x")


def test_failed_write_leaves_the_original_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = Host(root=tmp_path)
    target = tmp_path / "f.conf"
    target.write_text("keep me\n")

    def broken_rename(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", broken_rename)
    with pytest.raises(CommandFailed, match="no space left"):
        host.write_file("/f.conf", "new\n")
    assert target.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.conf"]  # the backup write failed first


def test_concurrent_writers_do_not_interleave(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(20):
                host.write_file("/shared.conf", f"writer {n} round {i}\n" * 50)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    lines = set((tmp_path / "shared.conf").read_text().splitlines())
    assert len(lines) == 1  # one writer's whole content, never a mix
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".gpunode-tmp")]


def test_subprocess_runner_uses_argument_lists_and_reports_failures() -> None:
    runner = SubprocessRunner()
    result = runner.run(["sh", "-c", 'printf "%s" "$1"', "sh", "a b; rm -rf /"], timeout=5)
    assert result.ok and result.stdout == "a b; rm -rf /"
    failed = runner.run(["sh", "-c", "echo boom >&2; exit 3"], timeout=5)
    with pytest.raises(CommandFailed, match=r"exited with status 3:\nboom"):
        failed.check()
    with pytest.raises(CommandFailed, match="is not installed"):
        runner.run(["/nonexistent/gpunode-test-program"], timeout=5)
    with pytest.raises(CommandFailed, match=r"did not finish within 0\.2 s"):
        runner.run(["sleep", "5"], timeout=0.2)


def test_output_that_is_not_utf8_is_decoded_tolerantly(tmp_path: Path) -> None:
    # journalctl prints a unit's log as it was written (a Latin-1 byte, a cut multi-byte character): the
    # runner must hand it over, not fail while gpunode is in the middle of a change.
    program = tmp_path / "prints-ff"
    program.write_text("#!/bin/sh\nprintf 'caf\\351 \\377\\n'\nprintf '\\377' >&2\n")
    program.chmod(0o755)
    result = SubprocessRunner().run([str(program)], timeout=10)
    assert result.ok and result.stdout == "caf\ufffd \ufffd\n" and result.stderr == "\ufffd"
    seen: list[str] = []
    streamed = Host(runner=SubprocessRunner()).stream([str(program)], timeout=10, on_line=seen.append)
    assert streamed.ok and "caf\ufffd \ufffd" in seen


def test_scripted_runner_answers_by_longest_prefix() -> None:
    runner = ScriptedRunner()
    runner.answer(["systemctl"], stdout="generic")
    runner.answer(["systemctl", "is-active"], stdout="active\n")
    runner.responses[("boom",)] = CommandFailed("boom timed out")
    assert Host(runner=runner).run(["systemctl", "is-active", "kubelet"]).stdout == "active\n"
    assert Host(runner=runner).run(["systemctl", "status"]).stdout == "generic"
    with pytest.raises(CommandFailed, match="timed out"):
        Host(runner=runner).run(["boom"])
    with pytest.raises(CommandFailed, match="not installed"):
        Host(runner=runner).run(["other"])
    assert runner.calls[0] == ("systemctl", "is-active", "kubelet")


def test_directory_symlinks_never_escape_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "etc").mkdir(parents=True)
    outside.mkdir()
    (root / "etc/containerd").symlink_to(outside)  # absolute: a host path, re-rooted
    (root / "etc/docker").symlink_to("../../outside")  # relative: cannot climb above the root
    host = Host(root=root)
    with pytest.raises(NotFound, match="directory /etc/containerd does not exist"):
        host.write_file("/etc/containerd/config.toml", "x\n")  # the link's target is not under the root
    assert not (outside / "config.toml").exists()
    (root / "outside").mkdir()
    host.write_file("/etc/docker/daemon.json", "{}\n")
    assert (root / "outside/daemon.json").read_text() == "{}\n"
    assert not (outside / "daemon.json").exists()


def test_reads_follow_absolute_links_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "usr/lib/os-release").write_text("ID=rocky\n")
    (root / "etc/os-release").symlink_to("/usr/lib/os-release")
    host = Host(root=root)
    assert host.read_text("/etc/os-release") == "ID=rocky\n"
    assert host.is_file("/etc/os-release") and host.is_symlink("/etc/os-release")


def test_link_loops_fifos_and_huge_files_are_refused(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    (tmp_path / "loop").symlink_to("/loop")
    with pytest.raises(ConfigError, match="too many levels of symbolic links"):
        host.read_text("/loop")
    assert not host.exists("/loop") and not host.is_file("/loop")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="not a regular file"):
        host.read_text("/fifo")  # returns at once instead of waiting for a writer
    (tmp_path / "huge").write_bytes(b"#" * (9 * 2**20))
    with pytest.raises(ConfigError, match="larger than 8 MiB"):
        host.read_text("/huge")


def test_temp_file_goes_to_temp_dir_and_stale_temps_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    host = Host(root=tmp_path)
    dropins = tmp_path / "etc/crio/crio.conf.d"
    dropins.mkdir(parents=True)
    stale = dropins / ".99-nvidia.toml.abc123.gpunode-tmp"  # left by a killed run
    stale.write_text("[crio.runtime\n")
    used: list[str] = []
    real_mkstemp = tempfile.mkstemp

    def spy(*args: object, **kwargs: object) -> tuple[int, str]:
        used.append(str(kwargs["dir"]))
        return real_mkstemp(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(tempfile, "mkstemp", spy)
    host.write_file("/etc/crio/crio.conf.d/99-nvidia.toml", "x = 1\n", temp_dir="/etc/crio")
    assert used == [str(tmp_path / "etc/crio")]
    assert sorted(p.name for p in dropins.iterdir()) == ["99-nvidia.toml"]
    assert not list((tmp_path / "etc/crio").glob(".*gpunode-tmp"))


def test_stream_hands_over_each_line_as_it_comes_and_keeps_the_tail() -> None:
    host = Host(runner=SubprocessRunner())
    seen: list[tuple[float, str]] = []
    script = "echo one; echo two >&2; sleep 0.3; echo three; exit 3"
    result = host.stream(
        ["sh", "-c", script], timeout=30, on_line=lambda line: seen.append((time.monotonic(), line))
    )
    assert [line for _, line in seen] == ["one", "two", "three"]  # stderr merged, in order
    assert seen[2][0] - seen[0][0] >= 0.25  # "one" arrived before the command ended
    assert result.returncode == 3 and result.stdout == "one\ntwo\nthree"
    with pytest.raises(CommandFailed, match=r"did not finish within 0\.5 s"):
        host.stream(["sleep", "30"], timeout=0.5, on_line=lambda line: None)
    with pytest.raises(CommandFailed, match="is not installed"):
        host.stream(["no-such-program-gpunode"], timeout=5, on_line=lambda line: None)


def test_stream_replays_a_scripted_runners_output() -> None:
    runner = ScriptedRunner()
    runner.answer(["apt-get", "update"], stdout="Hit:1 x\nDone\n", returncode=0)
    lines: list[str] = []
    result = Host(runner=runner).stream(["apt-get", "update"], timeout=5, on_line=lines.append)
    assert lines == ["Hit:1 x", "Done"] and result.ok


# -- programs are found whatever the caller's PATH ---------------------------------------------------------


def test_which_always_searches_the_sbin_directories(tmp_path: Path) -> None:
    """cron, Ansible and non-login shells give gpunode a PATH without /usr/sbin (dockerd, crio live there)."""
    program = tmp_path / "usr/sbin/dockerd"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    host = Host(root=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert host.which("dockerd") == "/usr/sbin/dockerd"
    assert Host(root=tmp_path, env={}).which("dockerd") == "/usr/sbin/dockerd"


def test_the_runner_runs_a_program_from_sbin_with_a_short_path(monkeypatch: pytest.MonkeyPatch) -> None:
    sbin = next(
        (d for d in ("/usr/sbin", "/sbin") if os.access(f"{d}/blkid", os.X_OK)),
        None,
    )
    assert sbin is not None, "blkid (util-linux) is in /usr/sbin on every Debian system"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    result = SubprocessRunner().run(["blkid", "--version"], timeout=30)
    assert result.ok and "blkid" in result.stdout


def test_a_path_entry_the_user_cannot_read_is_skipped(tmp_path: Path) -> None:
    """As a non-root user with an unreadable directory first on PATH (a real permission check: the child
    drops to nobody), which() and a whole doctor run go on instead of failing as 'a bug'."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("this test drops privileges to nobody and needs to start as root")
        pytest.skip("needs root to drop to nobody")
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    tmp_path.chmod(0o755)
    child = (
        "import os, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "from gpunode.host import Host\n"
        "print(Host().which('sh'))\n"
        "from gpunode.cli.main import main\n"
        "sys.exit(main(['doctor']))\n"
    )
    env = {**os.environ, "PATH": f"{secret}:/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, check=False, timeout=120
    )
    assert result.stdout.splitlines()[0] == "/usr/bin/sh", result.stderr
    assert result.returncode in (0, 1), result.stderr
    assert "internal error" not in result.stdout + result.stderr


def test_a_file_where_a_directory_is_needed_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "var").write_text("not a directory\n")
    host = Host(root=tmp_path)
    with pytest.raises(ConfigError, match="a part of that path is a file"):
        host.make_dirs("/var/lib/gpunode")
    with pytest.raises(ConfigError):
        host.write_file("/var/lib/gpunode/x.json", "{}\n", make_parents=True)
