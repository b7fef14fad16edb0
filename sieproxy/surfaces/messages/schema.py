"""The Anthropic Messages request's wire schema: msgspec Structs that forbid unknown keys
(``POST /v1/messages`` and ``/v1/messages/count_tokens``), and the fields refused with a reason.

The mapping onto a chat request is ``request.py`` (top-level fields) and ``conversation.py``
(``system`` and ``messages``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct

__all__ = [
    "MESSAGES_KNOWN_REJECTED",
    "CacheControl",
    "CountTokensRequest",
    "MBase64Source",
    "MBlock",
    "MDirectCaller",
    "MImage",
    "MJsonFormat",
    "MMessage",
    "MMetadata",
    "MOutputConfig",
    "MRedactedThinking",
    "MText",
    "MThinking",
    "MThinkingConfig",
    "MTool",
    "MToolChoice",
    "MToolResult",
    "MToolUse",
    "MURLSource",
    "MessagesRequest",
]


class _Strict(Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: str | None = None


# ---------------------------------------------------------------- content blocks


class MText(_Strict, tag_field="type", tag="text"):
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class MBase64Source(_Strict, tag_field="type", tag="base64"):
    media_type: str
    data: str


class MURLSource(_Strict, tag_field="type", tag="url"):
    url: str


class MImage(_Strict, tag_field="type", tag="image"):
    source: MBase64Source | MURLSource
    cache_control: CacheControl | None = None


class MDirectCaller(_Strict):
    type: Literal["direct"]


class MToolUse(_Strict, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # What the SDK's replayed ToolUseBlock carries: a call the model made itself, in no toolset.
    caller: MDirectCaller | None = None
    toolset_name: None = None


class MToolResult(_Strict, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[MText | MImage] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class MThinking(_Strict, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class MRedactedThinking(_Strict, tag_field="type", tag="redacted_thinking"):
    data: str
    cache_control: CacheControl | None = None


MBlock = MText | MImage | MToolUse | MToolResult | MThinking | MRedactedThinking


class MMessage(_Strict):
    role: str
    content: str | list[MBlock]


# ---------------------------------------------------------------- tools and options


class MTool(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    #: Fine-grained tool streaming (a beta): the arguments stream as generated anyway.
    eager_input_streaming: bool | None = None


class MToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class MMetadata(_Strict):
    user_id: str | None = None


class MJsonFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = msgspec.field(name="schema")


class MOutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "max", "xhigh"] | None = None
    format: MJsonFormat | None = None


#: Fields ``/v1/messages`` refuses with a reason (``unsupported_field``), and what to say.
MESSAGES_KNOWN_REJECTED: dict[str, str] = {
    "container": (
        "`container` needs Anthropic's code-execution containers, which a self-hosted gateway "
        "does not run; remove it."
    ),
    "mcp_servers": (
        "`mcp_servers` (the MCP connector) needs the API to call MCP servers itself, which this "
        "gateway does not do; run the MCP client on your side and send its tools in `tools`."
    ),
    "diagnostics": (
        "`diagnostics` compares with a stored earlier request, and the gateway is stateless: it "
        "stores none; remove it."
    ),
    "inference_geo": (
        "`inference_geo` chooses among Anthropic's regions; a self-hosted model runs where its "
        "engines are. Remove it."
    ),
}


class CountTokensRequest(_Strict, kw_only=True):
    """``/v1/messages/count_tokens``: the prompt fields of a Messages request."""

    model: str
    messages: list[MMessage]
    system: str | list[MText] | None = None
    tools: list[Any] | None = None
    tool_choice: MToolChoice | None = None
    thinking: MThinkingConfig | None = None
    context_management: dict[str, Any] | None = None
    output_config: MOutputConfig | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    # known-rejected (see MESSAGES_KNOWN_REJECTED)
    container: Any = UNSET
    mcp_servers: Any = UNSET
    diagnostics: Any = UNSET
    inference_geo: Any = UNSET


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: MMetadata | None = None
    stream: bool | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

