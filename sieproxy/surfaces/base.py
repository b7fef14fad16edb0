"""The surface seam: what an API surface is, as intake, admission and the relay see it.

A :class:`Surface` is one public API (chat completions, legacy completions, Responses, ...):
its route, its label in metrics and logs, its strict request schema and validation, its
mapping onto the internal generation (:meth:`Surface.prepare` → a
:class:`~sieproxy.core.planning.prepared.Prepared`: engine bodies and a shaper for the
surface's streamed or whole output), and its error envelope (:meth:`Surface.error`). Intake
(``sieproxy/front/intake.py``) finds the surface by path and calls only these; a new surface
is one module that subclasses :class:`Surface` and is listed in ``SURFACES``
(``sieproxy/surfaces/__init__.py``) or handed to ``create_app``. Surfaces are sans-IO: they
import the core and nothing of the shell.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from ..core.errors import GatewayError
from ..core.planning.prepared import Prepared
from ..core.request.profile import ModelProfile

__all__ = ["ErrorAnswer", "Surface"]

_json = msgspec.json.Encoder()

#: An error as sent: status, headers (names as given), body bytes.
ErrorAnswer = tuple[int, dict[str, str], bytes]


class Surface:
    """One API surface (module docstring). Subclasses set ``name`` and ``path`` and implement
    :meth:`prepare`; :meth:`error` defaults to OpenAI's envelope."""

    #: The endpoint label in metrics and the access log (``chat``, ``completions``, ...).
    name: str = ""
    #: The route (``POST`` only).
    path: str = ""
    #: Request headers that carry the API key besides ``Authorization: Bearer`` (lower case).
    key_headers: tuple[bytes, ...] = ()

    def prepare(
        self,
        raw: bytes,
        profiles: Mapping[str, ModelProfile],
        *,
        request_id: str,
        created: int,
        model: str | None = None,
    ) -> Prepared:
        """Decode and validate ``raw``, find the model (404), plan the engine requests and build
        the shaper. ``model`` plans the same request for another model (a fallback), whose name
        the response then carries. Raises a :class:`GatewayError` to refuse."""
        raise NotImplementedError

    def error(self, err: GatewayError) -> ErrorAnswer:
        """``err`` as this surface sends it before a response started (OpenAI's envelope by
        default: ``{"error": {"message", "type", "param", "code"}}``)."""
        return err.status, err.headers, _json.encode(err.envelope())
