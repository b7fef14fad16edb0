"""Per-tenant limits: the arithmetic of admission, settlement and the rate-limit headers.

Sans-IO: every function takes the time (``now``, seconds) as an argument; the shell
(sieproxy/tenancy/) passes the clock, and the Redis script (sieproxy/tenancy/redis_store.py)
does the same arithmetic in Lua on the same numbers.

Semantics
---------
- **Requests per minute** and **tokens per minute** are each a *token bucket*, not a
  clock-aligned minute: the bucket holds at most the per-minute limit and refills continuously
  at ``limit / 60`` per second; a new tenant's bucket starts full (so a burst of one minute's
  allowance passes at once, then the steady rate applies).
- A request **reserves** ``cost`` tokens at admission (its prompt tokens plus its output cap,
  for every candidate) and one request; at its end it is **settled**: the bucket gets back the
  reserved tokens it did not use (``reserved - used``; when it used more than it reserved — a
  prompt estimate that was low — the difference is taken, down to an empty bucket: the level
  never goes below zero, so no wait is ever longer than one minute).
- **Concurrency**: at most ``concurrency`` admitted requests at once; over it the answer is at
  once a 429 (it is not queued) with ``Retry-After: 1`` (no one can tell when a running request
  ends).
- **Retry-After** is the time until the bucket holds what the request needs, rounded up to whole
  seconds: a retry after it succeeds unless other requests of the tenant took the room first.
  A request needs at most the bucket's capacity, so it is at most 60 s; a request that needs
  more than the whole per-minute budget could never pass and is refused with a 400
  (:func:`too_large`), not a 429 (which would make SDKs retry forever).
- Admission is all or nothing: when one limit refuses, nothing is taken from the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..errors import GatewayError, InvalidRequest

__all__ = [
    "LIMIT_NAMES",
    "Bucket",
    "Decision",
    "Limits",
    "RateLimited",
    "TenantCounters",
    "admit",
    "anthropic_rate_headers",
    "duration_text",
    "rate_headers",
    "settle",
    "too_large",
]

#: The limits a refusal can name, as the error and the metrics name them.
LIMIT_NAMES = ("requests", "tokens", "concurrency")

_MINUTE = 60.0
_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits (``None``: no limit)."""

    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.concurrency is None


@dataclass(slots=True)
class Bucket:
    """A token bucket's level at time ``at`` (full when first seen)."""

    level: float
    at: float

    def refill(self, capacity: int, now: float) -> None:
        if now > self.at:
            self.level = min(float(capacity), self.level + (now - self.at) * capacity / _MINUTE)
            self.at = now

    def wait_for(self, need: float, capacity: int) -> float:
        """Seconds until the bucket holds ``need`` (0 when it does now, to within ``_EPS``: the
        refill's floating-point rounding must not refuse a retry made after its Retry-After)."""
        if self.level + _EPS >= need:
            return 0.0
        return (need - self.level) * _MINUTE / capacity

    def until_full(self, capacity: int) -> float:
        return max(0.0, (capacity - self.level) * _MINUTE / capacity)


@dataclass(slots=True)
class TenantCounters:
    """One tenant's counters (per process, or the copy a Redis script keeps)."""

    requests: Bucket | None = None
    tokens: Bucket | None = None
    inflight: int = 0

    def bucket(self, which: str, capacity: int, now: float) -> Bucket:
        b: Bucket | None = getattr(self, which)
        if b is None:
            b = Bucket(float(capacity), now)
            setattr(self, which, b)
        b.refill(capacity, now)
        return b


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one admission, and what the ``x-ratelimit-*`` headers say."""

    ok: bool
    limit: str | None = None  # the refusing limit (LIMIT_NAMES) when not ok
    retry_after: float = 0.0  # seconds, when not ok
    #: (remaining, seconds until full) of each bucket that has a limit, after the admission.
    requests: tuple[int, float] | None = None
    tokens: tuple[int, float] | None = None
    extra: dict[str, str] = field(default_factory=dict)


def too_large(limits: Limits, cost: int, *, param: str | None, detail: str) -> None:
    """A request needing more tokens than the whole per-minute budget: a non-retryable 400."""
    if limits.tpm is not None and cost > limits.tpm:
        raise InvalidRequest(
            f"This request may use up to {cost} tokens ({detail}), more than the whole "
            f"per-minute token limit of this key ({limits.tpm} tokens per minute, tpm); it can "
            "never pass: lower the output token limit, the number of candidates or the prompt.",
            param=param,
            code="tokens_limit_exceeded",
        )


def _snapshot(
    c: TenantCounters, limits: Limits
) -> tuple[tuple[int, float] | None, tuple[int, float] | None]:
    req = tok = None
    if limits.rpm is not None and c.requests is not None:
        req = (max(0, math.floor(c.requests.level)), c.requests.until_full(limits.rpm))
    if limits.tpm is not None and c.tokens is not None:
        tok = (max(0, math.floor(c.tokens.level)), c.tokens.until_full(limits.tpm))
    return req, tok


def admit(c: TenantCounters, limits: Limits, cost: int, now: float) -> Decision:
    """Admit one request reserving ``cost`` tokens, or say which limit refuses and for how long.

    On success the request, its tokens and a concurrency slot are taken from ``c``."""
    if limits.concurrency is not None and c.inflight >= limits.concurrency:
        req, tok = _snapshot(c, limits)
        return Decision(False, "concurrency", 1.0, req, tok)
    waits: list[tuple[float, str]] = []
    rb = tb = None
    if limits.rpm is not None:
        rb = c.bucket("requests", limits.rpm, now)
        waits.append((rb.wait_for(1, limits.rpm), "requests"))
    if limits.tpm is not None:
        tb = c.bucket("tokens", limits.tpm, now)
        waits.append((tb.wait_for(min(cost, limits.tpm), limits.tpm), "tokens"))
    worst = max(waits, default=(0.0, ""))
    if worst[0] > 0:
        req, tok = _snapshot(c, limits)
        return Decision(False, worst[1], min(worst[0], _MINUTE), req, tok)
    if rb is not None:
        rb.level = max(0.0, rb.level - 1)
    if tb is not None:
        tb.level = max(0.0, tb.level - cost)
    c.inflight += 1
    req, tok = _snapshot(c, limits)
    return Decision(True, requests=req, tokens=tok)


def settle(c: TenantCounters, limits: Limits, reserved: int, used: int, now: float) -> None:
    """A request admitted with ``reserved`` tokens ended having used ``used``: give back the
    difference (or take the excess) and free its concurrency slot."""
    c.inflight = max(0, c.inflight - 1)
    if limits.tpm is not None:
        b = c.bucket("tokens", limits.tpm, now)
        # Between empty and full: a low estimate's excess is taken only down to empty.
        b.level = max(0.0, min(float(limits.tpm), b.level + reserved - used))


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``"1m30s"``, ``"1.5s"``,
    ``"250ms"``, ``"0s"``."""
    if seconds <= 0:
        return "0s"
    ms = math.ceil(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def rate_headers(limits: Limits, d: Decision) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits that are set (none when unlimited)."""
    out: dict[str, str] = {}
    pairs = (("requests", limits.rpm, d.requests), ("tokens", limits.tpm, d.tokens))
    for name, limit, snap in pairs:
        if limit is None:
            continue
        remaining, reset = snap if snap is not None else (limit, 0.0)
        out[f"x-ratelimit-limit-{name}"] = str(limit)
        out[f"x-ratelimit-remaining-{name}"] = str(remaining)
        out[f"x-ratelimit-reset-{name}"] = duration_text(reset)
    return out


def anthropic_rate_headers(limits: Limits, d: Decision, now: float) -> dict[str, str]:
    """Anthropic's ``anthropic-ratelimit-*`` headers (the Messages routes) for the limits that are
    set: ``…-limit``, ``…-remaining``, and ``…-reset`` as the RFC 3339 time (UTC, whole seconds,
    rounded up) when the bucket is full again, ``now`` being the limiter's clock (Unix time)."""
    out: dict[str, str] = {}
    pairs = (("requests", limits.rpm, d.requests), ("tokens", limits.tpm, d.tokens))
    for name, limit, snap in pairs:
        if limit is None:
            continue
        remaining, reset = snap if snap is not None else (limit, 0.0)
        at = datetime.fromtimestamp(math.ceil(now + reset), UTC)
        out[f"anthropic-ratelimit-{name}-limit"] = str(limit)
        out[f"anthropic-ratelimit-{name}-remaining"] = str(remaining)
        out[f"anthropic-ratelimit-{name}-reset"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
    return out


class RateLimited(GatewayError):
    """429: a tenant limit refuses the request now; ``Retry-After`` says when a retry passes.

    ``limit`` names the refusing limit (``requests``, ``tokens`` or ``concurrency``) and
    ``retry_after_s`` is the exact wait in seconds, so another surface (the Messages API) can
    render the same refusal in its own envelope and headers (``at``: the limiter's time of the
    decision, for :func:`anthropic_rate_headers`)."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(
        self,
        limit: str,
        retry_after_s: float,
        limits: Limits,
        decision: Decision,
        at: float = 0.0,
    ) -> None:
        self.limit = limit
        self.at = at
        self.retry_after_s = retry_after_s
        self.limits = limits
        self.decision = decision
        wait = max(1, math.ceil(retry_after_s))
        what = {
            "requests": f"requests per minute ({limits.rpm})",
            "tokens": f"tokens per minute ({limits.tpm})",
            "concurrency": f"concurrent requests ({limits.concurrency})",
        }[limit]
        super().__init__(
            f"Rate limit reached for this key's {what}; retry after {wait} s.",
            headers={
                "Retry-After": str(wait),
                "retry-after-ms": str(wait * 1000),
                **rate_headers(limits, decision),
            },
        )
        self.type = "tokens" if limit == "tokens" else "requests"
