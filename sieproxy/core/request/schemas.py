"""Wire schemas of the two endpoints' request bodies (msgspec Structs).

The Structs express *types* only (strict: no int/float/bool coercion, unknown keys forbidden);
ranges and cross-field rules live in :mod:`sieproxy.core.validate`, where each refusal gets its
own message, ``code`` and ``param``.

Conventions:
- ``None`` means "absent or null" for every optional field (OpenAI treats them the same).
- Known-rejected fields are declared as ``Any = UNSET`` so the validator can answer them with a
  specific message instead of a generic "unknown field".
- Field names that clash with Python use ``rename`` (``schema`` → ``schema_``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType, field

__all__ = [
    "CHAT_KNOWN_REJECTED",
    "COMPLETIONS_KNOWN_REJECTED",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTemplateKwargs",
    "CompletionRequest",
    "ContentPart",
    "FunctionCall",
    "FunctionDef",
    "GuardianConfig",
    "ImagePart",
    "ImageURL",
    "InputImagePart",
    "InputTextPart",
    "JsonSchemaFormat",
    "NamedFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "TextPart",
    "Tool",
    "ToolCall",
]


class _Strict(Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


# ---------------------------------------------------------------- content parts (tagged by type)


class TextPart(_Strict, tag_field="type", tag="text"):
    text: str


class InputTextPart(_Strict, tag_field="type", tag="input_text"):
    text: str


class ImageURL(_Strict):
    url: str
    # OpenAI clients send `detail`; it is accepted and ignored (the engine decides resolution).
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict, tag_field="type", tag="image_url"):
    image_url: str | ImageURL


class InputImagePart(_Strict, tag_field="type", tag="input_image"):
    image_url: str | ImageURL
    detail: Literal["auto", "low", "high"] | None = None


ContentPart = TextPart | InputTextPart | ImagePart | InputImagePart


# ---------------------------------------------------------------- messages and tools


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | UnsetType | None = UNSET
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    # Accepted for OpenAI compatibility (clients replay them): `name` reaches the template;
    # `refusal` and `reasoning_content` of a replayed assistant turn are dropped.
    name: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Sent by the openai SDK's pydantic helpers; a strict tool is always grammar-constrained
    # when the call is forced, and its schema is used as given.
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None
    #: SIE extension (vLLM's name): the running usage on every chunk of the stream.
    continuous_usage_stats: bool | None = None


class GuardianConfig(_Strict):
    risk_name: str


class ChatTemplateKwargs(_Strict):
    enable_thinking: bool | None = None
    guardian_config: GuardianConfig | None = None


# ---------------------------------------------------------------- the two requests

#: Fields the chat endpoint refuses with a reason (``unsupported_field``), and what to say.
CHAT_KNOWN_REJECTED: dict[str, str] = {
    "functions": "`functions` is deprecated by OpenAI; use `tools` instead.",
    "function_call": "`function_call` is deprecated by OpenAI; use `tool_choice` instead.",
    "modalities": "`modalities` is out of scope: this gateway generates text only.",
    "audio": "`audio` is out of scope: this gateway generates text only.",
    "metadata": "`metadata` is out of scope: the gateway stores nothing; remove it.",
    "store": "`store` is out of scope: the gateway stores nothing; remove it.",
    "service_tier": "`service_tier` is out of scope; remove it.",
    "prediction": "`prediction` (predicted outputs) is out of scope; remove it.",
    "reasoning_effort": (
        "`reasoning_effort` is out of scope; use `chat_template_kwargs.enable_thinking` "
        "and `include_reasoning` instead."
    ),
    "verbosity": "`verbosity` is out of scope; remove it.",
}

#: Fields the legacy completions endpoint refuses with a reason (``unsupported_field``).
COMPLETIONS_KNOWN_REJECTED: dict[str, str] = {
    "echo": "`echo` is not supported on /v1/completions; remove it.",
    "suffix": "`suffix` (insertion) is not supported on /v1/completions; remove it.",
    "logprobs": (
        "`logprobs` is not supported on /v1/completions; use `logprobs` on /v1/chat/completions."
    ),
    "best_of": "`best_of` is not supported on /v1/completions; use /v1/chat/completions.",
}


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[ChatMessage]
    best_of: int | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    frequency_penalty: float | None = None
    #: SIE extension (SGLang's and vLLM's sampling field): generate past the end-of-sequence
    #: token, up to the output cap (what benchmark tools send to fix the output length).
    ignore_eos: bool | None = None
    include_reasoning: bool | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    lora_adapter: str | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    n: int | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = None
    prompt_cache_key: str | None = None
    repetition_penalty: float | None = None
    response_format: ResponseFormat | None = None
    routing_key: str | None = None
    safety_identifier: str | None = None
    schema_in_prompt: bool | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = None
    top_k: int | None = None
    top_logprobs: int | None = None
    top_p: float | None = None
    user: str | None = None
    # known-rejected (see CHAT_KNOWN_REJECTED)
    functions: Any = UNSET
    function_call: Any = UNSET
    modalities: Any = UNSET
    audio: Any = UNSET
    metadata: Any = UNSET
    store: Any = UNSET
    service_tier: Any = UNSET
    prediction: Any = UNSET
    reasoning_effort: Any = UNSET
    verbosity: Any = UNSET


class CompletionRequest(_Strict):
    model: str
    prompt: str | list[Any]
    frequency_penalty: float | None = None
    ignore_eos: bool | None = None  # SIE extension, as on chat
    max_tokens: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    # known-rejected (see COMPLETIONS_KNOWN_REJECTED)
    echo: Any = UNSET
    suffix: Any = UNSET
    logprobs: Any = UNSET
    best_of: Any = UNSET


chat_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_request_decoder = msgspec.json.Decoder(CompletionRequest)
