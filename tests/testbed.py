"""The daemons the tests run: unpacked from Debian packages into .testbed/, never installed.

containerd 1.6, runc and dockerd 20.10 (with its docker client, docker-init and docker-proxy) come from
Debian bookworm, containerd 1.7 and dockerd 26 from trixie, containerd 2.x and dockerd 28+ from sid. They
are fetched with apt-get through a private configuration (its own sources list, lists and cache under
.testbed/apt: the host's apt state is not touched) and unpacked with `dpkg-deb -x`: no service is
installed, enabled or started, no maintainer script runs, nothing lands outside the checkout. The host's
own containerd, runc or docker.io, installed or not, are never what a test runs. `./install.sh --dev` runs
`python -m tests.testbed fetch`; it is idempotent (a package already unpacked at the suite's current
version is kept).

Tests ask `binary("containerd-1.6")` or `binary("dockerd-20.10", "docker")`: the path of the unpacked
program, or a failure under CI (the check must not silently stop running there) and a skip elsewhere.
Daemons find their helpers by name on PATH (containerd its shim and runc, dockerd runc and docker-init):
`path_with("containerd-1.6", "runc")` is a PATH with those trees' program directories first.
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
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Unpacked:
    name: str  # what tests ask for, e.g. "containerd-2"
    suite: str  # the Debian suite the package comes from
    package: str
    programs: tuple[str, ...]  # paths inside the tree
    # Packages of the same suite unpacked into the same tree, for what a program needs next to it:
    # docker.io's docker-init is a relative link to tini's tini-static.
    also: tuple[str, ...] = ()


UNPACKED = (
    Unpacked(
        "containerd-1.6",
        "bookworm",
        "containerd",
        ("usr/bin/containerd", "usr/bin/ctr", "usr/bin/containerd-shim-runc-v2"),
    ),
    Unpacked("runc", "bookworm", "runc", ("usr/sbin/runc",)),
    Unpacked(
        "dockerd-20.10",
        "bookworm",
        "docker.io",
        ("usr/sbin/dockerd", "usr/bin/docker", "usr/bin/docker-init", "usr/sbin/docker-proxy"),
        also=("tini",),
    ),
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
        versions = {p: _candidate(options, p, item.suite) for p in (item.package, *item.also)}
        target = bed / item.name
        stamp = target / ".version"
        # The main package's version alone, as before `also`: trees unpacked then are not fetched again.
        wanted = "\n".join([versions[item.package], *(f"{p}={versions[p]}" for p in item.also)])
        version = versions[item.package]
        if stamp.exists() and stamp.read_text().strip() == wanted:
            said.append(f"{item.name}: {item.package} {version} (already unpacked)")
            continue
        debs = apt / "debs"
        for old in debs.glob("*.deb"):
            old.unlink()
        subprocess.run(
            ["apt-get", *options, "-q", "download", *(f"{p}={v}" for p, v in versions.items())],
            check=True,
            cwd=debs,
            stdout=subprocess.DEVNULL,
        )
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], check=True)
            deb.unlink()
        stamp.write_text(wanted + "\n")
        extra = "".join(f" + {p} {versions[p]}" for p in item.also)
        said.append(f"{item.name}: {item.package} {version}{extra} unpacked")
    return said


def _candidate(options: list[str], package: str, suite: str) -> str:
    """The version of the package in its suite (newest there): apt-cache madison lists every suite."""
    out = subprocess.run(
        ["apt-cache", *options, "madison", package], check=True, capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        fields = [f.strip() for f in line.split("|")]
        where = fields[2].split() if len(fields) >= 3 else []  # "http://... sid/main amd64 Packages"
        if len(where) >= 2 and where[1].startswith(f"{suite}/") and where[-1] == "Packages":
            return fields[1]
    raise SystemExit(f"testbed: no {package} in Debian {suite}:\n{out}")


def binary(name: str, program: str | None = None) -> Path:
    """The path of an unpacked program (`program` defaults to the package's first one)."""
    path = location(name, program)
    if not os.access(path, os.X_OK):
        why = f"{path} is missing: run `python -m tests.testbed fetch` (./install.sh --dev does)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the checks against {name}")
        pytest.skip(why)
    return path


def location(name: str, program: str | None = None) -> Path:
    """Where binary() finds the program, whether it is there or not (for messages and constants)."""
    item = _item(name)
    inside = program or item.programs[0]
    if program is not None:
        inside = next(p for p in item.programs if p.endswith("/" + program))
    return BED / item.name / inside


def bin_dirs(*names: str) -> list[Path]:
    """The directories of the named trees' programs, each program checked as binary() checks it."""
    dirs: list[Path] = []
    for name in names:
        for inside in _item(name).programs:
            directory = binary(name, inside.rpartition("/")[2]).parent
            if directory not in dirs:
                dirs.append(directory)
    return dirs


def path_with(*names: str, rest: str | None = None) -> str:
    """A PATH on which the named trees' programs come first, then `rest` (default: this process's PATH,
    for the ordinary tools a daemon runs: mount, modprobe, ...). containerd execs its shim and runc by
    name, dockerd runc and docker-init: a daemon started with this PATH finds the unpacked ones."""
    after = os.environ.get("PATH", DEFAULT_PATH) if rest is None else rest
    return os.pathsep.join([*(str(d) for d in bin_dirs(*names)), *([after] if after else [])])


def _item(name: str) -> Unpacked:
    found = [u for u in UNPACKED if u.name == name]
    if not found:
        raise ValueError(f"no {name!r} in the test bed: one of {', '.join(u.name for u in UNPACKED)}")
    return found[0]


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        raise SystemExit("usage: python -m tests.testbed fetch")
    for line in fetch():
        print(f"testbed: {line}")
