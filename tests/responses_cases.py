"""The ``POST /v1/responses`` request contract as a data table (no tests here).

Same shape as :mod:`tests.contract_cases` (a :class:`~tests.contract_cases.Case` per body, with
``endpoint="responses"``): ``status`` 200 for an accepted request, or 400 with the envelope's
``code`` and ``param``. ``tests/core/test_responses.py`` drives the table through the core's
``RESPONSES.prepare``; ``tests/shell/test_responses_contract.py`` posts it to a gateway in front of
a fake engine. Models: ``test-model`` (image input, the ``my-adapter`` LoRA) and ``text-model``.
"""

from __future__ import annotations

from typing import Any

from tests.contract_cases import INVALID, PNG_DATA_URI, UNSUPPORTED, Case

__all__ = ["RESPONSES_CASES"]

_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
_CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
_OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}
_USER = {"role": "user", "content": "What is the weather in Paris?"}
_SCHEMA = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}


def _R(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "test-model", "input": "Hello!"}
    body.update(fields)
    return body


def _items(*items: Any, **fields: Any) -> dict[str, Any]:
    return _R(input=list(items), **fields)


def ok(id: str, body: dict[str, Any] | bytes) -> Case:
    return Case(id, "responses", body, 200, None, None)


def bad(id: str, body: dict[str, Any] | bytes, param: str | None, code: str = INVALID) -> Case:
    return Case(id, "responses", body, 400, code, param)


RESPONSES_CASES: list[Case] = [
    # ---- accepted
    ok("resp-minimal", _R()),
    ok("resp-text-model", _R(model="text-model")),
    ok("resp-stream", _R(stream=True)),
    ok("resp-instructions", _R(instructions="Answer briefly.")),
    ok("resp-easy-message", _items(_USER)),
    ok("resp-typed-message", _items({**_USER, "type": "message"})),
    ok("resp-developer-system", _items({"role": "developer", "content": "Be brief."}, _USER)),
    ok(
        "resp-input-text-parts",
        _items({"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}),
    ),
    ok(
        "resp-input-image",
        _items(
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": PNG_DATA_URI, "detail": "auto"},
                ],
            }
        ),
    ),
    ok(
        "resp-assistant-output-text-replay",
        _items(
            _USER,
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
            },
            {"role": "user", "content": "Thanks!"},
        ),
    ),
    ok("resp-tool-round-trip", _items(_USER, _CALL, _OUTPUT, tools=[_TOOL])),
    ok(
        "resp-tool-round-trip-sdk-shape",
        _items(_USER, {**_CALL, "id": "fc_1", "status": "completed"}, _OUTPUT, tools=[_TOOL]),
    ),
    ok(
        "resp-two-calls-one-turn",
        _items(
            _USER,
            _CALL,
            {**_CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
            _OUTPUT,
            {**_OUTPUT, "call_id": "call_2"},
            tools=[_TOOL],
        ),
    ),
    ok(
        "resp-output-parts",
        _items(
            _USER, _CALL, {**_OUTPUT, "output": [{"type": "input_text", "text": "18C"}]},
            tools=[_TOOL],
        ),
    ),
    ok(
        "resp-reasoning-item-dropped",
        _items(_USER, {"type": "reasoning", "id": "rs_1", "summary": []}, _CALL, _OUTPUT,
               tools=[_TOOL]),
    ),
    ok("resp-tools-auto", _R(tools=[_TOOL], tool_choice="auto")),
    ok("resp-tools-none", _R(tools=[_TOOL], tool_choice="none")),
    ok("resp-tools-required", _R(tools=[_TOOL], tool_choice="required")),
    ok("resp-tools-named", _R(tools=[_TOOL], tool_choice={"type": "function", "name": "f"} | {
        "name": "get_weather"})),
    ok("resp-parallel-false", _R(tools=[_TOOL], parallel_tool_calls=False)),
    ok("resp-format-text", _R(text={"format": {"type": "text"}})),
    ok("resp-format-json-object", _R(text={"format": {"type": "json_object"}})),
    ok("resp-format-json-schema", _R(text={"format": _SCHEMA})),
    ok("resp-format-json-schema-strict", _R(text={"format": {**_SCHEMA, "strict": True}})),
    ok("resp-sampling", _R(temperature=0, top_p=0.5, max_output_tokens=5)),
    ok("resp-store-false", _R(store=False)),
    ok("resp-background-false", _R(background=False)),
    ok("resp-user", _R(user="u-1", safety_identifier="s-1", prompt_cache_key="k")),
    ok("resp-lora", _R(lora_adapter="my-adapter")),
    ok("resp-include-reasoning", _R(include_reasoning=True)),
    ok("resp-thinking", _R(chat_template_kwargs={"enable_thinking": False})),
    ok(
        "resp-nulls-are-absent",
        _R(
            instructions=None, tools=None, tool_choice=None, text=None, max_output_tokens=None,
            temperature=None, top_p=None, stream=None, store=None, previous_response_id=None,
            metadata=None, reasoning=None, include=None, conversation=None,
        ),
    ),
    # ---- decoding
    bad("resp-empty-body", b"", None),
    bad("resp-malformed-json", b'{"model": ', None),
    bad("resp-top-level-array", b"[]", None),
    bad("resp-missing-model", {"input": "x"}, "model"),
    bad("resp-model-empty", _R(model=""), "model"),
    bad("resp-missing-input", {"model": "test-model"}, "input"),
    bad("resp-input-number", _R(input=5), "input"),
    bad("resp-input-empty-list", _R(input=[]), "input"),
    # ---- unknown and known-rejected fields
    bad("resp-unknown-field", _R(foo=1), "foo", UNSUPPORTED),
    bad("resp-chat-messages", _R(messages=[_USER]), "messages", UNSUPPORTED),
    bad("resp-chat-n", _R(n=2), "n", UNSUPPORTED),
    bad("resp-previous-response-id", _R(previous_response_id="resp_1"), "previous_response_id",
        UNSUPPORTED),
    bad("resp-store-true", _R(store=True), "store", UNSUPPORTED),
    bad("resp-background-true", _R(background=True), "background", UNSUPPORTED),
    bad("resp-conversation", _R(conversation="conv_1"), "conversation", UNSUPPORTED),
    bad("resp-conversation-object", _R(conversation={"id": "conv_1"}), "conversation",
        UNSUPPORTED),
    bad("resp-metadata", _R(metadata={"a": "b"}), "metadata", UNSUPPORTED),
    bad("resp-metadata-empty", _R(metadata={}), "metadata", UNSUPPORTED),
    bad("resp-prompt", _R(prompt={"id": "pmpt_1"}), "prompt", UNSUPPORTED),
    ok("resp-include-empty", _R(include=[])),
    bad("resp-include", _R(include=["reasoning.encrypted_content"]), "include", UNSUPPORTED),
    bad("resp-top-logprobs", _R(top_logprobs=2), "top_logprobs", UNSUPPORTED),
    bad("resp-reasoning", _R(reasoning={"effort": "low"}), "reasoning", UNSUPPORTED),
    bad("resp-truncation", _R(truncation="auto"), "truncation", UNSUPPORTED),
    bad("resp-max-tool-calls", _R(max_tool_calls=2), "max_tool_calls", UNSUPPORTED),
    bad("resp-service-tier", _R(service_tier="auto"), "service_tier", UNSUPPORTED),
    bad("resp-text-verbosity", _R(text={"verbosity": "low"}), "text.verbosity", UNSUPPORTED),
    bad("resp-stream-options", _R(stream_options={"include_obfuscation": False}),
        "stream_options", UNSUPPORTED),
    # ---- built-in tools and stateful items
    bad("resp-tool-web-search", _R(tools=[{"type": "web_search"}]), "tools[0].type", UNSUPPORTED),
    bad("resp-tool-file-search", _R(tools=[_TOOL, {"type": "file_search"}]), "tools[1].type",
        UNSUPPORTED),
    bad("resp-item-reference", _items({"type": "item_reference", "id": "msg_1"}),
        "input[0].type", UNSUPPORTED),
    bad("resp-item-web-search-call", _items(_USER, {"type": "web_search_call", "id": "ws_1"}),
        "input[1].type", UNSUPPORTED),
    bad(
        "resp-image-file-id",
        _items({"role": "user", "content": [{"type": "input_image", "file_id": "file_1",
                                              "detail": "auto"}]}),
        "input[0].content[0]",
        UNSUPPORTED,
    ),
    bad(
        "resp-image-no-url",
        _items({"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}),
        "input[0].content[0].image_url",
    ),
    # ---- values
    bad("resp-max-output-tokens-0", _R(max_output_tokens=0), "max_output_tokens"),
    bad("resp-max-output-tokens-float", _R(max_output_tokens=1.5), "max_output_tokens"),
    bad("resp-temperature-negative", _R(temperature=-1), "temperature"),
    bad("resp-top-p-0", _R(top_p=0), "top_p"),
    bad("resp-stream-string", _R(stream="yes"), "stream"),
    bad("resp-lora-unknown", _R(lora_adapter="nope"), "lora_adapter"),
    bad("resp-lora-empty", _R(lora_adapter=""), "lora_adapter"),
    bad("resp-instructions-number", _R(instructions=3), "instructions"),
    # ---- items
    bad("resp-item-role", _items({"role": "tool", "content": "x"}), "input[0].role"),
    bad("resp-item-no-content", _items({"role": "user"}), "input[0].content"),
    bad("resp-item-empty-content", _items({"role": "user", "content": []}), "input[0].content"),
    bad("resp-item-unknown-key", _items({**_USER, "name": "bob"}), "input[0].name"),
    bad("resp-item-part-type", _items({"role": "user", "content": [{"type": "input_file"}]}),
        "input[0].content[0].type"),
    bad(
        "resp-item-image-in-system",
        _items({"role": "system", "content": [{"type": "input_image", "image_url": PNG_DATA_URI,
                                               "detail": "auto"}]}, _USER),
        "input[0].content[0]",
    ),
    bad(
        "resp-item-image-remote",
        _items({"role": "user", "content": [{"type": "input_image",
                                             "image_url": "https://example.com/a.png",
                                             "detail": "auto"}]}),
        "input[0].content[0].image_url",
    ),
    bad(
        "resp-item-image-text-model",
        _items({"role": "user", "content": [{"type": "input_image", "image_url": PNG_DATA_URI,
                                             "detail": "auto"}]}, model="text-model"),
        "input[0].content[0]",
        UNSUPPORTED,
    ),
    bad("resp-item-not-object", _items("hello"), "input[0]"),
    bad("resp-call-missing-call-id", _items(_USER, {k: v for k, v in _CALL.items()
                                                    if k != "call_id"}, tools=[_TOOL]),
        "input[1].call_id"),
    bad("resp-call-empty-call-id", _items(_USER, {**_CALL, "call_id": ""}, tools=[_TOOL]),
        "input[1].call_id"),
    bad("resp-call-empty-name", _items(_USER, {**_CALL, "name": ""}, tools=[_TOOL]),
        "input[1].name"),
    bad("resp-call-arguments-not-json", _items(_USER, {**_CALL, "arguments": "{"},
                                               tools=[_TOOL]), "input[1].arguments"),
    bad("resp-call-arguments-array", _items(_USER, {**_CALL, "arguments": "[]"}, tools=[_TOOL]),
        "input[1].arguments"),
    bad("resp-output-unknown-call", _items(_USER, _CALL, {**_OUTPUT, "call_id": "call_9"},
                                           tools=[_TOOL]), "input[2].call_id"),
    bad("resp-output-before-call", _items(_USER, _OUTPUT, _CALL, tools=[_TOOL]),
        "input[1].call_id"),
    bad("resp-output-empty-list", _items(_USER, _CALL, {**_OUTPUT, "output": []},
                                         tools=[_TOOL]), "input[2].output"),
    bad("resp-only-reasoning", _items({"type": "reasoning", "summary": []}), "input"),
    # ---- tools, tool_choice, text.format
    bad("resp-tools-empty", _R(tools=[]), "tools"),
    bad("resp-tool-chat-shape", _R(tools=[{"type": "function", "function": {"name": "f"}}]),
        "tools[0].function", INVALID),
    bad("resp-tool-no-name", _R(tools=[{"type": "function", "parameters": {}}]),
        "tools[0].name"),
    bad("resp-tool-bad-name", _R(tools=[{**_TOOL, "name": "get weather"}]), "tools[0].name"),
    bad("resp-tool-duplicate", _R(tools=[_TOOL, _TOOL]), "tools[1].name"),
    bad("resp-tool-choice-without-tools", _R(tool_choice="auto"), "tool_choice"),
    bad("resp-tool-choice-named-without-tools",
        _R(tool_choice={"type": "function", "name": "get_weather"}), "tool_choice"),
    bad("resp-tool-choice-unknown-name",
        _R(tools=[_TOOL], tool_choice={"type": "function", "name": "other"}),
        "tool_choice.name"),
    bad("resp-tool-choice-string", _R(tools=[_TOOL], tool_choice="always"), "tool_choice"),
    bad("resp-tool-choice-hosted", _R(tools=[_TOOL], tool_choice={"type": "web_search"}),
        "tool_choice.type"),
    bad("resp-forced-tool-with-json", _R(tools=[_TOOL], tool_choice="required",
                                         text={"format": _SCHEMA}), "text.format"),
    bad("resp-format-unknown-type", _R(text={"format": {"type": "yaml"}}), "text.format.type"),
    bad("resp-format-json-schema-no-schema",
        _R(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    bad("resp-format-chat-shape",
        _R(text={"format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
        "text.format.json_schema"),
]
