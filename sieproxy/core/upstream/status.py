"""What an engine's HTTP status means for the client, the circuit breaker and the retry rules:
one table, the same in code and in docs/API.md ("Engine status codes").

    engine status        client gets                           breaker   retryable
    400, 413, 422        400 (the refusal, read from its       no        no
                         OpenAI error envelope: core.refusal)
    429                  503 engine_unavailable, Retry-After   no        yes
    404, other 4xx       502 upstream_error                    no        no
    503                  503 engine_unavailable, Retry-After   yes       yes
    other 5xx            502 upstream_error                    yes       no

A 4xx never counts toward the breaker: the engine answered, about this request (an engine 404 is
a path or model it does not serve: a configuration matter no backoff fixes). Failures without a
status (no connection, a broken or truncated stream, a timeout) count when the client's status
is 5xx, as before.
"""

from __future__ import annotations

__all__ = ["REFUSALS", "breaker_counts", "retryable_status"]

#: Engine statuses that are the engine refusing this request: the client's 400.
REFUSALS = frozenset({400, 413, 422})


def retryable_status(engine_status: int) -> bool:
    """Whether another replica may take a request its engine answered so (nothing started)."""
    return engine_status in (429, 503)


def breaker_counts(engine_status: int | None, client_status: int) -> bool:
    """Whether a failed request counts toward its replica's breaker: ``engine_status`` is the
    engine's HTTP status if it answered with one (None otherwise)."""
    if engine_status is not None:
        return engine_status >= 500
    return client_status >= 500
