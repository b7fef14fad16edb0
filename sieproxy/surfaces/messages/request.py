"""The Anthropic Messages request (``POST /v1/messages``, ``/v1/messages/count_tokens``).

Theory of operation
-------------------
As with ``/v1/responses``, a Messages request is a chat request in another shape, so this
module only decodes and maps; the chat rules, planning, the relay and the engine path are chat's.
:func:`decode_messages` decodes the body strictly (the Structs of ``schema.py`` forbid unknown
keys: an unknown top-level key is ``unsupported_field``, one inside a block
``invalid_request``), refuses what the gateway cannot honour with a reason, applies the
Messages-only rules with Messages paths in ``param``, and returns the mapped
:class:`~.schemas.ChatCompletionRequest` with a :class:`~.paths.PathMap`. :func:`for_model` then
applies what depends on the model (``thinking`` and the ``max_tokens`` cap); the chat rules run
on the mapped request, and a chat refusal's ``param`` (and its words) are written back as the
Messages path the client sent (``messages[3].tool_call_id`` →
``messages[2].content[0].tool_use_id``).

The mapping of the top-level fields (``system`` and ``messages``: ``conversation.py``;
docs/API.md, "POST /v1/messages", says which fields are honoured):

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

from typing import Any, Literal

import msgspec
from msgspec import UNSET

from ...core.errors import InvalidRequest, RequestError, UnsupportedField
from ...core.request.profile import ModelProfile
from ...core.request.schemas import (
    ChatCompletionRequest,
    ChatTemplateKwargs,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)
from ...core.request.validate import check_chat_request, decode_body, validation_error
from .conversation import chat_messages
from .paths import PathMap, translated
from .schema import MESSAGES_KNOWN_REJECTED, CountTokensRequest, MessagesRequest, MTool

__all__ = ["decode_count_tokens", "decode_messages", "for_model"]

_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)
_REJECTED = tuple(MESSAGES_KNOWN_REJECTED.items())
_INT32_MAX = 2**31 - 1
_MIN_BUDGET = 1024


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
        messages=chat_messages(req, paths),
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
