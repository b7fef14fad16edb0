"""Planning: a validated request → one SGLang ``/generate`` body per candidate.

Theory of operation
-------------------
A chat request with ``k = best_of or n`` candidates becomes ``k`` independent ``/generate``
requests that share one rendered prompt (the shell sends them to the same engine replica so they
share its prefix cache). Each body is a *single* generation: ``sampling_params.n`` is never sent
(SGLang would replace our rids with random ones), and each candidate has its own ``rid``,
``f"{request_id}-{index}"``, which the shell uses for ``/abort_request``.

Body decisions
--------------
- ``text`` is the rendered prompt (the gateway has no tokenizer, so no ``input_ids``).
- ``sampling_params`` use SGLang's names and carry only what the client set (the engine's
  defaults apply otherwise; OpenAI's and SGLang's default ``temperature`` are both 1.0):
  ``max_new_tokens`` (always: the validated cap), ``min_new_tokens``, ``stop`` (the request's
  stops, then the profile's, de-duplicated in order, at most 32 — SGLang's limit; the profile's
  extras are the ones dropped), ``temperature``, ``top_p``, ``top_k``, ``frequency_penalty``,
  ``presence_penalty``, ``repetition_penalty``, ``logit_bias``, ``ignore_eos`` (when true), the
  one grammar key of :mod:`sieproxy.core.grammar`, and ``skip_special_tokens: false`` while
  tools are in play (so the tool-call tags reach the parser).
- ``seed`` → ``sampling_seed = seed + index`` wrapped into the signed 64-bit range: candidates
  of one seeded request differ from each other (``n`` copies of one sample would be useless) and
  each is reproducible; candidate 0 gets the client's seed itself, so ``n=1`` is exactly
  "seed → sampling_seed". (SGLang honours it only with ``--enable-deterministic-inference``.)
- ``return_logprob`` when the client asked for ``logprobs`` or when ``best_of`` ranking is needed
  (more candidates than returned choices); then ``top_logprobs_num`` (the client's
  ``top_logprobs``, 0 when only ranking needs them), ``logprob_start_len: -1`` (output only) and
  ``return_text_in_logprobs: true``.
- ``lora_path`` (top level) is the request's ``lora_adapter``; ``image_data`` lists the request's
  decoded images as ``data:`` URIs in message/part order (one per image placeholder).
- Never forwarded: ``user``, ``safety_identifier``, ``prompt_cache_key``, ``routing_key``.
- ``stream`` is the ``stream_upstream`` argument (default true: the gateway streams from the
  engine even for a non-streaming client, so deadlines and aborts work per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from ..request.profile import ModelProfile
from ..request.schemas import ChatCompletionRequest, CompletionRequest
from ..request.valid import ValidChat, ValidCompletion
from .affinity import opening_end, prefix_key
from .grammar import (
    response_format_constraint,
    tool_plan,
    with_schema_in_prompt,
    with_tools_in_prompt,
)
from .template import messages_for_template, render_chat, template_renders_tools

__all__ = [
    "MAX_STOP",
    "ChatPlan",
    "candidate_seed",
    "merge_stops",
    "plan_chat",
    "plan_completion",
]

#: SGLang's ``MAX_STOP_COUNT``.
MAX_STOP = 32

_I64 = 1 << 64
_I64_MIN = -(1 << 63)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """The engine side of one chat request.

    ``bodies``: one ``/generate`` body per candidate, in index order. ``tool_parser``: the parser
    the response side runs on each candidate's text (the profile's, ``"json_array"`` under the
    JSON-array constraint, ``None`` when tools are off). ``reasoning_parser``: the profile's.
    ``prompt``: the rendered prompt. ``reasoning_open``: the prompt leaves a ``<think>`` block
    open (the template started the reasoning), so output begins inside reasoning.
    ``prefix_key``: the prompt's prefix-affinity key (:mod:`sieproxy.core.affinity`).
    """

    bodies: list[dict[str, Any]]
    tool_parser: str | None
    reasoning_parser: str | None
    prompt: str
    reasoning_open: bool = False
    prefix_key: str | None = None


def candidate_seed(seed: int, index: int) -> int:
    """``seed + index`` wrapped into ``[-2**63, 2**63 - 1]``."""
    return (seed + index - _I64_MIN) % _I64 + _I64_MIN


def merge_stops(request_stops: list[str], profile_stops: tuple[str, ...]) -> list[str]:
    """Request stops then profile stops, de-duplicated in order, at most :data:`MAX_STOP`."""
    if len(set(request_stops)) > MAX_STOP:
        raise InvalidRequest(f"`stop` allows at most {MAX_STOP} strings.", param="stop")
    merged = list(dict.fromkeys([*request_stops, *profile_stops]))
    return merged[:MAX_STOP]


def _set(params: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        params[key] = value


def _sampling(
    max_tokens: int,
    stop: list[str],
    profile: ModelProfile,
    req: ChatCompletionRequest | CompletionRequest,
) -> dict[str, Any]:
    """The ``sampling_params`` both endpoints share (only what the client set, plus the cap)."""
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    stops = merge_stops(stop, profile.stop)
    if stops:
        params["stop"] = stops
    _set(params, "temperature", req.temperature)
    _set(params, "top_p", req.top_p)
    _set(params, "frequency_penalty", req.frequency_penalty)
    _set(params, "presence_penalty", req.presence_penalty)
    if req.ignore_eos:
        params["ignore_eos"] = True
    return params


def _reasoning_open(prompt: str) -> bool:
    return prompt.rfind("<think>") > prompt.rfind("</think>")


def plan_chat(
    valid: ValidChat,
    profile: ModelProfile,
    *,
    request_id: str,
    stream_upstream: bool = True,
) -> ChatPlan:
    """Render the prompt and build the ``/generate`` bodies of a chat request."""
    req = valid.req
    tools = tool_plan(valid, profile)
    grammar = response_format_constraint(valid) or tools.constraint

    messages = with_schema_in_prompt(messages_for_template(valid), valid, profile)
    messages = with_tools_in_prompt(
        messages, tools, template_renders_tools(profile.chat_template)
    )
    kwargs: dict[str, Any] = {}
    if req.chat_template_kwargs is not None:
        ctk = req.chat_template_kwargs
        if ctk.enable_thinking is not None:
            kwargs["enable_thinking"] = ctk.enable_thinking
        if ctk.guardian_config is not None:
            kwargs["guardian_config"] = {"risk_name": ctk.guardian_config.risk_name}
    prompt = render_chat(profile, messages, tools=tools.template_tools, template_kwargs=kwargs)

    params = _sampling(valid.max_tokens, valid.stop, profile, req)
    _set(params, "min_new_tokens", req.min_tokens)
    _set(params, "top_k", req.top_k)
    _set(params, "repetition_penalty", req.repetition_penalty)
    if req.logit_bias:
        params["logit_bias"] = dict(req.logit_bias)
    if grammar is not None:
        params[grammar[0]] = grammar[1]
    if tools.active:
        params["skip_special_tokens"] = False

    common: dict[str, Any] = {"text": prompt, "stream": stream_upstream}
    if valid.logprobs or valid.candidates > valid.n:
        common["return_logprob"] = True
        common["top_logprobs_num"] = valid.top_logprobs if valid.logprobs else 0
        common["logprob_start_len"] = -1
        common["return_text_in_logprobs"] = True
    if req.lora_adapter is not None:
        common["lora_path"] = req.lora_adapter
    if valid.images:
        ordered = sorted(valid.images, key=lambda im: (im.message_index, im.part_index))
        common["image_data"] = [im.data_uri for im in ordered]

    bodies: list[dict[str, Any]] = []
    for index in range(valid.candidates):
        sp = dict(params)
        if req.seed is not None:
            sp["sampling_seed"] = candidate_seed(req.seed, index)
        bodies.append({**common, "rid": f"{request_id}-{index}", "sampling_params": sp})

    return ChatPlan(
        bodies=bodies,
        tool_parser=tools.parser,
        reasoning_parser=profile.reasoning_parser,
        prompt=prompt,
        reasoning_open=profile.reasoning_parser is not None and _reasoning_open(prompt),
        prefix_key=prefix_key(prompt, opening_end(prompt, messages)),
    )


def plan_completion(
    valid: ValidCompletion,
    profile: ModelProfile,
    *,
    request_id: str,
    stream_upstream: bool = True,
) -> dict[str, Any]:
    """The one ``/generate`` body of a legacy completions request (raw prompt, no template)."""
    req = valid.req
    params = _sampling(valid.max_tokens, valid.stop, profile, req)
    if req.seed is not None:
        params["sampling_seed"] = candidate_seed(req.seed, 0)
    return {
        "text": valid.prompt,
        "rid": f"{request_id}-0",
        "stream": stream_upstream,
        "sampling_params": params,
    }
