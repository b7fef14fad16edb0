"""The Responses API request (``POST /v1/responses``): validation, mapping to chat.

Theory of operation
-------------------
The gateway is stateless, so a Responses request is a chat request in another shape: the
``instructions`` become a system message, the ``input`` items become messages (a
``function_call`` item an assistant tool call, a ``function_call_output`` item a tool message),
function ``tools`` / ``tool_choice`` / ``text.format`` / ``max_output_tokens`` their chat
counterparts. :func:`decode_responses` decodes the body strictly (the Structs of ``schema.py``:
unknown top-level keys → ``unsupported_field``, as on chat), refuses what statelessness forbids
with a reason, checks the Responses-specific rules with Responses paths in ``param``, and
returns the mapped :class:`~.schemas.ChatCompletionRequest` with a :class:`~.paths.PathMap`.
The chat rules then run on the mapped request (one candidate: ``n`` is never set), and a chat
refusal's ``param`` is written back as the Responses path it came from (``messages[2].content``
→ ``input[1].content``), so a client never sees a field it did not send. Planning, the relay and
the engine path are chat's.

Decisions where the issue is silent (docs/API.md, "POST /v1/responses"):

- ``input`` items may omit ``type`` (the SDK's easy message form): such an item is a message.
  Item types other than ``message``, ``function_call``, ``function_call_output`` and
  ``reasoning`` are refused with ``unsupported_field`` (``item_reference`` and the built-in
  tools' call items need server-side state or tools the gateway does not run).
- Replayed ``reasoning`` items are dropped (as chat drops a replayed ``reasoning_content``);
  replayed ``output_text`` / ``refusal`` parts of assistant messages become their text.
- Consecutive ``function_call`` items (after an assistant message, or alone) form one assistant
  turn with several tool calls; a ``function_call_output`` must name the ``call_id`` of an
  earlier ``function_call`` item. Its ``output`` is a string or ``input_text`` parts.
- ``store``: absent or ``false`` is accepted (nothing is stored either way); ``true`` is refused.
  ``background: false`` is accepted; ``true`` is refused. ``include``, ``top_logprobs``,
  ``reasoning``, ``truncation``, ``max_tool_calls``, ``prompt``, ``service_tier`` and
  ``metadata`` are refused with a reason; an explicit ``null`` means absent for each, and so
  does ``include: []`` (nothing extra asked for).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from msgspec import UNSET

from ...core.errors import InvalidRequest, RequestError, UnsupportedField
from ...core.request.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    InputImagePart,
    InputTextPart,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
)
from ...core.request.validate import (
    check_chat_request,
    decode_body,
    is_json_object,
    validation_error,
)
from .paths import PathMap, translated
from .schema import (
    RESPONSES_KNOWN_REJECTED,
    RContent,
    ResponsesRequest,
    RFormatJsonObject,
    RFormatJsonSchema,
    RFormatText,
    RFunctionCall,
    RFunctionCallOutput,
    RFunctionTool,
    RInputImage,
    RInputText,
    RItem,
    RMessage,
    RNamedTool,
    ROutputText,
    RRefusal,
)

__all__ = ["decode_responses"]

_decoder = msgspec.json.Decoder(ResponsesRequest)
_REJECTED = tuple(RESPONSES_KNOWN_REJECTED.items())
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_INT32_MAX = 2**31 - 1
_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})


def _convert(obj: Any, typ: Any, path: str) -> Any:
    """``msgspec.convert`` of one nested object, its errors reported at ``path``."""
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        head, sep, tail = text.rpartition(" - at `$")
        text = f"{head} - at `$.{path}{tail}" if sep else f"{text} - at `$.{path}`"
        raise validation_error(text) from exc


def _check_top(req: ResponsesRequest) -> None:
    if not req.model:
        raise InvalidRequest("`model` must be a non-empty model name.", param="model")
    for name, message in _REJECTED:
        value = getattr(req, name)
        if value is not UNSET and value is not None and not (name == "include" and value == []):
            raise UnsupportedField(message, param=name)
    if req.store:
        raise UnsupportedField(
            "`store: true` needs stored responses, and the gateway is stateless: it stores "
            "none. Send `store: false` or omit it.",
            param="store",
        )
    if req.background:
        raise UnsupportedField(
            "`background: true` needs a stored response to poll, and the gateway is stateless; "
            "omit it and use `stream: true` for long generations.",
            param="background",
        )
    if req.text is not None and req.text.verbosity is not UNSET and req.text.verbosity is not None:
        raise UnsupportedField(
            "`text.verbosity` is out of scope; remove it.", param="text.verbosity"
        )
    cap = req.max_output_tokens
    if cap is not None and not 1 <= cap <= _INT32_MAX:
        raise InvalidRequest(
            "`max_output_tokens` must be an integer of at least 1.", param="max_output_tokens"
        )


def _tools(req: ResponsesRequest) -> list[Tool] | None:
    if req.tools is None:
        return None
    if not req.tools:
        raise InvalidRequest(
            "`tools` must contain at least one tool; omit it instead.", param="tools"
        )
    out: list[Tool] = []
    for k, raw in enumerate(req.tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise UnsupportedField(
                f"Built-in tools such as `{kind}` run on OpenAI's own servers; this gateway "
                "serves function tools only (`type: \"function\"`).",
                param=f"tools[{k}].type",
            )
        t: RFunctionTool = _convert(raw, RFunctionTool, f"tools[{k}]")
        if _TOOL_NAME.fullmatch(t.name) is None:
            raise InvalidRequest(
                "A tool name must be 1 to 64 characters of a-z, A-Z, 0-9, _ or -.",
                param=f"tools[{k}].name",
            )
        fn = FunctionDef(t.name, t.description, t.parameters, t.strict)
        out.append(Tool("function", fn))
    return out


def _text_of(parts: list[RContent], path: str, *, images: bool) -> list[ContentPart]:
    out: list[ContentPart] = []
    for j, p in enumerate(parts):
        if type(p) is RInputText:
            out.append(InputTextPart(p.text))
        elif type(p) is ROutputText:
            out.append(TextPart(p.text))
        elif type(p) is RRefusal:
            out.append(TextPart(p.refusal))
        else:
            assert type(p) is RInputImage
            if not images:
                raise InvalidRequest(
                    "Image parts are only allowed in user messages; move the image.",
                    param=f"{path}[{j}]",
                )
            if p.image_url is None and p.file_id is None:
                raise InvalidRequest(
                    "An `input_image` part needs `image_url`, a base64 `data:` URI.",
                    param=f"{path}[{j}].image_url",
                )
            if p.file_id is not None or p.image_url is None:
                raise UnsupportedField(
                    "`file_id` images need stored files, and the gateway is stateless; send the "
                    "image as a base64 `data:` URI in `image_url`.",
                    param=f"{path}[{j}]",
                )
            out.append(InputImagePart(p.image_url, p.detail))
    return out


def _content(
    value: str | list[RContent], path: str, *, images: bool
) -> str | list[ContentPart]:
    """A message's ``content`` or a call output's ``output``: a string, or its parts."""
    if isinstance(value, str):
        return value
    if not value:
        name = path.rsplit(".", 1)[1]
        raise InvalidRequest(
            f"`{name}` must not be an empty array; send a string or at least one part.",
            param=path,
        )
    return _text_of(value, path, images=images)


def _items(req: ResponsesRequest, paths: PathMap) -> list[ChatMessage]:
    """The chat messages of ``instructions`` and ``input`` (``paths`` records their origin)."""
    messages: list[ChatMessage] = []
    if req.instructions is not None:
        messages.append(ChatMessage("system", req.instructions))
        paths.messages.append("instructions")
    if isinstance(req.input, str):
        messages.append(ChatMessage("user", req.input))
        paths.messages.append("input")
        return messages
    if not req.input:
        raise InvalidRequest("`input` must contain at least one item.", param="input")
    calls: dict[str, str] = {}  # call_id → name of the function_call items so far
    open_turn = False  # the last message is an assistant turn function calls may join
    for k, raw in enumerate(req.input):
        path = f"input[{k}]"
        if isinstance(raw, dict) and "type" not in raw:
            raw = {**raw, "type": "message"}
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind not in _ITEM_TYPES:
            raise UnsupportedField(
                f"Input items of type `{kind}` are not supported: the gateway is stateless and "
                "runs no built-in tools. Send `message`, `function_call`, `function_call_output` "
                "or `reasoning` items.",
                param=f"{path}.type",
            )
        item: RItem = _convert(raw, RItem, path)
        if type(item) is RMessage:
            role = item.role
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(
                    "`role` must be one of user, system, developer or assistant.",
                    param=f"{path}.role",
                )
            content = _content(item.content, f"{path}.content", images=role == "user")
            messages.append(ChatMessage("system" if role == "developer" else role, content))
            paths.messages.append(path)
            open_turn = role == "assistant"
        elif type(item) is RFunctionCall:
            _check_call(item, path, calls)
            call = ToolCall(item.call_id, "function", FunctionCall(item.name, item.arguments))
            if not open_turn:
                messages.append(ChatMessage("assistant", None, tool_calls=[]))
                paths.messages.append(path)
                open_turn = True
            turn = messages[-1]
            if turn.tool_calls is None:
                turn.tool_calls = []
            paths.calls[(len(messages) - 1, len(turn.tool_calls))] = path
            turn.tool_calls.append(call)
        elif type(item) is RFunctionCallOutput:
            if item.call_id not in calls:
                raise InvalidRequest(
                    "`call_id` must match the `call_id` of an earlier `function_call` item.",
                    param=f"{path}.call_id",
                )
            output = _content(item.output, f"{path}.output", images=False)
            paths.outputs.add(len(messages))
            messages.append(ChatMessage("tool", output, tool_call_id=item.call_id))
            paths.messages.append(path)
            open_turn = False
        # a reasoning item: dropped (its turn's answer follows as a message or function calls)
    if not messages:
        raise InvalidRequest(
            "`input` must contain a message or a function call output, not only reasoning items.",
            param="input",
        )
    return messages


def _check_call(item: RFunctionCall, path: str, calls: dict[str, str]) -> None:
    if not item.call_id:
        raise InvalidRequest(
            "A function call needs a non-empty `call_id`.", param=f"{path}.call_id"
        )
    if not item.name:
        raise InvalidRequest("A function call needs a non-empty `name`.", param=f"{path}.name")
    if not is_json_object(item.arguments):
        raise InvalidRequest(
            'Function call `arguments` must be a JSON-encoded object, such as "{}".',
            param=f"{path}.arguments",
        )
    calls[item.call_id] = item.name


def _format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    if type(fmt) is RFormatText:
        return ResponseFormat("text")
    if type(fmt) is RFormatJsonObject:
        return ResponseFormat("json_object")
    assert type(fmt) is RFormatJsonSchema
    js = JsonSchemaFormat(fmt.name, fmt.description, fmt.schema_, fmt.strict)
    return ResponseFormat("json_schema", js)


def to_chat(req: ResponsesRequest, paths: PathMap) -> ChatCompletionRequest:
    """The chat request a validated Responses request means (one candidate)."""
    choice = req.tool_choice
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None
    if isinstance(choice, RNamedTool):
        tool_choice = NamedToolChoice("function", NamedFunction(choice.name))
    else:
        tool_choice = choice
    return ChatCompletionRequest(
        model=req.model,
        messages=_items(req, paths),
        chat_template_kwargs=req.chat_template_kwargs,
        include_reasoning=req.include_reasoning,
        lora_adapter=req.lora_adapter,
        max_completion_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls,
        prompt_cache_key=req.prompt_cache_key,
        response_format=_format(req),
        safety_identifier=req.safety_identifier,
        stream=req.stream,
        temperature=req.temperature,
        tool_choice=tool_choice,
        tools=_tools(req),
        top_p=req.top_p,
        user=req.user,
    )


def decode_responses(body: bytes) -> tuple[ResponsesRequest, ChatCompletionRequest, PathMap]:
    """Decode a ``/v1/responses`` body, apply every rule that does not depend on the model, and
    map it to a chat request (see the module docstring). Raises :class:`RequestError`."""
    req = decode_body(_decoder.decode, body)
    _check_top(req)
    paths = PathMap()
    chat = to_chat(req, paths)
    if isinstance(req.tool_choice, RNamedTool) and chat.tools is None:
        raise InvalidRequest(
            "`tool_choice` requires `tools`; add tools or remove tool_choice.", param="tool_choice"
        )
    fmt = chat.response_format
    forcing = req.tool_choice == "required" or isinstance(req.tool_choice, RNamedTool)
    if forcing and chat.tools is not None and fmt is not None and fmt.type != "text":
        raise InvalidRequest(
            "A forcing `tool_choice` cannot be combined with a JSON `text.format` (two competing "
            "grammars); drop one of them.",
            param="text.format",
        )
    try:
        check_chat_request(chat)
    except RequestError as err:
        raise translated(err, paths) from err
    return req, chat, paths
