"""Engine refusals: what the engine's 4xx text means, and the gateway's own words for it.

An engine refuses a request it cannot run — a prompt longer than the context, a completion that
would overflow it, a grammar it cannot compile, a ``logit_bias`` id outside the vocabulary — with
a 400 (before the stream) or a 4xx in the stream (an ``error`` object, or an abort finish reason
with a status code). Its text is never echoed to a client. The boundaries that meet it
(``sieproxy.fleet.client`` for the status line, ``core.upstream.sglang`` for the stream) call
:func:`classify` once, which matches the text against :data:`_TABLE` — the patterns of SGLang's
``TokenizerManager`` / scheduler messages and of the CPU engine, which uses the same wording —
and keeps only the kind and the numbers. The relay then calls :func:`explain` with the request's
own field names (:class:`RequestFields`: ``messages`` or ``prompt``, ``max_tokens`` or
``max_completion_tokens``, ``response_format`` or ``tools``) to build the client's error.

    kind               engine text (SGLang and CPU engine)            param / code
    prompt_too_long    "The input (N tokens) is longer than the       messages | prompt
                       model's context length (C tokens)"             context_length_exceeded
    context_exceeded   "Requested token count exceeds the model's     max_tokens (or the prompt
                       maximum context length of C tokens. You        field when N >= C)
                       requested a total of T tokens: N ... M ..."    context_length_exceeded
    logit_bias         "logit_bias must has keys in [0, V-1], got X"  logit_bias
    grammar            "Invalid grammar request ...", "invalid        response_format | tools
                       json_schema: ...", "... json_schema, regex,
                       ebnf ..."
    max_tokens         "max_new_tokens must be ..."                   max_tokens
    (by the OpenAI error envelope's code or type, when the text says nothing above:)
    context_length     context_length_exceeded, string_above_max_    messages | prompt
                       length                                         context_length_exceeded
    content_policy     content_policy_violation, content_filter,      messages | prompt
                       invalid_prompt                                 content_policy_violation
    engine_model       model_not_found (the engine's model name)      model / model_not_found
    other              anything else                                  none (a generic sentence)

The gateway also checks what it can before sending (``core.validate``: ``logit_bias`` ids against
a known vocabulary size, ``max_tokens`` against a known context length) with the same words,
and words what only the answer shows: an engine that returns no logprobs, so that ``best_of``
cannot rank (:func:`best_of_without_logprobs`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import EngineStreamError, GatewayError, InvalidRequest, RequestError

__all__ = [
    "ContextLengthExceeded",
    "Refusal",
    "RequestFields",
    "best_of_without_logprobs",
    "classify",
    "classify_error",
    "engine_message",
    "engine_stream_error",
    "explain",
    "logit_bias_out_of_vocab",
    "max_tokens_over_context",
]


@dataclass(frozen=True, slots=True)
class Refusal:
    """What an engine's refusal said, without its text: the kind and the numbers it gave."""

    kind: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    context_length: int | None = None
    token_id: int | None = None
    vocab_size: int | None = None


@dataclass(frozen=True, slots=True)
class RequestFields:
    """The request's own names for what an engine can refuse."""

    prompt: str = "messages"  # "prompt" on /v1/completions
    max_tokens: str = "max_tokens"  # or "max_completion_tokens", the one the client sent
    grammar: str = "response_format"  # or "tools" when the constraint came from tool_choice


_Build = Callable[[re.Match[str]], Refusal]


def _prompt_too_long(m: re.Match[str]) -> Refusal:
    return Refusal(
        "prompt_too_long", prompt_tokens=int(m["n"]), context_length=int(m["ctx"])
    )


def _context_exceeded(m: re.Match[str]) -> Refusal:
    return Refusal(
        "context_exceeded",
        prompt_tokens=int(m["n"]),
        completion_tokens=int(m["m"]),
        context_length=int(m["ctx"]),
    )


def _logit_bias(m: re.Match[str]) -> Refusal:
    top, got = m["top"], m["got"]
    return Refusal(
        "logit_bias",
        vocab_size=int(top) + 1 if top is not None else None,
        token_id=int(got) if got is not None else None,
    )


def _kind(kind: str) -> _Build:
    return lambda _m: Refusal(kind)


#: Engine text -> refusal, first match wins (matched case-insensitively, anywhere in the text).
_TABLE: tuple[tuple[re.Pattern[str], _Build], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE | re.DOTALL), build)
    for pattern, build in (
        (
            r"input \((?P<n>\d+) tokens\) is longer than the model's context length "
            r"\((?P<ctx>\d+) tokens\)",
            _prompt_too_long,
        ),
        (
            r"maximum context length of (?P<ctx>\d+) tokens.*?total of \d+ tokens: "
            r"(?P<n>\d+) tokens from the input messages and (?P<m>\d+) tokens for the completion",
            _context_exceeded,
        ),
        (r"logit_bias(?:.*?\[0, (?P<top>\d+)\], got (?P<got>-?\d+))?", _logit_bias),
        (r"grammar|json_schema|json schema|regex|ebnf|structural_tag", _kind("grammar")),
        (r"max_new_tokens", _kind("max_tokens")),
    )
)


def classify(text: str | None) -> Refusal:
    """The refusal an engine's 4xx ``text`` describes (``other`` when nothing matches)."""
    if text:
        for pattern, build in _TABLE:
            m = pattern.search(text)
            if m is not None:
                return build(m)
    return Refusal("other")


#: An OpenAI error envelope's ``code`` (or ``type``) -> refusal kind: what OpenAI-compatible
#: engines and hosted endpoints say without a text the table above knows.
_CODES = {
    "context_length_exceeded": "context_length",
    "string_above_max_length": "context_length",
    "content_policy_violation": "content_policy",
    "content_filter": "content_policy",
    "invalid_prompt": "content_policy",
    "model_not_found": "engine_model",
}


def classify_error(obj: Any) -> Refusal:
    """The refusal an engine's error body describes: its text (:func:`classify`), else the
    ``code`` / ``type`` of its OpenAI error envelope (``{"error": {"code", "type", ...}}`` or
    ``{"object": "error", ...}``)."""
    r = classify(engine_message(obj))
    if r.kind != "other" or not isinstance(obj, dict):
        return r
    err = obj.get("error", obj)
    if isinstance(err, dict):
        for key in ("code", "type"):
            kind = _CODES.get(str(err.get(key) or "").lower())
            if kind is not None:
                return Refusal(kind)
    return r


def engine_message(obj: Any) -> str | None:
    """The message of an engine's error JSON, in any of SGLang's shapes: ``{"error": "text"}``
    (contract check), ``{"error": {"message": ...}}`` (validation, stream error) or
    ``{"object": "error", "message": ...}`` (FastAPI); for classification only."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, str):
            return err
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
    return None


class ContextLengthExceeded(RequestError):
    """The prompt, or the prompt and the completion's cap together, exceed the context."""

    code = "context_length_exceeded"


_OTHER = (
    "The engine refused the request; check that the prompt and max_tokens fit the model's "
    "context and that every parameter is in range."
)


def explain(r: Refusal, f: RequestFields) -> GatewayError:
    """The client's 400 for refusal ``r`` of a request whose field names are ``f``."""
    where = "messages" if f.prompt == "messages" else "prompt"
    ctx, n, m = r.context_length, r.prompt_tokens, r.completion_tokens
    if r.kind == "prompt_too_long" or (r.kind == "context_exceeded" and n is not None
                                       and ctx is not None and n >= ctx):  # fmt: skip
        return ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens, and the {where} alone are "
            f"{n} tokens; shorten the {where}.",
            param=f.prompt,
        )
    if r.kind == "context_exceeded":
        assert ctx is not None and n is not None and m is not None
        room = max(ctx - n, 0)
        return ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens, but {n + m} tokens were "
            f"requested ({n} in the {where} and {m} for the completion); set `{f.max_tokens}` "
            f"to at most {room} or shorten the {where}.",
            param=f.max_tokens,
        )
    if r.kind == "logit_bias":
        if r.vocab_size is not None:
            return logit_bias_out_of_vocab(r.token_id, r.vocab_size)
        return InvalidRequest(
            "A `logit_bias` key is not a token id of this model; remove it.", param="logit_bias"
        )
    if r.kind == "grammar":
        what = "JSON schema" if f.grammar == "response_format" else "tools' parameter schemas"
        return InvalidRequest(
            f"The engine could not compile the {what} into a decoding grammar; check "
            f"`{f.grammar}` (a valid JSON Schema the engine supports).",
            param=f.grammar,
        )
    if r.kind == "context_length":  # the engine's code, without numbers
        return ContextLengthExceeded(
            f"The {where} and `{f.max_tokens}` together exceed this model's maximum context "
            f"length; shorten the {where} or lower `{f.max_tokens}`.",
            param=f.prompt,
        )
    if r.kind == "content_policy":
        err = InvalidRequest(
            f"The engine's content policy refused this request; change the {where} (retrying "
            "the same request gets the same answer).",
            param=f.prompt,
        )
        err.code = "content_policy_violation"
        return err
    if r.kind == "engine_model":
        err = InvalidRequest(
            "The engine behind this model does not serve it under the gateway's model name (or "
            "the `lora_adapter` name); the operator must align the engine's served model name.",
            param="model",
        )
        err.code = "model_not_found"
        return err
    if r.kind == "max_tokens":
        return InvalidRequest(
            f"The engine refused `{f.max_tokens}`; lower it to fit the model's context.",
            param=f.max_tokens,
        )
    return InvalidRequest(_OTHER)


def logit_bias_out_of_vocab(token_id: int | None, vocab_size: int) -> InvalidRequest:
    """``logit_bias`` names an id the model's vocabulary does not have."""
    which = f"token id {token_id}" if token_id is not None else "a token id"
    return InvalidRequest(
        f"`logit_bias` has {which}, outside this model's vocabulary of {vocab_size} tokens "
        f"(ids 0 to {vocab_size - 1}); remove it.",
        param="logit_bias",
    )


def best_of_without_logprobs() -> InvalidRequest:
    """``best_of`` ranks by the engine's token logprobs, and the engine returned none."""
    return InvalidRequest(
        "`best_of` ranks the candidates by their token logprobs, but the engine behind this "
        "model returns no logprobs, so best_of cannot rank; remove `best_of` (or set it to "
        "`n`).",
        param="best_of",
    )


def max_tokens_over_context(param: str, value: int, context_length: int) -> ContextLengthExceeded:
    """``max_tokens`` alone leaves no room for a prompt in the model's context."""
    return ContextLengthExceeded(
        f"`{param}` is {value}, but this model's maximum context length is {context_length} "
        f"tokens, prompt included; set `{param}` to less than {context_length}.",
        param=param,
    )


def engine_stream_error(error: Any) -> EngineStreamError:
    """The error for an ``{"error": ...}`` payload in an engine's stream (either protocol): a
    400 refusal, classified, when its code is 4xx, else the engine failing. The engine's text
    is never echoed."""
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
        err = EngineStreamError(
            "The engine refused the request; check that the prompt and max_tokens fit the "
            "model's context."
        )
        err.status = 400
        err.type = "invalid_request_error"
        err.code = "invalid_request"
        err.refusal = classify_error({"error": error})
        return err
    return EngineStreamError("The engine failed while generating; retry the request.")
