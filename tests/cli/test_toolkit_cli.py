"""`gpunode toolkit install|uninstall|status` through the CLI, with package managers that cannot run here
(dnf, yum, zypper) and an apt whose effects land in the temp root's dpkg database.

The real apt path (a signed repository, apt-get in an isolated root) is tests/integration/test_toolkit_apt.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host
from gpunode.toolkit import install as toolkit
from gpunode.toolkit.managers import APT_LIST, PACKAGES
from tests.pkgfake import FakePackages

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KEY = (FIXTURES / "toolkit/test-key-rsa.asc").read_text()
KEY_FPR = "BEAA704E2C010DC785031E04262B7125F6CCD064"
OTHER_KEY = (FIXTURES / "toolkit/test-key-ed25519.asc").read_text()
REPO = "https://nvidia.github.io/libnvidia-container"


def expected_commands(case: str) -> list[str]:
    """The command lines of one case in tests/fixtures/toolkit/commands.txt."""
    lines = (FIXTURES / "toolkit/commands.txt").read_text().splitlines()
    start = lines.index(f"[{case}]") + 1
    out = []
    for line in lines[start:]:
        if line.startswith("["):
            break
        out.append(line)
    return out


OS = {"apt": "ubuntu-22.04", "dnf": "rocky-9.4", "yum": "amzn-2", "zypper": "sles-15-sp5"}


def make_node(tmp_path: Path, manager: str, **kwargs: object) -> tuple[Host, FakePackages]:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text((FIXTURES / "os-release" / OS[manager]).read_text())
    program = {"apt": "apt-get", "dnf": "dnf", "yum": "yum", "zypper": "zypper"}[manager]
    (root / "usr/bin").mkdir(parents=True)
    (root / f"usr/bin/{program}").write_text("#!/bin/sh\n")
    (root / f"usr/bin/{program}").chmod(0o755)
    fake = FakePackages(root=root, manager=manager, **kwargs)  # type: ignore[arg-type]
    return Host(root=root, runner=fake, env={"PATH": "/usr/sbin:/usr/bin"}, euid=0), fake


def key_file(tmp_path: Path, text: str = KEY) -> str:
    path = tmp_path / "key.asc"
    path.write_text(text)
    return str(path)


def cli(host: Host, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["toolkit", *args], host=host)
    out, err = capsys.readouterr()
    return code, out, err


def install_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["install", "--key-file", key_file(tmp_path), "--key-fingerprint", KEY_FPR, "--yes", *extra]


# -- apt ---------------------------------------------------------------------------------------------


def test_apt_install_pins_writes_the_files_then_a_second_run_does_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    code, out, err = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))
    assert code == ExitCode.OK, err
    assert fake.calls == expected_commands("apt --version 1.17.8")
    keyring = host.path("/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg")
    listfile = host.path("/etc/apt/sources.list.d/nvidia-container-toolkit.list")
    from gpunode.toolkit.keys import parse_key

    assert keyring.read_bytes() == parse_key(KEY.encode(), "k").packets
    assert keyring.stat().st_mode & 0o777 == 0o644  # apt's _apt user must read it
    assert listfile.read_text() == (FIXTURES / "toolkit/apt.list").read_text()
    assert "==> [1/3] write the repository files" in out
    assert "==> [3/3] install the packages" in out
    assert "    install: done" in out  # the package manager's output, streamed
    assert "nvidia-container-toolkit 1.17.8-1 is installed" in out
    record = json.loads(host.path(toolkit.RECORD_PATH).read_text())
    assert record["version"] == "1.17.8-1" and record["files"][APT_LIST]["created"]

    mtimes = (keyring.stat().st_mtime_ns, listfile.stat().st_mtime_ns)
    fake.calls.clear()
    code, out, _ = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))
    assert code == ExitCode.OK
    assert "nvidia-container-toolkit 1.17.8-1 is already installed" in out and "nothing to do" in out
    assert fake.calls == []
    assert (keyring.stat().st_mtime_ns, listfile.stat().st_mtime_ns) == mtimes


def test_apt_upgrade_to_another_pinned_version_keeps_the_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    assert cli(host, capsys, *install_args(tmp_path, "--version", "1.17.7"))[0] == ExitCode.OK
    assert set(fake.installed.values()) == {"1.17.7-1"}
    code, out, _ = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))
    assert code == ExitCode.OK
    assert "unchanged /etc/apt/sources.list.d/nvidia-container-toolkit.list" in out
    assert set(fake.installed.values()) == {"1.17.8-1"}


def test_no_version_and_already_installed_does_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt", installed=dict.fromkeys(PACKAGES, "1.16.2-1"))
    code, out, _ = cli(host, capsys, "install", "--yes")  # no key needed: nothing is fetched
    assert code == ExitCode.OK
    assert "nvidia-container-toolkit 1.16.2-1 is already installed" in out
    assert fake.calls == []


def test_a_failed_step_reports_the_command_and_rolls_the_files_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = (
        "Get:1 http://127.0.0.1/stable/deb/amd64  InRelease [1,484 B]\n"
        "Err:1 http://127.0.0.1/stable/deb/amd64  InRelease\n"
        "  The following signatures couldn't be verified because the public key is not available: "
        "NO_PUBKEY DDCAE044F796ECB0\n"
        "E: The repository 'http://127.0.0.1/stable/deb/amd64  InRelease' is not signed.\n"
    )
    host, fake = make_node(tmp_path, "apt", fail={"update": (100, output)})
    before = "deb [signed-by=/old.gpg] https://example.invalid/old /\n"
    listfile = host.path("/etc/apt/sources.list.d/nvidia-container-toolkit.list")
    listfile.parent.mkdir(parents=True)
    listfile.write_text(before)
    code, _, err = cli(host, capsys, *install_args(tmp_path))
    assert code == ExitCode.COMMAND_FAILED
    assert "refresh NVIDIA's package index failed: `DEBIAN_FRONTEND=noninteractive" in err
    assert "apt-get update -o Dir::Etc::SourceList=" in err and "exited with status 100" in err
    assert "  | E: The repository 'http://127.0.0.1/stable/deb/amd64  InRelease' is not signed." in err
    assert (
        "rolled back: restored /etc/apt/sources.list.d/nvidia-container-toolkit.list, "
        "removed /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"
    ) in err
    assert "fix: the repository is not signed by the key gpunode installed" in err
    assert "Traceback" not in err
    assert listfile.read_text() == before
    assert not host.exists("/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg")
    assert not host.exists(toolkit.RECORD_PATH)
    assert len(fake.calls) == 1  # nothing ran after the failed step


def test_a_key_with_another_fingerprint_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    code, _, err = cli(host, capsys, "install", "--key-file", key_file(tmp_path), "--yes")
    assert code == ExitCode.ERROR
    assert "its fingerprint BEAA 704E 2C01 0DC7 8503  1E04 262B 7125 F6CC D064" not in err  # no double space
    assert "fingerprint BEAA 704E 2C01 0DC7 8503 1E04 262B 7125 F6CC D064 is not NVIDIA's" in err
    assert "--key-fingerprint" in err
    assert fake.calls == [] and not host.exists("/etc/apt/sources.list.d")
    # A trusted key with another one appended is refused as a whole.
    both = KEY + OTHER_KEY
    code, _, err = cli(
        host, capsys, "install", "--key-file", key_file(tmp_path, both), "--key-fingerprint", KEY_FPR, "--yes"
    )
    assert code == ExitCode.ERROR and "F66B 1098" in err
    assert fake.calls == []


def test_another_list_naming_the_same_repository_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    old = host.path("/etc/apt/sources.list.d/libnvidia-container.list")
    old.parent.mkdir(parents=True)
    old.write_text("deb https://nvidia.github.io/libnvidia-container/stable/ubuntu18.04/$(ARCH) /\n")
    code, _, err = cli(host, capsys, *install_args(tmp_path))
    assert code == ExitCode.CONFIG
    assert "/etc/apt/sources.list.d/libnvidia-container.list already lists NVIDIA's repository" in err
    assert fake.calls == []


def test_dry_run_prints_every_file_and_command_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    code, out, _ = cli(
        host, capsys, "install", "--dry-run", "--key-file", key_file(tmp_path), "--key-fingerprint", KEY_FPR
    )
    assert code == ExitCode.OK
    assert f"signing key {KEY_FPR} (as given)" in out
    assert "would create /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg (binary keyring" in out
    assert "would create /etc/apt/sources.list.d/nvidia-container-toolkit.list (mode 644):" in out
    for command in expected_commands("apt"):
        assert f"would run: {command}\n" in out
    assert "dry run: nothing was changed" in out
    assert fake.calls == []
    assert not host.exists("/etc/apt/sources.list.d") and not host.exists("/var/lib/gpunode")


def test_the_key_is_downloaded_from_the_repository_when_no_file_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key_server: str
) -> None:
    host, _fake = make_node(tmp_path, "apt")
    code, out, err = cli(
        host, capsys, "install", "--repo-url", key_server, "--key-fingerprint", KEY_FPR, "--yes"
    )
    assert code == ExitCode.OK, err
    assert f"from {key_server}/gpgkey" in out
    listed = host.path("/etc/apt/sources.list.d/nvidia-container-toolkit.list").read_text()
    assert (
        f"deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
        f"{key_server}/stable/deb/$(ARCH) /\n" in listed
    )


def test_a_missing_key_url_is_one_clear_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key_server: str
) -> None:
    host, fake = make_node(tmp_path, "apt")
    code, _, err = cli(host, capsys, "install", "--repo-url", f"{key_server}/nothing-here", "--yes")
    assert code == ExitCode.ERROR
    assert f"cannot download the signing key: {key_server}/nothing-here/gpgkey answered HTTP 404" in err
    code, _, err = cli(host, capsys, "install", "--repo-url", "http://127.0.0.1:9", "--yes")
    assert code == ExitCode.ERROR
    assert "cannot download the signing key from http://127.0.0.1:9/gpgkey: connection refused" in err
    assert fake.calls == []


@pytest.fixture
def key_server(tmp_path: Path) -> object:
    import http.server
    import threading
    from functools import partial

    site = tmp_path / "site"
    site.mkdir()
    (site / "gpgkey").write_text(KEY)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# -- dnf, yum, zypper ----------------------------------------------------------------------------------


def test_dnf_repo_file_key_and_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, fake = make_node(tmp_path, "dnf")
    code, out, err = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))
    assert code == ExitCode.OK, err
    assert fake.calls == expected_commands("dnf --version 1.17.8")
    assert (
        host.path("/etc/yum.repos.d/nvidia-container-toolkit.repo").read_text()
        == (FIXTURES / "toolkit/dnf.repo").read_text()
    )
    armored = host.path("/etc/pki/rpm-gpg/RPM-GPG-KEY-nvidia-container-toolkit").read_text()
    from gpunode.toolkit.keys import parse_key

    assert armored.startswith("-----BEGIN PGP PUBLIC KEY BLOCK-----\n")
    assert parse_key(armored.encode(), "x").packets == parse_key(KEY.encode(), "y").packets
    fake.calls.clear()
    code, out, _ = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))
    assert "already installed" in out and fake.calls == []


def test_dnf_without_a_version_installs_the_newest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "dnf")
    code, out, err = cli(host, capsys, *install_args(tmp_path))
    assert code == ExitCode.OK, err
    assert fake.calls == expected_commands("dnf")
    assert "nvidia-container-toolkit 1.17.8-1 is installed" in out


def test_yum_goes_down_with_downgrade(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, fake = make_node(tmp_path, "yum", installed=dict.fromkeys(PACKAGES, "1.17.8-1"))
    code, _, err = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.7"))
    assert code == ExitCode.OK, err
    assert fake.calls == expected_commands("yum --version 1.17.7 over 1.17.8")
    assert host.path("/etc/yum.repos.d/nvidia-container-toolkit.repo").exists()


def test_zypper_mirror_and_experimental(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, fake = make_node(tmp_path, "zypper")
    mirror = "https://mirror.example.internal/nvidia/"
    args = install_args(tmp_path, "--version", "1.17.8", "--experimental", "--repo-url", mirror)
    code, _, err = cli(host, capsys, *args)
    assert code == ExitCode.OK, err
    assert fake.calls == expected_commands("zypper --version 1.17.8 --experimental")
    assert (
        host.path("/etc/zypp/repos.d/nvidia-container-toolkit.repo").read_text()
        == (FIXTURES / "toolkit/zypper-mirror-experimental.repo").read_text()
    )


def test_uninstall_removes_the_packages_and_only_the_files_gpunode_added(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "dnf")
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    unrelated = host.path("/etc/yum.repos.d/other.repo")
    unrelated.write_text("[other]\n")
    fake.calls.clear()
    code, out, _ = cli(host, capsys, "uninstall", "--dry-run")
    assert code == ExitCode.OK and fake.calls == []
    assert "would run: dnf -y remove nvidia-container-toolkit nvidia-container-toolkit-base" in out
    assert "would remove /etc/yum.repos.d/nvidia-container-toolkit.repo" in out
    code, out, _ = cli(host, capsys, "uninstall", "--yes")
    assert code == ExitCode.OK
    assert fake.calls == [
        "dnf -y remove nvidia-container-toolkit nvidia-container-toolkit-base libnvidia-container-tools "
        "libnvidia-container1"
    ]
    assert fake.installed == {}
    assert not host.exists("/etc/yum.repos.d/nvidia-container-toolkit.repo")
    assert not host.exists("/etc/pki/rpm-gpg/RPM-GPG-KEY-nvidia-container-toolkit")
    assert unrelated.exists() and not host.exists(toolkit.RECORD_PATH)
    code, out, _ = cli(host, capsys, "uninstall", "--yes")
    assert code == ExitCode.OK and "not installed" in out and "nothing to do" in out


def test_uninstall_restores_a_file_gpunode_replaced_and_leaves_one_changed_since(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, _ = make_node(tmp_path, "apt")
    listfile = host.path("/etc/apt/sources.list.d/nvidia-container-toolkit.list")
    listfile.parent.mkdir(parents=True)
    listfile.write_text("# the operator's own\n")
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    keyring = host.path("/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg")
    keyring.write_bytes(keyring.read_bytes() + b"\x00")  # changed by someone else since
    code, out, _ = cli(host, capsys, "uninstall", "--yes")
    assert code == ExitCode.OK
    assert listfile.read_text() == "# the operator's own\n"
    assert "changed since gpunode wrote it: left as it is" in out and keyring.exists()


def test_status_text_json_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, _ = make_node(tmp_path, "apt")
    code, out, _ = cli(host, capsys, "status")
    assert code == ExitCode.UNHEALTHY and "not installed" in out
    assert cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))[0] == ExitCode.OK
    code, out, _ = cli(host, capsys, "status", "--json")
    assert code == ExitCode.OK
    report = json.loads(out)
    assert report["version"] == "1.17.8-1" and report["package_manager"] == "apt"
    assert report["key_fingerprints"] == [KEY_FPR] and report["key_is_nvidias"] is False
    assert report["repository_files"] == {
        "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg": True,
        "/etc/apt/sources.list.d/nvidia-container-toolkit.list": True,
    }


# -- refusals ------------------------------------------------------------------------------------------


def test_unsupported_distribution_names_it_and_the_supported_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, _fake = make_node(tmp_path, "apt")
    host.path("/etc/os-release").write_text((FIXTURES / "os-release/arch").read_text())
    code, _, err = cli(host, capsys, "install", "--dry-run")
    assert code == ExitCode.ERROR
    assert "Arch Linux is not a distribution gpunode supports" in err
    assert "fix: gpunode supports: Ubuntu 20.04, 22.04, 24.04; Debian 11, 12, 13;" in err


def test_needs_root_confirmation_and_a_real_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, fake = make_node(tmp_path, "apt")
    unprivileged = Host(root=host.root, runner=fake, env=host.env, euid=1000)
    code, _, err = cli(unprivileged, capsys, *install_args(tmp_path))
    assert code == ExitCode.PERMISSION and "sudo gpunode toolkit install" in err
    without_yes = [a for a in install_args(tmp_path) if a != "--yes"]
    code, _, err = cli(host, capsys, *without_yes)  # stdin is not a terminal under pytest
    assert code == ExitCode.USAGE and "add --yes" in err
    assert fake.calls == [] and not host.exists("/etc/apt/sources.list.d/nvidia-container-toolkit.list")
    code, _, err = cli(host, capsys, "install", "--version", "latest!", "--yes")
    assert code == ExitCode.USAGE and "is not a package version" in err


def test_foreign_root_with_real_commands_is_dry_run_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text((FIXTURES / "os-release/ubuntu-22.04").read_text())
    code = main(["--root", str(tmp_path), "toolkit", "install", "--yes"])
    _, err = capsys.readouterr()
    assert code == ExitCode.USAGE and "works with --dry-run only" in err


def test_uninstall_warns_when_a_runtime_still_runs_the_nvidia_runtime(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, _ = make_node(tmp_path, "apt")
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    daemon = host.path("/etc/docker/daemon.json")
    daemon.parent.mkdir(parents=True)
    daemon.write_text('{"runtimes": {"nvidia": {"path": "nvidia-container-runtime", "runtimeArgs": []}}}\n')
    broken = host.path("/etc/containerd/config.toml")
    broken.parent.mkdir(parents=True)
    broken.write_text("version = [\n")  # unreadable: doctor's to report; uninstall goes on
    code, out, _ = cli(host, capsys, "uninstall", "--dry-run")
    assert code == ExitCode.OK
    assert (
        "note: /etc/docker/daemon.json still runs nvidia-container-runtime (runtime 'nvidia'): containers "
        "asking for it will fail to start once it is removed (undo with `gpunode configure-runtime docker "
        "--revert`)"
    ) in out
    assert "containerd" not in out.split("note:", 1)[1]
