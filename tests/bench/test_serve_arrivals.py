"""``bench serve``'s arrival processes: the distribution of start times (mean rate, the gaps'
coefficient of variation) and a trace's schedule."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from bench.serve import arrivals as A

N = 20_000


def _gaps(kind: str, rate: float, burstiness: float = 1.0, seed: int = 3) -> list[float]:
    times = list(itertools.islice(A.start_times(kind, rate, random.Random(seed), burstiness),
                                  N + 1))
    assert times[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(times))
    return [b - a for a, b in itertools.pairwise(times)]


def _cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs)


def test_constant_arrivals_are_evenly_spaced() -> None:
    times = list(itertools.islice(A.start_times("constant", 4.0, random.Random(0)), 5))
    assert times == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_poisson_arrivals_have_the_rate_and_exponential_gaps() -> None:
    gaps = _gaps("poisson", 8.0)
    # 20,000 exponential gaps: the mean is within 3 % of 1/rate (about 4 standard errors) and
    # the coefficient of variation within 5 % of 1.
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.03)
    assert _cv(gaps) == pytest.approx(1.0, rel=0.05)
    # memorylessness: the share of gaps above the mean is e^-1
    assert sum(g > 1 / 8.0 for g in gaps) / N == pytest.approx(math.exp(-1), abs=0.015)
    # ... and the number of arrivals per second is Poisson: its variance equals its mean
    times = list(itertools.accumulate(gaps))
    counts = [0] * int(times[-1])
    for t in times:
        if int(t) < len(counts):
            counts[int(t)] += 1
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_cv(burstiness: float) -> None:
    gaps = _gaps("gamma", 5.0, burstiness)
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.04)
    assert _cv(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_gamma_of_burstiness_one_is_poisson() -> None:
    assert _gaps("gamma", 5.0, 1.0) == pytest.approx(_gaps("poisson", 5.0))


def test_an_infinite_rate_starts_everything_at_once() -> None:
    times = list(itertools.islice(A.start_times("poisson", math.inf, random.Random(0)), 10))
    assert times == [0.0] * 10


@pytest.mark.parametrize(("kind", "rate", "burstiness", "match"), [
    ("weibull", 1.0, 1.0, "unknown arrival process"),
    ("poisson", 0.0, 1.0, "rate must be positive"),
    ("gamma", 1.0, 0.0, "burstiness must be positive"),
])
def test_bad_arrival_parameters_are_refused(kind: str, rate: float, burstiness: float,
                                            match: str) -> None:
    with pytest.raises(ValueError, match=match):
        next(A.gaps(kind, rate, random.Random(0), burstiness))


def test_a_trace_starts_at_its_first_timestamp_and_scales_with_speed() -> None:
    assert A.trace_times([1000.0, 1500.0, 4000.0]) == pytest.approx([0.0, 0.5, 3.0])
    assert A.trace_times([1000.0, 1500.0, 4000.0], speed=2.0) == pytest.approx([0.0, 0.25, 1.5])
    assert A.trace_times([]) == []
    with pytest.raises(ValueError, match="speed"):
        A.trace_times([0.0], speed=0.0)
