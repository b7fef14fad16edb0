"""The tenant checks of one request, for every surface: the model the key may use, the
reservation (prompt + output cap of every candidate), and the limits.

:class:`Tenancy` is the hook a surface calls: ``check_model`` before it validates the body
(404 ``model_not_found``, worded as for a model that does not exist, so a key learns nothing
about the models it may not use), then ``admit`` once it knows the reservation (400 when the
request can never fit the per-minute budget, 429 ``core.quota.RateLimited`` over a limit; the
errors are in the shared tree, and carry what another envelope needs to render them), and
``settle`` at the end with the tokens used. chat, completions and Responses go through it in
sieproxy/front/intake.py.

Prompt tokens: the gateway has no tokenizer on the request path (it sends the rendered prompt
as text), so the reservation uses an estimate of one token per 4 bytes of the rendered prompt
(UTF-8), rounded up; token ids (a ``/v1/completions`` prompt given as ids) count exactly;
images are not counted. The engine's real count replaces the estimate when the request is
settled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from ..core.errors import NotFound
from ..core.tenancy.fairshare import Ticket
from ..core.tenancy.quota import RateLimited, too_large
from ..settings.keys import KeyEntry, Tenant
from .limiter import Lease, Limiter

__all__ = ["ANONYMOUS", "BYTES_PER_TOKEN", "Tenancy", "estimate_prompt_tokens", "requested_model"]

#: The tenant of every request when auth is off.
ANONYMOUS = KeyEntry("", Tenant("anonymous"))
#: The prompt estimate's ratio (see the module docstring).
BYTES_PER_TOKEN = 4


class _ModelOnly(msgspec.Struct):
    model: Any = None


_model_decoder = msgspec.json.Decoder(_ModelOnly)


def requested_model(raw: bytes) -> str | None:
    """The ``model`` a JSON request body names (None when it cannot tell: the body's own
    validation then answers)."""
    try:
        m = _model_decoder.decode(raw).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return m if isinstance(m, str) else None


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """The prompt tokens of one ``/generate`` body (see the module docstring)."""
    ids = body.get("input_ids")
    if isinstance(ids, list):
        return len(ids)
    text = body.get("text")
    if isinstance(text, list):  # token ids given as the prompt
        return len(text) if all(isinstance(t, int) for t in text) else 0
    if isinstance(text, str):
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN)
    return 0


def reservation(bodies: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(prompt estimate, output cap per candidate, candidates) of a planned request."""
    prompt = estimate_prompt_tokens(bodies[0]) if bodies else 0
    cap = max((int(b.get("sampling_params", {}).get("max_new_tokens") or 0) for b in bodies),
              default=0)  # fmt: skip
    return prompt, cap, len(bodies)


class Tenancy:
    """The limiter, and what each refusal is reported to (the metrics)."""

    def __init__(
        self,
        limiter: Limiter,
        on_reject: Callable[[str, str], None] = lambda tenant, limit: None,
    ) -> None:
        self.limiter = limiter
        self.on_reject = on_reject

    def check_model(self, entry: KeyEntry | None, model: str | None) -> None:
        """404 ``model_not_found`` when the key may not use ``model`` (the same error as for a
        model that does not exist)."""
        if entry is not None and model is not None and not entry.may_use(model):
            self.on_reject(entry.tenant.name, "model")
            raise NotFound(
                f"The model {model!r} does not exist; GET /v1/models lists the served models.",
                param="model",
                code="model_not_found",
            )

    async def admit(
        self,
        entry: KeyEntry | None,
        *,
        prompt_tokens: int,
        max_tokens: int,
        candidates: int,
        param: str | None,
    ) -> Lease:
        """Reserve ``prompt_tokens + candidates × max_tokens``; 400 when that exceeds the whole
        per-minute budget, 429 over a limit."""
        tenant = (entry or ANONYMOUS).tenant
        cost = prompt_tokens + candidates * max_tokens
        detail = f"about {prompt_tokens} prompt tokens + {candidates} × {max_tokens} output tokens"
        try:
            too_large(tenant.limits, cost, param=param, detail=detail)
        except Exception:
            self.on_reject(tenant.name, "too_large")
            raise
        try:
            return await self.limiter.admit(tenant.name, tenant.limits, cost)
        except RateLimited as exc:
            self.on_reject(tenant.name, exc.limit)
            raise

    def settle(self, lease: Lease, used: int) -> None:
        self.limiter.settle(lease, used)

    @staticmethod
    def ticket(entry: KeyEntry | None, cost: int) -> Ticket:
        """The request's place in the admission queue (sieproxy/tenancy/admission.py)."""
        t = (entry or ANONYMOUS).tenant
        return Ticket(t.name, t.priority, cost, t.weight)
