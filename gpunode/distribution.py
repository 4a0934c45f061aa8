"""Which Linux distribution the host runs, and which package manager NVIDIA's packages go through.

Read from the host's os-release (under the Host's root, never this machine's own when --root is given) with
the `distro` library. Used by `gpunode doctor` (is this a supported node?) and `gpunode toolkit` (apt, dnf,
yum or zypper?).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.errors import ConfigError, GpunodeError, NotFound
from gpunode.host import Host

OS_RELEASE_FILES = ("/etc/os-release", "/usr/lib/os-release")

SUPPORTED_DISTRIBUTIONS: dict[str, str] = {
    "ubuntu": "Ubuntu 20.04, 22.04, 24.04",
    "debian": "Debian 11, 12, 13",
    "rhel": "RHEL 8, 9, 10",
    "rocky": "Rocky Linux 8, 9, 10",
    "almalinux": "AlmaLinux 8, 9, 10",
    "centos": "CentOS Stream 8, 9, 10",
    "fedora": "Fedora",
    "amzn": "Amazon Linux 2, 2023",
    "sles": "SLES 15",
    "opensuse-leap": "openSUSE Leap 15",
}
SUPPORTED_TEXT = "gpunode supports: " + "; ".join(SUPPORTED_DISTRIBUTIONS.values())

# The oldest release of each that NVIDIA still publishes nvidia-container-toolkit for (major version).
MINIMUM_MAJOR: dict[str, int] = {
    "ubuntu": 20,
    "debian": 11,
    "rhel": 8,
    "rocky": 8,
    "almalinux": 8,
    "centos": 8,
    "amzn": 2,
    "sles": 15,
    "opensuse-leap": 15,
}

# os-release ID (or an ID_LIKE entry) → the family whose packages NVIDIA publishes.
_FAMILIES: dict[str, str] = {
    "debian": "debian",
    "ubuntu": "debian",
    "rhel": "rhel",
    "rocky": "rhel",
    "almalinux": "rhel",
    "centos": "rhel",
    "fedora": "rhel",
    "amzn": "rhel",
    "ol": "rhel",
    "sles": "suse",
    "sled": "suse",
    "sle_hpc": "suse",
    "opensuse-leap": "suse",
    "opensuse-tumbleweed": "suse",
    "opensuse": "suse",
    "suse": "suse",
}


@dataclass(frozen=True)
class Distribution:
    id: str  # os-release ID, e.g. "ubuntu", "rhel", "opensuse-leap"
    version: str  # VERSION_ID, e.g. "22.04", "9.4", "2023"
    pretty: str  # what to show: "Ubuntu 22.04.4 LTS"
    like: tuple[str, ...]  # ID_LIKE
    source: str  # the os-release file it came from

    @property
    def family(self) -> str | None:
        """ "debian", "rhel" or "suse": whose packages fit; None for a distribution NVIDIA does not serve."""
        for candidate in (self.id, *self.like):
            if candidate in _FAMILIES:
                return _FAMILIES[candidate]
        return None

    @property
    def major(self) -> int | None:
        head = self.version.split(".", 1)[0]
        return int(head) if head.isdigit() else None

    @property
    def too_old(self) -> bool:
        minimum = MINIMUM_MAJOR.get(self.id)
        return minimum is not None and self.major is not None and self.major < minimum


def read_distribution(host: Host) -> Distribution:
    """The host's distribution. No os-release, or one that cannot be read: NotFound / ConfigError."""
    import distro

    release = next((p for p in OS_RELEASE_FILES if host.exists(p)), None)
    if release is None:
        raise NotFound(
            f"cannot tell the distribution: neither {' nor '.join(OS_RELEASE_FILES)} exists",
            SUPPORTED_TEXT,
        )
    host.read_text(release)  # the clear error (permission, not UTF-8, ...) before distro's own parse
    try:
        # distro reads the file itself: give it the path resolved under the root, never this machine's.
        info = distro.LinuxDistribution(
            include_lsb=False,
            include_uname=False,
            root_dir=str(host.root),
            os_release_file=str(host.path(release)),
        )
        dist_id, version, like = info.id(), info.version(), info.like().split()
        pretty = info.os_release_attr("pretty_name") or f"{info.name() or dist_id} {version}".strip()
    except (OSError, UnicodeError, ValueError) as exc:
        raise ConfigError(f"{release}: {exc}") from exc
    if not dist_id and not like:
        raise ConfigError(f"cannot tell the distribution: {release} names none (no ID=)", SUPPORTED_TEXT)
    return Distribution(id=dist_id, version=version, pretty=pretty, like=tuple(like), source=release)


class UnsupportedDistribution(GpunodeError):
    pass


def require_family(dist: Distribution) -> str:
    """The distribution's family, or a clear error naming it and what gpunode supports."""
    family = dist.family
    if family is None:
        raise UnsupportedDistribution(
            f"{dist.pretty or dist.id} is not a distribution gpunode supports: NVIDIA publishes "
            "nvidia-container-toolkit for apt (Debian, Ubuntu), dnf/yum (RHEL, Rocky, Alma, CentOS Stream, "
            "Fedora, Amazon Linux) and zypper (SLES, openSUSE) systems only",
            SUPPORTED_TEXT,
        )
    return family
