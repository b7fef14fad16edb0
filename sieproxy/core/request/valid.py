"""Validated requests: what validation hands to planning and to the merger.

Validation (:mod:`sieproxy.core.validate`) produces these; planning (:mod:`sieproxy.core.plan`)
turns them into engine requests; the merger reads the response-shaping options from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["ImageInput", "ValidChat", "ValidCompletion"]


@dataclass(frozen=True, slots=True)
class ImageInput:
    """A decoded ``data:`` image of message ``message_index``, content part ``part_index``."""

    message_index: int
    part_index: int
    mime: str
    data: bytes
    data_uri: str


@dataclass(slots=True)
class ValidChat:
    """A chat request that passed every rule, for one model.

    ``req.messages`` roles are normalized (``developer`` → ``system``). ``candidates`` is the number
    of engine generations (``best_of`` or ``n``); ``n`` is the number of returned choices.
    """

    req: ChatCompletionRequest
    model: str
    n: int
    candidates: int
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: list[str]
    logprobs: bool
    top_logprobs: int
    include_reasoning: bool
    best_of: int | None = None
    images: list[ImageInput] = field(default_factory=list)
    #: ``stream_options.continuous_usage_stats``: the running usage on every chunk.
    continuous_usage: bool = False


@dataclass(slots=True)
class ValidCompletion:
    """A legacy completions request that passed every rule (always one candidate)."""

    req: CompletionRequest
    model: str
    prompt: str
    max_tokens: int
    stream: bool
    stop: list[str]
    #: ``stream_options`` of a streamed request (the usage chunk; the running usage).
    include_usage: bool = False
    continuous_usage: bool = False
