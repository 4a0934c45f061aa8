"""Install, remove and inspect the device plugin's systemd service.

detect → plan → apply → verify: `plan_install` reads the host and returns the files to write and the
systemctl commands to run (what `--dry-run` prints); `apply_install` writes atomically, runs them and
waits until systemd reports the unit active — with Type=notify that means the plugin has registered with
kubelet. What install wrote is recorded (checksums) so that uninstall removes exactly that.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from gpunode import paths
from gpunode.errors import CommandFailed, ConfigError, ExitCode, GpunodeError, NotFound, PermissionDenied
from gpunode.host import Host
from gpunode.plugin import statusfile
from gpunode.services import journal_tail
from gpunode.systemd import enable
from gpunode.systemd.unitsyntax import absolute_path, exec_start

UNIT = paths.PLUGIN_SERVICE
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
CONFIG_PATH = "/etc/gpunode/plugin.toml"
RECORD_PATH = "/var/lib/gpunode/plugin-service.json"
BACKUP_DIR = "/var/lib/gpunode/backups"
STATUS_FILE = paths.PLUGIN_STATUS_FILE
# `plugin install --doctor-metrics DIR`: doctor's findings for node_exporter's textfile collector (issue 18).
DOCTOR_SERVICE = "gpunode-doctor-metrics.service"
DOCTOR_TIMER = "gpunode-doctor-metrics.timer"
DOCTOR_FILE = "gpunode_doctor.prom"
READY_TIMEOUT = 120.0
POLL_INTERVAL = 0.5
# What install waits for (its progress line, and `waited_for` in its --json result).
WAITING_FOR = f"{UNIT} to register with kubelet"
# Ctrl-C during that wait: nothing is rolled back (the unit is written, enabled and started, and may
# still come up), so the message says what is left and how to look at it.
INTERRUPTED = (
    f"interrupted while waiting: {UNIT} is installed and started; check it with "
    "`gpunode plugin status` / `journalctl -u gpunode-device-plugin`"
)
SYSTEMCTL_TIMEOUT = 60.0
SHOW_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "UnitFileState",
    "StatusText",
    "MainPID",
    "NRestarts",
    "Result",
    # Where the service is told to write its status file (GPUNODE_PLUGIN_STATUS_FILE), if anywhere else.
    "Environment",
    "EnvironmentFiles",
)


@dataclass(frozen=True)
class FileWrite:
    path: str
    content: str
    mode: int
    before: str | None  # None: the file does not exist
    # The file is there with the right content but another mode or owner (a unit left 0666): rewritten.
    wrong_mode: bool = False

    @property
    def changed(self) -> bool:
        return self.before != self.content or self.wrong_mode


@dataclass(frozen=True)
class ServicePlan:
    files: tuple[FileWrite, ...]
    commands: tuple[tuple[str, ...], ...]
    remove: tuple[str, ...] = ()  # files to delete (uninstall)
    wait_ready: bool = False
    notes: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()  # uninstall: files install wrote that were changed since (left in place)
    # Under --root (Host.offline): the units enabled or disabled by their links, and what is left for the
    # operator to run on the system in the root (nothing runs on this machine).
    links: tuple[enable.Link, ...] = ()
    next_steps: tuple[tuple[str, ...], ...] = ()

    @property
    def changes_nothing(self) -> bool:
        return (
            not any(f.changed for f in self.files)
            and not self.commands
            and not self.remove
            and not any(link.changed for link in self.links)
        )


@dataclass(frozen=True)
class Waiting:
    """Where install's wait for the unit stands: reported at each poll, for the CLI's progress line."""

    what: str
    elapsed: float
    timeout: float
    done: bool = False  # the last report: the unit is active, failed, or the time is up


# The wait's clock and pause: module attributes, read at each call, so that a test of the CLI can run the
# wait (and interrupt it) without real time passing.
monotonic: Callable[[], float] = time.monotonic
pause: Callable[[float], None] = time.sleep


@dataclass
class ServiceState:
    properties: dict[str, str] = field(default_factory=dict)
    plugin: dict[str, object] | None = None  # the plugin's own status file, when it is running
    lookup: statusfile.Lookup = field(default_factory=statusfile.Lookup)  # where that file was looked for
    waited_s: float | None = None  # install: how long it waited for the unit to turn active (None: no wait)

    @property
    def installed(self) -> bool:
        """systemd knows the unit (False also when systemctl does not answer: no systemd, a container)."""
        return bool(self.properties) and self.properties.get("LoadState") != "not-found"

    @property
    def active(self) -> str:
        return self.properties.get("ActiveState", "unknown")

    @property
    def enabled(self) -> bool:
        return self.properties.get("UnitFileState") in ("enabled", "enabled-runtime")


def gpunode_executable() -> str:
    """The installed `gpunode` program: next to this interpreter (a venv or /usr/local), else on PATH."""
    beside = Path(sys.executable).parent / "gpunode"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    import shutil

    found = shutil.which("gpunode")
    if found is None:
        raise NotFound(
            "cannot find the installed `gpunode` program to put in the unit's ExecStart",
            "install gpunode with ./install.sh (it puts gpunode on PATH), then run this again",
        )
    return str(Path(found).resolve())


# Hardening options that would hide the program itself when gpunode is installed below these directories
# (a venv in /root, a checkout in /tmp): the unit would fail with 203/EXEC, so they are turned off.
_HIDING = {
    "ProtectHome=yes": ("/home", "/root", "/run/user"),
    "PrivateTmp=yes": ("/tmp", "/var/tmp"),  # noqa: S108 (names the directories, creates nothing)
}


def _under(path: str, prefixes: Iterable[str]) -> list[str]:
    """The prefixes that are the path or a directory above it."""
    return [p for p in prefixes if path == p or path.startswith(p + "/")]


def render_unit(executable: str) -> str:
    template = resources.files("gpunode.templates").joinpath(UNIT).read_text(encoding="utf-8")
    text = template.replace("@EXEC_START@", exec_start(executable, ["plugin", "run"]))
    for option, prefixes in _HIDING.items():
        hidden_under = _under(executable, prefixes)
        if hidden_under:
            text = text.replace(
                f"\n{option}\n",
                f"\n# {option} is off: gpunode is installed under {hidden_under[0]}, which it would hide\n",
            )
    return text


def render_doctor_units(executable: str, directory: str) -> tuple[str, str]:
    """The oneshot service and its timer that write DIR/gpunode_doctor.prom (node_exporter's
    --collector.textfile.directory)."""
    directory = absolute_path("--doctor-metrics", directory)
    templates = resources.files("gpunode.templates")
    target = directory.rstrip("/") + "/" + DOCTOR_FILE
    unit = templates.joinpath(DOCTOR_SERVICE).read_text(encoding="utf-8")
    command = exec_start(executable, ["doctor", "--prometheus", target])
    unit = unit.replace("@EXEC_START@", command)
    return unit, templates.joinpath(DOCTOR_TIMER).read_text(encoding="utf-8")


def hardening_relaxed(executable: str) -> list[str]:
    """The hardening options render_unit turns off for this location (to tell the operator)."""
    return [option for option, prefixes in _HIDING.items() if _under(executable, prefixes)]


def service_state(
    host: Host, *, status_file: str | None = None, env: Mapping[str, str] | None = None
) -> ServiceState:
    """systemd's view of the unit and the plugin's status file: `status_file`, else
    $GPUNODE_PLUGIN_STATUS_FILE in `env`, else where the unit tells the service to write it, else the
    default."""
    props: dict[str, str] = {}
    result = None
    try:
        # Under --root this machine's systemd knows nothing of the root's unit: not asked, the status
        # file in the root alone tells (ActiveState stays "unknown").
        if not host.offline:
            result = host.run(
                ["systemctl", "show", UNIT, *(f"--property={p}" for p in SHOW_PROPERTIES)],
                timeout=SYSTEMCTL_TIMEOUT,
            )
    except CommandFailed:
        result = None  # no systemctl (a container): the status file alone tells the plugin's state
    if result is not None and result.ok:
        for line in result.stdout.splitlines():
            key, _, value = line.partition("=")
            key, value = key.strip(), value.strip()
            if key == "EnvironmentFiles" and props.get(key):  # one line per file
                value = f"{props[key]}\n{value}"
            props[key] = value
    lookup = statusfile.find(
        host, flag=status_file, env=env if env is not None else {}, unit=UNIT, unit_properties=props
    )
    return ServiceState(props, lookup.document, lookup)


def _planned_file(host: Host, path: str, content: str, mode: int = 0o644) -> FileWrite:
    """A file gpunode owns: its mode and owner are gpunode's (root, `mode`) whatever was there before."""
    before = host.read_text_if_exists(path)
    wrong = False
    if before is not None:
        try:
            st = host.path(path).stat()
        except OSError:
            st = None
        wrong = st is not None and (stat.S_IMODE(st.st_mode) != mode or st.st_uid != host.euid)
    return FileWrite(path, content, mode, before, wrong_mode=wrong)


def plan_install(
    host: Host,
    *,
    config_file: str | None,
    start: bool,
    executable: str,
    doctor_metrics: str | None = None,
) -> ServicePlan:
    """What install would write and run. A config file is validated first (before systemd is touched).
    `doctor_metrics` (a directory): also the timer that writes doctor's findings there."""
    files = [_planned_file(host, UNIT_PATH, render_unit(executable))]
    if config_file is not None:
        files.append(_planned_file(host, CONFIG_PATH, _validated_config(host, config_file, executable)))
    doctor_files = []
    if doctor_metrics is not None:
        doctor_unit, timer = render_doctor_units(executable, doctor_metrics)
        doctor_files = [
            _planned_file(host, f"/etc/systemd/system/{DOCTOR_SERVICE}", doctor_unit),
            _planned_file(host, f"/etc/systemd/system/{DOCTOR_TIMER}", timer),
        ]
    if host.offline:
        enable.require_program(host, executable, "plugin install")
        return _plan_install_offline(host, files, doctor_files, start=start, executable=executable)
    state = service_state(host)
    commands: list[tuple[str, ...]] = []
    unit_changed = files[0].changed
    config_changed = len(files) > 1 and files[1].changed
    doctor_changed = any(f.changed for f in doctor_files)
    files += doctor_files
    if unit_changed or doctor_changed:
        commands.append(("systemctl", "daemon-reload"))
    if doctor_changed:
        commands.append(("systemctl", "enable", "--now", DOCTOR_TIMER))
    if not state.enabled or unit_changed:
        commands.append(("systemctl", "enable", UNIT))
    running = state.active in ("active", "activating", "reloading")
    if start:
        if not running:
            commands.append(("systemctl", "start", "--no-block", UNIT))
        elif unit_changed:
            commands.append(("systemctl", "restart", "--no-block", UNIT))
        elif config_changed:
            commands.append(("systemctl", "reload", UNIT))  # SIGHUP: the plugin re-reads its config
    return ServicePlan(tuple(files), tuple(commands), wait_ready=start, notes=_notes(executable))


def _notes(executable: str) -> tuple[str, ...]:
    return tuple(
        f"{option} is off in the unit: {executable} lies in a directory it would hide; install gpunode "
        "under /usr/local or /opt to keep it"
        for option in hardening_relaxed(executable)
    )


def _plan_install_offline(
    host: Host, files: list[FileWrite], doctor_files: list[FileWrite], *, start: bool, executable: str
) -> ServicePlan:
    """Under --root: the files written into the root, the units enabled by their links there, and the
    rest — reload, start — left as next steps for the system in the root (nothing runs here)."""
    unit, config = files[0], (files[1] if len(files) > 1 else None)
    links = enable.enable_links(host, UNIT, unit.content)
    steps: list[tuple[str, ...]] = []
    if unit.changed or any(f.changed for f in doctor_files):
        steps.append(("systemctl", "daemon-reload"))
    if doctor_files:
        links += enable.enable_links(host, DOCTOR_TIMER, doctor_files[1].content)
        if any(f.changed for f in doctor_files):
            steps.append(("systemctl", "start", DOCTOR_TIMER))
    if start:
        # Whether the plugin runs there now is not known from here: a unit that was there is taken to be
        # running (a restart or a reload applies the change), a new one to be started.
        if unit.before is None:
            steps.append(("systemctl", "start", UNIT))
        elif unit.changed:
            steps.append(("systemctl", "restart", UNIT))
        elif config is not None and config.changed:
            steps.append(("systemctl", "reload", UNIT))
    files += doctor_files
    notes = _notes(executable)
    return ServicePlan(tuple(files), (), notes=notes, links=tuple(links), next_steps=tuple(steps))


# Where the unit's own hardening puts a private or read-only view (ProtectSystem=full: /usr, /boot, /etc).
_UNIT_PRIVATE = {**_HIDING, "ProtectSystem=full": ("/usr", "/boot", "/etc", "/efi")}
UNIT_ENV_FILE = "/etc/default/gpunode-device-plugin"  # the unit's EnvironmentFile= (see the template)


def _validated_config(host: Host, config_file: str, executable: str) -> str:
    from gpunode.plugin.config import config_file_named, load_config

    text = host.read_text_if_exists(config_file)
    if text is None:
        raise NotFound(f"plugin config {config_file} does not exist", "give the path of a plugin TOML file")
    env = statusfile.environment_file(host, UNIT_ENV_FILE)
    named_by, named = config_file_named(env)  # as the unit's `plugin run` (no --config) will pick it
    if named is not None and named != CONFIG_PATH:
        variable = named_by.removeprefix("$")
        raise ConfigError(
            f"{UNIT_ENV_FILE} sets {variable}={named}: the service would read that file, not the "
            f"{CONFIG_PATH} plugin install writes",
            f"remove {variable} from {UNIT_ENV_FILE} (the file given to --config is installed as "
            f"{CONFIG_PATH}), then run again",
        )
    # The whole resolution, as the service will do it (the file, and the unit's environment file):
    # unknown keys, bad values, impossible combinations.
    config = load_config(host, config_path=config_file, env=env)
    if any(e.replicas > 1 for e in config.mps_resources):
        # The MPS daemons' pipe and shm directories must be the ones pods mount from the host: under a
        # directory the unit makes private (PrivateTmp) or read-only, the daemons would live in the
        # service's own view, and pods would run without MPS (a client that finds no daemon runs unlimited).
        relaxed = set(hardening_relaxed(executable))
        root = config.mps_root
        for option, prefixes in _UNIT_PRIVATE.items():
            under = _under(root, prefixes)
            if under and option not in relaxed:
                raise ConfigError(
                    f"mps.root {root} lies under {under[0]}, which the plugin's unit ({option}) keeps "
                    "from the host: pods would not reach its MPS daemons",
                    "use a directory under /run or /var/lib (the default is /run/nvidia/mps)",
                )
    from gpunode.plugin.nvidia_config import is_toml

    if not is_toml(text):
        # NVIDIA's config (it loaded, so it is one): installed as the gpunode TOML it means, which is what
        # /etc/gpunode/plugin.toml should hold and what an operator editing it later expects.
        from gpunode.plugin.import_config import render

        return render(text, config_file)
    return text


def require_root(host: Host, what: str) -> None:
    if host.euid != 0:
        raise PermissionDenied(
            f"{what} changes systemd units under /etc and needs root",
            f"run it as root (sudo gpunode {what}), or add --dry-run to see the plan",
        )


def apply_install(
    host: Host,
    plan: ServicePlan,
    *,
    timeout: float = READY_TIMEOUT,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
    progress: Callable[[Waiting], None] | None = None,
) -> ServiceState:
    """`progress` is called at each poll of the wait for the unit (see wait_until_active)."""
    require_root(host, "plugin install")
    changed = False  # a file written, a link made or a systemctl command run: nothing is rolled back
    try:
        record = _read_record(host)
        for f in plan.files:
            if f.changed:
                backup = f"{BACKUP_DIR}{f.path}" if f.before is not None and f.path not in record else None
                host.write_file(
                    f.path, f.content, mode=f.mode, backup_to=backup, make_parents=True, exact_mode=True
                )
                changed = True
            record[f.path] = _digest(f.content)
        host.make_dirs(os.path.dirname(RECORD_PATH))
        host.write_file(RECORD_PATH, json.dumps(record, indent=2, sort_keys=True) + "\n", mode=0o644)
        changed = changed or any(link.changed for link in plan.links)
        enable.apply(host, plan.links)
        for argv in plan.commands:
            changed = True  # a systemctl command that fails may have acted all the same (enabled, started)
            host.run(list(argv), timeout=SYSTEMCTL_TIMEOUT).check()
        if host.offline:
            return ServiceState()  # this machine's systemd knows nothing of the root's units: not asked
        if not plan.wait_ready:
            return service_state(host)
        return wait_until_active(host, timeout=timeout, sleep=sleep, clock=clock, progress=progress)
    except GpunodeError as err:
        # The files written stay (a re-run finishes the install, uninstall removes them): the --json
        # error document must say that the host changed.
        err.changed = err.changed or changed
        raise


def wait_until_active(
    host: Host,
    *,
    timeout: float = READY_TIMEOUT,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
    progress: Callable[[Waiting], None] | None = None,
) -> ServiceState:
    """Type=notify: the unit turns active only after the plugin's READY=1, i.e. once it has registered.

    Polling systemctl is the only way to wait on another process's unit from outside. `progress` hears
    what is waited for and for how long at every poll, the last one included (the CLI shows it: the wait
    can last `timeout` seconds). Ctrl-C ends the wait, not the install: the error says what is left.
    """
    sleep = sleep or pause
    clock = clock or monotonic
    start = clock()
    try:
        while True:
            state = service_state(host)
            elapsed = max(0.0, clock() - start)
            over = state.active in ("active", "failed") or elapsed >= timeout
            if progress is not None:
                progress(Waiting(WAITING_FOR, elapsed, timeout, done=over))
            if state.active == "active":
                state.waited_s = elapsed
                return state
            if over:
                why = state.properties.get("StatusText") or state.properties.get("Result") or state.active
                raise CommandFailed(
                    f"{UNIT} did not become ready within {timeout:.0f}s ({state.active}: {why})"
                    + journal_tail(host, UNIT),
                    "the plugin is ready once it has registered with kubelet: check that kubelet runs "
                    f"(`systemctl status kubelet`) and `journalctl -u {UNIT}`",
                )
            sleep(POLL_INTERVAL)
    except KeyboardInterrupt:
        # Not rolled back: the unit may still come up, and stopping a plugin that is about to register
        # would undo a good install. The host changed (the --json error document says so).
        err = GpunodeError(
            INTERRUPTED,
            "nothing was rolled back: the service comes up once the plugin registers; "
            "`gpunode plugin uninstall` removes it",
            exit_code=ExitCode.INTERRUPTED,
        )
        err.changed = True
        raise err from None


def plan_uninstall(host: Host) -> ServicePlan:
    """Stop, disable and remove what install wrote, and nothing else (files changed since are kept)."""
    record = _read_record(host)
    remove: list[str] = []
    kept: list[str] = []
    notes: list[str] = []
    for path, digest in sorted(record.items()):
        text = host.read_text_if_exists(path)
        if text is None:
            continue
        if _digest(text) == digest:
            remove.append(path)
        else:
            kept.append(path)
            notes.append(f"{path} was changed after gpunode wrote it; left in place")
    if not record and host.exists(UNIT_PATH):
        notes.append(f"{UNIT_PATH} was not installed by gpunode (no record); left in place")
    if host.offline:
        # Under --root: the links to the units removed go with them (what `systemctl disable` removes);
        # stopping and reloading are for the system in the root, if it runs.
        gone = [
            os.path.basename(p) for p in remove if p in (UNIT_PATH, f"/etc/systemd/system/{DOCTOR_TIMER}")
        ]
        links = tuple(link for unit in gone for link in enable.disable_links(host, unit))
        steps = (("systemctl", "stop", *gone), ("systemctl", "daemon-reload")) if gone else ()
        return ServicePlan(
            (), (), remove=tuple(remove), notes=tuple(notes), kept=tuple(kept), links=links, next_steps=steps
        )
    state = service_state(host)
    commands: list[tuple[str, ...]] = []
    running = state.active not in ("inactive", "unknown") or state.enabled
    if record and running:
        commands.append(("systemctl", "disable", "--now", UNIT))
    elif running:
        # Without a record the unit is someone else's (installed by hand, or by another tool): stopping
        # it would undo what gpunode never did.
        notes.append(
            f"{UNIT} is {state.active}{' and enabled' if state.enabled else ''}, but gpunode has no record "
            f"of installing it ({RECORD_PATH}); left running as it is"
        )
    if f"/etc/systemd/system/{DOCTOR_TIMER}" in record:
        commands.append(("systemctl", "disable", "--now", DOCTOR_TIMER))
    if UNIT_PATH in remove or f"/etc/systemd/system/{DOCTOR_TIMER}" in remove:
        commands.append(("systemctl", "daemon-reload"))
    return ServicePlan((), tuple(commands), remove=tuple(remove), notes=tuple(notes), kept=tuple(kept))


def apply_uninstall(host: Host, plan: ServicePlan) -> None:
    require_root(host, "plugin uninstall")
    reload_cmd = ("systemctl", "daemon-reload")
    for argv in plan.commands:
        if argv != reload_cmd:
            host.run(list(argv), timeout=SYSTEMCTL_TIMEOUT).check()
    enable.apply(host, plan.links)
    for path in plan.remove:
        host.remove_file(path)
    if reload_cmd in plan.commands:
        host.run(list(reload_cmd), timeout=SYSTEMCTL_TIMEOUT).check()
    host.remove_file(RECORD_PATH)


def _read_record(host: Host) -> dict[str, str]:
    text = host.read_text_if_exists(RECORD_PATH)
    if not text:
        return {}
    try:
        loaded = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or JSON nested thousands deep
        return {}
    return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
