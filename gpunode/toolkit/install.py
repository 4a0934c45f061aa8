"""Install, remove and inspect nvidia-container-toolkit: detect → plan → apply → verify.

`plan_install` reads the host (distribution, installed versions, the files there now), gets and checks the
signing key, and returns every file to write and every command to run; `--dry-run` prints that and stops.
`apply_install` writes the repository files atomically, runs the package manager with its output streamed,
checks the installed versions, and records what it wrote so that `uninstall` takes back exactly that. A
failed step rolls back the files written before it.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gpunode.distribution import Distribution, read_distribution, require_family
from gpunode.errors import CommandFailed, ConfigError, GpunodeError, PermissionDenied, UsageError
from gpunode.host import CommandResult, Host
from gpunode.runtimes.records import STATE_DIR, backup_path, sha256
from gpunode.toolkit import keys, managers
from gpunode.toolkit.managers import PACKAGES, Command, PackageManager, RepoFile

RECORD_PATH = f"{STATE_DIR}/toolkit.json"
LOCK = f"{STATE_DIR}/toolkit.lock"
FAILURE_TAIL = 15  # lines of a failed command's output in the error


@dataclass(frozen=True)
class InstallOptions:
    version: str | None = None  # as the operator typed it: "1.17.8" or "1.17.8-1"
    # None: the repository the last install recorded, else NVIDIA's (a mirror set up once is kept).
    repo_url: str | None = None
    key_file: str | None = None
    key_fingerprint: str | None = None
    experimental: bool = False


@dataclass(frozen=True)
class PlannedFile:
    file: RepoFile
    before: bytes | None  # None: the file does not exist
    before_mode: int | None = None  # its permission bits

    @property
    def changed(self) -> bool:
        wrong_mode = (
            self.file.own_mode and self.before_mode is not None and self.before_mode != self.file.mode
        )
        return self.before != self.file.content or wrong_mode


@dataclass(frozen=True)
class ToolkitPlan:
    distribution: Distribution
    manager: PackageManager
    installed: Mapping[str, str | None]
    wanted: str | None  # the package version to pin, e.g. "1.17.8-1"
    files: tuple[PlannedFile, ...] = ()
    commands: tuple[Command, ...] = ()
    remove: tuple[str, ...] = ()  # files to delete (uninstall)
    restore: tuple[tuple[str, str], ...] = ()  # (file, its backup) to put back (uninstall)
    notes: tuple[str, ...] = ()
    key: keys.PublicKey | None = None
    repo_url: str = managers.DEFAULT_REPO_URL
    warnings: tuple[str, ...] = ()
    drift: tuple[str, ...] = ()  # what install repairs in the repository files (see `drift`)
    # A plan only to be shown (fetch_key=False): the key is still to be downloaded from here, and checked,
    # when the plan is made again to be applied. Its file is not among `files` then.
    key_download: str | None = None
    key_download_note: str | None = None

    @property
    def changes_nothing(self) -> bool:
        return (
            not self.commands
            and not self.remove
            and not self.restore
            and not any(f.changed for f in self.files)
        )


@dataclass
class Progress:
    """Callbacks the CLI renders: a step starting, each line of a command's output."""

    step: Callable[[int, int, str], None] = lambda n, total, what: None
    line: Callable[[str], None] = lambda line: None


@dataclass
class Outcome:
    written: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    installed: dict[str, str | None] = field(default_factory=dict)


# -- detect ----------------------------------------------------------------------------------------


def detect(host: Host) -> tuple[Distribution, PackageManager]:
    dist = read_distribution(host)
    return dist, managers.choose(host, dist, require_family(dist))


def consistent_version(installed: Mapping[str, str | None]) -> str | None:
    """The one version all four packages are at; None when one is missing or they differ."""
    versions = set(installed.values())
    if len(versions) == 1:
        return next(iter(versions))
    return None


def satisfied(installed: Mapping[str, str | None], wanted: str | None) -> bool:
    have = consistent_version(installed)
    return have is not None and (wanted is None or have == wanted)


# -- plan ------------------------------------------------------------------------------------------


def plan_install(
    host: Host,
    opts: InstallOptions,
    *,
    fetch: Callable[[str], bytes] = keys.fetch_key,
    fetch_key: bool = True,
) -> ToolkitPlan:
    """The install's plan. fetch_key=False: a plan to show only (a dry run), made offline — the key is not
    downloaded (a --key-file is still read and checked), the plan says from where it will be, and
    apply_install refuses it; apply a plan made again with the key."""
    wanted = managers.package_version(opts.version) if opts.version else None
    record = read_record(host)
    recorded_url = record.get("repo_url") if isinstance(record.get("repo_url"), str) else None
    repo_url, warnings = check_repo_url(opts.repo_url or recorded_url or managers.DEFAULT_REPO_URL)
    expected = _trusted_fingerprints(opts, record, repo_url)
    dist, manager = detect(host)
    installed = manager.installed(host)
    # Before anything else, and also when the packages are there: such a source breaks every apt run.
    conflicts = manager.conflicting_sources(host, repo_url)
    if conflicts:
        raise ConfigError(
            f"{', '.join(conflicts)} already list{'s' if len(conflicts) == 1 else ''} NVIDIA's repository "
            f"({repo_url}); apt refuses a source listed twice with different keys",
            f"remove {' and '.join(conflicts)} (gpunode writes its own {managers.APT_LIST}), "
            "then run this again",
        )
    # What was done to the repository files since they were written: installed packages are no reason to
    # leave a source that skips the signature check in place. Judged against what gpunode recorded (or,
    # without a record, the repository the file itself names), not against --repo-url: a node set up from
    # a mirror has not drifted because another URL is asked for now (that alone changes nothing, as ever).
    found = drift(host, manager, recorded_url, _trusted_fingerprints(opts, record, recorded_url or repo_url))
    if satisfied(installed, wanted) and not found:
        return ToolkitPlan(dist, manager, installed, wanted, repo_url=repo_url, warnings=warnings)
    source = opts.key_file or f"{repo_url}/gpgkey"
    key: keys.PublicKey | None = None
    key_note: str | None = None
    if opts.key_file or fetch_key:
        data = keys.read_key_file(opts.key_file) if opts.key_file else fetch(source)
        key = keys.parse_key(data, source)
        keys.check_trusted(key, expected, custom=expected != keys.NVIDIA_FINGERPRINTS)
        repo_files = manager.repo_files(repo_url, key, opts.experimental)
    else:
        # The other files do not depend on the key's bytes: plan them with an empty stand-in, and leave the
        # key's own file out (it is written, after its check, only when applying).
        stand_in = keys.PublicKey(packets=b"", fingerprints=(), source=source)
        repo_files = [
            f for f in manager.repo_files(repo_url, stand_in, opts.experimental) if f.path != manager.key_path
        ]
        key_note = (
            f"download the signing key from {source} when applying, check it is "
            f"{'the key with fingerprint' if len(expected) == 1 else 'signed by one of'} "
            f"{', '.join(expected)}, then write {manager.key_path} (not downloaded in a dry run)"
        )
    files = tuple(PlannedFile(f, host.read_bytes(f.path), _mode(host, f.path)) for f in repo_files)
    notes = []
    have = {p: v for p, v in installed.items() if v}
    if have:
        notes.append("installed now: " + ", ".join(f"{p} {v}" for p, v in have.items()))
    commands: tuple[Command, ...] = ()
    if satisfied(installed, wanted):
        notes.append("the packages are installed as wanted: only the repository files are repaired")
    else:
        if wanted is None:
            notes.append("no --version given: the newest version in the repository is installed")
        commands = (manager.refresh(opts.experimental), manager.install(wanted, installed))
    return ToolkitPlan(
        dist,
        manager,
        installed,
        wanted,
        files,
        commands,
        notes=tuple(notes),
        key=key,
        repo_url=repo_url,
        warnings=warnings,
        drift=tuple(found),
        key_download=None if key is not None else source,
        key_download_note=key_note,
    )


def _trusted_fingerprints(opts: InstallOptions, record: Mapping[str, Any], repo_url: str) -> tuple[str, ...]:
    """--key-fingerprint; else the fingerprints an earlier install trusted for this same repository (a
    mirror re-signed with its own key stays trusted); else NVIDIA's."""
    if opts.key_fingerprint:
        return (keys.normalize_fingerprint(opts.key_fingerprint),)
    recorded = record.get("key_fingerprints")
    if (
        record.get("repo_url") == repo_url
        and isinstance(recorded, list)
        and recorded
        and all(isinstance(f, str) for f in recorded)
    ):
        return tuple(keys.normalize_fingerprint(f) for f in recorded)
    return keys.NVIDIA_FINGERPRINTS


def check_repo_url(url: str) -> tuple[str, tuple[str, ...]]:
    """The repository base URL as it goes into the package manager's files, and the warnings it earns.

    It is written into a line of a sources list or .repo file: a line break in it would start another
    line (a `deb [trusted=yes] ...` source that skips every signature check), so whitespace and control
    characters are refused outright, as are a query or fragment (`#` starts a comment for apt) and a
    user:password (which would be world-readable there, and shown in messages). http:// is allowed (the
    signatures protect the packages) but warned about."""
    bad = next((i for i, c in enumerate(url) if not 0x21 <= ord(c) <= 0x7E), None)
    if bad is not None:
        raise UsageError(
            f"--repo-url {url!r} holds a space, control or non-ASCII character (at position {bad + 1}), "
            "which would change the repository file gpunode writes",
            f"give just the repository's base URL, like {managers.DEFAULT_REPO_URL}",
        )
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("https", "http") or not parts.hostname or not port_ok:
        raise UsageError(
            f"--repo-url {url!r} is not an http:// or https:// URL with a host",
            f"give the base of the repository mirror, like {managers.DEFAULT_REPO_URL}",
        )
    if parts.username is not None or parts.password is not None:
        shown = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()
        raise UsageError(
            f"--repo-url {shown} carries a user name or password, which would be written into a "
            "world-readable repository file",
            "give the mirror's URL without them and put the credentials in /etc/apt/auth.conf.d/ (apt) "
            "or the .repo's username= and password= (dnf, zypper)",
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise UsageError(
            f"--repo-url {url!r} has a query or fragment; the package manager appends paths to the base URL",
            f"give the repository's base URL, like {managers.DEFAULT_REPO_URL}",
        )
    value = url.rstrip("/")
    warnings: tuple[str, ...] = ()
    if parts.scheme == "http":
        warnings = (
            f"--repo-url {value} is plain http://: the signatures still protect the packages, but anyone "
            "on the way sees what this node installs and can hold back updates; prefer https://",
        )
    return value, warnings


def _mode(host: Host, path: str) -> int | None:
    try:
        return stat.S_IMODE(host.path(path).stat().st_mode)
    except (OSError, GpunodeError):
        return None


def drift(host: Host, manager: PackageManager, repo_url: str | None, trusted: tuple[str, ...]) -> list[str]:
    """What weakens the signature check in the repository files gpunode manages, read as the package
    manager reads them: a source gpunode did not write (any other URL, say a second line planted with
    `[trusted=yes]`), a source without `signed-by`, checks turned off (`repo_gpgcheck=0`, zypper's
    `gpgcheck=0`), a key that is missing, unreadable by apt, or not the trusted one. [] when the files are
    as gpunode writes them, or absent (nothing installed from a repository)."""
    problems = manager.audit(host, repo_url)
    repo_file = next(p for p in manager.owned_paths() if p != manager.key_path)
    if not host.exists(repo_file):
        return problems
    key_path = manager.key_path
    data = host.read_bytes(key_path) if host.is_file(key_path) else None
    if data is None:
        return [*problems, f"{key_path} is missing: the repository's signatures cannot be checked"]
    try:
        key = keys.parse_key(data, key_path)
        keys.check_trusted(key, trusted, custom=trusted != keys.NVIDIA_FINGERPRINTS)
    except GpunodeError as exc:
        problems.append(exc.message)
    mode = _mode(host, key_path)
    if manager.name == "apt" and mode is not None and not mode & 0o004:
        problems.append(f"{key_path} has mode {mode:o}: apt's _apt user cannot read it, so it checks nothing")
    return problems


def plan_uninstall(host: Host) -> ToolkitPlan:
    dist, manager = detect(host)
    installed = manager.installed(host)
    record = read_record(host)
    present = [p for p in PACKAGES if installed.get(p)]
    commands = (manager.remove(present),) if present else ()
    remove: list[str] = []
    restore: list[tuple[str, str]] = []
    notes: list[str] = []
    for path, entry in sorted(record.get("files", {}).items()):
        now = host.read_bytes(path)
        if now is None:
            continue
        if sha256(now) != entry.get("written_sha256"):
            notes.append(f"{path} changed since gpunode wrote it: left as it is")
        elif entry.get("created"):
            remove.append(path)
        elif entry.get("backup") and host.exists(entry["backup"]):
            restore.append((path, entry["backup"]))
    if not record:
        leftovers = [p for p in manager.owned_paths() if host.exists(p)]
        if leftovers:
            notes.append(f"{', '.join(leftovers)} not written by gpunode (no record): left as they are")
    notes.extend(_runtimes_still_using_it(host))
    return ToolkitPlan(
        dist, manager, installed, None, (), commands, tuple(remove), tuple(restore), tuple(notes)
    )


def _runtimes_still_using_it(host: Host) -> list[str]:
    """Runtimes whose configuration (drop-ins, imports and k3s/RKE2 layouts followed, as doctor reads them)
    still runs nvidia-container-runtime: removing the toolkit breaks the containers that use it."""
    from gpunode.runtimes import containerd, crio, docker

    found = []
    for runtime, read_state in (("docker", docker.read_state), ("containerd", containerd.read_state),
                                ("crio", crio.read_state)):  # fmt: skip
        try:
            state = read_state(host)
        except GpunodeError:
            continue  # a configuration that cannot be read is doctor's to report, not uninstall's to fail on
        if state.nvidia_runtime is not None:
            found.append(
                f"{state.config_path} still runs nvidia-container-runtime "
                f"(runtime {state.nvidia_runtime!r}): containers asking for it will fail to start once it is "
                "removed (undo with "
                f"`gpunode configure-runtime {runtime} --revert`)"
            )
    return found


# -- apply -----------------------------------------------------------------------------------------


def refuse_under_root(host: Host, plan: ToolkitPlan, what: str) -> None:
    """Under --root DIR nothing that acts runs on this machine, and a package manager is nothing else:
    this machine's apt-get, dnf or zypper installs into this machine (its dpkg or rpm database, its /usr),
    never into DIR. Writing only the repository files into DIR would record a toolkit that is not there,
    so nothing is written: the packages are installed from inside DIR, where its own package manager runs.
    (Reading DIR's dpkg status file for `toolkit status` and the plan is reading files, not acting.)"""
    if not host.offline or plan.changes_nothing:
        return
    inside = f"sudo chroot {host.root} gpunode toolkit {what}"
    raise UsageError(
        f"toolkit {what} under --root {host.root}: gpunode runs no package manager on this machine "
        f"({plan.manager.name} here would {what} packages on this machine, not in {host.root}); nothing was "
        "changed",
        f"run it inside {host.root}, with its own {plan.manager.name}: `{inside}` (or `systemd-nspawn -D "
        f"{host.root} gpunode toolkit {what}`; gpunode must be installed there), or once {host.root} is the "
        "running system",
    )


def apply_install(host: Host, plan: ToolkitPlan, progress: Progress | None = None) -> Outcome:
    refuse_under_root(host, plan, "install")
    if plan.key_download is not None:  # a caller's mistake, never the operator's: a key must be checked
        raise ValueError(f"a plan without its key ({plan.key_download}) is for showing, not for applying")
    progress = progress or Progress()
    outcome = Outcome()
    written: list[PlannedFile] = []
    total = len(plan.commands) + (1 if any(f.changed for f in plan.files) else 0)
    step = 0
    try:
        if any(f.changed for f in plan.files):
            step += 1
            progress.step(step, total, "write the repository files")
            for planned in plan.files:
                if not planned.changed:
                    continue
                host.write_file(
                    planned.file.path,
                    planned.file.content,
                    mode=planned.file.mode,
                    backup_to=backup_path(planned.file.path),
                    make_parents=True,
                    # A key gets 0644 whatever the file it replaces, or a link's target, had: apt's _apt
                    # user must read it, and a key must not stay writable by someone else.
                    exact_mode=planned.file.own_mode,
                    # The file as planned from: one changed meanwhile is not overwritten.
                    expect=planned.before,
                )
                written.append(planned)
                outcome.written.append(planned.file.path)
        for command in plan.commands:
            step += 1
            progress.step(step, total, f"{command.title}: {command}")
            _run(host, command, progress)
    except BaseException as exc:
        undone = _roll_back(host, written)
        if isinstance(exc, GpunodeError) and undone:
            exc.message += f"\nrolled back: {', '.join(undone)}"
        elif isinstance(exc, GpunodeError) and plan.files:
            exc.message += "\nrolled back: nothing to roll back (no file had been changed)"
        raise
    outcome.installed = plan.manager.installed(host)
    if not satisfied(outcome.installed, plan.wanted):
        got = ", ".join(f"{p} {v or 'not installed'}" for p, v in outcome.installed.items())
        raise CommandFailed(
            f"the package manager finished, but the packages are not at "
            f"{plan.wanted or 'one version'}: {got}",
            "look for held packages or a pin (apt-mark showhold; dnf versionlock list) and run this again",
        )
    _save_record(host, plan, outcome.installed)
    return outcome


def _run(host: Host, command: Command, progress: Progress) -> CommandResult:
    result = host.stream(command.argv, timeout=command.timeout, env=command.env, on_line=progress.line)
    if result.returncode != 0:
        tail = "\n".join(f"  | {line}" for line in result.stdout.strip().splitlines()[-FAILURE_TAIL:])
        raise CommandFailed(
            f"{command.title} failed: `{command}` exited with status {result.returncode}"
            + (f"; its last lines:\n{tail}" if tail else ""),
            _hint(command, result.stdout),
        )
    return result


def _hint(command: Command, output: str) -> str:
    if "NO_PUBKEY" in output or "is not signed" in output or "signatures were invalid" in output:
        return (
            "the repository is not signed by the key gpunode installed: check --repo-url, and for a mirror "
            "signed with its own key give that key (--key-file) and its fingerprint (--key-fingerprint)"
        )
    if "Could not resolve" in output or "Failed to fetch" in output or "Cannot download" in output:
        return "the repository cannot be reached: check the node's network and proxy, or use --repo-url"
    if (
        "Unable to locate package" in output
        or "has no installation candidate" in output
        or "No match" in output
    ):
        return "the repository has no such package or version: check --version (`gpunode toolkit status`)"
    if "Could not get lock" in output or "is locked" in output:
        return "another package manager is running: wait for it to finish, then run this again"
    return f"read the output above, fix the cause, and run this again (the command: {command})"


def _roll_back(host: Host, written: list[PlannedFile]) -> list[str]:
    undone = []
    for planned in reversed(written):
        try:
            if planned.before is None:
                host.remove_file(planned.file.path)
                undone.append(f"removed {planned.file.path}")
            else:
                host.write_file(planned.file.path, planned.before)
                undone.append(f"restored {planned.file.path}")
        except GpunodeError:
            undone.append(
                f"COULD NOT restore {planned.file.path} (its original is in {backup_path(planned.file.path)})"
            )
    return undone


def apply_uninstall(host: Host, plan: ToolkitPlan, progress: Progress | None = None) -> Outcome:
    refuse_under_root(host, plan, "uninstall")
    progress = progress or Progress()
    outcome = Outcome()
    total = len(plan.commands) + (1 if plan.remove or plan.restore else 0)
    step = 0
    for command in plan.commands:
        step += 1
        progress.step(step, total, f"{command.title}: {command}")
        _run(host, command, progress)
    if plan.remove or plan.restore:
        progress.step(step + 1, total, "remove the repository files")
        for path in plan.remove:
            if host.remove_file(path):
                outcome.removed.append(path)
        for path, backup in plan.restore:
            original = host.read_bytes(backup)
            if original is not None:
                host.write_file(path, original)
                outcome.restored.append(path)
    host.remove_file(RECORD_PATH)
    outcome.installed = plan.manager.installed(host)
    return outcome


# -- the record ------------------------------------------------------------------------------------


def read_record(host: Host) -> dict[str, Any]:
    text = host.read_text_if_exists(RECORD_PATH)
    if text is None:
        return {}
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{RECORD_PATH} is not valid JSON ({exc.msg}, line {exc.lineno})",
            "restore it from a backup, or delete it (gpunode then no longer removes the repository files)",
        ) from exc
    except (ValueError, RecursionError):  # a number of over 4,300 digits, or JSON nested thousands deep
        raise ConfigError(
            f"{RECORD_PATH} is not a gpunode toolkit record (a number or nesting no record has)",
            f"delete {RECORD_PATH}",
        ) from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("files", {}), dict):
        raise ConfigError(f"{RECORD_PATH} is not a gpunode toolkit record", f"delete {RECORD_PATH}")
    return loaded


def _save_record(host: Host, plan: ToolkitPlan, installed: Mapping[str, str | None]) -> None:
    record = read_record(host)
    files: dict[str, Any] = record.get("files", {})
    for planned in plan.files:
        earlier = files.get(planned.file.path, {})
        if not planned.changed and not earlier:
            continue  # already there exactly so before gpunode: not gpunode's to remove
        # "created" stays what it was at gpunode's first write: the original state is what uninstall restores.
        created = earlier.get("created", planned.before is None)
        files[planned.file.path] = {
            "created": created,
            "backup": None if created else backup_path(planned.file.path),
            "written_sha256": sha256(planned.file.content),
        }
    record = {
        "format": 1,
        "manager": plan.manager.name,
        "repo_url": plan.repo_url,
        "version": consistent_version(installed),
        "files": files,
    }
    if plan.key is not None:
        # The key trusted for this repository: status and a later install check the keyring against it.
        record["key_fingerprints"] = list(plan.key.fingerprints)
    elif isinstance(earlier_keys := read_record(host).get("key_fingerprints"), list):
        record["key_fingerprints"] = earlier_keys
    host.make_dirs(STATE_DIR)
    host.write_file(RECORD_PATH, json.dumps(record, indent=2, sort_keys=True) + "\n", mode=0o644)


# -- status ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolkitStatus:
    distribution: str
    manager: str
    installed: Mapping[str, str | None]
    version: str | None  # the one version all four are at
    files: Mapping[str, bool]  # repository files gpunode manages → present
    key_fingerprints: tuple[str, ...]
    key_trusted: bool | None  # None: no key file
    repo_url: str | None
    drift: tuple[str, ...] = ()  # what weakens the signature check in the repository files

    @property
    def healthy(self) -> bool:
        return self.version is not None and not self.drift

    def to_json(self) -> dict[str, object]:
        return {
            "distribution": self.distribution,
            "package_manager": self.manager,
            "packages": dict(self.installed),
            "version": self.version,
            "repository_files": dict(self.files),
            "key_fingerprints": list(self.key_fingerprints),
            "key_is_nvidias": self.key_trusted,
            "repo_url": self.repo_url,
            "drift": list(self.drift),
            "healthy": self.healthy,
        }


def status(host: Host) -> ToolkitStatus:
    dist, manager = detect(host)
    installed = manager.installed(host)
    record = read_record(host)
    files = {p: host.exists(p) for p in manager.owned_paths()}
    key_path = managers.APT_KEYRING if manager.name == "apt" else managers.RPM_KEY
    fingerprints: tuple[str, ...] = ()
    trusted: bool | None = None
    data = host.read_bytes(key_path) if host.is_file(key_path) else None
    if data is not None:
        try:
            fingerprints = keys.parse_key(data, key_path).fingerprints
            trusted = all(f in keys.NVIDIA_FINGERPRINTS for f in fingerprints)
        except GpunodeError:
            trusted = False
    repo = record.get("repo_url")
    recorded = record.get("key_fingerprints")
    trusted_set = (
        tuple(str(f) for f in recorded)
        if isinstance(recorded, list) and recorded
        else keys.NVIDIA_FINGERPRINTS
    )
    found = drift(host, manager, repo if isinstance(repo, str) else None, trusted_set)
    listed = repo if isinstance(repo, str) else managers.DEFAULT_REPO_URL
    found.extend(
        f"{other} lists the repository {listed} too: a second source that gpunode did not write"
        for other in manager.conflicting_sources(host, listed)
    )
    return ToolkitStatus(
        distribution=dist.pretty or dist.id,
        manager=manager.name,
        installed=installed,
        version=consistent_version(installed),
        files=files,
        key_fingerprints=fingerprints,
        key_trusted=trusted,
        repo_url=repo if isinstance(repo, str) else None,
        drift=tuple(found),
    )


def require_root(host: Host, what: str) -> None:
    if host.euid != 0:
        raise PermissionDenied(
            f"{what} changes the system's packages and repositories and needs root",
            f"run it as root (sudo gpunode {what}), or add --dry-run to see the plan",
        )
