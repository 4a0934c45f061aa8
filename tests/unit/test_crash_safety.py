"""Crash safety of configure-runtime's writes: a failure or a kill at any point of the write sequence leaves
each configuration file either the old or the new complete file, and the node recoverable.

Part a injects an OSError into every step of Host.write_file / _atomic_write / apply (tempfile.mkstemp, the
data write, fchmod, fchown, fsync of the file and of the directory, rename, open, remove, records.save,
each atomic write as a whole) at the Nth call, for every N, once or from then on (a disk that stays full).
Part b kills a real `gpunode configure-runtime` process with SIGKILL at the Nth fsync / rename / write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import gpunode.host
from gpunode.cli.main import main
from gpunode.errors import ExitCode, GpunodeError
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import configure, containerd, crio, docker, records
from gpunode.runtimes.plan import ConfigureOptions
from tests.killharness import fake_containerd_env, gpunode_process

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20 1.6.20~ds1-1\n"
STOCK_CONTAINERD = (FIXTURES / "containerd/default-v2.toml").read_bytes()
# A common hand-written config: only runc's SystemdCgroup set.
SYSTEMD_ONLY_CONTAINERD = (
    b"version = 2\n"
    b'[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
    b"SystemdCgroup = true\n"
)
# daemon.json written on one line without spaces, as `echo '{...}' > daemon.json` leaves it.
COMPACT_DAEMON_JSON = b'{"log-driver":"journald","live-restore":true}'
CONTAINERD_DROPIN = "/etc/containerd/conf.d/99-nvidia.toml"
TEMP_SUFFIX = ".gpunode-tmp"


def host_at(root: Path) -> Host:
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], CONTAINERD_1_6)
    return Host(root=root, runner=runner)


def local(root: Path, host_path: str) -> Path:
    return root / host_path.lstrip("/")


def read(root: Path, host_path: str) -> bytes | None:
    path = local(root, host_path)
    return path.read_bytes() if path.exists() else None


def temp_files(root: Path) -> list[str]:
    return sorted("/" + str(p.relative_to(root)) for p in root.rglob(f"*{TEMP_SUFFIX}"))


@dataclass(frozen=True)
class Scenario:
    runtime: str
    files: Mapping[str, bytes]  # the node's files before gpunode
    opts: ConfigureOptions
    watched: tuple[str, ...]  # the configuration files the runtime reads

    def prepare(self, root: Path) -> None:
        for host_path, data in self.files.items():
            path = local(root, host_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    def contents(self, root: Path) -> dict[str, bytes | None]:
        return {p: read(root, p) for p in self.watched}


SCENARIOS = {
    "containerd": Scenario(
        "containerd",
        {containerd.DEFAULT_CONFIG: STOCK_CONTAINERD},
        ConfigureOptions(set_as_default=True, cdi=True),
        (containerd.DEFAULT_CONFIG,),
    ),
    "docker": Scenario(
        "docker",
        {docker.DAEMON_JSON: COMPACT_DAEMON_JSON},
        ConfigureOptions(set_as_default=True),
        (docker.DAEMON_JSON,),
    ),
    # A small main file keeps this one fast: it has twice the write steps.
    "containerd-drop-in": Scenario(
        "containerd",
        {containerd.DEFAULT_CONFIG: SYSTEMD_ONLY_CONTAINERD},
        ConfigureOptions(set_as_default=True, drop_in=CONTAINERD_DROPIN),
        (containerd.DEFAULT_CONFIG, CONTAINERD_DROPIN),
    ),
}


def configure_and_revert_cleanly(
    scenario: Scenario,
) -> tuple[dict[str, bytes | None], dict[str, bytes | None]]:
    """(old, new) contents of the watched files, from a run nothing disturbs."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scenario.prepare(root)
        host = host_at(root)
        old = scenario.contents(root)
        configure.apply(host, configure.plan_configure(host, scenario.runtime, scenario.opts), restart=False)
        new = scenario.contents(root)
        assert new != old
        return old, new


# -- a: injected failures ---------------------------------------------------------------------------


@dataclass
class Fault:
    """Fails the Nth call of one step (and, when persistent, every later one: a disk that stays full)."""

    step: str
    n: int
    persistent: bool
    armed: bool = False
    calls: int = 0
    fired: int = 0

    def hit(self) -> None:
        if not self.armed:
            return
        self.calls += 1
        if self.calls == self.n or (self.persistent and self.calls > self.n):
            self.fired += 1
            raise OSError(errno.EIO, f"injected: {self.step} call {self.calls} fails")


class HalfWritten:
    """A file object whose write, when the fault hits, writes half the data and then fails (a short write on
    a full disk: _atomic_write turns ENOSPC into CommandFailed)."""

    def __init__(self, fh: Any, fault: Fault) -> None:
        self._fh = fh
        self._fault = fault

    def __enter__(self) -> HalfWritten:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()

    def write(self, data: bytes) -> int:
        try:
            self._fault.hit()
        except OSError:
            self._fh.write(data[: len(data) // 2])
            self._fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device") from None
        return int(self._fh.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def failing(fault: Fault, real: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        fault.hit()
        return real(*args, **kwargs)

    return wrapper


STEPS = (
    "mkstemp",
    "write",
    "fchmod",
    "fchown",
    "fsync",  # the temp file's and the directory's
    "rename",
    "open",  # reads, the directory lock, the directory fsync
    "remove_file",
    "atomic_write",  # each whole atomic write: records, backup, configuration file
    "records.save",
)


def install(mp: pytest.MonkeyPatch, fault: Fault) -> None:
    if fault.step == "mkstemp":
        mp.setattr(tempfile, "mkstemp", failing(fault, tempfile.mkstemp))
    elif fault.step == "write":
        real_fdopen = os.fdopen
        mp.setattr(os, "fdopen", lambda *a, **k: HalfWritten(real_fdopen(*a, **k), fault))
    elif fault.step in ("fchmod", "fchown", "fsync", "rename", "open"):
        mp.setattr(os, fault.step, failing(fault, getattr(os, fault.step)))
    elif fault.step == "remove_file":
        mp.setattr(Host, "remove_file", failing(fault, Host.remove_file))
    elif fault.step == "atomic_write":
        mp.setattr(gpunode.host, "_atomic_write", failing(fault, gpunode.host._atomic_write))
    elif fault.step == "records.save":
        mp.setattr(records, "save", failing(fault, records.save))
    else:
        raise AssertionError(fault.step)


@dataclass
class Report:
    violations: list[str] = field(default_factory=list)
    raised: dict[str, list[str]] = field(default_factory=dict)  # exception type -> "step#N"

    def check(self, ok: bool, where: str, what: str) -> None:
        if not ok:
            self.violations.append(f"{where}: {what}")


def one_injected_run(
    scenario: Scenario, fault: Fault, old: Mapping[str, Any], new: Mapping[str, Any], report: Report
) -> bool:
    """Run apply() with `fault` armed and check the state it leaves; False once the fault no longer fires."""
    where = f"{fault.step}#{fault.n}{'+' if fault.persistent else ''}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scenario.prepare(root)
        host = host_at(root)
        plan = configure.plan_configure(host, scenario.runtime, scenario.opts)
        error: BaseException | None = None
        with pytest.MonkeyPatch.context() as mp:
            install(mp, fault)
            fault.armed = True
            try:
                configure.apply(host, plan, restart=False)
            except BaseException as exc:  # anything at all: what escapes is part of what is checked
                error = exc
            fault.armed = False
        if not fault.fired:
            report.check(error is None, where, f"apply failed without an injected failure: {error!r}")
            report.check(
                scenario.contents(root) == new, where, "a run with no failure did not write the new files"
            )
            return False
        report.check(error is not None, where, "the injected failure was swallowed: apply reported success")
        if error is not None:
            report.raised.setdefault(type(error).__name__, []).append(where)
            # Anything else reaches the operator as "internal error: this is a bug in gpunode".
            report.check(isinstance(error, GpunodeError), where, f"apply raised {error!r}")

        # The invariant: each file old or new, complete; no temp file left; the records readable.
        now = scenario.contents(root)
        for path in scenario.watched:
            report.check(
                now[path] in (old[path], new[path]), where, f"{path} is neither the old nor the new file"
            )
        report.check(not temp_files(root), where, f"temp files left: {temp_files(root)}")
        try:
            saved = records.load(host)
        except GpunodeError as exc:
            report.check(False, where, f"the records are damaged: {exc.message}")
            return True
        if not fault.persistent:
            # One failure and the rollback (which then succeeds) puts back every file and the records.
            report.check(now == old, where, f"not rolled back: {[p for p in now if now[p] != old[p]]}")
            report.check(not saved.files, where, "the records still list the change after the rollback")

        # The node stays recoverable once the disk is healthy again: configure, then revert to the original.
        try:
            configure.apply(
                host, configure.plan_configure(host, scenario.runtime, scenario.opts), restart=False
            )
            report.check(
                scenario.contents(root) == new, where, "configure after the failure wrote something else"
            )
            configure.apply(
                host, configure.plan_revert(host, scenario.runtime, ConfigureOptions()), restart=False
            )
        except GpunodeError as exc:
            report.check(False, where, f"recovery failed: {exc.message}")
            return True
        after = scenario.contents(root)
        for path in scenario.watched:
            report.check(
                after[path] == old[path],
                where,
                f"revert after recovery did not give back the original {path}",
            )
        report.check(not host.exists(records.RECORDS), where, "records left after revert")
        report.check(not temp_files(root), where, f"temp files left after recovery: {temp_files(root)}")
    return True


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_injected_failure_at_every_step_leaves_old_or_new(name: str, persistent: bool) -> None:
    scenario = SCENARIOS[name]
    old, new = configure_and_revert_cleanly(scenario)
    report = Report()
    for step in STEPS:
        for n in range(1, 40):
            if not one_injected_run(scenario, Fault(step, n, persistent), old, new, report):
                break
        else:
            raise AssertionError(f"{step} is called without end")
        assert n > 1, f"{step} is never called: the fault injection misses the write sequence"
    summary = "; ".join(f"{kind}: {', '.join(where)}" for kind, where in sorted(report.raised.items()))
    assert not report.violations, "\n".join([*report.violations, f"(raised: {summary})"])


@contextlib.contextmanager
def failing_fsync_of(root: Path, host_path: str) -> Iterator[list[str]]:
    """Fail (EIO, once) the fsync of the file or directory at `host_path`, or of a temp file made for it:
    a named point of the write sequence, whatever the order of the other writes. Yields what failed."""
    target = local(root, host_path)
    real = os.fsync
    failed: list[str] = []

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        is_temp = path.parent == target.parent and path.name.startswith(f".{target.name}.")
        if not failed and (path == target or is_temp):
            failed.append(str(path))
            raise OSError(errno.EIO, f"injected: fsync of {path} fails")
        real(fd)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        yield failed


def test_a_failed_records_write_is_reported_as_a_gpunode_error(tmp_path: Path) -> None:
    """EIO on /var/lib/gpunode is an operational failure, not a bug in gpunode: it must not end as
    "internal error ... This is a bug in gpunode" (exit 70)."""
    SCENARIOS["containerd"].prepare(tmp_path)
    argv = ["configure-runtime", "containerd", "--set-as-default", "--no-restart"]
    with failing_fsync_of(tmp_path, records.RECORDS) as failed:
        code = main(argv, host=host_at(tmp_path))
    assert failed, "the records' temp file was never fsynced"
    assert read(tmp_path, containerd.DEFAULT_CONFIG) == STOCK_CONTAINERD
    assert code == ExitCode.COMMAND_FAILED, "an I/O error writing the records is not a CommandFailed"


def test_a_failed_records_fsync_is_rolled_back_and_revert_stays_exact(tmp_path: Path) -> None:
    """The records' directory fsync fails after their rename: nothing else was written, so the node must be
    as before, records included. Otherwise the next configure takes the file for one gpunode already
    changed, never backs it up, and revert can no longer give back the original bytes."""
    scenario = SCENARIOS["docker"]
    scenario.prepare(tmp_path)
    host = host_at(tmp_path)
    plan = configure.plan_configure(host, "docker", scenario.opts)
    with (
        failing_fsync_of(tmp_path, posixpath.dirname(records.RECORDS)) as failed,
        pytest.raises(GpunodeError),
    ):
        configure.apply(host, plan, restart=False)
    assert failed
    assert read(tmp_path, docker.DAEMON_JSON) == COMPACT_DAEMON_JSON
    configure.apply(host, configure.plan_configure(host, "docker", scenario.opts), restart=False)
    configure.apply(host, configure.plan_revert(host, "docker", ConfigureOptions()), restart=False)
    assert read(tmp_path, docker.DAEMON_JSON) == COMPACT_DAEMON_JSON, "revert is not byte-exact: no backup"
    assert records.load(host).files == {}


def test_a_failed_directory_fsync_after_the_rename_is_rolled_back(tmp_path: Path) -> None:
    """EIO on the fsync of daemon.json's directory, after the rename put the new file in place: the file
    is new, so the rollback must put the original back (or keep the record and the backup for revert).
    Deleting the backup and the record while the new file stays loses the original for good."""
    scenario = SCENARIOS["docker"]
    scenario.prepare(tmp_path)
    host = host_at(tmp_path)
    plan = configure.plan_configure(host, "docker", scenario.opts)
    with (
        failing_fsync_of(tmp_path, posixpath.dirname(docker.DAEMON_JSON)) as failed,
        pytest.raises(GpunodeError) as err,
    ):
        configure.apply(host, plan, restart=False)
    assert failed
    kept = host.exists(records.RECORDS) and host.exists(records.backup_path(docker.DAEMON_JSON))
    assert read(tmp_path, docker.DAEMON_JSON) == COMPACT_DAEMON_JSON or kept, (
        f"daemon.json stays changed, its backup and record are gone; apply said: {err.value.message}"
    )


def test_a_file_renamed_in_place_before_a_failure_is_rolled_back(tmp_path: Path) -> None:
    """The drop-in is written, then the main file is renamed into place and its directory fsync fails. The
    rollback must put back the main file too: left with the new `imports` entry and the drop-in removed,
    containerd refuses to start (a non-glob import of a missing file is fatal)."""
    scenario = SCENARIOS["containerd-drop-in"]
    old, _ = configure_and_revert_cleanly(scenario)
    scenario.prepare(tmp_path)
    host = host_at(tmp_path)
    plan = configure.plan_configure(host, "containerd", scenario.opts)
    # /etc/containerd itself is fsynced only for config.toml: the drop-in is in conf.d.
    with (
        failing_fsync_of(tmp_path, posixpath.dirname(containerd.DEFAULT_CONFIG)) as failed,
        pytest.raises(GpunodeError),
    ):
        configure.apply(host, plan, restart=False)
    assert failed
    state = containerd.read_state(host)
    assert not state.problems, state.problems
    assert scenario.contents(tmp_path) == old


# -- b: a real kill ---------------------------------------------------------------------------------

# A real kill: tests/killharness.py runs the CLI in a child SIGKILLed at the Nth call of one step.


@pytest.fixture(scope="module")
def fake_containerd() -> Iterator[dict[str, str]]:
    with fake_containerd_env() as env:
        yield env


@dataclass(frozen=True)
class KillState:
    """What a kill leaves: the configuration ("old" or "new"), whether the records and the backup exist, and
    the temp files left behind."""

    config: str
    records: bool
    backup: bool
    temps: tuple[str, ...]


CONFIGURE = ("configure-runtime", "containerd", "--set-as-default", "--no-restart")
REVERT = ("configure-runtime", "containerd", "--revert", "--no-restart")


def kill_and_recover(
    root: Path, env: Mapping[str, str], *, original: bytes, new: bytes, kill: tuple[str, int]
) -> KillState | None:
    """Kill a configure at the Nth call of a step, check what it leaves and recover from it; None when the
    run completed before the Nth call."""
    config = containerd.DEFAULT_CONFIG
    local(root, config).parent.mkdir(parents=True)
    local(root, config).write_bytes(original)
    code = gpunode_process(root, env, *CONFIGURE, kill=kill)
    if code == 0:
        assert read(root, config) == new
        return None
    assert code == -signal.SIGKILL
    data = read(root, config)
    assert data in (original, new), f"a kill at {kill} left {config} neither old nor new: {data!r}"
    state = KillState(
        "old" if data == original else "new",
        local(root, records.RECORDS).exists(),
        local(root, records.backup_path(config)).exists(),
        tuple(temp_files(root)),
    )
    # The configuration is replaced only once its original is recorded and safe in the backup.
    if state.config == "new":
        assert state.records and state.backup
    # containerd reads config.toml and what it imports: none of it is a leftover of the killed run.
    loaded = containerd.load_config(host_at(root), config)
    assert loaded.files == (config,) and not loaded.problems

    # A fresh process configures from that state (clearing the temp file next to the configuration), and
    # revert gives back the original bytes.
    assert gpunode_process(root, env, *CONFIGURE) == 0, f"configure after a kill at {kill} failed"
    assert read(root, config) == new
    assert not [t for t in temp_files(root) if t.startswith(posixpath.dirname(config) + "/")]
    assert main(list(REVERT), host=host_at(root)) == 0
    assert read(root, config) == original, f"revert after a kill at {kill} is not byte-exact"
    assert not local(root, records.RECORDS).exists()
    return state


def configured(original: bytes) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        local(root, containerd.DEFAULT_CONFIG).parent.mkdir(parents=True)
        local(root, containerd.DEFAULT_CONFIG).write_bytes(original)
        assert main(list(CONFIGURE), host=host_at(root)) == 0
        data = read(root, containerd.DEFAULT_CONFIG)
        assert data is not None and data != original
        return data


@pytest.mark.parametrize("step", ["fsync", "rename", "write"])
def test_kill_at_every_point_leaves_old_or_new_and_recoverable(
    step: str, tmp_path: Path, fake_containerd: dict[str, str]
) -> None:
    new = configured(STOCK_CONTAINERD)
    states: dict[int, KillState] = {}
    for n in range(1, 20):
        state = kill_and_recover(
            tmp_path / f"{step}-{n}", fake_containerd, original=STOCK_CONTAINERD, new=new, kill=(step, n)
        )
        if state is None:
            break
        states[n] = state
    else:
        raise AssertionError(f"configure never completed with {step} patched")
    # Three files are written, in this order: the records, the backup, config.toml. Each write has one
    # data write, one rename and two fsyncs (the temp file's, then the directory's after the rename).
    assert len(states) == {"fsync": 6, "rename": 3, "write": 3}[step]
    order = [(s.records, s.backup, s.config) for s in states.values()]
    assert order == sorted(order, key=lambda o: (o[0], o[1], o[2] == "new"))
    assert [s.config for s in states.values()].count("new") == (1 if step == "fsync" else 0)


def test_a_backup_temp_left_by_a_kill_is_cleaned_up(tmp_path: Path, fake_containerd: dict[str, str]) -> None:
    """Killed while copying the original to the backup (the 2nd write): the half-written temp file in
    /var/lib/gpunode/backups outlives the next configure and the revert, unlike the temp files next to the
    records and the configuration, which the next write of those files removes."""
    new = configured(STOCK_CONTAINERD)
    assert kill_and_recover(tmp_path, fake_containerd, original=STOCK_CONTAINERD, new=new, kill=("write", 2))
    assert not temp_files(tmp_path), "temp files left after configure and revert"


@pytest.mark.parametrize(
    ("original", "path", "runtime"),
    [
        (SYSTEMD_ONLY_CONTAINERD, containerd.DEFAULT_CONFIG, "containerd"),
        (COMPACT_DAEMON_JSON, docker.DAEMON_JSON, "docker"),
    ],
    ids=["containerd", "docker"],
)
def test_kill_between_records_and_backup_then_rerun_keeps_revert_exact(
    original: bytes, path: str, runtime: str, tmp_path: Path, fake_containerd: dict[str, str]
) -> None:
    """The 2nd fsync is the records directory's: the change is recorded, the backup not yet written. The
    operator runs configure again; revert must still give back the original bytes."""
    local(tmp_path, path).parent.mkdir(parents=True)
    local(tmp_path, path).write_bytes(original)
    configure_args = ("configure-runtime", runtime, "--set-as-default", "--no-restart")
    assert gpunode_process(tmp_path, fake_containerd, *configure_args, kill=("fsync", 2)) == -signal.SIGKILL
    assert read(tmp_path, path) == original
    assert (
        local(tmp_path, records.RECORDS).exists() and not local(tmp_path, records.backup_path(path)).exists()
    )

    assert gpunode_process(tmp_path, fake_containerd, *configure_args) == 0
    assert main(["configure-runtime", runtime, "--revert", "--no-restart"], host=host_at(tmp_path)) == 0
    assert read(tmp_path, path) == original, (
        "revert is not byte-exact: the rerun never backed the original up"
    )


@pytest.mark.parametrize(("step", "n"), [("write", 2), ("rename", 2)], ids=["mid-write", "before-rename"])
def test_kill_while_writing_a_crio_drop_in_leaves_nothing_crio_reads(
    step: str, n: int, tmp_path: Path, fake_containerd: dict[str, str]
) -> None:
    """CRI-O applies every file under crio.conf.d, dotfiles included (a filepath.Walk): a temp file of the
    drop-in left there by a killed gpunode, half written or complete, would be applied as configuration."""
    shutil.copytree(
        FIXTURES / "crio/crio.conf.d", local(tmp_path, crio.DROPIN_DIR), ignore=shutil.ignore_patterns("99-*")
    )
    shutil.copy(FIXTURES / "crio/crio.conf", local(tmp_path, crio.CRIO_CONF))
    before = sorted(p.name for p in local(tmp_path, crio.DROPIN_DIR).iterdir())
    args = ("configure-runtime", "crio", "--set-as-default", "--no-restart")
    # The records are the 1st write and rename; the drop-in (a new file: no backup) the 2nd.
    assert gpunode_process(tmp_path, fake_containerd, *args, kill=(step, n)) == -signal.SIGKILL
    left = sorted(p.name for p in local(tmp_path, crio.DROPIN_DIR).iterdir())
    assert left == before, f"files CRI-O would apply after the kill: {sorted(set(left) - set(before))}"
    assert gpunode_process(tmp_path, fake_containerd, *args) == 0
