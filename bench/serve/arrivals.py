"""When requests start: arrival processes for an open-loop run, and a trace's own schedule.

Every function returns start offsets in seconds from the run's start, non-decreasing. A fixed
concurrency (a closed loop) has no schedule: each of its clients sends its next request when
the previous one ends (bench/serve/loop.py).

* ``constant``: one arrival every 1/rate s;
* ``poisson``: exponential gaps of mean 1/rate (a Poisson process, coefficient of variation 1);
* ``gamma``: gamma-distributed gaps of mean 1/rate and shape ``burstiness``, so the
  coefficient of variation of the gaps is 1/√burstiness: below 1 burstier than Poisson, above
  1 more regular (vLLM's ``--burstiness``). ``gamma`` with burstiness 1 is ``poisson``.

The first arrival is at 0. A rate of ``inf`` starts every request at once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

KINDS = ("constant", "poisson", "gamma")


def gaps(kind: str, rate: float, rng: random.Random, burstiness: float = 1.0) -> Iterator[float]:
    """The endless sequence of gaps between two arrivals."""
    if kind not in KINDS:
        raise ValueError(f"unknown arrival process {kind!r} (one of {', '.join(KINDS)})")
    if not rate > 0:
        raise ValueError(f"the request rate must be positive, not {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, not {burstiness}")
    if math.isinf(rate):
        while True:
            yield 0.0
    if kind == "constant":
        while True:
            yield 1.0 / rate
    shape = 1.0 if kind == "poisson" else burstiness
    scale = 1.0 / (rate * shape)
    while True:
        yield rng.gammavariate(shape, scale)


def start_times(kind: str, rate: float, rng: random.Random,
                burstiness: float = 1.0) -> Iterator[float]:
    """The endless, non-decreasing start offsets of an arrival process (the first is 0)."""
    t = 0.0
    yield t
    for g in gaps(kind, rate, rng, burstiness):
        t += g
        yield t


def trace_times(timestamps_ms: Sequence[float], speed: float = 1.0) -> list[float]:
    """A trace's start offsets: each timestamp (milliseconds) minus the earliest, divided by
    ``speed`` (2 replays twice as fast). The order of the trace is kept."""
    if not speed > 0:
        raise ValueError(f"the trace speed must be positive, not {speed}")
    if not timestamps_ms:
        return []
    t0 = min(timestamps_ms)
    return [(t - t0) / 1000.0 / speed for t in timestamps_ms]
