"""One choice's pipeline and state: candidate deltas in, visible :class:`ChoiceDelta` out.

Theory of operation
-------------------
Each candidate's text runs through a fixed pipeline::

    CandidateDelta.text ─▶ StopMatcher ─▶ ReasoningParser? ─▶ ToolCallParser? ─▶ ChoiceDelta

- The stop matcher holds back any tail that could start a stop string and cuts the text at the
  first stop to complete. When it matches, the choice moves to ``STOPPED`` and announces
  ``(index, "stop")`` in the shaper's ``ends``: the shell ends and aborts the upstream
  candidate; deltas still in flight are ignored, and the finish reason becomes ``stop``
  whatever the engine reports afterwards (usually an ``abort`` without status, caused by the
  gateway's own abort).
- The reasoning parser splits reasoning from content. With ``include_reasoning`` false the
  reasoning is dropped (the engine still counts its tokens in ``completion_tokens``).
- The tool-call parser turns content into plain content plus tool-call deltas.
- An engine that parsed its output itself (``core.openai_chat``) sends reasoning and tool-call
  fragments beside the text (``CandidateDelta.reasoning`` / ``tool_calls``): they join what the
  parsers (then absent) would have produced, shown or hidden by the same rules.
- Logprobs wait in ``pending`` until the pipeline produces visible output, and ride on that
  delta. If a delta produced only *hidden* reasoning (or nothing, right after hidden
  reasoning, e.g. a closing tag), its pending logprobs are dropped, so private reasoning does
  not leak through token logprobs. (Attribution is per engine chunk, not per token: a chunk
  that crosses the reasoning/content boundary keeps all its logprobs.)
- :meth:`ChoiceState.finish` flushes every stage in order and maps the finish reason.

A streamed choice with no stop string, no parser and no logprobs waiting (the common case) skips
the pipeline: each stage would return its input unchanged, so ``feed`` returns the delta's text
as it is, without a call per stage.

The cumulative logprob (the best_of score) sums *every* chosen-token logprob the engine reports
before a stop match, visible or not.

State table (``event`` × ``phase`` → ``phase``; anything else is illegal, raises
:class:`ChoiceStateError` and leaves the choice ``FAILED``)::

    OPEN     + DELTA      → OPEN
    OPEN     + STOP_MATCH → STOPPED
    OPEN     + FINISH     → FINISHED
    OPEN     + FAIL       → FAILED
    STOPPED  + DELTA      → STOPPED      (in-flight output after the gateway's stop: ignored)
    STOPPED  + FINISH     → FINISHED
    STOPPED  + FAIL       → FAILED

Finish mapping to OpenAI: engine ``length`` with the output ending inside a call (the tool
parser's ``truncated``: arguments cut mid-JSON, or a call list left open) → ``length``; else any
tool-call delta produced → ``tool_calls`` (also when ``length`` came after complete calls);
gateway stop match → ``stop``; engine ``stop``/``length`` pass through; anything else
(``abort`` without a status, unknown types) → ``stop``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InternalError
from .events import (
    CandidateDelta,
    CandidateFinish,
    ChoiceDelta,
    ReasoningParser,
    TokenLogprob,
    ToolCallDelta,
    ToolCallParser,
)
from .stopstr import StopMatcher

__all__ = [
    "ChoiceEvent",
    "ChoicePhase",
    "ChoiceState",
    "ChoiceStateError",
    "CompleteToolCall",
    "ReasoningFactory",
    "ToolCallFactory",
    "openai_finish_reason",
]

ReasoningFactory = Callable[[], ReasoningParser]
ToolCallFactory = Callable[[], ToolCallParser]


class ChoicePhase(enum.Enum):
    __hash__ = object.__hash__  # Enum hashes by name in Python: slow in a hot table

    OPEN = "open"
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"


class ChoiceEvent(enum.Enum):
    __hash__ = object.__hash__  # Enum hashes by name in Python: slow in a hot table

    DELTA = "delta"
    STOP_MATCH = "stop_match"
    FINISH = "finish"
    FAIL = "fail"


_P, _E = ChoicePhase, ChoiceEvent
_TRANSITIONS: dict[tuple[ChoicePhase, ChoiceEvent], ChoicePhase] = {
    (_P.OPEN, _E.DELTA): _P.OPEN,
    (_P.OPEN, _E.STOP_MATCH): _P.STOPPED,
    (_P.OPEN, _E.FINISH): _P.FINISHED,
    (_P.OPEN, _E.FAIL): _P.FAILED,
    (_P.STOPPED, _E.DELTA): _P.STOPPED,
    (_P.STOPPED, _E.FINISH): _P.FINISHED,
    (_P.STOPPED, _E.FAIL): _P.FAILED,
}


class ChoiceStateError(InternalError):
    """An event arrived that the choice's state does not allow (a gateway bug)."""


@dataclass(slots=True)
class CompleteToolCall:
    """A tool call assembled from its deltas (for non-streaming bodies)."""

    index: int
    id: str | None = None
    name: str = ""
    arguments_parts: list[str] = field(default_factory=list)

    @property
    def arguments(self) -> str:
        return "".join(self.arguments_parts)


def openai_finish_reason(
    engine_reason: str, *, stop_matched: bool, tool_calls: bool, call_cut: bool = False
) -> str:
    """Map an engine finish reason to OpenAI's chat vocabulary (see the module docstring)."""
    if call_cut and engine_reason == "length" and not stop_matched:
        return "length"
    if tool_calls:
        return "tool_calls"
    if stop_matched:
        return "stop"
    if engine_reason in ("stop", "length"):
        return engine_reason
    return "stop"


class ChoiceState:
    """The pipeline and accounting of one choice (one candidate)."""

    __slots__ = (
        "_calls",
        "_content",
        "_hiding",
        "_pending",
        "_reasoning",
        "_reasoning_text",
        "_stop",
        "_tools",
        "cached_tokens",
        "collect",
        "completion_tokens",
        "cumulative_logprob",
        "ends",
        "engine_reason",
        "finish_reason",
        "include_reasoning",
        "index",
        "logprobs",
        "phase",
        "plain",
        "prompt_tokens",
        "reasoning_tokens",
        "saw_tool_call",
        "stop_matched",
        "want_logprobs",
    )

    def __init__(
        self,
        index: int,
        *,
        stops: list[str] | None = None,
        reasoning: ReasoningFactory | None = None,
        tools: ToolCallFactory | None = None,
        include_reasoning: bool = False,
        logprobs: bool = False,
        collect: bool = True,
        ends: list[tuple[int, str]] | None = None,
    ) -> None:
        self.index = index
        #: Where the choice announces that its candidate must end (the shaper's ``ends``).
        self.ends = ends
        self.phase = ChoicePhase.OPEN
        self.include_reasoning = include_reasoning
        self.want_logprobs = logprobs
        self.collect = collect  # keep the text for a non-streaming body
        self._stop = StopMatcher(stops or [])
        self._reasoning = reasoning() if reasoning is not None else None
        self._tools = tools() if tools is not None else None
        #: Every stage passes text through unchanged (see the module docstring; read by the
        #: express lane, ``core.upstream.sglang``).
        self.plain = not (self._stop.stops or reasoning or tools or collect)
        self._pending: list[TokenLogprob] = []
        self._hiding = False  # the last output was hidden reasoning
        self._content: list[str] = []
        self._reasoning_text: list[str] = []
        self._calls: dict[int, CompleteToolCall] = {}
        self.saw_tool_call = False
        self.logprobs: list[TokenLogprob] = []
        self.cumulative_logprob = 0.0
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.reasoning_tokens = 0
        #: The gateway matched a stop string (announced in ``ends`` as ``(index, "stop")``: the
        #: shell ends the upstream candidate).
        self.stop_matched = False
        self.engine_reason: str | None = None
        self.finish_reason: str | None = None

    # ------------------------------------------------------------------ state

    def _to(self, event: ChoiceEvent) -> None:
        nxt = _TRANSITIONS.get((self.phase, event))
        if nxt is None:
            old, self.phase = self.phase, ChoicePhase.FAILED
            raise ChoiceStateError(
                f"Internal error: choice {self.index} got {event.value} while {old.value}."
            )
        self.phase = nxt

    @property
    def finished(self) -> bool:
        return self.phase is ChoicePhase.FINISHED

    @property
    def stop_string(self) -> str | None:
        """The stop string the gateway matched (None: none matched)."""
        return self._stop.matched

    # ------------------------------------------------------------------ events

    def feed(self, delta: CandidateDelta) -> ChoiceDelta:
        """Run one candidate delta through the pipeline; return what becomes visible."""
        if self.phase is not ChoicePhase.OPEN:  # OPEN stays OPEN: no table lookup per token
            self._to(ChoiceEvent.DELTA)
        if delta.completion_tokens > self.completion_tokens:
            self.completion_tokens = delta.completion_tokens
        self.prompt_tokens = delta.prompt_tokens  # (the finish's, once it comes)
        if self.phase is ChoicePhase.STOPPED:
            return ChoiceDelta()
        for lp in delta.logprobs:
            self.cumulative_logprob += lp.logprob
        if self.want_logprobs:
            self._pending.extend(delta.logprobs)
        if self.plain and not self._pending and not (delta.tool_calls or delta.reasoning):
            return ChoiceDelta(delta.text)
        safe, matched = self._stop.feed(delta.text)
        out = self._process(safe, final=False, parsed=delta)
        if matched:
            self.stop_matched = True
            self._to(ChoiceEvent.STOP_MATCH)
            if self.ends is not None:
                self.ends.append((self.index, "stop"))
        return out

    def finish(self, fin: CandidateFinish) -> ChoiceDelta:
        """The candidate ended: flush every stage, record usage and the finish reason."""
        self._to(ChoiceEvent.FINISH)
        out = self._process(self._stop.flush(), final=True)
        if self._pending:  # logprobs whose text never became visible: attach them last
            out.logprobs.extend(self._pending)
            if self.collect:
                self.logprobs.extend(self._pending)
            self._pending = []
        self.engine_reason = fin.reason
        self.prompt_tokens = fin.prompt_tokens
        self.cached_tokens = fin.cached_tokens
        self.reasoning_tokens = fin.reasoning_tokens
        self.completion_tokens = max(self.completion_tokens, fin.completion_tokens)
        self.finish_reason = openai_finish_reason(
            fin.reason,
            stop_matched=self.stop_matched,
            tool_calls=self.saw_tool_call,
            call_cut=self._tools is not None and self._tools.truncated,
        )
        return out

    def fail(self) -> None:
        """The request failed while this choice was open."""
        self._to(ChoiceEvent.FAIL)

    # ------------------------------------------------------------------ pipeline

    def _process(
        self, text: str, *, final: bool, parsed: CandidateDelta | None = None
    ) -> ChoiceDelta:
        """``text`` through the parsers; ``parsed``: what the engine parsed itself (its
        reasoning and tool calls, which go before the text's)."""
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text) if text else ("", "")
            if final:
                r2, c2 = self._reasoning.flush()
                reasoning += r2
                content += c2
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content) if content else ("", [])
            if final:
                c2, t2 = self._tools.flush()
                content += c2
                calls = calls + t2
        if parsed is not None and (parsed.reasoning or parsed.tool_calls):
            reasoning = parsed.reasoning + reasoning
            calls = parsed.tool_calls + calls
        hidden = bool(reasoning) and not self.include_reasoning
        if hidden:
            reasoning = ""
        out = ChoiceDelta(content=content, reasoning=reasoning, tool_calls=calls)
        if calls:
            self.saw_tool_call = True
        if self.collect:
            self._collect(content, reasoning, calls)
        visible = bool(content or reasoning or calls)
        if visible:
            self._hiding = False
        elif hidden:
            self._hiding = True
        if self._pending:
            if visible:
                out.logprobs = self._pending
                if self.collect:
                    self.logprobs.extend(self._pending)
                self._pending = []
            elif self._hiding:
                self._pending = []
        return out

    def _collect(self, content: str, reasoning: str, calls: list[ToolCallDelta]) -> None:
        if content:
            self._content.append(content)
        if reasoning:
            self._reasoning_text.append(reasoning)
        for c in calls:
            call = self._calls.get(c.index)
            if call is None:
                call = self._calls[c.index] = CompleteToolCall(c.index)
            if c.id is not None:
                call.id = c.id
            if c.name is not None:
                call.name = c.name
            if c.arguments:
                call.arguments_parts.append(c.arguments)

    # ------------------------------------------------------------------ results

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning_text)

    @property
    def tool_calls(self) -> list[CompleteToolCall]:
        return [self._calls[k] for k in sorted(self._calls)]
