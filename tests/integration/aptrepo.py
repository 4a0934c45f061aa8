"""A tiny signed apt repository shaped like NVIDIA's libnvidia-container one, served on 127.0.0.1, for tests.

`build_site()` makes, under one web root:

- `good/`: what `gpunode toolkit install --repo-url BASE` expects at BASE. `good/gpgkey` is the armored
  public key, `good/stable/deb/<arch>/` a flat repository (`deb [signed-by=...] BASE/stable/deb/$(ARCH) /`)
  with the four toolkit packages in two versions, and `good/experimental/deb/<arch>/` one with a release
  candidate. The dependencies are the real ones' shape: `apt-get install nvidia-container-toolkit=V`
  alone takes the newest libnvidia-container-tools and libnvidia-container1, so a pinned install must name
  all four.
- `otherkey/`: the same packages and the same `gpgkey`, but the Release files are signed by a second key
  that nobody trusts: apt must refuse it.

The packages are dummies built with dpkg-deb; `nvidia-ctk --version` and friends print the version the
way the real binaries start their output. Keys are throw-away ed25519 keys made with the real gpg in a
private GNUPGHOME; the gpg-agent they need is stopped once everything is signed.

`serve(root)` serves a directory over HTTP on 127.0.0.1 (a free port) from a daemon thread.

Needs gpg and gpg-agent (Debian: gnupg), dpkg-deb (dpkg) and dpkg-scanpackages (dpkg-dev).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gzip
import hashlib
import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

UID = "gpunode test <test@example.invalid>"
OTHER_UID = "gpunode other test key <other@example.invalid>"
STABLE_VERSIONS = ("1.17.7-1", "1.17.8-1")
EXPERIMENTAL_VERSIONS = ("1.18.0~rc.1-1",)
PACKAGES = (
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
    "libnvidia-container-tools",
    "libnvidia-container1",
)
# gpg, dpkg-deb and dpkg-scanpackages are quick; the shared 2-core test machines are not.
TOOL_TIMEOUT = 120.0
TOOLS = {
    "gpg": "gnupg",
    "gpg-agent": "gnupg",
    "gpgconf": "gnupg",
    "dpkg-deb": "dpkg",
    "dpkg-scanpackages": "dpkg-dev",
}


def missing_tools() -> list[str]:
    """What this host lacks to build the repository; empty when it can."""
    return [
        f"{tool} is not installed (Debian: {deb})" for tool, deb in TOOLS.items() if not shutil.which(tool)
    ]


@dataclass(frozen=True)
class SigningKey:
    home: Path  # its GNUPGHOME, which holds the secret key
    fingerprint: str  # 40 upper-case hex digits, as gpg prints it
    armored: bytes  # `gpg --export --armor`: what NVIDIA serves as BASE/gpgkey
    binary: bytes  # `gpg --export`: the OpenPGP packets, i.e. `gpg --dearmor` of `armored`


@dataclass(frozen=True)
class Site:
    """A web root with the repositories in it; URLs are relative to wherever it is served."""

    root: Path
    arch: str
    key: SigningKey  # signs good/, and is good/gpgkey and otherkey/gpgkey
    other_key: SigningKey  # signs otherkey/ only
    good: str = "good"
    other: str = "otherkey"

    def base(self, url: str, which: str | None = None) -> str:
        """The --repo-url of one repository (default: the good one) on a server at url."""
        return f"{url.rstrip('/')}/{which or self.good}"


def upstream(version: str) -> str:
    """`1.17.7-1` -> `1.17.7`, `1.18.0~rc.1-1` -> `1.18.0~rc.1`: what the binaries report."""
    return version.rpartition("-")[0]


def host_arch() -> str:
    arch: str = _run(["dpkg", "--print-architecture"]).stdout.strip()
    return arch


def build_site(workdir: Path, *, arch: str | None = None) -> Site:
    """Keys, packages, both repositories and their signatures under workdir (which must be empty or new)."""
    workdir.mkdir(parents=True, exist_ok=True)
    arch = arch or host_arch()
    key_homes = (workdir / "gnupg-key", workdir / "gnupg-other")
    try:
        key = make_key(key_homes[0], UID)
        other_key = make_key(key_homes[1], OTHER_UID)
        root = workdir / "www"
        debs = workdir / "debs"
        stable = [build_deb(debs, spec, arch) for v in STABLE_VERSIONS for spec in toolkit_packages(v)]
        experimental = [
            build_deb(debs, spec, arch) for v in EXPERIMENTAL_VERSIONS for spec in toolkit_packages(v)
        ]
        for name, signer in (("good", key), ("otherkey", other_key)):
            base = root / name
            base.mkdir(parents=True)
            # The key a client is told to trust is always the first one: otherkey/ is a repository whose
            # signature does not match the key its own site publishes.
            (base / "gpgkey").write_bytes(key.armored)
            build_flat_repo(base / "stable" / "deb" / arch, stable, signer, arch, label="stable")
            build_flat_repo(
                base / "experimental" / "deb" / arch, experimental, signer, arch, label="experimental"
            )
        return Site(root=root, arch=arch, key=key, other_key=other_key)
    finally:
        for home in key_homes:
            stop_agent(home)


# --- keys ------------------------------------------------------------------------------------------


def make_key(home: Path, uid: str) -> SigningKey:
    """A fresh ed25519 signing key without passphrase in its own GNUPGHOME."""
    home.mkdir(mode=0o700, parents=True)
    _gpg(home, "--passphrase", "", "--quick-gen-key", uid, "ed25519", "sign", "never")
    listing = _gpg(home, "--with-colons", "--list-keys", uid).stdout
    # The first fpr record follows the pub record: the primary key's fingerprint.
    fingerprints = [line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr:")]
    if not fingerprints:
        raise RuntimeError(f"gpg listed no fingerprint for {uid!r}:\n{listing}")
    armored = _gpg(home, "--armor", "--export", fingerprints[0], binary=True).stdout
    binary = _gpg(home, "--export", fingerprints[0], binary=True).stdout
    # Tests compare gpunode's keyring with `binary`; that only means something if it is what dearmoring
    # the served key gives.
    if dearmor(armored) != binary:
        raise RuntimeError("gpg --export is not the dearmored gpg --export --armor")
    return SigningKey(home=home, fingerprint=fingerprints[0], armored=armored, binary=binary)


def dearmor(armored: bytes) -> bytes:
    """The packets of an ASCII-armored OpenPGP block (RFC 4880 section 6.2), checksum line dropped."""
    lines = armored.decode("ascii").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----BEGIN PGP"))
    end = next(i for i, line in enumerate(lines) if line.startswith("-----END PGP"))
    body = lines[start + 1 : end]
    # Armor headers ("Comment: ...") end at the first empty line.
    if "" in body:
        body = body[body.index("") + 1 :]
    return base64.b64decode("".join(line for line in body if not line.startswith("=")))


def stop_agent(home: Path) -> None:
    """Stop the gpg-agent that gpg started for this GNUPGHOME (it outlives gpg otherwise)."""
    if home.is_dir():
        subprocess.run(
            ["gpgconf", "--kill", "gpg-agent"],
            env=_gpg_env(home),
            capture_output=True,
            timeout=TOOL_TIMEOUT,
            check=False,
        )


def sign_release(directory: Path, key: SigningKey) -> None:
    """InRelease (clear-signed) and Release.gpg (detached, armored) for directory/Release."""
    release = directory / "Release"
    for path in (directory / "InRelease", directory / "Release.gpg"):
        path.unlink(missing_ok=True)
    common = ("--local-user", key.fingerprint, "--digest-algo", "SHA512")
    _gpg(key.home, *common, "--clearsign", "--output", str(directory / "InRelease"), str(release))
    _gpg(
        key.home,
        *common,
        "--armor",
        "--detach-sign",
        "--output",
        str(directory / "Release.gpg"),
        str(release),
    )


def _gpg(home: Path, *args: str, binary: bool = False) -> subprocess.CompletedProcess[Any]:
    return _run(["gpg", "--batch", "--no-tty", "--quiet", *args], env=_gpg_env(home), text=not binary)


def _gpg_env(home: Path) -> dict[str, str]:
    return {"GNUPGHOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C"}


# --- packages --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackageSpec:
    name: str
    version: str
    depends: Sequence[str]
    files: dict[str, str]  # absolute path inside the package -> text; every file is executable


def toolkit_packages(version: str) -> list[PackageSpec]:
    """The four packages of one toolkit release, with the real packages' relations (1.17.x)."""
    up = upstream(version)
    # The real nvidia-container-cli begins its --version output with these lines.
    cli = f"cli-version: {up}\\nlib-version: {up}"
    return [
        PackageSpec(
            "nvidia-container-toolkit",
            version,
            [
                f"nvidia-container-toolkit-base (= {version})",
                f"libnvidia-container-tools (>= {version})",
                "libnvidia-container-tools (<< 2.0.0)",
            ],
            {
                "/usr/bin/nvidia-container-runtime-hook": _script(
                    f"NVIDIA Container Runtime Hook version {up}"
                )
            },
        ),
        PackageSpec(
            "nvidia-container-toolkit-base",
            version,
            [],
            {
                "/usr/bin/nvidia-ctk": _script(f"NVIDIA Container Toolkit CLI version {up}"),
                "/usr/bin/nvidia-container-runtime": _script(f"NVIDIA Container Runtime version {up}"),
            },
        ),
        PackageSpec(
            "libnvidia-container-tools",
            version,
            [f"libnvidia-container1 (>= {version})"],
            {"/usr/bin/nvidia-container-cli": _script(cli)},
        ),
        PackageSpec(
            "libnvidia-container1",
            version,
            [],
            # Not a real library: a stand-in file, so that the package owns something where the real one does.
            {"/usr/share/libnvidia-container1/VERSION": f"{up}\n"},
        ),
    ]


def _script(version_line: str) -> str:
    return (
        "#!/bin/sh\n"
        "# A stand-in built by gpunode's tests; it only knows --version.\n"
        'if [ "$1" = "--version" ] || [ "$1" = "version" ]; then\n'
        f'    printf "%b\\n" "{version_line}"\n'
        "    exit 0\n"
        "fi\n"
        'echo "$0: test stand-in: unsupported arguments: $*" >&2\n'
        "exit 2\n"
    )


def build_deb(out_dir: Path, spec: PackageSpec, arch: str) -> Path:
    """A .deb with root-owned files, named like the archive's (name_version_arch.deb, no epoch)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tree = out_dir / f"tree-{spec.name}-{spec.version}"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "DEBIAN").mkdir(parents=True)
    for path, text in spec.files.items():
        target = tree / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(0o755)
    control = [
        f"Package: {spec.name}",
        f"Version: {spec.version}",
        f"Architecture: {arch}",
        "Maintainer: gpunode tests <test@example.invalid>",
        "Section: utils",
        "Priority: optional",
    ]
    if spec.depends:
        control.append(f"Depends: {', '.join(spec.depends)}")
    control.append(f"Description: test stand-in for NVIDIA's {spec.name}\n Built by gpunode's tests.")
    (tree / "DEBIAN" / "control").write_text("\n".join(control) + "\n")
    # dpkg-deb refuses a control directory with group/other write bits, whatever the umask made.
    for directory in [tree, *(p for p in tree.rglob("*") if p.is_dir())]:
        directory.chmod(0o755)
    deb = out_dir / f"{spec.name}_{spec.version.replace(':', '%3a')}_{arch}.deb"
    _run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)])
    shutil.rmtree(tree)
    return deb


# --- repositories ----------------------------------------------------------------------------------


def build_flat_repo(directory: Path, debs: Sequence[Path], key: SigningKey, arch: str, *, label: str) -> None:
    """A flat repository (`deb URI /`) in directory: the .debs, Packages(.gz), Release and signatures."""
    directory.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        target = directory / deb.name
        if not target.exists():
            os.link(deb, target)
    # Without --multiversion dpkg-scanpackages keeps only the newest version of each package, and pinning
    # an older one could not be tested.
    packages = _run(["dpkg-scanpackages", "--multiversion", "--arch", arch, "."], cwd=directory).stdout
    if not packages.strip():
        raise RuntimeError(f"dpkg-scanpackages found no packages in {directory}")
    (directory / "Packages").write_text(packages)
    # mtime=0: the same input gives the same bytes, so the hash in Release stays meaningful across rebuilds.
    (directory / "Packages.gz").write_bytes(gzip.compress(packages.encode(), mtime=0))
    (directory / "Release").write_text(
        release_text(directory, ["Packages", "Packages.gz"], arch, label=label)
    )
    sign_release(directory, key)


def release_text(directory: Path, names: Sequence[str], arch: str, *, label: str) -> str:
    """A Release file as apt 2.x wants it: a Date (not in the future), the architectures, and the strong
    hashes (apt ignores MD5Sum and SHA1 and refuses a Release without SHA256)."""
    # A minute back: the container reads the same clock, and apt refuses a Date in the future.
    date = (datetime.now(timezone.utc) - timedelta(minutes=1)).strftime("%a, %d %b %Y %H:%M:%S UTC")
    lines = [
        "Origin: gpunode-test",
        "Label: gpunode-test",
        f"Suite: {label}",
        f"Codename: {label}",
        f"Date: {date}",
        f"Architectures: {arch}",
        "Description: gpunode test repository, shaped like NVIDIA's libnvidia-container",
    ]
    for heading, algorithm in (("SHA256", "sha256"), ("SHA512", "sha512")):
        lines.append(f"{heading}:")
        for name in names:
            data = (directory / name).read_bytes()
            lines.append(f" {hashlib.new(algorithm, data).hexdigest()} {len(data):>16} {name}")
    return "\n".join(lines) + "\n"


# --- HTTP ------------------------------------------------------------------------------------------


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT, no trailing slash
    root: Path
    # Every request's path, in order: tests see from it whether a command fetched anything at all.
    requests: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def mark(self) -> int:
        """A position in `requests`; `since(mark)` gives the paths requested after it."""
        with self._lock:
            return len(self.requests)

    def since(self, mark: int) -> list[str]:
        with self._lock:
            return self.requests[mark:]

    def _record(self, path: str) -> None:
        with self._lock:
            self.requests.append(path)


class _Handler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args: Any, record: Server, **kwargs: Any) -> None:
        self._server_record = record
        super().__init__(*args, **kwargs)

    def send_head(self) -> Any:
        # Both GET and HEAD come through here; a 404 is recorded too (apt probes for files).
        self._server_record._record(self.path)
        return super().send_head()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the test output is no place for an access log


@contextlib.contextmanager
def serve(root: Path) -> Iterator[Server]:
    """Serve root over HTTP on 127.0.0.1 (a free port) until the block ends."""
    server = Server(url="", root=root)
    handler = functools.partial(_Handler, directory=str(root), record=server)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    host, port = httpd.server_address[:2]
    server.url = f"http://{host!s}:{port}"
    thread = threading.Thread(target=httpd.serve_forever, name="aptrepo-http", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=30)


# --- helpers ---------------------------------------------------------------------------------------


def _run(
    argv: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, text: bool = True
) -> subprocess.CompletedProcess[Any]:
    result = subprocess.run(
        list(argv), cwd=cwd, env=env, capture_output=True, text=text, timeout=TOOL_TIMEOUT, check=False
    )
    if result.returncode != 0:
        stderr = result.stderr if text else result.stderr.decode(errors="replace")
        raise RuntimeError(f"{' '.join(argv)} exited with {result.returncode}:\n{stderr}")
    return result
