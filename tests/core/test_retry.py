"""The retry table (sieproxy/core/upstream/retry.py): every failure kind, its moves and their
bounds, the jittered backoff, and Retry-After in both of its forms."""

from __future__ import annotations

import calendar

import pytest

from sieproxy.core.errors import (
    EngineAborted,
    EngineHTTPError,
    EngineMalformed,
    EngineStreamError,
    EngineTimeout,
    EngineTruncated,
    EngineUnreachable,
    GatewayError,
    InvalidRequest,
)
from sieproxy.core.request.refusal import Refusal
from sieproxy.core.upstream.retry import (
    POLICY,
    FirstTokenTimeout,
    Tried,
    backoff,
    classify,
    decide,
    parse_retry_after,
)

MAX = 5.0


def http(status: int, hint: float | None = None) -> EngineHTTPError:
    err = EngineHTTPError("x", engine_status=status)
    err.upstream_retry_after = hint
    return err


def refused(kind: str) -> EngineHTTPError:
    err = http(400)
    err.refusal = Refusal(kind, prompt_tokens=10, context_length=8)
    return err


CASES: list[tuple[str, GatewayError, str]] = [
    ("429-hint", http(429, 2.0), "busy_hint"),
    ("503-hint", http(503, 5.0), "busy_hint"),
    ("429-hint-too-long", http(429, 60.0), "busy"),
    ("429", http(429), "busy"),
    ("503", http(503), "busy"),
    ("500", http(500), "server"),
    ("502", http(502), "server"),
    ("event-500", EngineStreamError("x"), "server"),
    ("malformed", EngineMalformed(), "server"),
    ("truncated", EngineTruncated(), "server"),
    ("abort-503", EngineAborted("x", engine_status=503), "server"),
    ("abort-400", EngineAborted("x", engine_status=400), "refused"),
    ("unreachable", EngineUnreachable(), "unreachable"),
    ("first-token", FirstTokenTimeout(), "first_token"),
    ("gap", EngineTimeout("x"), "timeout"),
    ("400", http(400), "refused"),
    ("context", refused("prompt_too_long"), "context"),
    ("context-total", refused("context_exceeded"), "context"),
    ("grammar", refused("grammar"), "refused"),
    ("not-upstream", InvalidRequest("x"), "refused"),
]


@pytest.mark.parametrize(("err", "kind"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_failure_has_its_row(err: GatewayError, kind: str) -> None:
    assert classify(err, MAX) == kind
    assert kind in POLICY


def moves(err: GatewayError, tried: Tried, *, now: float = 0.0, deadline: float = 100.0):  # type: ignore[no-untyped-def]
    return decide(
        err,
        tried,
        now=now,
        deadline=deadline,
        draw=0.5,
        retry_after_max=MAX,
        backoff_base=0.1,
        backoff_cap=2.0,
    )


def test_a_one_off_5xx_is_retried_once_within_the_model_then_falls_back() -> None:
    tried = Tried()
    d = moves(http(500), tried)
    assert d.moves == ("other", "same", "fallback")
    assert d.pause == pytest.approx(0.075)  # half the backoff, plus half of it times the draw
    tried.took("same")
    d = moves(http(500), tried)
    assert d.moves == ("fallback",), "one retry within the model"
    tried.took("fallback")
    assert moves(http(500), tried).moves == ("fallback",)


def test_retry_after_within_the_bound_retries_the_same_replica_after_the_pause() -> None:
    tried = Tried()
    d = moves(http(429, 2.0), tried)
    assert d.kind == "busy_hint"
    assert d.moves == ("same", "other", "fallback")
    assert d.pause == 2.0
    tried.took("same")
    d = moves(http(429, 3.0), tried)
    assert d.moves == ("other", "fallback"), "the same replica once"
    assert tried.hint == 3.0, "the longest hint is kept for the client"
    tried.took("other")
    assert moves(http(429, 1.0), tried).moves == ("fallback",)
    assert tried.hint == 3.0


def test_a_pause_past_the_deadline_is_not_taken() -> None:
    d = moves(http(503, 4.0), Tried(), now=10.0, deadline=13.0)
    assert d.moves == ("other", "fallback")


def test_retry_after_beyond_the_bound_moves_on_at_once() -> None:
    tried = Tried()
    d = moves(http(503, 30.0), tried)
    assert d.kind == "busy" and d.moves == ("other", "same", "fallback")
    assert d.pause < 1.0  # the backoff, not the hint
    assert tried.hint == 30.0


@pytest.mark.parametrize(
    ("err", "want"),
    [
        (EngineTimeout("gap"), ()),
        (http(400), ()),
        (EngineUnreachable(), ("other", "fallback")),
        (FirstTokenTimeout(), ("other", "fallback")),
        (refused("prompt_too_long"), ("context",)),
    ],
)
def test_rows_without_a_same_replica_move(err: GatewayError, want: tuple[str, ...]) -> None:
    assert moves(err, Tried()).moves == want


def test_backoff_doubles_with_equal_jitter_and_a_cap() -> None:
    assert backoff(0, 0.0, base=0.1, cap=2.0) == pytest.approx(0.05)
    assert backoff(0, 0.999999, base=0.1, cap=2.0) == pytest.approx(0.1)
    assert backoff(3, 0.0, base=0.1, cap=2.0) == pytest.approx(0.4)
    assert backoff(10, 1.0, base=0.1, cap=2.0) == pytest.approx(2.0)
    assert backoff(10_000, 0.5, base=0.1, cap=2.0) == pytest.approx(1.5)  # no overflow


def test_retry_after_forms() -> None:
    now = calendar.timegm((2026, 12, 5, 9, 0, 0, 0, 0, 0))
    assert parse_retry_after(b"2", now) == 2.0
    assert parse_retry_after(" 0 ", now) == 0.0
    assert parse_retry_after("1.5", now) == 1.5
    assert parse_retry_after("Sat, 05 Dec 2026 09:00:07 GMT", now) == 7.0
    assert parse_retry_after("Sat, 05 Dec 2026 08:59:00 GMT", now) == 0.0  # in the past
    for bad in (
        None, "", "-1", "soon", "nan", "inf",
        "Sat, 05 Dec 2026 09:00:07",  # no zone
        "Sat, 31 Feb 2026 09:00:00 GMT",  # no such day
    ):  # fmt: skip
        assert parse_retry_after(bad, now) is None, bad
