"""Tool-call parsers: recorded outputs, split invariance, the streamed delta protocol.

Every recorded output in ``tests/data/outputs/*.json`` is run through the choice's parser chain
(reasoning parser, then tool parser, as the choice pipeline does) fed whole, split at every
character position, one character at a time, and at random multi-splits (hypothesis, plus a
seeded ``random`` sweep whose seed is in every failure message). All must give the same
reasoning, content and calls (ids, names, concatenated arguments) as the expected values
written in the file.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sieproxy.core.shaping.events import ToolCallDelta
from sieproxy.core.shaping.reasoning import make_reasoning_parser
from sieproxy.core.shaping.toolparse import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonArrayToolParser,
    Llama3ToolParser,
    default_id_factory,
    make_tool_parser,
    merge_tool_calls,
    parse_all,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "outputs"
CASES: dict[str, dict[str, Any]] = {
    p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DATA.glob("*.json"))
}
TOOL_CASES = sorted(k for k, c in CASES.items() if c["tool_parser"])
SEED = "chatcmpl-test:0"


@dataclass
class Run:
    reasoning: str = ""
    content: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)
    calls: int = 0
    truncated: bool = False

    def merged(self) -> tuple[str, str, list[dict[str, Any]]]:
        return self.reasoning, self.content, merge_tool_calls(self.deltas)


def run_case(case: dict[str, Any], chunks: list[str]) -> Run:
    """Feed ``chunks`` through the case's parser chain (reasoning ▸ tools) and flush."""
    rp = make_reasoning_parser(case["reasoning_parser"], enable_thinking=case["enable_thinking"])
    tp = make_tool_parser(case["tool_parser"], tool_names=set(case["tool_names"]), seed=SEED)
    out = Run()

    def tools(text: str, final: bool) -> None:
        if tp is None:
            out.content += text
            return
        content, deltas = tp.feed(text)
        out.content += content
        out.deltas += deltas
        if final:
            content, deltas = tp.flush()
            out.content += content
            out.deltas += deltas
            out.calls = tp.calls
            out.truncated = tp.truncated

    for chunk in chunks:
        if rp is None:
            tools(chunk, False)
        else:
            reasoning, content = rp.feed(chunk)
            out.reasoning += reasoning
            tools(content, False)
    if rp is not None:
        reasoning, content = rp.flush()
        out.reasoning += reasoning
        tools(content, True)
    else:
        tools("", True)
    return out


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def check_protocol(deltas: list[ToolCallDelta]) -> None:
    """id + name exactly on a call's first delta; indices start at 0 and open in order."""
    seen: set[int] = set()
    for d in deltas:
        if d.index not in seen:
            assert d.index == len(seen), f"call {d.index} opened out of order"
            assert d.id is not None and d.id.startswith("call_") and len(d.id) == 29
            assert d.name, "first delta carries the name"
            assert d.arguments == ""
            seen.add(d.index)
        else:
            assert d.id is None and d.name is None, "id/name only on the first delta"
            assert d.arguments, "no empty argument fragments"


def check_expected(case: dict[str, Any], run: Run) -> None:
    exp = case["expected"]
    assert run.reasoning == exp["reasoning"]
    assert run.content == exp["content"]
    calls = merge_tool_calls(run.deltas)
    assert len(calls) == len(exp["tool_calls"]) == run.calls
    if "truncated" in exp:
        assert run.truncated is exp["truncated"]
    ids = default_id_factory(SEED)
    for i, (got, want) in enumerate(zip(calls, exp["tool_calls"], strict=True)):
        assert got["id"] == ids(i)
        assert got["type"] == "function"
        assert got["function"]["name"] == want["name"]
        args = got["function"]["arguments"]
        if "arguments_text" in want:
            assert args == want["arguments_text"]
        else:
            assert json.loads(args) == want["arguments"]


# -- recorded outputs ---------------------------------------------------------------------------


def test_recorded_outputs_exist() -> None:
    assert len(TOOL_CASES) >= 20
    for fmt in ("hermes", "qwen25", "qwen", "llama3", "json_array", "smollm2"):
        assert any(CASES[k]["tool_parser"] == fmt for k in TOOL_CASES), fmt


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole(name: str) -> None:
    case = CASES[name]
    run = run_case(case, [case["text"]])
    check_protocol(run.deltas)
    check_expected(case, run)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split_point(name: str) -> None:
    case = CASES[name]
    text = case["text"]
    whole = run_case(case, [text])
    for i in range(len(text) + 1):
        run = run_case(case, [text[:i], text[i:]])
        check_protocol(run.deltas)
        assert run.merged() == whole.merged(), f"split at {i}: {text[:i]!r} | {text[i:]!r}"
        assert run.calls == whole.calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_char_by_char(name: str) -> None:
    case = CASES[name]
    run = run_case(case, list(case["text"]))
    check_protocol(run.deltas)
    check_expected(case, run)


@pytest.mark.parametrize("name", sorted(CASES))
def test_seeded_random_splits(name: str) -> None:
    case = CASES[name]
    text = case["text"]
    whole = run_case(case, [text]).merged()
    for seed in range(40):
        rng = random.Random(seed)
        cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randrange(1, 12))]
        run = run_case(case, split_at(text, cuts))
        check_protocol(run.deltas)
        assert run.merged() == whole, f"random.Random({seed}) cuts={sorted(cuts)}"


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=60, deadline=None, print_blob=True)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=25))
def test_hypothesis_splits(name: str, cuts: list[int]) -> None:
    case = CASES[name]
    text = case["text"]
    run = run_case(case, split_at(text, cuts))
    check_protocol(run.deltas)
    check_expected(case, run)


# -- arbitrary text: never raises, always split-invariant ------------------------------------

_PIECES = [
    "<tool_call>", "</tool_call>", "<tool_", "<|python_tag|>", "<think>", "</think>",
    "{", "}", "[", "]", '"', "\\", ":", ",", ";", " ", "\n", "x", "1", "null", "é", "\u2028",
    '"name"', '"arguments"', '"parameters"', '"f"', '"g"', '{"name": "f", "arguments": ',
    '{"name": "g", "parameters": {"a": 1}}',
]  # fmt: skip

garbage = st.lists(st.sampled_from(_PIECES), max_size=30).map("".join)


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
@settings(max_examples=150, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(text=garbage, cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=10))
def test_arbitrary_text_split_invariant(fmt: str, text: str, cuts: list[int]) -> None:
    case = {"tool_parser": fmt, "reasoning_parser": None, "enable_thinking": None,
            "tool_names": ["f", "g"]}  # fmt: skip
    whole = run_case(case, [text])
    check_protocol(whole.deltas)
    for chunks in (split_at(text, cuts), list(text)):
        run = run_case(case, chunks)
        check_protocol(run.deltas)
        assert run.merged() == whole.merged()
        assert run.calls == whole.calls
        assert run.truncated == whole.truncated
    if not whole.deltas and fmt == "llama3":  # no call: the output is content, verbatim
        assert whole.content == text


@pytest.mark.parametrize("fmt", ["hermes", "qwen25"])
@settings(max_examples=150, deadline=None)
@given(text=garbage)
def test_hermes_without_calls_loses_only_adjacent_whitespace(fmt: str, text: str) -> None:
    content, calls = parse_all(make_tool_parser(fmt, tool_names={"f", "g"}), text)  # type: ignore[arg-type]
    if not calls:
        strip = str.maketrans("", "", " \t\r\n")
        assert content.translate(strip) == text.translate(strip)


# -- streaming shape -----------------------------------------------------------------------------


def test_streams_name_first_then_argument_fragments() -> None:
    p = HermesToolParser(tool_names={"get_weather"}, seed="s")
    feeds = ['<tool_call>\n{"name": "get_', 'weather", "argu', 'ments": {"ci', 'ty": "Pa',
             'ris"}}\n</tool', "_call>"]  # fmt: skip
    got = [p.feed(f) for f in feeds]
    assert got[0] == ("", [])
    assert got[1] == ("", [])  # the name is known, but the arguments have not started
    assert got[2] == (
        "",
        [
            ToolCallDelta(0, default_id_factory("s")(0), "get_weather", ""),
            ToolCallDelta(0, None, None, '{"ci'),
        ],
    )
    assert got[3] == ("", [ToolCallDelta(0, None, None, 'ty": "Pa')])
    assert got[4] == ("", [ToolCallDelta(0, None, None, 'ris"}')])
    assert got[5] == ("", [])
    assert p.flush() == ("", [])
    assert p.calls == 1


def test_content_is_streamed_promptly() -> None:
    p = HermesToolParser()
    assert p.feed("Hello wor") == ("Hello wor", [])
    assert p.feed("ld <tool") == ("ld", [])  # " <tool" could open a call
    assert p.feed("s> are fine\n") == (" <tools> are fine", [])
    assert p.flush() == ("\n", [])


def test_long_arguments_stream_without_rescanning() -> None:
    p = HermesToolParser()
    p.feed('<tool_call>{"name": "write_file", "arguments": {"text": "')
    body = 'lorem ipsum \\" { } ] ' * 2000
    out = []
    for i in range(0, len(body), 7):
        _, deltas = p.feed(body[i : i + 7])
        out += [d.arguments for d in deltas]
    _, deltas = p.feed('"}}</tool_call>')
    out += [d.arguments for d in deltas]
    assert "".join(out).endswith(body + '"}')
    obj = p._obj  # scanner gone once the call ended
    assert obj is None


def test_id_factory_and_seed() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2
    _, calls = parse_all(HermesToolParser(id_factory=lambda i: f"id{i}"), text)
    assert [c["id"] for c in calls] == ["id0", "id1"]
    _, a = parse_all(HermesToolParser(seed="req-1:0"), text)
    _, b = parse_all(HermesToolParser(seed="req-2:0"), text)
    assert a[0]["id"] != b[0]["id"] and a[0]["id"] != a[1]["id"]
    assert a == parse_all(HermesToolParser(seed="req-1:0"), text)[1]


def test_parse_all_shape() -> None:
    content, calls = parse_all(
        JsonArrayToolParser(seed="x"), '[{"name": "f", "parameters": {"a": 1}}]'
    )
    assert content == ""
    assert calls == [
        {
            "id": default_id_factory("x")(0),
            "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'},
        }
    ]


def test_json_array_not_an_array_is_content() -> None:
    assert parse_all(JsonArrayToolParser(), ' {"name": "f"}') == (' {"name": "f"}', [])
    assert parse_all(JsonArrayToolParser(), "[1, 2]") == ("[1, 2]", [])
    assert parse_all(JsonArrayToolParser(), "[]") == ("", [])


def test_llama3_python_tag_without_json_is_content() -> None:
    text = "<|python_tag|>print('hi')"
    assert parse_all(Llama3ToolParser(), text) == (text, [])
    assert parse_all(Llama3ToolParser(), "  ") == ("  ", [])


def test_llama3_trailing_semicolon_dropped() -> None:
    content, calls = parse_all(Llama3ToolParser(), '{"name": "f", "parameters": {}};\n')
    assert content == "" and len(calls) == 1


def test_registry() -> None:
    assert make_tool_parser(None, tool_names=set()) is None
    for name in ("hermes", "qwen25", "qwen", "QWEN25", "llama3", "json_array", "json-array",
                 "smollm2", "SmolLM2"):  # fmt: skip
        assert make_tool_parser(name, tool_names={"f"}) is not None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_tool_parser("mistral", tool_names=set())


def test_empty_tool_names_disable_the_check() -> None:
    _, calls = parse_all(HermesToolParser(), '<tool_call>{"name": "any", "arguments": {}}')
    assert calls[0]["function"]["name"] == "any"


@pytest.mark.parametrize(
    ("fmt", "prefix"), [("hermes", "text"), ("llama3", "<|python_tag|>"), ("json_array", "[")]
)
def test_whitespace_runs_are_held_as_parts(fmt: str, prefix: str) -> None:
    # A degenerate model emitting only newlines must not make each feed re-copy the run.
    p = make_tool_parser(fmt, tool_names=set())
    assert isinstance(p, HermesToolParser | Llama3ToolParser | JsonArrayToolParser)
    head, _ = p.feed(prefix)
    for _ in range(5000):
        assert p.feed("\n ") == ("", [])
        assert len(p._hold) < 16
    content, deltas = p.flush()
    assert deltas == [] and head + content == prefix + "\n " * 5000
