"""``python -m bench tenants``, tiny: both scenarios run against a real gateway and the fake
engine, B is never refused, A's flood meets its quota, and the saturated replica queues A."""

from __future__ import annotations

import math

import trio

from bench import tenants as TN


def test_a_tiny_run_of_both_scenarios() -> None:
    p = TN.Params(b_requests=4, b_think=0.0, tokens=4, ttft=0.02, itl=0.005, a_rpm=60,
                  sat_slots=2, sat_a_clients=6)  # fmt: skip
    out = trio.run(TN.run, p)
    q, sat = out["quota"], out["saturated"]
    assert q["b_statuses"] == {200: 4}
    assert q["a_statuses"].get(429, 0) > 0  # the flood runs into A's quota
    assert not any(s >= 500 for s in q["a_statuses"])
    assert sat["b_statuses"] == {200: 4} and set(sat["a_statuses"]) == {200}
    for figure in (q["b_alone_ttft_p50_ms"], q["b_shared_ttft_p50_ms"], sat["b_ttft_p50_ms"]):
        assert math.isfinite(figure) and figure > 0
    # the engine's own TTFT is a floor of every measured one
    assert q["b_alone_ttft_p50_ms"] >= p.ttft * 1000
    assert [v["target"] for v in out["verdicts"]] == [
        "quota: B's TTFT p50 within 1.2× of B alone, no 5xx for B",
        "saturated: B's TTFT p50 at most the duration of one of A's requests",
    ]
