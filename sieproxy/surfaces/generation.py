"""The internal generation request: a chat request, validated and planned for a model.

The chat request (``core/request/schemas.py``) is the gateway's internal generation request:
surfaces that speak another shape (Responses, Messages) map onto it and share its planning
here — the model that serves it, the chat rules, the engine bodies, and one fresh tool-call and
reasoning parser per choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.planning.plan import ChatPlan, merge_stops, plan_chat
from ..core.planning.prepared import find_profile
from ..core.request.profile import ModelProfile
from ..core.request.schemas import ChatCompletionRequest, CompletionRequest
from ..core.request.valid import ValidChat
from ..core.request.validate import check_chat
from ..core.shaping.events import ReasoningParser, ToolCallParser
from ..core.shaping.reasoning import make_reasoning_parser
from ..core.shaping.toolparse import make_tool_parser
from ..core.upstream.openai_chat import plan_engine_chat

__all__ = ["PlannedChat", "plan_chat_request", "serving"]


def serving(
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


@dataclass(slots=True)
class PlannedChat:
    """A chat request checked against its model and planned: the valid request, the engine
    bodies, and factories of one fresh parser per choice (None: not used)."""

    valid: ValidChat
    plan: ChatPlan
    tool_parser: Callable[[], ToolCallParser] | None
    reasoning_parser: Callable[[], ReasoningParser] | None


def _parsers(
    req: ChatCompletionRequest, plan: ChatPlan, request_id: str
) -> tuple[Callable[[], ToolCallParser] | None, Callable[[], ReasoningParser] | None]:
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


def plan_chat_request(
    req: ChatCompletionRequest, profile: ModelProfile, *, request_id: str
) -> PlannedChat:
    """Check ``req`` against ``profile`` (400s naming chat's fields), plan its engine bodies,
    and add the model's own stop strings to what the shaper watches for."""
    valid = check_chat(req, profile)
    if profile.render == "engine":  # the engine renders it (``core/upstream/openai_chat.py``)
        plan = plan_engine_chat(valid, profile, request_id=request_id)
    else:
        plan = plan_chat(valid, profile, request_id=request_id)
    valid.stop = merge_stops(valid.stop, profile.stop)
    tool_factory, reasoning_factory = _parsers(req, plan, request_id)
    return PlannedChat(valid, plan, tool_factory, reasoning_factory)
