"""Install, remove and inspect gpunode's systemd services: the device plugin's and the DRA driver's.

detect → plan → apply → verify: `plan_install` reads the host and returns the files to write and the
systemctl commands to run (what `--dry-run` prints); `apply_install` writes atomically, runs them and
waits until systemd reports the unit active — with Type=notify that means the plugin has registered with
kubelet. What install wrote is recorded (checksums) so that uninstall removes exactly that.

The two services share this machinery; a UnitSpec says what differs (the unit, the command it runs, its
record, its status file). A node runs one of them: each install refuses while the other is enabled.
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
class UnitSpec:
    """One of gpunode's services: what install, uninstall and status need to know of it."""

    command: str  # "plugin": `gpunode plugin install`, `gpunode plugin status`
    unit: str
    run_args: tuple[str, ...]  # what ExecStart runs after the gpunode program
    record_path: str
    env_file: str  # the unit's EnvironmentFile=
    status_env: str  # the variable that moves the status file, and where it is by default
    status_default: str
    waiting_for: str  # install's progress line and `waited_for`
    ready_fix: str  # what to check when the unit does not turn active

    @property
    def unit_path(self) -> str:
        return f"/etc/systemd/system/{self.unit}"

    @property
    def interrupted(self) -> str:
        # Ctrl-C during the wait: nothing is rolled back, so the message says what is left and where to look.
        return (
            f"interrupted while waiting: {self.unit} is installed and started; check it with "
            f"`gpunode {self.command} status` / `journalctl -u {self.unit.removesuffix('.service')}`"
        )


PLUGIN = UnitSpec(
    command="plugin",
    unit=UNIT,
    run_args=("plugin", "run"),
    record_path=RECORD_PATH,
    env_file="/etc/default/gpunode-device-plugin",
    status_env=statusfile.ENV,
    status_default=STATUS_FILE,
    waiting_for=WAITING_FOR,
    ready_fix="the plugin is ready once it has registered with kubelet",
)
DRA = UnitSpec(
    command="dra",
    unit="gpunode-dra-driver.service",
    run_args=("dra", "run"),
    record_path="/var/lib/gpunode/dra-service.json",
    env_file="/etc/default/gpunode-dra-driver",
    status_env="GPUNODE_DRA_STATUS_FILE",
    status_default="/run/gpunode/dra.json",
    waiting_for="gpunode-dra-driver.service to register with kubelet",
    ready_fix="the DRA driver is ready once its sockets are served and registered with kubelet",
)
# One side per node: two services would serve the same GPUs to kubelet through two APIs.
_OTHER = {PLUGIN.unit: DRA, DRA.unit: PLUGIN}


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
    spec: UnitSpec = PLUGIN

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


def render_unit(executable: str, spec: UnitSpec = PLUGIN) -> str:
    template = resources.files("gpunode.templates").joinpath(spec.unit).read_text(encoding="utf-8")
    text = template.replace("@EXEC_START@", exec_start(executable, list(spec.run_args)))
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
    host: Host,
    *,
    status_file: str | None = None,
    env: Mapping[str, str] | None = None,
    spec: UnitSpec = PLUGIN,
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
                ["systemctl", "show", spec.unit, *(f"--property={p}" for p in SHOW_PROPERTIES)],
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
        host,
        flag=status_file,
        env=env if env is not None else {},
        unit=spec.unit,
        unit_properties=props,
        env_name=spec.status_env,
        default=spec.status_default,
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
    spec: UnitSpec = PLUGIN,
) -> ServicePlan:
    """What install would write and run. A config file is validated first (before systemd is touched).
    `doctor_metrics` (a directory): also the timer that writes doctor's findings there (the plugin's
    options: the DRA driver takes its settings from its environment file)."""
    _refuse_other_side(host, spec)
    files = [_planned_file(host, spec.unit_path, render_unit(executable, spec))]
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
        enable.require_program(host, executable, f"{spec.command} install")
        return _plan_install_offline(host, files, doctor_files, start=start, executable=executable, spec=spec)
    state = service_state(host, spec=spec)
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
        commands.append(("systemctl", "enable", spec.unit))
    running = state.active in ("active", "activating", "reloading")
    if start:
        if not running:
            commands.append(("systemctl", "start", "--no-block", spec.unit))
        elif unit_changed:
            commands.append(("systemctl", "restart", "--no-block", spec.unit))
        elif config_changed:
            commands.append(("systemctl", "reload", spec.unit))  # SIGHUP: the plugin re-reads its config
    return ServicePlan(tuple(files), tuple(commands), wait_ready=start, notes=_notes(executable), spec=spec)


def _refuse_other_side(host: Host, spec: UnitSpec) -> None:
    """One side per node: the device plugin and the DRA driver would both hand the GPUs to kubelet."""
    other = _OTHER[spec.unit]
    if not host.exists(other.unit_path):
        return  # gpunode writes its units there: without the file, the other side is not gpunode's
    if host.offline:
        # This machine's systemd knows nothing of the root's units: enabled is the link `enable` makes.
        wants = f"/etc/systemd/system/multi-user.target.wants/{other.unit}"
        enabled = os.path.lexists(host.path(wants))
    else:
        state = service_state(host, spec=other)
        enabled = state.installed and state.enabled
    if enabled:
        raise GpunodeError(
            f"{other.unit} is installed and enabled: gpunode's {_SIDE[other.command]} already serves this "
            f"node's GPUs, and one node serves them through one kubelet API",
            f"switch the node over with `gpunode up` (issue 26), or run `gpunode {other.command} uninstall` "
            f"first, then run `gpunode {spec.command} install` again",
            exit_code=ExitCode.ERROR,
        )


_SIDE = {"plugin": "device plugin", "dra": "DRA driver"}


def _notes(executable: str) -> tuple[str, ...]:
    return tuple(
        f"{option} is off in the unit: {executable} lies in a directory it would hide; install gpunode "
        "under /usr/local or /opt to keep it"
        for option in hardening_relaxed(executable)
    )


def _plan_install_offline(
    host: Host,
    files: list[FileWrite],
    doctor_files: list[FileWrite],
    *,
    start: bool,
    executable: str,
    spec: UnitSpec,
) -> ServicePlan:
    """Under --root: the files written into the root, the units enabled by their links there, and the
    rest — reload, start — left as next steps for the system in the root (nothing runs here)."""
    unit, config = files[0], (files[1] if len(files) > 1 else None)
    links = enable.enable_links(host, spec.unit, unit.content)
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
            steps.append(("systemctl", "start", spec.unit))
        elif unit.changed:
            steps.append(("systemctl", "restart", spec.unit))
        elif config is not None and config.changed:
            steps.append(("systemctl", "reload", spec.unit))
    files += doctor_files
    notes = _notes(executable)
    return ServicePlan(tuple(files), (), notes=notes, links=tuple(links), next_steps=tuple(steps), spec=spec)


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
    spec = plan.spec
    require_root(host, f"{spec.command} install")
    changed = False  # a file written, a link made or a systemctl command run: nothing is rolled back
    try:
        record = _read_record(host, spec)
        for f in plan.files:
            if f.changed:
                backup = f"{BACKUP_DIR}{f.path}" if f.before is not None and f.path not in record else None
                host.write_file(
                    f.path, f.content, mode=f.mode, backup_to=backup, make_parents=True, exact_mode=True
                )
                changed = True
            record[f.path] = _digest(f.content)
        host.make_dirs(os.path.dirname(spec.record_path))
        host.write_file(spec.record_path, json.dumps(record, indent=2, sort_keys=True) + "\n", mode=0o644)
        changed = changed or any(link.changed for link in plan.links)
        enable.apply(host, plan.links)
        for argv in plan.commands:
            changed = True  # a systemctl command that fails may have acted all the same (enabled, started)
            host.run(list(argv), timeout=SYSTEMCTL_TIMEOUT).check()
        if host.offline:
            return ServiceState()  # this machine's systemd knows nothing of the root's units: not asked
        if not plan.wait_ready:
            return service_state(host, spec=spec)
        return wait_until_active(
            host, timeout=timeout, sleep=sleep, clock=clock, progress=progress, spec=spec
        )
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
    spec: UnitSpec = PLUGIN,
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
            state = service_state(host, spec=spec)
            elapsed = max(0.0, clock() - start)
            over = state.active in ("active", "failed") or elapsed >= timeout
            if progress is not None:
                progress(Waiting(spec.waiting_for, elapsed, timeout, done=over))
            if state.active == "active":
                state.waited_s = elapsed
                return state
            if over:
                why = state.properties.get("StatusText") or state.properties.get("Result") or state.active
                raise CommandFailed(
                    f"{spec.unit} did not become ready within {timeout:.0f}s ({state.active}: {why})"
                    + journal_tail(host, spec.unit),
                    f"{spec.ready_fix}: check that kubelet runs "
                    f"(`systemctl status kubelet`) and `journalctl -u {spec.unit}`",
                )
            sleep(POLL_INTERVAL)
    except KeyboardInterrupt:
        # Not rolled back: the unit may still come up, and stopping a plugin that is about to register
        # would undo a good install. The host changed (the --json error document says so).
        err = GpunodeError(
            spec.interrupted,
            f"nothing was rolled back: the service comes up once the {spec.command.replace('dra', 'driver')} "
            "registers; "
            f"`gpunode {spec.command} uninstall` removes it",
            exit_code=ExitCode.INTERRUPTED,
        )
        err.changed = True
        raise err from None


def plan_uninstall(host: Host, spec: UnitSpec = PLUGIN) -> ServicePlan:
    """Stop, disable and remove what install wrote, and nothing else (files changed since are kept)."""
    unit, unit_path, record_path = spec.unit, spec.unit_path, spec.record_path
    record = _read_record(host, spec)
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
    if not record and host.exists(unit_path):
        notes.append(f"{unit_path} was not installed by gpunode (no record); left in place")
    if host.offline:
        # Under --root: the links to the units removed go with them (what `systemctl disable` removes);
        # stopping and reloading are for the system in the root, if it runs.
        gone = [
            os.path.basename(p) for p in remove if p in (unit_path, f"/etc/systemd/system/{DOCTOR_TIMER}")
        ]
        links = tuple(link for name in gone for link in enable.disable_links(host, name))
        steps = (("systemctl", "stop", *gone), ("systemctl", "daemon-reload")) if gone else ()
        return ServicePlan(
            (),
            (),
            remove=tuple(remove),
            notes=tuple(notes),
            kept=tuple(kept),
            links=links,
            next_steps=steps,
            spec=spec,
        )
    state = service_state(host, spec=spec)
    commands: list[tuple[str, ...]] = []
    running = state.active not in ("inactive", "unknown") or state.enabled
    if record and running:
        commands.append(("systemctl", "disable", "--now", unit))
    elif running:
        # Without a record the unit is someone else's (installed by hand, or by another tool): stopping
        # it would undo what gpunode never did.
        notes.append(
            f"{unit} is {state.active}{' and enabled' if state.enabled else ''}, but gpunode has no record "
            f"of installing it ({record_path}); left running as it is"
        )
    if f"/etc/systemd/system/{DOCTOR_TIMER}" in record:
        commands.append(("systemctl", "disable", "--now", DOCTOR_TIMER))
    if unit_path in remove or f"/etc/systemd/system/{DOCTOR_TIMER}" in remove:
        commands.append(("systemctl", "daemon-reload"))
    return ServicePlan(
        (), tuple(commands), remove=tuple(remove), notes=tuple(notes), kept=tuple(kept), spec=spec
    )


def apply_uninstall(host: Host, plan: ServicePlan) -> None:
    require_root(host, f"{plan.spec.command} uninstall")
    reload_cmd = ("systemctl", "daemon-reload")
    for argv in plan.commands:
        if argv != reload_cmd:
            host.run(list(argv), timeout=SYSTEMCTL_TIMEOUT).check()
    enable.apply(host, plan.links)
    for path in plan.remove:
        host.remove_file(path)
    if reload_cmd in plan.commands:
        host.run(list(reload_cmd), timeout=SYSTEMCTL_TIMEOUT).check()
    host.remove_file(plan.spec.record_path)


def _read_record(host: Host, spec: UnitSpec = PLUGIN) -> dict[str, str]:
    text = host.read_text_if_exists(spec.record_path)
    if not text:
        return {}
    try:
        loaded = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or JSON nested thousands deep
        return {}
    return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
