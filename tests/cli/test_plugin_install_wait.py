"""`plugin install` shows its wait for the plugin to register (up to 120 s), and Ctrl-C during that wait
leaves a clear state (issue 24).

No real time passes: the wait's clock and pause (`service.monotonic`, `service.pause`) are a fake clock
that each pause moves on by the pause's length, and that raises KeyboardInterrupt at a chosen pause, as
Ctrl-C would. systemctl is a fake that turns the unit active after a number of polls (`show`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpunode import schemas
from gpunode.cli.main import main
from gpunode.cli.waitline import WaitLine
from gpunode.errors import ExitCode
from gpunode.host import CommandResult, Host
from gpunode.systemd import service
from tests.scriptedrunner import FakeRunner

UNIT = service.UNIT
WAITING = "waiting for gpunode-device-plugin.service to register with kubelet"


class SlowSystemctl(FakeRunner):
    """systemctl for the plugin's unit: once started it is `activating` for `polls` polls, then active
    (Type=notify: the plugin registered)."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls
        self.active = "inactive"
        self.enabled = False
        self.shows_since_start = 0

    def answer(self, key: tuple[str, ...]) -> CommandResult:
        if key[0] == "journalctl":
            return CommandResult(key, 0, "", "")
        verb = key[1]
        if verb == "show":
            if self.active == "activating":
                self.shows_since_start += 1
                if self.shows_since_start > self.polls:
                    self.active = "active"
            text = (
                f"LoadState=loaded\nActiveState={self.active}\nSubState=running\n"
                f"UnitFileState={'enabled' if self.enabled else 'disabled'}\nStatusText=\nMainPID=0\n"
                "NRestarts=0\nResult=success\n"
            )
            return CommandResult(key, 0, text, "")
        if verb == "enable":
            self.enabled = True
        elif verb == "start":
            self.active = "activating"
        elif verb != "daemon-reload":
            raise AssertionError(f"unexpected systemctl call {key}")
        return CommandResult(key, 0, "", "")


class FakeClock:
    """monotonic() and sleep(): each sleep moves the clock on; the `interrupt_at`-th sleep raises
    KeyboardInterrupt instead (Ctrl-C during the wait)."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.now = 1000.0
        self.sleeps = 0
        self.interrupt_at = interrupt_at

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        if self.sleeps == self.interrupt_at:
            raise KeyboardInterrupt
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(service, "monotonic", fake.monotonic)
    monkeypatch.setattr(service, "pause", fake.sleep)
    monkeypatch.setattr(service, "gpunode_executable", lambda: "/usr/local/bin/gpunode")
    return fake


def install(
    tmp_path: Path, systemctl: SlowSystemctl, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    code = main(["plugin", "install", *args], host=Host(root=tmp_path, runner=systemctl, env={}, euid=0))
    out, err = capsys.readouterr()
    return code, out, err


def json_document(out: str) -> dict[str, Any]:
    doc = json.loads(out)  # stdout is the one document, nothing else
    assert isinstance(doc, dict)
    jsonschema.validate(doc, schemas.load("plugin-install"))
    return doc


def test_the_wait_is_reported_at_every_poll_and_its_length_returned(tmp_path: Path, clock: FakeClock) -> None:
    systemctl = SlowSystemctl(polls=4)
    host = Host(root=tmp_path, runner=systemctl, env={}, euid=0)
    reports: list[service.Waiting] = []
    plan = service.plan_install(host, config_file=None, start=True, executable="/usr/local/bin/gpunode")
    state = service.apply_install(host, plan, progress=reports.append)
    assert state.active == "active" and state.waited_s == 2.0  # four pauses of 0.5 s
    assert [r.elapsed for r in reports] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [r.done for r in reports] == [False, False, False, False, True]
    assert {r.what for r in reports} == {"gpunode-device-plugin.service to register with kubelet"}
    assert {r.timeout for r in reports} == {120.0}


def test_json_result_says_what_it_waited_for_and_how_long_and_progress_goes_to_stderr(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = install(tmp_path, SlowSystemctl(polls=60), capsys, "--json")  # active after 30 s
    assert code == ExitCode.OK, err
    doc = json_document(out)
    assert doc["waited_for"] == "gpunode-device-plugin.service to register with kubelet"
    assert doc["waited_s"] == 30.0 and doc["changed"] is True and doc["error"] is None
    # Not a terminal: a plain line every 10 s, none per poll, none for the end.
    assert err.splitlines() == [
        f"{WAITING} (10 s of at most 120 s)",
        f"{WAITING} (20 s of at most 120 s)",
    ]


def test_human_output_says_how_long_it_waited(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = install(tmp_path, SlowSystemctl(polls=6), capsys)
    assert code == ExitCode.OK, err
    assert "waited 3 s for gpunode-device-plugin.service to register with kubelet\n" in out
    assert err == ""  # under 10 s, not on a terminal: nothing to show


def test_no_start_waits_for_nothing(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = install(tmp_path, SlowSystemctl(polls=6), capsys, "--no-start", "--json")
    assert code == ExitCode.OK, err
    doc = json_document(out)
    assert doc["waited_for"] is None and doc["waited_s"] is None and doc["wait_ready"] is False
    assert clock.sleeps == 0


def test_ctrl_c_during_the_wait_leaves_the_service_installed_and_says_how_to_check_it(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    clock.interrupt_at = 5
    systemctl = SlowSystemctl(polls=100)
    code, _, err = install(tmp_path, systemctl, capsys)
    assert code == 130  # ExitCode.INTERRUPTED, as for any Ctrl-C
    assert (
        "interrupted while waiting: gpunode-device-plugin.service is installed and started; check it with "
        "`gpunode plugin status` / `journalctl -u gpunode-device-plugin`"
    ) in err
    assert "Traceback" not in err and "internal error" not in err
    # Not rolled back: the unit is written, enabled and started; nothing stopped, disabled or removed.
    assert (tmp_path / service.UNIT_PATH.lstrip("/")).is_file()
    assert (tmp_path / service.RECORD_PATH.lstrip("/")).is_file()
    assert systemctl.enabled and systemctl.active == "activating"
    assert not [c for c in systemctl.calls if c[1] in ("stop", "disable")]


def test_ctrl_c_during_the_wait_with_json_is_an_error_document_that_says_changed(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    clock.interrupt_at = 3
    code, out, err = install(tmp_path, SlowSystemctl(polls=100), capsys, "--json")
    assert code == ExitCode.INTERRUPTED
    doc = json_document(out)
    assert doc["changed"] is True
    assert doc["error"]["exit_code"] == 130
    assert doc["error"]["message"] == service.INTERRUPTED
    assert (
        "nothing was rolled back" in doc["error"]["fix"] and "gpunode plugin uninstall" in doc["error"]["fix"]
    )
    assert doc["waited_for"] == "gpunode-device-plugin.service to register with kubelet"
    assert doc["waited_s"] == 1.0  # two pauses done, interrupted in the third
    assert service.INTERRUPTED in err


def test_a_timeout_error_document_says_how_long_it_waited(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = install(tmp_path, SlowSystemctl(polls=10_000), capsys, "--json")
    assert code == ExitCode.COMMAND_FAILED
    doc = json_document(out)
    assert doc["changed"] is True and "did not become ready within 120s" in doc["error"]["message"]
    assert doc["waited_s"] == 120.0


def test_on_a_terminal_one_live_line_is_redrawn_and_cleared_at_the_end() -> None:
    stream = io.StringIO()
    line = WaitLine(stream, live=True, width=200)
    what = "gpunode-device-plugin.service to register with kubelet"
    line(service.Waiting(what, 12.0, 120.0))
    first = f"{WAITING} (12 s of at most 120 s)"
    assert stream.getvalue() == f"\r{first}"
    line(service.Waiting(what, 100.0, 120.0))
    second = f"{WAITING} (100 s of at most 120 s)"
    assert stream.getvalue() == f"\r{first}\r{second}"
    line(service.Waiting(what, 9.0, 120.0))  # a shorter text: padded over the longer one
    third = f"{WAITING} (9 s of at most 120 s)"
    assert stream.getvalue() == f"\r{first}\r{second}\r{third}  "
    assert "\n" not in stream.getvalue()  # one line, redrawn in place
    line(service.Waiting(what, 9.5, 120.0, done=True))
    assert stream.getvalue().endswith("\r" + " " * len(third) + "\r")  # cleared: the result comes next
    assert line.json() == {"waited_for": what, "waited_s": 9.5}


def test_a_live_line_left_by_an_interrupt_is_cleared_on_close() -> None:
    stream = io.StringIO()
    with WaitLine(stream, live=True, width=200) as line:
        line(service.Waiting("x", 1.0, 120.0))
    text = "waiting for x (1 s of at most 120 s)"
    assert stream.getvalue() == f"\r{text}\r{' ' * len(text)}\r"


class InterruptedShow(SlowSystemctl):
    """Ctrl-C on a terminal reaches `systemctl show` too (one process group): the runner raises it."""

    def answer(self, key: tuple[str, ...]) -> CommandResult:
        if key[:2] == ("systemctl", "show") and self.shows_since_start == 2:
            raise KeyboardInterrupt
        return super().answer(key)


def test_ctrl_c_while_systemctl_is_asked_is_the_same_clear_state(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = install(tmp_path, InterruptedShow(polls=100), capsys, "--json")
    assert code == ExitCode.INTERRUPTED
    doc = json_document(out)
    assert doc["changed"] is True and doc["error"]["message"] == service.INTERRUPTED
    assert service.INTERRUPTED in err


def test_a_live_line_never_wraps_in_a_narrow_terminal() -> None:
    stream = io.StringIO()
    line = WaitLine(stream, live=True, width=40)
    line(service.Waiting("gpunode-device-plugin.service to register with kubelet", 12.0, 120.0))
    line(service.Waiting("gpunode-device-plugin.service to register with kubelet", 13.0, 120.0))
    drawn = stream.getvalue().split("\r")[1:]
    # 39 columns (the cursor stays on the line), the time first so that it is never the part cut off.
    assert drawn == ["waiting (12 s of at most 120 s) for gpu", "waiting (13 s of at most 120 s) for gpu"]
