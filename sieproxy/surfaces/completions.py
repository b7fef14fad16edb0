"""``POST /v1/completions``: OpenAI's legacy raw-prompt completions (one candidate).

Its own strict schema and rules (``CompletionRequest``, ``check_completion``), the prompt sent
as given (``plan_completion``: no template), and ``CompletionStream`` / ``CompletionCollector``
for the output. Ids are ``cmpl-<request_id>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.planning.affinity import prefix_key
from ..core.planning.plan import merge_stops, plan_completion
from ..core.planning.prepared import Collected, Prepared
from ..core.request.profile import ModelProfile
from ..core.request.refusal import RequestFields
from ..core.request.validate import check_completion, decode_completion
from ..core.shaping.merger import CompletionCollector, CompletionStream
from .base import Surface
from .generation import serving

__all__ = ["COMPLETIONS", "CompletionsSurface"]


class CompletionsSurface(Surface):
    name = "completions"
    path = "/v1/completions"

    def prepare(
        self,
        raw: bytes,
        profiles: Mapping[str, ModelProfile],
        *,
        request_id: str,
        created: int,
        model: str | None = None,
    ) -> Prepared:
        req = decode_completion(raw)
        profile = serving(profiles, req, model)
        valid = check_completion(req, profile)
        body = plan_completion(valid, profile, request_id=request_id)
        valid.stop = merge_stops(valid.stop, profile.stop)
        kw: dict[str, Any] = {
            "response_id": f"cmpl-{request_id}",
            "model": req.model,
            "created": created,
        }
        shaper: Any
        if valid.stream:
            shaper = CompletionStream(valid, **kw)
        else:
            shaper = Collected(CompletionCollector(valid, **kw))
        return Prepared(
            model=req.model,
            n=1,
            stream=valid.stream,
            bodies=[body],
            shaper=shaper,
            affinity_key=None,
            prefix_key=prefix_key(valid.prompt),
            fields=RequestFields(prompt="prompt", max_tokens="max_tokens"),
            kind="completion",
        )


#: The one instance.
COMPLETIONS = CompletionsSurface()
