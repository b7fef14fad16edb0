"""Typed values that flow between the core's stages.

    engine chunk (dict) ──a protocol reader (core.protocol)──▶ CandidateDelta / CandidateFinish
        ──choice pipeline (stop strings ▸ reasoning ▸ tools)──▶ ChoiceDelta
        ──merger──▶ encoded SSE frames / a final body

The parsers of the chat-semantics layer implement :class:`ReasoningParser` and
:class:`ToolCallParser`; the choice pipeline only knows these two protocols.

The values are msgspec ``Struct`` classes, not dataclasses: one or two are made per relayed token,
and a ``Struct`` is built in C (about a quarter of a dataclass's cost with list defaults, which
msgspec copies per instance as a ``default_factory`` would). They are never encoded as such.
"""

from __future__ import annotations

from typing import Protocol

from msgspec import Struct

__all__ = [
    "CandidateDelta",
    "CandidateFinish",
    "ChoiceDelta",
    "ReasoningParser",
    "TokenLogprob",
    "ToolCallDelta",
    "ToolCallParser",
    "TopLogprob",
]


# The events are plain data (strings, numbers, lists of other events): they can never be part
# of a reference cycle, so the cycle collector does not track them (``gc=False``). A relayed
# token creates a few of them; tracked, each one would be linked into the collector's young
# generation when made and unlinked when freed (the lists inside them still are).


class TopLogprob(Struct, gc=False):
    token: str
    token_id: int
    logprob: float


class TokenLogprob(Struct, gc=False):
    """One generated token's logprob, with its top alternatives (``top`` empty if not asked)."""

    token: str
    token_id: int
    logprob: float
    top: list[TopLogprob] = []


class CandidateDelta(Struct, gc=False):
    """New output of one candidate since its previous delta (already de-cumulated)."""

    text: str
    completion_tokens: int  # cumulative count reported by the engine
    logprobs: list[TokenLogprob] = []
    #: The prompt's tokens as the engine reported them with this output (0: not reported), so
    #: a candidate that never finishes (its client left, an error) still counts its prompt.
    prompt_tokens: int = 0
    #: Output the engine parsed itself (an engine that renders and parses, ``core.openai_chat``):
    #: reasoning, and tool-call fragments; ``text`` is then the content only.
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = []


class CandidateFinish(Struct, gc=False):
    """The terminal state of one candidate as the engine reported it.

    ``reason`` is SGLang's ``finish_reason.type`` passed through (``stop``, ``length``, ``abort``
    or anything newer); mapping to OpenAI's vocabulary is the merger's job.
    """

    reason: str
    matched: str | int | list[int] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


class ToolCallDelta(Struct, gc=False):
    """One OpenAI tool-call delta fragment: ``id`` and ``name`` only on a call's first one."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ChoiceDelta(Struct, gc=False):
    """What one choice adds to the response: visible text, reasoning, tool-call fragments."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = []
    logprobs: list[TokenLogprob] = []

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)


class ReasoningParser(Protocol):
    """Splits a choice's text into reasoning and content, incrementally.

    ``feed`` may hold back text that could be the start of a tag; ``flush`` releases it at the end.
    Both return ``(reasoning, content)``.
    """

    def feed(self, text: str) -> tuple[str, str]: ...

    def flush(self) -> tuple[str, str]: ...


class ToolCallParser(Protocol):
    """Turns a choice's content into plain content and tool-call deltas, incrementally.

    ``feed``/``flush`` return ``(content, deltas)``; ``calls`` counts the calls started so far;
    ``truncated`` (read after ``flush``) says the output ended inside a call.
    """

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]: ...

    def flush(self) -> tuple[str, list[ToolCallDelta]]: ...

    @property
    def calls(self) -> int: ...

    @property
    def truncated(self) -> bool: ...
