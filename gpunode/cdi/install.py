"""`gpunode cdi install`: keep the spec true without anyone remembering to regenerate it.

The mechanism, and why:

- a systemd oneshot, `gpunode-cdi.service`, runs `gpunode cdi generate` at boot, ordered before the
  container runtimes, kubelet and the device plugin: a new kernel module (a driver upgrade takes effect at
  the reboot) and device nodes renumbered at boot are in the spec before any pod starts;
- a path unit, `gpunode-cdi.path`, starts it whenever the dynamic linker's cache changes: every driver
  package (deb, rpm, the .run installer) runs `ldconfig` after putting its libraries in place, so a
  library upgrade is followed by a new spec within a second, with no polling and no package hook to install
  per distribution;
- a MIG geometry change touches no file (only /proc, which inotify cannot watch): whoever repartitions
  (mig-parted, an operator) runs `systemctl start gpunode-cdi.service` or `gpunode cdi generate`, and the
  device plugin refuses to start while its devices are not in the spec, which names the fix.

udev was not chosen: it sees device nodes appear, not library upgrades, and a long-running program started
from a udev rule is killed. Regenerating an unchanged node writes nothing (same bytes), so a spurious
trigger costs one NVML read.

It also closes the NVIDIA_VISIBLE_DEVICES exposure: with `accept-nvidia-visible-devices-envvar-when-
unprivileged = false` in nvidia-container-runtime's config, an unprivileged container's own environment
no longer selects GPUs; only what it was allocated (CDI, volume mounts) does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from gpunode.cdi import ownership
from gpunode.cdi.check import ENVVAR_KEY, TOOLKIT_CONFIG, envvar_setting
from gpunode.cdi.generate import GenerateOptions, default_output
from gpunode.cdi.hostfacts import LD_CACHE
from gpunode.errors import ConfigError, GpunodeError
from gpunode.host import Host
from gpunode.systemd import enable
from gpunode.systemd.unitsyntax import absolute_path, check_value, exec_start, path_setting

SERVICE = "gpunode-cdi.service"
PATH_UNIT = "gpunode-cdi.path"
UNIT_DIR = "/etc/systemd/system"
ENV_FILE = "/etc/default/gpunode-cdi"
BACKUP_DIR = "/var/lib/gpunode/backups"  # where every gpunode command keeps the files it replaced
OLD_BACKUP_DIR = (
    "/var/lib/gpunode/backup"  # where gpunode before issue 23 kept the toolkit's config: read too
)
# What `cdi install` wrote into each unit (a sha256 of the bytes) and where the file it replaced was kept:
# uninstall deletes a unit only while it is still those bytes, and puts the original back.
UNITS_RECORD = "/var/lib/gpunode/cdi-units.json"
UNIT_BACKUP_DIR = "/var/lib/gpunode/backups"  # as `plugin install` keeps the files it replaced
SYSTEMCTL_TIMEOUT = 60.0


@dataclass(frozen=True)
class FileChange:
    path: str
    content: str
    old: str | None
    # Where the file this replaces is copied first: a unit gpunode did not write (or not these bytes), the
    # toolkit's config. Never the only copy lost.
    backup: str | None = None

    @property
    def changed(self) -> bool:
        return self.content != self.old


@dataclass(frozen=True)
class InstallPlan:
    files: tuple[FileChange, ...]
    commands: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = field(default=())
    # Under --root (Host.offline) or with no systemd running: the units enabled by their links; under
    # --root, what is left to run on the system in the root (nothing runs here). See gpunode.systemd.enable.
    links: tuple[enable.Link, ...] = field(default=())
    next_steps: tuple[tuple[str, ...], ...] = field(default=())

    @property
    def changed(self) -> bool:
        return any(f.changed for f in self.files) or any(link.changed for link in self.links)


def generate_argv(executable: str, options: GenerateOptions) -> list[str]:
    return [executable, *(word for pair in _generate_options(options) for word in pair)]


def _generate_options(options: GenerateOptions) -> list[tuple[str, str]]:
    """The options of the unit's `gpunode cdi generate`, each with its value."""
    given: list[tuple[str, str]] = [("cdi", "generate")]
    if options.kind != GenerateOptions().kind:
        given.append(("--kind", options.kind))
    if options.driver_root != "/":
        given.append(("--driver-root", options.driver_root))
    if options.dev_root:
        given.append(("--dev-root", options.dev_root))
    if options.output and options.output != default_output(options.kind):
        given.append(("--output", options.output))
    if options.hook_program:
        given.append(("--hook-program", options.hook_program))
    return given


def render_service(executable: str, options: GenerateOptions) -> str:
    for option, value in _generate_options(options):
        check_value(option, value)  # refused naming the option it came from
    command = exec_start(executable, generate_argv(executable, options)[1:])
    return (
        "# Written by `gpunode cdi install`: regenerates gpunode's CDI spec (a run that finds nothing\n"
        "# changed writes nothing). Started at boot, and by gpunode-cdi.path when the linker cache changes.\n"
        "[Unit]\n"
        "Description=gpunode: regenerate the CDI spec of the NVIDIA GPUs\n"
        "After=systemd-modules-load.service nvidia-persistenced.service\n"
        "Before=containerd.service crio.service docker.service kubelet.service\n"
        "Before=gpunode-device-plugin.service\n"
        "\n"
        "[Service]\n"
        "Type=oneshot\n"
        # Where NVML is not on the loader's path (a driver container: LD_LIBRARY_PATH=...).
        f"EnvironmentFile=-{ENV_FILE}\n"
        f"ExecStart={command}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def render_path_unit(options: GenerateOptions) -> str:
    cache = path_setting("--driver-root", options.roots.driver(LD_CACHE))
    return (
        "# Written by `gpunode cdi install`: a driver package runs ldconfig after installing its libraries,\n"
        "# which replaces the linker cache; the CDI spec is then regenerated.\n"
        "[Unit]\n"
        "Description=gpunode: watch the driver's libraries for the CDI spec\n"
        "\n"
        "[Path]\n"
        f"PathChanged={cache}\n"
        f"Unit={SERVICE}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def plan_install(
    host: Host, options: GenerateOptions, executable: str, *, restrict_envvar: bool
) -> InstallPlan:
    for option, value in (("--driver-root", options.driver_root), ("--dev-root", options.dev_root)):
        if value:  # checked as given, before a path is derived from it (the error then names the value)
            absolute_path(option, value)
    enable.require_program(host, executable, "cdi install")
    record = _units_record(host)
    notes: list[str] = []
    files = [
        _unit_change(host, record, f"{UNIT_DIR}/{SERVICE}", render_service(executable, options), notes),
        _unit_change(host, record, f"{UNIT_DIR}/{PATH_UNIT}", render_path_unit(options), notes),
    ]
    if restrict_envvar:
        old = _read(host, TOOLKIT_CONFIG)
        if old is None:
            notes.append(
                f"{TOOLKIT_CONFIG} does not exist: install nvidia-container-toolkit, then run this again"
            )
        elif envvar_setting(old) is not False:
            files.append(
                FileChange(TOOLKIT_CONFIG, _with_envvar_off(old), old, f"{BACKUP_DIR}{TOOLKIT_CONFIG}")
            )
    if host.offline or not host.is_dir("/run/systemd/system"):
        # Nothing to ask a systemd: under --root this machine's is not the root's, and with none running
        # (an image being built) there is nothing to reload or start. Enabling is the links `systemctl
        # enable` would make, made here; never `systemctl --root=`, which is still this machine's program.
        links = [
            *enable.enable_links(host, SERVICE, files[0].content),
            *enable.enable_links(host, PATH_UNIT, files[1].content),
        ]
        if host.offline:
            steps: tuple[tuple[str, ...], ...] = (
                ("systemctl", "daemon-reload"),
                ("systemctl", "start", PATH_UNIT),
                ("systemctl", "start", SERVICE),
            )
        else:
            notes.append(
                "systemd is not running here: the units are enabled by their links, run at the next boot"
            )
            steps = ()
        return InstallPlan(tuple(files), (), tuple(notes), tuple(links), steps)
    commands = [
        ("systemctl", "daemon-reload"),
        ("systemctl", "enable", SERVICE, PATH_UNIT),
        ("systemctl", "start", PATH_UNIT),
        ("systemctl", "start", SERVICE),
    ]
    return InstallPlan(tuple(files), tuple(commands), tuple(notes))


def _unit_change(
    host: Host, record: dict[str, dict[str, Any]], path: str, content: str, notes: list[str]
) -> FileChange:
    """A unit to write; one that is there and is not what gpunode last wrote (another tool's, or edited by
    the operator) is kept first in the backups, and put back by `cdi uninstall`."""
    old = _read_unit(host, path)
    entry = record.get(path, {})
    if old is None or old == content or entry.get("written_sha256") == _digest(old):
        return FileChange(path, content, old, entry.get("backup"))
    backup = f"{UNIT_BACKUP_DIR}{path}"
    kept = _read(host, backup)
    if kept is not None and kept != old:  # an earlier original is kept there: never overwritten
        backup = f"{backup}.{_digest(old)[:12]}"
    notes.append(f"{path} was not written by gpunode: it is kept in {backup} (`cdi uninstall` puts it back)")
    return FileChange(path, content, old, backup)


def _read_unit(host: Host, path: str) -> str | None:
    """A unit's text; one that cannot be read is refused (it could not be kept before being replaced)."""
    return host.read_text_if_exists(path)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _units_record(host: Host) -> dict[str, dict[str, Any]]:
    """The units gpunode wrote: {path: {"written_sha256", "backup"}}; a damaged record knows nothing (its
    units are then kept by uninstall, never deleted)."""
    try:
        text = host.read_text_if_exists(UNITS_RECORD)
        data = json.loads(text) if text else {}
    except (GpunodeError, ValueError, RecursionError):
        return {}
    units = data.get("units") if isinstance(data, dict) else None
    if not isinstance(units, dict):
        return {}
    return {
        str(k): {
            "written_sha256": v.get("written_sha256") if isinstance(v.get("written_sha256"), str) else None,
            "backup": v.get("backup") if isinstance(v.get("backup"), str) else None,
        }
        for k, v in units.items()
        if isinstance(v, dict)
    }


def _write_units_record(host: Host, units: dict[str, dict[str, Any]]) -> None:
    if not units:
        host.remove_file(UNITS_RECORD)
        return
    text = json.dumps({"version": 1, "units": units}, indent=2, sort_keys=True) + "\n"
    host.write_file(UNITS_RECORD, text, mode=0o600, make_parents=True)


def _with_envvar_off(text: str) -> str:
    import tomlkit

    try:
        doc = tomlkit.parse(text)
    except Exception as exc:  # tomlkit's parse errors share no useful base class
        raise ConfigError(f"{TOOLKIT_CONFIG} is not valid TOML: {exc}", f"fix {TOOLKIT_CONFIG}") from exc
    doc[ENVVAR_KEY] = False
    return tomlkit.dumps(doc)


def _read(host: Host, path: str) -> str | None:
    try:
        return host.read_text_if_exists(path)
    except GpunodeError:
        return None


def apply_install(host: Host, plan: InstallPlan) -> None:
    record = _units_record(host)
    for change in plan.files:
        if not change.changed:
            continue
        backup = change.backup if change.old is not None else None
        host.write_file(
            change.path, change.content, mode=0o644, make_parents=True, backup_to=backup, expect=change.old
        )
        if change.path.startswith(f"{UNIT_DIR}/"):
            # Recorded right after each write: a run stopped halfway still knows the unit it wrote.
            record[change.path] = {"written_sha256": _digest(change.content), "backup": change.backup}
            _write_units_record(host, record)
    for change in plan.files:  # a re-run that wrote nothing still records units from before the record
        if change.path.startswith(f"{UNIT_DIR}/") and change.path not in record and not change.changed:
            record[change.path] = {"written_sha256": _digest(change.content), "backup": None}
            _write_units_record(host, record)
    enable.apply(host, plan.links)
    for argv in plan.commands:
        host.run(argv, timeout=SYSTEMCTL_TIMEOUT).check()


# -- the way back -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class UninstallPlan:
    remove: tuple[str, ...]  # gpunode's units and its own spec
    restore: tuple[tuple[str, str], ...]  # (file, the original to put back): the toolkit's config
    commands: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = field(default=())
    links: tuple[enable.Link, ...] = field(default=())  # under --root: the units' links, removed
    next_steps: tuple[tuple[str, ...], ...] = field(default=())
    # (spec, the backup `cdi generate --force` kept of the file it replaced): the spec is put back from it
    # (its entry in `restore` has the content), and the backup goes only once the original is in place.
    restored_from: tuple[tuple[str, str], ...] = field(default=())

    @property
    def changes_nothing(self) -> bool:
        return not self.remove and not self.restore and not self.links


def plan_uninstall(host: Host, options: GenerateOptions) -> UninstallPlan:
    """Undo `cdi install` and `cdi generate`: only files gpunode wrote (its units name `gpunode cdi
    generate`, its spec carries gpunode's header), and the toolkit's setting only while it is still as
    gpunode set it."""
    remove: list[str] = []
    notes: list[str] = []
    restore: list[tuple[str, str]] = []
    restored_from: list[tuple[str, str]] = []
    units = [f"{UNIT_DIR}/{SERVICE}", f"{UNIT_DIR}/{PATH_UNIT}"]
    record = _units_record(host)
    for unit in units:
        text = _read(host, unit)
        entry = record.get(unit)
        if text is None:
            continue
        if entry is None:
            notes.append(f"{unit} was not written by gpunode (no record in {UNITS_RECORD}): left in place")
        elif entry["written_sha256"] != _digest(text):
            notes.append(f"{unit} was changed after gpunode wrote it: left in place")
        elif entry["backup"] is None:
            remove.append(unit)
        else:
            original = _read(host, entry["backup"])
            if original is None:
                notes.append(f"{unit}: the backup {entry['backup']} of the unit it replaced is gone; kept")
            else:
                restore.append((unit, original))
                restored_from.append((unit, entry["backup"]))
                notes.append(f"{unit} is put back from {entry['backup']} (the unit `cdi install` replaced)")
    for spec in _spec_paths(host, options.path):
        _plan_spec(host, spec, remove=remove, restore=restore, restored_from=restored_from, notes=notes)
    backup = _toolkit_backup(host)
    original = _read(host, backup)
    current = _read(host, TOOLKIT_CONFIG)
    if original is not None and current is not None:
        if current == _with_envvar_off(original):
            restore.append((TOOLKIT_CONFIG, original))
        else:
            notes.append(
                f"{TOOLKIT_CONFIG} was changed after gpunode set {ENVVAR_KEY} = false: left as it is "
                f"(the original is in {backup})"
            )
    commands: list[tuple[str, ...]] = []
    if host.offline or not host.is_dir("/run/systemd/system"):
        # As in plan_install: the links removed here, never through `systemctl --root=`.
        gone = [unit.rsplit("/", 1)[1] for unit in units if unit in remove or unit in dict(restore)]
        links = tuple(link for unit in gone for link in enable.disable_links(host, unit))
        offline = host.offline and gone
        steps = (("systemctl", "stop", *gone), ("systemctl", "daemon-reload")) if offline else ()
        return UninstallPlan(
            tuple(remove), tuple(restore), (), tuple(notes), links, steps, restored_from=tuple(restored_from)
        )
    if any(u in remove or u in dict(restore) for u in units):
        commands = [("systemctl", "disable", "--now", PATH_UNIT, SERVICE), ("systemctl", "daemon-reload")]
    return UninstallPlan(
        tuple(remove), tuple(restore), tuple(commands), tuple(notes), restored_from=tuple(restored_from)
    )


def _remove_unit(
    host: Host, record: dict[str, dict[str, Any]], unit: str, original: tuple[str, str] | None
) -> None:
    """Delete a unit gpunode wrote (or put back the one it replaced), only while it is still gpunode's
    bytes; the backup goes only once the original is in place again."""
    text = _read(host, unit)
    entry = record.get(unit)
    if text is None or entry is None or entry["written_sha256"] != _digest(text):
        raise ConfigError(
            f"{unit} changed since the plan: it is no longer the unit gpunode wrote; left as it is",
            "run `gpunode cdi uninstall` again",
        )
    if original is None:
        host.remove_file(unit)
    else:
        host.write_file(unit, original[0], expect=text)
    del record[unit]
    _write_units_record(host, record)
    if original is not None:
        host.remove_file(original[1])  # no longer the only copy


def _toolkit_backup(host: Host) -> str:
    """The backup of the toolkit's config: in the backups directory, or where an older gpunode kept it."""
    backup = f"{BACKUP_DIR}{TOOLKIT_CONFIG}"
    old = f"{OLD_BACKUP_DIR}{TOOLKIT_CONFIG}"
    return old if not host.exists(backup) and host.exists(old) else backup


def _spec_paths(host: Host, default: str) -> list[str]:
    """The default spec path and every spec the record says gpunode wrote (a JSON spec, an --output)."""
    paths = [default]
    for path in ownership.recorded(host):
        if path not in paths and host.canonical(default) != path:
            paths.append(path)
    return paths


def _plan_spec(
    host: Host,
    spec: str,
    *,
    remove: list[str],
    restore: list[tuple[str, str]],
    restored_from: list[tuple[str, str]],
    notes: list[str],
) -> None:
    """A spec gpunode wrote (its header, or the record's checksum: JSON has no comments) is removed, or put
    back from the backup of the file a forced write replaced; anything else is not gpunode's to delete."""
    try:
        now = ownership.current(host, spec)
    except GpunodeError as exc:
        notes.append(f"{spec} left in place: {exc.message}")
        return
    if not now.exists:
        return
    if not now.ours:
        notes.append(f"{spec} was not written by gpunode: left in place")
        return
    kept = ownership.backups(host, spec)
    original = _read(host, kept[-1]) if kept else None
    if kept and original is None:
        notes.append(
            f"{spec}: the backup {kept[-1]} of the file it replaced is gone or unreadable; {spec} is kept"
        )
        return
    if original is not None:
        restore.append((spec, original))
        restored_from.append((spec, kept[-1]))
        notes.append(f"{spec} is put back from {kept[-1]} (the file `cdi generate --force` replaced)")
        notes.extend(f"an older backup stays: {older}" for older in kept[:-1])
    else:
        remove.append(spec)


def apply_uninstall(host: Host, plan: UninstallPlan) -> None:
    """Units stopped and disabled first, then the files removed, the toolkit's setting put back."""
    reload_cmd = ("systemctl", "daemon-reload")
    for argv in plan.commands:
        if argv != reload_cmd:
            host.run(argv, timeout=SYSTEMCTL_TIMEOUT).check()
    enable.apply(host, plan.links)
    record = _units_record(host)
    for path in plan.remove:
        if path.startswith(f"{UNIT_DIR}/"):
            _remove_unit(host, record, path, None)
        elif ownership.current(host, path).ours:  # still gpunode's bytes
            host.remove_file(path)
    backups = dict(plan.restored_from)
    for path, original in plan.restore:
        if path.startswith(f"{UNIT_DIR}/"):
            _remove_unit(host, record, path, (original, backups[path]))
            continue
        if path in backups:
            now = ownership.current(host, path)
            if not now.ours or now.data is None:
                raise ConfigError(
                    f"{path} changed since the plan: it is no longer the spec gpunode wrote; left as it is "
                    f"(the original stays in {backups[path]})",
                    "run `gpunode cdi uninstall` again",
                )
            host.write_file(path, original, expect=now.data)
            ownership.forget(host, path, backups[path])
            host.remove_file(backups[path])  # the original is in place again: no longer the only copy
            continue
        host.write_file(path, original, expect=_with_envvar_off(original))
        host.remove_file(_toolkit_backup(host))
    for path in plan.remove:
        if not path.startswith(f"{UNIT_DIR}/"):
            ownership.forget(host, path, None)
    if reload_cmd in plan.commands:
        host.run(reload_cmd, timeout=SYSTEMCTL_TIMEOUT).check()
