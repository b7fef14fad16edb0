"""``POST /v1/responses``: OpenAI's Responses API, stateless, on the chat path.

The request is decoded strictly and mapped onto a chat request with one candidate
(``request.py``); the chat rules and planning run on it (``surfaces/generation.py``) and a chat
refusal's ``param`` is written back as the Responses path it came from; ``ResponsesShaper``
(``shaper.py``) makes the output items and ``response.*`` events, streamed or whole.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...core.errors import RequestError
from ...core.planning.prepared import Prepared
from ...core.request.profile import ModelProfile
from ...core.request.refusal import RequestFields
from ..base import Surface
from ..generation import plan_chat_request, serving
from .paths import translated
from .request import decode_responses
from .shaper import ResponsesShaper

__all__ = ["RESPONSES", "ResponsesSurface"]


class ResponsesSurface(Surface):
    name = "responses"
    path = "/v1/responses"

    def prepare(
        self,
        raw: bytes,
        profiles: Mapping[str, ModelProfile],
        *,
        request_id: str,
        created: int,
        model: str | None = None,
    ) -> Prepared:
        rreq, req, paths = decode_responses(raw)
        profile = serving(profiles, req, model)
        try:
            p = plan_chat_request(req, profile, request_id=request_id)
        except RequestError as err:
            raise translated(err, paths) from err
        shaper = ResponsesShaper(
            p.valid,
            rreq,
            request_id=request_id,
            model=req.model,
            created=created,
            reasoning_parser=p.reasoning_parser,
            tool_parser=p.tool_parser,
        )
        return Prepared(
            model=req.model,
            n=1,
            stream=p.valid.stream,
            bodies=p.plan.bodies,
            shaper=shaper,
            affinity_key=req.prompt_cache_key,
            prefix_key=p.plan.prefix_key,
            fields=RequestFields(
                prompt="input",
                max_tokens="max_output_tokens",
                grammar="tools"
                if req.response_format is None or req.response_format.type == "text"
                else "text.format",
            ),
        )


#: The one instance.
RESPONSES = ResponsesSurface()
