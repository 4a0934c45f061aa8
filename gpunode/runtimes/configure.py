"""configure-runtime: choose the runtime, plan the change, apply it safely, restart and verify, or revert.

detect → plan → apply → verify. Planning only reads; applying writes the backup, then the record of what
changes, then each file atomically; a runtime that does not come back gets the previous files back.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpunode.errors import (
    CommandFailed,
    ConcurrentChange,
    ConfigError,
    GpunodeError,
    NotFound,
    UsageError,
)
from gpunode.host import Host
from gpunode.kubelet import kubelet_runtime
from gpunode.runtimes import containerd as ctd
from gpunode.runtimes import docker_editor, reader, records, service
from gpunode.runtimes.containerd_editor import plan_containerd
from gpunode.runtimes.containerd_units import SOCKETS, unit_for
from gpunode.runtimes.crio_editor import plan_crio
from gpunode.runtimes.docker_editor import plan_docker
from gpunode.runtimes.edits import Format, JsonFormat, TomlFormat, check_rendered, undo_edits
from gpunode.runtimes.plan import RUNTIMES, ConfigureOptions, FileChange, RuntimePlan

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PROGRAMS = {"docker": ("dockerd",), "containerd": ("containerd",), "crio": ("crio",)}


def choose_runtime(host: Host, requested: str | None) -> tuple[str, str | None]:
    """(runtime, why it was chosen): the one named, else the one kubelet uses, else the one installed."""
    if requested is not None:
        if requested not in RUNTIMES:
            raise UsageError(f"unknown runtime {requested!r}", f"name one of: {', '.join(RUNTIMES)}")
        return requested, None
    used = kubelet_runtime(host)
    if used is not None:
        return used, f"kubelet uses {used} (its container-runtime endpoint): configuring {used}"
    installed = [r for r in RUNTIMES if any(host.which(p) for p in _PROGRAMS[r])]
    if "containerd" not in installed and ctd.detect_location(host).flavour != "containerd":
        installed.append("containerd")  # k3s / RKE2 / microk8s embed their own containerd
    if len(installed) == 1:
        return installed[0], f"{installed[0]} is the only container runtime installed: configuring it"
    if not installed:
        raise NotFound(
            "no container runtime found (none of dockerd, containerd, crio is installed)",
            "install one, or name the one to configure: gpunode configure-runtime containerd",
        )
    raise UsageError(
        f"several container runtimes are installed ({', '.join(installed)}) and kubelet's configuration "
        "does not say which one it uses",
        f"name the one to configure, e.g. gpunode configure-runtime {installed[0]}",
    )


def check_options(opts: ConfigureOptions) -> None:
    if not _NAME.match(opts.runtime_name):
        raise UsageError(
            f"invalid runtime name {opts.runtime_name!r}",
            "use letters, digits, '.', '_' and '-' (e.g. nvidia)",
        )
    if not opts.runtime_path or any(c.isspace() for c in opts.runtime_path):
        raise UsageError(f"invalid --runtime-path {opts.runtime_path!r}", "give the binary's absolute path")
    for flag, value in (("--config", opts.config), ("--drop-in", opts.drop_in)):
        if value is not None and not value.startswith("/"):
            raise UsageError(f"{flag} needs an absolute path, not {value!r}")
    if opts.drop_in and opts.in_place:
        raise UsageError("--drop-in and --in-place cannot be used together")


def plan_configure(host: Host, runtime: str, opts: ConfigureOptions) -> RuntimePlan:
    check_options(opts)
    planner: Callable[[Host, ConfigureOptions], RuntimePlan] = {
        "docker": plan_docker,
        "containerd": plan_containerd,
        "crio": plan_crio,
    }[runtime]
    plan = planner(host, opts)
    for change in plan.pending:
        host.refuse_dangling_link(change.path)  # in the plan, so that a dry run says it too
    # One file, one name: records, backups and locks key a file by its canonical path, so the same file
    # reached through a link or another spelling keeps its one original.
    plan = replace(plan, changes=tuple(replace(c, path=host.canonical(c.path)) for c in plan.changes))
    plan = _with_directories(host, plan)
    fmt: Format = JsonFormat() if runtime == "docker" else TomlFormat()
    for change in plan.pending:
        if change.after is not None:
            check_rendered(fmt, change.after, change.edits, change.path)
    found, unread = reader.reader(host, runtime, [c.path for c in plan.changes])
    if found is None and unread is not None:
        # A file no service reads (a scratch --config): nothing to restart, now or later.
        plan = replace(plan, standard_location=False, messages=(*plan.messages, unread))
    if not host.commands_reach_root:
        plan = replace(plan, messages=(*plan.messages, _probes_note(host, runtime, plan.flavour)))
    binary = opts.runtime_path
    if binary.startswith("/") and not host.exists(binary):
        plan = replace(
            plan,
            messages=(
                *plan.messages,
                f"{binary} does not exist yet: install nvidia-container-toolkit before pods use this runtime",
            ),
        )
    return plan


def _probes_note(host: Host, runtime: str, flavour: str) -> str:
    """Where the versions came from under --root: R's package database, never a program run (neither this
    machine's nor R's own: gpunode.runtimes.probe)."""
    from gpunode.runtimes import k3s, probe

    programs = list(_PROGRAMS[runtime])
    if flavour in k3s.EMBEDDED_CONTAINERD:
        programs = [flavour, k3s.EMBEDDED_CONTAINERD[flavour]]
    looked = "; ".join(probe.locate(host, p).where for p in programs)
    return f"under --root gpunode runs no program, neither this machine's nor the image's: {looked}"


def plan_remove(host: Host, runtime: str, opts: ConfigureOptions) -> RuntimePlan:
    """Take the nvidia runtime out of configuration gpunode did not write (see gpunode.runtimes.remove)."""
    from gpunode.runtimes import remove

    check_options(opts)
    plan = remove.plan_remove(host, runtime, opts)
    plan = replace(plan, changes=tuple(replace(c, path=host.canonical(c.path)) for c in plan.changes))
    fmt: Format = JsonFormat() if runtime == "docker" else TomlFormat()
    for change in plan.pending:
        if change.after is not None:
            check_rendered(fmt, change.after, change.edits, change.path)
    return plan


def _missing_dirs(host: Host, path: str) -> tuple[str, ...]:
    """The directories above `path` that do not exist, outermost first."""
    missing: list[str] = []
    parent = posixpath.dirname(path)
    while parent != "/" and not host.is_dir(parent):
        missing.insert(0, parent)
        parent = posixpath.dirname(parent)
    return tuple(missing)


def _with_directories(host: Host, plan: RuntimePlan) -> RuntimePlan:
    """Plan the directories a new file needs, so that the dry run and the run agree: a drop-in's directory
    (or any directory of a runtime's standard layout) is created with mode 0755, as nvidia-ctk does; a file
    the operator named with --config in a directory that does not exist is refused here, not half-way."""
    changes: list[FileChange] = []
    messages = list(plan.messages)
    for change in plan.changes:
        if not change.changed or change.after is None:
            changes.append(change)
            continue
        missing = _missing_dirs(host, change.path)
        if missing and not (change.owned or plan.standard_location):
            raise NotFound(
                f"cannot write {change.path}: directory {missing[-1]} does not exist",
                f"create it (mkdir -p {missing[-1]}) or name a file in an existing directory",
            )
        if missing:
            messages.append(f"will create directory {missing[0]} (mode 0755) for {change.path}")
        changes.append(replace(change, make_dirs=tuple(missing)))
    return replace(plan, changes=tuple(changes), messages=tuple(messages))


def plan_revert(host: Host, runtime: str, opts: ConfigureOptions) -> RuntimePlan:
    """Put back every file gpunode changed for `runtime`.

    The record is per runtime and the revert takes all of it, whatever --config / --drop-in it is given: a
    revert that restored the main file and left a drop-in (or the reverse) would leave the runtime with
    half of gpunode's change, and a later glob import could bring a stale drop-in back.
    """
    loaded = records.load(host)
    known = loaded.for_runtime(runtime)
    if not known and runtime not in loaded.restart_pending:
        other = sorted({r.runtime for r in loaded.files.values()})
        raise NotFound(
            f"gpunode has no record of changing {runtime}'s configuration: nothing to revert",
            f"gpunode changed: {', '.join(other)} (revert that runtime instead)"
            if other
            else "to take an nvidia runtime gpunode did not add out of the configuration, use "
            f"`gpunode configure-runtime {runtime} --remove`",
        )
    changes: list[FileChange] = []
    messages: list[str] = []
    kept: list[str] = []
    for record in known:
        change, notes, keep = _revert_file(host, record)
        if change.before is None and change.after is not None:
            # A deleted file put back from its backup: its directory may be gone too (`rm -r
            # /etc/docker`). It is made again, 0755, as gpunode's own step (shown in the plan), and the
            # backup is removed only once the original is back in it.
            missing = _missing_dirs(host, record.path)
            if missing:
                notes.append(f"will create directory {missing[0]} (mode 0755) for {record.path}")
            changes.append(replace(change, make_dirs=missing))
        else:
            changes.append(replace(change, make_dirs=record.made_dirs))
        messages.extend(notes)
        if keep:
            kept.append(record.path)
    # Files are removed last: a main file must stop importing a drop-in before the drop-in goes.
    changes.sort(key=lambda c: c.after is None and c.before is not None)
    # The restart is for the service that reads the recorded files, whatever is installed now: none for a
    # scratch --config file, k3s's (not containerd.service) for a k3s drop-in, none once k3s is gone.
    unit, socket, flavour = _service_of(host, runtime)
    read_by_service = opts.config is None
    if known:
        found, unread = reader.reader(host, runtime, [r.path for r in known])
        if found is not None:
            unit, socket, flavour = found.unit, found.socket, found.flavour
        elif unread is not None:
            messages.append(unread)
        read_by_service = found is not None
    return RuntimePlan(
        runtime=runtime,
        changes=tuple(changes),
        messages=tuple(messages),
        unit=unit,
        socket=socket,
        flavour=flavour,
        standard_location=read_by_service,
        revert=True,
        kept=tuple(kept),
    )


def _revert_file(host: Host, record: records.FileRecord) -> tuple[FileChange, list[str], bool]:
    """The change that puts one file back, the notes that explain it, and whether the file is kept as it
    is because it is not (or cannot be shown to be) what gpunode wrote."""
    current = host.read_text_if_exists(record.path)
    digest = records.sha256(current)
    if digest == record.original_sha256:
        note = f"{record.path} is already as it was before gpunode"
        return FileChange(record.path, current, current), [note], False
    original = records.trusted_backup(host, record)
    have_original = record.backup is None or original is not None
    if record.written_known and digest == record.written_sha256 and have_original:
        return FileChange(record.path, current, original), [], False  # byte for byte what was there before
    if current is None:
        if original is not None:
            # The backup is now the only copy of the original: it goes back in place before the backup
            # is removed, never the backup alone.
            note = (
                f"{record.path} was removed since gpunode changed it: the original is put back from "
                f"{record.backup}"
            )
            return FileChange(record.path, None, original, mode=_mode_of(host, record.backup)), [note], False
        return (
            FileChange(record.path, None, None),
            [f"{record.path} was removed since gpunode changed it"],
            False,
        )
    if record.owned:
        # A file gpunode made is removed whole only while it is what gpunode wrote: anything else in it
        # (the operator's own lines, or a record pointed at another file) is not gpunode's to delete.
        why = (
            f"the record of it ({records.RECORDS}) comes from an older gpunode and does not say what "
            "gpunode wrote, so it cannot be told from your own"
            if not record.written_known
            else "it is no longer what gpunode wrote (changed since)"
        )
        note = (
            f"{record.path} is kept as it is: {why}; gpunode forgets it, and whatever it configures "
            f"stays in effect until you remove it (rm {record.path})"
        )
        return FileChange(record.path, current, current), [note], True
    fmt: Format = JsonFormat() if record.runtime == "docker" else TomlFormat()
    doc = fmt.parse(current, record.path)
    notes = undo_edits(fmt, doc, record.edits)
    why = "was edited since gpunode changed it" if have_original else f"has no backup left ({record.backup})"
    notes.insert(0, f"{record.path} {why}: removing only what gpunode added")
    return FileChange(record.path, current, fmt.render(doc, current), mode=0o644), notes, False


def _mode_of(host: Host, path: str | None) -> int:
    """The permission bits of a backup (gpunode keeps the original's mode on it), 0644 when unknown."""
    try:
        return 0o644 if path is None else host.path(path).stat().st_mode & 0o7777
    except OSError:
        return 0o644


def _service_of(host: Host, runtime: str) -> tuple[str, str, str]:
    if runtime == "docker":
        return docker_editor.UNIT, docker_editor.SOCKET, ""
    if runtime == "crio":
        from gpunode.runtimes import crio_editor

        return crio_editor.UNIT, crio_editor.SOCKET, ""
    flavour = ctd.detect_location(host).flavour
    return unit_for(host, flavour), SOCKETS[flavour], flavour


@dataclass
class Outcome:
    plan: RuntimePlan
    written: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    backups: list[str] = field(default_factory=list)
    restarted: str | None = None  # what the restarted runtime said
    restart_pending: bool = False  # the runtime has not read what gpunode wrote yet
    verified: str | None = None  # what the runtime's own view of the written files said

    @property
    def changed(self) -> bool:
        return bool(self.written or self.removed)


def _owes_restart(plan: RuntimePlan, pending_before: set[str]) -> bool:
    """Whether the plan's change (or an earlier one not yet restarted for) is one a service must read.

    A revert of files no service reads (a scratch --config, a k3s drop-in once k3s is gone) owes none,
    even to an explicit --restart: plan.unit is then only the runtime installed now (containerd.service
    beside a removed k3s), which never read them, and restarting it stops its containers for nothing."""
    if plan.revert and not plan.standard_location:
        return False
    return bool(plan.pending or plan.runtime in pending_before)


def will_restart(host: Host, plan: RuntimePlan, restart: bool) -> bool:
    """Whether apply() restarts the runtime: it changes files, or it changed them before and the runtime
    has not been restarted since (the record knows). Never under --root: see restart_elsewhere()."""
    return restart and host.commands_reach_root and _owes_restart(plan, records.load(host).restart_pending)


def restart_elsewhere(host: Host, plan: RuntimePlan) -> str | None:
    """The restart as a next step, when it is the system under --root that must run it (None otherwise).

    Under --root R, `systemctl restart` here would restart THIS machine's runtime, which does not read R's
    files: nothing that acts runs here, the restart is the operator's to run where R is the live root.
    """
    if host.commands_reach_root or not _owes_restart(plan, records.load(host).restart_pending):
        return None
    unit = plan.unit or f"{plan.runtime}.service"
    return (
        f"under --root {host.root} gpunode restarts nothing on this machine (its {unit} does not read these "
        f"files): once {host.root} is the running system, run `systemctl restart {unit}` there"
    )


def verify_effective(host: Host, plan: RuntimePlan) -> str | None:
    """Ask containerd itself (`config dump`) whether it reads the runtime as written; raise CommandFailed
    when it does not. None when it cannot be asked (not the real root, no containerd program, k3s / RKE2 /
    microk8s, which render their file at start, or nothing to expect)."""
    if plan.runtime != "containerd" or plan.flavour not in ("", "containerd") or plan.expect is None:
        return None
    main = next((c.path for c in plan.changes if not c.owned), None)
    if main is None:
        return None
    try:
        dump = ctd.effective_config(host, main)
    except ConfigError as exc:
        raise CommandFailed(exc.message, exc.fix) from None
    if dump is None:
        return None
    name, as_default = plan.expect
    runtimes = ctd.configured_runtimes(dump.doc, dump.version)
    default = ctd.default_runtime_name(dump.doc, dump.version)
    if name not in runtimes or (as_default and default != name):
        ignored = [w for w in dump.warnings if name in w]
        raise CommandFailed(
            f"containerd itself (`containerd --config {main} config dump`) does not read the {name!r} runtime"
            + (" as its default" if name in runtimes else "")
            + (f": {ignored[0]}" if ignored else ""),
            "see the dump for what containerd reads; report the layout to gpunode's developers",
        )
    return f"containerd's own dump shows the {name!r} runtime" + (" as the default" if as_default else "")


def apply(
    host: Host,
    plan: RuntimePlan,
    *,
    restart: bool,
    ready_timeout: float = service.READY_TIMEOUT,
    verify: bool = True,
) -> Outcome:
    """Carry the plan out: backups and records first, then each file atomically, then restart + verify.

    Any failure puts back the files this run changed (and the records), so the node is left as it was.
    A revert writes the files before the records: the record never forgets a change before the file is
    restored, so a revert killed at any point is finished by the next one.
    """
    outcome = Outcome(plan)
    old_records = records.load(host)
    new_records = records.Records(dict(old_records.files), set(old_records.restart_pending))
    # Files whose original is the file as it is now: no record yet, or one left by a run that stopped
    # before writing (the file still has the original's checksum). Their backup is taken (again) now.
    fresh: set[str] = set()
    for change in plan.changes:
        if plan.revert:
            new_records.files.pop(change.path, None)
            continue
        if not change.changed:
            continue
        old = old_records.files.get(change.path)
        base = old_records
        if old is None or records.sha256(change.before) == old.original_sha256:
            fresh.add(change.path)
            base = records.Records()
        new_records.files[change.path] = base.updated(
            plan.runtime,
            change.path,
            change.before,
            change.after,
            change.edits,
            owned=change.owned,
            made_dirs=change.make_dirs,
        )
    pending = plan.pending
    # --restart restarts a runtime gpunode changed and never restarted, even with nothing left to write.
    # Under --root the runtime that reads these files is not this machine's: never restarted from here.
    do_restart = restart and host.commands_reach_root and _owes_restart(plan, old_records.restart_pending)
    if plan.revert and not new_records.for_runtime(plan.runtime):
        # Nothing of gpunode's is left for the runtime to read; without a restart now, the operator is told
        # to restart it, as after any change gpunode does not restart for.
        new_records.restart_pending.discard(plan.runtime)
    elif pending and plan.standard_location:  # a file no service reads leaves no restart to do
        new_records.restart_pending.add(plan.runtime)
    if not pending and new_records == old_records and not do_restart:
        return outcome
    done: list[FileChange] = []
    restarting = False
    try:
        if plan.revert:
            for change in pending:
                done.append(change)
                _write(host, change, plan, first=False, outcome=outcome)
            # Then the backups, then the record: a revert killed in between finds every file back as it
            # was (or its record still there) and ends the job.
            _remove_backups(host, plan, old_records)
            records.save(host, new_records)
        else:
            for path in sorted(fresh):
                records.remove_backup(host, records.backup_path(path))  # a stale copy from an older cycle
            # The record goes first: a crash after it leaves files that are still the originals, which
            # revert and the next run recognise by their checksum.
            records.save(host, new_records)
            for change in pending:
                # Counted before the write: a failure after the rename (the directory fsync) has already
                # replaced the file. Rolling back a file that was not replaced is a no-op.
                done.append(change)
                _write(host, change, plan, first=change.path in fresh, outcome=outcome)
        if verify and pending and not plan.revert:
            # Before a restart: containerd must read what was written, or the files go back.
            outcome.verified = verify_effective(host, plan)
        if do_restart:
            restarting = True
            service.restart(host, plan)
            outcome.restarted = service.wait_until_ready(host, plan, timeout=ready_timeout)
    except BaseException as exc:
        # Whatever stops the change half-way — gpunode's own errors, the OS, a bug, Ctrl-C — the files go
        # back first: a node is never left with a configuration its runtime did not come back with.
        if isinstance(exc, ConcurrentChange) and done:
            done.pop()  # refused before its rename: that file is the other program's, not gpunode's
        restored = _roll_back(host, done, old_records, fresh, plan.runtime)
        if not isinstance(exc, Exception):
            raise  # Ctrl-C (KeyboardInterrupt), SystemExit: rolled back, and still what they were
        if restarting and done and not isinstance(exc, ConcurrentChange):
            # The runtime was restarted (or was being restarted) on the new files: start it on the old.
            try:
                service.restart(host, plan)
                restored = restored.rstrip(".") + f", and restarted {plan.unit} with it."
            except GpunodeError as again:
                restored += f" Restarting {plan.unit} with it failed too: {again.message}"
        if isinstance(exc, GpunodeError):
            exc.message += f"\n{restored}"
            exc.changed = "could not put back" in restored  # what --json reports as changed
            raise
        if isinstance(exc, OSError):
            raise CommandFailed(f"writing the configuration failed: {exc}\n{restored}") from exc
        # A bug in gpunode (an exception it did not foresee): the node is already safe, so the operator
        # gets what happened to the files and exit 8, not a bare internal error; --debug shows the cause.
        failed = CommandFailed(
            f"configuring {plan.runtime} failed ({type(exc).__name__}: {exc})\n{restored}",
            "this is a bug in gpunode: run the command again with --debug for the traceback and report it",
        )
        failed.changed = "could not put back" in restored
        raise failed from exc
    if do_restart:
        new_records.restart_pending.discard(plan.runtime)
        records.save(host, new_records)
    outcome.restart_pending = plan.runtime in new_records.restart_pending
    return outcome


def _remove_backups(host: Host, plan: RuntimePlan, old_records: records.Records) -> None:
    for record_path in (c.path for c in plan.changes):
        old = old_records.files.get(record_path)
        if old is not None and old.backup is not None:
            records.remove_backup(host, old.backup)


def _write(host: Host, change: FileChange, plan: RuntimePlan, *, first: bool, outcome: Outcome) -> None:
    if change.after is None:
        host.remove_file(change.path)
        outcome.removed.append(change.path)
        if plan.revert:
            _remove_made_dirs(host, change.make_dirs)
        return
    if not plan.revert or change.before is None:  # a revert makes directories only to put a file back
        for directory in change.make_dirs:
            if not host.is_dir(directory):
                host.make_dirs(directory, mode=0o755)
                host.set_mode(directory, 0o755)  # not the umask's choice
    keep_original = first and not plan.revert and change.before is not None
    backup = records.backup_path(change.path) if keep_original else None
    result = host.write_file(
        change.path,
        change.after,
        expect=change.before,
        mode=change.mode,
        backup_to=backup,
        make_parents=False,  # planned in _with_directories, made just above
        temp_dir=change.temp_dir if change.temp_dir and host.is_dir(change.temp_dir) else None,
    )
    outcome.written.append(change.path)
    if result.backup is not None and backup is not None:
        outcome.backups.append(backup)


def _remove_made_dirs(host: Host, directories: tuple[str, ...]) -> None:
    """Remove the directories gpunode created for a file, innermost first, while they are empty (anything
    the operator put there since keeps its directory)."""
    for directory in reversed(directories):
        if host.listdir(directory) or not host.remove_empty_dir(directory):
            return


def _encoded(text: str | None) -> bytes | None:
    return None if text is None else text.encode("utf-8")


def _roll_back(
    host: Host, done: list[FileChange], old_records: records.Records, fresh: set[str], plan_runtime: str
) -> str:
    """Put back what this run wrote; say what could not be put back rather than hide it."""
    failed: list[str] = []
    put_back: list[str] = []
    for change in reversed(done):
        try:
            current = host.read_bytes(change.path)
            if current == _encoded(change.before):
                continue  # never replaced (the failure came first), or already back
            if current != _encoded(change.after):
                # Another program wrote it after gpunode: its content is not gpunode's to throw away.
                failed.append(f"{change.path} (changed by another program since; left as it is)")
                continue
            if change.before is None:
                host.remove_file(change.path)
            else:
                host.write_file(change.path, change.before, expect=change.after)
            put_back.append(change.path)
        except (GpunodeError, OSError) as exc:
            failed.append(f"{change.path} ({exc})")
    if not failed:
        try:
            for path in sorted(fresh):
                records.remove_backup(host, records.backup_path(path))  # the file is its own original again
            records.save(host, old_records)
        except (GpunodeError, OSError) as exc:
            failed.append(f"{records.RECORDS} ({exc})")
    # Otherwise the record and backups stay: they describe the files as they are, so --revert works
    # once whatever failed is fixed.
    said = "gpunode changed no file." if not put_back else ""
    if put_back:
        said = "gpunode put back the previous content of " + ", ".join(reversed(put_back)) + "."
    if failed:
        said += (
            " It could not put back: "
            + "; ".join(failed)
            + f". Once that is fixed, run `gpunode configure-runtime {plan_runtime} --revert`"
            f" (originals are in {records.BACKUP_DIR})."
        )
    return said.strip()
