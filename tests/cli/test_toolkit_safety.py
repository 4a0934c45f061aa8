"""`gpunode toolkit` on a production node: a repository URL cannot plant a source, `status` reads the
repository files as the package manager reads them and reports what weakens the signature check (drift),
`install` repairs it, and the key gets its own mode. The package managers are tests/pkgfake.py's; real apt
is tests/integration/test_toolkit_apt.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gpunode.errors import ExitCode
from gpunode.host import Host
from gpunode.toolkit.managers import APT_KEYRING, APT_LIST, PACKAGES, RPM_KEY, YUM_REPO, ZYPP_REPO
from tests.cli.test_toolkit_cli import FIXTURES, KEY_FPR, OTHER_KEY, cli, install_args, key_file, make_node

EVIL = "http://evil.example/repo"
NVIDIA = "https://nvidia.github.io/libnvidia-container"


def status_json(host: Host, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code, out, _ = cli(host, capsys, "status", "--json")
    report: dict[str, Any] = json.loads(out)
    return code, report


# -- --repo-url --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        # The attack: a line break ends the deb line gpunode writes and starts one that trusts anything.
        f"https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /\ndeb [trusted=yes] {EVIL}",
        "https://mirror.example/nvidia\r\n",
        "https://mirror.example/nv idia",
        "https://mirror.example/\tnvidia",
        "https://mirror.example/nvidia\x00",
        "https://mirror.example/nvidiá",
    ],
    ids=["newline-injection", "crlf", "space", "tab", "nul", "non-ascii"],
)
def test_a_repo_url_with_whitespace_or_control_characters_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    host, fake = make_node(tmp_path, "apt")
    code, _, err = cli(host, capsys, *install_args(tmp_path, "--repo-url", url))
    assert code == ExitCode.USAGE
    assert "holds a space, control or non-ASCII character" in err
    # One error line and its fix: the URL is shown escaped, its line break cannot start a line.
    assert err.startswith("gpunode: error: ") and len(err.splitlines()) == 2
    assert fake.calls == [] and not host.exists(APT_LIST) and not host.exists(APT_KEYRING)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://mirror.example/nvidia", "is not an http:// or https:// URL with a host"),
        ("file:///srv/mirror", "is not an http:// or https:// URL with a host"),
        ("https:///nvidia", "is not an http:// or https:// URL with a host"),
        ("mirror.example/nvidia", "is not an http:// or https:// URL with a host"),
        ("https://mirror.example:99999/nvidia", "is not an http:// or https:// URL with a host"),
        ("https://mirror.example/nvidia?x=1", "has a query or fragment"),
        ("https://mirror.example/nvidia#x", "has a query or fragment"),
    ],
)
def test_a_repo_url_without_a_scheme_and_host_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, message: str
) -> None:
    host, fake = make_node(tmp_path, "dnf")
    code, _, err = cli(host, capsys, *install_args(tmp_path, "--repo-url", url))
    assert code == ExitCode.USAGE and message in err
    assert fake.calls == [] and not host.exists(YUM_REPO)


def test_a_repo_url_with_a_password_is_refused_without_showing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    url = "https://user:mirror-pw-never-shown@mirror.example/nvidia"
    code, _, err = cli(host, capsys, *install_args(tmp_path, "--repo-url", url))
    assert code == ExitCode.USAGE
    assert "'--repo-url': https://mirror.example/nvidia carries a user name or password" in err
    assert "auth.conf.d" in err and "mirror-pw-never-shown" not in err
    assert fake.calls == []


def test_an_http_repo_url_works_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, _ = make_node(tmp_path, "apt")
    code, out, err = cli(host, capsys, *install_args(tmp_path, "--repo-url", "http://mirror.example/nvidia/"))
    assert code == ExitCode.OK, err
    assert "warning: --repo-url http://mirror.example/nvidia is plain http://" in err
    assert "prefer https://" in err and "warning" not in out
    assert " http://mirror.example/nvidia/stable/deb/$(ARCH) /\n" in host.path(APT_LIST).read_text()
    code, _, err = cli(host, capsys, *install_args(tmp_path, "--repo-url", "https://mirror.example/nvidia"))
    assert code == ExitCode.OK and "warning" not in err


def test_the_recorded_mirror_and_its_key_are_kept_when_not_given_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    mirror = "https://mirror.example/nvidia"
    assert cli(host, capsys, *install_args(tmp_path, "--version", "1.17.7", "--repo-url", mirror))[0] == 0
    # No --repo-url, no --key-fingerprint: the mirror and the key trusted for it, as recorded.
    code, _, err = cli(host, capsys, "install", "--key-file", key_file(tmp_path), "--version", "1.17.8", "-y")
    assert code == ExitCode.OK, err
    assert f" {mirror}/stable/deb/$(ARCH) /\n" in host.path(APT_LIST).read_text()
    assert set(fake.installed.values()) == {"1.17.8-1"}
    # Another repository is not trusted with the mirror's key: NVIDIA's fingerprint is expected there.
    code, _, err = cli(
        host,
        capsys,
        "install",
        "--key-file",
        key_file(tmp_path),
        "--repo-url",
        "https://other.example/x",
        "--version",
        "1.17.7",
        "-y",
    )
    assert code == ExitCode.ERROR and "is not NVIDIA's" in err


# -- drift: reported by status, repaired by install --------------------------------------------------------


def test_status_reports_a_planted_trusted_source_and_install_removes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    assert cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))[0] == ExitCode.OK
    code, report = status_json(host, capsys)
    assert code == ExitCode.OK and report["drift"] == [] and report["healthy"] is True

    listfile = host.path(APT_LIST)
    written = listfile.read_text()
    listfile.write_text(written + f"deb [trusted=yes] {EVIL} /\n")
    code, report = status_json(host, capsys)
    assert code == ExitCode.UNHEALTHY and report["healthy"] is False
    assert report["version"] == "1.17.8-1"  # the packages are fine: the repository file is not
    assert report["drift"] == [
        f"{APT_LIST} line 4 adds a source gpunode did not write: deb {EVIL}",
        f"{APT_LIST} line 4: [trusted=yes] makes apt accept {EVIL} without a valid signature",
        f"{APT_LIST} line 4: {EVIL} has no signed-by=, so any key apt trusts may sign it",
    ]
    code, out, _ = cli(host, capsys, "status")
    assert code == ExitCode.UNHEALTHY
    assert f"DRIFT: {APT_LIST} line 4: [trusted=yes] makes apt accept" in out
    assert "fix: `sudo gpunode toolkit install`" in out

    fake.calls.clear()
    code, out, err = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))
    assert code == ExitCode.OK, err
    assert f"repair: {APT_LIST} line 4 adds a source gpunode did not write: deb {EVIL}" in out
    assert f"wrote {APT_LIST}" in out
    assert fake.calls == []  # the packages were right: only the file is written again
    assert listfile.read_text() == written == (FIXTURES / "toolkit/apt.list").read_text()
    code, report = status_json(host, capsys)
    assert code == ExitCode.OK and report["drift"] == []
    # Repaired once: the next run has nothing to do.
    code, out, _ = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))
    assert code == ExitCode.OK and "already installed" in out


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            "deb https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /",
            "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) has no signed-by=, so any key "
            "apt trusts may sign it",
        ),
        (
            "deb [signed-by=/etc/apt/keyrings/other.gpg] "
            "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /",
            "is checked with /etc/apt/keyrings/other.gpg, not " + APT_KEYRING,
        ),
        (
            f"deb [ arch=amd64 signed-by={APT_KEYRING} allow-insecure=yes ] "
            "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /  # a comment",
            "[allow-insecure=yes] makes apt accept",
        ),
        (
            f"deb-src [signed-by={APT_KEYRING}] {NVIDIA}/stable/deb/$(ARCH) /",
            "adds a source gpunode did not write: deb-src",
        ),
    ],
    ids=["no-signed-by", "other-keyring", "allow-insecure", "deb-src"],
)
def test_status_reads_each_source_line_as_apt_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, problem: str
) -> None:
    host, _ = make_node(tmp_path, "apt", installed=dict.fromkeys(PACKAGES, "1.17.8-1"))
    # Installed by hand, no record of gpunode's: the file is still read for what it does.
    host.path(APT_KEYRING).parent.mkdir(parents=True)
    from gpunode.toolkit.keys import parse_key

    host.path(APT_KEYRING).write_bytes(parse_key(key_file_text().encode(), "k").packets)
    host.path(APT_LIST).parent.mkdir(parents=True)
    host.path(APT_LIST).write_text(f"{line}\n")
    code, report = status_json(host, capsys)
    assert code == ExitCode.UNHEALTHY
    drift = report["drift"]
    assert isinstance(drift, list) and any(problem in p for p in drift), drift


def key_file_text() -> str:
    return (FIXTURES / "toolkit/test-key-rsa.asc").read_text()


def test_nvidias_own_list_file_installed_by_hand_is_no_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt", installed=dict.fromkeys(PACKAGES, "1.17.8-1"))
    # What NVIDIA's install guide writes, with NVIDIA's key (here: the test key, trusted by the record).
    from gpunode.toolkit.keys import parse_key

    host.path(APT_KEYRING).parent.mkdir(parents=True)
    host.path(APT_KEYRING).write_bytes(parse_key(key_file_text().encode(), "k").packets)
    host.path(APT_LIST).parent.mkdir(parents=True)
    host.path(APT_LIST).write_text(
        f"deb [signed-by={APT_KEYRING}] {NVIDIA}/stable/deb/$(ARCH) /\n"
        f"#deb [signed-by={APT_KEYRING}] {NVIDIA}/experimental/deb/$(ARCH) /\n"
    )
    _, report = status_json(host, capsys)
    # Only the key is reported: it is not NVIDIA's (the test key stands in for it here).
    assert report["drift"] == [
        f"refusing the signing key from {APT_KEYRING}: its fingerprint BEAA 704E 2C01 0DC7 8503 1E04 262B "
        "7125 F6CC D064 is not NVIDIA's (C95B 321B 61E8 8C18 09C4 F759 DDCA E044 F796 ECB0)"
    ]
    assert fake.calls == []


def test_a_keyring_apt_cannot_read_is_drift_and_install_gives_it_0644(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    keyring = host.path(APT_KEYRING)
    keyring.chmod(0o600)
    code, report = status_json(host, capsys)
    assert code == ExitCode.UNHEALTHY
    assert report["drift"] == [
        f"{APT_KEYRING} has mode 600: apt's _apt user cannot read it, so it checks nothing"
    ]
    fake.calls.clear()
    code, _, err = cli(host, capsys, *install_args(tmp_path))
    assert code == ExitCode.OK, err
    assert stat.S_IMODE(keyring.stat().st_mode) == 0o644
    assert fake.calls == []
    assert status_json(host, capsys)[0] == ExitCode.OK


def test_the_keyring_gets_its_own_mode_not_the_one_a_link_pointed_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, _ = make_node(tmp_path, "apt")
    # The keyring path is a link to a private file (an operator's, mode 0600, other content).
    target = host.path("/etc/keys/private.gpg")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x99\x00\x00")
    target.chmod(0o600)
    host.path(APT_KEYRING).parent.mkdir(parents=True)
    os.symlink("/etc/keys/private.gpg", host.path(APT_KEYRING, follow_last=False))
    code, _, err = cli(host, capsys, *install_args(tmp_path))
    assert code == ExitCode.OK, err
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # apt's _apt user reads it through the link


def test_a_key_replaced_by_another_is_drift_and_install_puts_the_trusted_one_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, _ = make_node(tmp_path, "dnf")
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    trusted = host.path(RPM_KEY).read_text()
    host.path(RPM_KEY).write_text(OTHER_KEY)
    code, report = status_json(host, capsys)
    assert code == ExitCode.UNHEALTHY
    (problem,) = report["drift"]
    assert problem.startswith(f"refusing the signing key from {RPM_KEY}: its fingerprint F66B")
    assert (
        f"is not the fingerprint you gave ({' '.join(KEY_FPR[i : i + 4] for i in range(0, 40, 4))})"
        in problem
    )
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    assert host.path(RPM_KEY).read_text() == trusted


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            ("repo_gpgcheck=1\n", "repo_gpgcheck=0\n"),
            "does not check the repository's signature (repo_gpgcheck=0)",
        ),
        (("repo_gpgcheck=1\n", ""), "does not check the repository's signature (no repo_gpgcheck=1)"),
        (
            (f"gpgkey=file://{RPM_KEY}\n", "gpgkey=https://evil.example/key\n"),
            "takes a signing key from https://evil.example/key, not the key gpunode checked",
        ),
        (("sslverify=1\n", "sslverify=0\n"), "does not verify the mirror's TLS certificate (sslverify=0)"),
        (
            ("enabled=1\n", f"enabled=1\nbaseurl={EVIL}\n"),
            f"[nvidia-container-toolkit] adds a source gpunode did not write: {EVIL}",
        ),
        (
            ("", f"\n[extra]\nbaseurl={EVIL}\ngpgcheck=0\n"),
            "adds a repository gpunode did not write: [extra]",
        ),
    ],
    ids=["repo_gpgcheck=0", "no-repo_gpgcheck", "foreign-gpgkey", "sslverify=0", "second-baseurl", "section"],
)
def test_dnf_repo_drift_is_reported_and_repaired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: tuple[str, str], problem: str
) -> None:
    host, fake = make_node(tmp_path, "dnf")
    assert cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))[0] == ExitCode.OK
    repo = host.path(YUM_REPO)
    written = repo.read_text()
    old, new = edit
    repo.write_text(written.replace(old, new, 1) if old else written + new)
    code, report = status_json(host, capsys)
    assert code == ExitCode.UNHEALTHY
    drift = report["drift"]
    assert isinstance(drift, list) and any(problem in p for p in drift), drift
    fake.calls.clear()
    code, _, err = cli(host, capsys, *install_args(tmp_path, "--version", "1.17.8"))
    assert code == ExitCode.OK, err
    assert repo.read_text() == written == (FIXTURES / "toolkit/dnf.repo").read_text()
    assert fake.calls == []
    assert status_json(host, capsys)[1]["drift"] == []


def test_zypper_gpgcheck_off_is_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, _ = make_node(tmp_path, "zypper")
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    repo = host.path(ZYPP_REPO)
    repo.write_text(repo.read_text().replace("repo_gpgcheck=1\n", "repo_gpgcheck=1\ngpgcheck=0\n", 1))
    code, report = status_json(host, capsys)
    assert code == ExitCode.UNHEALTHY
    assert report["drift"] == [
        f"{ZYPP_REPO} [nvidia-container-toolkit] turns every signature check off (gpgcheck=0)"
    ]
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    assert "gpgcheck=0" not in repo.read_text().replace("pkg_gpgcheck=0", "")


def test_another_list_naming_the_repository_is_drift_that_install_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    assert cli(host, capsys, *install_args(tmp_path))[0] == ExitCode.OK
    other = host.path("/etc/apt/sources.list.d/old-nvidia.list")
    other.write_text("deb [trusted=yes] https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /\n")
    code, report = status_json(host, capsys)
    assert code == ExitCode.UNHEALTHY
    assert report["drift"] == [
        "/etc/apt/sources.list.d/old-nvidia.list lists the repository "
        "https://nvidia.github.io/libnvidia-container too: a second source that gpunode did not write"
    ]
    # Not gpunode's file to remove: install names it and stops, even with the packages in place.
    fake.calls.clear()
    code, _, err = cli(host, capsys, *install_args(tmp_path))
    assert code == ExitCode.CONFIG and "old-nvidia.list already lists NVIDIA's repository" in err
    assert fake.calls == [] and other.exists()


def test_a_node_set_up_from_a_mirror_has_not_drifted_when_another_url_is_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, fake = make_node(tmp_path, "apt")
    mirror = "https://mirror.example/nvidia"
    assert cli(host, capsys, *install_args(tmp_path, "--repo-url", mirror))[0] == ExitCode.OK
    assert status_json(host, capsys)[1]["drift"] == []
    # NVIDIA's URL given explicitly (as `gpunode up` does): the packages are there and the files are as
    # gpunode wrote them, so nothing is fetched, written or run; as before, another URL alone changes nothing.
    fake.calls.clear()
    listed = host.path(APT_LIST).read_text()
    code, out, _ = cli(host, capsys, *install_args(tmp_path, "--repo-url", NVIDIA))
    assert code == ExitCode.OK and "already installed" in out
    assert fake.calls == [] and host.path(APT_LIST).read_text() == listed
