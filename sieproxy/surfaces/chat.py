"""``POST /v1/chat/completions``: OpenAI's chat completions, the gateway's own request shape.

The chat request is the internal generation request (``surfaces/generation.py``), so this
surface maps it as it is: strict decoding and the contract's rules (``core/request/``), the
engine bodies (``core/planning/plan.py``), and ``ChatStream`` / ``ChatCollector``
(``core/shaping/merger.py``) for the streamed and whole output. Ids are
``chatcmpl-<request_id>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.planning.prepared import Collected, Prepared
from ..core.request.profile import ModelProfile
from ..core.request.refusal import RequestFields
from ..core.request.validate import decode_chat
from ..core.shaping.merger import ChatCollector, ChatStream
from .base import Surface
from .generation import plan_chat_request, serving

__all__ = ["CHAT", "ChatSurface"]


class ChatSurface(Surface):
    name = "chat"
    path = "/v1/chat/completions"

    def prepare(
        self,
        raw: bytes,
        profiles: Mapping[str, ModelProfile],
        *,
        request_id: str,
        created: int,
        model: str | None = None,
    ) -> Prepared:
        req = decode_chat(raw)
        profile = serving(profiles, req, model)
        p = plan_chat_request(req, profile, request_id=request_id)
        kw: dict[str, Any] = {
            "response_id": f"chatcmpl-{request_id}",
            "model": req.model,
            "created": created,
            "reasoning_parser": p.reasoning_parser,
            "tool_parser": p.tool_parser,
        }
        shaper: Any
        if p.valid.stream:
            shaper = ChatStream(p.valid, **kw)
        else:
            shaper = Collected(ChatCollector(p.valid, **kw))
        return Prepared(
            model=req.model,
            n=p.valid.n,
            stream=p.valid.stream,
            bodies=p.plan.bodies,
            shaper=shaper,
            affinity_key=req.routing_key or req.prompt_cache_key,
            prefix_key=p.plan.prefix_key,
            fields=RequestFields(
                prompt="messages",
                max_tokens="max_completion_tokens"
                if req.max_completion_tokens is not None
                else "max_tokens",
                grammar="tools"
                if req.response_format is None or req.response_format.type == "text"
                else "response_format",
            ),
        )


#: The one instance.
CHAT = ChatSurface()
