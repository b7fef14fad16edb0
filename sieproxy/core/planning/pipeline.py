"""From request bytes to everything the shell needs to run a generation request.

``build_chat`` / ``build_completion`` / ``build_responses`` chain the sans-IO stages — decode and
validate, find the model (404), check the model-dependent rules, plan the engine requests, and
build the response shaper (a stream or a collector) with one fresh tool/reasoning parser per
choice. The shell only adds I/O: routing, the engine calls, the writes. ``model`` plans the same
request for another model than the one it names (a fallback), whose name the response carries.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .affinity import prefix_key
from ..request.aliases import resolve_alias
from ..errors import GatewayError, NotFound, RequestError
from ..shaping.events import CandidateDelta, CandidateFinish, ReasoningParser, ToolCallParser
from ..shaping.merger import ChatCollector, ChatStream, CompletionCollector, CompletionStream
from ...surfaces.messages.request import decode_count_tokens, decode_messages, for_model
from ...surfaces.messages.request import translated as messages_translated
from ...surfaces.messages.shaper import CountShaper, MessagesShaper
from ..upstream.openai_chat import plan_engine_chat
from .plan import ChatPlan, merge_stops, plan_chat, plan_completion
from ..request.profile import ModelProfile
from ..shaping.reasoning import make_reasoning_parser
from ..request.refusal import RequestFields
from ..request.valid import ValidChat
from ...surfaces.responses.request import decode_responses, translated
from ...surfaces.responses.shaper import ResponsesShaper
from ..request.schemas import ChatCompletionRequest, CompletionRequest
from ..shaping.toolparse import make_tool_parser
from ..request.validate import check_chat, check_completion, decode_chat, decode_completion

__all__ = [
    "Prepared",
    "build_chat",
    "build_completion",
    "build_count_tokens",
    "build_messages",
    "build_responses",
    "find_profile",
]


class _Collected:
    """Adapts a collector to the stream interface the shell drives (one body at the end)."""

    def __init__(self, collector: ChatCollector | CompletionCollector) -> None:
        self.collector = collector
        self.choices = collector.choices
        self.ends = collector.ends

    def start(self) -> bytes:
        return b""

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes:
        self.collector.on_delta(index, delta)
        return b""

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes:
        self.collector.on_finish(index, finish)
        return b""

    def on_error(self, err: GatewayError) -> bytes:  # never after a non-streaming start
        raise err

    def end(self) -> bytes:
        return self.collector.result()


@dataclass(slots=True)
class Prepared:
    """A validated, planned request: engine bodies and the response shaper."""

    model: str
    n: int
    stream: bool
    bodies: list[dict[str, Any]]
    shaper: Any  # ChatStream | CompletionStream | _Collected
    affinity_key: str | None
    #: The prompt's prefix-affinity key, used when ``affinity_key`` is None (model routing
    #: ``prefix``).
    prefix_key: str | None = None
    #: The request's names for what an engine may refuse (``core.refusal.explain``).
    fields: RequestFields = field(default_factory=RequestFields)

    def usage(self) -> tuple[int, int]:
        """(prompt tokens once, completion tokens summed) over what the engines reported."""
        choices = self.shaper.choices
        prompt = max((c.prompt_tokens for c in choices), default=0)
        return prompt, sum(c.completion_tokens for c in choices)


def find_profile(profiles: Mapping[str, ModelProfile], model: str) -> ModelProfile:
    """The served model ``model`` (or the one it is an alias of: ``core.aliases``), or 404
    ``model_not_found`` naming ``param: "model"``."""
    profile = profiles.get(model) or resolve_alias(profiles, model)
    if profile is None:
        raise NotFound(
            f"The model {model!r} does not exist; GET /v1/models lists the served models.",
            param="model",
            code="model_not_found",
        )
    return profile


def _serving(
    profiles: Mapping[str, ModelProfile],
    req: ChatCompletionRequest | CompletionRequest,
    model: str | None,
) -> ModelProfile:
    """The profile of the model that serves ``req``: ``model`` when a fallback serves it (the
    response then names it), else the one the request names (404 when unknown)."""
    if model is not None:
        req.model = model
    profile = find_profile(profiles, req.model)
    req.model = profile.name  # an alias names the served model from here on
    return profile


def _parsers(
    req: ChatCompletionRequest, plan: ChatPlan, request_id: str
) -> tuple[Callable[[], ToolCallParser] | None, Callable[[], ReasoningParser] | None]:
    """Factories of one fresh tool-call and reasoning parser per choice (None: not used)."""
    tool_names = [t.function.name for t in req.tools or []]
    counter = itertools.count()
    tool_factory: Callable[[], ToolCallParser] | None = None
    if plan.tool_parser is not None:
        name = plan.tool_parser

        def tool_factory() -> ToolCallParser:
            p = make_tool_parser(name, tool_names=tool_names, seed=f"{request_id}-{next(counter)}")
            assert p is not None
            return p

    reasoning_factory: Callable[[], ReasoningParser] | None = None
    if plan.reasoning_parser is not None:
        rname = plan.reasoning_parser
        ctk = req.chat_template_kwargs
        thinking = ctk.enable_thinking if ctk is not None else None

        def reasoning_factory() -> ReasoningParser:
            p = make_reasoning_parser(rname, enable_thinking=thinking)
            assert p is not None
            return p

    return tool_factory, reasoning_factory


def _plan(valid: ValidChat, profile: ModelProfile, request_id: str) -> ChatPlan:
    """The chat plan in the model's rendering mode (``ModelProfile.render``)."""
    if profile.render == "engine":
        return plan_engine_chat(valid, profile, request_id=request_id)
    return plan_chat(valid, profile, request_id=request_id)


def build_chat(
    raw: bytes,
    profiles: Mapping[str, ModelProfile],
    *,
    request_id: str,
    created: int,
    model: str | None = None,
) -> Prepared:
    req = decode_chat(raw)
    profile = _serving(profiles, req, model)
    valid = check_chat(req, profile)
    plan = _plan(valid, profile, request_id)
    valid.stop = merge_stops(valid.stop, profile.stop)

    tool_factory, reasoning_factory = _parsers(req, plan, request_id)
    kw: dict[str, Any] = {
        "response_id": f"chatcmpl-{request_id}",
        "model": req.model,
        "created": created,
        "reasoning_parser": reasoning_factory,
        "tool_parser": tool_factory,
    }
    shaper: Any
    if valid.stream:
        shaper = ChatStream(valid, **kw)
    else:
        collector = ChatCollector(valid, **kw)
        shaper = _Collected(collector)
    return Prepared(
        model=req.model,
        n=valid.n,
        stream=valid.stream,
        bodies=plan.bodies,
        shaper=shaper,
        affinity_key=req.routing_key or req.prompt_cache_key,
        prefix_key=plan.prefix_key,
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


def build_completion(
    raw: bytes,
    profiles: Mapping[str, ModelProfile],
    *,
    request_id: str,
    created: int,
    model: str | None = None,
) -> Prepared:
    req = decode_completion(raw)
    profile = _serving(profiles, req, model)
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
        shaper = _Collected(CompletionCollector(valid, **kw))
    return Prepared(
        model=req.model,
        n=1,
        stream=valid.stream,
        bodies=[body],
        shaper=shaper,
        affinity_key=None,
        prefix_key=prefix_key(valid.prompt),
        fields=RequestFields(prompt="prompt", max_tokens="max_tokens"),
    )


def build_responses(
    raw: bytes,
    profiles: Mapping[str, ModelProfile],
    *,
    request_id: str,
    created: int,
    model: str | None = None,
) -> Prepared:
    """``POST /v1/responses``: the chat path with one candidate (``core.responses``), shaped by
    :class:`ResponsesShaper`."""
    rreq, req, paths = decode_responses(raw)
    profile = _serving(profiles, req, model)
    try:
        valid = check_chat(req, profile)
    except RequestError as err:
        raise translated(err, paths) from err
    plan = _plan(valid, profile, request_id)
    valid.stop = merge_stops(valid.stop, profile.stop)
    tool_factory, reasoning_factory = _parsers(req, plan, request_id)
    shaper = ResponsesShaper(
        valid,
        rreq,
        request_id=request_id,
        model=req.model,
        created=created,
        reasoning_parser=reasoning_factory,
        tool_parser=tool_factory,
    )
    return Prepared(
        model=req.model,
        n=1,
        stream=valid.stream,
        bodies=plan.bodies,
        shaper=shaper,
        affinity_key=req.prompt_cache_key,
        prefix_key=plan.prefix_key,
        fields=RequestFields(
            prompt="input",
            max_tokens="max_output_tokens",
            grammar="tools" if req.response_format is None or req.response_format.type == "text"
            else "text.format",
        ),
    )


def build_messages(
    raw: bytes,
    profiles: Mapping[str, ModelProfile],
    *,
    request_id: str,
    created: int,
    model: str | None = None,
) -> Prepared:
    """``POST /v1/messages``: the chat path with one candidate (``core.messages``), shaped by
    :class:`MessagesShaper`."""
    mreq, req, paths = decode_messages(raw)
    profile = _serving(profiles, req, model)
    capped = for_model(mreq, req, profile)
    try:
        valid = check_chat(req, profile)
    except RequestError as err:
        raise messages_translated(err, paths) from err
    plan = _plan(valid, profile, request_id)
    if capped:  # up to the context's end (``core.messages.for_model``)
        for body in plan.bodies:
            if "chat" in body:  # the engine renders (``core.openai_chat``): no max_tokens
                body["chat"].pop("max_tokens", None)
            else:
                body["sampling_params"]["max_new_tokens"] = None
    valid.stop = merge_stops(valid.stop, profile.stop)
    tool_factory, reasoning_factory = _parsers(req, plan, request_id)
    shaper = MessagesShaper(
        valid,
        request_id=request_id,
        model=req.model,
        stop_sequences=mreq.stop_sequences,
        reasoning_parser=reasoning_factory,
        tool_parser=tool_factory,
    )
    return Prepared(
        model=req.model,
        n=1,
        stream=valid.stream,
        bodies=plan.bodies,
        shaper=shaper,
        affinity_key=None,
        prefix_key=plan.prefix_key,
        fields=RequestFields(
            prompt="messages",
            max_tokens="max_tokens",
            grammar="tools" if req.response_format is None else "output_config.format",
        ),
    )


def build_count_tokens(
    raw: bytes,
    profiles: Mapping[str, ModelProfile],
    *,
    request_id: str,
    created: int,
    model: str | None = None,
) -> Prepared:
    """``POST /v1/messages/count_tokens``: the Messages prompt rendered as for a generation,
    sent to the engine with ``max_new_tokens: 0`` (prefill only: the engine's tokenizer counts
    it), answered by :class:`CountShaper`."""
    mreq, req, paths = decode_count_tokens(raw)
    profile = _serving(profiles, req, model)
    for_model(mreq, req, profile)
    try:
        valid = check_chat(req, profile)
    except RequestError as err:
        raise messages_translated(err, paths) from err
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
