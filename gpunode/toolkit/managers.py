"""One engine per package manager: the repository files it needs, and the exact commands it runs.

Each engine only describes (files as bytes, commands as argument lists); install.py writes and runs them
through the Host, so a dry run and the tests see exactly what a real run would do.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from gpunode.distribution import Distribution
from gpunode.errors import CommandFailed, UsageError
from gpunode.host import Host
from gpunode.toolkit.keys import PublicKey

# Pinned together: each requires the others at exactly its own version.
PACKAGES: tuple[str, ...] = (
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
    "libnvidia-container-tools",
    "libnvidia-container1",
)
DEFAULT_REPO_URL = "https://nvidia.github.io/libnvidia-container"
APT_KEYRING = "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"
APT_LIST = "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
YUM_REPO = "/etc/yum.repos.d/nvidia-container-toolkit.repo"
ZYPP_REPO = "/etc/zypp/repos.d/nvidia-container-toolkit.repo"
# dnf and zypper read the key from here (gpgkey=file://...): the one gpunode checked, never a URL's.
RPM_KEY = "/etc/pki/rpm-gpg/RPM-GPG-KEY-nvidia-container-toolkit"
REPO_ID = "nvidia-container-toolkit"
EXPERIMENTAL_ID = "nvidia-container-toolkit-experimental"

REFRESH_TIMEOUT = 600.0
INSTALL_TIMEOUT = 1800.0
REMOVE_TIMEOUT = 900.0
QUERY_TIMEOUT = 60.0
HEADER = "# Written by gpunode (`gpunode toolkit install`); `gpunode toolkit uninstall` removes it.\n"

_VERSION = re.compile(r"[0-9][0-9A-Za-z.+~]*(-[0-9A-Za-z.+~]+)?")


@dataclass(frozen=True)
class RepoFile:
    path: str
    content: bytes
    mode: int = 0o644
    binary: bool = False  # shown as a summary, not as text, by --dry-run
    # gpunode's own file (a key): written with exactly `mode` and root's ownership, whatever the file it
    # replaces (or a link's target) had. apt reads its keyring as the unprivileged _apt user.
    own_mode: bool = False


@dataclass(frozen=True)
class Command:
    title: str  # what the step does, for progress lines
    argv: tuple[str, ...]
    timeout: float
    env: Mapping[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{prefix + ' ' if prefix else ''}{shlex.join(self.argv)}"


def package_version(version: str) -> str:
    """'1.17.8' → '1.17.8-1' (NVIDIA's packages all have release 1); a full 'X-R' is kept as given."""
    value = version.strip().removeprefix("v")
    if not _VERSION.fullmatch(value):
        raise UsageError(
            f"--version {version!r} is not a package version",
            "give the toolkit's version, e.g. --version 1.17.8 (or the full package version 1.17.8-1)",
        )
    return value if "-" in value else f"{value}-1"


def _version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    # Enough of dpkg/rpm ordering for NVIDIA's versions: numbers numerically, '~' sorts before anything.
    parts = re.findall(r"\d+|[A-Za-z]+|~", version)
    return tuple((0, -1) if p == "~" else (1, int(p)) if p.isdigit() else (2, p) for p in parts)


def is_older(a: str, b: str) -> bool:
    return _version_key(a) < _version_key(b)


class PackageManager:
    """What every engine answers; the subclasses fill in their own formats and commands."""

    name = ""
    env: ClassVar[Mapping[str, str]] = {}

    def repo_files(self, repo_url: str, key: PublicKey, experimental: bool) -> list[RepoFile]:
        raise NotImplementedError

    def installed(self, host: Host) -> dict[str, str | None]:
        """Each of PACKAGES → its installed version, None when it is not installed."""
        raise NotImplementedError

    def refresh(self, experimental: bool) -> Command:
        raise NotImplementedError

    def install(self, wanted: str | None, installed: Mapping[str, str | None]) -> Command:
        raise NotImplementedError

    def remove(self, packages: list[str]) -> Command:
        raise NotImplementedError

    def conflicting_sources(self, host: Host, repo_url: str) -> list[str]:
        """Other files that already name this repository in a way that breaks the package manager."""
        return []

    key_path = RPM_KEY

    def audit(self, host: Host, repo_url: str | None) -> list[str]:
        """What in gpunode's repository file (read as the package manager reads it) weakens or bypasses
        the signature check: a source gpunode did not write, a missing or foreign key, checks turned
        off. One sentence each, naming the file; [] for a file as gpunode writes it, or no file.
        `repo_url`: the repository base the file should name (None: the one the file itself names)."""
        raise NotImplementedError

    def owned_paths(self) -> tuple[str, ...]:
        """Every file any install by this engine may write (status and uninstall look at these)."""
        raise NotImplementedError


def _specs(wanted: str | None, separator: str) -> list[str]:
    return [f"{p}{separator}{wanted}" if wanted else p for p in PACKAGES]


# -- apt -----------------------------------------------------------------------------------------


class Apt(PackageManager):
    name = "apt"
    # No debconf questions, no changelog pager, no needrestart prompt (or automatic service restarts
    # on a production node: suspending it is what an unattended install wants).
    env: ClassVar[Mapping[str, str]] = {
        "DEBIAN_FRONTEND": "noninteractive",
        "APT_LISTCHANGES_FRONTEND": "none",
        "NEEDRESTART_SUSPEND": "1",
    }

    def repo_files(self, repo_url: str, key: PublicKey, experimental: bool) -> list[RepoFile]:
        lines = [f"deb [signed-by={APT_KEYRING}] {repo_url}/stable/deb/$(ARCH) /"]
        experimental_line = f"deb [signed-by={APT_KEYRING}] {repo_url}/experimental/deb/$(ARCH) /"
        lines.append(experimental_line if experimental else f"# {experimental_line}")
        text = HEADER + "".join(f"{line}\n" for line in lines)
        return [
            RepoFile(APT_KEYRING, key.packets, 0o644, binary=True, own_mode=True),
            RepoFile(APT_LIST, text.encode("utf-8")),
        ]

    def installed(self, host: Host) -> dict[str, str | None]:
        # dpkg's own database, read as a file: works under --root and needs no dpkg-query.
        status = host.read_text_if_exists("/var/lib/dpkg/status")
        if status is None:
            raise CommandFailed(
                "cannot tell which packages are installed: /var/lib/dpkg/status does not exist",
                "is this a Debian or Ubuntu system? apt needs dpkg's database",
            )
        found: dict[str, str | None] = dict.fromkeys(PACKAGES)
        for paragraph in status.split("\n\n"):
            fields = _deb822(paragraph)
            name = fields.get("Package")
            state = fields.get("Status", "").split()
            if name in found and state[-1:] == ["installed"]:
                found[name] = fields.get("Version")
        return found

    def refresh(self, experimental: bool) -> Command:
        # Only gpunode's own list: an unrelated broken source elsewhere must not fail the install, and the
        # other sources' lists stay as they are (List-Cleanup=0).
        return Command(
            "refresh NVIDIA's package index",
            (
                "apt-get",
                "update",
                "-o",
                f"Dir::Etc::SourceList={APT_LIST}",
                "-o",
                "Dir::Etc::SourceParts=-",
                "-o",
                "APT::Get::List-Cleanup=0",
            ),
            REFRESH_TIMEOUT,
            self.env,
        )

    def install(self, wanted: str | None, installed: Mapping[str, str | None]) -> Command:
        argv = [
            "apt-get",
            "install",
            "-y",
            # A changed /etc/nvidia-container-runtime/config.toml is the operator's: keep it on upgrade.
            "-o",
            "Dpkg::Options::=--force-confdef",
            "-o",
            "Dpkg::Options::=--force-confold",
        ]
        if wanted:
            argv.append("--allow-downgrades")  # an explicit older --version is what the operator asked for
        return Command("install the packages", (*argv, *_specs(wanted, "=")), INSTALL_TIMEOUT, self.env)

    def remove(self, packages: list[str]) -> Command:
        return Command(
            "remove the packages", ("apt-get", "remove", "-y", *packages), REMOVE_TIMEOUT, self.env
        )

    def conflicting_sources(self, host: Host, repo_url: str) -> list[str]:
        # The same repository listed again with another (or no) signed-by makes every apt-get fail with
        # "Conflicting values set for option Signed-By".
        needle = re.sub(r"^\w+://", "", repo_url.rstrip("/"))
        found = []
        candidates = ["/etc/apt/sources.list"] + [
            f"/etc/apt/sources.list.d/{name}"
            for name in host.listdir("/etc/apt/sources.list.d")
            if name.endswith((".list", ".sources"))
        ]
        for path in candidates:
            if path == APT_LIST:
                continue
            text = host.read_text_if_exists(path) or ""
            for line in text.splitlines():
                stripped = line.strip()
                if stripped.startswith("#") or needle not in stripped:
                    continue
                if path.endswith(".sources") or stripped.startswith(("deb ", "deb-src ", "URIs:")):
                    found.append(path)
                    break
        return found

    def owned_paths(self) -> tuple[str, ...]:
        return (APT_KEYRING, APT_LIST)

    key_path = APT_KEYRING

    def audit(self, host: Host, repo_url: str | None) -> list[str]:
        text = host.read_text_if_exists(APT_LIST)
        if text is None:
            return []
        sources: list[tuple[int, str, dict[str, str], str]] = []
        problems: list[str] = []
        for number, line in enumerate(text.splitlines(), 1):
            content = line.split("#", 1)[0].strip()  # apt ends a line at "#", wherever it is
            if not content:
                continue
            found = _APT_SOURCE.match(content)
            if found is None:
                problems.append(f"{APT_LIST} line {number} is not a source line gpunode writes: {content!r}")
                continue
            options: dict[str, str] = {}
            for option in (found["options"] or "").split():
                key, _, value = option.partition("=")
                options[key.rstrip("+-").lower()] = value
            sources.append((number, found["type"], options, found["uri"].rstrip("/")))
        base = repo_url or next(
            (m[1] for _, _, _, uri in sources if (m := _APT_REPO_URI.match(uri)) is not None), None
        )
        ours = {f"{base}/stable/deb/$(ARCH)", f"{base}/experimental/deb/$(ARCH)"} if base else set()
        for number, kind, options, uri in sources:
            where = f"{APT_LIST} line {number}"
            if kind != "deb" or uri not in ours:
                problems.append(f"{where} adds a source gpunode did not write: {kind} {uri}")
            for option in _APT_INSECURE:
                if options.get(option, "no").lower() not in ("no", "false", "0"):
                    problems.append(
                        f"{where}: [{option}={options[option]}] makes apt accept {uri} without a valid "
                        "signature"
                    )
            signed_by = options.get("signed-by")
            if not signed_by:
                problems.append(f"{where}: {uri} has no signed-by=, so any key apt trusts may sign it")
            elif signed_by != APT_KEYRING:
                problems.append(f"{where}: {uri} is checked with {signed_by}, not {APT_KEYRING}")
        return problems


# A one-line-style source: `deb [options] URI SUITE [COMPONENTS...]` (sources.list(5)).
_APT_SOURCE = re.compile(
    r"^(?P<type>deb(?:-src)?|\S+)\s+(?:\[(?P<options>[^\]]*)\]\s*)?(?P<uri>\S+)(?:\s+\S+)*$"
)
_APT_REPO_URI = re.compile(r"^(.+)/(?:stable|experimental)/deb/\$\(ARCH\)$")
# Options that let apt take a repository whose signature is missing, bad or weak.
_APT_INSECURE = ("trusted", "allow-insecure", "allow-weak", "allow-downgrade-to-insecure")


def _deb822(paragraph: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in paragraph.splitlines():
        if line[:1] in (" ", "\t") or ":" not in line:
            continue  # continuation lines (descriptions, conffiles) are not needed
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


# -- rpm: dnf, yum, zypper --------------------------------------------------------------------------


class _Rpm(PackageManager):
    def installed(self, host: Host) -> dict[str, str | None]:
        argv = ["rpm"] + ([] if host.is_real_root else ["--root", str(host.root)])
        argv += ["-q", "--queryformat", "%{NAME}\\t%{VERSION}-%{RELEASE}\\n", *PACKAGES]
        result = host.run(argv, timeout=QUERY_TIMEOUT)
        # rpm exits with the number of packages not installed and says so on stdout: read the lines.
        found: dict[str, str | None] = dict.fromkeys(PACKAGES)
        for line in result.stdout.splitlines():
            name, tab, version = line.partition("\t")
            if tab and name in found:
                found[name] = version.strip()
        if result.returncode != 0 and not any(found.values()) and "is not installed" not in result.stdout:
            result.check()  # a real failure (a broken rpm database), not "not installed"
        return found

    def _sections(self, repo_url: str, experimental: bool) -> list[tuple[str, str, bool]]:
        return [
            (REPO_ID, f"{repo_url}/stable/rpm/$basearch", True),
            (EXPERIMENTAL_ID, f"{repo_url}/experimental/rpm/$basearch", experimental),
        ]

    def owned_paths(self) -> tuple[str, ...]:
        return (self.repo_path, RPM_KEY)

    repo_path = YUM_REPO

    def audit(self, host: Host, repo_url: str | None) -> list[str]:
        text = host.read_text_if_exists(self.repo_path)
        if text is None:
            return []
        sections = _ini_sections(text)
        base = repo_url
        if base is None:
            stable = sections.get(REPO_ID, {}).get("baseurl", [""])[0]
            base = (
                stable.removesuffix("/stable/rpm/$basearch")
                if stable.endswith("/stable/rpm/$basearch")
                else None
            )
        problems: list[str] = []
        for name, keys in sections.items():
            where = f"{self.repo_path} [{name}]"
            expected = {REPO_ID: "stable", EXPERIMENTAL_ID: "experimental"}.get(name)
            if expected is None:
                problems.append(f"{self.repo_path} adds a repository gpunode did not write: [{name}]")
                continue
            for key in ("mirrorlist", "metalink"):
                for value in keys.get(key, []):
                    problems.append(f"{where} adds a source gpunode did not write: {key}={value}")
            for value in keys.get("baseurl", []):
                for url in value.replace(",", " ").split():
                    if base is not None and url.rstrip("/") != f"{base}/{expected}/rpm/$basearch":
                        problems.append(f"{where} adds a source gpunode did not write: {url}")
            checks = keys.get("repo_gpgcheck", [])
            if not checks or not all(_truthy(v) for v in checks):
                said = f"repo_gpgcheck={checks[-1]}" if checks else "no repo_gpgcheck=1"
                problems.append(f"{where} does not check the repository's signature ({said})")
            for value in keys.get("gpgkey", []):
                for url in value.replace(",", " ").split():
                    if url != f"file://{RPM_KEY}":
                        problems.append(
                            f"{where} takes a signing key from {url}, not the key gpunode checked"
                        )
            problems.extend(f"{where} {p}" for p in self._weakened(keys))
        return problems

    def _weakened(self, keys: Mapping[str, list[str]]) -> list[str]:
        """Manager-specific settings that turn a check off."""
        if any(not _truthy(v) for v in keys.get("sslverify", [])):
            return ["does not verify the mirror's TLS certificate (sslverify=0)"]
        return []

    def _key_file(self, key: PublicKey) -> RepoFile:
        return RepoFile(RPM_KEY, key.armored.encode("ascii"), 0o644, own_mode=True)


class Dnf(_Rpm):
    name = "dnf"
    program = "dnf"

    def repo_files(self, repo_url: str, key: PublicKey, experimental: bool) -> list[RepoFile]:
        # NVIDIA's own .repo, with the key gpunode checked instead of the key's URL.
        blocks = []
        for repo_id, baseurl, enabled in self._sections(repo_url, experimental):
            blocks.append(
                f"[{repo_id}]\n"
                f"name={repo_id}\n"
                f"baseurl={baseurl}\n"
                "repo_gpgcheck=1\n"
                "gpgcheck=0\n"
                f"enabled={int(enabled)}\n"
                f"gpgkey=file://{RPM_KEY}\n"
                "sslverify=1\n"
                "sslcacert=/etc/pki/tls/certs/ca-bundle.crt\n"
            )
        text = HEADER + "\n".join(blocks)
        return [self._key_file(key), RepoFile(YUM_REPO, text.encode("utf-8"))]

    def refresh(self, experimental: bool) -> Command:
        repos = [f"--repo={REPO_ID}"] + ([f"--repo={EXPERIMENTAL_ID}"] if experimental else [])
        return Command(
            "refresh NVIDIA's package index", (self.program, "-y", "makecache", *repos), REFRESH_TIMEOUT
        )

    def install(self, wanted: str | None, installed: Mapping[str, str | None]) -> Command:
        # dnf installs exactly the NEVR given, downgrading a newer installed one.
        return Command(
            "install the packages", (self.program, "-y", "install", *_specs(wanted, "-")), INSTALL_TIMEOUT
        )

    def remove(self, packages: list[str]) -> Command:
        return Command("remove the packages", (self.program, "-y", "remove", *packages), REMOVE_TIMEOUT)


class Yum(Dnf):
    """Amazon Linux 2 and other pre-dnf systems."""

    name = "yum"
    program = "yum"

    def refresh(self, experimental: bool) -> Command:
        enable = [f"--enablerepo={REPO_ID}"] + ([f"--enablerepo={EXPERIMENTAL_ID}"] if experimental else [])
        return Command(
            "refresh NVIDIA's package index",
            ("yum", "-y", "makecache", "--disablerepo=*", *enable),
            REFRESH_TIMEOUT,
        )

    def install(self, wanted: str | None, installed: Mapping[str, str | None]) -> Command:
        # Unlike dnf, `yum install` refuses to go down a version: that is `yum downgrade`.
        down = wanted is not None and any(v is not None and is_older(wanted, v) for v in installed.values())
        verb = "downgrade" if down else "install"
        return Command("install the packages", ("yum", "-y", verb, *_specs(wanted, "-")), INSTALL_TIMEOUT)


class Zypper(_Rpm):
    name = "zypper"
    repo_path = ZYPP_REPO

    def repo_files(self, repo_url: str, key: PublicKey, experimental: bool) -> list[RepoFile]:
        # What `zypper addrepo` of NVIDIA's .repo stores, in zypper's own keys: metadata signed
        # (repo_gpgcheck), packages not (pkg_gpgcheck), as NVIDIA publishes them.
        blocks = []
        for repo_id, baseurl, enabled in self._sections(repo_url, experimental):
            blocks.append(
                f"[{repo_id}]\n"
                f"name={repo_id}\n"
                f"enabled={int(enabled)}\n"
                "autorefresh=1\n"
                f"baseurl={baseurl}\n"
                "type=rpm-md\n"
                "repo_gpgcheck=1\n"
                "pkg_gpgcheck=0\n"
                f"gpgkey=file://{RPM_KEY}\n"
            )
        text = HEADER + "\n".join(blocks)
        return [self._key_file(key), RepoFile(ZYPP_REPO, text.encode("utf-8"))]

    def _weakened(self, keys: Mapping[str, list[str]]) -> list[str]:
        # zypper's gpgcheck is the master switch: off, it checks neither metadata nor packages.
        if any(not _truthy(v) for v in keys.get("gpgcheck", [])):
            return ["turns every signature check off (gpgcheck=0)"]
        return []

    # --gpg-auto-import-keys imports the gpgkey the .repo names: the local file gpunode checked.
    _BASE = ("zypper", "--non-interactive", "--gpg-auto-import-keys")

    def refresh(self, experimental: bool) -> Command:
        repos = [REPO_ID] + ([EXPERIMENTAL_ID] if experimental else [])
        return Command("refresh NVIDIA's package index", (*self._BASE, "refresh", *repos), REFRESH_TIMEOUT)

    def install(self, wanted: str | None, installed: Mapping[str, str | None]) -> Command:
        extra = ["--oldpackage"] if wanted else []  # lets an explicit older --version go down
        return Command(
            "install the packages", (*self._BASE, "install", *extra, *_specs(wanted, "=")), INSTALL_TIMEOUT
        )

    def remove(self, packages: list[str]) -> Command:
        return Command(
            "remove the packages", ("zypper", "--non-interactive", "remove", *packages), REMOVE_TIMEOUT
        )


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "yes", "true", "on")


def _ini_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """A .repo file's sections → key → every value it is given (a key set twice is looked at twice)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1].strip(), {})
            continue
        key, sep, value = line.partition("=")
        if sep and current is not None:
            current.setdefault(key.strip().lower(), []).append(value.strip())
    return sections


def choose(host: Host, dist: Distribution, family: str) -> PackageManager:
    """The engine for this distribution: dnf where it exists, yum on systems that predate it."""
    if family == "debian":
        return Apt()
    if family == "suse":
        return Zypper()
    if host.which("dnf"):
        return Dnf()
    if host.which("yum"):
        return Yum()
    # Neither found (a bare image under --root): go by what the release ships.
    old = (dist.id == "amzn" and dist.major == 2) or (
        dist.major is not None and dist.major < 8 and dist.id != "fedora"
    )
    return Yum() if old else Dnf()
