"""The Responses API request's wire schema (``POST /v1/responses``): msgspec Structs that forbid
unknown keys, and the fields refused with a reason. The mapping onto a chat request is
``request.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct
from msgspec import field as mfield

from ...core.request.schemas import ChatTemplateKwargs

__all__ = [
    "RESPONSES_KNOWN_REJECTED",
    "RContent",
    "RFormat",
    "RFormatJsonObject",
    "RFormatJsonSchema",
    "RFormatText",
    "RFunctionCall",
    "RFunctionCallOutput",
    "RFunctionTool",
    "RInputImage",
    "RInputText",
    "RItem",
    "RMessage",
    "RNamedTool",
    "ROutputText",
    "RReasoning",
    "RRefusal",
    "RText",
    "ResponsesRequest",
]


class _Strict(Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


# ---------------------------------------------------------------- content parts and items


class RInputText(_Strict, tag_field="type", tag="input_text"):
    text: str


class RInputImage(_Strict, tag_field="type", tag="input_image"):
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None
    file_id: str | None = None


class ROutputText(_Strict, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RRefusal(_Strict, tag_field="type", tag="refusal"):
    refusal: str


RContent = RInputText | RInputImage | ROutputText | RRefusal


class RMessage(_Strict, tag_field="type", tag="message"):
    role: str
    content: str | list[RContent]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class RFunctionCall(_Strict, tag_field="type", tag="function_call"):
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class RFunctionCallOutput(_Strict, tag_field="type", tag="function_call_output"):
    call_id: str
    output: str | list[RContent]
    id: str | None = None
    status: str | None = None


class RReasoning(_Strict, tag_field="type", tag="reasoning"):
    summary: list[Any]
    id: str | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


RItem = RMessage | RFunctionCall | RFunctionCallOutput | RReasoning


# ---------------------------------------------------------------- tools and text


class RFunctionTool(_Strict):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class RNamedTool(_Strict):
    type: Literal["function"]
    name: str


class RFormatText(_Strict, tag_field="type", tag="text"):
    pass


class RFormatJsonObject(_Strict, tag_field="type", tag="json_object"):
    pass


class RFormatJsonSchema(_Strict, tag_field="type", tag="json_schema"):
    schema_: dict[str, Any] = mfield(name="schema")
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


RFormat = RFormatText | RFormatJsonObject | RFormatJsonSchema


class RText(_Strict):
    format: RFormat | None = None
    verbosity: Any = UNSET


# ---------------------------------------------------------------- the request

#: Fields ``/v1/responses`` refuses with a reason (``unsupported_field``), and what to say.
RESPONSES_KNOWN_REJECTED: dict[str, str] = {
    "previous_response_id": (
        "`previous_response_id` needs stored responses, and the gateway is stateless: it stores "
        "none. Send the whole conversation in `input` instead."
    ),
    "conversation": (
        "`conversation` needs stored conversations, and the gateway is stateless: it stores "
        "none. Send the whole conversation in `input` instead."
    ),
    "prompt": (
        "`prompt` (a stored prompt template) needs server-side state, and the gateway is "
        "stateless; send `instructions` and `input` instead."
    ),
    "metadata": "`metadata` is out of scope: the gateway stores nothing; remove it.",
    "include": "`include` is not supported: no extra output data is available; remove it.",
    "top_logprobs": "`top_logprobs` is not supported on /v1/responses; remove it.",
    "reasoning": (
        "`reasoning` is out of scope; use `chat_template_kwargs.enable_thinking` and "
        "`include_reasoning` instead."
    ),
    "truncation": "`truncation` is not supported: the gateway never drops input; remove it.",
    "max_tool_calls": "`max_tool_calls` is not supported; remove it.",
    "service_tier": "`service_tier` is out of scope; remove it.",
}


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["auto", "none", "required"] | RNamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: RText | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    background: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    include_reasoning: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    lora_adapter: str | None = None
    # known-rejected (see RESPONSES_KNOWN_REJECTED)
    previous_response_id: Any = UNSET
    conversation: Any = UNSET
    prompt: Any = UNSET
    metadata: Any = UNSET
    include: Any = UNSET
    top_logprobs: Any = UNSET
    reasoning: Any = UNSET
    truncation: Any = UNSET
    max_tool_calls: Any = UNSET
    service_tier: Any = UNSET
