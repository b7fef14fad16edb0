"""Anthropic's error envelope for every error of the Messages routes.

:func:`error_reply` renders a :class:`~.errors.GatewayError` as
``{"type": "error", "error": {"type", "message"}}``, the status and headers unchanged; a
refusal's ``param`` leads its message. A stream's error event has the same body
(:func:`error_body`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ...core.errors import GatewayError
from ...core.tenancy.quota import RateLimited, anthropic_rate_headers

__all__ = ["error_body", "error_reply", "error_type"]

_enc = msgspec.json.Encoder()

#: HTTP status → Anthropic's error type (other 4xx: invalid_request_error, 5xx: api_error).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    found = _TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(err: GatewayError) -> dict[str, Any]:
    """Anthropic's error envelope for ``err`` (its ``param`` leads the message)."""
    message = f"{err.param}: {err.message}" if err.param else err.message
    return {"type": "error", "error": {"type": error_type(err.status), "message": message}}


def error_reply(err: GatewayError) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers, body)`` of ``err`` on a Messages route (``Retry-After`` and
    ``WWW-Authenticate`` kept; a tenant's 429 has Anthropic's ``anthropic-ratelimit-*``
    headers instead of OpenAI's ``x-ratelimit-*``)."""
    headers = dict(err.headers)
    if isinstance(err, RateLimited):
        headers = {k: v for k, v in headers.items() if not k.startswith("x-ratelimit-")}
        headers.update(anthropic_rate_headers(err.limits, err.decision, err.at))
    return err.status, headers, _enc.encode(error_body(err))
