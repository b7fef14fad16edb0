"""The Anthropic Messages request (``POST /v1/messages``, ``/v1/messages/count_tokens``).

Theory of operation
-------------------
As with ``/v1/responses``, a Messages request is a chat request in another shape, so this
module only decodes and maps; the chat rules, planning, the relay and the engine path are chat's.
:func:`decode_messages` decodes the body strictly (msgspec Structs that forbid unknown keys:
an unknown top-level key is ``unsupported_field``, one inside a block ``invalid_request``),
refuses what the gateway cannot honour with a reason, applies the Messages-only rules with
Messages paths in ``param``, and returns the mapped :class:`~.schemas.ChatCompletionRequest`
with a :class:`PathMap`. :func:`for_model` then applies what depends on the model (``thinking``
and the ``max_tokens`` cap); the chat rules run on the mapped request, and a chat refusal's
``param`` (and its words) are written back as the Messages path the client sent
(``messages[3].tool_call_id`` → ``messages[2].content[0].tool_use_id``).

The mapping (docs/API.md, "POST /v1/messages", says which fields are honoured):

- ``system`` (a string, or text blocks joined with a newline) → the first system message. A
  text block that starts with ``x-anthropic-billing-header:`` is dropped: Claude Code puts its
  billing attribution there (a value that differs per conversation), which is no instruction
  to a model, and as the prompt's first line it would keep every conversation from sharing the
  engine's prefix cache of the (long, identical) system prompt.
- A ``user`` message → its ``tool_result`` blocks first, each a ``tool`` message in block
  order (Anthropic requires them first too), then one user message with its text and image
  blocks (an image's ``base64`` source becomes a ``data:`` URI; a ``url`` source is refused, as
  remote images are on chat). A ``tool_result`` with ``is_error: true`` reaches the template
  as ``Error: <content>``; images inside a ``tool_result`` are refused with a reason.
- An ``assistant`` message → one assistant message: its text blocks as content, its
  ``tool_use`` blocks as tool calls (``input`` JSON-encoded); replayed ``thinking`` /
  ``redacted_thinking`` blocks are dropped, as chat drops a replayed ``reasoning_content``.
- A ``system`` message inside ``messages`` (Claude Code sends one after the first user message
  for some model names) → a system message at that place: the template decides.
- A final ``assistant`` message (a prefill to continue) is refused: the chat path always opens
  a new assistant turn, so the continuation could not be honoured.
- ``tools`` → function tools (``input_schema`` → ``parameters``); ``tool_choice`` ``auto`` /
  ``any`` / ``tool`` / ``none`` → ``auto`` / ``required`` / the named function / ``none``
  (the same grammar-enforced paths as chat); ``disable_parallel_tool_use`` →
  ``parallel_tool_calls: false``. Anthropic's own server tools (a ``type`` other than
  ``custom``) are refused.
- ``stop_sequences`` → ``stop``; ``max_tokens`` → ``max_completion_tokens``;
  ``output_config.format`` (``json_schema``) → ``response_format``.
- ``cache_control`` (anywhere, top level included), ``speed: "standard"``,
  ``metadata.user_id``, ``context_management``, ``output_config.effort``, ``service_tier`` and
  ``thinking.budget_tokens`` are accepted and have no effect (the engine's prefix cache works
  on every request without being asked).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct

from ...core.errors import InvalidRequest, RequestError, UnsupportedField
from ...core.request.profile import ModelProfile
from ...core.request.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateKwargs,
    ContentPart,
    FunctionCall,
    FunctionDef,
    ImagePart,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
)
from ...core.request.validate import check_chat_request, decode_body, validation_error

__all__ = [
    "MESSAGES_KNOWN_REJECTED",
    "CountTokensRequest",
    "MessagesRequest",
    "PathMap",
    "decode_count_tokens",
    "decode_messages",
    "for_model",
    "translated",
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


_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)
_REJECTED = tuple(MESSAGES_KNOWN_REJECTED.items())
_INT32_MAX = 2**31 - 1
_MIN_BUDGET = 1024


# ---------------------------------------------------------------- paths


@dataclass(slots=True)
class PathMap:
    """Where each mapped chat message came from, to write a chat ``param`` back as the
    Messages path the client sent."""

    #: Per chat message: the path it came from (``system``, ``messages[i]``, or a
    #: ``tool_result`` block's path for a tool message).
    messages: list[str] = field(default_factory=list)
    #: ``(chat message, part index)`` → the path of the block that part came from.
    parts: dict[tuple[int, int], str] = field(default_factory=dict)
    #: ``(chat message, tool call index)`` → the path of its ``tool_use`` block.
    calls: dict[tuple[int, int], str] = field(default_factory=dict)
    #: Chat messages that came from ``tool_result`` blocks.
    results: set[int] = field(default_factory=set)

    def translate(self, param: str | None) -> str | None:
        """The Messages path of a chat ``param``."""
        if param is None:
            return None
        m = _MSG_PARAM.match(param)
        if m is not None:
            i, rest = int(m.group(1)), m.group(2)
            part = _PART_PARAM.match(rest)
            if part is not None and (i, int(part.group(1))) in self.parts:
                tail = part.group(2)
                if tail.startswith(".image_url"):
                    tail = ".source"
                return self.parts[(i, int(part.group(1)))] + tail
            call = _CALL_PARAM.match(rest)
            if call is not None and (i, int(call.group(1))) in self.calls:
                tail = _CALL_FIELDS.get(call.group(2), call.group(2))
                return self.calls[(i, int(call.group(1)))] + tail
            base = self.messages[i] if i < len(self.messages) else "messages"
            if i in self.results:
                if rest == ".tool_call_id":
                    return base + ".tool_use_id"
                if rest.startswith(".content"):
                    return base + ".content"
            return base + rest
        for chat, ours in _TOP_PARAMS:
            if param == chat or param.startswith((chat + ".", chat + "[")):
                return ours + param[len(chat) :]
        tool = _TOOL_PARAM.match(param)
        if tool is not None:
            tail = tool.group(2)
            return f"tools[{tool.group(1)}]" + (
                ".input_schema" if tail.startswith(".parameters") else tail
            )
        return param


_MSG_PARAM = re.compile(r"messages\[(\d+)\](.*)")
_PART_PARAM = re.compile(r"\.content\[(\d+)\](.*)")
_CALL_PARAM = re.compile(r"\.tool_calls\[(\d+)\](.*)")
_CALL_FIELDS = {".function.name": ".name", ".function.arguments": ".input"}
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function(.*)")
_TOP_PARAMS = (
    ("max_completion_tokens", "max_tokens"),
    ("response_format.json_schema", "output_config.format.schema"),
    ("response_format", "output_config.format"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("stop", "stop_sequences"),
    ("chat_template_kwargs", "thinking"),
)
#: Chat words in a refusal's message and the Messages words for them.
_WORDS = (
    ("`max_completion_tokens`", "`max_tokens`"),
    ("`response_format`", "`output_config.format`"),
    ("`tool_call_id`", "`tool_use_id`"),
    ("`stop`", "`stop_sequences`"),
    ("tool_choice: \"required\"", "tool_choice `any`"),
)


def translated(err: RequestError, paths: PathMap) -> RequestError:
    """A chat refusal of the mapped request, its ``param`` and words those of Messages."""
    param = paths.translate(err.param)
    message = err.message
    for chat, ours in _WORDS:
        message = message.replace(chat, ours)
    if param == err.param and message == err.message:
        return err
    return type(err)(message, param=param, code=err.code)


# ---------------------------------------------------------------- the mapping


#: The start of Claude Code's billing-attribution system block (see the module docstring).
_BILLING = "x-anthropic-billing-header:"


def _text_blocks(blocks: list[MText], path: str, *, skip: str) -> str | None:
    """The system blocks' text (None: only skipped blocks)."""
    if not blocks:
        raise InvalidRequest(
            f"`{path}` must not be an empty array; send a string or at least one text block.",
            param=path,
        )
    kept = [b.text for b in blocks if not b.text.startswith(skip)]
    return "\n".join(kept) if kept else None


def _image(block: MImage, path: str) -> ImagePart:
    src = block.source
    if type(src) is MURLSource:
        raise InvalidRequest(
            "Remote image URLs are not fetched; send the image as a `base64` source.",
            param=f"{path}.source",
        )
    assert type(src) is MBase64Source
    return ImagePart(f"data:{src.media_type};base64,{src.data}")


def _result_text(block: MToolResult, path: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        pieces: list[str] = []
        for j, b in enumerate(content):
            if type(b) is MImage:
                raise UnsupportedField(
                    "Images inside a `tool_result` are not supported (chat templates carry "
                    "images in user turns only); send the image as an `image` block of the "
                    "user message instead.",
                    param=f"{path}.content[{j}]",
                )
            assert type(b) is MText
            pieces.append(b.text)
        text = "\n".join(pieces)
    return f"Error: {text}" if block.is_error else text


class _Mapper:
    """Builds the chat messages and records where each came from."""

    def __init__(self, paths: PathMap) -> None:
        self.paths = paths
        self.out: list[ChatMessage] = []
        self.call_ids: set[str] = set()

    def add(self, msg: ChatMessage, path: str) -> int:
        self.out.append(msg)
        self.paths.messages.append(path)
        return len(self.out) - 1

    def user(self, content: list[MBlock], path: str) -> None:
        parts: list[ContentPart] = []
        origins: list[str] = []
        for j, block in enumerate(content):
            bpath = f"{path}.content[{j}]"
            t = type(block)
            if t is MToolResult:
                assert isinstance(block, MToolResult)
                if not block.tool_use_id:
                    raise InvalidRequest(
                        "A `tool_result` needs the non-empty `tool_use_id` of the call it "
                        "answers.",
                        param=f"{bpath}.tool_use_id",
                    )
                text = _result_text(block, bpath)
                k = self.add(ChatMessage("tool", text, tool_call_id=block.tool_use_id), bpath)
                self.paths.results.add(k)
            elif t is MText:
                assert isinstance(block, MText)
                parts.append(TextPart(block.text))
                origins.append(bpath)
            elif t is MImage:
                assert isinstance(block, MImage)
                parts.append(_image(block, bpath))
                origins.append(bpath)
            else:
                raise InvalidRequest(
                    f"A user message cannot carry a `{_TAGS[t]}` block; only `text`, `image` "
                    "and `tool_result` blocks.",
                    param=f"{bpath}.type",
                )
        if parts:
            k = self.add(ChatMessage("user", parts), path)
            for j, origin in enumerate(origins):
                self.paths.parts[(k, j)] = origin

    def assistant(self, content: list[MBlock], path: str) -> None:
        texts: list[str] = []
        calls: list[ToolCall] = []
        call_paths: list[str] = []
        for j, block in enumerate(content):
            bpath = f"{path}.content[{j}]"
            t = type(block)
            if t is MText:
                assert isinstance(block, MText)
                texts.append(block.text)
            elif t is MToolUse:
                assert isinstance(block, MToolUse)
                if not block.id:
                    raise InvalidRequest(
                        "A `tool_use` block needs a non-empty `id`.", param=f"{bpath}.id"
                    )
                if block.id in self.call_ids:
                    raise InvalidRequest(
                        f"`tool_use` ids must be unique; `{block.id}` appears twice.",
                        param=f"{bpath}.id",
                    )
                self.call_ids.add(block.id)
                args = msgspec.json.encode(block.input).decode()
                calls.append(ToolCall(block.id, "function", FunctionCall(block.name, args)))
                call_paths.append(bpath)
            elif t is MThinking or t is MRedactedThinking:
                continue  # replayed reasoning: dropped (see the module docstring)
            else:
                raise InvalidRequest(
                    f"An assistant message cannot carry a `{_TAGS[t]}` block; only `text`, "
                    "`tool_use`, `thinking` and `redacted_thinking` blocks.",
                    param=f"{bpath}.type",
                )
        text = "".join(texts)
        said = text if text or not calls else None
        msg = ChatMessage("assistant", said, tool_calls=calls or None)
        k = self.add(msg, path)
        for n, cpath in enumerate(call_paths):
            self.paths.calls[(k, n)] = cpath


_TAGS: dict[type, str] = {
    MText: "text",
    MImage: "image",
    MToolUse: "tool_use",
    MToolResult: "tool_result",
    MThinking: "thinking",
    MRedactedThinking: "redacted_thinking",
}


def _messages(req: CountTokensRequest, paths: PathMap) -> list[ChatMessage]:
    mapper = _Mapper(paths)
    system = req.system
    if isinstance(system, list):
        text = _text_blocks(system, "system", skip=_BILLING)
        if text is not None:
            mapper.add(ChatMessage("system", text), "system")
    elif system is not None:
        mapper.add(ChatMessage("system", system), "system")
    if not req.messages:
        raise InvalidRequest("`messages` must contain at least one message.", param="messages")
    last = len(req.messages) - 1
    for i, msg in enumerate(req.messages):
        path = f"messages[{i}]"
        role = msg.role
        if role not in ("user", "assistant", "system"):
            raise InvalidRequest(
                "`role` must be `user` or `assistant` (or `system`).", param=f"{path}.role"
            )
        if role == "assistant" and i == last:
            raise UnsupportedField(
                "A final `assistant` message (a prefill to continue) is not supported: the "
                "answer always starts a new assistant turn. End `messages` with a user message.",
                param=path,
            )
        content = msg.content
        if isinstance(content, list) and not content:
            raise InvalidRequest(
                "`content` must not be an empty array; send a string or at least one block.",
                param=f"{path}.content",
            )
        if role == "system":
            if isinstance(content, str):
                mapper.add(ChatMessage("system", content), path)
            else:
                for j, block in enumerate(content):
                    if type(block) is not MText:
                        raise InvalidRequest(
                            "A system message carries `text` blocks only.",
                            param=f"{path}.content[{j}].type",
                        )
                texts = [b.text for b in content if isinstance(b, MText)]
                mapper.add(ChatMessage("system", "\n".join(texts)), path)
        elif isinstance(content, str):
            mapper.add(ChatMessage(role, content), path)
        elif role == "user":
            mapper.user(content, path)
        else:
            mapper.assistant(content, path)
    return mapper.out


def _tools(req: CountTokensRequest) -> list[Tool] | None:
    if req.tools is None:
        return None
    if not req.tools:
        return None  # Anthropic accepts an empty list: no tools
    out: list[Tool] = []
    for k, raw in enumerate(req.tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise UnsupportedField(
                f"Tools of type `{kind}` are Anthropic's own server or client tools; this "
                "gateway serves custom tools only (a `name`, `description` and "
                "`input_schema`, with no `type` or `type: \"custom\"`).",
                param=f"tools[{k}].type",
            )
        t = _convert(raw, MTool, f"tools[{k}]")
        fn = FunctionDef(t.name, t.description, t.input_schema, t.strict)
        out.append(Tool("function", fn))
    return out


def _convert(obj: Any, typ: type[MTool], path: str) -> MTool:
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        head, sep, tail = text.rpartition(" - at `$")
        text = f"{head} - at `$.{path}{tail}" if sep else f"{text} - at `$.{path}`"
        raise validation_error(text) from exc


def _tool_choice(
    req: CountTokensRequest,
) -> tuple[Literal["auto", "none", "required"] | NamedToolChoice | None, bool | None]:
    choice = req.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest(
                "A `tool_choice` of type `tool` needs the `name` of a tool in `tools`.",
                param="tool_choice.name",
            )
        return NamedToolChoice("function", NamedFunction(choice.name)), parallel
    if choice.name is not None:
        raise InvalidRequest(
            "`tool_choice.name` is only allowed with `type: \"tool\"`; remove it.",
            param="tool_choice.name",
        )
    if choice.type == "any":
        return "required", parallel
    if choice.type == "none":
        return "none", None
    return "auto", parallel


def _check_top(req: CountTokensRequest) -> None:
    if not req.model:
        raise InvalidRequest("`model` must be a non-empty model name.", param="model")
    for name, message in _REJECTED:
        value = getattr(req, name)
        if value is not UNSET and value is not None:
            raise UnsupportedField(message, param=name)
    if req.speed == "fast":
        raise UnsupportedField(
            "`speed: \"fast\"` is Anthropic's fast mode; a self-hosted model has one speed. "
            "Send `standard` or omit it.",
            param="speed",
        )
    thinking = req.thinking
    if thinking is not None:
        budget = thinking.budget_tokens
        if thinking.type == "enabled":
            if budget is None:
                raise InvalidRequest(
                    "`thinking` of type `enabled` needs `budget_tokens`.",
                    param="thinking.budget_tokens",
                )
            if not _MIN_BUDGET <= budget <= _INT32_MAX:
                raise InvalidRequest(
                    f"`thinking.budget_tokens` must be an integer of at least {_MIN_BUDGET}.",
                    param="thinking.budget_tokens",
                )
        elif budget is not None:
            raise InvalidRequest(
                "`thinking.budget_tokens` is only allowed with `type: \"enabled\"`; remove it.",
                param="thinking.budget_tokens",
            )
    if req.tool_choice is not None and not req.tools:
        raise InvalidRequest(
            "`tool_choice` requires `tools`; add tools or remove tool_choice.", param="tool_choice"
        )


def _check_generation(req: MessagesRequest) -> None:
    if not 1 <= req.max_tokens <= _INT32_MAX:
        raise InvalidRequest("`max_tokens` must be an integer of at least 1.", param="max_tokens")
    t = req.temperature
    if t is not None and not 0.0 <= t <= 1.0:
        raise InvalidRequest(
            "`temperature` must be a number from 0 to 1.", param="temperature"
        )


def _format(req: CountTokensRequest) -> ResponseFormat | None:
    oc = req.output_config
    if oc is None or oc.format is None:
        return None
    return ResponseFormat("json_schema", JsonSchemaFormat(schema_=oc.format.schema_))


def _to_chat(req: CountTokensRequest, paths: PathMap) -> ChatCompletionRequest:
    choice, parallel = _tool_choice(req)
    chat = ChatCompletionRequest(
        model=req.model,
        messages=_messages(req, paths),
        tools=_tools(req),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=_format(req),
    )
    if isinstance(req, MessagesRequest):
        chat.max_completion_tokens = req.max_tokens
        chat.stop = req.stop_sequences or None
        chat.temperature = req.temperature
        chat.top_p = req.top_p
        chat.top_k = req.top_k
        chat.stream = req.stream
    return chat


def _decoded(req: CountTokensRequest) -> tuple[ChatCompletionRequest, PathMap]:
    _check_top(req)
    if isinstance(req, MessagesRequest):
        _check_generation(req)
    paths = PathMap()
    chat = _to_chat(req, paths)
    try:
        check_chat_request(chat)
    except RequestError as err:
        raise translated(err, paths) from err
    return chat, paths


def decode_messages(body: bytes) -> tuple[MessagesRequest, ChatCompletionRequest, PathMap]:
    """Decode a ``/v1/messages`` body, apply every rule that does not depend on the model, and
    map it to a chat request (see the module docstring). Raises :class:`RequestError`."""
    req = decode_body(_decoder.decode, body)
    chat, paths = _decoded(req)
    return req, chat, paths


def decode_count_tokens(
    body: bytes,
) -> tuple[CountTokensRequest, ChatCompletionRequest, PathMap]:
    """Decode a ``/v1/messages/count_tokens`` body (the prompt fields of a Messages request;
    ``max_tokens``, sampling and ``stream`` are not among them) and map it to a chat request."""
    req = decode_body(_count_decoder.decode, body)
    chat, paths = _decoded(req)
    return req, chat, paths


def for_model(
    req: CountTokensRequest, chat: ChatCompletionRequest, profile: ModelProfile
) -> bool:
    """Apply what depends on the serving model to ``chat``; True when ``max_tokens`` is capped
    (the engine body then asks for output up to the context's end: ``max_new_tokens: null``).

    - ``thinking`` maps onto the reasoning parser when the model has one: ``enabled`` /
      ``adaptive`` → ``enable_thinking: true`` and the reasoning shown as ``thinking`` blocks,
      ``disabled`` → ``enable_thinking: false``; absent, the template's default holds and the
      reasoning stays hidden. A model with no reasoning parser: no effect.
    - A ``max_tokens`` at or above the model's context length (when known) cannot fit with any
      prompt; it is capped to what fits: generation runs until the context is full (or the
      model ends its turn), and ``stop_reason`` is ``max_tokens`` if the context ran out.
    """
    thinking = req.thinking
    if profile.reasoning_parser is not None and thinking is not None:
        on = thinking.type != "disabled"
        chat.chat_template_kwargs = ChatTemplateKwargs(enable_thinking=on)
        chat.include_reasoning = on
    ctx = profile.context_length
    cap = chat.max_completion_tokens
    if ctx is not None and cap is not None and cap >= ctx:
        chat.max_completion_tokens = None
        return True
    return False
