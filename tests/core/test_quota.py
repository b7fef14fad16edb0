"""core.quota: token buckets, reserve and settle, the 429 and 400 it leads to, the headers."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sieproxy.core.errors import InvalidRequest
from sieproxy.core.tenancy.quota import (
    Limits,
    RateLimited,
    TenantCounters,
    admit,
    duration_text,
    rate_headers,
    settle,
    too_large,
)


def test_requests_bucket_starts_full_then_refills_at_the_per_minute_rate() -> None:
    c, lim = TenantCounters(), Limits(rpm=3)
    for _ in range(3):
        assert admit(c, lim, 0, 100.0).ok
    d = admit(c, lim, 0, 100.0)
    assert not d.ok and d.limit == "requests"
    assert d.retry_after == pytest.approx(20.0)  # one request every 60/3 s
    assert not admit(c, lim, 0, 119.9).ok
    assert admit(c, lim, 0, 120.0).ok


def test_tokens_reserved_then_settled_to_real_usage() -> None:
    c, lim = TenantCounters(), Limits(tpm=1000)
    d = admit(c, lim, 800, 0.0)
    assert d.ok and d.tokens == (200, pytest.approx(48.0))
    refused = admit(c, lim, 300, 0.0)
    assert not refused.ok and refused.limit == "tokens"
    assert refused.retry_after == pytest.approx(6.0)  # 100 tokens at 1000/60 per second
    settle(c, lim, reserved=800, used=150, now=0.0)  # gives back 650
    assert c.tokens is not None and c.tokens.level == pytest.approx(850)
    assert admit(c, lim, 300, 0.0).ok


def test_settling_more_than_reserved_takes_down_to_empty_only() -> None:
    c, lim = TenantCounters(), Limits(tpm=100)
    assert admit(c, lim, 90, 0.0).ok
    settle(c, lim, reserved=90, used=500, now=0.0)
    assert c.tokens is not None and c.tokens.level == 0.0
    d = admit(c, lim, 100, 0.0)
    assert not d.ok and d.retry_after == pytest.approx(60.0)  # never longer than a minute


def test_concurrency_refuses_at_once_and_settle_frees_the_slot() -> None:
    c, lim = TenantCounters(), Limits(concurrency=2)
    assert admit(c, lim, 10, 0.0).ok and admit(c, lim, 10, 0.0).ok
    d = admit(c, lim, 10, 0.0)
    assert not d.ok and d.limit == "concurrency" and d.retry_after == 1.0
    settle(c, lim, 10, 10, 0.0)
    assert admit(c, lim, 10, 0.0).ok


def test_admission_is_all_or_nothing() -> None:
    c, lim = TenantCounters(), Limits(rpm=10, tpm=100, concurrency=5)
    assert admit(c, lim, 100, 0.0).ok
    d = admit(c, lim, 50, 0.0)  # the tokens refuse it: no request, no slot is taken
    assert not d.ok and d.limit == "tokens"
    assert c.requests is not None and c.requests.level == pytest.approx(9)
    assert c.inflight == 1


def test_the_longest_wait_names_the_limit() -> None:
    c, lim = TenantCounters(), Limits(rpm=1, tpm=6000)
    assert admit(c, lim, 6000, 0.0).ok
    d = admit(c, lim, 3000, 0.0)  # requests 60 s away, tokens 30 s
    assert d.limit == "requests" and d.retry_after == pytest.approx(60.0)
    d = admit(c, lim, 10, 59.0)  # requests 1 s away, tokens 0.1 s
    assert d.limit == "requests" and d.retry_after == pytest.approx(1.0)


def test_too_large_is_a_400_naming_the_limit_and_the_field() -> None:
    too_large(Limits(tpm=100), 100, param="max_tokens", detail="x")  # fits exactly
    too_large(Limits(), 10**9, param="max_tokens", detail="x")  # no token limit
    with pytest.raises(InvalidRequest) as exc:
        too_large(Limits(tpm=100), 101, param="max_tokens", detail="about 1 prompt tokens")
    err = exc.value
    assert err.status == 400 and err.param == "max_tokens"
    assert "tpm" in err.message and "100" in err.message and "Retry-After" not in err.headers


def test_rate_limited_error_is_openai_shaped() -> None:
    c, lim = TenantCounters(), Limits(rpm=2, tpm=1000)
    admit(c, lim, 10, 0.0)
    admit(c, lim, 10, 0.0)
    d = admit(c, lim, 10, 0.0)
    err = RateLimited(d.limit or "", d.retry_after, lim, d)
    body = err.envelope()["error"]
    assert err.status == 429 and body["code"] == "rate_limit_exceeded"
    assert body["type"] == "requests" and "requests per minute (2)" in body["message"]
    h = err.headers
    assert h["Retry-After"] == "30" and h["retry-after-ms"] == "30000"
    assert h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "1m0s"
    assert h["x-ratelimit-limit-tokens"] == "1000"
    assert h["x-ratelimit-remaining-tokens"] == "980"


def test_headers_only_for_the_limits_set() -> None:
    c = TenantCounters()
    assert rate_headers(Limits(), admit(c, Limits(), 5, 0.0)) == {}
    h = rate_headers(Limits(rpm=60), admit(c, Limits(rpm=60), 5, 0.0))
    assert h == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
    }


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0004, "1ms"), (0.25, "250ms"), (1.5, "1.5s"), (59.9991, "1m0s"),
     (90, "1m30s"), (6.02, "6.02s")],
)  # fmt: skip
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


@settings(max_examples=300, deadline=None)
@given(
    rpm=st.one_of(st.none(), st.integers(1, 50)),
    tpm=st.one_of(st.none(), st.integers(1, 5000)),
    steps=st.lists(
        st.tuples(st.floats(0, 30), st.integers(0, 5000), st.integers(0, 5000)), max_size=30
    ),
)
def test_retry_after_is_truthful_and_at_most_a_minute(
    rpm: int | None, tpm: int | None, steps: list[tuple[float, int, int]]
) -> None:
    """Whatever came before, a refused request passes when retried after its Retry-After (the
    whole seconds the header says), and not a second before the exact wait."""
    lim = Limits(rpm=rpm, tpm=tpm)
    c, now = TenantCounters(), 0.0
    for dt, cost, used in steps:
        now += dt
        cost = min(cost, tpm or cost)
        d = admit(c, lim, cost, now)
        if d.ok:
            settle(c, lim, cost, used, now)
            continue
        assert 0 < d.retry_after <= 60
        wait = math.ceil(d.retry_after)
        assert RateLimited(d.limit or "", d.retry_after, lim, d).headers["Retry-After"] == str(
            max(1, wait)
        )
        if d.retry_after > 0.01:
            probe = copy.deepcopy(c)
            assert not admit(probe, lim, cost, now + d.retry_after - 0.01).ok
        assert admit(c, lim, cost, now + max(1, wait)).ok
        now += max(1, wait)
