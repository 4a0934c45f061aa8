"""The daemons of other versions the tests run: unpacked from Debian packages into .testbed/, never installed.

containerd 1.7 and dockerd 26 come from Debian trixie, containerd 2.x and dockerd 28+ from sid. They are
fetched with apt-get through a private configuration (its own sources list, lists and cache under
.testbed/apt: the host's apt state is not touched) and unpacked with `dpkg-deb -x`: no service is
installed, enabled or started, nothing lands outside the checkout. `./install.sh --dev` runs
`python -m tests.testbed fetch`; it is idempotent (a package already unpacked at the suite's current version
is kept).

Tests ask `binary("containerd-2")`: the path of the unpacked program, or a failure under CI (the check must
not silently stop running there) and a skip elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BED = Path(os.environ.get("GPUNODE_TESTBED", REPO / ".testbed"))
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class Unpacked:
    name: str  # what tests ask for, e.g. "containerd-2"
    suite: str  # the Debian suite the package comes from
    package: str
    programs: tuple[str, ...]  # paths inside the package


UNPACKED = (
    Unpacked("containerd-1.7", "trixie", "containerd", ("usr/bin/containerd", "usr/bin/ctr")),
    Unpacked("containerd-2", "sid", "containerd", ("usr/bin/containerd", "usr/bin/ctr")),
    Unpacked("dockerd-26", "trixie", "docker.io", ("usr/sbin/dockerd",)),
    Unpacked("dockerd-28", "sid", "docker.io", ("usr/sbin/dockerd",)),
)


def _apt_options(bed: Path) -> list[str]:
    apt = bed / "apt"
    return [
        "-o",
        f"Dir::Etc::SourceList={apt / 'sources.list'}",
        "-o",
        "Dir::Etc::SourceParts=/nonexistent",
        "-o",
        f"Dir::State::Lists={apt / 'lists'}",
        "-o",
        f"Dir::Cache={apt / 'cache'}",
        "-o",
        "Dir::State::status=/dev/null",
        "-o",
        "Debug::NoLocking=1",
        "-o",
        "APT::Sandbox::User=root",  # the download goes to a directory _apt may not be able to write
    ]


def fetch(bed: Path = BED) -> list[str]:
    """Download and unpack every package of UNPACKED that is not unpacked at its suite's version yet."""
    apt = bed / "apt"
    for sub in ("lists/partial", "cache/archives/partial", "debs"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    suites = sorted({u.suite for u in UNPACKED})
    (apt / "sources.list").write_text(
        "".join(f"deb [signed-by={KEYRING}] {MIRROR} {suite} main\n" for suite in suites)
    )
    options = _apt_options(bed)
    subprocess.run(["apt-get", *options, "-q", "update"], check=True, stdout=subprocess.DEVNULL)
    said = []
    for item in UNPACKED:
        version = _candidate(options, item)
        target = bed / item.name
        stamp = target / ".version"
        if stamp.exists() and stamp.read_text().strip() == version:
            said.append(f"{item.name}: {item.package} {version} (already unpacked)")
            continue
        debs = apt / "debs"
        for old in debs.glob("*.deb"):
            old.unlink()
        subprocess.run(
            ["apt-get", *options, "-q", "download", f"{item.package}={version}"],
            check=True,
            cwd=debs,
            stdout=subprocess.DEVNULL,
        )
        (deb,) = debs.glob("*.deb")
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], check=True)
        deb.unlink()
        stamp.write_text(version + "\n")
        said.append(f"{item.name}: {item.package} {version} unpacked")
    return said


def _candidate(options: list[str], item: Unpacked) -> str:
    """The version of the package in its suite (newest there): apt-cache madison lists every suite."""
    out = subprocess.run(
        ["apt-cache", *options, "madison", item.package], check=True, capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        fields = [f.strip() for f in line.split("|")]
        where = fields[2].split() if len(fields) >= 3 else []  # "http://... sid/main amd64 Packages"
        if len(where) >= 2 and where[1].startswith(f"{item.suite}/") and where[-1] == "Packages":
            return fields[1]
    raise SystemExit(f"testbed: no {item.package} in Debian {item.suite}:\n{out}")


def binary(name: str, program: str | None = None) -> Path:
    """The path of an unpacked program (`program` defaults to the package's first one)."""
    item = next(u for u in UNPACKED if u.name == name)
    inside = program or item.programs[0]
    if program is not None:
        inside = next(p for p in item.programs if p.endswith("/" + program))
    path = BED / item.name / inside
    if not os.access(path, os.X_OK):
        why = f"{path} is missing: run `python -m tests.testbed fetch` (./install.sh --dev does)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the checks against {name}")
        pytest.skip(why)
    return path


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        raise SystemExit("usage: python -m tests.testbed fetch")
    for line in fetch():
        print(f"testbed: {line}")
