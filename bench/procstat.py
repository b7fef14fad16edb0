"""CPU time and memory of a process tree, read from the OS (/proc).

CPU is read two ways for every process in the tree (the root and all its descendants):

* ``schedstat``: the sum over every thread of ``/proc/<pid>/task/<tid>/schedstat`` field 1, the
  nanoseconds the scheduler ran that thread (precise; the headline figure);
* ``ticks``: ``utime + stime`` from ``/proc/<pid>/stat`` in clock ticks (10 ms granularity;
  recorded as a cross-check).

Memory: the sum of ``VmRSS`` over the tree, and ``VmHWM`` (the kernel's per-process peak).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["TreeSample", "descendants", "sample_tree", "tree_rss"]

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


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(schedstat seconds over all threads, utime+stime seconds) of one process."""
    ticks = 0.0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        rest = raw[raw.rfind(b")") + 2 :].split()
        ticks = (int(rest[11]) + int(rest[12])) / _TICK
    except OSError:
        return 0.0, 0.0
    ns = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    ns += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    except OSError:
        pass
    return ns / 1e9, ticks


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
    cpu: float
    cpu_ticks: float
    rss: int
    hwm: int


def sample_tree(roots: list[int]) -> TreeSample:
    """CPU and memory of ``roots`` and their descendants, now."""
    if not roots:
        return TreeSample((), 0.0, 0.0, 0, 0)
    pids = descendants(roots)
    cpu = ticks = 0.0
    rss = hwm = 0
    for pid in pids:
        c, t = _proc_cpu(pid)
        cpu += c
        ticks += t
        r, h = _proc_mem(pid)
        rss += r
        hwm += h
    return TreeSample(tuple(pids), cpu, ticks, rss, hwm)


def tree_rss(pids: tuple[int, ...] | list[int]) -> int:
    """The summed VmRSS of ``pids`` (a cheap sample for the memory time series)."""
    return sum(_proc_mem(p)[0] for p in pids)
