"""Chat as chat: engine-rendered requests to an OpenAI-compatible engine (``render = "engine"``).

For a model whose engines speak OpenAI's API (``protocol = "openai"``) the default is that the
*engine* renders the conversation with its own chat template and parses tool calls and
reasoning with its own parsers (what vLLM, SGLang's OpenAI server, llama.cpp's server and hosted
endpoints do with ``/v1/chat/completions``). The gateway still validates the request, fans out
``n`` / ``best_of`` itself (one upstream request per candidate, always ``n = 1``), enforces the
stop strings, deadlines and aborts, and shapes the client's response with its own order contract.
The gateway-rendered mode (``render = "gateway"``: :mod:`sieproxy.core.plan`, the prompt sent to
``/v1/completions``) stays available per model.

The plan
--------
:func:`plan_engine_chat` makes one planned body per candidate: ``{"rid", "chat"}``, where
``chat`` is the OpenAI chat body without ``model``, ``n`` and ``stream`` (added by
:func:`chat_request`). Field by field (``docs/CONFIGURATION.md``, "Rendering", has the same
table):

    messages                 → messages (roles normalized: developer → system; content parts
                               as OpenAI's: text, image_url with its data: URI; input_text /
                               input_image of /v1/responses become those; a replayed
                               assistant turn's refusal and reasoning_content are dropped)
    tools, tool_choice, parallel_tool_calls, response_format → the same (a json_schema format
                               without a name is named "response")
    chat_template_kwargs     → chat_template_kwargs (vLLM and SGLang pass them to the template)
    max_completion_tokens / max_tokens / the model's default → max_tokens (the validated cap)
    stop (+ the model's stop strings) → stop
    temperature, top_p, frequency_penalty, presence_penalty, logit_bias → the same
    seed                     → seed + index (as for the gateway-rendered mode)
    top_k, min_tokens, repetition_penalty, ignore_eos → the same (vLLM's and SGLang's extra
                               sampling fields)
    logprobs, top_logprobs   → the same, top_logprobs always (0 when not asked: llama.cpp's
                               server sends no chat logprobs without it); logprobs: true also
                               when best_of must rank
    lora_adapter             → model (the adapter is served as a model of that name)
    include_reasoning        → not sent: the gateway shows or hides the engine's reasoning
    schema_in_prompt, user, safety_identifier, prompt_cache_key, routing_key → not sent

The plan has no tool or reasoning parser (the engine parsed), and its prefix-affinity key is a
hash of the conversation's opening as data: the tools and the messages up to the first user
message (:func:`opening_key`; :mod:`sieproxy.core.affinity` says why the opening).

The reader
----------
:class:`OpenAIChatReader` reads ``chat.completion.chunk`` SSE payloads of one candidate:
``delta.content`` → the candidate's text; ``delta.reasoning_content`` (or vLLM's newer
``delta.reasoning``) → its reasoning; ``delta.tool_calls`` → tool-call fragments (id and name on
a call's first); ``logprobs.content`` → token logprobs (no token ids: ``-1``), which ``best_of``
ranks by; ``finish_reason`` ends the candidate, whose finish waits for the usage chunk
(``choices: []``) or ``[DONE]`` so that it carries the engine's token counts. Until the usage
arrives, the completion count is the number of logprob tokens (else of chunks with output)
seen. A payload with an ``error`` object is the engine failing mid-stream.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import EngineMalformed, EngineTruncated, GatewayError
from ..planning.affinity import prefix_key
from ..planning.plan import ChatPlan, candidate_seed, merge_stops
from ..request.profile import ModelProfile
from ..request.refusal import engine_stream_error
from ..request.valid import ValidChat
from ..shaping.events import (
    CandidateDelta,
    CandidateFinish,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
)
from .resume import Progress
from .sse import SSEDecoder

__all__ = [
    "NEG_INF_LOGPROB",
    "OpenAIChatReader",
    "chat_messages",
    "chat_request",
    "opening_key",
    "plan_engine_chat",
    "stream_error",
]

_KEY_ENCODER = msgspec.json.Encoder(order="sorted")
#: The logprob of a token the engine reports as impossible (``null``: ``-inf`` in JSON terms).
NEG_INF_LOGPROB = -9999.0


def stream_error(error: Any) -> GatewayError:
    """The error of an engine's mid-stream ``{"error": ...}`` payload (its 4xx: a refusal)."""
    if isinstance(error, dict) and isinstance(error.get("code"), str) and error["code"].isdigit():
        error = {**error, "code": int(error["code"])}  # vLLM and others send it as a string
    return engine_stream_error(error)


# ---------------------------------------------------------------- the plan


def _part(part: dict[str, Any]) -> dict[str, Any]:
    kind = part.get("type")
    if kind in ("text", "input_text"):
        return {"type": "text", "text": part.get("text", "")}
    ref = part.get("image_url")
    url = ref if isinstance(ref, str) else (ref or {}).get("url")
    image: dict[str, Any] = {"url": url}
    detail = part.get("detail") or (ref.get("detail") if isinstance(ref, dict) else None)
    if detail is not None:
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def chat_messages(valid: ValidChat) -> list[dict[str, Any]]:
    """The request's messages as an OpenAI-compatible engine reads them (module docstring)."""
    out: list[dict[str, Any]] = []
    for m in valid.req.messages:
        msg: dict[str, Any] = msgspec.to_builtins(m)
        msg.pop("refusal", None)
        msg.pop("reasoning_content", None)
        content = msg.get("content")
        if isinstance(content, list):
            msg["content"] = [_part(p) for p in content]
        elif "content" not in msg:
            msg["content"] = None  # an assistant turn of tool calls only
        out.append(msg)
    return out


def opening_key(messages: list[dict[str, Any]], tools: Any) -> str:
    """The prefix-affinity key of a conversation: a hash of its tools and its messages up to
    the first user message (all of them if there is none)."""
    end = next((i + 1 for i, m in enumerate(messages) if m.get("role") == "user"), None)
    opening = _KEY_ENCODER.encode([tools, messages[:end]]).decode("utf-8", "surrogatepass")
    return prefix_key(opening, len(opening))


def _set(out: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        out[key] = value


def plan_engine_chat(
    valid: ValidChat,
    profile: ModelProfile,
    *,
    request_id: str,
    stream_upstream: bool = True,
) -> ChatPlan:
    """The planned bodies of a chat request the engine renders (module docstring)."""
    req = valid.req
    messages = chat_messages(valid)
    chat: dict[str, Any] = {"messages": messages, "max_tokens": valid.max_tokens}
    tools = msgspec.to_builtins(req.tools) if req.tools else None
    _set(chat, "tools", tools)
    if req.tool_choice is not None:
        chat["tool_choice"] = msgspec.to_builtins(req.tool_choice)
    _set(chat, "parallel_tool_calls", req.parallel_tool_calls)
    if req.response_format is not None:
        fmt = msgspec.to_builtins(req.response_format)
        if isinstance(fmt.get("json_schema"), dict):
            fmt["json_schema"].setdefault("name", "response")
        chat["response_format"] = fmt
    if req.chat_template_kwargs is not None:
        chat["chat_template_kwargs"] = msgspec.to_builtins(req.chat_template_kwargs)
    stops = merge_stops(valid.stop, profile.stop)
    if stops:
        chat["stop"] = stops
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "top_k",
                "min_tokens", "repetition_penalty"):  # fmt: skip
        _set(chat, key, getattr(req, key))
    if req.logit_bias:
        chat["logit_bias"] = dict(req.logit_bias)
    if req.ignore_eos:
        chat["ignore_eos"] = True
    if valid.logprobs or valid.candidates > valid.n:
        chat["logprobs"] = True
        # Always with top_logprobs (0: the chosen tokens only): llama.cpp's server returns no
        # chat logprobs without it.
        chat["top_logprobs"] = valid.top_logprobs if valid.logprobs else 0
    common: dict[str, Any] = {"stream": stream_upstream}
    if req.lora_adapter is not None:
        common["lora_path"] = req.lora_adapter
    bodies: list[dict[str, Any]] = []
    for index in range(valid.candidates):
        one = dict(chat)
        if req.seed is not None:
            one["seed"] = candidate_seed(req.seed, index)
        bodies.append({**common, "rid": f"{request_id}-{index}", "chat": one})
    return ChatPlan(
        bodies=bodies,
        tool_parser=None,
        reasoning_parser=None,
        prompt="",
        prefix_key=opening_key(messages, tools),
    )


def chat_request(body: dict[str, Any], model: str) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one candidate's ``/v1/chat/completions`` request."""
    out: dict[str, Any] = {
        "model": body.get("lora_path") or model,
        **body["chat"],
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return "/v1/chat/completions", out


# ---------------------------------------------------------------- the reader


class _Fn(msgspec.Struct, gc=False):
    name: str | None = None
    arguments: str | None = None


class _Call(msgspec.Struct, gc=False):
    index: int = 0
    id: str | None = None
    function: _Fn | None = None


class _Delta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_Call] | None = None


class _Top(msgspec.Struct, gc=False):
    token: str = ""
    logprob: float | None = None


class _Entry(msgspec.Struct, gc=False):
    token: str = ""
    logprob: float | None = None
    top_logprobs: list[_Top] | None = None


class _Logprobs(msgspec.Struct, gc=False):
    content: list[_Entry] | None = None


class _Choice(msgspec.Struct, gc=False):
    index: int = 0
    delta: _Delta | None = None
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class _Chunk(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_decode = msgspec.json.Decoder(_Chunk).decode


def _value(v: float | None) -> float:
    return NEG_INF_LOGPROB if v is None else v


class OpenAIChatReader:
    """One candidate's streamed ``/v1/chat/completions`` body (a
    :class:`~.protocol.CandidateReader`; see the module docstring)."""

    __slots__ = (
        "_decoder", "_finish", "_finished", "_parsed", "_pieces", "_prompt", "_tokens", "done",
    )  # fmt: skip

    def __init__(self, *, max_line: int = 1 << 20) -> None:
        self._decoder = SSEDecoder(max_line)
        self._pieces: list[str] = []  # the content so far (a resume continues after it)
        self._parsed = False  # reasoning or tool calls came (a prefill cannot carry them)
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
            if self._finish is None:
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
        choices = chunk.choices or []
        if self._finished or len(choices) > 1:
            raise EngineMalformed()
        if choices:
            self._choice(choices[0], out)
        if chunk.usage is not None:
            self._usage(chunk.usage, out)

    def _choice(self, choice: _Choice, out: list[CandidateDelta | CandidateFinish]) -> None:
        d = choice.delta or _Delta()
        text = d.content or ""
        reasoning = d.reasoning_content or d.reasoning or ""
        calls = [
            ToolCallDelta(
                index=c.index,
                id=c.id,
                name=c.function.name if c.function is not None else None,
                arguments=(c.function.arguments or "") if c.function is not None else "",
            )
            for c in d.tool_calls or ()
        ]
        lps = self._logprobs(choice.logprobs)
        if self._finish is not None and (text or reasoning or calls or lps):
            raise EngineMalformed()  # output after the finish
        if lps:
            self._tokens += len(lps)
        elif text or reasoning or calls:
            self._tokens += 1
        if text:
            self._pieces.append(text)
        if reasoning or calls:
            self._parsed = True
        if text or reasoning or calls or lps:
            out.append(CandidateDelta(text, self._tokens, lps, self._prompt, reasoning, calls))
        if choice.finish_reason is not None and self._finish is None:
            matched = choice.stop_reason if isinstance(choice.stop_reason, str) else None
            self._finish = CandidateFinish(
                reason=choice.finish_reason, matched=matched,
                prompt_tokens=self._prompt, completion_tokens=self._tokens,
            )  # fmt: skip

    def _usage(self, u: _Usage, out: list[CandidateDelta | CandidateFinish]) -> None:
        self._prompt, self._tokens = u.prompt_tokens, u.completion_tokens
        cached = (u.prompt_tokens_details or {}).get("cached_tokens")
        reasoning = (u.completion_tokens_details or {}).get("reasoning_tokens")
        if self._finish is not None:
            f = self._finish
            self._finish = CandidateFinish(
                reason=f.reason, matched=f.matched, prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=cached if isinstance(cached, int) else 0,
                reasoning_tokens=reasoning if isinstance(reasoning, int) else 0,
            )  # fmt: skip
            self._finished = True
            out.append(self._finish)

    @staticmethod
    def _logprobs(lp: _Logprobs | None) -> list[TokenLogprob]:
        if lp is None or not lp.content:
            return []
        out: list[TokenLogprob] = []
        for e in lp.content:
            top = [TopLogprob(t.token, -1, _value(t.logprob)) for t in e.top_logprobs or ()]
            out.append(TokenLogprob(e.token, -1, _value(e.logprob), top))
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
        return Progress("".join(self._pieces), self._tokens, self._prompt, self._parsed, held)
