"""Distribution detection over real /etc/os-release contents, and the package manager each one gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.distribution import UnsupportedDistribution, read_distribution, require_family
from gpunode.errors import GpunodeError
from gpunode.host import Host, ScriptedRunner
from gpunode.toolkit import managers

OS_RELEASE = Path(__file__).resolve().parent.parent / "fixtures/os-release"


def node(tmp_path: Path, release: str, programs: tuple[str, ...] = ()) -> Host:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text((OS_RELEASE / release).read_text())
    for program in programs:
        path = tmp_path / "usr/bin" / program
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return Host(root=tmp_path, runner=ScriptedRunner(), env={"PATH": "/usr/bin"})


@pytest.mark.parametrize(
    ("release", "pretty", "family", "programs", "manager"),
    [
        ("ubuntu-22.04", "Ubuntu 22.04.4 LTS", "debian", ("apt-get",), "apt"),
        ("ubuntu-24.04", "Ubuntu 24.04.1 LTS", "debian", ("apt-get",), "apt"),
        ("debian-11", "Debian GNU/Linux 11 (bullseye)", "debian", ("apt-get",), "apt"),
        ("debian-12", "Debian GNU/Linux 12 (bookworm)", "debian", ("apt-get",), "apt"),
        ("linuxmint-21.3", "Linux Mint 21.3", "debian", ("apt-get",), "apt"),  # by ID_LIKE
        ("rhel-9.4", "Red Hat Enterprise Linux 9.4 (Plow)", "rhel", ("dnf", "yum"), "dnf"),
        ("rocky-9.4", "Rocky Linux 9.4 (Blue Onyx)", "rhel", ("dnf",), "dnf"),
        ("almalinux-9.4", "AlmaLinux 9.4 (Seafoam Ocelot)", "rhel", ("dnf",), "dnf"),
        ("centos-stream-9", "CentOS Stream 9", "rhel", ("dnf",), "dnf"),
        ("fedora-40", "Fedora Linux 40 (Server Edition)", "rhel", ("dnf",), "dnf"),
        ("oracle-9.4", "Oracle Linux Server 9.4", "rhel", ("dnf",), "dnf"),
        ("amzn-2", "Amazon Linux 2", "rhel", ("yum",), "yum"),
        ("amzn-2", "Amazon Linux 2", "rhel", (), "yum"),  # a bare image: by release
        ("amzn-2023", "Amazon Linux 2023.5.20240708", "rhel", ("dnf",), "dnf"),
        ("amzn-2023", "Amazon Linux 2023.5.20240708", "rhel", (), "dnf"),
        ("sles-15-sp5", "SUSE Linux Enterprise Server 15 SP5", "suse", ("zypper",), "zypper"),
        ("opensuse-leap-15.6", "openSUSE Leap 15.6", "suse", ("zypper",), "zypper"),
    ],
)
def test_each_supported_distribution_gets_its_package_manager(  # noqa: PLR0917 (one table row)
    tmp_path: Path, release: str, pretty: str, family: str, programs: tuple[str, ...], manager: str
) -> None:
    host = node(tmp_path, release, programs)
    dist = read_distribution(host)
    assert dist.pretty == pretty
    assert require_family(dist) == family
    assert managers.choose(host, dist, family).name == manager
    assert not dist.too_old


@pytest.mark.parametrize(("release", "name"), [("arch", "Arch Linux"), ("alpine-3.20", "Alpine Linux v3.20")])
def test_unsupported_distributions_are_named_with_the_supported_list(
    tmp_path: Path, release: str, name: str
) -> None:
    dist = read_distribution(node(tmp_path, release))
    with pytest.raises(UnsupportedDistribution) as err:
        require_family(dist)
    assert f"{name} is not a distribution gpunode supports" in err.value.message
    assert "apt (Debian, Ubuntu), dnf/yum (RHEL, Rocky, Alma, CentOS Stream, Fedora, Amazon Linux)" in (
        err.value.message
    )
    assert err.value.fix is not None and "SLES 15" in err.value.fix


def test_the_os_release_under_the_root_is_read_never_this_machines(tmp_path: Path) -> None:
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "usr/lib/os-release").write_text((OS_RELEASE / "sles-15-sp5").read_text())
    dist = read_distribution(Host(root=tmp_path))
    assert (dist.id, dist.version, dist.source) == ("sles", "15.5", "/usr/lib/os-release")


def test_no_os_release_and_no_id(tmp_path: Path) -> None:
    with pytest.raises(GpunodeError, match="neither /etc/os-release nor /usr/lib/os-release exists"):
        read_distribution(Host(root=tmp_path))
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text('NAME="Something"\n')
    with pytest.raises(GpunodeError, match="names none"):
        read_distribution(Host(root=tmp_path))
