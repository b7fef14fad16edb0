"""Reasoning parser: recorded think outputs, tags split anywhere, a reference model.

The recorded outputs with a reasoning parser (``tests/data/outputs/think_*.json``) are fed
whole, split at every position, one character at a time and at hypothesis-chosen multi-splits;
arbitrary text is checked against a small non-streaming reference implementation of the
documented rules.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sieproxy.core.shaping.reasoning import REASONING_PARSERS, ThinkParser, make_reasoning_parser

DATA = Path(__file__).resolve().parent.parent / "data" / "outputs"
CASES: dict[str, dict[str, Any]] = {
    p.stem: c
    for p in sorted(DATA.glob("*.json"))
    if (c := json.loads(p.read_text(encoding="utf-8")))["reasoning_parser"]
}
WS = " \t\r\n"


def run(parser: ThinkParser, chunks: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in chunks:
        r, c = parser.feed(chunk)
        reasoning += r
        content += c
    r, c = parser.flush()
    return reasoning + r, content + c


def case_parser(case: dict[str, Any]) -> ThinkParser:
    p = make_reasoning_parser(case["reasoning_parser"], enable_thinking=case["enable_thinking"])
    assert isinstance(p, ThinkParser)
    return p


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def reference(text: str, starts_in_reasoning: bool, interrupts: tuple[str, ...]) -> tuple[str, str]:
    """The documented rules, applied to the whole text at once."""
    s = text.lstrip(WS)
    if s.startswith("<think>"):
        s = s[len("<think>") :]
    elif not starts_in_reasoning:
        return "", text
    hits = [(i, t) for t in ("</think>", *interrupts) if (i := s.find(t)) >= 0]
    if not hits:
        return s.strip(WS), ""
    i, tag = min(hits)
    if tag == "</think>":
        return s[:i].strip(WS), s[i + len(tag) :].lstrip(WS)
    return s[:i].strip(WS), s[i:]


def test_recorded_think_outputs_exist() -> None:
    assert len(CASES) >= 6


@pytest.mark.parametrize("name", sorted(CASES))
def test_recorded_every_split(name: str) -> None:
    # Reasoning alone; the tool-parser half of mixed cases is covered in test_toolparse.py.
    case = CASES[name]
    text = case["text"]
    whole = run(case_parser(case), [text])
    if not case["tool_parser"]:
        assert whole == (case["expected"]["reasoning"], case["expected"]["content"])
    else:
        assert whole[0] == case["expected"]["reasoning"]
    for i in range(len(text) + 1):
        assert run(case_parser(case), [text[:i], text[i:]]) == whole, f"split at {i}"
    assert run(case_parser(case), list(text)) == whole


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=60, deadline=None, print_blob=True)
@given(cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=25))
def test_recorded_random_splits(name: str, cuts: list[int]) -> None:
    case = CASES[name]
    text = case["text"]
    assert run(case_parser(case), split_at(text, cuts)) == run(case_parser(case), [text])


_PIECES = ["<think>", "</think>", "<thi", "</", "<", ">", "<tool_call>", " ", "\n", "\t", "a", "é"]
garbage = st.lists(st.sampled_from(_PIECES), max_size=25).map("".join)


@settings(max_examples=400, deadline=None, print_blob=True)
@given(
    text=garbage,
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10),
    starts=st.booleans(),
    interrupt=st.booleans(),
)
def test_matches_reference(text: str, cuts: list[int], starts: bool, interrupt: bool) -> None:
    interrupts = ("<tool_call>",) if interrupt else ()
    want = reference(text, starts, interrupts)

    def make() -> ThinkParser:
        return ThinkParser(starts_in_reasoning=starts, interrupts=interrupts)

    assert run(make(), [text]) == want
    assert run(make(), split_at(text, cuts)) == want
    assert run(make(), list(text)) == want


def test_streams_reasoning_promptly() -> None:
    p = ThinkParser()
    assert p.feed("<thi") == ("", "")
    assert p.in_reasoning is False
    assert p.feed("nk>\nStep one") == ("Step one", "")
    assert p.in_reasoning is True
    assert p.feed(".\n") == (".", "")  # trailing newline held back
    assert p.feed("Step two.</th") == ("\nStep two.", "")
    assert p.feed("ink>\n\nDone") == ("", "Done")
    assert p.in_reasoning is False
    assert p.feed(" <think>x</think>") == ("", " <think>x</think>")
    assert p.flush() == ("", "")


def test_starts_in_reasoning_only_end_tag() -> None:
    p = ThinkParser(starts_in_reasoning=True)
    assert p.in_reasoning is True
    assert run(p, ["Thinking…", "</think>", "\n\n", "Answer"]) == ("Thinking…", "Answer")


def test_truncated_inside_reasoning_flushes_as_reasoning() -> None:
    p = ThinkParser(starts_in_reasoning=True)
    assert p.feed("still thinking\n\n") == ("still thinking", "")
    assert p.flush() == ("", "")
    p = ThinkParser()
    assert p.feed("<think>abc</") == ("abc", "")
    assert p.flush() == ("</", "")


def test_no_think_block_is_content_verbatim() -> None:
    assert run(ThinkParser(), ["\n  Hello", " <think>"]) == ("", "\n  Hello <think>")
    assert run(ThinkParser(), ["  "]) == ("", "  ")
    assert run(ThinkParser(), ["  <thi"]) == ("", "  <thi")


def test_registry() -> None:
    assert make_reasoning_parser(None, enable_thinking=True) is None
    on = make_reasoning_parser("qwen3", enable_thinking=None)
    off = make_reasoning_parser("qwen3", enable_thinking=False)
    assert isinstance(on, ThinkParser) and on.in_reasoning
    assert isinstance(off, ThinkParser) and not off.in_reasoning
    for name in ("deepseek-r1", "deepseek_r1", "DeepSeek-R1", "qwen3-thinking", "qwq"):
        p = make_reasoning_parser(name, enable_thinking=False)
        assert isinstance(p, ThinkParser) and p.in_reasoning, name
    v3 = make_reasoning_parser("deepseek-v3", enable_thinking=None)
    assert isinstance(v3, ThinkParser) and not v3.in_reasoning
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek-r1"}
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_reasoning_parser("gpt-oss", enable_thinking=None)


def test_qwen3_tool_call_interrupts_reasoning() -> None:
    p = make_reasoning_parser("qwen3", enable_thinking=True)
    assert p is not None
    assert run(p, ["<think>\nplan\n<tool", "_call>\n{}"]) == ("plan", "<tool_call>\n{}")  # type: ignore[arg-type]


def test_rejects_empty_tags() -> None:
    with pytest.raises(ValueError):
        ThinkParser(end="")


@pytest.mark.parametrize("starts", [False, True])
def test_whitespace_runs_are_held_as_parts(starts: bool) -> None:
    for text, want in (
        ("\n" * 3000, ("", "" if starts else "\n" * 3000)),
        ("<think>x" + "\n" * 3000, ("x", "")),
        ("<think>x" + "\n" * 3000 + "y", ("x" + "\n" * 3000 + "y", "")),
    ):
        p = ThinkParser(starts_in_reasoning=starts)
        got = ["", ""]
        for ch in text:
            r, c = p.feed(ch)
            got = [got[0] + r, got[1] + c]
            assert len(p._hold) < 8
        r, c = p.flush()
        assert (got[0] + r, got[1] + c) == want
