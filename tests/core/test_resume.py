"""core.upstream.resume: which failures are resumed, what continues a candidate, how the new stream
reads on; and each reader's progress (what a resume continues after)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sieproxy.core.errors import (
    ClientStalled,
    EngineAborted,
    EngineHTTPError,
    EngineMalformed,
    EngineStreamError,
    EngineTimeout,
    EngineTruncated,
    EngineUnreachable,
    GatewayError,
    InvalidRequest,
    UpstreamError,
)
from sieproxy.core.request.refusal import Refusal
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.core.upstream.openai import OpenAIReader
from sieproxy.core.upstream.openai_chat import OpenAIChatReader
from sieproxy.core.upstream.resume import (
    CAUSES,
    NotResumable,
    Progress,
    ResumedReader,
    break_cause,
    continuation,
    resumed_rid,
)
from sieproxy.core.upstream.retry import FirstTokenTimeout
from sieproxy.core.upstream.sglang import NativeReader


def refused(err: UpstreamError) -> UpstreamError:
    err.refusal = Refusal("content_filter")
    return err


# ---------------------------------------------------------------- break_cause


@pytest.mark.parametrize(
    ("err", "ended", "want"),
    [
        (EngineTruncated(), None, "cut"),
        (EngineMalformed(), None, "malformed"),
        (EngineStreamError("x"), None, "error_event"),
        (EngineAborted("x", engine_status=500), None, "error_event"),
        (EngineAborted("x", engine_status=503), None, "error_event"),
        (UpstreamError("x"), None, "cut"),
        (EngineTimeout("gap"), "timeout", "stall"),
        # not resumed
        (EngineTimeout("deadline"), "deadline", None),
        (EngineTimeout("deadline"), None, None),
        (FirstTokenTimeout(), "first_token", None),
        (FirstTokenTimeout(), None, None),
        (EngineAborted("x", engine_status=400), None, None),
        (refused(EngineStreamError("x")), None, None),
        (EngineHTTPError("x", engine_status=400), None, None),
        (EngineTruncated(), "client", None),
        (EngineTruncated(), "stop", None),
        (EngineTruncated(), "shutdown", None),
        (EngineTruncated(), "timeout", None),
        (ClientStalled(), None, None),
        (InvalidRequest("x"), None, None),
    ],
)
def test_break_cause(err: GatewayError, ended: str | None, want: str | None) -> None:
    assert break_cause(err, ended) == want
    assert want is None or want in CAUSES


def test_an_engine_error_event_with_a_4xx_code_is_a_refusal() -> None:
    err = EngineStreamError("x")
    err.status = 400
    assert break_cause(err, None) is None
    assert break_cause(EngineUnreachable("x"), None) == "cut"


# ---------------------------------------------------------------- continuation


@pytest.mark.parametrize(
    ("rid", "k", "want"),
    [("abc-0", 1, "abc.c1-0"), ("abc.r1-3", 2, "abc.r1.c2-3"), ("plain", 1, "plain.c1"),
     ("a-b-12", 1, "a-b.c1-12")],
)  # fmt: skip
def test_resumed_rid(rid: str, k: int, want: str) -> None:
    assert resumed_rid(rid, k) == want


def native(**sp: Any) -> dict[str, Any]:
    return {
        "text": "<u>hi</u><a>",
        "rid": "req-1",
        "stream": True,
        "sampling_params": {"temperature": 0.7, "sampling_seed": 42, "stop": ["X"], **sp},
        "return_logprob": True,
    }


def test_a_prompt_continues_with_the_output_and_a_smaller_budget() -> None:
    body = native(max_new_tokens=10, min_new_tokens=5)
    out = continuation(body, Progress(" one two", 2, 7), 1)
    assert out is not None
    assert out["text"] == "<u>hi</u><a> one two"
    assert out["rid"] == "req.c1-1"
    assert out["sampling_params"] == {
        "temperature": 0.7, "sampling_seed": 42, "stop": ["X"],
        "max_new_tokens": 8, "min_new_tokens": 3,
    }  # fmt: skip
    assert out["return_logprob"] is True and out["stream"] is True
    assert body["text"] == "<u>hi</u><a>" and body["rid"] == "req-1"  # not changed
    assert body["sampling_params"]["max_new_tokens"] == 10


def test_a_min_budget_that_was_met_is_dropped_and_no_cap_stays_none() -> None:
    out = continuation(native(min_new_tokens=2), Progress("abc", 3), 2)
    assert out is not None
    assert "min_new_tokens" not in out["sampling_params"]
    assert "max_new_tokens" not in out["sampling_params"]
    assert out["rid"] == "req.c2-1"


@pytest.mark.parametrize("used", [10, 11])
def test_a_budget_used_up_has_no_continuation(used: int) -> None:
    assert continuation(native(max_new_tokens=10), Progress("x", used), 1) is None
    chat = {"rid": "r-0", "chat": {"messages": [], "max_tokens": 10}}
    assert continuation(chat, Progress("x", used), 1) is None


def test_a_prompt_of_token_ids_cannot_be_continued() -> None:
    with pytest.raises(NotResumable, match="token ids"):
        continuation({"input_ids": [1, 2], "rid": "r-0"}, Progress("x", 1), 1)


def chat_body(**chat: Any) -> dict[str, Any]:
    return {
        "rid": "req-0",
        "stream": True,
        "chat": {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20,
            "seed": 7,
            "temperature": 0.2,
            **chat,
        },
    }


def test_a_chat_continues_with_an_assistant_prefill() -> None:
    body = chat_body(min_tokens=4)
    out = continuation(body, Progress("Hello, wor", 3, 9), 1)
    assert out is not None
    chat = out["chat"]
    assert chat["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello, wor"},
    ]
    assert chat["continue_final_message"] is True
    assert chat["add_generation_prompt"] is False
    assert chat["max_tokens"] == 17 and chat["min_tokens"] == 1
    assert chat["seed"] == 7 and chat["temperature"] == 0.2
    assert out["rid"] == "req.c1-0"
    assert len(body["chat"]["messages"]) == 1  # not changed
    out = continuation(body, Progress("Hello, world", 4), 2)
    assert out is not None and "min_tokens" not in out["chat"]


def test_a_chat_whose_engine_parsed_output_is_not_continued() -> None:
    with pytest.raises(NotResumable, match="reasoning or tool calls"):
        continuation(chat_body(), Progress("", 3, parsed=True), 1)


def test_progress_then() -> None:
    a = Progress("ab", 2, 5)
    b = Progress("cd", 3, 9, parsed=True)
    assert a.then(b) == Progress("abcd", 5, 5, True)
    assert Progress(prompt_tokens=0).then(b).prompt_tokens == 9
    assert not Progress().any and Progress(tokens=1).any and Progress("x").any


# ---------------------------------------------------------------- the readers' progress


def meta(tokens: int, prompt: int = 4, finish: Any = None) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": tokens, "finish_reason": finish}


def sse(*payloads: Any) -> bytes:
    return b"".join(
        b"data: " + (p if isinstance(p, str) else json.dumps(p)).encode() + b"\n\n"
        for p in payloads
    )


def test_native_cumulative_progress_is_the_text_emitted() -> None:
    r = NativeReader()
    r.feed(sse({"text": " a", "meta_info": meta(1)}, {"text": " a b", "meta_info": meta(2)}))
    assert r.progress() == Progress(" a b", 2, 4)
    r.feed(sse({"text": " a", "meta_info": meta(2)}))  # shorter: adds nothing
    assert r.progress() == Progress(" a b", 2, 4)


def test_native_incremental_progress_and_the_abort_quirk() -> None:
    r = NativeReader(incremental=True)
    r.feed(sse({"text": " a", "meta_info": meta(1)}, {"text": " b", "meta_info": meta(2)}))
    assert r.progress() == Progress(" a b", 2, 4)
    abort = {"type": "abort", "message": "x", "status_code": None}
    r.feed(sse({"text": " a b c", "meta_info": meta(3, finish=abort)}))
    assert r.progress().text == " a b c"


def completion(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"text": text, "index": 0, "finish_reason": finish}]}


def test_openai_progress_and_a_finish_held_for_the_usage() -> None:
    r = OpenAIReader()
    r.feed(sse(completion(" a"), completion(" b", "stop")))
    p = r.progress()
    assert (p.text, p.tokens) == (" a b", 2)
    assert p.finish is not None and p.finish.reason == "stop"
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    r.feed(sse(usage))
    assert r.progress().finish is None  # emitted: nothing held
    assert r.progress().prompt_tokens == 5


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_openai_chat_progress_marks_parsed_output() -> None:
    r = OpenAIChatReader()
    r.feed(sse(chat_chunk({"content": "Hi"}), chat_chunk({"content": " there"})))
    assert r.progress() == Progress("Hi there", 2, 0)
    r.feed(sse(chat_chunk({"reasoning_content": "hmm"})))
    assert r.progress().parsed


# ---------------------------------------------------------------- ResumedReader


def test_a_resumed_reader_continues_the_counts() -> None:
    base = Progress(" a b c", 3, 11)
    r = ResumedReader(NativeReader(), base)
    assert r.express(object()) is None
    stop = {"type": "stop", "matched": 2}
    events, err = r.feed(
        sse(
            {"text": " d", "meta_info": meta(1, prompt=14)},
            {"text": " d e", "meta_info": meta(2, prompt=14, finish=stop)},
            "[DONE]",
        )
    )
    assert err is None
    assert events == [
        CandidateDelta(" d", 4, [], 11),
        CandidateDelta(" e", 5, [], 11),
        CandidateFinish("stop", matched=2, prompt_tokens=11, completion_tokens=5),
    ]
    assert r.done and r.finished
    r.eof()
    assert r.progress() == Progress(" a b c d e", 5, 11)
    assert r.local_finish().completion_tokens == 5


def test_a_resumed_reader_without_the_first_prompt_count_estimates_it() -> None:
    r = ResumedReader(OpenAIReader(), Progress(" a b", 2, 0))
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
    events, err = r.feed(sse(completion(" c", "length"), usage))
    assert err is None
    assert events[-1] == CandidateFinish("length", prompt_tokens=7, completion_tokens=3)
    assert r.local_finish().prompt_tokens == 7


def test_a_resumed_reader_passes_errors_and_a_held_finish_on() -> None:
    r = ResumedReader(OpenAIReader(), Progress(" a", 1, 3))
    events, err = r.feed(sse(completion(" b", "stop")) + b"data: {bad\n\n")
    assert isinstance(err, EngineMalformed)
    assert events == [CandidateDelta(" b", 2, [], 3)]
    held = r.progress().finish
    assert held == CandidateFinish("stop", prompt_tokens=3, completion_tokens=2)
    with pytest.raises(EngineTruncated):
        ResumedReader(OpenAIReader(), Progress()).eof()
