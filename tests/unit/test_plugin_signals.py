"""The plugin's signals act at once whichever thread the kernel hands them to (gpunode.plugin.signals)."""

from __future__ import annotations

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
