"""The request-validation contract as a data table (no tests here).

Each :class:`Case` is one request body and the answer the gateway must give: ``status`` 200 with
``code`` None for an accepted request, or 400 with the error envelope's ``code`` and ``param``.
The core suite (``tests/core/test_validate.py``) drives them through ``decode_*`` / ``check_*``;
the HTTP suite posts them to a gateway serving :data:`PROFILES`.

A case picks its model through ``body["model"]``: ``test-model`` (:data:`PROFILE`: text and
image input, one LoRA adapter) or ``text-model`` (:data:`TEXT_ONLY`). Raw-``bytes`` bodies test
the decoder itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sieproxy.core.request.profile import ModelProfile

__all__ = [
    "CASES",
    "CHAT_CASES",
    "COMPLETIONS_CASES",
    "PNG_B64",
    "PNG_DATA_URI",
    "PROFILE",
    "PROFILES",
    "TEXT_ONLY",
    "Case",
    "body_bytes",
]

PROFILE = ModelProfile(
    name="test-model", lora_names=frozenset({"my-adapter"}), inputs=frozenset({"text", "image"})
)
TEXT_ONLY = ModelProfile(name="text-model")
PROFILES: dict[str, ModelProfile] = {p.name: p for p in (PROFILE, TEXT_ONLY)}

#: A valid 1x1 greyscale PNG (67 bytes).
PNG_B64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg=="
)
PNG_DATA_URI = f"data:image/png;base64,{PNG_B64}"

INVALID = "invalid_request"
UNSUPPORTED = "unsupported_field"


@dataclass(frozen=True)
class Case:
    id: str
    endpoint: str  # "chat" | "completions"
    body: dict[str, Any] | bytes
    status: int
    code: str | None
    param: str | None


def body_bytes(case: Case) -> bytes:
    """The case's request body as sent on the wire."""
    if isinstance(case.body, bytes):
        return case.body
    return json.dumps(case.body).encode()


_USER = {"role": "user", "content": "Hello!"}
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
_ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [_TOOL_CALL]}
_TOOL_REPLY = {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}
_JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": {"type": "object"}},
}
_NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat_body(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "test-model", "messages": [_USER]}
    body.update(fields)
    return body


def _msgs(*messages: Any, **fields: Any) -> dict[str, Any]:
    return _chat_body(messages=list(messages), **fields)


def _image_msg(part: dict[str, Any], role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": "What is this?"}, part]}


def _img(url: Any, kind: str = "image_url") -> dict[str, Any]:
    return {"type": kind, "image_url": url}


def ok(id: str, body: dict[str, Any] | bytes, endpoint: str = "chat") -> Case:
    return Case(id, endpoint, body, 200, None, None)


def bad(
    id: str,
    body: dict[str, Any] | bytes,
    param: str | None,
    code: str = INVALID,
    endpoint: str = "chat",
) -> Case:
    return Case(id, endpoint, body, 400, code, param)


_C = _chat_body

CHAT_CASES: list[Case] = [
    # ---- body decoding
    ok("chat-minimal", _C()),
    bad("chat-empty-body", b"", None),
    bad("chat-whitespace-body", b"  \n", None),
    bad("chat-malformed-json", b'{"model": "test-model",', None),
    bad("chat-trailing-garbage", b'{"model": "test-model", "messages": []} x', None),
    bad("chat-top-level-array", b"[]", None),
    bad("chat-top-level-string", b'"hello"', None),
    bad("chat-top-level-number", b"42", None),
    bad("chat-top-level-null", b"null", None),
    bad(
        "chat-invalid-utf8",
        b'{"model": "test-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        None,
    ),
    bad("chat-nan-literal", b'{"model": "test-model", "messages": [], "temperature": NaN}', None),
    bad("chat-unknown-field", _C(foo=1), "foo", UNSUPPORTED),
    bad("chat-unknown-field-null", _C(foo=None), "foo", UNSUPPORTED),
    ok("chat-null-optional-is-absent", _C(temperature=None, n=None, stop=None, tools=None)),
    bad("chat-missing-model", {"messages": [_USER]}, "model"),
    bad("chat-missing-messages", {"model": "test-model"}, "messages"),
    bad("chat-model-not-string", _C(model=5), "model"),
    bad("chat-model-empty", _C(model=""), "model"),
    # ---- known-rejected fields (explicit null = absent)
    *[
        bad(f"chat-known-rejected-{name}", _C(**{name: value}), name, UNSUPPORTED)
        for name, value in [
            ("functions", [{"name": "f", "parameters": {}}]),
            ("function_call", "auto"),
            ("modalities", ["text"]),
            ("audio", {"voice": "alloy"}),
            ("metadata", {"k": "v"}),
            ("store", False),
            ("service_tier", "auto"),
            ("prediction", {"type": "content", "content": "x"}),
            ("reasoning_effort", "low"),
            ("verbosity", "low"),
        ]
    ],
    ok("chat-known-rejected-null-functions", _C(functions=None)),
    ok("chat-known-rejected-null-store", _C(store=None)),
    # ---- n / best_of / stream
    ok("chat-n-1", _C(n=1)),
    ok("chat-n-128", _C(n=128, max_tokens=1)),
    ok("chat-n-3-stream", _C(n=3, stream=True)),
    bad("chat-n-0", _C(n=0), "n"),
    bad("chat-n-129", _C(n=129), "n"),
    bad("chat-n-negative", _C(n=-1), "n"),
    bad("chat-n-float", _C(n=1.5), "n"),
    bad("chat-n-string", _C(n="2"), "n"),
    bad("chat-n-bool", _C(n=True), "n"),
    ok("chat-best-of-1", _C(best_of=1)),
    ok("chat-best-of-3-n-2", _C(best_of=3, n=2)),
    ok("chat-best-of-equals-n", _C(best_of=2, n=2)),
    ok("chat-best-of-stream-false", _C(best_of=2, stream=False)),
    bad("chat-best-of-0", _C(best_of=0), "best_of"),
    bad("chat-best-of-129", _C(best_of=129), "best_of"),
    bad("chat-best-of-less-than-n", _C(best_of=2, n=3), "best_of"),
    bad("chat-best-of-stream", _C(best_of=2, stream=True), "best_of", UNSUPPORTED),
    bad("chat-best-of-string", _C(best_of="2"), "best_of"),
    ok("chat-stream-true", _C(stream=True)),
    ok("chat-stream-false", _C(stream=False)),
    bad("chat-stream-string", _C(stream="true"), "stream"),
    bad("chat-stream-int", _C(stream=1), "stream"),
    # ---- stream_options
    ok("chat-stream-options-usage", _C(stream=True, stream_options={"include_usage": True})),
    ok("chat-stream-options-without-stream", _C(stream_options={"include_usage": True})),
    ok("chat-stream-options-empty", _C(stream=True, stream_options={})),
    ok(
        "chat-stream-options-continuous-usage",
        _C(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    ),
    bad(
        "chat-stream-options-continuous-usage-type",
        _C(stream=True, stream_options={"continuous_usage_stats": 1}),
        "stream_options.continuous_usage_stats",
    ),
    bad(
        "chat-stream-options-unknown",
        _C(stream=True, stream_options={"obfuscation": True}),
        "stream_options.obfuscation",
        UNSUPPORTED,
    ),
    # ---- ignore_eos (extension: benchmark tools send it)
    ok("chat-ignore-eos", _C(ignore_eos=True, stop=None)),
    ok("chat-ignore-eos-false", _C(ignore_eos=False)),
    bad("chat-ignore-eos-string", _C(ignore_eos="yes"), "ignore_eos"),
    bad(
        "chat-stream-options-usage-type",
        _C(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
    ),
    bad("chat-stream-options-not-object", _C(stream_options=True), "stream_options"),
    # ---- penalties and sampling
    *[
        case
        for name in ("frequency_penalty", "presence_penalty")
        for case in (
            ok(f"chat-{name}-min", _C(**{name: -2})),
            ok(f"chat-{name}-max", _C(**{name: 2.0})),
            ok(f"chat-{name}-mid", _C(**{name: 0.5})),
            bad(f"chat-{name}-above", _C(**{name: 2.01}), name),
            bad(f"chat-{name}-below", _C(**{name: -2.5}), name),
            bad(f"chat-{name}-string", _C(**{name: "high"}), name),
            bad(
                f"chat-{name}-overflow",
                f'{{"model": "test-model", "messages": [{{"role": "user", "content": "x"}}], '
                f'"{name}": 1e999}}'.encode(),
                name,
            ),
        )
    ],
    ok("chat-repetition-penalty-1", _C(repetition_penalty=1.0)),
    ok("chat-repetition-penalty-2", _C(repetition_penalty=2)),
    ok("chat-repetition-penalty-small", _C(repetition_penalty=0.01)),
    bad("chat-repetition-penalty-0", _C(repetition_penalty=0), "repetition_penalty"),
    bad("chat-repetition-penalty-negative", _C(repetition_penalty=-1), "repetition_penalty"),
    bad("chat-repetition-penalty-above", _C(repetition_penalty=2.1), "repetition_penalty"),
    ok("chat-temperature-0", _C(temperature=0)),
    ok("chat-temperature-1.5", _C(temperature=1.5)),
    ok("chat-temperature-large", _C(temperature=100)),
    bad("chat-temperature-negative", _C(temperature=-0.1), "temperature"),
    bad("chat-temperature-string", _C(temperature="hot"), "temperature"),
    bad(
        "chat-temperature-overflow",
        b'{"model": "test-model", "messages": [{"role": "user", "content": "x"}], '
        b'"temperature": 1e400}',
        "temperature",
    ),
    ok("chat-top-p-1", _C(top_p=1)),
    ok("chat-top-p-half", _C(top_p=0.5)),
    bad("chat-top-p-0", _C(top_p=0), "top_p"),
    bad("chat-top-p-above", _C(top_p=1.1), "top_p"),
    bad("chat-top-p-negative", _C(top_p=-0.5), "top_p"),
    ok("chat-top-k-1", _C(top_k=1)),
    ok("chat-top-k-50", _C(top_k=50)),
    bad("chat-top-k-0", _C(top_k=0), "top_k"),
    bad("chat-top-k-minus-1", _C(top_k=-1), "top_k"),
    bad("chat-top-k-float", _C(top_k=1.5), "top_k"),
    # ---- logprobs
    ok("chat-logprobs", _C(logprobs=True)),
    ok("chat-logprobs-top-5", _C(logprobs=True, top_logprobs=5)),
    ok("chat-logprobs-top-20", _C(logprobs=True, top_logprobs=20)),
    ok("chat-top-logprobs-0-alone", _C(top_logprobs=0)),
    bad("chat-logprobs-string", _C(logprobs="yes"), "logprobs"),
    bad("chat-top-logprobs-21", _C(logprobs=True, top_logprobs=21), "top_logprobs"),
    bad("chat-top-logprobs-negative", _C(logprobs=True, top_logprobs=-1), "top_logprobs"),
    bad("chat-top-logprobs-without-logprobs", _C(top_logprobs=5), "top_logprobs"),
    bad("chat-top-logprobs-logprobs-false", _C(logprobs=False, top_logprobs=2), "top_logprobs"),
    # ---- logit_bias
    ok("chat-logit-bias", _C(logit_bias={"50256": -100, "15": 100, "7": 0.5})),
    ok("chat-logit-bias-1024", _C(logit_bias={str(i): 1 for i in range(1024)})),
    ok("chat-logit-bias-empty", _C(logit_bias={})),
    bad("chat-logit-bias-1025", _C(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    bad("chat-logit-bias-word-key", _C(logit_bias={"hello": 1}), "logit_bias.hello"),
    bad("chat-logit-bias-negative-key", _C(logit_bias={"-1": 1}), "logit_bias.-1"),
    bad("chat-logit-bias-float-key", _C(logit_bias={"1.5": 1}), "logit_bias.1.5"),
    bad("chat-logit-bias-above", _C(logit_bias={"1": 100.5}), "logit_bias.1"),
    bad("chat-logit-bias-below", _C(logit_bias={"1": -101}), "logit_bias.1"),
    bad("chat-logit-bias-string-value", _C(logit_bias={"1": "x"}), "logit_bias"),
    bad("chat-logit-bias-not-object", _C(logit_bias=[1]), "logit_bias"),
    # ---- seed
    ok("chat-seed-0", _C(seed=0)),
    ok("chat-seed-int64-max", _C(seed=2**63 - 1)),
    ok("chat-seed-int64-min", _C(seed=-(2**63))),
    bad("chat-seed-above-int64", _C(seed=2**63), "seed"),
    bad("chat-seed-below-int64", _C(seed=-(2**63) - 1), "seed"),
    bad("chat-seed-float", _C(seed=1.5), "seed"),
    bad("chat-seed-string", _C(seed="42"), "seed"),
    # ---- token limits
    ok("chat-max-completion-tokens-1", _C(max_completion_tokens=1)),
    ok("chat-max-tokens-1", _C(max_tokens=1)),
    ok("chat-max-tokens-both", _C(max_completion_tokens=5, max_tokens=10)),
    bad("chat-max-completion-tokens-0", _C(max_completion_tokens=0), "max_completion_tokens"),
    bad(
        "chat-max-completion-tokens-negative", _C(max_completion_tokens=-5), "max_completion_tokens"
    ),
    bad(
        "chat-max-completion-tokens-string", _C(max_completion_tokens="9"), "max_completion_tokens"
    ),
    bad("chat-max-tokens-0", _C(max_tokens=0), "max_tokens"),
    bad("chat-max-tokens-float", _C(max_tokens=10.5), "max_tokens"),
    ok("chat-min-tokens-0", _C(min_tokens=0)),
    ok("chat-min-tokens-equal-max", _C(min_tokens=10, max_tokens=10)),
    ok("chat-min-tokens-under-default", _C(min_tokens=1000)),
    bad("chat-min-tokens-negative", _C(min_tokens=-1), "min_tokens"),
    bad("chat-min-tokens-above-max", _C(min_tokens=11, max_tokens=10), "min_tokens"),
    bad(
        "chat-min-tokens-above-winning-max",
        _C(min_tokens=20, max_completion_tokens=10, max_tokens=100),
        "min_tokens",
    ),
    bad("chat-min-tokens-above-default", _C(min_tokens=2000), "min_tokens"),
    # ---- stop
    ok("chat-stop-string", _C(stop="END")),
    ok("chat-stop-list", _C(stop=["a", "b"])),
    ok("chat-stop-empty-list", _C(stop=[])),
    ok("chat-stop-32", _C(stop=[f"s{i}" for i in range(32)])),
    bad("chat-stop-33", _C(stop=[f"s{i}" for i in range(33)]), "stop"),
    bad("chat-stop-empty-string", _C(stop=""), "stop"),
    bad("chat-stop-empty-entry", _C(stop=["a", ""]), "stop[1]"),
    bad("chat-stop-number-entry", _C(stop=["a", 1]), "stop[1]"),
    bad("chat-stop-number", _C(stop=5), "stop"),
    # ---- messages and roles
    bad("chat-messages-empty", _msgs(), "messages"),
    bad("chat-messages-string", _C(messages="hi"), "messages"),
    bad("chat-message-not-object", _C(messages=["hi"]), "messages[0]"),
    bad("chat-message-missing-role", _C(messages=[{"content": "hi"}]), "messages[0].role"),
    bad("chat-message-role-unknown", _msgs({"role": "bot", "content": "hi"}), "messages[0].role"),
    bad(
        "chat-message-role-function",
        _msgs(_USER, {"role": "function", "content": "x"}),
        "messages[1].role",
    ),
    bad("chat-message-unknown-key", _msgs({**_USER, "foo": 1}), "messages[0].foo"),
    ok("chat-message-system", _msgs({"role": "system", "content": "Be brief."}, _USER)),
    ok("chat-message-developer", _msgs({"role": "developer", "content": "Be brief."}, _USER)),
    ok("chat-message-name", _msgs({**_USER, "name": "alice"})),
    ok(
        "chat-message-assistant-turns",
        _msgs(_USER, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "More"}),
    ),
    ok(
        "chat-tool-round-trip",
        _msgs(_USER, _ASSISTANT_CALL, _TOOL_REPLY, tools=[_TOOL]),
    ),
    ok(
        "chat-assistant-tool-calls-content-absent",
        _msgs(_USER, {"role": "assistant", "tool_calls": [_TOOL_CALL]}, _TOOL_REPLY),
    ),
    ok(
        "chat-assistant-tool-calls-with-content",
        _msgs(
            _USER,
            {"role": "assistant", "content": "Checking.", "tool_calls": [_TOOL_CALL]},
            _TOOL_REPLY,
        ),
    ),
    bad(
        "chat-tool-message-missing-tool-call-id",
        _msgs(_USER, _ASSISTANT_CALL, {"role": "tool", "content": "18C"}),
        "messages[2].tool_call_id",
    ),
    bad(
        "chat-tool-message-empty-tool-call-id",
        _msgs(_USER, _ASSISTANT_CALL, {"role": "tool", "tool_call_id": "", "content": "18C"}),
        "messages[2].tool_call_id",
    ),
    bad(
        "chat-tool-message-unknown-tool-call-id",
        _msgs(_USER, _ASSISTANT_CALL, {**_TOOL_REPLY, "tool_call_id": "call_9"}),
        "messages[2].tool_call_id",
    ),
    bad(
        "chat-tool-message-without-assistant-call",
        _msgs(_USER, _TOOL_REPLY),
        "messages[1].tool_call_id",
    ),
    bad(
        "chat-tool-call-id-on-user",
        _msgs({**_USER, "tool_call_id": "call_1"}),
        "messages[0].tool_call_id",
    ),
    bad(
        "chat-tool-call-id-on-assistant",
        _msgs(_USER, {"role": "assistant", "content": "x", "tool_call_id": "call_1"}),
        "messages[1].tool_call_id",
    ),
    bad(
        "chat-tool-calls-on-user",
        _msgs({**_USER, "tool_calls": [_TOOL_CALL]}),
        "messages[0].tool_calls",
    ),
    bad(
        "chat-tool-calls-on-tool",
        _msgs(_USER, _ASSISTANT_CALL, {**_TOOL_REPLY, "tool_calls": [_TOOL_CALL]}),
        "messages[2].tool_calls",
    ),
    bad(
        "chat-tool-call-bad-type",
        _msgs(_USER, {"role": "assistant", "tool_calls": [{**_TOOL_CALL, "type": "code"}]}),
        "messages[1].tool_calls[0].type",
    ),
    bad(
        "chat-tool-call-missing-id",
        _msgs(
            _USER,
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": _TOOL_CALL["function"]}],
            },
        ),
        "messages[1].tool_calls[0].id",
    ),
    bad(
        "chat-tool-call-arguments-not-json",
        _msgs(
            _USER,
            {
                "role": "assistant",
                "tool_calls": [
                    {**_TOOL_CALL, "function": {"name": "get_weather", "arguments": "{city"}}
                ],
            },
        ),
        "messages[1].tool_calls[0].function.arguments",
    ),
    bad("chat-user-content-null", _msgs({"role": "user", "content": None}), "messages[0].content"),
    bad("chat-user-content-absent", _msgs({"role": "user"}), "messages[0].content"),
    bad(
        "chat-assistant-content-null-without-tool-calls",
        _msgs(_USER, {"role": "assistant", "content": None}),
        "messages[1].content",
    ),
    bad(
        "chat-tool-content-null",
        _msgs(_USER, _ASSISTANT_CALL, {**_TOOL_REPLY, "content": None}),
        "messages[2].content",
    ),
    bad("chat-content-number", _msgs({"role": "user", "content": 5}), "messages[0].content"),
    # ---- content parts
    ok(
        "chat-content-text-part",
        _msgs({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
    ),
    ok(
        "chat-content-input-text-part",
        _msgs({"role": "user", "content": [{"type": "input_text", "text": "hi"}]}),
    ),
    ok(
        "chat-content-parts-system",
        _msgs({"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, _USER),
    ),
    bad(
        "chat-content-part-unknown-type",
        _msgs({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
        "messages[0].content[0].type",
    ),
    bad(
        "chat-content-part-missing-type",
        _msgs({"role": "user", "content": [{"text": "hi"}]}),
        "messages[0].content[0].type",
    ),
    bad(
        "chat-content-part-missing-text",
        _msgs({"role": "user", "content": [{"type": "text"}]}),
        "messages[0].content[0].text",
    ),
    bad(
        "chat-content-part-unknown-key",
        _msgs({"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}),
        "messages[0].content[0].foo",
    ),
    bad("chat-content-empty-array", _msgs({"role": "user", "content": []}), "messages[0].content"),
    # ---- chat_template_kwargs / guardian_config
    ok("chat-template-kwargs-thinking", _C(chat_template_kwargs={"enable_thinking": False})),
    ok(
        "chat-guardian-risk-name",
        _C(chat_template_kwargs={"guardian_config": {"risk_name": "harm"}}),
    ),
    ok(
        "chat-guardian-risk-name-128",
        _C(chat_template_kwargs={"guardian_config": {"risk_name": "r" * 128}}),
    ),
    bad(
        "chat-guardian-risk-name-empty",
        _C(chat_template_kwargs={"guardian_config": {"risk_name": ""}}),
        "chat_template_kwargs.guardian_config.risk_name",
    ),
    bad(
        "chat-guardian-risk-name-129",
        _C(chat_template_kwargs={"guardian_config": {"risk_name": "r" * 129}}),
        "chat_template_kwargs.guardian_config.risk_name",
    ),
    bad(
        "chat-guardian-risk-name-missing",
        _C(chat_template_kwargs={"guardian_config": {}}),
        "chat_template_kwargs.guardian_config.risk_name",
    ),
    bad(
        "chat-template-kwargs-unknown",
        _C(chat_template_kwargs={"add_generation_prompt": False}),
        "chat_template_kwargs.add_generation_prompt",
        UNSUPPORTED,
    ),
    bad(
        "chat-guardian-unknown",
        _C(chat_template_kwargs={"guardian_config": {"risk_name": "harm", "extra": 1}}),
        "chat_template_kwargs.guardian_config.extra",
        UNSUPPORTED,
    ),
    bad(
        "chat-template-kwargs-thinking-type",
        _C(chat_template_kwargs={"enable_thinking": "no"}),
        "chat_template_kwargs.enable_thinking",
    ),
    # ---- tools
    ok("chat-tools", _C(tools=[_TOOL])),
    ok(
        "chat-tools-name-64",
        _C(tools=[{"type": "function", "function": {"name": "a" * 64}}]),
    ),
    ok(
        "chat-tools-two",
        _C(tools=[_TOOL, {"type": "function", "function": {"name": "get-time_2"}}]),
    ),
    bad("chat-tools-empty", _C(tools=[]), "tools"),
    bad(
        "chat-tools-name-empty",
        _C(tools=[{"type": "function", "function": {"name": ""}}]),
        "tools[0].function.name",
    ),
    bad(
        "chat-tools-name-space",
        _C(tools=[{"type": "function", "function": {"name": "get weather"}}]),
        "tools[0].function.name",
    ),
    bad(
        "chat-tools-name-65",
        _C(tools=[{"type": "function", "function": {"name": "a" * 65}}]),
        "tools[0].function.name",
    ),
    bad("chat-tools-name-duplicate", _C(tools=[_TOOL, _TOOL]), "tools[1].function.name"),
    bad(
        "chat-tools-type",
        _C(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
        "tools[0].type",
    ),
    bad("chat-tools-missing-function", _C(tools=[{"type": "function"}]), "tools[0].function"),
    bad(
        "chat-tools-parameters-not-object",
        _C(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
        "tools[0].function.parameters",
    ),
    bad(
        "chat-tools-unknown-key",
        _C(tools=[{"type": "function", "function": {"name": "f", "foo": 1}}]),
        "tools[0].function.foo",
    ),
    ok("chat-parallel-tool-calls", _C(tools=[_TOOL], parallel_tool_calls=False)),
    bad("chat-parallel-tool-calls-type", _C(parallel_tool_calls="no"), "parallel_tool_calls"),
    # ---- tool_choice
    ok("chat-tool-choice-auto", _C(tools=[_TOOL], tool_choice="auto")),
    ok("chat-tool-choice-none", _C(tools=[_TOOL], tool_choice="none")),
    ok("chat-tool-choice-required", _C(tools=[_TOOL], tool_choice="required")),
    ok("chat-tool-choice-named", _C(tools=[_TOOL], tool_choice=_NAMED)),
    bad("chat-tool-choice-without-tools", _C(tool_choice="auto"), "tool_choice"),
    bad("chat-tool-choice-none-without-tools", _C(tool_choice="none"), "tool_choice"),
    bad("chat-tool-choice-named-without-tools", _C(tool_choice=_NAMED), "tool_choice"),
    bad(
        "chat-tool-choice-named-unknown",
        _C(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice.function.name",
    ),
    bad("chat-tool-choice-bad-string", _C(tools=[_TOOL], tool_choice="sometimes"), "tool_choice"),
    bad(
        "chat-tool-choice-named-missing-function",
        _C(tools=[_TOOL], tool_choice={"type": "function"}),
        "tool_choice.function",
    ),
    # ---- tool_choice x response_format
    ok(
        "chat-tool-choice-auto-json",
        _C(tools=[_TOOL], tool_choice="auto", response_format={"type": "json_object"}),
    ),
    ok(
        "chat-tool-choice-required-text-format",
        _C(tools=[_TOOL], tool_choice="required", response_format={"type": "text"}),
    ),
    bad(
        "chat-tool-choice-required-json-object",
        _C(tools=[_TOOL], tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
    ),
    bad(
        "chat-tool-choice-named-json-schema",
        _C(tools=[_TOOL], tool_choice=_NAMED, response_format=_JSON_SCHEMA),
        "response_format",
    ),
    # ---- response_format
    ok("chat-response-format-text", _C(response_format={"type": "text"})),
    ok("chat-response-format-json-object", _C(response_format={"type": "json_object"})),
    ok("chat-response-format-json-schema", _C(response_format=_JSON_SCHEMA)),
    ok(
        "chat-response-format-json-schema-strict",
        _C(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "strict": True, "schema": {"type": "object"}},
            }
        ),
    ),
    bad(
        "chat-response-format-json-schema-missing",
        _C(response_format={"type": "json_schema"}),
        "response_format.json_schema",
    ),
    bad(
        "chat-response-format-json-schema-no-schema",
        _C(response_format={"type": "json_schema", "json_schema": {"name": "a"}}),
        "response_format.json_schema",
    ),
    bad(
        "chat-response-format-schema-not-object",
        _C(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": 1}}),
        "response_format.json_schema.schema",
    ),
    bad("chat-response-format-type", _C(response_format={"type": "xml"}), "response_format.type"),
    bad(
        "chat-response-format-unknown-key",
        _C(response_format={"type": "text", "foo": 1}),
        "response_format.foo",
    ),
    ok("chat-schema-in-prompt-false", _C(response_format=_JSON_SCHEMA, schema_in_prompt=False)),
    bad("chat-schema-in-prompt-type", _C(schema_in_prompt="no"), "schema_in_prompt"),
    # ---- SIE extensions and pass-through fields
    ok("chat-include-reasoning", _C(include_reasoning=True)),
    bad("chat-include-reasoning-type", _C(include_reasoning="yes"), "include_reasoning"),
    ok("chat-lora-adapter", _C(lora_adapter="my-adapter")),
    bad("chat-lora-adapter-unknown", _C(lora_adapter="other-adapter"), "lora_adapter"),
    bad("chat-lora-adapter-empty", _C(lora_adapter=""), "lora_adapter"),
    bad("chat-lora-adapter-type", _C(lora_adapter=1), "lora_adapter"),
    bad(
        "chat-lora-adapter-other-model",
        _C(model="text-model", lora_adapter="my-adapter"),
        "lora_adapter",
    ),
    ok("chat-text-model", _C(model="text-model")),
    ok(
        "chat-hints",
        _C(user="u-1", safety_identifier="s-1", prompt_cache_key="k", routing_key="r"),
    ),
    bad("chat-user-type", _C(user=5), "user"),
    # ---- images
    ok("chat-image-url-string", _msgs(_image_msg(_img(PNG_DATA_URI)))),
    ok("chat-image-url-object", _msgs(_image_msg(_img({"url": PNG_DATA_URI, "detail": "low"})))),
    ok("chat-input-image", _msgs(_image_msg(_img(PNG_DATA_URI, "input_image")))),
    bad(
        "chat-image-remote-https",
        _msgs(_image_msg(_img("https://example.com/cat.png"))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-remote-object",
        _msgs(_image_msg(_img({"url": "http://example.com/cat.png"}))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-file-url",
        _msgs(_image_msg(_img("file:///etc/passwd", "input_image"))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-data-not-base64",
        _msgs(_image_msg(_img("data:image/png,rawbytes"))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-data-no-comma",
        _msgs(_image_msg(_img("data:image/png;base64"))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-bad-base64",
        _msgs(_image_msg(_img("data:image/png;base64,iVBOR!!!"))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-empty-payload",
        _msgs(_image_msg(_img("data:image/png;base64,"))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-not-image-mime",
        _msgs(_image_msg(_img(f"data:text/plain;base64,{PNG_B64}"))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-svg",
        _msgs(_image_msg(_img("data:image/svg+xml;base64,PHN2Zz48L3N2Zz4="))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-mime-mismatch",
        _msgs(_image_msg(_img(f"data:image/jpeg;base64,{PNG_B64}"))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-not-an-image",
        _msgs(_image_msg(_img("data:image/png;base64,aGVsbG8gd29ybGQ="))),
        "messages[0].content[1].image_url",
    ),
    bad(
        "chat-image-missing-url",
        _msgs(_image_msg(_img({"detail": "low"}))),
        "messages[0].content[1].image_url.url",
    ),
    bad(
        "chat-image-text-only-model",
        _C(model="text-model", messages=[_image_msg(_img(PNG_DATA_URI))]),
        "messages[0].content[1]",
        UNSUPPORTED,
    ),
    bad(
        "chat-image-text-only-model-remote",
        _C(model="text-model", messages=[_image_msg(_img("https://example.com/cat.png"))]),
        "messages[0].content[1]",
        UNSUPPORTED,
    ),
    bad(
        "chat-image-in-system-message",
        _msgs(_image_msg(_img(PNG_DATA_URI), role="system"), _USER),
        "messages[0].content[1]",
    ),
]


def _P(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "test-model", "prompt": "Once upon a time"}
    body.update(fields)
    return body


def cok(id: str, body: dict[str, Any] | bytes) -> Case:
    return ok(id, body, endpoint="completions")


def cbad(id: str, body: dict[str, Any] | bytes, param: str | None, code: str = INVALID) -> Case:
    return bad(id, body, param, code, endpoint="completions")


COMPLETIONS_CASES: list[Case] = [
    cok("cmpl-minimal", _P()),
    cok("cmpl-text-model", _P(model="text-model")),
    cok("cmpl-empty-prompt", _P(prompt="")),
    cok("cmpl-stream", _P(stream=True)),
    cok("cmpl-nulls-are-absent", _P(max_tokens=None, n=None, stop=None, temperature=None)),
    cbad("cmpl-empty-body", b"", None),
    cbad("cmpl-malformed-json", b'{"model": ', None),
    cbad("cmpl-top-level-array", b'[{"model": "test-model", "prompt": "x"}]', None),
    cbad("cmpl-top-level-string", b'"x"', None),
    cbad("cmpl-invalid-utf8", b'{"model": "test-model", "prompt": "\xc3"}', None),
    cbad("cmpl-unknown-field", _P(foo=1), "foo", UNSUPPORTED),
    cbad("cmpl-chat-field", _P(messages=[_USER]), "messages", UNSUPPORTED),
    cbad("cmpl-missing-model", {"prompt": "x"}, "model"),
    cbad("cmpl-model-empty", _P(model=""), "model"),
    cbad("cmpl-missing-prompt", {"model": "test-model"}, "prompt"),
    cbad("cmpl-prompt-number", _P(prompt=5), "prompt"),
    cbad("cmpl-prompt-null", _P(prompt=None), "prompt"),
    cbad("cmpl-prompt-array", _P(prompt=["a", "b"]), "prompt", UNSUPPORTED),
    cbad("cmpl-prompt-array-one", _P(prompt=["a"]), "prompt", UNSUPPORTED),
    cbad("cmpl-prompt-token-ids", _P(prompt=[1, 2, 3]), "prompt", UNSUPPORTED),
    # known-rejected (explicit null = absent)
    cbad("cmpl-echo", _P(echo=True), "echo", UNSUPPORTED),
    cbad("cmpl-echo-false", _P(echo=False), "echo", UNSUPPORTED),
    cbad("cmpl-suffix", _P(suffix="end"), "suffix", UNSUPPORTED),
    cbad("cmpl-logprobs", _P(logprobs=5), "logprobs", UNSUPPORTED),
    cbad("cmpl-best-of", _P(best_of=2), "best_of", UNSUPPORTED),
    cok("cmpl-known-rejected-null", _P(echo=None, suffix=None, logprobs=None, best_of=None)),
    # n
    cok("cmpl-n-1", _P(n=1)),
    cbad("cmpl-n-2", _P(n=2), "n", UNSUPPORTED),
    cbad("cmpl-n-0", _P(n=0), "n"),
    cbad("cmpl-n-negative", _P(n=-3), "n"),
    cbad("cmpl-n-string", _P(n="1"), "n"),
    # max_tokens
    cok("cmpl-max-tokens-1", _P(max_tokens=1)),
    cok("cmpl-max-tokens-large", _P(max_tokens=4096)),
    cbad("cmpl-max-tokens-0", _P(max_tokens=0), "max_tokens"),
    cbad("cmpl-max-tokens-negative", _P(max_tokens=-1), "max_tokens"),
    cbad("cmpl-max-tokens-float", _P(max_tokens=1.5), "max_tokens"),
    # sampling
    cok("cmpl-penalties", _P(frequency_penalty=-2, presence_penalty=2)),
    cbad("cmpl-frequency-penalty-above", _P(frequency_penalty=2.5), "frequency_penalty"),
    cbad("cmpl-presence-penalty-below", _P(presence_penalty=-3), "presence_penalty"),
    cbad("cmpl-presence-penalty-string", _P(presence_penalty="x"), "presence_penalty"),
    cok("cmpl-temperature-0", _P(temperature=0)),
    cbad("cmpl-temperature-negative", _P(temperature=-1), "temperature"),
    cbad(
        "cmpl-temperature-overflow",
        b'{"model": "test-model", "prompt": "x", "temperature": 1e999}',
        "temperature",
    ),
    cok("cmpl-top-p-1", _P(top_p=1)),
    cbad("cmpl-top-p-0", _P(top_p=0), "top_p"),
    cbad("cmpl-top-p-above", _P(top_p=1.5), "top_p"),
    cok("cmpl-seed", _P(seed=-(2**63))),
    cbad("cmpl-seed-above-int64", _P(seed=2**63), "seed"),
    cbad("cmpl-seed-float", _P(seed=0.5), "seed"),
    cbad("cmpl-stream-string", _P(stream="yes"), "stream"),
    # stop
    cok("cmpl-stop-string", _P(stop="\n")),
    cok("cmpl-stop-list-32", _P(stop=[f"s{i}" for i in range(32)])),
    cbad("cmpl-stop-33", _P(stop=[f"s{i}" for i in range(33)]), "stop"),
    cbad("cmpl-stop-empty-string", _P(stop=""), "stop"),
    cbad("cmpl-stop-empty-entry", _P(stop=["", "x"]), "stop[0]"),
    cbad("cmpl-stop-number", _P(stop=[1]), "stop[0]"),
    # chat-only fields are unknown here
    cbad("cmpl-top-k", _P(top_k=5), "top_k", UNSUPPORTED),
    cok("cmpl-stream-options", _P(stream=True, stream_options={"include_usage": True})),
    cok(
        "cmpl-stream-options-continuous-usage",
        _P(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    ),
    cbad(
        "cmpl-stream-options-unknown",
        _P(stream_options={"obfuscation": True}),
        "stream_options.obfuscation",
        UNSUPPORTED,
    ),
    cok("cmpl-ignore-eos", _P(ignore_eos=True, stop=None)),
    cbad("cmpl-ignore-eos-int", _P(ignore_eos=1), "ignore_eos"),
]

CASES: list[Case] = CHAT_CASES + COMPLETIONS_CASES
