"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API on the
chat path, for Claude Code and the ``anthropic`` SDKs.

The request is decoded strictly and mapped onto a chat request with one candidate
(``request.py``); the chat rules and planning run on it (``surfaces/generation.py``) and a chat
refusal's ``param`` is written back as the Messages path it came from. ``MessagesShaper``
(``shaper.py``) makes the content blocks and the ``message_*`` / ``content_block_*`` events,
streamed or whole; errors use Anthropic's envelope (``errors.py``), and an ``x-api-key`` header
carries the key. ``count_tokens`` renders the same prompt and has the engine prefill it with no
output (its tokenizer counts it: ``count.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ...core.errors import GatewayError, RequestError
from ...core.planning.plan import plan_chat
from ...core.planning.prepared import Prepared
from ...core.request.profile import ModelProfile
from ...core.request.refusal import RequestFields
from ...core.request.validate import check_chat
from ..base import ErrorAnswer, Surface
from ..generation import plan_chat_request, serving
from .count import CountShaper
from .errors import error_reply
from .paths import translated
from .request import decode_count_tokens, decode_messages, for_model
from .shaper import MessagesShaper

__all__ = ["COUNT_TOKENS", "MESSAGES", "CountTokensSurface", "MessagesSurface"]


class _Anthropic(Surface):
    """What both Messages routes share: the key header and the error envelope."""

    key_headers = (b"x-api-key",)

    def error(self, err: GatewayError) -> ErrorAnswer:
        return error_reply(err)


class MessagesSurface(_Anthropic):
    name = "messages"
    path = "/v1/messages"

    def prepare(
        self,
        raw: bytes,
        profiles: Mapping[str, ModelProfile],
        *,
        request_id: str,
        created: int,
        model: str | None = None,
    ) -> Prepared:
        mreq, req, paths = decode_messages(raw)
        profile = serving(profiles, req, model)
        capped = for_model(mreq, req, profile)
        try:
            p = plan_chat_request(req, profile, request_id=request_id)
        except RequestError as err:
            raise translated(err, paths) from err
        if capped:  # up to the context's end (``request.for_model``)
            for body in p.plan.bodies:
                if "chat" in body:  # the engine renders it: no max_tokens
                    body["chat"].pop("max_tokens", None)
                else:
                    body["sampling_params"]["max_new_tokens"] = None
        shaper = MessagesShaper(
            p.valid,
            request_id=request_id,
            model=req.model,
            stop_sequences=mreq.stop_sequences,
            reasoning_parser=p.reasoning_parser,
            tool_parser=p.tool_parser,
        )
        return Prepared(
            model=req.model,
            n=1,
            stream=p.valid.stream,
            bodies=p.plan.bodies,
            shaper=shaper,
            affinity_key=None,
            prefix_key=p.plan.prefix_key,
            fields=RequestFields(
                prompt="messages",
                max_tokens="max_tokens",
                grammar="tools" if req.response_format is None else "output_config.format",
            ),
        )


class CountTokensSurface(_Anthropic):
    name = "count_tokens"
    path = "/v1/messages/count_tokens"

    def prepare(
        self,
        raw: bytes,
        profiles: Mapping[str, ModelProfile],
        *,
        request_id: str,
        created: int,
        model: str | None = None,
    ) -> Prepared:
        mreq, req, paths = decode_count_tokens(raw)
        profile = serving(profiles, req, model)
        for_model(mreq, req, profile)
        try:
            valid = check_chat(req, profile)
        except RequestError as err:
            raise translated(err, paths) from err
        plan = plan_chat(valid, profile, request_id=request_id)
        [body] = plan.bodies
        body["sampling_params"] = {"max_new_tokens": 0}
        return Prepared(
            model=req.model,
            n=1,
            stream=False,
            bodies=[body],
            shaper=CountShaper(),
            affinity_key=None,
            prefix_key=plan.prefix_key,
            fields=RequestFields(prompt="messages", max_tokens="max_tokens"),
        )


#: The one instance of each.
MESSAGES = MessagesSurface()
COUNT_TOKENS = CountTokensSurface()
