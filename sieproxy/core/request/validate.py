"""Request validation: bytes → typed request → a request that passed every rule, or a 400.

Two steps per endpoint, because the HTTP layer looks the model up (404) between them:

- ``decode_*`` decodes the body straight into its msgspec Struct (types, unknown keys) and
  applies every rule that does not depend on the model (ranges, cross-field rules, messages,
  tools).
- ``check_*`` applies the rules that depend on the :class:`ModelProfile` (LoRA adapters, default
  max tokens, image support and limits) and returns a :class:`ValidChat` / :class:`ValidCompletion`.
  It assumes its argument came from ``decode_*``.

Every refusal is an :class:`InvalidRequest` or :class:`UnsupportedField` whose ``param`` is a JSON
path (``messages[2].tool_call_id``) and whose ``message`` is the gateway's own sentence; msgspec's
text is parsed for the path and kind of error, never echoed.

Decisions where the contract is silent
--------------------------------------
- ``null`` for an optional field means the same as leaving it out. For a known-rejected field
  (``functions``, ``echo``, ...) an explicit ``null`` is also treated as absent; any other value,
  even ``false`` or ``[]``, is refused with ``unsupported_field``.
- Unknown keys: at the top level, inside ``stream_options`` and inside ``chat_template_kwargs``
  (including ``guardian_config``) → ``unsupported_field`` with ``param`` the key's path; unknown
  keys anywhere else (messages, content parts, tools, response_format) → ``invalid_request``.
- Checks run in a fixed order and the first failure is reported: model, known-rejected fields,
  scalar fields (n, best_of, sampling, logprobs, token limits, stop), chat_template_kwargs,
  messages in order, tools, tool_choice, response_format; then, in ``check_chat``, lora_adapter,
  min_tokens against the effective max, images in message order.
- ``best_of`` with ``stream: true`` is refused whatever its value; range errors of ``best_of`` are
  reported before the streaming refusal, which comes before ``best_of >= n``.
- ``max_tokens`` and ``max_completion_tokens`` are each checked (>= 1) when present, even though
  ``max_completion_tokens`` wins. Integer fields that size engine buffers (token limits, top_k)
  are capped at 2**31 - 1 (engines hold them in int32).
- ``logit_bias`` keys are ASCII decimal token ids ``0 … 2**31 - 1``; the 1024-key cap is checked
  first (``param: "logit_bias"``), then each key (``param: "logit_bias.<key>"``).
- ``stop``: an empty list is the same as no stop; ``ValidChat.stop`` is the request's own list
  (planning adds the profile's stop strings).
- Messages: an empty ``content`` array is refused; image parts are accepted only on ``user``
  messages (as OpenAI does); ``tool_calls: []`` on an assistant message counts as no tool calls,
  so that message needs content; ``tool_calls`` (even empty) on any other role is refused. A
  ``tool`` message's ``tool_call_id`` must be non-empty and match the id of a tool call of an
  earlier assistant message. Replayed tool calls need a non-empty ``id`` and function ``name``,
  and ``arguments`` must be a JSON-encoded object (chat templates receive it as a mapping).
- ``tools: []`` is refused (OpenAI does; omit the field instead). Any ``tool_choice``, ``"none"``
  included, requires non-empty ``tools``. A forcing ``tool_choice`` conflicts with
  ``response_format`` only when the format's type is not ``text`` (``param: "response_format"``).
- ``response_format.json_schema`` needs a ``schema`` object; its ``name`` is optional (SGLang does
  not need it). A ``json_schema`` member sent with another type is ignored.
- Images: for a model without image input (or an encode-only model) any image part is refused
  with ``unsupported_field`` before its URL is looked at; otherwise remote URLs, malformed
  ``data:`` URIs, bad base64, unsupported or mislabelled types and oversized images are refused
  with ``invalid_request`` (``param`` … ``.image_url``). See :mod:`sieproxy.core.images`.
- Model limits, once learned from the engine (``ModelProfile.context_length`` / ``vocab_size``):
  an explicit ``max_tokens`` / ``max_completion_tokens`` of at least the context length is
  refused (``context_length_exceeded``; the default cap is lowered to fit instead), and so is a
  ``logit_bias`` id at or past the vocabulary size (``param: "logit_bias"``). See
  :mod:`sieproxy.core.refusal` for the engine's own refusals.
- Completions: an empty ``prompt`` string is accepted; ``temperature`` follows the chat rule
  (finite, >= 0).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import TypeVar

import msgspec
from msgspec import UNSET

from ..errors import InvalidRequest, RequestError, UnsupportedField
from .images import decode_image_uri
from .profile import ModelProfile
from .refusal import logit_bias_out_of_vocab, max_tokens_over_context
from .schemas import (
    CHAT_KNOWN_REJECTED,
    COMPLETIONS_KNOWN_REJECTED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    InputImagePart,
    NamedToolChoice,
    chat_request_decoder,
    completion_request_decoder,
)
from .valid import ImageInput, ValidChat, ValidCompletion

__all__ = [
    "MAX_CANDIDATES",
    "MAX_LOGIT_BIAS",
    "MAX_STOP",
    "MAX_STOP_LENGTH",
    "check_chat",
    "check_chat_request",
    "check_completion",
    "decode_body",
    "decode_chat",
    "decode_completion",
    "is_json_object",
    "validation_error",
]

MAX_CANDIDATES = 128
MAX_STOP = 32  # SGLang's MAX_STOP_COUNT
#: Longest stop string accepted (the gateway matches stops itself, incrementally, per choice).
MAX_STOP_LENGTH = 512
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
MAX_RISK_NAME = 128
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_INT32_MAX = 2**31 - 1
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_FLOAT_MAX = sys.float_info.max  # `lo <= x <= _FLOAT_MAX` refuses inf and NaN in one test

_ROLES = frozenset({"system", "user", "assistant", "tool"})
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_INDEX = re.compile(r"\[\d+\]")

# Objects whose unknown keys are "unsupported" (a field we might add) rather than malformed.
_UNSUPPORTED_PARENTS = frozenset(
    {"", "stream_options", "chat_template_kwargs", "chat_template_kwargs.guardian_config"}
)

_ENUMS = {
    "messages[].content[].type": "one of `text`, `input_text`, `image_url` or `input_image`",
    "messages[].content[].detail": "one of `auto`, `low` or `high`",
    "messages[].content[].image_url.detail": "one of `auto`, `low` or `high`",
    "messages[].tool_calls[].type": "`function`",
    "tools[].type": "`function`",
    "tool_choice": "one of `auto`, `none`, `required` or a named function object",
    "tool_choice.type": "`function`",
    "response_format.type": "one of `text`, `json_object` or `json_schema`",
    # /v1/responses (sieproxy.surfaces.responses.request)
    "input[].content[].type": "one of `input_text`, `input_image`, `output_text` or `refusal`",
    "input[].output[].type": "one of `input_text`, `input_image`, `output_text` or `refusal`",
    "input[].content[].detail": "one of `auto`, `low` or `high`",
    "text.format.type": "one of `text`, `json_object` or `json_schema`",
}

_TYPE_NAMES = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}


# ---------------------------------------------------------------- translating msgspec errors


def _json_path(path: str) -> str:
    """``$.messages[0].role`` → ``messages[0].role``; ``$`` → ``""``; dict keys drop out."""
    return path[2:].replace("[...]", "") if path.startswith("$.") else ""


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _describe(types: str) -> str:
    names = [_TYPE_NAMES.get(t, t) for t in types.split(" | ") if t != "null"]
    return " or ".join(names) if names else "null"


def _validation_error(text: str) -> RequestError:
    """Turn msgspec's ValidationError text into a gateway error (never echoing it)."""
    head, sep, tail = text.rpartition(" - at `")
    if sep and tail.endswith("`"):
        path = _json_path(tail[:-1])
        subject = f"Each `{path}` value" if tail.endswith("[...]`") else f"`{path}`"
    else:
        head, path = text, ""
        subject = ""

    if head.startswith("Object contains unknown field `") and head.endswith("`"):
        name = head[31:-1]
        param = _join(path, name)
        if path in _UNSUPPORTED_PARENTS:
            return UnsupportedField(f"`{param}` is not a supported field; remove it.", param=param)
        return InvalidRequest(f"`{param}` is not an accepted key here; remove it.", param=param)

    if head.startswith("Object missing required field `") and head.endswith("`"):
        param = _join(path, head[31:-1])
        return InvalidRequest(f"`{param}` is required; add it.", param=param)

    if head.startswith("Expected `") and "`, got `" in head:
        expected, _, got = head[10:].partition("`, got `")
        got = got.rstrip("`")
        if not path:
            return InvalidRequest(f"The request body must be a JSON object, not {_describe(got)}.")
        return InvalidRequest(
            f"{subject} must be {_describe(expected)}, not {_describe(got)}.", param=path
        )

    if head.startswith(("Invalid value ", "Invalid enum value ")):
        allowed = _ENUMS.get(_INDEX.sub("[]", path))
        if allowed:
            return InvalidRequest(f"`{path}` must be {allowed}.", param=path)
        return InvalidRequest(f"`{path}` has a value that is not accepted.", param=path or None)

    if head.startswith("Number out of range"):
        return InvalidRequest(f"`{path}` is out of range; send a finite number.", param=path)

    if path:
        return InvalidRequest(f"`{path}` is invalid; check its type and value.", param=path)
    return InvalidRequest("The request body is not a valid request object.")


def _decode_error(text: str) -> InvalidRequest:
    if "UTF-8" in text:
        return InvalidRequest("The request body is not valid UTF-8; encode the JSON as UTF-8.")
    return InvalidRequest("The request body is not valid JSON; send one JSON object.")


_T = TypeVar("_T")


def _decode(decode: Callable[[bytes], _T], body: bytes) -> _T:
    """Decode ``body`` with ``decode`` (a typed msgspec decoder), every failure a 400."""
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    try:
        return _decode_typed(decode, body)
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.") from None


def _decode_typed(decode: Callable[[bytes], _T], body: bytes) -> _T:
    try:
        return decode(body)
    except msgspec.ValidationError as exc:
        # msgspec validates while it parses, so a field error can be reported before the JSON
        # turns out to be truncated or malformed further on: malformed JSON wins.
        try:
            _any_json(body)
        except msgspec.ValidationError:
            pass  # (a DecodeError subclass) e.g. a number out of range: the typed error says where
        except msgspec.DecodeError as dexc:
            raise _decode_error(str(dexc)) from dexc
        raise _validation_error(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise _decode_error(str(exc)) from exc


_any_json = msgspec.json.Decoder().decode

#: Public names of the two decoding helpers, for the other request surfaces of the core.
decode_body = _decode
validation_error = _validation_error


# ---------------------------------------------------------------- rules shared by both endpoints


def _check_model(model: str) -> None:
    if not model:
        raise InvalidRequest("`model` must be a non-empty model name.", param="model")


def _check_sampling(req: ChatCompletionRequest | CompletionRequest) -> None:
    v: float | None = req.frequency_penalty
    if v is not None and not -2.0 <= v <= 2.0:
        raise InvalidRequest(
            "`frequency_penalty` must be a number from -2.0 to 2.0.", param="frequency_penalty"
        )
    v = req.presence_penalty
    if v is not None and not -2.0 <= v <= 2.0:
        raise InvalidRequest(
            "`presence_penalty` must be a number from -2.0 to 2.0.", param="presence_penalty"
        )
    v = req.temperature
    if v is not None and not 0.0 <= v <= _FLOAT_MAX:
        raise InvalidRequest(
            "`temperature` must be a finite number greater than or equal to 0.",
            param="temperature",
        )
    v = req.top_p
    if v is not None and not 0.0 < v <= 1.0:
        raise InvalidRequest(
            "`top_p` must be a number greater than 0 and at most 1.", param="top_p"
        )
    seed = req.seed
    if seed is not None and not _INT64_MIN <= seed <= _INT64_MAX:
        raise InvalidRequest("`seed` must be a signed 64-bit integer.", param="seed")


def _check_stop(stop: str | list[str] | None) -> None:
    if stop is None:
        return
    if type(stop) is str:
        if not stop:
            raise InvalidRequest("`stop` must not be an empty string.", param="stop")
        if len(stop) > MAX_STOP_LENGTH:
            raise InvalidRequest(
                f"A stop string may be at most {MAX_STOP_LENGTH} characters long.", param="stop"
            )
        return
    if len(stop) > MAX_STOP:
        raise InvalidRequest(f"`stop` may hold at most {MAX_STOP} strings.", param="stop")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(
                "Stop strings must not be empty; remove the empty entry.", param=f"stop[{i}]"
            )
        if len(s) > MAX_STOP_LENGTH:
            raise InvalidRequest(
                f"Stop strings may be at most {MAX_STOP_LENGTH} characters long.",
                param=f"stop[{i}]",
            )


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if type(stop) is str:
        return [stop]
    return list(stop)


def _check_token_limit(value: int | None, name: str) -> None:
    if value is not None and not 1 <= value <= _INT32_MAX:
        raise InvalidRequest(f"`{name}` must be an integer of at least 1.", param=name)


# ---------------------------------------------------------------- chat


_CHAT_REJECTED = tuple(CHAT_KNOWN_REJECTED.items())
_COMPLETIONS_REJECTED = tuple(COMPLETIONS_KNOWN_REJECTED.items())


def _check_known_rejected(
    req: ChatCompletionRequest | CompletionRequest, table: tuple[tuple[str, str], ...]
) -> None:
    for name, message in table:
        value = getattr(req, name)
        if value is not UNSET and value is not None:
            raise UnsupportedField(message, param=name)


def _check_logit_bias(bias: dict[str, float]) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} token ids.", param="logit_bias"
        )
    for key, value in bias.items():
        if not (len(key) <= 10 and key.isascii() and key.isdigit() and int(key) <= _INT32_MAX):
            raise InvalidRequest(
                "`logit_bias` keys must be token ids written as non-negative integers.",
                param=f"logit_bias.{key}",
            )
        if not -100.0 <= value <= 100.0:
            raise InvalidRequest(
                "`logit_bias` values must be numbers from -100 to 100.",
                param=f"logit_bias.{key}",
            )


def _check_fits_context(profile: ModelProfile, param: str, value: int) -> None:
    """A token cap that leaves no room for even a one-token prompt, when the context is known
    (the engine would refuse it; the prompt's own length is the engine's to check)."""
    ctx = profile.context_length
    if ctx is not None and value >= ctx:
        raise max_tokens_over_context(param, value, ctx)


def _check_chat_scalars(req: ChatCompletionRequest) -> None:
    n = req.n
    if n is None:
        n = 1
    elif not 1 <= n <= MAX_CANDIDATES:
        raise InvalidRequest(f"`n` must be an integer from 1 to {MAX_CANDIDATES}.", param="n")
    best_of = req.best_of
    if best_of is not None:
        if not 1 <= best_of <= MAX_CANDIDATES:
            raise InvalidRequest(
                f"`best_of` must be an integer from 1 to {MAX_CANDIDATES}.", param="best_of"
            )
        if req.stream:
            raise UnsupportedField(
                "`best_of` cannot be used with `stream: true`; remove one of them.",
                param="best_of",
            )
        if best_of < n:
            raise InvalidRequest("`best_of` must be greater than or equal to `n`.", param="best_of")
    _check_sampling(req)
    v = req.repetition_penalty
    if v is not None and not 0.0 < v <= 2.0:
        raise InvalidRequest(
            "`repetition_penalty` must be a number greater than 0 and at most 2.",
            param="repetition_penalty",
        )
    top_k = req.top_k
    if top_k is not None and not 1 <= top_k <= _INT32_MAX:
        raise InvalidRequest("`top_k` must be an integer of at least 1.", param="top_k")
    top_logprobs = req.top_logprobs
    if top_logprobs is not None:
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"`top_logprobs` must be an integer from 0 to {MAX_TOP_LOGPROBS}.",
                param="top_logprobs",
            )
        if top_logprobs and not req.logprobs:
            raise InvalidRequest(
                "`top_logprobs` requires `logprobs: true`; set logprobs or drop top_logprobs.",
                param="top_logprobs",
            )
    if req.logit_bias is not None:
        _check_logit_bias(req.logit_bias)
    _check_token_limit(req.max_completion_tokens, "max_completion_tokens")
    _check_token_limit(req.max_tokens, "max_tokens")
    min_tokens = req.min_tokens
    if min_tokens is not None and not 0 <= min_tokens <= _INT32_MAX:
        raise InvalidRequest("`min_tokens` must be an integer of at least 0.", param="min_tokens")
    _check_stop(req.stop)
    kwargs = req.chat_template_kwargs
    if kwargs is not None and kwargs.guardian_config is not None:
        risk = kwargs.guardian_config.risk_name
        if not 0 < len(risk) <= MAX_RISK_NAME:
            raise InvalidRequest(
                f"`risk_name` must be a non-empty string of at most {MAX_RISK_NAME} characters.",
                param="chat_template_kwargs.guardian_config.risk_name",
            )
    if req.lora_adapter is not None and not req.lora_adapter:
        raise InvalidRequest(
            "`lora_adapter` must be a non-empty adapter name; omit it for the base model.",
            param="lora_adapter",
        )


def is_json_object(text: str) -> bool:
    """``text`` is a JSON-encoded object (as tool-call ``arguments`` must be)."""
    try:
        return type(msgspec.json.decode(text)) is dict
    except msgspec.DecodeError:
        return False


def _check_tool_calls(msg: ChatMessage, i: int, call_ids: set[str]) -> None:
    assert msg.tool_calls is not None
    for k, call in enumerate(msg.tool_calls):
        if not call.id:
            raise InvalidRequest(
                "Each tool call needs a non-empty `id`.", param=f"messages[{i}].tool_calls[{k}].id"
            )
        if not call.function.name:
            raise InvalidRequest(
                "Each tool call needs a non-empty function `name`.",
                param=f"messages[{i}].tool_calls[{k}].function.name",
            )
        if not is_json_object(call.function.arguments):
            raise InvalidRequest(
                'Tool call `arguments` must be a JSON-encoded object, such as "{}".',
                param=f"messages[{i}].tool_calls[{k}].function.arguments",
            )
        call_ids.add(call.id)


def _check_messages(messages: list[ChatMessage]) -> None:
    if not messages:
        raise InvalidRequest("`messages` must contain at least one message.", param="messages")
    call_ids: set[str] = set()
    for i, msg in enumerate(messages):
        role = msg.role
        if role == "developer":
            msg.role = role = "system"
        elif role not in _ROLES:
            raise InvalidRequest(
                "`role` must be one of system, user, assistant, tool or developer.",
                param=f"messages[{i}].role",
            )
        if role == "tool":
            call_id = msg.tool_call_id
            if not call_id:
                raise InvalidRequest(
                    "A tool message needs a non-empty `tool_call_id` naming the call it answers.",
                    param=f"messages[{i}].tool_call_id",
                )
            if call_id not in call_ids:
                raise InvalidRequest(
                    "`tool_call_id` must match the id of a tool call in an earlier assistant "
                    "message.",
                    param=f"messages[{i}].tool_call_id",
                )
        elif msg.tool_call_id is not None:
            raise InvalidRequest(
                "`tool_call_id` is only allowed on tool messages; remove it.",
                param=f"messages[{i}].tool_call_id",
            )
        if msg.tool_calls is not None:
            if role != "assistant":
                raise InvalidRequest(
                    "`tool_calls` is only allowed on assistant messages; remove it.",
                    param=f"messages[{i}].tool_calls",
                )
            _check_tool_calls(msg, i, call_ids)
        content = msg.content
        if content is None or content is UNSET:
            if role != "assistant":
                raise InvalidRequest(
                    f"A {role} message needs `content`.", param=f"messages[{i}].content"
                )
            if not msg.tool_calls:
                raise InvalidRequest(
                    "An assistant message needs `content` unless it carries `tool_calls`.",
                    param=f"messages[{i}].content",
                )
        elif type(content) is list:
            if not content:
                raise InvalidRequest(
                    "`content` must not be an empty array; send at least one part.",
                    param=f"messages[{i}].content",
                )
            if role != "user":
                for j, part in enumerate(content):
                    if type(part) is ImagePart or type(part) is InputImagePart:
                        raise InvalidRequest(
                            "Image parts are only allowed in user messages; move the image.",
                            param=f"messages[{i}].content[{j}]",
                        )


def _check_tools(req: ChatCompletionRequest) -> None:
    tools = req.tools
    names: set[str] = set()
    if tools is not None:
        if not tools:
            raise InvalidRequest(
                "`tools` must contain at least one tool; omit it instead.", param="tools"
            )
        for k, tool in enumerate(tools):
            name = tool.function.name
            if _TOOL_NAME.fullmatch(name) is None:
                raise InvalidRequest(
                    "A tool name must be 1 to 64 characters of a-z, A-Z, 0-9, _ or -.",
                    param=f"tools[{k}].function.name",
                )
            if name in names:
                raise InvalidRequest(
                    f"Tool names must be unique; `{name}` appears twice.",
                    param=f"tools[{k}].function.name",
                )
            names.add(name)
    choice = req.tool_choice
    rf = req.response_format
    if choice is not None:
        if tools is None:
            raise InvalidRequest(
                "`tool_choice` requires `tools`; add tools or remove tool_choice.",
                param="tool_choice",
            )
        forcing = choice == "required"
        if type(choice) is NamedToolChoice:
            forcing = True
            if choice.function.name not in names:
                raise InvalidRequest(
                    "`tool_choice` must name a function that is declared in `tools`.",
                    param="tool_choice.function.name",
                )
        if forcing and rf is not None and rf.type != "text":
            raise InvalidRequest(
                "A forcing `tool_choice` cannot be combined with a JSON `response_format` "
                "(two competing grammars); drop one of them.",
                param="response_format",
            )
    if rf is not None and rf.type == "json_schema":
        js = rf.json_schema
        if js is None or js.schema_ is None:
            raise InvalidRequest(
                "A json_schema `response_format` needs `json_schema.schema`, a JSON Schema object.",
                param="response_format.json_schema",
            )


def decode_chat(body: bytes) -> ChatCompletionRequest:
    """Decode a chat request body and apply every rule that does not depend on the model.

    Normalizes ``developer`` roles to ``system`` in place. Raises :class:`RequestError`.
    """
    req = _decode(chat_request_decoder.decode, body)
    check_chat_request(req)
    return req


def check_chat_request(req: ChatCompletionRequest) -> None:
    """Every rule of :func:`decode_chat` after decoding (also run on the chat request a
    Responses request maps to)."""
    _check_model(req.model)
    _check_known_rejected(req, _CHAT_REJECTED)
    _check_chat_scalars(req)
    _check_messages(req.messages)
    _check_tools(req)


def _chat_images(req: ChatCompletionRequest, profile: ModelProfile) -> list[ImageInput]:
    images: list[ImageInput] = []
    for i, msg in enumerate(req.messages):
        content = msg.content
        if type(content) is not list:
            continue
        for j, part in enumerate(content):
            if type(part) is not ImagePart and type(part) is not InputImagePart:
                continue
            path = f"messages[{i}].content[{j}]"
            if not profile.accepts_images:
                reason = (
                    "is an embedding (encode-only) model"
                    if profile.encode_only
                    else "does not accept image input"
                )
                raise UnsupportedField(
                    f"Model `{profile.name}` {reason}; remove the image part.", param=path
                )
            ref = part.image_url
            uri = ref if isinstance(ref, str) else ref.url
            mime, data = decode_image_uri(
                uri, max_bytes=profile.max_image_bytes, param=f"{path}.image_url"
            )
            images.append(ImageInput(i, j, mime, data, uri))
    return images


def _cannot_generate(profile: ModelProfile) -> InvalidRequest:
    # An encode-only (embedding) model has no generation head: answering 200 would relay
    # whatever its engine makes of a /generate call. The contract serves no embeddings surface,
    # so the only advice is to pick another model.
    return InvalidRequest(
        f"Model `{profile.name}` is an embedding (encode-only) model and cannot generate "
        "text; choose a generative model (GET /v1/models lists them).",
        param="model",
    )


def check_chat(req: ChatCompletionRequest, profile: ModelProfile) -> ValidChat:
    """Apply the model-dependent rules to a request from :func:`decode_chat`."""
    if profile.encode_only:
        # The contract names the refusal of an image part sent to an encode-only model
        # (unsupported_field, at the part); any other request to it is refused for the model.
        _chat_images(req, profile)
        raise _cannot_generate(profile)
    lora = req.lora_adapter
    if lora is not None and lora not in profile.lora_names:
        raise InvalidRequest(
            f"`lora_adapter` names no adapter served for model `{profile.name}`; "
            "use a declared adapter name or omit it.",
            param="lora_adapter",
        )
    if req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
        _check_fits_context(profile, "max_completion_tokens", max_tokens)
    elif req.max_tokens is not None:
        max_tokens = req.max_tokens
        _check_fits_context(profile, "max_tokens", max_tokens)
    else:
        max_tokens = profile.default_max_tokens
        if profile.context_length is not None:  # a default never refuses: it is capped
            max_tokens = max(min(max_tokens, profile.context_length - 1), 1)
    if req.logit_bias and profile.vocab_size is not None:
        for key in req.logit_bias:
            if int(key) >= profile.vocab_size:
                raise logit_bias_out_of_vocab(int(key), profile.vocab_size)
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidRequest(
            f"`min_tokens` must not exceed the output-token cap ({max_tokens}).",
            param="min_tokens",
        )
    stream = bool(req.stream)
    options = req.stream_options
    n = req.n or 1
    return ValidChat(
        req=req,
        model=req.model,
        n=n,
        candidates=req.best_of or n,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=stream and options is not None and bool(options.include_usage),
        stop=_stop_list(req.stop),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        include_reasoning=bool(req.include_reasoning),
        best_of=req.best_of,
        images=_chat_images(req, profile),
        continuous_usage=stream and options is not None and bool(options.continuous_usage_stats),
    )


# ---------------------------------------------------------------- legacy completions


def decode_completion(body: bytes) -> CompletionRequest:
    """Decode a legacy completions body and apply every rule that does not depend on the model."""
    req = _decode(completion_request_decoder.decode, body)
    _check_model(req.model)
    _check_known_rejected(req, _COMPLETIONS_REJECTED)
    if type(req.prompt) is not str:
        raise UnsupportedField(
            "Batched (array) prompts are not supported; send one prompt string.", param="prompt"
        )
    n = req.n
    if n is not None and n != 1:
        if n > 1:
            raise UnsupportedField(
                "`n` > 1 is not supported on /v1/completions; use /v1/chat/completions.",
                param="n",
            )
        raise InvalidRequest("`n` must be 1 (or omitted) on /v1/completions.", param="n")
    _check_token_limit(req.max_tokens, "max_tokens")
    _check_sampling(req)
    _check_stop(req.stop)
    return req


def check_completion(req: CompletionRequest, profile: ModelProfile) -> ValidCompletion:
    """Build the validated completion from a request of :func:`decode_completion`.

    The model must be able to generate (not ``encode_only``), and ``max_tokens`` must stay below
    the context length when it is known.
    """
    if profile.encode_only:
        raise _cannot_generate(profile)
    prompt = req.prompt
    if type(prompt) is not str:
        raise UnsupportedField(
            "Batched (array) prompts are not supported; send one prompt string.", param="prompt"
        )
    if req.max_tokens is not None:
        _check_fits_context(profile, "max_tokens", req.max_tokens)
    options = req.stream_options
    return ValidCompletion(
        req=req,
        model=req.model,
        prompt=prompt,
        max_tokens=req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS,
        stream=bool(req.stream),
        stop=_stop_list(req.stop),
        include_usage=bool(req.stream and options and options.include_usage),
        continuous_usage=bool(req.stream and options and options.continuous_usage_stats),
    )
