"""Grammar selection: response_format, tool_choice constraints, schema_in_prompt."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from sieproxy.core.errors import InvalidRequest
from sieproxy.core.planning.grammar import (
    JSON_ARRAY_PARSER,
    RESPONSE_FORMATS_HEADER,
    json_array_tool_schema,
    response_format_constraint,
    response_formats_section,
    tool_constraint,
    tool_plan,
    tool_structural_tag,
    tools_section,
    with_schema_in_prompt,
    with_tools_in_prompt,
)
from sieproxy.core.planning.template import messages_for_template
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.schemas import ChatCompletionRequest
from sieproxy.core.request.valid import ValidChat

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}
WITH_DEFS = {
    "type": "function",
    "function": {
        "name": "book",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"when": {"$ref": "#/$defs/Date"}},
            "required": ["when"],
            "$defs": {
                "Date": {
                    "type": "object",
                    "properties": {"day": {"type": "integer"}},
                    "required": ["day"],
                }
            },
        },
    },
}
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "score": {"type": "number"}},
    "required": ["answer"],
}

PLAIN = ModelProfile(name="m")
QWEN = ModelProfile(name="q", tool_parser="qwen25")
HERMES = ModelProfile(name="h", tool_parser="hermes")


def valid_chat(**body: Any) -> ValidChat:
    body = {"model": "m", "messages": USER, **body}
    req = msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)
    return ValidChat(
        req=req,
        model="m",
        n=1,
        candidates=1,
        max_tokens=16,
        stream=False,
        include_usage=False,
        stop=[],
        logprobs=False,
        top_logprobs=0,
        include_reasoning=False,
    )


def json_schema_format(schema: Any = SCHEMA, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, **extra}}


# ---------------------------------------------------------------- response_format


def test_response_format_constraints() -> None:
    assert response_format_constraint(valid_chat()) is None
    assert response_format_constraint(valid_chat(response_format={"type": "text"})) is None
    assert response_format_constraint(valid_chat(response_format={"type": "json_object"})) == (
        "json_schema",
        '{"type": "object"}',
    )
    key, value = response_format_constraint(valid_chat(response_format=json_schema_format())) or (
        "",
        "",
    )
    assert key == "json_schema"
    assert isinstance(value, str) and json.loads(value) == SCHEMA
    schemaless = valid_chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert response_format_constraint(schemaless) == ("json_schema", '{"type": "object"}')


# ---------------------------------------------------------------- tools


def test_no_tools_or_none_hides_tools() -> None:
    for valid in (valid_chat(), valid_chat(tools=[WEATHER], tool_choice="none")):
        for profile in (PLAIN, QWEN):
            plan = tool_plan(valid, profile)
            assert plan.template_tools is None
            assert plan.constraint is None
            assert plan.parser is None
            assert not plan.active
            assert tool_constraint(valid, profile) is None


def test_auto_is_free_generation_with_the_profile_parser() -> None:
    for valid in (
        valid_chat(tools=[WEATHER, NOARGS]),
        valid_chat(tools=[WEATHER], tool_choice="auto"),
    ):
        plan = tool_plan(valid, QWEN)
        assert plan.constraint is None
        assert plan.parser == "qwen25"
        assert plan.active
        assert plan.template_tools is not None
        assert len(plan.template_tools) == len(valid.req.tools or ())
        assert tool_plan(valid, PLAIN).parser is None


def test_template_tools_are_plain_openai_dicts() -> None:
    plan = tool_plan(valid_chat(tools=[WEATHER, NOARGS]), PLAIN)
    assert plan.template_tools == [WEATHER, NOARGS]


@pytest.mark.parametrize("profile", [PLAIN, QWEN, HERMES])
def test_required_uses_the_json_array_constraint(profile: ModelProfile) -> None:
    valid = valid_chat(tools=[WEATHER, NOARGS], tool_choice="required")
    plan = tool_plan(valid, profile)
    assert plan.parser == JSON_ARRAY_PARSER
    assert plan.constraint is not None and plan.constraint[0] == "json_schema"
    schema = json.loads(plan.constraint[1])
    assert schema["minItems"] == 1 and schema["maxItems"] == profile.max_tool_calls == 4
    names = [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["ping"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    assert tool_constraint(valid, profile) == ("json_schema", plan.constraint[1], JSON_ARRAY_PARSER)


def test_named_choice_allows_and_shows_only_that_function() -> None:
    valid = valid_chat(
        tools=[WEATHER, NOARGS],
        tool_choice={"type": "function", "function": {"name": "ping"}},
        parallel_tool_calls=False,
    )
    plan = tool_plan(valid, QWEN)
    assert plan.template_tools == [NOARGS]
    assert plan.constraint is not None
    schema = json.loads(plan.constraint[1])
    assert schema["maxItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["ping"]]
    bad = valid_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(InvalidRequest) as info:
        tool_plan(bad, QWEN)
    assert info.value.param == "tool_choice"


def test_required_is_bounded_by_the_profile_cap_and_a_named_function_by_one() -> None:
    capped = ModelProfile(name="m", max_tool_calls=2)
    required = valid_chat(tools=[WEATHER, NOARGS], tool_choice="required")
    schema = json.loads(tool_plan(required, capped).constraint[1])  # type: ignore[index]
    assert schema["maxItems"] == 2
    serial = valid_chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(tool_plan(serial, capped).constraint[1])["maxItems"] == 1  # type: ignore[index]
    # A named function forces exactly one call, even with parallel calls allowed.
    for parallel in (None, True):
        body: dict[str, Any] = {"parallel_tool_calls": parallel} if parallel else {}
        named = valid_chat(
            tools=[WEATHER, NOARGS],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            **body,
        )
        schema = json.loads(tool_plan(named, PLAIN).constraint[1])  # type: ignore[index]
        assert schema["minItems"] == 1 and schema["maxItems"] == 1


def test_json_array_schema_is_valid_json_schema_and_means_what_it_says() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from sieproxy.core.request.schemas import Tool

    tools = [msgspec.convert(t, Tool) for t in (WEATHER, NOARGS, WITH_DEFS)]
    schema = json_array_tool_schema(tools, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    assert v.is_valid(
        [{"name": "ping", "parameters": {}}, {"name": "book", "parameters": {"when": {"day": 3}}}]
    )
    assert not v.is_valid([])
    assert not v.is_valid([{"name": "nope", "parameters": {}}])
    assert not v.is_valid([{"name": "get_weather", "parameters": {"town": "Oslo"}}])
    # the hoisted $defs still constrain the referencing tool
    assert not v.is_valid([{"name": "book", "parameters": {"when": {"day": "x"}}}])
    single = jsonschema.Draft202012Validator(json_array_tool_schema(tools, parallel=False))
    assert not single.is_valid([{"name": "ping", "parameters": {}}] * 2)


def test_conflicting_defs_are_refused() -> None:
    from sieproxy.core.request.schemas import Tool

    other = json.loads(json.dumps(WITH_DEFS))
    other["function"]["name"] = "book2"
    other["function"]["parameters"]["$defs"]["Date"] = {"type": "string"}
    tools = [msgspec.convert(t, Tool) for t in (WITH_DEFS, other)]
    with pytest.raises(InvalidRequest) as info:
        json_array_tool_schema(tools)
    assert info.value.param == "tools[1].function.parameters"


def test_strict_auto_tools_get_a_structural_tag_with_native_parsers() -> None:
    valid = valid_chat(tools=[WEATHER, WITH_DEFS])
    plan = tool_plan(valid, QWEN)
    assert plan.constraint is not None and plan.constraint[0] == "structural_tag"
    assert plan.parser == "qwen25"
    tag = json.loads(plan.constraint[1])
    assert tag["type"] == "structural_tag" and tag["triggers"] == ["<tool_call>"]
    assert tag["structures"][0]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert tag["structures"][0]["schema"] == {"type": "object"}  # not strict
    assert tag["structures"][1]["schema"] == WITH_DEFS["function"]["parameters"]  # type: ignore[index]
    assert tag["structures"][1]["end"] == "}\n</tool_call>"
    hermes = json.loads(tool_plan(valid, HERMES).constraint[1])  # type: ignore[index]
    assert hermes["structures"][0]["begin"] == '<tool_call>{"name": "get_weather", "arguments": '
    # no native parser, or no strict tool: free generation
    assert tool_plan(valid, PLAIN).constraint is None
    assert tool_plan(valid_chat(tools=[WEATHER]), QWEN).constraint is None


def test_smollm2_auto_calls_are_always_constrained_once_opened() -> None:
    smol = ModelProfile(name="s", tool_parser="smollm2")
    plan = tool_plan(valid_chat(tools=[WEATHER, NOARGS]), smol)  # no strict tool
    assert plan.constraint is not None and plan.constraint[0] == "structural_tag"
    tag = json.loads(plan.constraint[1])
    assert tag["triggers"] == ["<tool_call>"]
    first = tag["structures"][0]
    assert first["begin"] == '<tool_call>[{"name": "get_weather", "arguments": '
    assert first["schema"] == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert first["end"] == "}]</tool_call>"


def _xgrammar() -> Any:
    return pytest.importorskip("xgrammar")


def test_xgrammar_compiles_and_accepts_the_json_array_constraint() -> None:
    xgr = _xgrammar()
    from xgrammar.testing import _is_grammar_accept_string

    plan = tool_plan(valid_chat(tools=[WEATHER, NOARGS, WITH_DEFS], tool_choice="required"), PLAIN)
    assert plan.constraint is not None
    grammar = xgr.Grammar.from_json_schema(plan.constraint[1])
    assert _is_grammar_accept_string(
        grammar, '[{"name": "book", "parameters": {"when": {"day": 1}}}]'
    )
    assert _is_grammar_accept_string(grammar, '[{"name": "ping", "parameters": {}}]')
    assert not _is_grammar_accept_string(grammar, "[]")
    assert not _is_grammar_accept_string(grammar, '[{"name": "pong", "parameters": {}}]')


def test_xgrammar_ends_the_call_list_at_the_cap_and_allows_closing_after_each_call() -> None:
    xgr = _xgrammar()
    from xgrammar.testing import _is_grammar_accept_string

    call = '{"name": "ping", "parameters": {}}'
    capped = ModelProfile(name="m", max_tool_calls=3)
    required = valid_chat(tools=[WEATHER, NOARGS], tool_choice="required")
    grammar = xgr.Grammar.from_json_schema(tool_plan(required, capped).constraint[1])  # type: ignore[index]
    for k in (1, 2, 3):
        assert _is_grammar_accept_string(grammar, "[" + ", ".join([call] * k) + "]"), k
    assert not _is_grammar_accept_string(grammar, "[" + ", ".join([call] * 4) + "]")
    ping = {"type": "function", "function": {"name": "ping"}}
    named = valid_chat(tools=[NOARGS], tool_choice=ping)
    grammar = xgr.Grammar.from_json_schema(tool_plan(named, capped).constraint[1])  # type: ignore[index]
    assert _is_grammar_accept_string(grammar, f"[{call}]")
    assert not _is_grammar_accept_string(grammar, f"[{call}, {call}]")


SMOL = ModelProfile(name="s", tool_parser="smollm2")


@pytest.mark.parametrize("profile", [QWEN, HERMES, SMOL])
def test_xgrammar_compiles_and_accepts_the_structural_tag(profile: ModelProfile) -> None:
    xgr = _xgrammar()
    from xgrammar.structural_tag import StructuralTagItem
    from xgrammar.testing import _is_grammar_accept_string

    from sieproxy.core.request.schemas import Tool

    tools = [msgspec.convert(t, Tool) for t in (WEATHER, WITH_DEFS)]
    assert profile.tool_parser is not None
    tag = json.loads(tool_structural_tag(tools, profile.tool_parser))
    items = [StructuralTagItem(**s) for s in tag["structures"]]
    grammar = xgr.Grammar.from_structural_tag(items, tag["triggers"])
    nl = "" if profile.tool_parser in ("hermes", "smollm2") else "\n"
    obj = '{"name": "book", "arguments": {"when": {"day": 2}}}'
    if profile.tool_parser == "smollm2":
        obj = f"[{obj}]"
    call = f"<tool_call>{nl}{obj}{nl}</tool_call>"
    assert _is_grammar_accept_string(grammar, "Sure. " + call)
    assert _is_grammar_accept_string(grammar, "No call at all.")
    bad = call.replace('{"day": 2}', '{"day": "two"}')
    assert not _is_grammar_accept_string(grammar, bad)


def test_xgrammar_compiles_response_formats() -> None:
    xgr = _xgrammar()
    for rf in ({"type": "json_object"}, json_schema_format()):
        c = response_format_constraint(valid_chat(response_format=rf))
        assert c is not None
        xgr.Grammar.from_json_schema(c[1])


# ---------------------------------------------------------------- schema_in_prompt


def _with(valid: ValidChat, profile: ModelProfile = PLAIN) -> list[dict[str, Any]]:
    return with_schema_in_prompt(messages_for_template(valid), valid, profile)


SECTION = (
    "# Response Formats\n\n## reply\n\n"
    '{"type":"object","properties":{"answer":{"type":"string"},"score":{"type":"number"}},'
    '"required":["answer"]}'
)


def test_section_text() -> None:
    assert response_formats_section(SCHEMA, name="reply") == SECTION
    assert response_formats_section({"type": "object"}, description="Say \u00e9.") == (
        '# Response Formats\n\n## response\n\n// Say \u00e9.\n{"type":"object"}'
    )
    assert SECTION.startswith(RESPONSE_FORMATS_HEADER)


def test_schema_appended_to_the_system_message() -> None:
    valid = valid_chat(
        messages=[{"role": "system", "content": "Be kind."}, *USER],
        response_format=json_schema_format(),
    )
    msgs = _with(valid)
    assert msgs[0] == {"role": "system", "content": "Be kind.\n\n" + SECTION}
    assert msgs[1:] == USER
    # the request's message list is left untouched
    assert messages_for_template(valid)[0]["content"] == "Be kind."


def test_schema_inserted_as_a_system_message_when_there_is_none() -> None:
    msgs = _with(valid_chat(response_format=json_schema_format(description="An answer.")))
    assert msgs[0] == {
        "role": "system",
        "content": SECTION.replace("## reply\n\n", "## reply\n\n// An answer.\n"),
    }
    assert msgs[1:] == USER


def test_schema_added_as_a_part_to_part_array_system_content() -> None:
    valid = valid_chat(
        messages=[{"role": "system", "content": [{"type": "text", "text": "S"}]}, *USER],
        response_format=json_schema_format(),
    )
    assert _with(valid)[0]["content"] == [
        {"type": "text", "text": "S"},
        {"type": "text", "text": SECTION},
    ]


@pytest.mark.parametrize(
    "shown",
    [
        json.dumps(SCHEMA),
        json.dumps(SCHEMA, separators=(",", ":")),
        json.dumps(SCHEMA, indent=2),
        "Answer per this schema:\n" + json.dumps(dict(reversed(list(SCHEMA.items()))), indent=4),
        "{not json} then " + json.dumps(SCHEMA, sort_keys=True),
    ],
)
def test_schema_not_repeated_when_a_message_shows_it(shown: str) -> None:
    valid = valid_chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": shown}]}],
        response_format=json_schema_format(),
    )
    assert _with(valid) == messages_for_template(valid)


def test_schema_in_prompt_switches() -> None:
    off = ModelProfile(name="m", schema_in_prompt=False)
    rf = json_schema_format()
    assert _with(valid_chat(response_format=rf, schema_in_prompt=False)) == USER
    assert _with(valid_chat(response_format=rf), off) == USER
    assert _with(valid_chat(response_format=rf, schema_in_prompt=True), off)[0]["role"] == "system"
    # only json_schema formats are shown
    assert _with(valid_chat(response_format={"type": "json_object"})) == USER
    assert _with(valid_chat(response_format={"type": "text"})) == USER


# ---------------------------------------------------------------- tools in prompt

UNIT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": ["integer", "null"]},
                "unit": {"type": "string"},
            },
            "required": ["city", "days"],
        },
    },
}


def test_tools_section_text() -> None:
    text = tools_section([UNIT, NOARGS], "smollm2")
    assert text == "\n".join(
        [
            "# Tools",
            "",
            "You can call these tools:",
            "<tools>",
            json.dumps(UNIT["function"], separators=(",", ":")),
            '{"name":"ping"}',
            "</tools>",
            "",
            "To call a tool, reply with only the call, in this format:",
            '<tool_call>[{"name": "get_weather", "arguments": {"city": "...", "days": 0}}]'
            "</tool_call>",
        ]
    )


@pytest.mark.parametrize(
    ("parser", "example"),
    [
        ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'),
        ("qwen25", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'),
        ("llama3", '{"name": "ping", "parameters": {}}'),
        (JSON_ARRAY_PARSER, '[{"name": "ping", "parameters": {}}]'),
        ("smollm2", '<tool_call>[{"name": "ping", "arguments": {}}]</tool_call>'),
    ],
)
def test_tools_section_example_follows_the_parser(parser: str, example: str) -> None:
    from sieproxy.core.shaping.toolparse import make_tool_parser, parse_all

    text = tools_section([NOARGS], parser)
    assert text.endswith("in this format:\n" + example)
    # the example is a call the parser reads
    tp = make_tool_parser(parser, tool_names={"ping"})
    assert tp is not None
    assert parse_all(tp, example)[1][0]["function"]["name"] == "ping"


def test_tools_section_without_a_known_format_only_lists_the_tools() -> None:
    assert tools_section([NOARGS], None).endswith('<tools>\n{"name":"ping"}\n</tools>')


def test_tools_shown_only_when_the_template_ignores_them() -> None:
    smol = ModelProfile(name="s", tool_parser="smollm2")
    auto = tool_plan(valid_chat(tools=[WEATHER]), smol)
    msgs = [{"role": "system", "content": "Be brief."}, *USER]
    out = with_tools_in_prompt(msgs, auto, template_renders_tools=False)
    assert out[0]["content"] == "Be brief.\n\n" + tools_section([WEATHER], "smollm2")
    # under "auto", a one-turn example of a call follows the system message
    example = '<tool_call>[{"name": "get_weather", "arguments": {"city": "..."}}]</tool_call>'
    assert out[1:3] == [
        {"role": "user", "content": "Call get_weather."},
        {"role": "assistant", "content": example},
    ]
    assert out[3:] == USER and msgs[0]["content"] == "Be brief."
    described = valid_chat(tools=[UNIT], tool_choice="auto")
    out = with_tools_in_prompt(USER, tool_plan(described, smol), template_renders_tools=False)
    assert out[1]["content"] == "Weather in a city" and out[3:] == USER
    assert with_tools_in_prompt(msgs, auto, template_renders_tools=True) is msgs
    # forced calls: the example is the JSON-array form the grammar imposes
    forced = tool_plan(valid_chat(tools=[WEATHER], tool_choice="required"), smol)
    out = with_tools_in_prompt(USER, forced, template_renders_tools=False)
    assert out[0] == {"role": "system", "content": tools_section([WEATHER], JSON_ARRAY_PARSER)}
    none = tool_plan(valid_chat(tools=[WEATHER], tool_choice="none"), smol)
    assert with_tools_in_prompt(USER, none, template_renders_tools=False) is USER
