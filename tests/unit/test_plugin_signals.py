"""The plugin's signals act at once whichever thread the kernel hands them to (gpunode.plugin.signals)."""

from __future__ import annotations

import os
import queue
import signal
import threading

from gpunode.plugin.signals import SignalRelay


def _from_another_thread(signum: int) -> None:
    # pthread_kill aims the signal at that thread: the case where the kernel picked a thread other than
    # the main one for a process-directed signal.
    thread = threading.Thread(target=lambda: signal.pthread_kill(threading.get_ident(), signum))
    thread.start()
    thread.join()


def test_a_signal_landing_on_another_thread_acts_while_the_main_thread_sleeps_in_a_queue() -> None:
    got: queue.SimpleQueue[str] = queue.SimpleQueue()
    with SignalRelay({signal.SIGUSR1: lambda: got.put("usr1"), signal.SIGUSR2: lambda: got.put("usr2")}):
        _from_another_thread(signal.SIGUSR1)
        # The main thread blocks in get() as the plugin's event loop does; a plain Python handler would
        # run only after this timeout (a SIGHUP acted on 30 s late in CI).
        assert got.get(timeout=30) == "usr1"
        signal.raise_signal(signal.SIGUSR2)  # and one the main thread itself receives
        assert got.get(timeout=30) == "usr2"


def test_close_puts_back_the_handlers_and_wakeup_fd_it_found() -> None:
    handler = signal.getsignal(signal.SIGUSR1)
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    relay = SignalRelay({signal.SIGUSR1: lambda: None}).start()
    assert signal.getsignal(signal.SIGUSR1) is not handler
    relay.close()
    assert signal.getsignal(signal.SIGUSR1) is handler
    assert signal.set_wakeup_fd(before) == before


def test_closed_without_restoring_a_late_signal_does_nothing() -> None:
    """The plugin closes its relay last and keeps the do-nothing handlers: a second SIGTERM (or a SIGHUP)
    while it cleans up must not run the old handler (the default one would end the process at once)."""
    old_calls: list[int] = []
    saved = signal.signal(signal.SIGUSR2, lambda signum, frame: old_calls.append(signum))
    try:
        acted: queue.SimpleQueue[str] = queue.SimpleQueue()
        relay = SignalRelay({signal.SIGUSR2: lambda: acted.put("usr2")}).start()
        relay.close(restore=False)
        signal.raise_signal(signal.SIGUSR2)
        assert old_calls == [] and acted.empty()
    finally:
        signal.signal(signal.SIGUSR2, saved)


def test_started_off_the_main_thread_it_refuses_and_leaves_nothing_behind() -> None:
    fds = len(os.listdir("/proc/self/fd"))
    errors: list[BaseException] = []

    def start() -> None:
        try:
            SignalRelay({signal.SIGUSR1: lambda: None}).start()
        except ValueError as err:
            errors.append(err)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert len(os.listdir("/proc/self/fd")) == fds
    assert not any(t.name == "signals" for t in threading.enumerate())
