"""`gpunode toolkit install | status | uninstall` with real apt and dpkg, against a signed test repository.

The repository (tests/integration/aptrepo.py) is shaped like NVIDIA's libnvidia-container one: a flat repo
at BASE/stable/deb/<arch>/ signed with a throw-away key that BASE/gpgkey publishes, holding the four
toolkit packages in two versions (1.17.7-1, 1.17.8-1), and a copy of it signed with another key. It is
built once per module and served on the host's 127.0.0.1.

gpunode never runs on this host's root: each test gets a fresh overlay of / (tests/integration/
overlayroot.py) and gpunode runs inside it under systemd-nspawn, from this checkout's venv (bound in at the
same path), so apt-get and dpkg really install and remove packages, and all of it is thrown away after.
The keys handed to `--key-file` are bound in read-only at KEYS.

`test_fixture_repository_with_plain_apt` checks the fixture itself with apt alone, so a failure there is
the harness's, not gpunode's.

Needs root, systemd-nspawn (Debian: systemd-container), overlayfs, gpg (gnupg), dpkg-deb (dpkg),
dpkg-scanpackages (dpkg-dev) and apt-get, and a venv made from the host's /usr/bin/python3. In CI (the CI
variable is set) a missing one is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpunode.errors import ExitCode
from tests.integration import aptrepo, nspawn, overlayroot

KEYRING = "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"
LIST = "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
RECORD = "/var/lib/gpunode/toolkit.json"
DPKG_STATUS = "/var/lib/dpkg/status"
# Where the container sees the key files (a host directory, bound in read-only).
KEYS = "/srv/gpunode-test-keys"
KEY_FILE = f"{KEYS}/test-key.asc"
OTHER_KEY_FILE = f"{KEYS}/other-key.asc"
OLD, NEW = aptrepo.STABLE_VERSIONS
RC = aptrepo.EXPERIMENTAL_VERSIONS[-1]
# apt-get install of four tiny packages is seconds; the shared 2-core test machines can be very slow.
TIMEOUT = 600.0


@dataclass(frozen=True)
class Bed:
    site: aptrepo.Site
    server: aptrepo.Server
    binds: Sequence[nspawn.Bind]  # checkout, venv and the key files

    @property
    def base(self) -> str:
        return self.site.base(self.server.url)

    @property
    def other_base(self) -> str:
        """The repository whose Release files are signed by the other key (its gpgkey is the test key)."""
        return self.site.base(self.server.url, self.site.other)

    @property
    def fingerprint(self) -> str:
        return self.site.key.fingerprint


def prerequisites() -> list[nspawn.Bind]:
    lacking = aptrepo.missing_tools() + overlayroot.missing_prerequisites()
    if shutil.which("apt-get") is None:
        lacking.append("apt-get is not installed")
    return nspawn.checkout_binds(lacking)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    binds = prerequisites()
    work = tmp_path_factory.mktemp("aptrepo")
    site = aptrepo.build_site(work / "site")
    keys = work / "keys"
    keys.mkdir()
    (keys / Path(KEY_FILE).name).write_bytes(site.key.armored)
    (keys / Path(OTHER_KEY_FILE).name).write_bytes(site.other_key.armored)
    with aptrepo.serve(site.root) as server:
        yield Bed(site=site, server=server, binds=[*binds, nspawn.Bind(keys, KEYS)])


@pytest.fixture
def root(bed: Bed) -> Iterator[overlayroot.OverlayRoot]:
    """A fresh overlay of the host's / in which gpunode and apt run; discarded after the test."""
    with overlayroot.overlay_root(bed.binds, name_prefix="gpunode-apt") as box:
        yield box


def gpunode(root: overlayroot.OverlayRoot, *args: str) -> subprocess.CompletedProcess[str]:
    return root.run([sys.executable, "-m", "gpunode", "toolkit", *args], timeout=TIMEOUT)


def install_args(
    bed: Bed, *extra: str, key_file: str | None = KEY_FILE, base: str | None = None
) -> list[str]:
    args = ["install", "--repo-url", base or bed.base, "--key-fingerprint", bed.fingerprint, "--yes"]
    if key_file is not None:
        args += ["--key-file", key_file]
    return [*args, *extra]


def versions(root: overlayroot.OverlayRoot) -> dict[str, str | None]:
    """Installed version of each toolkit package, None where it is not installed."""
    found: dict[str, str | None] = {}
    for package in aptrepo.PACKAGES:
        result = root.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}|${Version}", package])
        status, _, version = result.stdout.partition("|")
        # "ii " is installed; "rc " (removed, config files left) and "unknown package" (rc 1) are not.
        found[package] = version if result.returncode == 0 and status.startswith("ii") else None
    return found


def all_at(version: str | None) -> dict[str, str | None]:
    return dict.fromkeys(aptrepo.PACKAGES, version)


def list_lines(root: overlayroot.OverlayRoot) -> list[str]:
    text = root.path(LIST).read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def repo_line(base: str, channel: str = "stable") -> str:
    # $(ARCH) stays literal in the file: apt substitutes it, as in NVIDIA's own list file.
    return f"deb [signed-by={KEYRING}] {base}/{channel}/deb/$(ARCH) /"


def snapshot(root: overlayroot.OverlayRoot, *paths: str) -> dict[str, tuple[int, bytes]]:
    return {p: (root.path(p).stat().st_mtime_ns, root.path(p).read_bytes()) for p in paths}


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def ctk_version(root: overlayroot.OverlayRoot) -> str:
    return root.run(["nvidia-ctk", "--version"], check=True).stdout


def assert_nothing_written(root: overlayroot.OverlayRoot) -> None:
    for path in (KEYRING, LIST, RECORD):
        assert not root.path(path).exists(), f"{path} is there"
    assert versions(root) == all_at(None)


# --- the fixture repository, with apt alone ------------------------------------------------------------


def test_fixture_repository_with_plain_apt(bed: Bed, root: overlayroot.OverlayRoot) -> None:
    """The test repository is valid for apt, a pinned install of all four packages gets exactly that
    version, pinning only the toolkit would not, and the repository signed by another key is refused."""
    root.path(KEYRING).write_bytes(bed.site.key.binary)
    root.path(KEYRING).chmod(0o644)
    # Only this list: the host's own sources may be unreachable from a test machine.
    only_ours = ["-o", f"Dir::Etc::SourceList={LIST}", "-o", "Dir::Etc::SourceParts=-"]
    noninteractive = {"DEBIAN_FRONTEND": "noninteractive"}

    root.path(LIST).write_text(repo_line(bed.base) + "\n")
    update = root.run(["apt-get", "update", *only_ours], timeout=TIMEOUT)
    assert update.returncode == 0, explain(update)
    assert not any(line.startswith(("W:", "E:")) for line in update.stderr.splitlines()), explain(update)
    # The repository's paths as apt asks for them: $(ARCH) became the host's architecture.
    policy = root.run(["apt-cache", "policy", "nvidia-container-toolkit"], check=True).stdout
    assert f"{bed.base}/stable/deb/{bed.site.arch}  Packages" in policy, policy
    assert f"Candidate: {NEW}" in policy, policy

    # Why gpunode must pin all four: apt's resolver does not go back to the older -base on its own ...
    alone = root.run(
        ["apt-get", "install", "--simulate", f"nvidia-container-toolkit={OLD}"], env=noninteractive
    )
    assert alone.returncode == 100, explain(alone)
    conflict = f"nvidia-container-toolkit-base (= {OLD}) but {NEW} is to be installed"
    assert conflict in alone.stdout, explain(alone)
    # ... and with the toolkit and -base pinned, the libraries still come in the newest version.
    two = [f"nvidia-container-toolkit={OLD}", f"nvidia-container-toolkit-base={OLD}"]
    half = root.run(["apt-get", "install", "--simulate", *two], env=noninteractive)
    assert half.returncode == 0, explain(half)
    assert f"Inst libnvidia-container-tools ({NEW}" in half.stdout, explain(half)
    assert f"Inst libnvidia-container1 ({NEW}" in half.stdout, explain(half)

    pinned = [f"{package}={OLD}" for package in aptrepo.PACKAGES]
    install = root.run(["apt-get", "install", "-y", *pinned], env=noninteractive, timeout=TIMEOUT)
    assert install.returncode == 0, explain(install)
    assert versions(root) == all_at(OLD)
    assert ctk_version(root) == f"NVIDIA Container Toolkit CLI version {aptrepo.upstream(OLD)}\n"
    runtime = root.run(["nvidia-container-runtime", "--version"], check=True).stdout
    assert runtime == f"NVIDIA Container Runtime version {aptrepo.upstream(OLD)}\n"

    root.path(LIST).write_text(repo_line(bed.other_base) + "\n")
    refused = root.run(["apt-get", "update", *only_ours], timeout=TIMEOUT)
    assert refused.returncode == 100, explain(refused)
    other_key_id = bed.site.other_key.fingerprint[-16:]
    assert f"NO_PUBKEY {other_key_id}" in refused.stderr, explain(refused)
    assert "is not signed" in refused.stderr, explain(refused)


# --- gpunode toolkit install ---------------------------------------------------------------------------


def test_pinned_install_reinstall_upgrade_uninstall(bed: Bed, root: overlayroot.OverlayRoot) -> None:
    """--version pins all four packages although a newer release is in the repository; a second run
    changes nothing; another --version upgrades all four; uninstall takes back packages and files."""
    pin = ("--version", aptrepo.upstream(OLD))
    first = gpunode(root, *install_args(bed, *pin))
    assert first.returncode == ExitCode.OK, explain(first)
    assert versions(root) == all_at(OLD)
    keyring = root.path(KEYRING)
    assert keyring.read_bytes() == bed.site.key.binary
    assert stat.S_IMODE(keyring.stat().st_mode) == 0o644
    assert list_lines(root) == [repo_line(bed.base)]
    assert aptrepo.upstream(OLD) in ctk_version(root)
    assert json.loads(root.path(RECORD).read_text())

    status = gpunode(root, "status")
    assert status.returncode == ExitCode.OK, explain(status)
    assert aptrepo.upstream(OLD) in status.stdout, explain(status)
    status_json = gpunode(root, "status", "--json")
    assert status_json.returncode == ExitCode.OK, explain(status_json)
    json.loads(status_json.stdout)

    before = snapshot(root, KEYRING, LIST, DPKG_STATUS)
    mark = bed.server.mark()
    again = gpunode(root, *install_args(bed, *pin))
    assert again.returncode == ExitCode.OK, explain(again)
    assert "already installed" in again.stdout + again.stderr, explain(again)
    assert snapshot(root, KEYRING, LIST, DPKG_STATUS) == before
    # Runs nothing: no apt-get update (it would ask the repository for its InRelease), no key download.
    assert bed.server.since(mark) == []

    upgrade = gpunode(root, *install_args(bed, "--version", aptrepo.upstream(NEW)))
    assert upgrade.returncode == ExitCode.OK, explain(upgrade)
    assert versions(root) == all_at(NEW)
    assert aptrepo.upstream(NEW) in ctk_version(root)
    assert root.path(KEYRING).read_bytes() == bed.site.key.binary
    assert list_lines(root) == [repo_line(bed.base)]

    uninstall = gpunode(root, "uninstall", "--yes")
    assert uninstall.returncode == ExitCode.OK, explain(uninstall)
    assert versions(root) == all_at(None)
    assert not root.path("/usr/bin/nvidia-ctk").exists()
    for path in (KEYRING, LIST):
        assert not root.path(path).exists(), f"{path} is still there"
    gone = gpunode(root, "status")
    assert gone.returncode == ExitCode.UNHEALTHY, explain(gone)


def test_install_newest_with_key_from_repository(bed: Bed, root: overlayroot.OverlayRoot) -> None:
    """Without --version the newest release is installed; without --key-file the key comes from
    BASE/gpgkey and must still have the given fingerprint."""
    mark = bed.server.mark()
    result = gpunode(root, *install_args(bed, key_file=None))
    assert result.returncode == ExitCode.OK, explain(result)
    assert "/good/gpgkey" in bed.server.since(mark)
    assert versions(root) == all_at(NEW)
    assert root.path(KEYRING).read_bytes() == bed.site.key.binary
    assert list_lines(root) == [repo_line(bed.base)]
    assert aptrepo.upstream(NEW) in ctk_version(root)


def test_experimental_channel(bed: Bed, root: overlayroot.OverlayRoot) -> None:
    """--experimental adds NVIDIA's experimental repository, whose release candidate is then newest."""
    result = gpunode(root, *install_args(bed, "--experimental"))
    assert result.returncode == ExitCode.OK, explain(result)
    assert list_lines(root) == [repo_line(bed.base), repo_line(bed.base, "experimental")]
    assert versions(root) == all_at(RC)


def test_repository_signed_by_another_key_is_rolled_back(bed: Bed, root: overlayroot.OverlayRoot) -> None:
    """apt-get update refuses a repository whose signature is not by the trusted key: gpunode fails with
    the command named, and takes back the keyring and list file it had written."""
    result = gpunode(root, *install_args(bed, base=bed.other_base))
    assert result.returncode == ExitCode.COMMAND_FAILED, explain(result)
    assert "apt-get" in result.stderr, explain(result)
    assert "rolled back" in result.stderr, explain(result)
    assert_nothing_written(root)
    # Not even a whiteout: the files did not exist before, so the overlay's upper layer has no trace.
    assert not root.written(KEYRING).exists()
    assert not root.written(LIST).exists()


@pytest.mark.parametrize(
    ("key_file", "give_fingerprint"),
    [
        pytest.param(OTHER_KEY_FILE, True, id="other-key-file"),
        # No --key-fingerprint: the test key is not NVIDIA's, whose fingerprint is built in.
        pytest.param(KEY_FILE, False, id="not-nvidias-key"),
    ],
)
def test_key_with_wrong_fingerprint_is_refused(
    bed: Bed, root: overlayroot.OverlayRoot, key_file: str, give_fingerprint: bool
) -> None:
    """A key that is not the expected one is refused before anything is written or fetched."""
    args = ["install", "--repo-url", bed.base, "--key-file", key_file, "--yes"]
    if give_fingerprint:
        args += ["--key-fingerprint", bed.fingerprint]
    mark = bed.server.mark()
    result = gpunode(root, *args)
    assert result.returncode == ExitCode.ERROR, explain(result)
    assert "fingerprint" in result.stderr.lower(), explain(result)
    assert_nothing_written(root)
    assert bed.server.since(mark) == []


def test_overlay_root_leaves_the_host_alone(bed: Bed) -> None:
    """What runs inside writes only to the overlay's upper layer, and the overlay is gone afterwards."""
    marker = "/usr/local/share/gpunode-overlay-test"
    assert not os.path.exists(marker)
    with overlayroot.overlay_root(bed.binds) as box:
        box.run(["cp", "/etc/os-release", marker], check=True)
        expected = Path("/etc/os-release").read_bytes()
        assert box.path(marker).read_bytes() == expected
        assert box.written(marker).read_bytes() == expected
        merged = box.merged
    assert not os.path.exists(marker)
    assert not os.path.ismount(merged)
    assert not merged.exists()


# --- safe on a production node: no planted sources, drift reported and repaired ------------------------


def test_a_repo_url_with_a_line_break_plants_no_source(bed: Bed, root: overlayroot.OverlayRoot) -> None:
    """A line break in --repo-url would end gpunode's deb line and start one that trusts an unsigned
    repository: refused before anything is fetched or written."""
    planted = f"{bed.base}/stable/deb/$(ARCH) /\ndeb [trusted=yes] {bed.other_base}"
    mark = bed.server.mark()
    result = gpunode(root, *install_args(bed, base=planted))
    assert result.returncode == ExitCode.USAGE, explain(result)
    assert "holds a space, control or non-ASCII character" in result.stderr, explain(result)
    assert_nothing_written(root)
    assert bed.server.since(mark) == []


def test_a_planted_source_is_reported_by_status_and_removed_by_install(
    bed: Bed, root: overlayroot.OverlayRoot
) -> None:
    """A `[trusted=yes]` line added to gpunode's list makes apt take a repository whose signature it
    cannot check; status reports it (exit 1) and install, with the packages already in place, writes the
    list again as gpunode writes it, runs no apt-get, and apt checks signatures again."""
    pin = ("--version", aptrepo.upstream(OLD))
    first = gpunode(root, *install_args(bed, *pin))
    assert first.returncode == ExitCode.OK, explain(first)
    written = root.path(LIST).read_text()
    planted = f"deb [trusted=yes] {bed.other_base}/stable/deb/$(ARCH) /"
    root.path(LIST).write_text(written + planted + "\n")

    # What the drift means for real apt: the repository signed by a key nobody trusts is taken.
    only_ours = ["-o", f"Dir::Etc::SourceList={LIST}", "-o", "Dir::Etc::SourceParts=-"]
    update = root.run(["apt-get", "update", *only_ours], timeout=TIMEOUT)
    assert update.returncode == 0, explain(update)

    status = gpunode(root, "status", "--json")
    assert status.returncode == ExitCode.UNHEALTHY, explain(status)
    drift = json.loads(status.stdout)["drift"]
    other = f"{bed.other_base}/stable/deb/$(ARCH)"
    assert f"{LIST} line 4: [trusted=yes] makes apt accept {other} without a valid signature" in drift
    assert (
        f"{LIST} line 4 adds a source gpunode did not write: deb {bed.other_base}/stable/deb/$(ARCH)" in drift
    )

    before = snapshot(root, DPKG_STATUS)
    repair = gpunode(root, *install_args(bed, *pin))
    assert repair.returncode == ExitCode.OK, explain(repair)
    assert "repair: " in repair.stdout, explain(repair)
    assert root.path(LIST).read_text() == written
    assert list_lines(root) == [repo_line(bed.base)]
    assert snapshot(root, DPKG_STATUS) == before  # no package was touched
    healthy = gpunode(root, "status", "--json")
    assert healthy.returncode == ExitCode.OK, explain(healthy)
    assert json.loads(healthy.stdout)["drift"] == []
    update = root.run(["apt-get", "update", *only_ours], timeout=TIMEOUT)
    assert update.returncode == 0, explain(update)
    assert bed.other_base not in update.stdout, explain(update)
