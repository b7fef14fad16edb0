"""Planning: chat and completions requests → SGLang ``/generate`` bodies."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from sieproxy.core.errors import InvalidRequest
from sieproxy.core.planning.plan import (
    MAX_STOP,
    ChatPlan,
    candidate_seed,
    merge_stops,
    plan_chat,
    plan_completion,
)
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.schemas import ChatCompletionRequest, CompletionRequest
from sieproxy.core.request.valid import ImageInput, ValidChat, ValidCompletion

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}TOOLS:{{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif force_think is defined %}<think>\n{% endif %}{% endif %}"
)
PROFILE = ModelProfile(
    name="m",
    chat_template=QWEN_TEMPLATE,
    tool_parser="qwen25",
    reasoning_parser="qwen3",
    stop=("<|im_end|>",),
    inputs=frozenset({"text", "image"}),
)
PLAIN = ModelProfile(name="plain")
USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
PRIVATE: dict[str, Any] = {
    "user": "user-7f3",
    "safety_identifier": "safety-9a1",
    "prompt_cache_key": "pck-42b",
    "routing_key": "route-c0d",
}


def valid_chat(
    *,
    n: int = 1,
    best_of: int | None = None,
    stop: list[str] | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    max_tokens: int = 64,
    stream: bool = True,
    images: list[ImageInput] | None = None,
    **body: Any,
) -> ValidChat:
    body = {"model": "m", "messages": USER, **body}
    req = msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)
    return ValidChat(
        req=req,
        model="m",
        n=n,
        candidates=best_of or n,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=False,
        stop=stop or [],
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        include_reasoning=False,
        best_of=best_of,
        images=images or [],
    )


def plan(valid: ValidChat, profile: ModelProfile = PROFILE, **kw: Any) -> ChatPlan:
    return plan_chat(valid, profile, request_id="req1", **kw)


def test_minimal_body() -> None:
    p = plan(valid_chat())
    assert p.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert p.bodies == [
        {
            "text": p.prompt,
            "stream": True,
            "rid": "req1-0",
            "sampling_params": {"max_new_tokens": 64, "stop": ["<|im_end|>"]},
        }
    ]
    assert p.tool_parser is None
    assert p.reasoning_parser == "qwen3"
    assert not p.reasoning_open
    assert plan(valid_chat(), stream_upstream=False).bodies[0]["stream"] is False


def test_sampling_params_use_sglang_names() -> None:
    valid = valid_chat(
        stop=["END", "<|im_end|>", "END"],
        temperature=0.0,
        top_p=0.9,
        top_k=40,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.1,
        min_tokens=2,
        logit_bias={"42": -100.0, "7": 3.5},
        lora_adapter="sql",
        max_completion_tokens=64,
    )
    body = plan(valid).bodies[0]
    assert body["sampling_params"] == {
        "max_new_tokens": 64,
        "min_new_tokens": 2,
        "stop": ["END", "<|im_end|>"],
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 40,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -100.0, "7": 3.5},
    }
    assert body["lora_path"] == "sql"
    assert "lora_adapter" not in body and "n" not in body["sampling_params"]


def test_one_body_per_candidate_with_distinct_reproducible_seeds() -> None:
    bodies = plan(valid_chat(n=3, seed=1234)).bodies
    assert [b["rid"] for b in bodies] == ["req1-0", "req1-1", "req1-2"]
    seeds = [b["sampling_params"]["sampling_seed"] for b in bodies]
    assert seeds == [1234, 1235, 1236]
    assert len({b["text"] for b in bodies}) == 1
    assert all("n" not in b["sampling_params"] for b in bodies)
    again = plan(valid_chat(n=3, seed=1234)).bodies
    assert [b["sampling_params"]["sampling_seed"] for b in again] == seeds
    assert "sampling_seed" not in plan(valid_chat(n=2)).bodies[1]["sampling_params"]


def test_seed_wraps_into_signed_64_bit() -> None:
    top = 2**63 - 1
    assert candidate_seed(top, 0) == top
    assert candidate_seed(top, 1) == -(2**63)
    assert candidate_seed(-(2**63), 0) == -(2**63)
    seeds = [b["sampling_params"]["sampling_seed"] for b in plan(valid_chat(n=2, seed=top)).bodies]
    assert seeds == [top, -(2**63)]
    assert all(-(2**63) <= s <= top for s in seeds)


def test_logprobs_and_best_of() -> None:
    body = plan(valid_chat(logprobs=True, top_logprobs=5)).bodies[0]
    assert body["return_logprob"] is True
    assert body["top_logprobs_num"] == 5
    assert body["logprob_start_len"] == -1
    assert body["return_text_in_logprobs"] is True
    ranked = plan(valid_chat(n=1, best_of=3, stream=False)).bodies
    assert len(ranked) == 3
    assert all(b["return_logprob"] and b["top_logprobs_num"] == 0 for b in ranked)
    assert "return_logprob" not in plan(valid_chat()).bodies[0]


def test_images_in_message_order() -> None:
    imgs = [
        ImageInput(1, 0, "image/png", b"b", "data:image/png;base64,Yg=="),
        ImageInput(0, 1, "image/png", b"a", "data:image/png;base64,YQ=="),
    ]
    body = plan(valid_chat(images=imgs)).bodies[0]
    assert body["image_data"] == ["data:image/png;base64,YQ==", "data:image/png;base64,Yg=="]


def test_privacy_fields_are_never_forwarded() -> None:
    for valid in (valid_chat(**PRIVATE), valid_chat(n=2, seed=1, tools=[WEATHER], **PRIVATE)):
        bodies = plan(valid).bodies
        dumped = json.dumps(bodies)
        keys = {k for b in bodies for k in (*b, *b["sampling_params"])}
        for key, value in PRIVATE.items():
            assert value not in dumped
            assert key not in keys


def test_stops_merged_deduplicated_and_capped() -> None:
    assert merge_stops(["a", "b", "a"], ("b", "c")) == ["a", "b", "c"]
    many = [f"s{i}" for i in range(MAX_STOP)]
    assert merge_stops(many, ("x",)) == many
    with pytest.raises(InvalidRequest):
        merge_stops([*many, "extra"], ())
    assert "stop" not in plan(valid_chat(), PLAIN).bodies[0]["sampling_params"]


def test_tools_and_parsers() -> None:
    auto = plan(valid_chat(tools=[WEATHER]))
    assert auto.tool_parser == "qwen25"
    assert auto.bodies[0]["sampling_params"]["skip_special_tokens"] is False
    assert "TOOLS:get_weather" in auto.prompt
    assert not any(k in auto.bodies[0]["sampling_params"] for k in GRAMMAR_KEYS)

    none = plan(valid_chat(tools=[WEATHER], tool_choice="none"))
    assert none.tool_parser is None
    assert "TOOLS" not in none.prompt
    assert "skip_special_tokens" not in none.bodies[0]["sampling_params"]

    req = plan(valid_chat(tools=[WEATHER], tool_choice="required", n=2))
    assert req.tool_parser == "json_array"
    assert all("json_schema" in b["sampling_params"] for b in req.bodies)


SMOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_reach_the_prompt_of_a_template_that_ignores_them() -> None:
    smol = ModelProfile(name="s", chat_template=SMOL_TEMPLATE, tool_parser="smollm2")
    weather = json.dumps(WEATHER["function"], separators=(",", ":"))
    auto = plan(valid_chat(tools=[WEATHER]), smol)
    assert auto.prompt.startswith("<|im_start|>system\n# Tools\n\n")
    assert weather in auto.prompt
    example = '<tool_call>[{"name": "get_weather", "arguments": {"city": "..."}}]</tool_call>'
    assert example in auto.prompt
    assert auto.tool_parser == "smollm2"
    ping = {"type": "function", "function": {"name": "ping"}}
    named = plan(
        valid_chat(
            tools=[WEATHER, ping], tool_choice={"type": "function", "function": {"name": "ping"}}
        ),
        smol,
    )
    assert '[{"name": "ping", "parameters": {}}]' in named.prompt
    assert "get_weather" not in named.prompt
    assert "# Tools" not in plan(valid_chat(tools=[WEATHER], tool_choice="none"), smol).prompt
    assert "# Tools" not in plan(valid_chat(), smol).prompt
    # a template that renders `tools` itself gets no section
    assert "# Tools" not in plan(valid_chat(tools=[WEATHER])).prompt


def test_reasoning_open_when_the_template_starts_thinking() -> None:
    assert plan(valid_chat(chat_template_kwargs={"enable_thinking": False})).reasoning_open is False
    profile = ModelProfile(
        name="r",
        chat_template=QWEN_TEMPLATE,
        reasoning_parser="qwen3",
        template_vars={"force_think": "1"},
    )
    assert plan(valid_chat(), profile).reasoning_open is True
    assert (
        plan(valid_chat(), ModelProfile(name="x", chat_template=QWEN_TEMPLATE)).reasoning_open
        is False
    )


def test_schema_in_prompt_reaches_the_prompt() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA}}
    p = plan(valid_chat(response_format=rf))
    assert p.prompt.startswith("<|im_start|>system\n# Response Formats\n\n## out\n\n{")
    assert json.loads(p.bodies[0]["sampling_params"]["json_schema"]) == SCHEMA
    p = plan(valid_chat(response_format=rf, schema_in_prompt=False))
    assert "Response Formats" not in p.prompt


REQUESTS: list[dict[str, Any]] = [
    {},
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
    {"tools": [WEATHER]},
    {"tools": [WEATHER], "tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]},  # type: ignore[dict-item]
    {
        "tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}],  # type: ignore[dict-item]
        "response_format": {"type": "json_object"},
    },
    {"tools": [WEATHER], "tool_choice": "none", "response_format": {"type": "json_object"}},
]


@pytest.mark.parametrize("profile", [PROFILE, PLAIN, ModelProfile(name="h", tool_parser="hermes")])
@pytest.mark.parametrize("body", REQUESTS)
def test_at_most_one_grammar_and_it_compiles(body: dict[str, Any], profile: ModelProfile) -> None:
    p = plan(valid_chat(n=2, seed=5, **body), profile)
    for b in p.bodies:
        keys = [k for k in GRAMMAR_KEYS if k in b["sampling_params"]]
        assert len(keys) <= 1
        for k in keys:
            assert isinstance(b["sampling_params"][k], str)
    sp = p.bodies[0]["sampling_params"]
    try:
        import xgrammar as xgr
    except ImportError:
        return
    if "json_schema" in sp:
        xgr.Grammar.from_json_schema(sp["json_schema"])
    if "structural_tag" in sp:
        from xgrammar.structural_tag import StructuralTagItem

        tag = json.loads(sp["structural_tag"])
        xgr.Grammar.from_structural_tag(
            [StructuralTagItem(**s) for s in tag["structures"]], tag["triggers"]
        )


def test_tool_constraint_schemas_are_valid_json_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for body in REQUESTS:
        sp = plan(valid_chat(**body)).bodies[0]["sampling_params"]
        if "json_schema" in sp:
            jsonschema.Draft202012Validator.check_schema(json.loads(sp["json_schema"]))
        if "structural_tag" in sp:
            for s in json.loads(sp["structural_tag"])["structures"]:
                jsonschema.Draft202012Validator.check_schema(s["schema"])


def test_template_errors_surface_as_400() -> None:
    bad = ModelProfile(name="b", chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(InvalidRequest):
        plan(valid_chat(), bad)


# ---------------------------------------------------------------- completions


def valid_completion(**body: Any) -> ValidCompletion:
    body = {"model": "m", "prompt": "Once upon", **body}
    req = msgspec.json.decode(json.dumps(body), type=CompletionRequest)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return ValidCompletion(
        req=req,
        model="m",
        prompt="Once upon",
        max_tokens=body.get("max_tokens") or 16,
        stream=bool(body.get("stream")),
        stop=stops,
    )


def test_plan_completion() -> None:
    assert plan_completion(valid_completion(), PLAIN, request_id="c9") == {
        "text": "Once upon",
        "rid": "c9-0",
        "stream": True,
        "sampling_params": {"max_new_tokens": 16},
    }
    body = plan_completion(
        valid_completion(
            max_tokens=5,
            stop="\n",
            temperature=0.2,
            top_p=0.5,
            seed=-3,
            frequency_penalty=1.0,
            presence_penalty=0.1,
        ),
        PROFILE,
        request_id="c9",
        stream_upstream=False,
    )
    assert body["stream"] is False
    assert body["sampling_params"] == {
        "max_new_tokens": 5,
        "stop": ["\n", "<|im_end|>"],
        "temperature": 0.2,
        "top_p": 0.5,
        "frequency_penalty": 1.0,
        "presence_penalty": 0.1,
        "sampling_seed": -3,
    }


def test_ignore_eos_is_forwarded_only_when_true() -> None:
    assert plan(valid_chat(ignore_eos=True)).bodies[0]["sampling_params"]["ignore_eos"] is True
    assert "ignore_eos" not in plan(valid_chat(ignore_eos=False)).bodies[0]["sampling_params"]
    req = CompletionRequest(model="m", prompt="p", ignore_eos=True)
    valid = ValidCompletion(req=req, model="m", prompt="p", max_tokens=4, stream=True, stop=[])
    body = plan_completion(valid, PROFILE, request_id="r")
    assert body["sampling_params"]["ignore_eos"] is True
