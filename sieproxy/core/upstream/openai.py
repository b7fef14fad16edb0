"""The OpenAI-compatible upstream protocol (``protocol = "openai"``).

For engines that speak OpenAI's HTTP API (vLLM, llama.cpp's server, TGI, SGLang's own OpenAI
server): one upstream request per candidate, always a single streamed generation.

The request
-----------
The gateway plans every request itself (the chat template, tools and ``response_format`` in the
prompt, the stop strings, per-candidate seeds: :mod:`sieproxy.core.plan`) and runs its own
reasoning and tool-call parsers on each candidate's text. So that a model behaves exactly as it
does behind SGLang, the candidate's request is the planned *prompt*, sent to the engine's
``POST /v1/completions`` — for chat requests too: an engine's ``/v1/chat/completions`` would
render its own template and parse tools its own way. Field by field, from the planned body
(``docs/CONFIGURATION.md``, "The OpenAI-compatible protocol", has the same table):

    text                          → prompt
    (the gateway's model name)    → model
    stream                        → stream: true, stream_options.include_usage: true
    (always)                      → n: 1 (fan-out and best_of stay the gateway's)
    max_new_tokens                → max_tokens
    stop                          → stop
    temperature, top_p, frequency_penalty, presence_penalty, logit_bias → the same names
    sampling_seed                 → seed
    top_k, min_new_tokens, repetition_penalty, skip_special_tokens, ignore_eos
                                  → top_k, min_tokens, repetition_penalty,
                                    skip_special_tokens, ignore_eos (the extra sampling
                                    fields vLLM and SGLang's OpenAI server accept; an engine
                                    without them ignores or refuses them: its 4xx becomes the
                                    client's 400)
    json_schema                   → response_format {"type": "json_schema", ...}
    regex, ebnf                   → regex, ebnf (SGLang's OpenAI server's extra fields)
    return_logprob + top_logprobs_num → logprobs: N (the legacy API's top-N; 0 still returns
                                    the chosen tokens' logprobs, which ``best_of`` ranks by)
    lora_path                     → model (the adapter is served as a model of that name)
    image_data                    → refused (400, ``messages``): the legacy completions API has
                                    no image input
    rid                           → not sent (OpenAI has no request ids to abort by)

The reader
----------
SSE ``data:`` payloads of ``text_completion`` chunks: ``choices[0].text`` is a delta;
``choices[0].logprobs`` holds ``tokens`` / ``token_logprobs`` / ``top_logprobs`` (no token
ids: ``-1``); ``finish_reason`` (``stop`` / ``length``; vLLM's ``stop_reason`` names the matched
stop) ends the candidate, whose finish is emitted when the usage chunk (``choices: []``,
``usage``) or ``[DONE]`` arrives, so that it carries the engine's token counts. Until the usage
arrives, the completion count is the number of logprob tokens (else of text chunks) seen. A
payload with an ``error`` object is the engine failing mid-stream (4xx codes: refusals).

A planned body with a ``chat`` key is a chat the engine renders (``render = "engine"``, the
default for these engines): :mod:`sieproxy.core.openai_chat` makes its request (to
``/v1/chat/completions``) and its reader; what follows is the gateway-rendered mode's.

The abort is closing the candidate's connection (:meth:`OpenAICompat.abort` is ``None``);
health is ``/health``, else ``/v1/models``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ..errors import (
    EngineMalformed,
    EngineTruncated,
    GatewayError,
    InvalidRequest,
)
from ..shaping.events import CandidateDelta, CandidateFinish, TokenLogprob, TopLogprob
from .openai_chat import NEG_INF_LOGPROB, OpenAIChatReader, chat_request, stream_error
from .resume import Progress
from .sse import SSEDecoder

__all__ = ["OPENAI", "OpenAICompat", "OpenAIReader"]


class _Logprobs(msgspec.Struct, gc=False):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float | None] | None] | None = None


class _Choice(msgspec.Struct, gc=False):
    text: str = ""
    index: int = 0
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None


class _Chunk(msgspec.Struct, gc=False):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_decode = msgspec.json.Decoder(_Chunk).decode

# Planned sampling parameters sent under the same name, and those renamed.
_SAME = (
    "stop",
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "top_k",
    "repetition_penalty",
    "skip_special_tokens",
    "ignore_eos",
    "regex",
    "ebnf",
)
_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}


class OpenAIReader:
    """One candidate's streamed ``/v1/completions`` body (a :class:`~.protocol.CandidateReader`;
    see the module docstring)."""

    __slots__ = ("_decoder", "_finish", "_finished", "_pieces", "_prompt", "_tokens", "done")

    def __init__(self, *, max_line: int = 1 << 20) -> None:
        self._decoder = SSEDecoder(max_line)
        self._pieces: list[str] = []  # the text so far (a resume continues after it)
        self._tokens = 0
        self._prompt = 0
        self._finish: CandidateFinish | None = None  # read, waiting for the usage
        self._finished = False
        self.done = False

    @property
    def finished(self) -> bool:
        return self._finished

    def feed(
        self, data: bytes
    ) -> tuple[list[CandidateDelta | CandidateFinish], GatewayError | None]:
        out: list[CandidateDelta | CandidateFinish] = []
        try:
            for payload in self._decoder.feed(data):
                self._payload(payload, out)
                if self.done:
                    break
        except GatewayError as err:
            return out, err
        return out, None

    def _payload(self, payload: str, out: list[CandidateDelta | CandidateFinish]) -> None:
        if self.done:
            raise EngineMalformed()
        if payload == "[DONE]":
            self.done = True
            if self._finish is None:  # the stream ended without the candidate's finish
                raise EngineTruncated("The engine ended the stream before the generation finished.")
            if not self._finished:
                self._finished = True
                out.append(self._finish)
            return
        try:
            chunk = _decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EngineMalformed() from exc
        if chunk.error is not None:
            raise stream_error(chunk.error)
        if self._finished or len(chunk.choices) > 1:
            raise EngineMalformed()
        if chunk.choices:
            choice = chunk.choices[0]
            if self._finish is not None:
                raise EngineMalformed()  # output after the finish
            lps = self._logprobs(choice.logprobs)
            self._tokens += len(lps) if choice.logprobs is not None else (1 if choice.text else 0)
            if choice.text or lps:
                if choice.text:
                    self._pieces.append(choice.text)
                out.append(CandidateDelta(choice.text, self._tokens, lps, self._prompt))
            if choice.finish_reason is not None:
                matched = choice.stop_reason if isinstance(choice.stop_reason, str) else None
                self._finish = CandidateFinish(
                    reason=choice.finish_reason, matched=matched,
                    prompt_tokens=self._prompt, completion_tokens=self._tokens,
                )  # fmt: skip
        if chunk.usage is not None:
            u = chunk.usage
            self._prompt, self._tokens = u.prompt_tokens, u.completion_tokens
            cached = (u.prompt_tokens_details or {}).get("cached_tokens")
            if self._finish is not None:
                f = self._finish
                self._finish = CandidateFinish(
                    reason=f.reason, matched=f.matched, prompt_tokens=u.prompt_tokens,
                    completion_tokens=u.completion_tokens,
                    cached_tokens=cached if isinstance(cached, int) else 0,
                )  # fmt: skip
                self._finished = True
                out.append(self._finish)

    @staticmethod
    def _logprobs(lp: _Logprobs | None) -> list[TokenLogprob]:
        if lp is None:
            return []
        tops = lp.top_logprobs or []
        out: list[TokenLogprob] = []
        for i, (token, value) in enumerate(zip(lp.tokens, lp.token_logprobs, strict=False)):
            row = tops[i] if i < len(tops) else None
            top = [
                TopLogprob(t, -1, NEG_INF_LOGPROB if v is None else v)
                for t, v in (row or {}).items()
            ]
            out.append(TokenLogprob(token, -1, NEG_INF_LOGPROB if value is None else value, top))
        return out

    def eof(self) -> None:
        if not (self.done or self._finished):
            self._decoder.close()
            raise EngineTruncated()

    def local_finish(self, reason: str = "abort") -> CandidateFinish:
        return CandidateFinish(
            reason=reason, prompt_tokens=self._prompt, completion_tokens=self._tokens
        )

    def express(self, shaper: object, index: int = 0) -> None:
        return None  # no fast path: every read takes ``feed``

    def progress(self) -> Progress:
        """The output so far (for a resume, ``core.upstream.resume``)."""
        held = None if self._finished else self._finish
        return Progress("".join(self._pieces), self._tokens, self._prompt, finish=held)


class OpenAICompat:
    """OpenAI's HTTP API as an :class:`~.protocol.EngineProtocol` (module docstring)."""

    name = "openai"
    health_paths: tuple[str, ...] = ("/health", "/v1/models")
    server_info = False

    def request(
        self, body: dict[str, Any], endpoint: str, model: str
    ) -> tuple[str, dict[str, Any]]:
        if "chat" in body:  # a chat the engine renders (``core.openai_chat``)
            return chat_request(body, model)
        if body.get("image_data"):
            raise InvalidRequest(
                "Images are not supported by this model's engine (an OpenAI-compatible "
                "upstream takes text prompts only); remove the image parts.",
                param="messages",
            )
        sp: dict[str, Any] = body.get("sampling_params", {})
        out: dict[str, Any] = {
            "model": body.get("lora_path") or model,
            "prompt": body["text"],
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for key in _SAME:
            if key in sp:
                out[key] = sp[key]
        for key, name in _RENAMED.items():
            if key in sp:
                out[name] = sp[key]
        if "json_schema" in sp:
            schema = json.loads(sp["json_schema"])
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "response", "schema": schema},
            }
        if body.get("return_logprob"):
            out["logprobs"] = int(body.get("top_logprobs_num") or 0)
        return "/v1/completions", out

    def reader(
        self, *, incremental: bool, max_line: int, body: dict[str, Any] | None = None
    ) -> OpenAIReader | OpenAIChatReader:
        if body is not None and "chat" in body:
            return OpenAIChatReader(max_line=max_line)
        return OpenAIReader(max_line=max_line)

    def abort(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        return None  # closing the candidate's connection is the abort


#: The one instance (``protocol = "openai"``).
OPENAI = OpenAICompat()
