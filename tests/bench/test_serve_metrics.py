"""``bench serve``'s figures: the percentile maths, latency summaries, throughput, errors by
kind and goodput under SLOs; the server's Prometheus metrics."""

from __future__ import annotations

import array
import random
import statistics

import pytest

from bench import loadgen
from bench.serve import prom
from bench.serve.metrics import RequestRecord, figures, parse_slos, percentile, summary


def test_linear_percentiles_match_the_inclusive_quantiles() -> None:
    rng = random.Random(5)
    for n in (2, 3, 10, 101, 977):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        qs = statistics.quantiles(xs, n=100, method="inclusive")  # numpy's "linear"
        for q in (1, 25, 50, 90, 99):
            assert percentile(xs, q) == pytest.approx(qs[q - 1])
        assert percentile(xs, 0) == min(xs) and percentile(xs, 100) == max(xs)


def test_percentiles_by_hand() -> None:
    xs = [float(x) for x in range(1, 11)]  # 1..10
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 50, "nearest") == 5.0
    assert percentile(xs, 90, "nearest") == 9.0
    assert percentile(xs, 91, "nearest") == 10.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(xs, 101)
    with pytest.raises(ValueError):
        percentile(xs, 50, "midpoint")


def test_summary_and_the_overhead_load_generator_share_the_maths() -> None:
    s = summary([0.004, 0.001, 0.002, 0.003], scale=1000)
    assert s == pytest.approx({"count": 4, "mean": 2.5, "min": 1.0, "p50": 2.5, "p90": 3.7,
                               "p99": 3.97, "max": 4.0})
    assert summary([]) == {"count": 0}
    # bench/loadgen.py: nearest-rank, milliseconds, with p99.9 and no minimum
    got = loadgen.pct(array.array("d", [x / 1000 for x in range(1, 1001)]))
    assert got == pytest.approx({"count": 1000, "mean": 500.5, "p50": 500.0, "p90": 900.0,
                                 "p99": 990.0, "p999": 999.0, "max": 1000.0})


def _rec(i: int, start: float, end: float, ttft: float | None = 100.0, out: int | None = 11,
         itl: list[float] | None = None, error: str | None = None,
         inp: int | None = 50) -> RequestRecord:
    r = RequestRecord(index=i, conversation=i, turn=0, scheduled_s=start, start_s=start,
                      end_s=end, error=error, input_tokens=inp, output_tokens=out,
                      tokens_source="usage")
    if error is None:
        r.ttft_ms = ttft
        r.e2e_ms = (end - start) * 1000
        r.itl_ms = itl if itl is not None else [10.0] * 10
    return r


def test_tpot_is_the_time_after_the_first_token_per_further_token() -> None:
    r = _rec(0, 0.0, 1.1, ttft=100.0, out=11)
    assert r.tpot_ms == pytest.approx(100.0)  # (1100 - 100) / 10
    assert _rec(0, 0.0, 1.0, out=1).tpot_ms is None
    assert _rec(0, 0.0, 1.0, error="http_500").tpot_ms is None


def test_figures_of_a_run() -> None:
    recs = [_rec(0, 0.0, 1.1), _rec(1, 0.5, 2.5, ttft=900.0, out=21, itl=[50.0, 300.0]),
            _rec(2, 1.0, 1.2, error="http_429"), _rec(3, 1.5, 1.6, error="timeout"),
            _rec(4, 2.0, 4.0, error="http_429")]
    f = figures(recs, {"ttft_ms": 500.0})
    assert f["requests"] == 5 and f["completed"] == 2 and f["failed"] == 3
    assert f["errors"] == {"http_429": 2, "timeout": 1}
    assert f["duration_s"] == pytest.approx(4.0)
    assert f["request_throughput"] == pytest.approx(0.5)
    assert f["output_tokens"] == 32 and f["input_tokens"] == 100
    assert f["output_token_throughput"] == pytest.approx(8.0)
    assert f["total_token_throughput"] == pytest.approx(33.0)
    assert f["ttft_ms"]["p50"] == pytest.approx(500.0) and f["ttft_ms"]["count"] == 2
    assert f["e2e_ms"]["mean"] == pytest.approx(1550.0)
    assert f["itl_ms"]["count"] == 12 and f["itl_ms"]["max"] == 300.0
    assert f["tpot_ms"]["min"] == pytest.approx((2000 - 900) / 20)
    assert f["tpot_ms"]["max"] == pytest.approx((1100 - 100) / 10)
    assert f["goodput"] == {"slos": {"ttft_ms": 500.0}, "requests_met": 1,
                            "fraction_met": 0.2, "request_goodput": pytest.approx(0.25)}
    assert f["tokens_counted_by"] == {"usage": 2}


def test_goodput_needs_every_slo_and_success() -> None:
    fast = _rec(0, 0.0, 1.1, ttft=100.0, out=11, itl=[90.0, 110.0])  # TPOT 100 ms
    assert fast.meets({})
    assert fast.meets({"ttft_ms": 100.0, "tpot_ms": 100.0, "e2e_ms": 1100.0, "itl_ms": 110.0})
    assert not fast.meets({"ttft_ms": 99.0})
    assert not fast.meets({"tpot_ms": 99.0})
    assert not fast.meets({"e2e_ms": 1000.0})
    assert not fast.meets({"itl_ms": 100.0})  # its largest gap is 110 ms
    one = _rec(1, 0.0, 0.1, ttft=100.0, out=1, itl=[])
    assert one.meets({"tpot_ms": 1.0, "itl_ms": 1.0})  # no TPOT, no gap: not held against it
    assert not _rec(2, 0.0, 0.1, error="http_500").meets({})
    assert figures([], {"ttft_ms": 1.0})["goodput"]["request_goodput"] == 0.0


def test_slos_from_the_command_line() -> None:
    assert parse_slos(["ttft_ms=500", "tpot_ms=50"]) == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    for bad, match in (("ttft=5", "NAME one of"), ("ttft_ms", "NAME one of"),
                       ("e2e_ms=fast", "not a number"), ("itl_ms=0", "positive")):
        with pytest.raises(ValueError, match=match):
            parse_slos([bad])


PROM_BEFORE = """# HELP sieproxy_requests_total Requests.
# TYPE sieproxy_requests_total counter
sieproxy_requests_total{route="chat",code="200"} 10
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0
# TYPE req_latency_seconds histogram
req_latency_seconds_bucket{le="0.1"} 3
req_latency_seconds_bucket{le="+Inf"} 4
req_latency_seconds_sum 0.9
req_latency_seconds_count 4
# TYPE tokens counter
tokens_total 100
tokens_created 1.7e9
"""
PROM_AFTER = PROM_BEFORE.replace("} 10", "} 25").replace('"m"} 0', '"m"} 3').replace(
    "_sum 0.9", "_sum 2.4").replace("_count 4", "_count 9").replace("total 100", "total 420")


def test_prometheus_counters_change_and_gauges_are_read_after() -> None:
    b, tb = prom.parse(PROM_BEFORE)
    a, ta = prom.parse(PROM_AFTER)
    assert tb["vllm:num_requests_running"] == "gauge"
    d = prom.difference(b, a, {**tb, **ta})
    assert d["counters_delta"] == pytest.approx({
        'sieproxy_requests_total{route="chat",code="200"}': 15.0,
        "req_latency_seconds_sum": 1.5, "req_latency_seconds_count": 5.0,
        "tokens_total": 320.0})
    assert d["gauges_after"] == {'vllm:num_requests_running{model_name="m"}': 3.0}
    assert prom.report("http://x/metrics", "HTTP 404", None) == {
        "available": False, "url": "http://x/metrics", "reason": "HTTP 404"}
    assert prom.report(None, None, None)["available"] is False
    with pytest.raises(ValueError, match="not Prometheus"):
        prom.parse("<html>")
