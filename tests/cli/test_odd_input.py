"""Odd input and an unlucky environment end in a clear error or a clean exit, never "internal error" (70).

JSON nested thousands deep, a 5,000-digit number, a lone surrogate escape, a read-only /var/lib/gpunode, an
immutable file, a full stdout, a closed pipe, Ctrl-C while gpunode is still importing its modules.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import records

REPO = Path(__file__).resolve().parents[2]
DAEMON_JSON = "/etc/docker/daemon.json"


def node(tmp_path: Path) -> Host:
    return Host(root=tmp_path, runner=ScriptedRunner())


def put(root: Path, host_path: str, data: str) -> Path:
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data)
    return path


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ('{"a":' + "[" * 100_000 + "]" * 100_000 + "}", "nests arrays or objects too deeply"),
        ('{"data-root":' + "1" * 5000 + "}", "holds a value gpunode cannot read"),
        ('{"data-root":"\\ud800"}', "lone UTF-16 surrogate escape (\\ud800)"),
    ],
    ids=["deep", "5000-digits", "lone-surrogate"],
)
def test_hostile_daemon_json_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, said: str
) -> None:
    put(tmp_path, DAEMON_JSON, content)
    for extra in ("--dry-run", "--no-restart"):
        assert main(["configure-runtime", "docker", extra], host=node(tmp_path)) == ExitCode.CONFIG
        err = capsys.readouterr().err
        assert said in err and "fix:" in err and "internal error" not in err
    assert (tmp_path / DAEMON_JSON.lstrip("/")).read_text() == content


def test_damaged_records_nested_thousands_deep_are_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    put(tmp_path, DAEMON_JSON, "{}\n")
    put(tmp_path, records.RECORDS, '{"files":' + "[" * 50_000 + "]" * 50_000 + "}")
    assert main(["configure-runtime", "docker", "--revert"], host=node(tmp_path)) == ExitCode.CONFIG
    assert "runtime-changes.json is damaged" in capsys.readouterr().err


def _gpunode(*args: str, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-c", "from gpunode.cli.entry import run; run()", *args]
    return subprocess.run(argv, cwd=REPO, check=False, timeout=120, **kwargs)  # type: ignore[call-overload,no-any-return]


def _need_root_tool(tool: str) -> str:
    found = shutil.which(tool)
    if found is None or os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(f"this test needs root and {tool} (util-linux)")
        pytest.skip(f"needs root and {tool}")
    return found


def test_a_read_only_state_directory_is_a_clear_error(tmp_path: Path) -> None:
    """/var/lib/gpunode on a read-only mount, in a private mount namespace (nothing leaks to the host)."""
    unshare = _need_root_tool("unshare")
    put(tmp_path, DAEMON_JSON, "{}\n")
    state = tmp_path / "var/lib/gpunode"
    state.mkdir(parents=True)
    script = 'mount -t tmpfs -o ro tmpfs "$1" && shift && exec "$@"'
    child = [sys.executable, "-c", "from gpunode.cli.entry import run; run()"]
    argv = [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(state), *child]
    argv += ["--root", str(tmp_path), "configure-runtime", "docker", "--no-restart"]
    result = subprocess.run(argv, cwd=REPO, check=False, timeout=120, capture_output=True, text=True)
    assert result.returncode == ExitCode.PERMISSION, result.stderr
    assert "/var/lib/gpunode/configure-runtime.lock: the filesystem is read-only" in result.stderr
    assert "fix: remount it read-write" in result.stderr and "internal error" not in result.stderr
    assert (tmp_path / DAEMON_JSON.lstrip("/")).read_text() == "{}\n"


def test_an_immutable_file_is_named_with_the_fix(tmp_path: Path) -> None:
    chattr = _need_root_tool("chattr")
    path = put(tmp_path, DAEMON_JSON, "{}\n")
    subprocess.run([chattr, "+i", str(path)], check=True)
    try:
        result = _gpunode(
            "--root", str(tmp_path), "configure-runtime", "docker", "--no-restart", capture_output=True
        )
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)
    err = result.stderr.decode()
    assert result.returncode == ExitCode.PERMISSION, err
    assert "operation not permitted, even to root" in err and "lsattr" in err
    assert "gpunode changed no file." in err
    assert path.read_text() == "{}\n" and not list(path.parent.glob(".*gpunode-tmp"))


def test_a_full_stdout_is_a_clear_error() -> None:
    with open("/dev/full", "wb") as full:
        result = _gpunode("--help", stdout=full, stderr=subprocess.PIPE)
    assert result.returncode == ExitCode.ERROR
    assert result.stderr.decode() == (
        "gpunode: error: cannot write the output: No space left on device\n"
        "  fix: send the output where there is room (or to a file)\n"
    )


@pytest.mark.parametrize(
    "args", [("--help",), ("doctor",), ("plugin", "run", "--simulate", "dgx-a100", "--show-config")]
)
def test_a_closed_pipe_ends_quietly_with_141(args: tuple[str, ...]) -> None:
    """`gpunode … | head -1`: the reader is gone before gpunode writes. No message, no traceback; 141 as for a
    program SIGPIPE ends (1 would read as "unhealthy")."""
    argv = [sys.executable, "-c", "from gpunode.cli.entry import run; run()", *args]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == ExitCode.BROKEN_PIPE, err
    assert err == ""


def test_ctrl_c_while_importing_is_a_quiet_130() -> None:
    """Ctrl-C lands while click is being imported (a meta-path hook raises it there, deterministically)."""
    child = (
        "import sys\n"
        "class CtrlC:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'click':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, CtrlC())\n"
        "from gpunode.cli.entry import run\n"
        "run()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", child, "doctor"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == ExitCode.INTERRUPTED
    assert result.stderr == "gpunode: interrupted\n"
