"""Resuming a broken stream: what to send to continue a candidate, and how its events read on.

A candidate whose engine stream breaks *after it produced output* (the connection cut, an
engine error event, a stall past ``token_gap_timeout``, a malformed event its protocol cannot
skip) is continued on another replica, the same one or a fallback (``sieproxy.relay.resume``). This
module decides, without I/O, the three things that needs:

- **whether** the failure is a break that may be resumed, and its cause (:func:`break_cause`):

      EngineTruncated (EOF or reset mid-body, [DONE] before the finish)  cut
      an engine error event or abort finish with a 5xx (not a refusal)     error_event
      the token gap fired (the shell's cause ``timeout``)                  stall
      EngineMalformed (a protocol or mode that cannot skip it)             malformed
      anything else: a 4xx refusal (a content filter), the request deadline, the client
      leaving, a stall of the client, the gateway ending it              not resumed

- **what to send** (:func:`continuation`): the candidate's *original* planned body (the
  model's; after a fallback, the fallback model's) plus everything the candidate produced so
  far (:class:`Progress`, summed over its attempts):

  * a prompt body (``text``: SGLang native, and the gateway-rendered OpenAI mode, whose
    ``text`` becomes the ``prompt``): ``text`` + the output so far;
  * a chat pass-through body (``chat``: ``render = "engine"``): the messages plus an assistant
    message holding the output so far, with vLLM's ``continue_final_message: true`` and
    ``add_generation_prompt: false`` (the engine renders the turn open, as a prefill). Output
    the engine parsed itself (reasoning, tool-call fragments) cannot be put back into a
    prefill faithfully: such a candidate is not resumed (:class:`NotResumable`);
  * ``max_new_tokens`` / ``max_tokens`` reduced by the tokens produced (none left: no request,
    the candidate ends with ``length``), ``min_new_tokens`` / ``min_tokens`` likewise; every
    other sampling parameter and the seed unchanged;
  * a fresh rid, ``<request id>.c<k>-<index>`` for the candidate's ``k``-th resume (an abort
    of the broken rid can never reach it; the index stays last).

- **how the new stream reads** (:class:`ResumedReader`): the new attempt's reader, wrapped so
  that its events continue the old ones: token counts offset by the tokens already produced,
  the prompt counted as the client's prompt (not the continued one), and its own output added
  to the progress for a further resume. The text of the new stream is only the continuation
  (both protocols return the output, not the prompt), so nothing is repeated or lost; the
  choice's pipeline (stop strings, parsers) and the response's ids live on in the shaper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import (
    EngineAborted,
    EngineMalformed,
    EngineStreamError,
    EngineTimeout,
    EngineTruncated,
    GatewayError,
    UpstreamError,
)
from ..shaping.events import CandidateDelta, CandidateFinish

if TYPE_CHECKING:
    from .protocol import CandidateReader, ExpressLane

__all__ = [
    "CAUSES",
    "NotResumable",
    "Progress",
    "ResumedReader",
    "break_cause",
    "continuation",
    "resumed_rid",
]

#: The causes of a resume, as counted (``sieproxy_resumes_total{cause}``, the access log).
CAUSES = ("cut", "error_event", "stall", "malformed")


@dataclass(frozen=True, slots=True)
class Progress:
    """What one candidate produced so far, over all its attempts: the raw output text (before
    the gateway's stop strings and parsers), the completion tokens the engines counted, the
    client's prompt tokens (0: not reported yet), and whether the engine sent output it
    parsed itself (reasoning or tool-call fragments, which a prefill cannot carry)."""

    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    parsed: bool = False
    #: The engine's finish, read but held for a usage chunk that never came (the OpenAI
    #: protocol): a stream cut then is complete, with the counts read so far.
    finish: CandidateFinish | None = None

    @property
    def any(self) -> bool:
        """Something was produced (a candidate without output is not resumed but retried)."""
        return bool(self.text) or self.tokens > 0 or self.parsed

    def then(self, more: Progress) -> Progress:
        """This progress followed by ``more`` (the next attempt's own)."""
        return Progress(
            self.text + more.text,
            self.tokens + more.tokens,
            self.prompt_tokens or more.prompt_tokens,
            self.parsed or more.parsed,
        )


class NotResumable(Exception):
    """The candidate cannot be continued; ``str(exc)`` says why (for the gateway's log)."""


def break_cause(err: GatewayError, ended: str | None) -> str | None:
    """The resume cause of a candidate's failure ``err`` (one of :data:`CAUSES`), or None when
    it is not a break to resume; ``ended`` is why the gateway ended the candidate, if it did
    (``timeout``: the token gap fired; any other is not resumed)."""
    if ended is not None:
        return "stall" if ended == "timeout" and isinstance(err, EngineTimeout) else None
    if not isinstance(err, UpstreamError) or err.refusal is not None or err.status < 500:
        return None  # a refusal (4xx): the request itself; not the engine breaking
    if isinstance(err, EngineTimeout):
        return None  # the deadline, or a first-token timeout (before any output)
    if isinstance(err, EngineMalformed):
        return "malformed"
    if isinstance(err, EngineStreamError | EngineAborted):
        return "error_event"
    if isinstance(err, EngineTruncated):
        return "cut"
    return "cut"  # another engine failure mid-body (the connection broke)


def resumed_rid(rid: str, k: int) -> str:
    """The rid of a candidate's ``k``-th resume: ``<head>-<index>`` → ``<head>.c<k>-<index>``."""
    head, dash, index = rid.rpartition("-")
    return f"{head}.c{k}{dash}{index}" if dash else f"{rid}.c{k}"


def _left(cap: Any, used: int) -> int | None:
    """What is left of a token cap (None: no cap)."""
    if cap is None or isinstance(cap, bool) or not isinstance(cap, int):
        return None
    return cap - used


def continuation(body: dict[str, Any], done: Progress, k: int) -> dict[str, Any] | None:
    """The planned body that continues ``body``'s candidate after ``done`` (its ``k``-th
    resume), or None when its token budget is used up (the candidate ends with ``length``);
    :class:`NotResumable` when it cannot be continued (the module docstring)."""
    out = dict(body)
    rid = body.get("rid")
    if isinstance(rid, str):
        out["rid"] = resumed_rid(rid, k)
    if "chat" in body:
        return _chat(out, body["chat"], done)
    text = body.get("text")
    if not isinstance(text, str):
        raise NotResumable("the prompt is not text (token ids): its continuation is unknown")
    sp = dict(body.get("sampling_params") or {})
    left = _left(sp.get("max_new_tokens"), done.tokens)
    if left is not None:
        if left <= 0:
            return None
        sp["max_new_tokens"] = left
    least = _left(sp.get("min_new_tokens"), done.tokens)
    if least is not None:
        if least > 0:
            sp["min_new_tokens"] = least
        else:
            del sp["min_new_tokens"]
    out["text"] = text + done.text
    out["sampling_params"] = sp
    return out


def _chat(out: dict[str, Any], chat: dict[str, Any], done: Progress) -> dict[str, Any] | None:
    if done.parsed:
        raise NotResumable(
            "the engine sent reasoning or tool calls it parsed itself; a prefill cannot "
            "carry them back"
        )
    c = dict(chat)
    left = _left(c.get("max_tokens"), done.tokens)
    if left is not None:
        if left <= 0:
            return None
        c["max_tokens"] = left
    least = _left(c.get("min_tokens"), done.tokens)
    if least is not None:
        if least > 0:
            c["min_tokens"] = least
        else:
            del c["min_tokens"]
    c["messages"] = [*chat.get("messages", []), {"role": "assistant", "content": done.text}]
    c["continue_final_message"] = True
    c["add_generation_prompt"] = False
    out["chat"] = c
    return out


class ResumedReader:
    """The reader of a resumed attempt: ``inner``'s events continued after ``base`` (token
    counts offset, the client's prompt counted; the module docstring). No express lane: every
    read of a resumed stream takes the general path."""

    __slots__ = ("base", "inner")

    def __init__(self, inner: CandidateReader, base: Progress) -> None:
        self.inner = inner
        self.base = base

    @property
    def done(self) -> bool:
        return self.inner.done

    @property
    def finished(self) -> bool:
        return self.inner.finished

    def _prompt(self, reported: int) -> int:
        """The client's prompt tokens: the first attempt's count, else the continued prompt's
        count less the output it carried (an estimate: the tokenization of the boundary)."""
        base = self.base
        if base.prompt_tokens:
            return base.prompt_tokens
        return max(reported - base.tokens, 0) if reported else 0

    def _finish(self, f: CandidateFinish) -> CandidateFinish:
        return CandidateFinish(
            reason=f.reason,
            matched=f.matched,
            prompt_tokens=self._prompt(f.prompt_tokens),
            completion_tokens=self.base.tokens + f.completion_tokens,
            cached_tokens=f.cached_tokens,
            reasoning_tokens=f.reasoning_tokens,
        )

    def feed(
        self, data: bytes
    ) -> tuple[list[CandidateDelta | CandidateFinish], GatewayError | None]:
        events, err = self.inner.feed(data)
        base = self.base.tokens
        out: list[CandidateDelta | CandidateFinish] = []
        for ev in events:
            if isinstance(ev, CandidateDelta):
                ev = CandidateDelta(
                    ev.text,
                    base + ev.completion_tokens,
                    ev.logprobs,
                    self._prompt(ev.prompt_tokens),
                    ev.reasoning,
                    ev.tool_calls,
                )
            else:
                ev = self._finish(ev)
            out.append(ev)
        return out, err

    def eof(self) -> None:
        self.inner.eof()

    def local_finish(self, reason: str = "abort") -> CandidateFinish:
        return self._finish(self.inner.local_finish(reason))

    def express(self, shaper: object, index: int = 0) -> ExpressLane | None:
        return None

    def progress(self) -> Progress:
        """Everything produced: the attempts before, then this one's."""
        own = self.inner.progress()
        done = self.base.then(Progress(own.text, own.tokens, 0, own.parsed))
        if own.finish is None:
            return done
        return Progress(done.text, done.tokens, done.prompt_tokens, done.parsed,
                        self._finish(own.finish))  # fmt: skip
