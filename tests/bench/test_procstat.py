"""The bench's CPU reading of a process tree (``bench.procstat``)."""

from __future__ import annotations

import os
import threading
import time

from bench.procstat import cpu_between, sample_tree


def _burn(seconds: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


def test_a_thread_that_ends_in_the_window_keeps_its_time() -> None:
    """A thread's schedstat counter goes when the thread ends: the window still counts what
    it ran in the window (from the process's tick counters), and is never negative."""
    halfway, go_on = threading.Event(), threading.Event()

    def worker() -> None:
        _burn(0.2)
        halfway.set()
        go_on.wait()
        _burn(0.3)

    th = threading.Thread(target=worker)
    th.start()
    halfway.wait()
    a = sample_tree([os.getpid()])
    go_on.set()
    th.join()
    # join() returns once Python is done with the thread; the kernel removes its task entry
    # (and its schedstat counter) a moment later
    while os.path.exists(f"/proc/self/task/{th.native_id}"):
        time.sleep(0.001)
    b = sample_tree([os.getpid()])
    assert th.native_id not in b.threads
    assert b.cpu - a.cpu < 0.1  # the plain difference lost the ended thread's 0.5 s
    assert 0.25 <= cpu_between(a, b) < 2.0


def test_threads_that_live_on_count_by_schedstat() -> None:
    a = sample_tree([os.getpid()])
    _burn(0.1)
    b = sample_tree([os.getpid()])
    assert 0.09 <= cpu_between(a, b) < 1.0
