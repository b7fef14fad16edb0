"""The retry policy before the first byte: one table, and the decision it makes.

An engine failure that reaches the relay before any of the engine's events reached the
response's shaper is classified (:func:`classify`) and looked up in :data:`POLICY`. The table
says where the request may go next and how often, in order of preference:

    failure        what it is                                   moves, in order        retries
    busy_hint      429/503 with Retry-After <= retry_after_max  same (after the hint), 2
                                                                other, fallback
    busy           429/503 without a usable Retry-After         other, same (backoff), 1
                                                                fallback
    server         other 5xx status, an error event, a 5xx      other, same (backoff), 1
                   abort finish or a malformed event before      fallback
                   any output, a reset or EOF (before or
                   after the head, before any output)
    unreachable    connection refused, connect/pool timeout     other, fallback        1
    first_token    ``first_token_timeout`` fired, nothing shown other, fallback        1
    context        ``context_length_exceeded`` (the engine's)   context fallback       —
    timeout        the token gap or the request deadline        none                   0
    refused        any other 4xx (the request itself)           none                   0

``retries`` bounds the moves within the model (``same`` and ``other`` together); ``fallback``
then tries the model's ``fallbacks`` (``context``: its ``context_fallbacks``), each once
(``sieproxy.fallback``). A ``same`` move is taken only where the table lists it and, for
``busy_hint``, only when the pause ends before the request's deadline; ``other`` only when
another ready replica of the model has room (the shell asks the pool). So a one-off 5xx on a
model with one replica is retried once on that replica after a short jittered backoff, and on
another replica where there is one.

Backoff (:func:`backoff`): ``base * 2**k`` seconds for the ``k``-th retry of the request,
jittered to between half and the whole of that (equal jitter), capped at ``cap``; the random
draw is an input. Retry-After (:func:`parse_retry_after`): delta-seconds or an HTTP-date, the
current wall-clock time an input. The module is sans-IO: no clock, no randomness of its own.
"""

from __future__ import annotations

import calendar
import math
import re
from dataclasses import dataclass, field

from ..errors import (
    EngineAborted,
    EngineHTTPError,
    EngineMalformed,
    EngineStreamError,
    EngineTimeout,
    EngineTruncated,
    EngineUnreachable,
    GatewayError,
    UpstreamError,
)

__all__ = [
    "POLICY",
    "Decision",
    "Rule",
    "Tried",
    "backoff",
    "classify",
    "decide",
    "parse_retry_after",
]


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of :data:`POLICY`: the moves in order of preference (``same``, ``other``,
    ``fallback``, ``context``) and how many retries within the model."""

    moves: tuple[str, ...]
    retries: int


#: The policy table (see the module docstring).
POLICY: dict[str, Rule] = {
    "busy_hint": Rule(("same", "other", "fallback"), 2),
    "busy": Rule(("other", "same", "fallback"), 1),
    "server": Rule(("other", "same", "fallback"), 1),
    "unreachable": Rule(("other", "fallback"), 1),
    "first_token": Rule(("other", "fallback"), 1),
    "context": Rule(("context",), 0),
    "timeout": Rule((), 0),
    "refused": Rule((), 0),
}


class FirstTokenTimeout(EngineTimeout):
    """An attempt showed nothing within the model's ``first_token_timeout``: it was aborted,
    and the request may move on (:data:`POLICY` ``first_token``)."""

    def __init__(
        self,
        message: str = "The engine produced no token within the model's first-token timeout; "
        "the request was aborted.",
    ) -> None:
        super().__init__(message)


def classify(err: GatewayError, retry_after_max: float) -> str:
    """The :data:`POLICY` row of an engine failure that came before any output."""
    if isinstance(err, FirstTokenTimeout):
        return "first_token"
    if isinstance(err, EngineTimeout):
        return "timeout"
    if not isinstance(err, UpstreamError):
        return "refused"
    refusal = err.refusal
    if refusal is not None and refusal.kind in ("prompt_too_long", "context_exceeded"):
        return "context"
    if isinstance(err, EngineUnreachable):
        return "unreachable"
    if isinstance(err, EngineHTTPError) and err.engine_status in (429, 503):
        hint = err.upstream_retry_after
        return "busy_hint" if hint is not None and hint <= retry_after_max else "busy"
    if err.status < 500:
        return "refused"
    if isinstance(
        err, EngineHTTPError | EngineStreamError | EngineAborted | EngineMalformed | EngineTruncated
    ):
        return "server"
    return "server" if err.retryable else "refused"


@dataclass(slots=True)
class Tried:
    """What one request has used of the table so far."""

    retries: int = 0  # moves within the model (same or other)
    same: int = 0
    fallbacks: int = 0
    #: The largest Retry-After an engine asked for (seconds), for the client's when all fail.
    hint: float | None = None
    kinds: list[str] = field(default_factory=list)

    def took(self, move: str) -> None:
        """The shell took ``move``."""
        if move in ("same", "other"):
            self.retries += 1
            self.same += move == "same"
        else:
            self.fallbacks += 1


@dataclass(frozen=True, slots=True)
class Decision:
    """The moves left for this failure, in order (the shell takes the first that works), and
    the pause before a ``same`` move."""

    kind: str
    moves: tuple[str, ...]
    pause: float = 0.0


def backoff(k: int, draw: float, *, base: float, cap: float) -> float:
    """The pause before the ``k``-th retry (0-based): equal jitter over ``base * 2**k``,
    capped at ``cap``; ``draw`` in [0, 1)."""
    full = min(cap, base * (2 ** min(k, 30)))
    return float(full / 2 + full / 2 * draw)


def decide(
    err: GatewayError,
    tried: Tried,
    *,
    now: float,
    deadline: float,
    draw: float,
    retry_after_max: float,
    backoff_base: float,
    backoff_cap: float,
) -> Decision:
    """The moves :data:`POLICY` allows after ``err`` (``tried`` is updated with its hint)."""
    kind = classify(err, retry_after_max)
    tried.kinds.append(kind)
    hint = err.upstream_retry_after if isinstance(err, UpstreamError) else None
    if hint is not None:
        tried.hint = hint if tried.hint is None else max(tried.hint, hint)
    rule = POLICY[kind]
    moves: list[str] = []
    pause = 0.0
    within = tried.retries < rule.retries
    for move in rule.moves:
        if move == "same":
            if not within or tried.same >= 1:
                continue
            if kind == "busy_hint":
                assert hint is not None
                pause = hint
            else:
                pause = backoff(tried.retries, draw, base=backoff_base, cap=backoff_cap)
            if now + pause >= deadline:
                continue
        elif move == "other" and not within:
            continue
        moves.append(move)
    return Decision(kind, tuple(moves), pause)


def parse_retry_after(value: bytes | str | None, now: float) -> float | None:
    """Seconds from a ``Retry-After`` value (delta-seconds, or an HTTP-date against ``now``,
    the wall-clock time in seconds since the epoch); None when absent or unreadable."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if not text:
        return None
    if text.isdigit():
        return float(int(text))
    try:
        seconds = float(text)  # not RFC 9110, but some servers send fractions
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    m = _IMF_DATE.match(text)
    if m is None:
        return None
    day, year, hh, mm, ss = (int(m[k]) for k in (1, 3, 4, 5, 6))
    month = _MONTHS.index(m[2]) + 1
    if not 1 <= day <= calendar.monthrange(year, month)[1] or hh > 23 or mm > 59 or ss > 60:
        return None
    when = calendar.timegm((year, month, day, hh, mm, ss, 0, 0, 0))
    return max(float(when) - now, 0.0)


#: RFC 9110's IMF-fixdate, the form a sender must use: ``Sun, 06 Nov 1994 08:49:37 GMT``.
_IMF_DATE = re.compile(
    r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d{2}) "
    r"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) (\d{4}) (\d{2}):(\d{2}):(\d{2}) GMT$"
)
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
