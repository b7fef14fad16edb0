"""SGLang's native protocol: ``/generate`` streams, ``/abort_request``, ``/health``.

This module is the whole of the gateway's knowledge of SGLang's native API, as one
implementation of :class:`sieproxy.core.upstream.protocol.EngineProtocol` (:data:`SGLANG`): the
candidate's request (the planned body, :mod:`sieproxy.core.plan`, sent as it is to
``/generate``), its reader (:class:`NativeReader`: engine bytes in, candidate events out,
with the express lane of the common token inside it), the abort (``/abort_request`` with the
candidate's ``rid``) and the probes (``/health``, ``/server_info``).

Reading the stream
------------------
One :class:`GenerateReader` reads one candidate's stream, one SSE ``data`` payload at a time, and
turns it into a :class:`CandidateDelta` (new text and logprobs since the previous chunk) and, on
the terminal chunk, a :class:`CandidateFinish`.

Text comes in two modes (engine flag ``--incremental-streaming-output``):

- cumulative (the default): every chunk's ``text`` is the whole generation so far; the reader
  emits the suffix beyond what it already emitted. A chunk whose text is *shorter* than what was
  emitted adds nothing (text cannot be retracted; SGLang holds back partial stop strings, so
  this does not happen in practice).
- incremental: ``text`` is a delta. Quirk: an abort chunk carries the *whole* accumulated text;
  when an abort chunk's text starts with everything emitted so far, only the rest is emitted.
  The reader does not compare the emitted text for that check: it keeps the emitted length and
  a CRC-32 of the emitted text's UTF-8.

What the candidate produced so far (:meth:`GenerateReader.progress`, for a resume of a broken
stream, :mod:`~.resume`) is the last cumulative text (a reference to the decoded chunk: nothing
is copied), or in incremental mode the list of the pieces emitted.

Logprob lists are placed by position, which covers both modes and the abort quirk at once: a
list of ``m`` entries with ``output_token_logprobs_length == L`` holds positions ``[L-m, L)``;
without ``L`` it holds ``[0, m)`` (cumulative) or ``[seen, seen+m)`` (incremental). Only
positions not yet seen are emitted. A ``null`` logprob (orjson's rendering of ``-inf``) becomes
:data:`NEG_INF_LOGPROB`, as OpenAI and vLLM report it.

Errors (all messages are the gateway's own; engine text is never echoed):

    top-level "error" key            EngineStreamError (400 when the engine's code is 4xx)
    abort with int status_code       EngineAborted(engine_status=N)
    (a 4xx of either also carries ``refusal``: its text classified by ``core.refusal``)
    abort with null status_code      CandidateFinish(reason="abort")
    bad JSON / shape / types         EngineMalformed — except, in cumulative mode, a chunk
                                     that does not decode: skipped (the next chunk repeats
                                     the whole state: text, logprobs, counts), at most
                                     ``MAX_SKIPPED`` per candidate
    [DONE] before the terminal chunk EngineTruncated
    EOF before [DONE]                EngineTruncated — unless the terminal chunk was already
                                     seen: SGLang always sends [DONE] after it, but a finished
                                     candidate is complete, so EOF then is accepted.

The express lane
----------------
Nearly every engine read of a streamed response carries one token: one SSE event of one
``data:`` line holding one SGLang ``/generate`` chunk with new text, no finish reason and no
logprobs. And nearly every streamed choice passes that text through unchanged (no stop string,
no reasoning or tool parser, no logprobs waiting: ``ChoiceState``'s plain case). The general
path handles such a read in four layers, each with its own fast path for it::

    SSEDecoder.feed ─▶ GenerateReader.feed ─▶ ChoiceState.feed ─▶ StreamShaper.on_delta

with a call, a check and an intermediate value at every step (a payload ``str``, a
``CandidateDelta``, an event tuple, a ``ChoiceDelta``). On a gateway relaying hundreds of
streams, every one of those touches memory that the other streams' tokens have pushed out of the
cache since this stream's last token: at 256 interleaved streams the general path's Python was
about three times its cost in a loop over one stream (docs/DESIGN.md, "The express lane").

:meth:`Express.relay` does the same work for a read of exactly that shape in one step: one shape
check of the bytes, one msgspec decode, the reader's and the choice's counters moved as their
own code moves them, and the SSE frame built from the bytes around the text that the shaper
encodes once per choice (``StreamShaper.text_affixes``). For anything else — a read that is not
one whole ``data:`` event, an SSE decoder holding a partial line or event, ``[DONE]``, a
malformed or error payload, a finish, logprobs, a choice that is not plain, a stream or choice
that is not open — it returns ``None`` **having changed nothing**, and the caller hands the same
bytes to the general path. So every read is handled exactly once, by one path or the other, and
what each layer keeps ends the same either way: ``tests/core/test_express.py`` runs random
streams (every shape above, split and joined at random) through both and compares every frame,
every error and the state at the end.

The lane reads and moves state that belongs to those layers (listed in :meth:`Express.relay`),
as their own fast paths do; a change to one of them must keep the lane in step, and the
differential test is what says whether it did.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec

from ..errors import (
    EngineAborted,
    EngineMalformed,
    EngineTruncated,
    GatewayError,
)
from ..request.refusal import classify, engine_stream_error
from ..shaping.choice import ChoicePhase, ChoiceState
from ..shaping.events import CandidateDelta, CandidateFinish, TokenLogprob, TopLogprob
from ..shaping.merger import StreamPhase, StreamShaper
from .resume import Progress
from .sse import SSEDecoder

__all__ = [
    "MAX_SKIPPED",
    "NEG_INF_LOGPROB",
    "SGLANG",
    "Express",
    "GenerateReader",
    "NativeReader",
    "SGLangNative",
    "decode_chunk",
    "parse_generate_response",
]

NEG_INF_LOGPROB = -9999.0

_Triple = tuple[float | None, int, str | None]


# Not tracked by the cycle collector (``gc=False``): decoded JSON never forms a cycle.
class _Meta(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    output_token_logprobs: list[_Triple] | None = None
    output_top_logprobs: list[list[_Triple] | None] | None = None
    output_token_logprobs_length: int | None = None


class _Chunk(msgspec.Struct, gc=False):
    text: str | msgspec.UnsetType = msgspec.UNSET
    meta_info: _Meta | msgspec.UnsetType = msgspec.UNSET
    error: Any = msgspec.UNSET
    object: Any = None
    code: Any = None
    message: Any = None


#: One ``/generate`` chunk's JSON (``str`` or bytes) as a ``_Chunk`` (also the express lane).
decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _decode(payload: str | bytes) -> tuple[str, _Meta]:
    try:
        chunk = decode_chunk(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EngineMalformed() from exc
    if chunk.error is not msgspec.UNSET and chunk.error is not None:
        raise engine_stream_error(chunk.error)
    if chunk.object == "error":  # FastAPI/HTTPException shape: {"object":"error","code":N,...}
        raise engine_stream_error({"code": chunk.code, "message": chunk.message})
    if isinstance(chunk.text, msgspec.UnsetType) or isinstance(chunk.meta_info, msgspec.UnsetType):
        raise EngineMalformed()
    return chunk.text, chunk.meta_info


def _aborted(status: int, message: Any = None) -> EngineAborted:
    if 400 <= status < 500:
        msg = "The engine refused the request; check that it fits the model's limits."
    elif status == 503:
        msg = "The engine is overloaded; retry shortly."
    else:
        msg = "The engine aborted the generation; retry the request."
    err = EngineAborted(msg, engine_status=status)
    if 400 <= status < 500:
        err.refusal = classify(message if isinstance(message, str) else None)
    return err


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finish(meta: _Meta) -> CandidateFinish | None:
    fr = meta.finish_reason
    if fr is None:
        return None
    kind = fr.get("type")
    if not isinstance(kind, str):
        raise EngineMalformed()
    matched: str | int | list[int] | None = None
    if kind == "abort":
        status = fr.get("status_code")
        if status is not None:
            if not _is_int(status):
                raise EngineMalformed()
            raise _aborted(status, fr.get("message"))
    elif kind == "stop":
        raw = fr.get("matched")
        if not (
            raw is None
            or isinstance(raw, str)
            or _is_int(raw)
            or (isinstance(raw, list) and all(_is_int(x) for x in raw))
        ):
            raise EngineMalformed()
        matched = raw
    return CandidateFinish(
        reason=kind,
        matched=matched,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens,
        cached_tokens=meta.cached_tokens,
        reasoning_tokens=meta.reasoning_tokens,
    )


def _logprobs(meta: _Meta, seen: int, incremental: bool) -> list[TokenLogprob]:
    """The logprobs of output positions ``seen`` onwards that this chunk carries."""
    tokens = meta.output_token_logprobs
    if not tokens:
        return []
    m = len(tokens)
    total = meta.output_token_logprobs_length
    if total is not None:
        base = total - m
        if base < 0:
            raise EngineMalformed()
    else:
        base = seen if incremental else 0
    skip = max(seen - base, 0)
    if skip >= m:
        return []
    tops = meta.output_top_logprobs or []
    out: list[TokenLogprob] = []
    for i in range(skip, m):
        lp, tid, text = tokens[i]
        row = tops[i] if i < len(tops) else None
        top = (
            [
                TopLogprob(t or "", t_id, NEG_INF_LOGPROB if t_lp is None else t_lp)
                for t_lp, t_id, t in row
            ]
            if row
            else []
        )
        out.append(TokenLogprob(text or "", tid, NEG_INF_LOGPROB if lp is None else lp, top))
    return out


#: Chunks a cumulative-mode reader skips per candidate before a malformed one is an error.
MAX_SKIPPED = 3


class GenerateReader:
    """Reads one candidate's ``/generate`` SSE payloads (see the module docstring)."""

    __slots__ = (
        "_crc",
        "_emitted",
        "_finished",
        "_full",
        "_lp_seen",
        "_pieces",
        "_prompt_tokens",
        "_skipped",
        "_tokens",
        "done",
        "incremental",
    )

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental
        self._emitted = 0  # characters of text emitted
        self._crc = 0  # incremental mode: CRC-32 of the emitted text, for the abort quirk
        self._full = ""  # cumulative mode: the last chunk's text that emitted something
        self._pieces: list[str] = []  # incremental mode: the pieces emitted
        self._lp_seen = 0
        self._tokens = 0
        self._prompt_tokens = 0
        self._finished = False
        self._skipped = 0  # chunks skipped that did not decode (cumulative mode)
        #: True once ``[DONE]`` was read (an attribute, not a property: read once per token).
        self.done = False

    def local_finish(self, reason: str = "abort") -> CandidateFinish:
        """A finish for a candidate the gateway ended itself (stop matched, best_of loser),
        carrying the token counts the engine reported so far."""
        return CandidateFinish(
            reason=reason, prompt_tokens=self._prompt_tokens, completion_tokens=self._tokens
        )

    @property
    def finished(self) -> bool:
        """True once the terminal chunk (a finish reason) was read."""
        return self._finished

    def progress(self) -> Progress:
        """The output so far (the module docstring)."""
        text = "".join(self._pieces) if self.incremental else self._full[: self._emitted]
        return Progress(text, self._tokens, self._prompt_tokens)

    def feed(self, payload: str) -> tuple[CandidateDelta | None, CandidateFinish | None]:
        """Interpret one SSE data payload; ``[DONE]`` yields ``(None, None)``."""
        if self.done:
            raise EngineMalformed()
        if payload == "[DONE]":
            self.done = True
            if not self._finished:  # the stream ended without the candidate's finish
                raise EngineTruncated("The engine ended the stream before the generation finished.")
            return None, None
        if self._finished:
            raise EngineMalformed()
        try:
            text, meta = _decode(payload)
        except EngineMalformed:
            # Cumulative text: the next chunk carries everything this one did. A terminal chunk
            # lost so is still an error: [DONE] (or the end) then comes before the finish.
            if self.incremental or self._skipped >= MAX_SKIPPED:
                raise
            self._skipped += 1
            return None, None
        finish = None if meta.finish_reason is None else _finish(meta)
        if finish is not None:
            self._finished = True
        new_text = self._new_text(text, finish)
        logprobs: list[TokenLogprob] = []
        if meta.output_token_logprobs:
            logprobs = _logprobs(meta, self._lp_seen, self.incremental)
            self._lp_seen += len(logprobs)
        delta: CandidateDelta | None = None
        if new_text or logprobs or meta.completion_tokens != self._tokens:
            delta = CandidateDelta(new_text, meta.completion_tokens, logprobs, meta.prompt_tokens)
        self._tokens = meta.completion_tokens
        self._prompt_tokens = meta.prompt_tokens
        return delta, finish

    def eof(self) -> None:
        """The stream ended: raise :class:`EngineTruncated` unless it ended properly."""
        if not (self.done or self._finished):
            raise EngineTruncated()

    def _new_text(self, text: str, finish: CandidateFinish | None) -> str:
        if not self.incremental:
            new = text[self._emitted :]
            if new:
                self._emitted += len(new)
                self._full = text
            return new
        if (
            finish is not None
            and finish.reason == "abort"
            and self._emitted
            and len(text) >= self._emitted
            and zlib.crc32(text[: self._emitted].encode()) == self._crc
        ):
            text = text[self._emitted :]
        if text:
            self._crc = zlib.crc32(text.encode(), self._crc)
            self._emitted += len(text)
            self._pieces.append(text)
        return text


def parse_generate_response(body: bytes) -> tuple[CandidateDelta, CandidateFinish]:
    """Interpret a non-streaming ``/generate`` body (one object, as for ``n`` = 1)."""
    text, meta = _decode(body)
    finish = _finish(meta)
    if finish is None:
        raise EngineMalformed()
    logprobs = _logprobs(meta, 0, False)
    return CandidateDelta(text, meta.completion_tokens, logprobs, meta.prompt_tokens), finish

_enc = msgspec.json.Encoder()
_UNSET = msgspec.UNSET
_OPEN = ChoicePhase.OPEN
_STREAMING = StreamPhase.STREAMING



class Express:
    """The express lane of choice ``index`` of a streamed response (see the module docstring).

    ``Express.of(...)`` is ``None`` where the lane can never apply (the choice has a stop
    string, a parser or logprobs), so the caller need not offer it any read."""

    __slots__ = ("_affixes", "_choice", "_decoder", "_index", "_reader", "_shaper")

    def __init__(
        self, decoder: SSEDecoder, reader: GenerateReader, shaper: StreamShaper, index: int
    ) -> None:
        self._decoder = decoder
        self._reader = reader
        self._shaper = shaper
        self._choice: ChoiceState = shaper.choices[index]
        self._index = index
        self._affixes: tuple[bytes, bytes] | None = None

    @classmethod
    def of(
        cls, decoder: SSEDecoder, reader: GenerateReader, shaper: object, index: int = 0
    ) -> Express | None:
        """The lane for this choice, or ``None`` if its output never takes it (a shaper that
        is not a streaming one, a choice with stop strings, parsers or logprobs)."""
        if not isinstance(shaper, StreamShaper) or not 0 <= index < len(shaper.choices):
            return None
        if shaper.continuous:  # every chunk carries the running usage: no fixed bytes
            return None
        choice = shaper.choices[index]
        if not choice.plain or choice.want_logprobs:  # (so no logprobs ever wait in it)
            return None
        return cls(decoder, reader, shaper, index)

    def relay(self, data: bytes) -> bytes | None:
        """The client's SSE frames for one engine read (``b""`` if it shows nothing new), or
        ``None`` if the read is not the common case: then nothing was changed, and ``data``
        goes to the general path. A read of several whole events (a relay that fell behind
        reads tokens in bursts) is taken if every one of them is common, else none is.

        State it reads: ``SSEDecoder``'s buffers and flags (as its fast path checks them),
        ``GenerateReader.done`` / ``finished`` / ``incremental``, the stream's and the choice's
        phase. State it moves, as ``GenerateReader.feed`` and ``ChoiceState.feed`` move it:
        the reader's emitted length, CRC and token counts, the choice's token counts
        (``_burst`` puts them back)."""
        d = self._decoder
        reader = self._reader
        choice = self._choice
        n = len(data)
        # A partial line or event, a pending LF, the first line, a failure: the decoder's
        # general path must see these bytes. So must anything but whole events of one data
        # line and its blank line each (SSEDecoder.feed's own fast path checks the same).
        if (
            not d.at_rest()
            or reader.done
            or reader._finished
            or choice.phase is not _OPEN
            or self._shaper.phase is not _STREAMING
            or not n
            or n > d.max_line
            or data[-1] != 0x0A
            or 0x0D in data  # a CR ends a line too
        ):
            return None
        # One line and the blank line (its first LF is the last but one byte), and that line
        # is ``data: `` and the payload. (``partition`` and ``removeprefix``, not ``find`` and
        # ``startswith``, which parse their arguments the old way on CPython 3.11.)
        line, _, tail = data.partition(b"\n")
        payload = line.removeprefix(b"data: ")
        if len(tail) != 1 or len(payload) == len(line):
            return self._burst(data)  # several events, or not the common case
        try:
            # ASCII needs no UTF-8 check; anything else is checked whole, as the SSE decoder
            # does (msgspec does not look inside the fields it skips).
            chunk = decode_chunk(payload if payload.isascii() else payload.decode())
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            return None  # the general path raises its own error for it
        text = chunk.text
        meta = chunk.meta_info
        if (
            text is _UNSET
            or meta is _UNSET
            or (chunk.error is not _UNSET and chunk.error is not None)
            or chunk.object == "error"
            or meta.finish_reason is not None
            or meta.output_token_logprobs
        ):
            return None
        # GenerateReader.feed and _new_text, for a chunk with no finish and no logprobs.
        if reader.incremental:
            if text:
                reader._crc = zlib.crc32(text.encode(), reader._crc)
                reader._emitted += len(text)
                reader._pieces.append(text)
        else:
            full = text
            text = full[reader._emitted :]
            if text:
                reader._emitted += len(text)
                reader._full = full
        tokens = meta.completion_tokens
        if text or tokens != reader._tokens:
            # The reader's delta, through ChoiceState.feed's plain case (a read with no delta
            # leaves the choice as it is).
            choice.prompt_tokens = meta.prompt_tokens
            if tokens > choice.completion_tokens:
                choice.completion_tokens = tokens
        reader._tokens = tokens
        reader._prompt_tokens = meta.prompt_tokens
        # Then the shaper's frame of a token of text.
        if not text:
            return b""
        affixes = self._affixes
        if affixes is None:
            affixes = self._affixes = self._shaper.text_affixes(self._index)
        return b"".join((affixes[0], _enc.encode(text), affixes[1]))

    def _burst(self, data: bytes) -> bytes | None:
        """Two or more whole events in one read, each through ``relay``: all of them, or none
        (what ``relay`` moved for the first ones is put back when a later one is declined)."""
        end = data.find(b"\n\n")
        if end < 0 or end + 2 == len(data):  # not a burst (relay declined this one event)
            return None
        reader, choice = self._reader, self._choice
        saved = (reader._emitted, reader._crc, reader._tokens, reader._prompt_tokens,
                 choice.completion_tokens, choice.prompt_tokens, reader._full)  # fmt: skip
        pieces = len(reader._pieces)
        frames = []
        start = 0
        while end >= 0:
            frame = self.relay(data[start : end + 2])  # (an event of two lines: declined)
            if frame is None:
                break
            frames.append(frame)
            start = end + 2
            if start == len(data):
                return b"".join(frames)
            end = data.find(b"\n\n", start)
        (reader._emitted, reader._crc, reader._tokens, reader._prompt_tokens,
         choice.completion_tokens, choice.prompt_tokens, reader._full) = saved  # fmt: skip
        del reader._pieces[pieces:]
        return None


class NativeReader:
    """One candidate's ``/generate`` body: SSE framing, then :class:`GenerateReader`, with the
    express lane over both (a :class:`~.protocol.CandidateReader`)."""

    __slots__ = ("_decoder", "_reader")

    def __init__(self, *, incremental: bool = False, max_line: int = 1 << 20) -> None:
        self._decoder = SSEDecoder(max_line)
        self._reader = GenerateReader(incremental=incremental)

    @property
    def done(self) -> bool:
        return self._reader.done

    @property
    def finished(self) -> bool:
        return self._reader._finished

    def feed(
        self, data: bytes
    ) -> tuple[list[CandidateDelta | CandidateFinish], GatewayError | None]:
        out: list[CandidateDelta | CandidateFinish] = []
        reader = self._reader
        try:
            for payload in self._decoder.feed(data):
                delta, finish = reader.feed(payload)
                if delta is not None:
                    out.append(delta)
                if finish is not None:
                    out.append(finish)
                if reader.done:
                    break
        except GatewayError as err:
            return out, err
        return out, None

    def eof(self) -> None:
        if not self._reader.done:
            self._decoder.close()
            self._reader.eof()

    def local_finish(self, reason: str = "abort") -> CandidateFinish:
        return self._reader.local_finish(reason)

    def progress(self) -> Progress:
        return self._reader.progress()

    def express(self, shaper: object, index: int = 0) -> Express | None:
        return Express.of(self._decoder, self._reader, shaper, index)


class SGLangNative:
    """SGLang's native API as an :class:`~.protocol.EngineProtocol` (module docstring)."""

    name = "sglang"
    health_paths: tuple[str, ...] = ("/health",)
    server_info = True

    def request(
        self, body: dict[str, Any], endpoint: str, model: str
    ) -> tuple[str, dict[str, Any]]:
        return "/generate", body

    def reader(
        self, *, incremental: bool, max_line: int, body: dict[str, Any] | None = None
    ) -> NativeReader:
        return NativeReader(incremental=incremental, max_line=max_line)

    def abort(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        # Exactly the candidate's rid (SGLang ignores prefixes).
        return "/abort_request", {"rid": body["rid"]}


#: The one instance (``protocol = "sglang"``, the default).
SGLANG = SGLangNative()
