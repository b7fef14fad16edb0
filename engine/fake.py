"""A scripted fake SGLang engine: SGLang's native HTTP protocol on trio + h11.

Theory of operation. Every generation request (native ``/generate``, or the OpenAI-compatible
``/v1/chat/completions`` kept for third-party benchmarks) is turned into a :class:`Call` — the
parsed request as a script sees it — and handed to the engine's *script*, any callable
``Call -> Plan``. The :class:`Plan` says which tokens to emit (each string is one token), when
(time to first token, inter-token intervals), with which logprobs, how it finishes, and which
:class:`Fault` to inject. The engine then behaves as SGLang 0.5.23 does around the plan:

- ``max_new_tokens`` (absent: 128, null: no limit) cuts the plan with ``{"type":"length"}``;
- ``stop`` strings are matched on the cumulative text, trimmed unless ``no_stop_trim``, and a
  tail that could still become a stop string is held back (no chunk is sent for it);
- tokens running out ends with ``plan.finish`` or, by default, an EOS stop
  ``{"type":"stop","matched": 2}`` (the EOS id is not added to ``output_ids``);
- text, ``output_ids`` and output logprobs are cumulative, or deltas with ``incremental=True``
  (advertised in ``/server_info``); an ``/abort_request`` abort chunk in incremental mode
  re-sends the whole text with ``output_ids=[last id]``, SGLang's quirk;
- ``/abort_request {"rid"}`` ends exactly that running rid with
  ``{"type":"abort","message":"Aborted","status_code":null,"err_type":null}`` then ``[DONE]``;
- a client closing the connection stops the generation and records the rid as cancelled;
- ``/v1/loads`` (and the older ``/get_load``) report the running requests and none waiting, or
  what :attr:`FakeEngine.load` scripts (``(running, waiting)``); ``reports_load = False``
  makes both 404 (an engine that reports no load);
- ``returns_logprobs = False`` accepts a request for logprobs and returns none (in either mode).

``/v1/chat/completions`` (with ``n``, logprobs, and the reasoning and tool calls an engine's own
parsers would send: see ``_chat_delta``) is what an OpenAI-compatible engine that renders chat
itself serves; ``chat_only = True`` makes it the only generation route (with ``/v1/models``), as
on hosted endpoints. ``/v1/completions`` is the OpenAI-compatible mode of a gateway that renders
(``protocol = "openai"``, ``render = "gateway"``): one streamed prompt with ``n`` = 1, the same
scripts and faults, framed as ``text_completion`` chunks with a usage chunk before ``[DONE]``
(``stream_options.include_usage``); it has no rid, so a request is recorded under a generated
``cmpl-`` id (or the name :attr:`FakeEngine.name_request` gives it) and a closed connection is
its abort.

Wire framing is exactly SGLang's: ``data: <compact json>\\n\\n`` per chunk, ``data: [DONE]\\n\\n``.
The native ``/generate`` supports one prompt with ``n`` absent or 1: batches and ``n > 1`` get a
400 (the gateway fans out itself and never sends them). ``/v1/chat/completions`` supports ``n``.

Everything the upstream saw is recorded for tests: :attr:`FakeEngine.requests`,
:attr:`~FakeEngine.aborts`, :attr:`~FakeEngine.running`, :attr:`~FakeEngine.finished`,
:attr:`~FakeEngine.aborted`, :attr:`~FakeEngine.cancelled`, :attr:`~FakeEngine.faulted`,
:meth:`~FakeEngine.statistics`, and :meth:`~FakeEngine.wait_for` waits for a condition on them.

Usage::

    engine = FakeEngine(script=lambda call: Plan(tokens=["Hel", "lo"], itl=0.01))
    port = await nursery.start(engine.serve)

or ``python -m engine.fake --port 30000 --ttft-ms 50 --itl-ms 10 --tokens 256``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import os
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from engine._http import ClientGone, HTTPConnection, HTTPRequest, HTTPServer

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "EOS_TOKEN_ID",
    "Call",
    "DefaultScript",
    "FakeEngine",
    "FakeEngineStatistics",
    "Fault",
    "FaultKind",
    "Plan",
    "Script",
    "SequenceScript",
    "abort_finish",
    "default_tokens",
    "main",
]

DEFAULT_MAX_NEW_TOKENS = 128
EOS_TOKEN_ID = 2
UNLIMITED_TOKENS = 64
"""Tokens the default script emits when ``max_new_tokens`` is null (then it ends with EOS)."""

SAMPLING_PARAMS_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
"""The keys SGLang 0.5.23's JSON contract accepts in ``sampling_params`` (others: 400)."""

_ENCODE = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_ABORTED: dict[str, Any] = {
    "type": "abort", "message": "Aborted", "status_code": None, "err_type": None,
}  # fmt: skip


# ---- scripting ------------------------------------------------------------------------------


class FaultKind(enum.Enum):
    """What a :class:`Fault` does to the response."""

    ERROR_EVENT = "error_event"  # data: {"error": {...}} then [DONE] (stream); 400 (non-stream)
    EOF = "eof"  # stream ends without [DONE]: cleanly (HTTP message ended) or by a bare close
    RESET = "reset"  # TCP RST
    HANG = "hang"  # stop sending (forever, or for ``duration``), still abortable
    MALFORMED = "malformed"  # an undecodable JSON chunk, then [DONE]
    HTTP_ERROR = "http_error"  # an error status before any response head


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault injected into one response.

    ``at`` is the number of token steps completed before the fault fires (0: right after the
    response head; at or past the last step: after the terminal chunk, in place of ``[DONE]``).
    ``before_headers`` makes HANG, RESET and EOF fire before the response head is sent.
    """

    kind: FaultKind
    at: int = 0
    before_headers: bool = False
    status_code: int = 500
    message: str = "injected fault"
    body: bytes | None = None
    clean: bool = True
    duration: float | None = None
    retry_after: str | None = None  # HTTP_ERROR: the answer's Retry-After header
    until: trio.Event | None = None  # HANG: until this event is set (a test's own signal)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The extra headers of an HTTP_ERROR answer."""
        if self.retry_after is None:
            return []
        return [(b"retry-after", self.retry_after.encode("latin-1"))]

    @classmethod
    def error_event(cls, at: int = 0, message: str = "injected error", code: int = 400) -> Fault:
        """An in-stream ``{"error": {...}}`` event then ``[DONE]`` (non-stream: HTTP ``code``)."""
        return cls(FaultKind.ERROR_EVENT, at=at, message=message, status_code=code)

    @classmethod
    def eof(cls, at: int = 0, *, clean: bool = True) -> Fault:
        """End without ``[DONE]``: ``clean`` ends the HTTP body properly, else the socket closes
        mid-body (an incomplete chunked message)."""
        return cls(FaultKind.EOF, at=at, clean=clean)

    @classmethod
    def reset(cls, at: int = 0, *, before_headers: bool = False) -> Fault:
        """Reset the connection (RST) after ``at`` steps, or before the response head."""
        return cls(FaultKind.RESET, at=at, before_headers=before_headers)

    @classmethod
    def hang(
        cls,
        at: int = 0,
        *,
        before_headers: bool = False,
        duration: float | None = None,
        until: trio.Event | None = None,
    ) -> Fault:
        """Stop sending after ``at`` steps (or before the head) forever, for ``duration`` s, or
        until ``until`` is set; then the stream goes on."""
        return cls(
            FaultKind.HANG, at=at, before_headers=before_headers, duration=duration, until=until
        )

    @classmethod
    def malformed(cls, at: int = 0, *, goes_on: bool = False) -> Fault:
        """Send a chunk that is not valid JSON after ``at`` steps, then ``[DONE]`` (with
        ``goes_on``: then the rest of the stream, as if nothing happened)."""
        return cls(FaultKind.MALFORMED, at=at, clean=not goes_on)

    @classmethod
    def http_error(
        cls,
        status: int = 500,
        message: str | None = None,
        body: bytes | None = None,
        *,
        retry_after: str | None = None,
    ) -> Fault:
        """Answer with ``status`` before any head (with ``Retry-After: retry_after`` if given).
        The default body is SGLang's for the status: 400 ``{"error":{"message"}}``, else
        ``{"object":"error","message","type","param","code"}``.
        """
        return cls(
            FaultKind.HTTP_ERROR,
            status_code=status,
            message=message or f"injected HTTP {status}",
            body=body,
            retry_after=retry_after,
        )


def abort_finish(
    message: str = "Aborted", status_code: int | None = None, err_type: str | None = None
) -> dict[str, Any]:
    """An abort ``finish_reason``, e.g. ``abort_finish("OOM", 503, "ServiceUnavailable")``."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


LogprobTriple = tuple[float, int, str]


@dataclass(frozen=True, slots=True)
class Plan:
    """What one generation does. Only ``tokens`` is required.

    ``itl`` is one interval for every gap, or one per gap (``itl[i-1]`` precedes token ``i``).
    ``finish`` applies when the tokens run out (before that, ``max_new_tokens`` and ``stop``
    may end the generation); an abort ``finish`` arrives as a separate, final chunk.
    """

    tokens: Sequence[str]
    token_ids: Sequence[int] | None = None
    ttft: float = 0.0
    itl: float | Sequence[float] = 0.0
    logprobs: Sequence[float] | None = None
    top_logprobs: Sequence[Sequence[LogprobTriple]] | None = None
    finish: dict[str, Any] | None = None
    fault: Fault | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Call:
    """One generation as a script sees it (for chat with ``n``, one per choice)."""

    path: str
    body: dict[str, Any]
    rid: str
    prompt: str | list[int]
    prompt_tokens: int
    max_new_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    seed: int
    index: int = 0


Script = Callable[[Call], Plan]
"""A script: any callable from a :class:`Call` to a :class:`Plan`."""

_SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
_VOCAB = len(_SYLLABLES) ** 2
_STEP = 7919  # prime, coprime with _VOCAB: consecutive tokens always differ


def default_tokens(seed: int, count: int) -> tuple[list[str], list[int]]:
    """``count`` deterministic, pairwise-consecutive-distinct word tokens and their ids."""
    texts: list[str] = []
    ids: list[int] = []
    n = len(_SYLLABLES)
    for i in range(count):
        w = (seed + i * _STEP) % _VOCAB
        texts.append(" " + _SYLLABLES[w // n] + _SYLLABLES[w % n])
        ids.append(1000 + w)
    return texts, ids


@dataclass(frozen=True, slots=True)
class DefaultScript:
    """Deterministic distinct tokens derived from the prompt and rid (or ``sampling_seed``).

    Emits ``tokens`` tokens if set, else ``max_new_tokens`` (``UNLIMITED_TOKENS`` when null);
    the engine then applies ``max_new_tokens`` and ``stop`` as SGLang does.
    """

    ttft: float = 0.0
    itl: float = 0.0
    tokens: int | None = None

    def __call__(self, call: Call) -> Plan:
        """The plan for ``call``."""
        if self.tokens is not None:
            count = self.tokens
        elif call.max_new_tokens is not None:
            count = call.max_new_tokens
        else:
            count = UNLIMITED_TOKENS
        texts, ids = default_tokens(call.seed, count)
        return Plan(tokens=texts, token_ids=ids, ttft=self.ttft, itl=self.itl)


@dataclass
class SequenceScript:
    """Hands out ``plans`` to successive calls in order, then defers to ``then``."""

    plans: list[Plan | Script]
    then: Script = field(default_factory=DefaultScript)

    def __call__(self, call: Call) -> Plan:
        """The next plan (a plan in the list may itself be a script)."""
        if not self.plans:
            return self.then(call)
        item = self.plans.pop(0)
        return item if isinstance(item, Plan) else item(call)


def _token_id(text: str) -> int:
    return 1000 + zlib.crc32(text.encode("utf-8")) % 30000


def _logprob(token_id: int) -> float:
    return -((token_id % 17) + 1) / 10


# ---- one generation's state ------------------------------------------------------------------


class _Run:
    """A running rid: what ``/abort_request`` and the running set see."""

    __slots__ = ("aborted", "rid", "scope")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.aborted = False
        self.scope: trio.CancelScope | None = None

    def abort(self) -> None:
        self.aborted = True
        if self.scope is not None:
            self.scope.cancel()

    async def wait_for(self, event: trio.Event | None, deadline: float) -> bool:
        """Until ``event`` is set (None: until ``deadline``); False if aborted meanwhile."""
        if event is None:
            return await self.wait_until(deadline)
        if self.aborted:
            return False
        with trio.CancelScope() as scope:
            self.scope = scope
            await event.wait()
        self.scope = None
        return not self.aborted

    async def wait_until(self, deadline: float) -> bool:
        """Sleep until ``deadline``; False if aborted meanwhile (or before)."""
        if self.aborted:
            return False
        if deadline <= trio.current_time():
            await trio.lowlevel.checkpoint()
            return not self.aborted
        with trio.CancelScope(deadline=deadline) as scope:
            self.scope = scope
            await trio.sleep_forever()
        self.scope = None
        return not self.aborted


class _Generation:
    """Token-by-token state of one plan under one request's params; builds the chunks."""

    def __init__(
        self,
        call: Call,
        plan: Plan,
        *,
        cumulative: bool,
        return_logprob: bool,
        top_logprobs_num: int,
        text_in_logprobs: bool,
        no_stop_trim: bool,
    ) -> None:
        self.call = call
        self.plan = plan
        self.cumulative = cumulative
        self.tokens = list(plan.tokens)
        self.token_ids = (
            list(plan.token_ids) if plan.token_ids is not None else
            [_token_id(t) for t in self.tokens]
        )  # fmt: skip
        limit = len(self.tokens)
        if call.max_new_tokens is not None:
            limit = min(limit, max(call.max_new_tokens, 0))
        self.limit = limit
        self.stops = call.stop
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.no_stop_trim = no_stop_trim
        self.return_logprob = return_logprob
        self.top_k = top_logprobs_num if return_logprob else 0
        self.text_in_logprobs = text_in_logprobs
        self.text = ""
        self.visible_len = 0  # how much of self.text may be shown
        self.ids: list[int] = []
        self.lp: list[list[Any]] = []
        self.top: list[list[list[Any]] | None] = []
        self.sent_text = 0
        self.sent_ids = 0
        self.finish: dict[str, Any] | None = None
        self.prompt_tokens = plan.prompt_tokens if plan.prompt_tokens is not None else (
            call.prompt_tokens
        )  # fmt: skip
        self.t_start = time.monotonic()

    @property
    def steps(self) -> int:
        """Number of steps (at least one: a zero-token generation still sends one chunk)."""
        return max(self.limit, 1)

    def step(self, i: int) -> bool:
        """Generate step ``i``; return whether a chunk should be sent for it."""
        if i < self.limit:
            tok, tid = self.tokens[i], self.token_ids[i]
            prev = len(self.text)
            self.text += tok
            self.ids.append(tid)
            if self.return_logprob:
                self._add_logprobs(i, tok, tid)
            if self.stops:
                start = max(0, prev - self.max_stop + 1)
                best: tuple[int, str] | None = None
                for s in self.stops:
                    at = self.text.find(s, start)
                    if at >= 0 and (best is None or at < best[0]):
                        best = (at, s)
                if best is not None:
                    at, s = best
                    self.visible_len = at + len(s) if self.no_stop_trim else at
                    self.finish = {"type": "stop", "matched": s}
                    return True
        n = len(self.ids)
        if self.call.max_new_tokens is not None and n >= self.call.max_new_tokens:
            self.finish = {"type": "length", "length": n}
        elif i >= self.limit - 1:
            planned = self.plan.finish
            if planned is None:
                self.finish = {"type": "stop", "matched": EOS_TOKEN_ID}
            elif planned.get("type") != "abort":
                self.finish = dict(planned)
        self.visible_len = len(self.text)
        if self.finish is None and self.stops and self._tail_may_stop():
            hold = self._held_back()
            self.visible_len = len(self.text) - hold
            return False
        return True

    def _tail_may_stop(self) -> bool:
        return self._held_back() > 0

    def _held_back(self) -> int:
        text = self.text
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _add_logprobs(self, i: int, tok: str, tid: int) -> None:
        plan = self.plan
        lp = plan.logprobs[i] if plan.logprobs is not None else _logprob(tid)
        text = tok if self.text_in_logprobs else None
        self.lp.append([lp, tid, text])
        if self.top_k > 0:
            if plan.top_logprobs is not None:
                row = [[a, b, c if self.text_in_logprobs else None]
                       for a, b, c in plan.top_logprobs[i][: self.top_k]]  # fmt: skip
            else:
                row = [[lp, tid, text]]
                w = tid - 1000
                for j in range(1, self.top_k):
                    alt_w = (w + j * 31) % _VOCAB
                    alt_text = default_tokens(alt_w, 1)[0][0] if self.text_in_logprobs else None
                    row.append([round(lp - 0.5 * j, 4), 1000 + alt_w, alt_text])
            self.top.append(row)

    @property
    def planned_abort(self) -> dict[str, Any] | None:
        """The plan's abort finish, sent as a separate chunk once the tokens are out."""
        f = self.plan.finish
        return dict(f) if f is not None and f.get("type") == "abort" else None

    def chunk(self, finish: dict[str, Any] | None, *, quirk: bool = False) -> dict[str, Any]:
        """The chunk for the current state (advances the delta markers in incremental mode)."""
        n = len(self.ids)
        vis = self.visible_len
        if self.cumulative:
            text = self.text[:vis] if vis != len(self.text) else self.text
            ids: list[int] = self.ids
            lp_start = 0
        elif quirk:
            text = self.text[:vis]
            ids = self.ids[-1:]
            lp_start = n
        else:
            text = self.text[self.sent_text : vis]
            ids = self.ids[self.sent_ids :]
            lp_start = self.sent_ids
            self.sent_text = max(vis, self.sent_text)
            self.sent_ids = n
        meta: dict[str, Any] = {
            "id": self.call.rid,
            "finish_reason": finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": self.plan.cached_tokens,
            "reasoning_tokens": self.plan.reasoning_tokens,
            "weight_version": "default",
        }
        if self.return_logprob:
            meta["output_token_logprobs"] = self.lp[lp_start:] if lp_start else self.lp
            meta["output_token_logprobs_length"] = n
            if self.top_k > 0:
                meta["output_top_logprobs"] = self.top[lp_start:] if lp_start else self.top
        if finish is not None:
            meta["e2e_latency"] = round(time.monotonic() - self.t_start, 6)
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def final_text(self) -> str:
        """The visible text so far."""
        return self.text[: self.visible_len]


def _deadlines(plan: Plan, start: float, steps: int) -> list[float]:
    out = []
    t = start + plan.ttft
    itl = plan.itl
    for i in range(steps):
        if i:
            gap = itl if isinstance(itl, int | float) else (itl[i - 1] if i - 1 < len(itl) else 0.0)
            t += gap
        out.append(t)
    return out


# ---- the engine -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FakeEngineStatistics:
    """Counters of a :class:`FakeEngine` (see :meth:`FakeEngine.statistics`)."""

    connections_accepted: int
    connections_open: int
    requests: int
    generate_requests: int
    chat_requests: int
    health_checks: int
    streams_started: int
    finished: int
    aborted: int
    cancelled: int
    faulted: int
    aborts_received: int
    chunks_sent: int
    tokens_generated: int
    running: int


class _BadRequest(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


class FakeEngine:
    """A fake SGLang engine driven by a script (see the module docstring)."""

    def __init__(
        self,
        script: Script | None = None,
        *,
        incremental: bool = False,
        abort_quirk: bool = True,
        model_path: str = "fake/fake-model",
        served_model_name: str | None = None,
        context_length: int = 8192,
        strict_sampling_params: bool = True,
        healthy: bool = True,
        vocab_size: int | None = None,
        chat_only: bool = False,
    ) -> None:
        self.script: Script = script if script is not None else DefaultScript()
        #: Serve only ``/v1/chat/completions`` and ``/v1/models`` (everything else 404, also
        #: ``/health``), as hosted OpenAI-compatible endpoints and many proxies do.
        self.chat_only = chat_only
        self.incremental = incremental
        self.abort_quirk = abort_quirk
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.context_length = context_length
        #: Sent in ``/model_info`` when set (the CPU engine's extension; SGLang has no such key).
        self.vocab_size = vocab_size
        self.strict_sampling_params = strict_sampling_params
        self.healthy = healthy
        #: Scripted ``(running, waiting)`` for /v1/loads; None: the real running count.
        self.load: tuple[int, int] | None = None
        self.reports_load = True
        #: False: logprobs are accepted in a request and never returned (as some
        #: OpenAI-compatible servers do); the text and the finish are unchanged.
        self.returns_logprobs = True
        #: False: a chat request continuing its last assistant message (vLLM's
        #: ``continue_final_message``, an assistant prefill) is refused with a 400, as an
        #: OpenAI-compatible server without prefills does.
        self.accepts_prefill = True
        #: OpenAI mode: a request's name in the records and for the script (its rid), read
        #: from its body; ``None`` (or no name): a generated ``cmpl-`` id.
        self.name_request: Callable[[dict[str, Any]], str | None] | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self.requests: list[tuple[str, Any]] = []
        self.aborts: list[str] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.faulted: list[tuple[str, FaultKind]] = []
        self.outcomes: dict[str, str] = {}
        self._running: dict[str, list[_Run]] = {}
        self._counts = dict.fromkeys(
            ("requests", "generate", "chat", "health", "streams", "chunks", "tokens"), 0
        )
        self._changed = trio.Event()
        self._server = HTTPServer(self._handle)
        self._started = time.time()
        #: A prefix cache publishing KV events (engine/fake_cache.py): ``cached_tokens`` and
        #: ``prompt_tokens`` then come from it.
        self.prefix_cache: Any = None

    # -- observation ------------------------------------------------------------------------

    @property
    def running(self) -> set[str]:
        """Rids currently generating."""
        return set(self._running)

    def statistics(self) -> FakeEngineStatistics:
        """A snapshot of the engine's counters."""
        c = self._counts
        return FakeEngineStatistics(
            connections_accepted=self._server.connections_accepted,
            connections_open=self._server.connections_open,
            requests=c["requests"],
            generate_requests=c["generate"],
            chat_requests=c["chat"],
            health_checks=c["health"],
            streams_started=c["streams"],
            finished=len(self.finished),
            aborted=len(self.aborted),
            cancelled=len(self.cancelled),
            faulted=len(self.faulted),
            aborts_received=len(self.aborts),
            chunks_sent=c["chunks"],
            tokens_generated=c["tokens"],
            running=sum(len(v) for v in self._running.values()),
        )

    async def wait_for(self, predicate: Callable[[], bool], *, poll: float = 0.01) -> None:
        """Wait until ``predicate()`` holds.

        It is re-checked whenever the records change, and every ``poll`` seconds (counters such
        as ``chunks_sent`` change on the hot path, which does not notify).
        """
        while not predicate():
            with trio.move_on_after(poll):
                await self._changed.wait()

    def clear_records(self) -> None:
        """Forget recorded requests and outcomes (counters and running rids stay)."""
        for rec in (self.requests, self.aborts, self.finished, self.aborted, self.cancelled):
            rec.clear()
        self.faulted.clear()
        self.outcomes.clear()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _record_outcome(self, rid: str, outcome: str, kind: FaultKind | None = None) -> None:
        self.outcomes[rid] = outcome
        if outcome == "finished":
            self.finished.append(rid)
        elif outcome == "aborted":
            self.aborted.append(rid)
        elif outcome == "cancelled":
            self.cancelled.append(rid)
        elif outcome == "fault" and kind is not None:
            self.faulted.append((rid, kind))
        self._notify()

    def _add_running(self, run: _Run) -> None:
        self._running.setdefault(run.rid, []).append(run)
        self._notify()

    def _remove_running(self, run: _Run) -> None:
        runs = self._running.get(run.rid)
        if runs and run in runs:
            runs.remove(run)
            if not runs:
                del self._running[run.rid]
        self._notify()

    # -- serving -----------------------------------------------------------------------------

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve on ``host:port`` (0: any free port) until cancelled; reports the bound port.

        ``port = await nursery.start(engine.serve)``. After :meth:`close_listener` this may be
        started again on the same port.
        """
        self.host = host
        async with trio.open_nursery() as nursery:
            self.port = await nursery.start(self._server.serve, host, port)
            task_status.started(self.port)

    def drop_reused(self, count: int = 1, *, reset: bool = False) -> None:
        """Close the connection, without answering, under the next ``count`` POSTs that arrive
        on a reused keep-alive connection (``reset``: with a TCP RST): an engine closing an idle
        connection as a request arrives. :attr:`dropped` counts them."""
        self._server.drop_reused = count
        self._server.drop_with_reset = reset

    @property
    def dropped(self) -> int:
        """Requests closed unanswered by :meth:`drop_reused`."""
        return self._server.dropped

    def close_listener(self) -> None:
        """Stop accepting: new connections are refused; open ones are still served."""
        self._server.close_listeners()

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the listener."""
        return f"http://{self.host}:{self.port}"

    # -- routing -----------------------------------------------------------------------------

    async def _handle(self, conn: HTTPConnection, req: HTTPRequest) -> None:
        self._counts["requests"] += 1
        path, method = req.path, req.method
        try:
            if self.chat_only and path not in ("/v1/chat/completions", "/v1/models"):
                await self._json(conn, 404, {"detail": "Not Found"})
            elif path == "/generate" and method in ("POST", "PUT"):
                await self._generate(conn, req)
            elif path == "/v1/chat/completions" and method == "POST":
                await self._chat(conn, req)
            elif path == "/v1/completions" and method == "POST":
                await self._completions(conn, req)
            elif path == "/abort_request" and method == "POST":
                await self._abort(conn, req)
            elif path in ("/health", "/health_generate", "/ready") and method == "GET":
                self._counts["health"] += 1
                await conn.send_response(200 if self.healthy else 503)
            elif path in ("/server_info", "/get_server_info") and method == "GET":
                await self._json(conn, 200, self.server_info())
            elif path in ("/v1/loads", "/get_load") and method == "GET":
                if self.reports_load:
                    await self._json(conn, 200, self.loads(legacy=path == "/get_load"))
                else:
                    await self._json(conn, 404, {"detail": "Not Found"})
            elif path in ("/model_info", "/get_model_info") and method == "GET":
                await self._json(conn, 200, self.model_info())
            elif path == "/v1/models" and method == "GET":
                await self._json(conn, 200, self.models())
            elif path in _KNOWN_PATHS:
                await self._json(conn, 405, {"detail": "Method Not Allowed"})
            else:
                await self._json(conn, 404, {"detail": "Not Found"})
        except _BadRequest as exc:
            await self._json(conn, exc.status, exc.body)

    @staticmethod
    async def _json(conn: HTTPConnection, status: int, obj: Any) -> None:
        await conn.send_response(status, _ENCODE(obj))

    def _parse_body(self, req: HTTPRequest) -> Any:
        try:
            body = json.loads(req.body) if req.body else None
        except ValueError as exc:
            self.requests.append((req.path, None))
            raise _BadRequest(400, _validation_error(f"JSON decode error: {exc}")) from exc
        self.requests.append((req.path, body))
        self._notify()
        if not isinstance(body, dict):
            raise _BadRequest(400, _validation_error("Input should be a valid dictionary"))
        return body

    # -- info endpoints -------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        """The ``/server_info`` body: resolved server args plus scheduler info."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "context_length": self.context_length,
            "max_context_length": self.context_length,
            "incremental_streaming_output": self.incremental,
            "stream_interval": 1,
            "host": self.host,
            "port": self.port,
            "tool_call_parser": None,
            "reasoning_parser": None,
            "disaggregation_mode": "null",
            "max_total_num_tokens": self.context_length * 16,
            "max_req_input_len": self.context_length - 1,
            "internal_states": [{"last_gen_throughput": 0.0}],
            "version": "0.5.23",
            "frontend": "fake",
            # Set by a gateway for its embedded engine (it checks that it talks to its child).
            "launch_token": os.environ.get("SIEPROXY_ENGINE_LAUNCH_TOKEN"),
            **(self.prefix_cache.server_info() if self.prefix_cache is not None else {}),
        }

    def loads(self, *, legacy: bool = False) -> Any:
        """The ``/v1/loads`` body (``legacy``: ``/get_load``'s), one data-parallel rank."""
        running, waiting = self.load or (sum(len(v) for v in self._running.values()), 0)
        if legacy:
            return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting}]
        return {
            "loads": [
                {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting}
            ]
        }

    def model_info(self) -> dict[str, Any]:
        """The ``/model_info`` body."""
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "fake",
            "architectures": ["FakeForCausalLM"],
        } | ({"vocab_size": self.vocab_size} if self.vocab_size is not None else {})

    def models(self) -> dict[str, Any]:
        """The ``/v1/models`` body."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "created": int(self._started),
                    "owned_by": "sglang",
                    "root": self.model_path,
                    "parent": None,
                    "max_model_len": self.context_length,
                }
            ],
        }

    # -- abort -------------------------------------------------------------------------------

    async def _abort(self, conn: HTTPConnection, req: HTTPRequest) -> None:
        try:
            body = json.loads(req.body) if req.body else {}
        except ValueError:
            body = {}
        self.requests.append((req.path, body))
        rid = body.get("rid") if isinstance(body, dict) else None
        abort_all = isinstance(body, dict) and body.get("abort_all") is True
        self.aborts.append(rid if isinstance(rid, str) else "")
        if abort_all:
            targets = [r for runs in self._running.values() for r in runs]
        elif isinstance(rid, str) and rid:
            targets = list(self._running.get(rid, ()))
        else:
            targets = []
        for run in targets:
            run.abort()
        self._notify()
        await conn.send_response(200)

    # -- /generate -------------------------------------------------------------------------

    def _generate_call(self, body: dict[str, Any]) -> tuple[Call, dict[str, Any]]:
        sp = body.get("sampling_params")
        if sp is None:
            sp = {}
        if isinstance(sp, list):
            raise _BadRequest(400, _error_message("batch requests are not supported (fake)"))
        if not isinstance(sp, dict):
            raise _BadRequest(400, {"error": "invalid type: expected struct SamplingParams"})
        if self.strict_sampling_params:
            for key in sp:
                if key not in SAMPLING_PARAMS_FIELDS:
                    raise _BadRequest(400, {"error": _unknown_field(key)})
        n = sp.get("n")
        if n not in (None, 1):
            raise _BadRequest(400, _error_message("n > 1 is not supported by the fake engine"))
        text, ids = body.get("text"), body.get("input_ids")
        prompt: str | list[int]
        if isinstance(text, str):
            prompt = text
            prompt_tokens = max(1, len(text.split()))
        elif text is None and isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            if not ids:
                raise _BadRequest(400, _error_message("input_ids cannot be empty"))
            prompt = ids
            prompt_tokens = len(ids)
        elif isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
            raise _BadRequest(400, _error_message("batch requests are not supported (fake)"))
        else:
            raise _BadRequest(
                400, _error_message("Either text, input_ids or input_embeds should be provided.")
            )
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise _BadRequest(400, _error_message("rid must be a string (no batches)"))
        client_rid = rid or ""
        call = self._make_call(
            "/generate",
            body,
            rid or uuid.uuid4().hex,
            client_rid,
            prompt,
            prompt_tokens,
            sp,
            bool(body.get("stream", False)),
        )
        return call, sp

    def _make_call(
        self,
        path: str,
        body: dict[str, Any],
        rid: str,
        seed_rid: str,
        prompt: str | list[int],
        prompt_tokens: int,
        sp: dict[str, Any],
        stream: bool,
        index: int = 0,
    ) -> Call:
        max_new: int | None = sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        stop = sp.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if s)
        seed_src = sp.get("sampling_seed")
        key = f"{prompt!r}|{seed_src if seed_src is not None else seed_rid}|{index}"
        return Call(
            path=path,
            body=body,
            rid=rid,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new,
            stop=stops,
            stream=stream,
            seed=zlib.crc32(key.encode("utf-8")),
            index=index,
        )

    async def _generate(self, conn: HTTPConnection, req: HTTPRequest) -> None:
        self._counts["generate"] += 1
        body = self._parse_body(req)
        call, sp = self._generate_call(body)
        plan = self.script(call)
        if self.prefix_cache is not None:
            n, cached = self.prefix_cache.serve(call.prompt)
            plan = dataclasses.replace(plan, prompt_tokens=n, cached_tokens=cached)
        gen = _Generation(
            call,
            plan,
            cumulative=not (self.incremental and call.stream),
            return_logprob=body.get("return_logprob") is True and self.returns_logprobs,
            top_logprobs_num=int(body.get("top_logprobs_num") or 0),
            text_in_logprobs=body.get("return_text_in_logprobs") is True,
            no_stop_trim=sp.get("no_stop_trim") is True,
        )
        await self._run_generation(conn, call, gen)

    # -- /v1/completions (the OpenAI-compatible mode) ----------------------------------------

    async def _completions(self, conn: HTTPConnection, req: HTTPRequest) -> None:
        """OpenAI's legacy completions, streamed, one prompt, ``n`` = 1: the same scripts and
        faults as ``/generate``, framed as ``text_completion`` chunks (a usage chunk before
        ``[DONE]`` with ``stream_options.include_usage``). No rid: the abort is a closed
        connection (recorded as ``cancelled`` under its name: :attr:`name_request`'s, else a
        generated id)."""
        self._counts["generate"] += 1  # (counted with the native generations)
        body = self._parse_body(req)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _BadRequest(400, _openai_error("prompt must be one string (fake)"))
        if body.get("n") not in (None, 1) or body.get("stream") is not True:
            raise _BadRequest(400, _openai_error("only streamed n = 1 is supported (fake)"))
        sp: dict[str, Any] = {"max_new_tokens": body.get("max_tokens", DEFAULT_MAX_NEW_TOKENS)}
        if body.get("stop") is not None:
            sp["stop"] = body["stop"]
        if body.get("seed") is not None:
            sp["sampling_seed"] = body["seed"]
        name = self.name_request(body) if self.name_request is not None else None
        rid = name or "cmpl-" + uuid.uuid4().hex
        call = self._make_call(
            "/v1/completions", body, rid, rid, prompt, max(1, len(prompt.split())), sp, True
        )  # unseeded: candidates differ, as a sampler's do
        logprobs = body.get("logprobs")
        gen = _Generation(
            call, self.script(call), cumulative=False,
            return_logprob=self.returns_logprobs
            and isinstance(logprobs, int) and not isinstance(logprobs, bool),
            top_logprobs_num=int(logprobs or 0), text_in_logprobs=True, no_stop_trim=False,
        )  # fmt: skip
        options = body.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        await self._run_generation(conn, call, gen, openai=(str(body.get("model")), usage))

    async def _run_generation(
        self,
        conn: HTTPConnection,
        call: Call,
        gen: _Generation,
        openai: tuple[str, bool] | None = None,
    ) -> None:
        plan = gen.plan
        fault = plan.fault
        if fault is not None and fault.kind is FaultKind.HTTP_ERROR:
            self._record_outcome(call.rid, "fault", fault.kind)
            await conn.send_response(
                fault.status_code, _http_error_body(fault), headers=fault.headers()
            )
            return
        run = _Run(call.rid)
        self._add_running(run)
        outcome: list[str] = ["cancelled"]
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_client, conn, nursery.cancel_scope)
                try:
                    if call.stream:
                        outcome[0] = await self._stream(conn, gen, run, openai)
                    else:
                        outcome[0] = await self._unary(conn, gen, run)
                except ClientGone:
                    outcome[0] = "cancelled"
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._remove_running(run)
            result = outcome[0]
            if result.startswith("fault:"):
                self._record_outcome(call.rid, "fault", FaultKind(result[6:]))
            else:
                self._record_outcome(call.rid, result)

    async def _pre_head_fault(self, conn: HTTPConnection, fault: Fault, run: _Run) -> str | None:
        """Fire a ``before_headers`` fault; None if the response should go on (hang ended)."""
        if fault.kind is FaultKind.RESET:
            conn.reset()
        elif fault.kind is FaultKind.EOF:
            conn.close_abruptly()
        elif fault.kind is FaultKind.HANG:
            end = math.inf if fault.duration is None else trio.current_time() + fault.duration
            await run.wait_for(fault.until, end)
            return None
        else:
            return None
        return "fault:" + str(fault.kind.value)

    async def _stream(
        self,
        conn: HTTPConnection,
        gen: _Generation,
        run: _Run,
        openai: tuple[str, bool] | None = None,
    ) -> str:
        fault = gen.plan.fault
        if fault is not None and fault.before_headers:
            result = await self._pre_head_fault(conn, fault, run)
            if result is not None:
                return result
        await conn.start_response(200, _SSE_HEADERS)
        self._counts["streams"] += 1
        counts = self._counts
        deadlines = _deadlines(gen.plan, trio.current_time(), gen.steps)
        fault_at = fault.at if fault is not None and not fault.before_headers else -1
        for i in range(gen.steps):
            if i == fault_at:
                assert fault is not None
                result = await self._stream_fault(conn, gen, run, fault)
                if result is not None:
                    return result
            if not await run.wait_until(deadlines[i]):
                break
            emit = gen.step(i)
            if i < gen.limit:
                counts["tokens"] += 1
            if emit:
                await conn.send_data(_frame(gen, gen.chunk(gen.finish), openai))
                counts["chunks"] += 1
            if gen.finish is not None:
                break
        if run.aborted:
            await conn.send_data(
                _frame(gen, gen.chunk(_ABORTED, quirk=self.abort_quirk), openai)
            )
            counts["chunks"] += 1
            outcome = "aborted"
        elif gen.finish is None and gen.planned_abort is not None:
            await conn.send_data(_frame(gen, gen.chunk(gen.planned_abort), openai))
            counts["chunks"] += 1
            outcome = "aborted"
        else:
            outcome = "finished"
        if fault is not None and fault_at >= gen.steps and not run.aborted:
            result = await self._stream_fault(conn, gen, run, fault)
            if result is not None:
                return result
        if openai is not None and openai[1]:
            n = len(gen.ids)
            usage = {"prompt_tokens": gen.prompt_tokens, "completion_tokens": n,
                     "total_tokens": gen.prompt_tokens + n}  # fmt: skip
            await conn.send_data(_sse({"id": gen.call.rid, "object": "text_completion",
                                       "model": openai[0], "choices": [], "usage": usage}))
        await conn.send_data(_DONE)
        await conn.end_response()
        return outcome

    async def _stream_fault(
        self, conn: HTTPConnection, gen: _Generation, run: _Run, fault: Fault
    ) -> str | None:
        """Fire an in-stream fault; None if the stream should go on (a hang that ended)."""
        kind = fault.kind
        if kind is FaultKind.ERROR_EVENT:
            err = {
                "error": {
                    "message": fault.message,
                    "type": "invalid_request_error",
                    "code": fault.status_code,
                    "retryable": False,
                }
            }
            await conn.send_data(b"data: " + _ENCODE(err) + b"\n\n" + _DONE)
            await conn.end_response()
        elif kind is FaultKind.EOF:
            if fault.clean:
                await conn.end_response()
            else:
                conn.close_abruptly()
        elif kind is FaultKind.RESET:
            conn.reset()
        elif kind is FaultKind.MALFORMED:
            bad = b'data: {"text": "oops", "meta_info": {"id": \n\n'
            if not fault.clean:  # ``goes_on``
                await conn.send_data(bad)
                return None
            await conn.send_data(bad + _DONE)
            await conn.end_response()
        elif kind is FaultKind.HANG:
            end = math.inf if fault.duration is None else trio.current_time() + fault.duration
            await run.wait_for(fault.until, end)
            return None
        return "fault:" + str(kind.value)

    async def _unary(self, conn: HTTPConnection, gen: _Generation, run: _Run) -> str:
        fault = gen.plan.fault
        fault_at = fault.at if fault is not None else -1
        deadlines = _deadlines(gen.plan, trio.current_time(), gen.steps)
        for i in range(gen.steps + 1):
            if i == fault_at or (i == gen.steps and fault_at > gen.steps):
                assert fault is not None
                result = await self._unary_fault(conn, run, fault)
                if result is not None:
                    return result
            if i == gen.steps:
                break
            if not await run.wait_until(deadlines[i]):
                break
            gen.step(i)
            if i < gen.limit:
                self._counts["tokens"] += 1
            if gen.finish is not None:
                break
        finish = gen.finish
        if run.aborted:
            finish = _ABORTED
        elif finish is None:
            finish = gen.planned_abort
        gen.visible_len = len(gen.text) if finish is not gen.finish else gen.visible_len
        if finish is not None and finish.get("type") == "abort" and finish.get("status_code"):
            status = int(finish["status_code"])
            msg = str(finish.get("message") or "")
            body: Any = _error_message(msg) if status == 400 else {
                "object": "error", "message": msg, "type": finish.get("err_type") or str(status),
                "param": None, "code": status,
            }  # fmt: skip
            await self._json(conn, status, body)
            return "aborted"
        await self._json(conn, 200, gen.chunk(finish))
        return "aborted" if finish is not None and finish.get("type") == "abort" else "finished"

    async def _unary_fault(self, conn: HTTPConnection, run: _Run, fault: Fault) -> str | None:
        kind = fault.kind
        if kind is FaultKind.ERROR_EVENT:
            await self._json(conn, fault.status_code, _error_message(fault.message))
        elif kind is FaultKind.EOF:
            conn.close_abruptly()
        elif kind is FaultKind.RESET:
            conn.reset()
        elif kind is FaultKind.MALFORMED:
            await conn.send_response(200, b'{"text": "oops", "meta_info": {"id": ')
        elif kind is FaultKind.HANG:
            end = math.inf if fault.duration is None else trio.current_time() + fault.duration
            await run.wait_for(fault.until, end)
            return None
        return "fault:" + str(kind.value)

    # -- /v1/chat/completions ----------------------------------------------------------------

    async def _chat(self, conn: HTTPConnection, req: HTTPRequest) -> None:
        self._counts["chat"] += 1
        body = self._parse_body(req)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest(400, _openai_error("messages must be a non-empty list"))
        if body.get("continue_final_message") and not self.accepts_prefill:
            raise _BadRequest(400, _openai_error("continue_final_message is not supported"))
        prompt = "\n".join(_message_text(m) for m in messages)
        n = body.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise _BadRequest(400, _openai_error("n must be a positive integer"))
        stream = body.get("stream") is True
        sp: dict[str, Any] = {}
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        sp["max_new_tokens"] = max_tokens
        if body.get("stop") is not None:
            sp["stop"] = body["stop"]
        if body.get("seed") is not None:
            sp["sampling_seed"] = body["seed"]
        base = body.get("rid") if isinstance(body.get("rid"), str) else None
        if base is None and self.name_request is not None and n == 1:
            base = self.name_request(body)
        chat_id = base or "chatcmpl-" + uuid.uuid4().hex
        prompt_tokens = max(1, len(prompt.split()))
        gens: list[_Generation] = []
        for i in range(n):
            rid = chat_id if n == 1 else f"{chat_id}_{i}"
            call = self._make_call(
                "/v1/chat/completions", body, rid, base or "", prompt, prompt_tokens, sp,
                stream, index=i,
            )  # fmt: skip
            want = body.get("logprobs") is True and self.returns_logprobs
            gens.append(
                _Generation(
                    call, self.script(call), cumulative=False, return_logprob=want,
                    top_logprobs_num=int(body.get("top_logprobs") or 0),
                    text_in_logprobs=True, no_stop_trim=False,
                )
            )  # fmt: skip
        plan = gens[0].plan
        fault = plan.fault
        if fault is not None and fault.kind is FaultKind.HTTP_ERROR:
            self._record_outcome(chat_id, "fault", fault.kind)
            body_bytes = fault.body or _ENCODE(_openai_error(fault.message, fault.status_code))
            await conn.send_response(fault.status_code, body_bytes, headers=fault.headers())
            return
        runs = [_Run(g.call.rid) for g in gens]
        for run in runs:
            self._add_running(run)
        outcome: list[str] = ["cancelled"]
        model = body.get("model") or self.served_model_name
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_client, conn, nursery.cancel_scope)
                try:
                    outcome[0] = await self._chat_run(
                        conn, gens, runs, chat_id, str(model), stream, body
                    )
                except ClientGone:
                    outcome[0] = "cancelled"
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            for run in runs:
                self._remove_running(run)
            for g in gens:
                result = outcome[0]
                if result.startswith("fault:"):
                    self._record_outcome(g.call.rid, "fault", FaultKind(result[6:]))
                else:
                    self._record_outcome(g.call.rid, result)

    async def _chat_run(
        self,
        conn: HTTPConnection,
        gens: list[_Generation],
        runs: list[_Run],
        chat_id: str,
        model: str,
        stream: bool,
        body: dict[str, Any],
    ) -> str:
        plan = gens[0].plan
        fault = plan.fault
        created = int(time.time())
        steps = max(g.steps for g in gens)
        deadlines = _deadlines(plan, trio.current_time(), steps)
        head_sent = False
        fault_at = fault.at if fault is not None else -1
        lead = runs[0]
        role_sent: set[int] = set()

        def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            obj = {"id": chat_id, "object": "chat.completion.chunk", "created": created,
                   "model": model, "choices": choices, **extra}  # fmt: skip
            return b"data: " + _ENCODE(obj) + b"\n\n"

        for i in range(steps + 1):
            if i == fault_at or (i == steps and fault_at > steps):
                assert fault is not None
                if stream and not head_sent and not fault.before_headers and (
                    fault.kind is not FaultKind.HANG
                ):
                    await conn.start_response(200, _SSE_HEADERS)
                    head_sent = True
                result = await (
                    self._stream_fault(conn, gens[0], lead, fault) if stream and head_sent
                    else self._unary_fault(conn, lead, fault)
                )  # fmt: skip
                if result is not None:
                    return result
            if i == steps:
                break
            if not await lead.wait_until(deadlines[i]):
                break
            out: list[bytes] = []
            for g, run in zip(gens, runs, strict=True):
                if g.finish is not None or i >= g.steps or run.aborted:
                    continue
                before = g.sent_text
                emit = g.step(i)
                if i < g.limit:
                    self._counts["tokens"] += 1
                if stream and emit:
                    if g.call.index not in role_sent:
                        role_sent.add(g.call.index)
                        out.append(frame([{"index": g.call.index, "delta": {
                            "role": "assistant", "content": "", "reasoning_content": None},
                            "logprobs": None, "finish_reason": None}]))  # fmt: skip
                    delta = g.final_text()[before:]
                    g.sent_text = max(before, len(g.final_text()))
                    if delta:
                        out.append(frame([{"index": g.call.index, "delta": _chat_delta(g, delta),
                                           "logprobs": _chat_logprobs(g),
                                           "finish_reason": None}]))  # fmt: skip
            if stream and out:
                if not head_sent:
                    await conn.start_response(200, _SSE_HEADERS)
                    head_sent = True
                    self._counts["streams"] += 1
                await conn.send_data(b"".join(out))
                self._counts["chunks"] += len(out)
            if all(g.finish is not None or run.aborted for g, run in zip(gens, runs, strict=True)):
                break
        aborted = any(run.aborted for run in runs)
        finishes = []
        for g, run in zip(gens, runs, strict=True):
            f = g.finish or g.planned_abort or {"type": "stop", "matched": EOS_TOKEN_ID}
            if run.aborted:
                f = _ABORTED
            matched = f.get("matched") if f.get("type") == "stop" else None
            finishes.append((g, f["type"], matched))
        completion = sum(len(g.ids) for g in gens)
        usage = {"prompt_tokens": gens[0].prompt_tokens, "completion_tokens": completion,
                 "total_tokens": gens[0].prompt_tokens + completion}  # fmt: skip
        if not stream:
            choices = [{"index": g.call.index, "message": {"role": "assistant",
                        "content": g.final_text(), "reasoning_content": None, "tool_calls": None},
                        "logprobs": None, "finish_reason": ftype, "matched_stop": matched}
                       for g, ftype, matched in finishes]  # fmt: skip
            await self._json(conn, 200, {"id": chat_id, "object": "chat.completion",
                                         "created": created, "model": model,
                                         "choices": choices, "usage": usage})  # fmt: skip
            return "aborted" if aborted else "finished"
        out = [frame([{"index": g.call.index, "delta": {}, "logprobs": None,
                       "finish_reason": "tool_calls" if getattr(g, "calls", 0) and ftype == "stop"
                       else ftype, "matched_stop": matched}])
               for g, ftype, matched in finishes]  # fmt: skip
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            out.append(frame([], usage=usage))
        out.append(_DONE)
        if not head_sent:
            await conn.start_response(200, _SSE_HEADERS)
            self._counts["streams"] += 1
        await conn.send_data(b"".join(out))
        self._counts["chunks"] += len(out) - 1
        await conn.end_response()
        return "aborted" if aborted else "finished"


_KNOWN_PATHS = frozenset(
    {
        "/generate", "/v1/chat/completions", "/v1/completions", "/abort_request", "/health",
        "/health_generate", "/ready", "/server_info", "/get_server_info", "/model_info",
        "/get_model_info", "/v1/models", "/v1/loads", "/get_load",
    }
)  # fmt: skip


def _chat_delta(gen: _Generation, text: str) -> dict[str, Any]:
    """The chat delta of ``text``, parsed as an engine with a reasoning and a tool-call parser
    would (the scripts' tokens ``<think>`` / ``</think>`` and ``<tool_call>{json}</tool_call>``
    are whole tokens): reasoning as ``reasoning_content``, a call as ``tool_calls``."""
    state = gen.__dict__
    if text == "<think>":
        state["thinking"] = True
        return {"reasoning_content": ""}
    if text == "</think>":
        state["thinking"] = False
        return {"reasoning_content": ""}
    if state.get("thinking"):
        return {"reasoning_content": text}
    if text.startswith("<tool_call>") and text.endswith("</tool_call>"):
        call = json.loads(text[len("<tool_call>") : -len("</tool_call>")])
        k = state["calls"] = state.get("calls", 0) + 1
        fn = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        return {"tool_calls": [{"index": k - 1, "id": f"call_fake_{k}", "type": "function",
                                "function": fn}]}  # fmt: skip
    return {"content": text, "reasoning_content": None}


def _chat_logprobs(gen: _Generation) -> dict[str, Any] | None:
    """The chat ``logprobs`` of the tokens not sent yet (None when not asked for)."""
    if not gen.return_logprob:
        return None
    start = gen.__dict__.get("sent_lp", 0)
    gen.__dict__["sent_lp"] = len(gen.lp)
    content = []
    for k in range(start, len(gen.lp)):
        lp, _, tok = gen.lp[k]
        row = gen.top[k] if k < len(gen.top) else []
        content.append({"token": tok, "logprob": lp, "bytes": None,
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": None}
                                         for v, _, t in row or ()]})  # fmt: skip
    return {"content": content}


def _sse(obj: Any) -> bytes:
    return b"data: " + _ENCODE(obj) + b"\n\n"


def _frame(gen: _Generation, chunk: dict[str, Any], openai: tuple[str, bool] | None) -> bytes:
    """One SSE event of ``chunk`` (a ``/generate`` chunk), or of the ``text_completion`` chunk
    it becomes in the OpenAI-compatible mode (``openai``: the model name, usage wanted)."""
    if openai is None:
        return _sse(chunk)
    meta = chunk["meta_info"]
    choice: dict[str, Any] = {"index": 0, "text": chunk["text"], "logprobs": None,
                              "finish_reason": None}  # fmt: skip
    finish = meta["finish_reason"]
    if finish is not None:
        choice["finish_reason"] = finish["type"]
        if isinstance(finish.get("matched"), str):
            choice["stop_reason"] = finish["matched"]
    if "output_token_logprobs" in meta:
        lps = meta["output_token_logprobs"]
        tops = meta.get("output_top_logprobs")
        choice["logprobs"] = {
            "tokens": [t or "" for _, _, t in lps],
            "token_logprobs": [lp for lp, _, _ in lps],
            "top_logprobs": [{t or "": lp for lp, _, t in row} for row in tops] if tops else None,
        }
    return _sse({"id": gen.call.rid, "object": "text_completion", "model": openai[0],
                 "choices": [choice]})  # fmt: skip


async def _watch_client(conn: HTTPConnection, scope: trio.CancelScope) -> None:
    await conn.wait_client_gone()
    scope.cancel()


def _error_message(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


def _openai_error(message: str, code: int = 400) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "BadRequestError", "param": None,
            "code": code}  # fmt: skip


def _validation_error(message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "Bad Request", "param": None,
            "code": 400}  # fmt: skip


def _unknown_field(key: str) -> str:
    listed = ", ".join(f"`{f}`" for f in SAMPLING_PARAMS_FIELDS)
    return f"unknown field `{key}`, expected one of {listed}"


def _http_error_body(fault: Fault) -> bytes:
    if fault.body is not None:
        return fault.body
    if fault.status_code == 400:
        return _ENCODE(_error_message(fault.message))
    body = {"object": "error", "message": fault.message, "type": str(fault.status_code),
            "param": None, "code": fault.status_code}  # fmt: skip
    return _ENCODE(body)


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


# ---- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m engine.fake`` / ``sieproxy-engine fake`` argument parser."""
    p = argparse.ArgumentParser(
        prog="sieproxy-engine fake",
        description="Scripted fake SGLang engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: sieproxy-engine fake --port 30000 --ttft-ms 50 --itl-ms 20 --tokens 64",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=30000, help="listen port; 0 picks a free one")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    p.add_argument("--itl-ms", type=float, default=0.0, help="inter-token interval")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per generation (None: the request's max_new_tokens)")  # fmt: skip
    p.add_argument("--incremental", action="store_true", help="delta text instead of cumulative")
    p.add_argument("--model-path", default="fake/fake-model", help="reported in /model_info")
    p.add_argument("--served-model-name", default=None, help="the model's name (None: the path)")
    p.add_argument("--context-length", type=int, default=8192, help="reported context length")
    p.add_argument("--kv-events-config", default=None,
                   help="keep a prefix cache and publish KV events (SGLang's JSON, as the CPU "
                        "engine takes it; engine/fake_cache.py)")  # fmt: skip
    p.add_argument("--prefix-cache-tokens", type=int, default=4096,
                   help="that cache's size in tokens")  # fmt: skip
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json to tokenize text prompts with (None: by words)")
    p.add_argument("--chat-only", action="store_true",
                   help="serve only /v1/chat/completions and /v1/models, as hosted "
                        "OpenAI-compatible endpoints do")  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run a fake engine with the default script; prints ``listening on <url>`` once bound."""
    args = build_parser().parse_args(argv)
    engine = FakeEngine(
        DefaultScript(ttft=args.ttft_ms / 1000, itl=args.itl_ms / 1000, tokens=args.tokens),
        incremental=args.incremental,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        context_length=args.context_length,
        chat_only=args.chat_only,
    )
    if args.kv_events_config:
        from engine.fake_cache import FakePrefixCache

        engine.prefix_cache = FakePrefixCache(
            args.tokenizer,
            capacity_tokens=args.prefix_cache_tokens,
            kv_events_config=args.kv_events_config,
        )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(engine.serve, args.host, args.port)
            print(f"fake engine listening on http://{args.host}:{port}", flush=True)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
