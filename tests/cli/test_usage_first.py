"""A usage error is reported before anything else is tried (issue 24): a bad argument is exit 2 in click's
form even on a node where NVML cannot be used and a command would otherwise fail there first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cdi", "generate", "--kind", "bad_kind"], "cdi generate: Invalid value for '--kind': CDI kind "
         "'bad_kind' must be vendor/class, e.g. nvidia.com/gpu"),
        (["cdi", "generate", "--kind", "nvidia.com/-gpu"],
         "cdi generate: Invalid value for '--kind': CDI class"),
        (["cdi", "generate", "--output", "spec.yaml"],
         "cdi generate: Invalid value for '--output': 'spec.yaml' is not an absolute path"),
        (["cdi", "generate", "--driver-root", "driver"],
         "cdi generate: Invalid value for '--driver-root': 'driver' is not an absolute path"),
        (["cdi", "check", "--kind", "bad_kind"], "cdi check: Invalid value for '--kind'"),
        (["cdi", "install", "--dev-root", "dev"], "cdi install: Invalid value for '--dev-root'"),
        (["cdi", "uninstall", "--kind", "bad_kind"], "cdi uninstall: Invalid value for '--kind'"),
    ],
)  # fmt: skip
def test_a_bad_argument_is_said_before_nvml_is_tried(
    args: list[str],
    message: str,
    tmp_path: Path,
    fake_nvml: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_nvml(profile="no-driver")  # what the command would otherwise fail on first (exit 7)
    runner = ScriptedRunner()
    assert main(args, host=Host(root=tmp_path, runner=runner, euid=0)) == ExitCode.USAGE
    first, fix = capsys.readouterr().err.splitlines()
    assert first.startswith(f"gpunode: error: {message}")
    assert fix == f"  fix: see `gpunode {' '.join(args[:2])} --help`"
    assert runner.calls == [] and list(tmp_path.iterdir()) == []  # nothing run, nothing written


# Every other command (issue 24's audit): a bad value with what would fail first without the check, in the
# comment. The root is empty (no kubeconfig, no os-release, no runtime, no kubelet) and NVML has no driver.
@pytest.mark.parametrize(
    ("args", "message", "euid"),
    [
        # doctor would run every check (commands through the runner) before it wrote the metrics file
        (["doctor", "--prometheus", "textfile/"], "doctor: Invalid value for '--prometheus': 'textfile/' "
         "is not a file name; give the file to write", 0),
        # up's preflight (NVML) is planned first
        (["up", "--repo-url", "ftp://mirror.example/nvidia"], "up: Invalid value for '--repo-url': "
         "'ftp://mirror.example/nvidia' is not an http:// or https:// URL with a host", 0),
        (["up", "--toolkit-version", "1.17.8 --force"], "up: Invalid value for '--toolkit-version': "
         "'1.17.8 --force' is not a package version; give the toolkit's version, e.g. --toolkit-version", 0),
        (["up", "--node", "GPU_1"], "up: Invalid value for '--node': 'GPU_1' is not a valid node name", 0),
        (["up", "--runtime", "podman"], "up: Invalid value for '--runtime': unknown runtime 'podman'", 0),
        # down reads the plugin's unit, the records and kubeconfigs first
        (["down", "--node", "GPU_1"], "down: Invalid value for '--node': 'GPU_1' is not a valid node "
         "name", 0),
        (["down", "--server", "ftp://api"], "down: Invalid value for '--server': 'ftp://api' is not an API "
         "server URL", 0),
        # toolkit install: not root (exit 5), then no os-release (the distribution unknown)
        (["toolkit", "install", "--key-fingerprint", "C95B321B"], "toolkit install: Invalid value for "
         "'--key-fingerprint': 'C95B321B' is not a key fingerprint (40 or 64 hexadecimal digits); "
         "copy it", 1000),
        (["toolkit", "install", "--version", "latest!"], "toolkit install: Invalid value for '--version': "
         "'latest!' is not a package version", 1000),
        (["toolkit", "uninstall", "all"], "toolkit uninstall: Got unexpected extra argument (all)", 1000),
        (["toolkit", "status", "--version"], "toolkit status: No such option '--version'", 0),
        # configure-runtime without RUNTIME reads kubelet's files to pick one (none here: exit 6)
        (["configure-runtime", "--runtime-name", "nvidia legacy"], "configure-runtime: Invalid value for "
         "'--runtime-name': invalid runtime name 'nvidia legacy'; use letters", 0),
        (["configure-runtime", "--runtime-path", "nvidia-container-runtime --debug"], "configure-runtime: "
         "Invalid value for '--runtime-path': 'nvidia-container-runtime --debug'; give the binary's", 0),
        (["configure-runtime", "podman"], "configure-runtime: Invalid value for '[RUNTIME]': unknown runtime "
         "'podman'; name one of: docker, containerd, crio", 0),
        (["configure-runtime", "containerd", "--config", "config.toml"], "configure-runtime: Invalid value "
         "for '--config': 'config.toml' is not an absolute path; under --root give the path", 0),
        # node advertise reads NVML's GPUs before it finds credentials and checks the resource
        (["node", "advertise", "--resource", "gpu"], "node advertise: Invalid value for '--resource': gpu: "
         "resource name 'gpu' must be <domain>/<name>", 0),
        (["node", "advertise", "--count", "-1"], "node advertise: Invalid value for '--count': -1: a count "
         "cannot be negative; give 0 or more", 0),
        (["node", "advertise", "--server", "https://user:pw@api:6443"], "node advertise: Invalid value for "
         "'--server': 'https://user:***@api:6443' is not an API server URL (it carries a user name or "
         "password)", 0),
        # node withdraw looks for credentials (none here: exit 6) before it checks the resource
        (["node", "withdraw", "--resource", "cpu"], "node withdraw: Invalid value for '--resource': "
         "cpu: ", 0),
        # plugin install: not root (exit 5) is said first otherwise
        (["plugin", "install", "--doctor-metrics", "metrics"], "plugin install: Invalid value for "
         "'--doctor-metrics': 'metrics' is not an absolute path without '.' or '..'", 1000),
        (["plugin", "uninstall", "now"], "plugin uninstall: Got unexpected extra argument (now)", 1000),
        # plugin status would look for the unit and read the status file (none: exit 1)
        (["plugin", "status", "--status-file", "status.json"], "plugin status: Invalid value for "
         "'--status-file': 'status.json' is not an absolute path", 0),
        # plugin manifest loads the config first otherwise (an unreadable --config: exit 6)
        (["plugin", "manifest", "--config", "/absent.toml", "--namespace", "GPU"], "plugin manifest: Invalid "
         "value for '--namespace': 'GPU' is not a valid namespace name; use lower-case letters", 0),
        (["plugin", "manifest", "--config", "/absent.toml", "--status-file", "/run/"], "plugin manifest: "
         "Invalid value for '--status-file': '/run/' is not an absolute file path without '..'", 0),
        (["plugin", "import-config", "/absent.yaml", "/other.yaml"], "plugin import-config: Got unexpected "
         "extra argument (/other.yaml)", 0),
        (["cdi", "list", "--kind", "nvidia.com/gpu"], "cdi list: No such option '--kind'", 0),
    ],
)  # fmt: skip
def test_every_command_says_a_bad_value_before_it_tries_anything(
    args: list[str],
    message: str,
    euid: int,
    *,
    tmp_path: Path,
    fake_nvml: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_nvml(profile="no-driver")
    runner = ScriptedRunner()
    assert main(args, host=Host(root=tmp_path, runner=runner, euid=euid, env={})) == ExitCode.USAGE
    first, fix = capsys.readouterr().err.splitlines()
    assert first.startswith(f"gpunode: error: {message}"), first
    command = " ".join(args[:2] if args[0] in ("toolkit", "node", "plugin", "cdi") else args[:1])
    assert fix == f"  fix: see `gpunode {command} --help`"
    assert runner.calls == [] and list(tmp_path.iterdir()) == []  # nothing run, nothing written


@pytest.mark.parametrize(
    ("args", "says", "not_said"),
    [
        (["down", "--yes"], "its node step withdraws capacity and labels through the Kubernetes API",
         "package manager"),
        (["down", "--toolkit", "--yes"], "--toolkit would remove the packages with this machine's package "
         "manager", "Kubernetes API"),
        (["up", "--yes"], "its toolkit step installs nvidia-container-toolkit, and this machine's package "
         "manager would install it here", "Kubernetes API"),
        (["toolkit", "uninstall", "--yes"], "this machine's package manager would remove the packages here",
         "Kubernetes API"),
    ],
)  # fmt: skip
def test_a_foreign_root_is_refused_for_what_the_command_would_really_do(
    args: list[str], says: str, not_said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # This machine's programs as the runner (Host's default): they would act here, not in the root.
    assert main(args, host=Host(root=tmp_path, euid=0, env={})) == ExitCode.USAGE
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"gpunode: error: --root {tmp_path} works with --dry-run only: {says}"), first
    assert not_said not in first
    assert list(tmp_path.iterdir()) == []
