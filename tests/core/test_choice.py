from __future__ import annotations

import pytest

from sieproxy.core.shaping.choice import (
    ChoicePhase,
    ChoiceState,
    ChoiceStateError,
    openai_finish_reason,
)
from sieproxy.core.shaping.events import (
    CandidateDelta,
    CandidateFinish,
    ChoiceDelta,
    TokenLogprob,
    ToolCallDelta,
)

from .fakes import FakeReasoning, FakeTools


def tok(i: int, lp: float = -0.5) -> TokenLogprob:
    return TokenLogprob(f"t{i}", i, lp)


def d(text: str, n: int, lps: list[TokenLogprob] | None = None) -> CandidateDelta:
    return CandidateDelta(text, n, lps or [])


def fin(reason: str = "stop", n: int = 0) -> CandidateFinish:
    return CandidateFinish(reason, None, 7, n, 1, 0)


def test_prompt_tokens_are_counted_before_the_finish() -> None:
    """A choice that never finishes (its client left) reports the prompt its deltas carried;
    the finish's count is the last word."""
    c = ChoiceState(0)
    c.feed(CandidateDelta("a", 1, [], prompt_tokens=11))
    assert c.prompt_tokens == 11 and c.completion_tokens == 1
    c.finish(fin("stop", 1))
    assert c.prompt_tokens == 7


def test_plain_text_and_accounting() -> None:
    c = ChoiceState(0, logprobs=True)
    out = c.feed(d("Hel", 1, [tok(1, -0.25)]))
    assert out.content == "Hel" and [t.token_id for t in out.logprobs] == [1]
    out = c.feed(d("lo", 2, [tok(2, -0.5)]))
    assert out.content == "lo"
    tail = c.finish(fin("length", 2))
    assert not tail
    assert c.finished and c.finish_reason == "length"
    assert c.content == "Hello"
    assert c.completion_tokens == 2 and c.prompt_tokens == 7 and c.cached_tokens == 1
    assert c.cumulative_logprob == pytest.approx(-0.75)
    assert [t.token_id for t in c.logprobs] == [1, 2]


def test_stop_string_split_across_deltas() -> None:
    c = ChoiceState(0, stops=["END"], logprobs=True)
    assert c.feed(d("abcE", 1, [tok(1)])).content == "abc"
    assert not c.stop_matched
    out = c.feed(d("NDxyz", 2, [tok(2)]))
    assert out.content == ""
    assert c.stop_matched and c.phase is ChoicePhase.STOPPED
    # in-flight output after the gateway's match is ignored
    assert not c.feed(d("more", 3, [tok(3, -9.0)]))
    c.finish(fin("abort", 4))
    assert c.finish_reason == "stop"
    assert c.content == "abc"
    assert c.completion_tokens == 4
    # the score counts only tokens before the stop match
    assert c.cumulative_logprob == pytest.approx(-1.0)


def test_held_stop_prefix_is_released_at_finish() -> None:
    c = ChoiceState(0, stops=["###"])
    assert c.feed(d("a#", 1)).content == "a"
    tail = c.finish(fin("length", 1))
    assert tail.content == "#"
    assert c.content == "a#"


def test_logprobs_wait_for_visible_text() -> None:
    c = ChoiceState(0, stops=["xyz"], logprobs=True)
    out = c.feed(d("x", 1, [tok(1)]))
    assert out.content == "" and out.logprobs == []
    out = c.feed(d("a", 2, [tok(2)]))
    assert out.content == "xa"
    assert [t.token_id for t in out.logprobs] == [1, 2]


def test_pending_logprobs_attach_at_finish() -> None:
    c = ChoiceState(0, stops=["xyz"], logprobs=True)
    c.feed(d("xy", 1, [tok(1)]))
    tail = c.finish(fin("length", 1))
    assert tail.content == "xy" and [t.token_id for t in tail.logprobs] == [1]


def test_no_logprobs_when_not_asked() -> None:
    c = ChoiceState(0)
    out = c.feed(d("a", 1, [tok(1, -2.0)]))
    assert out.logprobs == []
    assert c.cumulative_logprob == -2.0


def test_reasoning_shown() -> None:
    c = ChoiceState(0, reasoning=FakeReasoning, include_reasoning=True, logprobs=True)
    out = c.feed(d("[thi", 1, [tok(1)]))
    assert out.reasoning == "thi" and out.content == "" and len(out.logprobs) == 1
    out = c.feed(d("nk]Hi", 2, [tok(2)]))
    assert out.reasoning == "nk" and out.content == "Hi"
    c.finish(fin("stop", 2))
    assert c.reasoning == "think" and c.content == "Hi"


def test_reasoning_hidden_drops_text_and_its_logprobs() -> None:
    c = ChoiceState(0, reasoning=FakeReasoning, include_reasoning=False, logprobs=True)
    out = c.feed(d("[secret", 1, [tok(1)]))
    assert not out
    out = c.feed(d("]", 2, [tok(2)]))
    assert not out
    out = c.feed(d("Hi", 3, [tok(3)]))
    assert out.content == "Hi" and [t.token_id for t in out.logprobs] == [3]
    c.finish(fin("stop", 3))
    assert c.reasoning == "" and c.content == "Hi"
    assert c.completion_tokens == 3  # reasoning tokens still count
    assert c.cumulative_logprob == pytest.approx(-1.5)


def test_parsers_are_flushed_at_finish() -> None:
    made: list[FakeReasoning | FakeTools] = []

    def rf() -> FakeReasoning:
        made.append(p := FakeReasoning())
        return p

    def tf() -> FakeTools:
        made.append(p := FakeTools())
        return p

    c = ChoiceState(0, reasoning=rf, tools=tf)
    c.finish(fin())
    assert all(p.flushed for p in made) and len(made) == 2


def test_tool_calls() -> None:
    c = ChoiceState(0, tools=FakeTools)
    out = c.feed(d("ok {a", 1))
    assert out.content == "ok "
    assert out.tool_calls == [
        ToolCallDelta(0, "call_0", "fn", ""),
        ToolCallDelta(0, None, None, "a"),
    ]
    c.feed(d("b}{", 2))
    c.feed(d("c}", 3))
    c.finish(fin("stop", 3))
    assert c.finish_reason == "tool_calls"
    calls = c.tool_calls
    assert [(x.index, x.id, x.name, x.arguments) for x in calls] == [
        (0, "call_0", "fn", "ab"),
        (1, "call_1", "fn", "c"),
    ]


def test_tool_call_cut_by_length_is_length() -> None:
    c = ChoiceState(0, tools=FakeTools, collect=False)
    c.feed(d("{partial", 1))
    c.finish(fin("length", 1))
    assert c.finish_reason == "length"
    assert c.tool_calls == []  # not collected when streaming


def test_length_after_complete_calls_is_tool_calls() -> None:
    c = ChoiceState(0, tools=FakeTools)
    c.feed(d("{ab} trailing", 1))
    c.finish(fin("length", 1))
    assert c.finish_reason == "tool_calls"
    assert [t.name for t in c.tool_calls] == ["fn"]


def test_forced_call_list_cut_by_length_is_length_with_the_complete_calls() -> None:
    from functools import partial

    from sieproxy.core.shaping.toolparse import make_tool_parser

    tools = partial(make_tool_parser, "json_array", tool_names={"get_weather"})
    c = ChoiceState(0, tools=tools)  # type: ignore[arg-type]
    c.feed(d('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_w', 30))
    c.finish(fin("length", 30))
    assert c.finish_reason == "length"
    assert c.content == ""
    assert [(t.name, t.arguments) for t in c.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    done = ChoiceState(0, tools=tools)  # type: ignore[arg-type]
    done.feed(d('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', 20))
    done.finish(fin("stop", 20))
    assert done.finish_reason == "tool_calls" and done.content == ""


@pytest.mark.parametrize(
    "reason,stop,tools,expected",
    [
        ("stop", False, False, "stop"),
        ("length", False, False, "length"),
        ("abort", False, False, "stop"),
        ("novel", False, False, "stop"),
        ("length", True, False, "stop"),
        ("length", False, True, "tool_calls"),
        ("stop", True, True, "tool_calls"),
        ("abort", False, True, "tool_calls"),
    ],
)
def test_finish_mapping(reason: str, stop: bool, tools: bool, expected: str) -> None:
    assert openai_finish_reason(reason, stop_matched=stop, tool_calls=tools) == expected


@pytest.mark.parametrize(
    "reason,stop,expected",
    [("length", False, "length"), ("stop", False, "tool_calls"), ("length", True, "tool_calls")],
)
def test_finish_mapping_of_a_cut_call(reason: str, stop: bool, expected: str) -> None:
    got = openai_finish_reason(reason, stop_matched=stop, tool_calls=True, call_cut=True)
    assert got == expected


def test_illegal_transitions_leave_failed() -> None:
    c = ChoiceState(0)
    c.finish(fin())
    with pytest.raises(ChoiceStateError):
        c.feed(d("x", 1))
    assert c.phase is ChoicePhase.FAILED
    with pytest.raises(ChoiceStateError):
        c.finish(fin())
    assert c.phase is ChoicePhase.FAILED

    c2 = ChoiceState(1)
    c2.fail()
    assert c2.phase is ChoicePhase.FAILED
    with pytest.raises(ChoiceStateError):
        c2.feed(d("x", 1))

    c3 = ChoiceState(2)
    c3.finish(fin())
    with pytest.raises(ChoiceStateError):
        c3.fail()
    assert c3.phase is ChoicePhase.FAILED


# ---- a streamed choice (collect=False): the pass-through shortcut is taken only when no stage
# would change the text


def test_streamed_plain_choice_passes_text_through() -> None:
    c = ChoiceState(0, collect=False)
    out = c.feed(d("Hel", 1, [tok(1)]))
    assert out == ChoiceDelta("Hel")  # logprobs not asked: not attached
    assert c.feed(d("", 2)) == ChoiceDelta()  # a token with no text yet: nothing visible
    assert c.completion_tokens == 2 and c.cumulative_logprob == -0.5
    c.finish(fin("length", 2))
    assert c.content == "" and c.finish_reason == "length"  # streamed: nothing collected


def test_streamed_logprobs_ride_on_their_own_delta() -> None:
    c = ChoiceState(0, logprobs=True, collect=False)
    out = c.feed(d("Hel", 1, [tok(1)]))
    assert out.content == "Hel" and [t.token_id for t in out.logprobs] == [1]
    out = c.feed(d("lo", 2, [tok(2)]))
    assert out.content == "lo" and [t.token_id for t in out.logprobs] == [2]
    assert not c.finish(fin("stop", 2)).logprobs  # none left over for the closure


def test_streamed_stop_string_is_still_matched() -> None:
    c = ChoiceState(0, stops=["END"], collect=False)
    assert c.feed(d("abcE", 1)).content == "abc"  # "E" could start the stop string
    out = c.feed(d("ND more", 2))
    assert out.content == "" and c.stop_matched and c.phase is ChoicePhase.STOPPED


def test_streamed_reasoning_is_still_split() -> None:
    c = ChoiceState(0, reasoning=FakeReasoning, include_reasoning=False, collect=False)
    assert not c.feed(d("[secret", 1))
    assert c.feed(d("]Hi", 2)) == ChoiceDelta("Hi")


def test_streamed_tool_calls_are_still_parsed() -> None:
    c = ChoiceState(0, tools=FakeTools, collect=False)
    out = c.feed(d("ok {a", 1))
    assert out.content == "ok " and [t.name for t in out.tool_calls][:1] == ["fn"]


def test_a_choice_keeps_its_attributes_in_slots() -> None:
    """``ChoiceState`` is slotted (one per candidate, read on every token): with every stage
    on and a whole life (deltas, a stop string, the finish), no attribute lands in a
    ``__dict__``; the slot list is the class's own, not its error's."""
    c = ChoiceState(
        0, stops=["END"], reasoning=FakeReasoning, tools=FakeTools, logprobs=True,
        include_reasoning=True,
    )
    c.feed(d("[r]Hi E", 1, [tok(1)]))
    c.feed(d("ND more", 2, [tok(2)]))
    c.finish(fin("stop", 2))
    assert c.stop_matched and c.finished
    assert not hasattr(c, "__dict__")
    assert "__slots__" in vars(ChoiceState)
    assert "__slots__" not in vars(ChoiceStateError)
