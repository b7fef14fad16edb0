"""Bearer-token authentication: which tenant a request's key belongs to.

Keys are held only as SHA-256 digests: the keys file's (sieproxy/settings/keys.py) and those of
the old token list (``tokens``, ``tokens_file``, ``SIEPROXY_AUTH_TOKENS``), each of which is a
tenant of its own with no limits. A presented key is hashed and the digest compared with every
configured digest using ``hmac.compare_digest`` (constant time, on bytes, no early exit), so
neither timing nor a non-ASCII header can tell anything or crash anything. Any header that is
not ``Bearer <token>`` is simply a 401. Auth enabled with no key configured fails closed: every
request gets 500 until the operator fixes the configuration. A keys file turns auth on.
"""

from __future__ import annotations

import hashlib
import hmac

from ..core.errors import AuthenticationError, InternalError
from ..settings.keys import KeyEntry, legacy_entries

__all__ = ["Authenticator"]


class Authenticator:
    def __init__(
        self, enabled: bool, tokens: list[bytes], keys: dict[str, KeyEntry] | None = None
    ) -> None:
        self.enabled = enabled or keys is not None
        self.keys = {**legacy_entries(tokens), **(keys or {})}
        self._digests = [(bytes.fromhex(h), e) for h, e in self.keys.items()]

    def check(self, authorization: bytes | None) -> KeyEntry | None:
        """The key's entry (None with auth off); 401 (or 500 when misconfigured) otherwise."""
        if not self.enabled:
            return None
        if not self.keys:
            raise InternalError(
                "Authentication is enabled but no token is configured; contact the operator."
            )
        if not authorization:
            raise AuthenticationError("Missing bearer token: send `Authorization: Bearer <token>`.")
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            raise AuthenticationError("Malformed Authorization header: use `Bearer <token>`.")
        digest = hashlib.sha256(token.strip()).digest()
        entry: KeyEntry | None = None
        for d, e in self._digests:
            if hmac.compare_digest(digest, d):
                entry = e
        if entry is None:
            raise AuthenticationError("Invalid bearer token.")
        return entry
