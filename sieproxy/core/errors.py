"""The gateway's error model: every error a client can see, with its HTTP status.

Errors carry their status (as h11's do), so each boundary translates once, into one of these,
and the HTTP layer renders them with :meth:`GatewayError.envelope`.

    GatewayError                     status, type, code, param, message, headers
    ├── RequestError                 400  invalid_request_error
    │   ├── InvalidRequest           400  code "invalid_request"
    │   ├── UnsupportedField         400  code "unsupported_field"
    │   └── ContextLengthExceeded    400  code "context_length_exceeded" (in core.refusal)
    ├── AuthenticationError          401  (WWW-Authenticate: Bearer)
    ├── NotFound                     404  (unknown model, unknown path)
    ├── MethodNotAllowed             405
    ├── BodyTooLarge                 413
    ├── InternalError                500  (misconfiguration; never echoes exception text)
    ├── ServiceUnavailable           503  (Retry-After)
    └── UpstreamError                errors that come from an engine
        ├── EngineUnreachable        503  connection refused, connect or pool timeout
        ├── EngineHTTPError          502 / 503 / 400  the engine answered with an error status
        │                            (a 4xx refusal carries ``refusal``; see core.refusal)
        ├── EngineMalformed          500  "worker emitted malformed response"
        ├── EngineStreamError        500  the engine sent an in-stream `error` object
        ├── EngineAborted            status from the abort finish reason
        ├── EngineTruncated          502  EOF without `[DONE]`, or a reset (also before the head)
        └── EngineTimeout            504  no token within the configured gap / deadline

Engine or library exception text is never put in ``message``: messages are the gateway's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .request.refusal import Refusal

__all__ = [
    "AuthenticationError",
    "BodyTooLarge",
    "EngineAborted",
    "EngineHTTPError",
    "EngineMalformed",
    "EngineStreamError",
    "EngineTimeout",
    "EngineTruncated",
    "EngineUnreachable",
    "GatewayError",
    "InternalError",
    "InvalidRequest",
    "MethodNotAllowed",
    "NotFound",
    "RequestError",
    "ServiceUnavailable",
    "UnsupportedField",
    "UpstreamError",
]


_MAX_MESSAGE = 512
_MAX_PARAM = 128


class GatewayError(Exception):
    """Base class: an error with an HTTP status and an OpenAI error envelope."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # Messages and params may quote client input (a field name, a model name): clip them so
        # an error body stays small whatever the request held.
        if len(message) > _MAX_MESSAGE:
            message = message[:_MAX_MESSAGE] + "…"
        if param is not None and len(param) > _MAX_PARAM:
            param = param[:_MAX_PARAM] + "…"
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def envelope(self) -> dict[str, Any]:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r})"


class RequestError(GatewayError):
    status = 400
    type = "invalid_request_error"


class InvalidRequest(RequestError):
    """A value of an accepted field is of the wrong type, out of range, or breaks a rule."""

    code = "invalid_request"


class UnsupportedField(RequestError):
    """A field (or value) the gateway does not accept at all."""

    code = "unsupported_field"


class AuthenticationError(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self, message: str = "Missing or invalid bearer token.", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("WWW-Authenticate", "Bearer")


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class InternalError(GatewayError):
    status = 500
    type = "server_error"
    code = "internal_error"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after
        self.headers.setdefault("Retry-After", str(retry_after))


class UpstreamError(GatewayError):
    """An engine failed.  ``retryable`` is true when nothing reached the engine's model yet.
    ``refusal`` is set when the engine refused the request itself (a 4xx): what its text said,
    for ``core.refusal.explain`` to word the client's error with the request's field names."""

    status = 502
    type = "server_error"
    code = "upstream_error"
    retryable = False
    refusal: Refusal | None = None
    #: The engine's own ``Retry-After`` (seconds), when its error status carried one
    #: (``core.retry``).
    upstream_retry_after: float | None = None


class EngineUnreachable(UpstreamError, ServiceUnavailable):
    status = 503
    code = "engine_unavailable"
    retryable = True

    def __init__(
        self, message: str = "No engine could be reached; retry shortly.", **kw: Any
    ) -> None:
        super().__init__(message, **kw)


class EngineHTTPError(UpstreamError):
    """The engine answered ``/generate`` with a non-200 status (its text is not echoed)."""

    code = "upstream_error"

    def __init__(self, message: str, *, engine_status: int, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.engine_status = engine_status
        if engine_status in (400, 413, 422):  # the table: core/upstream/status.py
            # The engine refused the request itself (e.g. prompt longer than the context).
            self.status = 400
            self.type = "invalid_request_error"
            self.code = "invalid_request"
        elif engine_status in (429, 503):
            self.status = 503
            self.code = "engine_unavailable"
            self.retryable = True
            self.headers.setdefault("Retry-After", "1")
        else:
            self.status = 502


class EngineMalformed(UpstreamError):
    status = 500
    code = "malformed_upstream"

    def __init__(
        self, message: str = "The worker emitted a malformed response.", **kw: Any
    ) -> None:
        super().__init__(message, **kw)


class EngineStreamError(UpstreamError):
    """The engine sent an ``{"error": ...}`` object in its stream."""

    status = 500
    code = "upstream_error"


class EngineAborted(UpstreamError):
    """An abort finish reason with a status code (scheduler-side failure)."""

    code = "upstream_aborted"

    def __init__(self, message: str, *, engine_status: int, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.engine_status = engine_status
        if 400 <= engine_status < 500:
            self.status = 400
            self.type = "invalid_request_error"
            self.code = "invalid_request"
        elif engine_status == 503:
            self.status = 503
            self.headers.setdefault("Retry-After", "1")
        else:
            self.status = 502


class EngineTruncated(UpstreamError):
    status = 502
    code = "upstream_truncated"

    def __init__(
        self, message: str = "The engine closed the stream before it finished.", **kw: Any
    ) -> None:
        super().__init__(message, **kw)


class ClientStalled(GatewayError):
    """The client stopped reading for longer than ``client_stall_timeout``: the generation was
    aborted upstream. Sent as the stream's error event if the client ever reads again."""

    status = 408
    type = "timeout_error"
    code = "client_stalled"

    def __init__(
        self,
        message: str = "The client did not read the stream for too long; the generation was "
        "aborted.",
        **kw: Any,
    ) -> None:
        super().__init__(message, **kw)


class EngineTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
