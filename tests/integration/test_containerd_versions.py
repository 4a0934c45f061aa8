"""configure-runtime against the containerd that will read the file: 1.6 (Debian bookworm), 1.7 (trixie) and
2.x (sid), all unpacked into .testbed/ (tests/testbed.py), never installed.

For each version and each input — the file that version's own `containerd config default` writes, the 1.6
stock file, hand-written ones, a runc on the legacy v1 shim, `runtime_type = ""` — gpunode is told the real
`containerd --version`, configures the file, and that containerd must then, in `config dump`, show the
nvidia runtime (runc v2, BinaryName), the default, and SystemdCgroup where the previous default had it in
any form; and a daemon of that version, with private paths, must start on it with its CRI plugin ok. A
version 1 file for containerd 2.x, which would ignore it, must be refused without a change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import containerd as ctd
from tests import testbed
from tests.integration.cri.daemon import plugins_status, start_containerd, stop_containerd

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "containerd"
CONFIG = "/etc/containerd/config.toml"
NVIDIA = "/usr/bin/nvidia-container-runtime"

SYSTEMD_ONLY_V2 = """version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true
"""
# runc on the legacy v1 shim: the cgroup driver comes from the CRI plugin's own systemd_cgroup.
LEGACY_SHIM_V2 = """version = 2
[plugins."io.containerd.grpc.v1.cri"]
  systemd_cgroup = true
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runtime.v1.linux"
"""
# An explicit empty runtime_type with runc's options, as some generated configs have it.
EMPTY_TYPE_V2 = """version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = ""
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true
"""
V1_FILE = """[plugins.cri.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins.cri.containerd.runtimes.runc.options]
    SystemdCgroup = true
"""


@dataclass(frozen=True)
class Containerd:
    binary: str
    ctr: str
    version_output: str

    @property
    def version(self) -> tuple[int, int]:
        parsed = ctd.parse_containerd_version(self.version_output)
        assert parsed is not None
        return parsed


def _containerd(name: str) -> Containerd:
    binary = str(testbed.binary(f"containerd-{name}"))
    ctr = str(testbed.binary(f"containerd-{name}", "ctr"))
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    return Containerd(binary, ctr, out)


@pytest.fixture(params=["1.6", "1.7", "2"], ids=["containerd-1.6", "containerd-1.7", "containerd-2"])
def containerd(request: pytest.FixtureRequest) -> Containerd:
    return _containerd(request.param)


def configure(root: Path, daemon: Containerd, text: str, *args: str) -> int:
    path = root / CONFIG.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], daemon.version_output)
    return main(
        ["configure-runtime", "containerd", *args, "--no-restart"], host=Host(root=root, runner=runner)
    )


def dump(daemon: Containerd, config: Path) -> tuple[dict[str, Any], str]:
    done = subprocess.run(
        [daemon.binary, "--config", str(config), "config", "dump"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=config.parent,
    )
    assert done.returncode == 0, done.stderr
    return ctd.parse_toml(done.stdout, f"config dump of {config}"), done.stderr


def check_nvidia(daemon: Containerd, config: Path, *, systemd_cgroup: bool) -> None:
    dumped, warnings = dump(daemon, config)
    cri = ctd.get_table(dumped, ctd.cri_table_path(3 if daemon.version[0] >= 2 else 2)) or {}
    containerd_table = cri.get("containerd", {})
    nvidia = containerd_table.get("runtimes", {}).get("nvidia")
    assert nvidia is not None, f"containerd {daemon.version} does not see the nvidia runtime:\n{warnings}"
    assert nvidia["runtime_type"] == "io.containerd.runc.v2"
    assert nvidia["options"]["BinaryName"] == NVIDIA
    assert containerd_table["default_runtime_name"] == "nvidia"
    assert bool(nvidia["options"].get("SystemdCgroup")) is systemd_cgroup
    assert "nvidia" not in "".join(line for line in warnings.splitlines() if "Ignoring unknown key" in line)


@pytest.fixture
def short_base() -> Iterator[Path]:
    # containerd's ttrpc socket path must stay under 108 bytes: pytest's tmp_path can be too long.
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gn-ctd-") as tmp:
        yield Path(tmp)


def start_and_check(daemon: Containerd, config: Path, base: Path) -> None:
    running = start_containerd(config, base, binary=daemon.binary)
    try:
        statuses = plugins_status(running.socket, program=daemon.ctr)
        cri = next(v for k, v in statuses.items() if k.endswith(".cri"))
        assert cri == "ok", f"containerd {daemon.version}: CRI plugin {cri}:\n{running.log_text()[-3000:]}"
    finally:
        stop_containerd(running)


def test_a_legacy_shim_default_keeps_systemd_cgroup_and_is_never_made_unloadable(
    tmp_path: Path, short_base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """runc on the v1 shim with the CRI plugin's systemd_cgroup: the nvidia runtime (runc v2) gets
    SystemdCgroup = true in its own options. Making it the default is refused: containerd 1.x itself
    refuses systemd_cgroup with a default that is not on the v1 shim, and its CRI plugin would not load."""
    for name in ("1.6", "1.7"):
        daemon = _containerd(name)
        root = tmp_path / name
        assert configure(root, daemon, LEGACY_SHIM_V2) == ExitCode.OK
        config = root / CONFIG.lstrip("/")
        dumped, _ = dump(daemon, config)
        runtimes = dumped["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
        assert runtimes["nvidia"]["options"]["SystemdCgroup"] is True
        assert runtimes["nvidia"]["runtime_type"] == "io.containerd.runc.v2"
        start_and_check(daemon, config, short_base / name)

        again = tmp_path / f"{name}-default"
        capsys.readouterr()
        assert configure(again, daemon, LEGACY_SHIM_V2, "--set-as-default") == ExitCode.CONFIG
        assert "systemd_cgroup = true" in capsys.readouterr().err
        assert (again / CONFIG.lstrip("/")).read_text() == LEGACY_SHIM_V2
        # The refusal is containerd's own rule: the same file with the default switched by hand fails to load.
        manual = again / "manual.toml"
        manual.write_text((root / CONFIG.lstrip("/")).read_text().replace('"runc"', '"nvidia"', 1))
        running = start_containerd(manual, short_base / f"{name}-manual", binary=daemon.binary)
        try:
            statuses = plugins_status(running.socket, program=daemon.ctr)
            assert next(v for k, v in statuses.items() if k.endswith(".cri")) == "error"
            assert "systemd_cgroup` only works for runtime" in running.log_text()
        finally:
            stop_containerd(running)


def _inputs(daemon: Containerd) -> dict[str, tuple[str, bool]]:
    """name -> (file content, whether the nvidia runtime must end with SystemdCgroup = true)."""
    own = subprocess.run(
        [daemon.binary, "config", "default"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    inputs = {
        "own-default": (own, False),
        "stock-1.6-default": ((FIXTURES / "default-v2.toml").read_text(), False),
        "systemd-only": (SYSTEMD_ONLY_V2, True),
    }
    if daemon.version[0] < 2:  # containerd 2.x no longer has the v1 shim
        inputs["empty-runtime-type"] = (EMPTY_TYPE_V2, True)
    return inputs


def test_every_input_is_seen_by_the_containerd_that_reads_it(
    containerd: Containerd, tmp_path: Path, short_base: Path
) -> None:
    for n, (name, (text, systemd_cgroup)) in enumerate(_inputs(containerd).items()):
        root = tmp_path / name
        code = configure(root, containerd, text, "--set-as-default")
        assert code == ExitCode.OK, f"{name}: configure-runtime exited {code}"
        config = root / CONFIG.lstrip("/")
        check_nvidia(containerd, config, systemd_cgroup=systemd_cgroup)
        start_and_check(containerd, config, short_base / str(n))


def test_a_version_1_file_is_refused_for_containerd_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = _containerd("2")
    # What containerd 2 does with it: the CRI keys are ignored, so nothing gpunode added would be seen.
    probe = tmp_path / "probe.toml"
    probe.write_text(V1_FILE)
    _, warnings = dump(daemon, probe)
    assert "Ignoring unknown key" in warnings
    code = configure(tmp_path, daemon, V1_FILE, "--set-as-default")
    assert code == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "version 1 configuration" in err and "containerd config migrate" in err
    assert (tmp_path / CONFIG.lstrip("/")).read_text() == V1_FILE


def test_a_version_1_file_is_still_configured_for_containerd_1_7(tmp_path: Path, short_base: Path) -> None:
    daemon = _containerd("1.7")
    assert configure(tmp_path, daemon, V1_FILE, "--set-as-default") == ExitCode.OK
    config = tmp_path / CONFIG.lstrip("/")
    dumped, _ = dump(daemon, config)
    runtimes = dumped["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["nvidia"]["options"]["BinaryName"] == NVIDIA
    assert runtimes["nvidia"]["options"]["SystemdCgroup"] is True
    start_and_check(daemon, config, short_base)


NAMESPACE_CHILD = r"""
import json, os, subprocess, sys

for directory in ("/etc/containerd", "/var/lib"):
    os.makedirs(directory, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", directory], check=True)
real, scenario = sys.argv[1], sys.argv[2]
original = 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  default_runtime_name = "runc"\n'
with open("/etc/containerd/config.toml", "w") as fh:
    fh.write(original)
with open("/etc/containerd/original.toml", "w") as fh:
    fh.write(original)
# A containerd that reads config.toml as if gpunode's change were not there ("ignored keys"): it dumps the
# original file instead. Everything else is the real program.
os.makedirs("/var/lib/fakebin")
with open("/var/lib/fakebin/containerd", "w") as fh:
    if scenario == "ignoring":
        dump = f"exec {real} --config /etc/containerd/original.toml config dump"
        fh.write(f'#!/bin/sh\nif [ "$3" = config ]; then {dump}; fi\nexec {real} "$@"\n')
    else:
        fh.write(f'#!/bin/sh\nexec {real} "$@"\n')
os.chmod("/var/lib/fakebin/containerd", 0o755)
os.environ["PATH"] = "/var/lib/fakebin:" + os.environ["PATH"]

from gpunode.cli.main import main

extra = ["--effective"] if scenario == "effective" else []
code = main(["configure-runtime", "containerd", "--set-as-default", "--no-restart", *extra])
config = open("/etc/containerd/config.toml").read()
print("RESULT " + json.dumps({"code": code, "config": config, "original": original}))
"""


@pytest.mark.parametrize("scenario", ["real", "ignoring", "effective"])
def test_configure_asks_containerd_itself_before_it_reports_success(scenario: str) -> None:
    """On the real root (a private mount namespace: tmpfs over /etc/containerd and /var/lib),
    configure-runtime asks `containerd config dump` whether containerd reads what was written. The real
    1.6 does; one that ignores the change makes gpunode put the file back and exit 8 instead of reporting
    success."""
    import json
    import sys

    daemon = _containerd("1.6")
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("this test needs root and unshare (util-linux)")
        pytest.skip("needs root and unshare")
    argv = [unshare, "--mount", "--propagation", "private", sys.executable, "-c", NAMESPACE_CHILD]
    done = subprocess.run(
        [*argv, daemon.binary, scenario],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(
        next(x for x in done.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT ")
    )
    if scenario == "effective":  # --effective: containerd's own dump decides what the runtimes are today
        assert result["code"] == ExitCode.OK, done.stderr
        assert "decided from containerd's own view (`containerd config dump`)" in done.stdout
        assert 'default_runtime_name = "nvidia"' in result["config"]
    elif scenario == "real":
        assert result["code"] == ExitCode.OK, done.stderr
        assert "verified: containerd's own dump shows the 'nvidia' runtime as the default" in done.stdout
        assert 'default_runtime_name = "nvidia"' in result["config"]
    else:
        assert result["code"] == ExitCode.COMMAND_FAILED, done.stdout
        assert "does not read the 'nvidia' runtime" in done.stderr
        assert result["config"] == result["original"]


def test_effective_needs_containerd_on_the_real_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = _containerd("1.6")
    assert configure(tmp_path, daemon, SYSTEMD_ONLY_V2, "--effective") == ExitCode.NOT_FOUND
    err = capsys.readouterr().err
    assert "--effective asks containerd for its configuration" in err and "leave out --effective" in err
