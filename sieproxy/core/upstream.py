"""Interpret SGLang's native ``/generate`` output as candidate events.

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
  The reader does not keep the emitted text for that check (a stream of many thousand tokens
  would hold every piece): it keeps the emitted length and a CRC-32 of the emitted text's
  UTF-8, so its memory is constant whatever the length of the stream.

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
    bad JSON / shape / types         EngineMalformed
    EOF before [DONE]                EngineTruncated — unless the terminal chunk was already
                                     seen: SGLang always sends [DONE] after it, but a finished
                                     candidate is complete, so EOF then is accepted.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec

from .errors import EngineAborted, EngineMalformed, EngineStreamError, EngineTruncated
from .events import CandidateDelta, CandidateFinish, TokenLogprob, TopLogprob
from .refusal import classify, engine_message

__all__ = ["NEG_INF_LOGPROB", "GenerateReader", "decode_chunk", "parse_generate_response"]

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


#: One ``/generate`` chunk's JSON (``str`` or bytes) as a ``_Chunk`` (also ``core.express``).
decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _decode(payload: str | bytes) -> tuple[str, _Meta]:
    try:
        chunk = decode_chunk(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EngineMalformed() from exc
    if chunk.error is not msgspec.UNSET and chunk.error is not None:
        raise _stream_error(chunk.error)
    if chunk.object == "error":  # FastAPI/HTTPException shape: {"object":"error","code":N,...}
        raise _stream_error({"code": chunk.code, "message": chunk.message})
    if isinstance(chunk.text, msgspec.UnsetType) or isinstance(chunk.meta_info, msgspec.UnsetType):
        raise EngineMalformed()
    return chunk.text, chunk.meta_info


def _stream_error(error: Any) -> EngineStreamError:
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and _is_int(code) and 400 <= code < 500:
        err = EngineStreamError(
            "The engine refused the request; check that the prompt and max_tokens fit the "
            "model's context."
        )
        err.status = 400
        err.type = "invalid_request_error"
        err.code = "invalid_request"
        err.refusal = classify(engine_message({"error": error}))
        return err
    return EngineStreamError("The engine failed while generating; retry the request.")


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


class GenerateReader:
    """Reads one candidate's ``/generate`` SSE payloads (see the module docstring)."""

    __slots__ = (
        "_crc",
        "_emitted",
        "_finished",
        "_lp_seen",
        "_prompt_tokens",
        "_tokens",
        "done",
        "incremental",
    )

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental
        self._emitted = 0  # characters of text emitted
        self._crc = 0  # incremental mode: CRC-32 of the emitted text, for the abort quirk
        self._lp_seen = 0
        self._tokens = 0
        self._prompt_tokens = 0
        self._finished = False
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

    def feed(self, payload: str) -> tuple[CandidateDelta | None, CandidateFinish | None]:
        """Interpret one SSE data payload; ``[DONE]`` yields ``(None, None)``."""
        if self.done:
            raise EngineMalformed()
        if payload == "[DONE]":
            self.done = True
            return None, None
        if self._finished:
            raise EngineMalformed()
        text, meta = _decode(payload)
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
            self._emitted += len(new)
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
        return text


def parse_generate_response(body: bytes) -> tuple[CandidateDelta, CandidateFinish]:
    """Interpret a non-streaming ``/generate`` body (one object, as for ``n`` = 1)."""
    text, meta = _decode(body)
    finish = _finish(meta)
    if finish is None:
        raise EngineMalformed()
    logprobs = _logprobs(meta, 0, False)
    return CandidateDelta(text, meta.completion_tokens, logprobs, meta.prompt_tokens), finish
