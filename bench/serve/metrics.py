"""The figures of a serve run, computed from its per-request records (no I/O, no clock).

A :class:`RequestRecord` is what the client measured for one request; :func:`figures` turns a
run's records into every figure the outputs show: latency percentiles, throughput, errors by
kind and goodput under SLOs. The percentile maths is shared with the overhead load generator
(bench/loadgen.py uses :func:`percentile` with ``method="nearest"``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The quantiles every latency figure reports (besides count, mean, min and max).
QUANTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
#: The SLO names ``--slo NAME=VALUE`` accepts, each a per-request figure in milliseconds.
SLO_NAMES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def percentile(values: Sequence[float], q: float, method: str = "linear") -> float:
    """The ``q``-th percentile (0–100) of ``values``.

    ``linear`` interpolates between the two nearest ranks (numpy's default, what vLLM's and
    guidellm's reports use); ``nearest`` is the nearest-rank value (the smallest value with at
    least ``q`` % of the values at or below it)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside 0..100")
    s = sorted(values)
    n = len(s)
    if method == "nearest":
        # rounded first: 99.9 % of 1,000 is rank 999, not 1,000 (99.9 / 100 * 1000 > 999)
        return s[min(n - 1, max(0, math.ceil(round(q / 100 * n, 9)) - 1))]
    if method != "linear":
        raise ValueError(f"unknown percentile method {method!r}")
    pos = q / 100 * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: Iterable[float], quantiles: Sequence[float] = QUANTILES,
            method: str = "linear", scale: float = 1.0) -> dict[str, float | int]:
    """Count, mean, min, the ``quantiles`` (keys ``p50`` …) and max of ``values`` × ``scale``;
    only ``count`` when there are none."""
    s = sorted(v * scale for v in values)
    if not s:
        return {"count": 0}
    out: dict[str, float | int] = {"count": len(s), "mean": sum(s) / len(s), "min": s[0]}
    for q in quantiles:
        out[f"p{q:g}".replace(".", "")] = percentile(s, q, method)
    out["max"] = s[-1]
    return out


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds from the run's start; latencies
    are milliseconds. ``error`` is the failure's kind (``http_429``, ``timeout``,
    ``connection``, ``tls``, ``protocol``, ``stream_error``, ``empty``), None on success."""

    index: int
    conversation: int
    turn: int
    scheduled_s: float
    start_s: float
    end_s: float = 0.0
    error: str | None = None
    error_detail: str = ""
    status: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    tokens_source: str = "chunks"

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: (end-to-end − TTFT) ÷ (output tokens − 1);
        None for one token or a failure."""
        out = self.output_tokens
        if not self.ok or self.ttft_ms is None or self.e2e_ms is None or out is None or out < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (out - 1)

    def meets(self, slos: dict[str, float]) -> bool:
        """Whether this request counts towards goodput: it succeeded and every SLO holds
        (``itl_ms`` bounds its largest gap; a figure the request has not got, such as the TPOT
        of a one-token reply, does not fail it)."""
        if not self.ok:
            return False
        got = {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms,
               "itl_ms": max(self.itl_ms) if self.itl_ms else None}
        return all(got[k] is None or got[k] <= v for k, v in slos.items())  # type: ignore[operator]

    def as_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["ok"] = self.ok
        d["tpot_ms"] = self.tpot_ms
        return d


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``["ttft_ms=500", "tpot_ms=50"]`` → ``{"ttft_ms": 500.0, "tpot_ms": 50.0}``."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--slo {item!r}: expected NAME=MILLISECONDS with NAME one of "
                             f"{', '.join(SLO_NAMES)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo {item!r}: {value!r} is not a number") from None
        if out[name] <= 0:
            raise ValueError(f"--slo {item!r}: the bound must be positive")
    return out


def figures(records: Sequence[RequestRecord], slos: dict[str, float]) -> dict[str, Any]:
    """Every figure of one run (one load point) from its measured requests.

    The run's duration is from the first request's start to the last one's end; throughput
    divides by it. Latency figures cover the successful requests; ITL pools every gap between
    two content events of the same request."""
    ok = [r for r in records if r.ok]
    if records:
        duration = max(r.end_s for r in records) - min(r.start_s for r in records)
    else:
        duration = 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.input_tokens or 0 for r in ok)
    met = sum(1 for r in records if r.meets(slos))
    errors = Counter(r.error for r in records if r.error is not None)
    sources = Counter(r.tokens_source for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_s": duration,
        "request_throughput": per_s(len(ok)),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "input_token_throughput": per_s(in_tokens),
        "output_token_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "tokens_counted_by": dict(sources),
        "ttft_ms": summary(r.ttft_ms for r in ok if r.ttft_ms is not None),
        "tpot_ms": summary(t for r in ok if (t := r.tpot_ms) is not None),
        "itl_ms": summary(g for r in ok for g in r.itl_ms),
        "e2e_ms": summary(r.e2e_ms for r in ok if r.e2e_ms is not None),
        "goodput": {
            "slos": dict(slos),
            "requests_met": met,
            "fraction_met": met / len(records) if records else 0.0,
            "request_goodput": per_s(met),
        },
    }
