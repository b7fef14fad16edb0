"""Bearer-token authentication.

Tokens are held only as SHA-256 digests. A presented token is hashed and compared with every
configured digest using ``hmac.compare_digest`` (constant time, on bytes, no early exit), so
neither timing nor a non-ASCII header can tell anything or crash anything: any header that is
not ``Bearer <token>`` is simply a 401. Auth enabled with no token configured fails closed: every
request gets 500 until the operator fixes the configuration.
"""

from __future__ import annotations

import hashlib
import hmac

from .core.errors import AuthenticationError, InternalError

__all__ = ["Authenticator"]


class Authenticator:
    def __init__(self, enabled: bool, tokens: list[bytes]) -> None:
        self.enabled = enabled
        self._digests = [hashlib.sha256(t).digest() for t in tokens]

    def check(self, authorization: bytes | None) -> None:
        """Raise 401 (or 500 when misconfigured) unless ``authorization`` carries a known token."""
        if not self.enabled:
            return
        if not self._digests:
            raise InternalError(
                "Authentication is enabled but no token is configured; contact the operator."
            )
        if not authorization:
            raise AuthenticationError("Missing bearer token: send `Authorization: Bearer <token>`.")
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            raise AuthenticationError("Malformed Authorization header: use `Bearer <token>`.")
        digest = hashlib.sha256(token.strip()).digest()
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(digest, d)
        if not ok:
            raise AuthenticationError("Invalid bearer token.")
