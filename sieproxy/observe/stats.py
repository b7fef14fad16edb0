"""What one request records for the access log and the metrics (``sieproxy.observe``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.errors import GatewayError

__all__ = ["RequestStats"]


@dataclass(slots=True)
class RequestStats:
    """What the access log and metrics record about one request."""

    request_id: str
    model: str
    endpoint: str
    n: int
    stream: bool
    replica: str | None = None
    started: float = 0.0
    first_token_at: float | None = None
    abort_causes: dict[str, int] = field(default_factory=dict)
    retried: bool = False
    #: Broken streams resumed elsewhere, by cause (sieproxy/relay/resume.py).
    resumes: dict[str, int] = field(default_factory=dict)
    error: GatewayError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sdk_version: str | None = None
    #: The tenant of the request's key (sieproxy/tenancy/; None with auth off).
    tenant: str | None = None
    #: Seconds it waited for a replica slot (admission).
    admission_wait: float = 0.0
    #: How the response ended for its client: ``complete`` (its end was sent), ``client_closed``
    #: (the client left first) or ``cut`` (the gateway stopped first: a shutdown stopping at
    #: once).
    outcome: str = "complete"
    responded: bool = False  # its status line was sent
    #: ``cache_aware`` routing: the cached prompt tokens predicted for the chosen replica, and
    #: the engine's report (``cached_tokens``); called at the first token.
    cached_predicted: int | None = None
    cached_tokens: int | None = None
    on_first_token: Callable[[], None] | None = None
