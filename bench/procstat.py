"""CPU time and memory of a process tree, read from the OS (/proc).

CPU is read two ways for every process in the tree (the root and all its descendants):

* ``schedstat``: the sum over every thread of ``/proc/<pid>/task/<tid>/schedstat`` field 1, the
  nanoseconds the scheduler ran that thread (precise; the headline figure);
* ``ticks``: ``utime + stime`` from ``/proc/<pid>/stat``, with ``cutime + cstime`` (the
  children it has reaped), in clock ticks (10 ms granularity; recorded as a cross-check).

Memory: the sum of ``VmRSS`` over the tree, and ``VmHWM`` (the kernel's per-process peak).

A window's CPU is ``cpu_between(start, end)``, thread by thread: a thread or a process that
ends inside the window takes its schedstat counter with it (a plain difference of the sums
went negative for LiteLLM, whose worker threads come and go), so then the tick counters, which
keep an ended thread's time in its process and a reaped child's in its parent, give the figure
when it is larger.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["TreeSample", "cpu_between", "descendants", "sample_tree", "tree_rss"]

_TICK = os.sysconf("SC_CLK_TCK")


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2 :].split()
        out.setdefault(int(rest[1]), []).append(int(name))
    return out


def descendants(roots: list[int]) -> list[int]:
    """``roots`` and every descendant process (a snapshot)."""
    kids = _children_map()
    seen: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        todo.extend(kids.get(pid, ()))
    return seen


def _proc_cpu(pid: int, threads: dict[int, int]) -> float:
    """The utime+stime seconds of one process (with its reaped children's); each thread's
    schedstat nanoseconds go into ``threads`` (by thread id)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        rest = raw[raw.rfind(b")") + 2 :].split()
        ticks = sum(int(x) for x in rest[11:15]) / _TICK
    except OSError:
        return 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    threads[int(tid)] = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    except OSError:
        pass
    return ticks


def _proc_mem(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, hwm


@dataclass(frozen=True, slots=True)
class TreeSample:
    """CPU seconds (schedstat and ticks) and memory of a process tree at one instant."""

    pids: tuple[int, ...]
    cpu_ticks: float
    rss: int
    hwm: int
    threads: dict[int, int] = field(default_factory=dict)  # thread id -> schedstat ns

    @property
    def cpu(self) -> float:
        """Schedstat seconds of the threads alive now."""
        return sum(self.threads.values()) / 1e9


def cpu_between(a: TreeSample, b: TreeSample) -> float:
    """CPU seconds the tree used from ``a`` to ``b`` (see the module docstring): each thread
    alive at ``b`` counts from its value at ``a`` (from zero if it started since)."""
    ns = sum(max(v - a.threads.get(tid, 0), 0) for tid, v in b.threads.items())
    cpu = ns / 1e9
    if any(tid not in b.threads for tid in a.threads):
        cpu = max(cpu, b.cpu_ticks - a.cpu_ticks)
    return cpu


def sample_tree(roots: list[int]) -> TreeSample:
    """CPU and memory of ``roots`` and their descendants, now."""
    if not roots:
        return TreeSample((), 0.0, 0, 0)
    pids = descendants(roots)
    ticks = 0.0
    rss = hwm = 0
    threads: dict[int, int] = {}
    for pid in pids:
        ticks += _proc_cpu(pid, threads)
        r, h = _proc_mem(pid)
        rss += r
        hwm += h
    return TreeSample(tuple(pids), ticks, rss, hwm, threads)


def tree_rss(pids: tuple[int, ...] | list[int]) -> int:
    """The summed VmRSS of ``pids`` (a cheap sample for the memory time series)."""
    return sum(_proc_mem(p)[0] for p in pids)
