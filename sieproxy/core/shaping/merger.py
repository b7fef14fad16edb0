"""Response builders: candidate events in, SSE frames or a final JSON body out.

Theory of operation
-------------------
The shell reads each candidate's engine stream with its protocol's reader (:mod:`~.protocol`)
and hands the resulting events, in arrival order, to one builder per request:

- :class:`ChatStream` / :class:`CompletionStream` return encoded SSE bytes for each event;
- :class:`ChatCollector` / :class:`CompletionCollector` accumulate and build one body at the end.

Each choice owns a :class:`~.choice.ChoiceState` (stop strings ▸ reasoning ▸ tool calls). The
builders only shape output, and guarantee the order contract of ``spec/README.md``::

    start()        role chunk for every index 0..n-1, in order          (chat only)
    on_delta(i)    zero or more content / reasoning / tool-call chunks of choice i
    on_finish(i)   flushed tail of choice i, then its closure chunk with finish_reason, once
    end()          usage chunk (include_usage), then data: [DONE]

With ``stream_options.continuous_usage_stats`` (an SIE extension, vLLM's name) every chunk
carries ``usage``: the running counts (prompt once, completion tokens so far summed over the
choices), the final usage chunk unchanged.
    on_error(e)    data: {"error": envelope}, then data: [DONE]      (instead of end())

The stream's own state table (anything else raises :class:`MergerError`, and the builder is
then ``CLOSED``)::

    NEW       + start            → STREAMING
    STREAMING + delta / finish   → STREAMING
    STREAMING + end              → CLOSED    (every choice must have finished)
    NEW       + error            → CLOSED
    STREAMING + error            → CLOSED

Hot path: the chunk envelope (``id``, ``object``, ``created``, ``model``) is encoded once into a
byte prefix; each chunk encodes only its one choice Struct with a module-level msgspec encoder,
``encode_into`` the frame buffer. Non-streaming text is joined once, at the end.

Usage: ``prompt_tokens`` once per request (every candidate shares the prompt), the completion
tokens of the *returned* choices summed (reasoning included, shown or not), total = the sum;
``prompt_tokens_details.cached_tokens`` the engine's ``cached_tokens``, once: the least any
returned candidate reported.

best_of (non-streaming only): every candidate is collected; after each event the collector
announces in ``ends`` the unfinished candidates that can no longer be returned
(:meth:`ChatCollector.losers`, ``(index, "best_of")``) so the shell can abort them; the result
keeps the top ``n`` by cumulative logprob, re-indexed ``0..n-1``, and carries logprobs only if
the client asked for them. A candidate that finishes with text but without a single logprob
(an engine that accepts ``logprobs`` and returns none, as some OpenAI-compatible servers do)
cannot be ranked: :meth:`ChatCollector.on_finish` raises the client's 400 naming ``best_of``
(``core.refusal.best_of_without_logprobs``) rather than rank unscored candidates by chance.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec
from msgspec import UNSET, Struct, UnsetType

from ..errors import GatewayError, InternalError
from ..request.refusal import best_of_without_logprobs
from ..request.valid import ValidChat, ValidCompletion
from ..upstream.sse import DONE_FRAME
from . import bestof
from .choice import ChoiceState, ChoiceStateError, ReasoningFactory, ToolCallFactory
from .events import CandidateDelta, CandidateFinish, ChoiceDelta, ToolCallDelta
from .logprobs import LogprobContent, content_entries

__all__ = [
    "ChatCollector",
    "ChatStream",
    "CompletionCollector",
    "CompletionStream",
    "MergerError",
    "StreamPhase",
    "StreamShaper",
    "Usage",
]

_enc = msgspec.json.Encoder()


class MergerError(InternalError):
    """The shell drove a builder out of order (a gateway bug)."""


# ---------------------------------------------------------------- wire Structs (key order = wire)


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Fn(Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class _ToolCallChunk(Struct, kw_only=True):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: _Fn


class _Delta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[_ToolCallChunk] | UnsetType = UNSET


class _Logprobs(Struct):
    content: list[LogprobContent]


class _ChunkChoice(Struct):
    index: int
    delta: _Delta
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None


class _TextChunkChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None


class _Function(Struct):
    name: str
    arguments: str


class _ToolCall(Struct, kw_only=True):
    id: str
    type: str = "function"
    function: _Function


class _Message(Struct):
    role: str
    content: str
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[_ToolCall] | UnsetType = UNSET


class _Choice(Struct):
    index: int
    message: _Message
    logprobs: _Logprobs | None
    finish_reason: str


class _ChatCompletion(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]
    usage: Usage


class _TextCompletion(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[_TextChunkChoice]
    usage: Usage


_ROLE_DELTA = _Delta(role="assistant", content="")
_EMPTY_DELTA = _Delta()


def _usage(states: Sequence[ChoiceState], returned: Sequence[ChoiceState]) -> Usage:
    prompt = max((s.prompt_tokens for s in states), default=0)
    completion = sum(s.completion_tokens for s in returned)
    # The prompt is counted once, so are its cached tokens: what every returned candidate found
    # cached (the candidates of one request may also reuse each other's prefix; not counted).
    cached = min((s.cached_tokens for s in returned), default=0)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(min(cached, prompt)))


def _tool_chunks(calls: list[ToolCallDelta]) -> list[_ToolCallChunk]:
    """One entry per call index per chunk (as OpenAI sends): fragments of the same call that
    arrive together are merged, the id and name kept from the call's first fragment."""
    out: list[_ToolCallChunk] = []
    for c in calls:
        last = out[-1] if out else None
        if last is not None and last.index == c.index and c.id is None and c.name is None:
            prev = last.function.arguments
            last.function.arguments = (prev if isinstance(prev, str) else "") + c.arguments
            continue
        if c.id is not None or c.name is not None:
            out.append(
                _ToolCallChunk(
                    index=c.index,
                    id=c.id if c.id is not None else UNSET,
                    type="function",
                    function=_Fn(c.name if c.name is not None else UNSET, c.arguments),
                )
            )
        else:
            out.append(_ToolCallChunk(index=c.index, function=_Fn(arguments=c.arguments)))
    return out


def _call_id(index: int, call_index: int) -> str:
    return f"call_{index}_{call_index}"


# ---------------------------------------------------------------- streaming


class StreamPhase(enum.Enum):
    __hash__ = object.__hash__  # Enum hashes by name in Python: slow in a hot table

    NEW = "new"
    STREAMING = "streaming"
    CLOSED = "closed"


class _Ev(enum.Enum):
    __hash__ = object.__hash__  # Enum hashes by name in Python: slow in a hot table

    START = "start"
    EVENT = "event"
    END = "end"
    ERROR = "error"


_S = StreamPhase
_STREAM_TRANSITIONS: dict[tuple[StreamPhase, _Ev], StreamPhase] = {
    (_S.NEW, _Ev.START): _S.STREAMING,
    (_S.STREAMING, _Ev.EVENT): _S.STREAMING,
    (_S.STREAMING, _Ev.END): _S.CLOSED,
    (_S.NEW, _Ev.ERROR): _S.CLOSED,
    (_S.STREAMING, _Ev.ERROR): _S.CLOSED,
}


class _StreamBase:
    """Envelope prefix, state table, choice lookup, error and end framing."""

    __slots__ = (
        "_affixes",
        "_head",
        "_tail",
        "choices",
        "continuous",
        "ends",
        "include_usage",
        "phase",
    )

    _object: str = ""

    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        created: int,
        include_usage: bool,
        continuous: bool = False,
    ) -> None:
        self.phase = StreamPhase.NEW
        self.include_usage = include_usage
        #: ``continuous_usage_stats``: every chunk carries the running usage (then no chunk
        #: takes the text fast path, whose bytes after the text are fixed).
        self.continuous = continuous
        self._head = b"".join(
            (
                b'data: {"id":',
                _enc.encode(response_id),
                b',"object":',
                _enc.encode(self._object),
                b',"created":',
                str(int(created)).encode(),
                b',"model":',
                _enc.encode(model),
                b',"choices":[',
            )
        )
        self._tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self.choices: list[ChoiceState] = []
        #: Candidates the shell must end, as decided: ``(index, "stop")`` once a stop string
        #: matched (the shell empties the list).
        self.ends: list[tuple[int, str]] = []
        self._affixes: list[tuple[bytes, bytes]] = []  # ``text_affixes``, per choice index

    def _text_choice(self, index: int, text: str) -> Struct:
        """The choice of a chunk that carries only ``text`` (what ``_text_chunk`` frames)."""
        raise NotImplementedError

    def text_affixes(self, index: int) -> tuple[bytes, bytes]:
        """The bytes before and after the JSON of the text in choice ``index``'s chunk of
        only text (``_text_choice``): its encoding with an empty text, split around that
        text's ``""`` (the last string field before the constant tail), made once per choice."""
        affixes = self._affixes
        while len(affixes) <= index:
            whole = _enc.encode(self._text_choice(len(affixes), ""))
            cut = whole.rindex(b'""')
            affixes.append((self._head + whole[:cut], whole[cut + 2 :] + self._tail))
        return affixes[index]

    def _text_chunk(self, index: int, text: str) -> bytes:
        """The chunk ``_chunk`` writes for ``_text_choice(index, text)``, byte for byte, from
        the bytes around the text (``text_affixes``): the common chunk of a stream (a token of
        text) then costs one string encoding instead of two Structs and their encoding."""
        if self.continuous:
            out = bytearray()
            self._chunk(out, self._text_choice(index, text))
            return bytes(out)
        affixes = self._affixes
        pre, post = affixes[index] if index < len(affixes) else self.text_affixes(index)
        return b"".join((pre, _enc.encode(text), post))

    def _to(self, event: _Ev) -> None:
        nxt = _STREAM_TRANSITIONS.get((self.phase, event))
        if nxt is None:
            old, self.phase = self.phase, StreamPhase.CLOSED
            raise MergerError(f"Internal error: stream got {event.value} while {old.value}.")
        self.phase = nxt

    def _choice(self, index: int) -> ChoiceState:
        if not 0 <= index < len(self.choices):
            self.phase = StreamPhase.CLOSED
            raise MergerError(f"Internal error: no choice {index}.")
        return self.choices[index]

    def _feed(self, index: int, delta: CandidateDelta) -> ChoiceDelta:
        if self.phase is not StreamPhase.STREAMING:  # STREAMING stays: no lookup per token
            self._to(_Ev.EVENT)
        choices = self.choices
        state = choices[index] if 0 <= index < len(choices) else self._choice(index)
        try:
            return state.feed(delta)
        except ChoiceStateError as exc:
            self.phase = StreamPhase.CLOSED
            raise MergerError(f"Internal error: choice {index} got output after it ended.") from exc

    def _finish(self, index: int, finish: CandidateFinish) -> tuple[ChoiceState, ChoiceDelta]:
        self._to(_Ev.EVENT)
        state = self._choice(index)
        try:
            return state, state.finish(finish)
        except ChoiceStateError as exc:
            self.phase = StreamPhase.CLOSED
            raise MergerError(f"Internal error: choice {index} finished twice.") from exc

    def _chunk(self, out: bytearray, choice: Struct) -> None:
        out += self._head
        _enc.encode_into(choice, out, -1)
        if self.continuous:  # the usage so far: every choice's tokens, the prompt once
            out += b'],"usage":'
            out += _enc.encode(_usage(self.choices, self.choices))
            out += b"}\n\n"
            return
        out += self._tail

    def finished(self, index: int) -> bool:
        return self.choices[index].finished

    def on_error(self, err: GatewayError) -> bytes:
        """An error after the 200: the error event, then ``[DONE]``; the stream is closed."""
        self._to(_Ev.ERROR)
        for c in self.choices:
            if not c.finished:
                c.fail()
        return b"data: " + _enc.encode(err.envelope()) + b"\n\n" + DONE_FRAME

    def end(self) -> bytes:
        """Every choice finished: the usage chunk (if asked for), then ``[DONE]``. Raised
        before anything changes otherwise, so the stream can still end with an error event."""
        if not all(c.finished for c in self.choices):
            raise MergerError("Internal error: stream ended before every choice finished.")
        self._to(_Ev.END)
        if not self.include_usage:
            return DONE_FRAME
        usage = _enc.encode(_usage(self.choices, self.choices))
        return self._head + b'],"usage":' + usage + b"}\n\n" + DONE_FRAME


#: The streaming builders' common base (a fast path checks for it and uses ``choices``,
#: ``phase`` and ``text_affixes``).
StreamShaper = _StreamBase


class ChatStream(_StreamBase):
    """A streaming ``chat.completion.chunk`` response (see the module docstring)."""

    __slots__ = ()

    _object = "chat.completion.chunk"

    def __init__(
        self,
        valid: ValidChat,
        *,
        response_id: str,
        model: str,
        created: int,
        reasoning_parser: ReasoningFactory | None = None,
        tool_parser: ToolCallFactory | None = None,
    ) -> None:
        super().__init__(
            response_id=response_id,
            model=model,
            created=created,
            include_usage=valid.include_usage,
            continuous=valid.continuous_usage,
        )
        if valid.candidates != valid.n:
            raise MergerError("Internal error: best_of cannot be streamed.")
        self.choices = [
            ChoiceState(
                i,
                stops=valid.stop,
                reasoning=reasoning_parser,
                tools=tool_parser,
                include_reasoning=valid.include_reasoning,
                logprobs=valid.logprobs,
                collect=False,
                ends=self.ends,
            )
            for i in range(valid.n)
        ]

    def start(self) -> bytes:
        """The role chunks of every choice, in index order."""
        self._to(_Ev.START)
        out = bytearray()
        for i in range(len(self.choices)):
            self._chunk(out, _ChunkChoice(i, _ROLE_DELTA))
        return bytes(out)

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes:
        """Output of candidate ``index``: zero or more chunks."""
        cd = self._feed(index, delta)
        if cd.content and not (cd.reasoning or cd.tool_calls or cd.logprobs):
            return self._text_chunk(index, cd.content)  # most deltas: one token of content
        out = bytearray()
        self._delta_chunks(out, index, cd)  # nothing for an empty delta
        return bytes(out)

    def _text_choice(self, index: int, text: str) -> Struct:
        return _ChunkChoice(index, _Delta(content=text))

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes:
        """Candidate ``index`` ended: its flushed tail, then its closure chunk."""
        state, cd = self._finish(index, finish)
        out = bytearray()
        if cd:
            self._delta_chunks(out, index, cd)
        self._chunk(out, _ChunkChoice(index, _EMPTY_DELTA, None, state.finish_reason))
        return bytes(out)

    def _delta_chunks(self, out: bytearray, index: int, cd: ChoiceDelta) -> None:
        # One chunk per kind of output (as SGLang and OpenAI send them); the logprobs ride on
        # the first chunk of the delta.
        lp: _Logprobs | None = _Logprobs(content_entries(cd.logprobs)) if cd.logprobs else None
        if cd.reasoning:
            self._chunk(out, _ChunkChoice(index, _Delta(reasoning_content=cd.reasoning), lp))
            lp = None
        if cd.content or (lp is not None and not cd.tool_calls):
            self._chunk(out, _ChunkChoice(index, _Delta(content=cd.content), lp))
            lp = None
        if cd.tool_calls:
            delta = _Delta(tool_calls=_tool_chunks(cd.tool_calls))
            self._chunk(out, _ChunkChoice(index, delta, lp))


class CompletionStream(_StreamBase):
    """A streaming legacy ``text_completion`` response (one choice, no role chunk; the usage
    chunk and the running usage as ``stream_options`` asks)."""

    __slots__ = ()

    _object = "text_completion"

    def __init__(
        self, valid: ValidCompletion, *, response_id: str, model: str, created: int
    ) -> None:
        super().__init__(
            response_id=response_id,
            model=model,
            created=created,
            include_usage=valid.include_usage,
            continuous=valid.continuous_usage,
        )
        self.choices = [ChoiceState(0, stops=valid.stop, collect=False, ends=self.ends)]

    def start(self) -> bytes:
        """Nothing to send up front; moves the stream to ``STREAMING``."""
        self._to(_Ev.START)
        return b""

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes:
        cd = self._feed(index, delta)
        if not cd.content:
            return b""
        return self._text_chunk(index, cd.content)

    def _text_choice(self, index: int, text: str) -> Struct:
        return _TextChunkChoice(index, text)

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes:
        """The last chunk: any held-back text, with the finish reason."""
        state, cd = self._finish(index, finish)
        out = bytearray()
        self._chunk(out, _TextChunkChoice(index, cd.content, state.finish_reason))
        return bytes(out)


# ---------------------------------------------------------------- non-streaming


class _CollectorBase:
    choices: list[ChoiceState]
    #: Candidates the shell must end, as decided: ``(index, "stop")`` once a stop string
    #: matched, ``(index, "best_of")`` once a candidate can no longer be returned (the shell
    #: empties the list).
    ends: list[tuple[int, str]]

    def _choice(self, index: int) -> ChoiceState:
        if not 0 <= index < len(self.choices):
            raise MergerError(f"Internal error: no choice {index}.")
        return self.choices[index]

    def on_delta(self, index: int, delta: CandidateDelta) -> None:
        self._choice(index).feed(delta)

    def on_finish(self, index: int, finish: CandidateFinish) -> None:
        self._choice(index).finish(finish)

    def finished(self, index: int) -> bool:
        return self.choices[index].finished

    def _check_done(self) -> None:
        if not all(c.finished for c in self.choices):
            raise MergerError("Internal error: result requested before every choice finished.")


class ChatCollector(_CollectorBase):
    """A non-streaming ``chat.completion`` body (any ``n``, and ``best_of``)."""

    def __init__(
        self,
        valid: ValidChat,
        *,
        response_id: str,
        model: str,
        created: int,
        reasoning_parser: ReasoningFactory | None = None,
        tool_parser: ToolCallFactory | None = None,
    ) -> None:
        self.valid = valid
        self.response_id = response_id
        self.model = model
        self.created = created
        self.show_reasoning = valid.include_reasoning and reasoning_parser is not None
        self.ends = []
        self.choices = [
            ChoiceState(
                i,
                stops=valid.stop,
                reasoning=reasoning_parser,
                tools=tool_parser,
                include_reasoning=valid.include_reasoning,
                logprobs=valid.logprobs,
                ends=self.ends,
            )
            for i in range(valid.candidates)
        ]
        self._lost: set[int] = set()
        self._ranks = valid.candidates > valid.n  # best_of: the logprobs decide
        # best_of: the candidates whose output reached the collector, and those of them that
        # came with a logprob (a candidate ended early may have had no output shown here).
        self._fed: set[int] = set()
        self._scored: set[int] = set()

    def on_delta(self, index: int, delta: CandidateDelta) -> None:
        self._choice(index).feed(delta)
        if self._ranks:
            if delta.logprobs:
                self._scored.add(index)
            elif delta.text:
                self._fed.add(index)
            self.ends.extend((j, "best_of") for j in self.losers())

    def on_finish(self, index: int, finish: CandidateFinish) -> None:
        self._choice(index).finish(finish)
        if self._ranks:
            if index in self._fed and index not in self._scored:
                raise best_of_without_logprobs()
            self.ends.extend((j, "best_of") for j in self.losers())

    def losers(self) -> list[int]:
        """best_of: unfinished candidates that can no longer be returned (each reported once)."""
        n = self.valid.n
        if len(self.choices) <= n:
            return []
        finished = {c.index: c.cumulative_logprob for c in self.choices if c.finished}
        running = {
            c.index: c.cumulative_logprob
            for c in self.choices
            if not c.finished and c.index not in self._lost
        }
        out = bestof.cannot_win(finished, running, n)
        self._lost.update(out)
        return out

    def returned(self) -> list[ChoiceState]:
        """The choices the body returns, in output order (best_of: ranked)."""
        n = self.valid.n
        if len(self.choices) <= n:
            return list(self.choices)
        order = bestof.rank([c.cumulative_logprob for c in self.choices], n)
        return [self.choices[i] for i in order]

    def result(self) -> bytes:
        """The ``chat.completion`` body."""
        self._check_done()
        returned = self.returned()
        body = _ChatCompletion(
            self.response_id,
            "chat.completion",
            self.created,
            self.model,
            [self._message_choice(i, c) for i, c in enumerate(returned)],
            _usage(self.choices, returned),
        )
        return _enc.encode(body)

    def _message_choice(self, new_index: int, c: ChoiceState) -> _Choice:
        msg = _Message("assistant", c.content)
        if self.show_reasoning or c.reasoning:  # (an engine's own: shown only if asked)
            msg.reasoning_content = c.reasoning
        calls = c.tool_calls
        if calls:
            msg.tool_calls = [
                _ToolCall(
                    id=call.id or _call_id(new_index, call.index),
                    function=_Function(call.name, call.arguments),
                )
                for call in calls
            ]
        lp = _Logprobs(content_entries(c.logprobs)) if self.valid.logprobs else None
        assert c.finish_reason is not None
        return _Choice(new_index, msg, lp, c.finish_reason)


class CompletionCollector(_CollectorBase):
    """A non-streaming legacy ``text_completion`` body (no ``logprobs`` key)."""

    def __init__(
        self, valid: ValidCompletion, *, response_id: str, model: str, created: int
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = created
        self.ends = []
        self.choices = [ChoiceState(0, stops=valid.stop, ends=self.ends)]

    def result(self) -> bytes:
        """The ``text_completion`` body."""
        self._check_done()
        c = self.choices[0]
        assert c.finish_reason is not None
        body = _TextCompletion(
            self.response_id,
            "text_completion",
            self.created,
            self.model,
            [_TextChunkChoice(0, c.content, c.finish_reason)],
            _usage(self.choices, self.choices),
        )
        return _enc.encode(body)
