from __future__ import annotations

import gc
import json
import random
from typing import Any

import pytest

from sieproxy.core.errors import EngineTimeout, InvalidRequest
from sieproxy.core.request.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from sieproxy.core.request.valid import ValidChat, ValidCompletion
from sieproxy.core.shaping.events import (
    CandidateDelta,
    CandidateFinish,
    ChoiceDelta,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
)
from sieproxy.core.shaping.merger import (
    ChatCollector,
    ChatStream,
    CompletionCollector,
    CompletionStream,
    MergerError,
    StreamPhase,
)
from sieproxy.core.upstream.sglang import GenerateReader
from sieproxy.core.upstream.sse import SSEDecoder

# Tiny stand-ins for the chat-semantics parsers (single-character tags, so no hold-back):
# text inside [ ... ] is reasoning; text inside { ... } is one call to `fn`.
from .fakes import FakeReasoning, FakeTools

CREATED = 1_700_000_000
NO_CACHE = {"prompt_tokens_details": {"cached_tokens": 0}}


def chat(
    n: int = 1,
    *,
    best_of: int | None = None,
    stream: bool = True,
    include_usage: bool = False,
    stop: list[str] | None = None,
    logprobs: bool = False,
    include_reasoning: bool = False,
) -> ValidChat:
    req = ChatCompletionRequest(model="m", messages=[ChatMessage(role="user", content="hi")])
    return ValidChat(
        req=req,
        model="m",
        n=n,
        candidates=best_of or n,
        max_tokens=100,
        stream=stream,
        include_usage=include_usage,
        stop=stop or [],
        logprobs=logprobs,
        top_logprobs=0,
        include_reasoning=include_reasoning,
        best_of=best_of,
    )


def completion(stream: bool = True, stop: list[str] | None = None) -> ValidCompletion:
    req = CompletionRequest(model="m", prompt="p")
    return ValidCompletion(
        req=req, model="m", prompt="p", max_tokens=16, stream=stream, stop=stop or []
    )


def decode(frames: bytes) -> list[Any]:
    dec = SSEDecoder()
    out = dec.feed(frames)
    assert dec.close() == [] and not dec.discarded
    return [p if p == "[DONE]" else json.loads(p) for p in out]


def engine_payloads(text: str, rng: random.Random, prompt: int = 9) -> list[str]:
    """A cumulative-mode /generate stream for `text`, one token per character, random chunks."""
    payloads = []
    pos = 0
    while pos < len(text):
        pos = min(len(text), pos + rng.randint(1, 4))
        meta: dict[str, Any] = {
            "id": "r",
            "prompt_tokens": prompt,
            "completion_tokens": pos,
            "finish_reason": None,
            "output_token_logprobs": [[-0.01 * (i + 1), i, text[i]] for i in range(pos)],
        }
        if pos == len(text):
            meta["finish_reason"] = {"type": "length", "length": pos}
        payloads.append(json.dumps({"text": text[:pos], "meta_info": meta}))
    payloads.append("[DONE]")
    return payloads


def run_stream(
    stream: ChatStream | CompletionStream, texts: list[str], seed: int
) -> tuple[bytes, dict[int, int]]:
    """Interleave every candidate's engine stream at random, as the shell would."""
    rng = random.Random(seed)
    readers = [GenerateReader() for _ in texts]
    queues = [engine_payloads(t, rng) for t in texts]
    out = bytearray(stream.start())
    live = [i for i in range(len(texts))]
    while live:
        i = rng.choice(live)
        payload = queues[i].pop(0)
        delta, fin = readers[i].feed(payload)
        if delta is not None:
            out += stream.on_delta(i, delta)
        if fin is not None:
            out += stream.on_finish(i, fin)
        if not queues[i]:
            readers[i].eof()
            live.remove(i)
    out += stream.end()
    return bytes(out), {i: len(t) for i, t in enumerate(texts)}


def check_order_contract(
    events: list[Any], n: int, include_usage: bool, obj: str = "chat.completion.chunk"
) -> dict[int, list[dict[str, Any]]]:
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    chunks = events[:-1]
    for c in chunks:
        assert c["id"] == "chatcmpl-req" and c["object"] == obj
        assert c["created"] == CREATED and c["model"] == "m"
        if include_usage:
            assert "usage" in c
        else:
            assert "usage" not in c
    if include_usage:
        usage_chunk = chunks.pop()
        assert usage_chunk["choices"] == [] and usage_chunk["usage"] is not None
        for c in chunks:
            assert c["usage"] is None
    # 1. role chunks first, in index order
    for i in range(n):
        (ch,) = chunks[i]["choices"]
        assert ch == {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    per: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n)}
    closed: set[int] = set()
    for c in chunks[n:]:
        (ch,) = c["choices"]
        i = ch["index"]
        assert i not in closed, "nothing of a choice after its closure"
        assert "role" not in ch["delta"]
        if ch["finish_reason"] is not None:
            assert ch["delta"] == {}
            closed.add(i)
        per[i].append(ch)
    assert closed == set(range(n)), "exactly one closure per choice"
    return per


@pytest.mark.parametrize("n", [1, 4, 16, 128])
@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_order_contract(n: int, include_usage: bool) -> None:
    valid = chat(n, include_usage=include_usage, logprobs=True)
    stream = ChatStream(valid, response_id="chatcmpl-req", model="m", created=CREATED)
    texts = [f"choice {i}: h\u00e9llo\u2028w\u00f6rld \U0001f600 {'x' * (i % 7)}" for i in range(n)]
    frames, lengths = run_stream(stream, texts, seed=n)
    events = decode(frames)
    per = check_order_contract(events, n, include_usage)
    for i in range(n):
        content = "".join(ch["delta"].get("content", "") for ch in per[i])
        assert content == texts[i]
        tokens = [e["token"] for ch in per[i] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        assert "".join(tokens) == texts[i]
        for ch in per[i]:
            if ch["logprobs"]:
                for e in ch["logprobs"]["content"]:
                    assert e["bytes"] == list(e["token"].encode())
                    assert e["top_logprobs"] == []
        assert per[i][-1]["finish_reason"] == "length"
    if include_usage:
        usage = events[-2]["usage"]
        completion = sum(lengths.values())
        assert usage == {
            "prompt_tokens": 9,
            "completion_tokens": completion,
            "total_tokens": 9 + completion,
            **NO_CACHE,
        }
    assert stream.phase is StreamPhase.CLOSED


def test_chat_stream_stop_string_and_stopped_flag() -> None:
    stream = ChatStream(
        chat(2, stop=["STOP"]), response_id="chatcmpl-req", model="m", created=CREATED
    )
    out = bytearray(stream.start())
    out += stream.on_delta(0, CandidateDelta("abcST", 2))
    assert stream.ends == []
    out += stream.on_delta(0, CandidateDelta("OPxyz", 4))
    assert stream.ends == [(0, "stop")] and not stream.finished(0)  # the decision, once
    out += stream.on_delta(0, CandidateDelta("late", 5))  # in flight: ignored
    assert stream.ends == [(0, "stop")]
    out += stream.on_delta(1, CandidateDelta("S", 1))
    out += stream.on_finish(1, CandidateFinish("stop", "</s>", 3, 1))
    out += stream.on_finish(0, CandidateFinish("abort", None, 3, 6))
    out += stream.end()
    per = check_order_contract(decode(bytes(out)), 2, False)
    assert "".join(ch["delta"].get("content", "") for ch in per[0]) == "abc"
    assert per[0][-1]["finish_reason"] == "stop"
    assert "".join(ch["delta"].get("content", "") for ch in per[1]) == "S"


def test_chat_stream_reasoning_and_tools() -> None:
    valid = chat(1, include_reasoning=True, include_usage=True)
    stream = ChatStream(
        valid,
        response_id="chatcmpl-req",
        model="m",
        created=CREATED,
        reasoning_parser=FakeReasoning,
        tool_parser=FakeTools,
    )
    out = bytearray(stream.start())
    out += stream.on_delta(0, CandidateDelta("[think]ok {ab", 5))
    out += stream.on_delta(0, CandidateDelta("c}", 6))
    out += stream.on_finish(0, CandidateFinish("stop", None, 4, 6, 0, 3))
    out += stream.end()
    events = decode(bytes(out))
    per = check_order_contract(events, 1, True)
    deltas = [ch["delta"] for ch in per[0]]
    assert deltas[0] == {"reasoning_content": "think"}
    assert deltas[1] == {"content": "ok "}
    # fragments of one call arriving together merge into one entry (one per index, as OpenAI)
    assert deltas[2] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_0",
                "type": "function",
                "function": {"name": "fn", "arguments": "ab"},
            },
        ]
    }
    assert deltas[3] == {"tool_calls": [{"index": 0, "function": {"arguments": "c"}}]}
    assert per[0][-1]["finish_reason"] == "tool_calls"
    assert events[-2]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 6,
        "total_tokens": 10,
        **NO_CACHE,
    }


def test_chat_stream_hidden_reasoning() -> None:
    stream = ChatStream(
        chat(1, logprobs=True),
        response_id="chatcmpl-req",
        model="m",
        created=CREATED,
        reasoning_parser=FakeReasoning,
    )
    out = bytearray(stream.start())
    out += stream.on_delta(0, CandidateDelta("[secret]", 3, [TokenLogprob("[secret]", 1, -1.0)]))
    out += stream.on_delta(0, CandidateDelta("Hi", 4, [TokenLogprob("Hi", 2, -0.5)]))
    out += stream.on_finish(0, CandidateFinish("stop", None, 4, 4))
    out += stream.end()
    text = out.decode()
    assert "secret" not in text
    per = check_order_contract(decode(bytes(out)), 1, False)
    assert per[0][0]["delta"] == {"content": "Hi"}
    assert [e["token"] for e in per[0][0]["logprobs"]["content"]] == ["Hi"]


def test_logprobs_only_delta_rides_on_empty_content_chunk() -> None:
    stream = ChatStream(
        chat(1, logprobs=True, stop=["zz"]), response_id="chatcmpl-req", model="m", created=CREATED
    )
    out = bytearray(stream.start())
    assert stream.on_delta(0, CandidateDelta("z", 1, [TokenLogprob("z", 1, -1.0)])) == b""
    out += stream.on_finish(0, CandidateFinish("length", None, 1, 1))
    out += stream.end()
    per = check_order_contract(decode(bytes(out)), 1, False)
    assert per[0][0]["delta"] == {"content": "z"}
    assert per[0][0]["logprobs"]["content"][0]["token"] == "z"


def test_chat_stream_error_after_start() -> None:
    stream = ChatStream(
        chat(2, include_usage=True), response_id="chatcmpl-req", model="m", created=CREATED
    )
    out = bytearray(stream.start())
    out += stream.on_delta(0, CandidateDelta("a", 1))
    out += stream.on_finish(0, CandidateFinish("stop", None, 1, 1))
    out += stream.on_error(EngineTimeout("The engine stopped producing tokens."))
    events = decode(bytes(out))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert events[-2] == {
        "error": {
            "message": "The engine stopped producing tokens.",
            "type": "server_error",
            "param": None,
            "code": "upstream_timeout",
        }
    }
    assert stream.phase is StreamPhase.CLOSED
    with pytest.raises(MergerError):
        stream.on_delta(1, CandidateDelta("b", 1))
    with pytest.raises(MergerError):
        stream.end()


def test_chat_stream_illegal_orders() -> None:
    s = ChatStream(chat(2), response_id="chatcmpl-req", model="m", created=CREATED)
    with pytest.raises(MergerError):
        s.on_delta(0, CandidateDelta("a", 1))
    assert s.phase is StreamPhase.CLOSED

    s = ChatStream(chat(2), response_id="chatcmpl-req", model="m", created=CREATED)
    s.start()
    with pytest.raises(MergerError):
        s.start()

    s = ChatStream(chat(2), response_id="chatcmpl-req", model="m", created=CREATED)
    s.start()
    s.on_finish(0, CandidateFinish("stop"))
    with pytest.raises(MergerError):  # choice 1 never finished
        s.end()

    s = ChatStream(chat(2), response_id="chatcmpl-req", model="m", created=CREATED)
    s.start()
    s.on_finish(0, CandidateFinish("stop"))
    with pytest.raises(MergerError):  # second closure of the same choice
        s.on_finish(0, CandidateFinish("stop"))

    s = ChatStream(chat(2), response_id="chatcmpl-req", model="m", created=CREATED)
    s.start()
    with pytest.raises(MergerError):
        s.on_delta(2, CandidateDelta("a", 1))

    with pytest.raises(MergerError):
        ChatStream(chat(2, best_of=3), response_id="x", model="m", created=CREATED)


def test_error_before_start() -> None:
    s = ChatStream(chat(1), response_id="chatcmpl-req", model="m", created=CREATED)
    events = decode(s.on_error(EngineTimeout("t")))
    assert events[-1] == "[DONE]" and "error" in events[0]


# ---------------------------------------------------------------- non-streaming chat


def feed_all(
    coll: ChatCollector, parts: dict[int, list[tuple[str, float]]], reason: str = "stop"
) -> None:
    """Each candidate gets one token per part, with the given logprob."""
    for i, toks in parts.items():
        for k, (text, lp) in enumerate(toks):
            coll.on_delta(i, CandidateDelta(text, k + 1, [TokenLogprob(text, k, lp)]))
        coll.on_finish(i, CandidateFinish(reason, None, 11, len(toks), 0, 0))


def test_chat_collector_body() -> None:
    valid = chat(2, stream=False, logprobs=True, include_reasoning=True)
    coll = ChatCollector(
        valid,
        response_id="chatcmpl-req",
        model="m",
        created=CREATED,
        reasoning_parser=FakeReasoning,
        tool_parser=FakeTools,
    )
    feed_all(
        coll,
        {
            0: [("[why]", -0.1), ("Hel", -0.2), ("lo", -0.3)],
            1: [("{", -0.1), ("x", -0.1), ("}", -0.1)],
        },
    )
    body = json.loads(coll.result())
    assert body["id"] == "chatcmpl-req" and body["object"] == "chat.completion"
    assert body["created"] == CREATED and body["model"] == "m"
    c0, c1 = body["choices"]
    assert c0["index"] == 0 and c0["finish_reason"] == "stop"
    assert c0["message"] == {"role": "assistant", "content": "Hello", "reasoning_content": "why"}
    assert [e["token"] for e in c0["logprobs"]["content"]] == ["[why]", "Hel", "lo"]
    assert c1["finish_reason"] == "tool_calls"
    assert c1["message"] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "fn", "arguments": "x"}}
        ],
    }
    # prompt counted once, completion summed
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 6,
        "total_tokens": 17,
        **NO_CACHE,
    }


def test_chat_collector_without_logprobs_or_reasoning() -> None:
    coll = ChatCollector(
        chat(1, stream=False),
        response_id="chatcmpl-req",
        model="m",
        created=CREATED,
        reasoning_parser=FakeReasoning,
    )
    feed_all(coll, {0: [("[hidden]", -0.1), ("ok", -0.2)]}, reason="length")
    body = json.loads(coll.result())
    (c0,) = body["choices"]
    assert c0 == {
        "index": 0,
        "message": {"role": "assistant", "content": "ok"},
        "logprobs": None,
        "finish_reason": "length",
    }


def test_chat_collector_result_before_finish() -> None:
    coll = ChatCollector(chat(2, stream=False), response_id="x", model="m", created=CREATED)
    coll.on_finish(0, CandidateFinish("stop"))
    with pytest.raises(MergerError):
        coll.result()


def test_best_of_ranks_reindexes_and_strips_logprobs() -> None:
    valid = chat(2, best_of=4, stream=False)
    coll = ChatCollector(valid, response_id="chatcmpl-req", model="m", created=CREATED)
    feed_all(
        coll,
        {
            0: [("a", -1.0), ("a", -1.0)],  # -2.0
            1: [("b", -0.5)],  # -0.5  (best)
            2: [("c", -0.25), ("c", -1.75)],  # -2.0  (tie with 0; 0 wins)
            3: [("d", -0.1), ("d", -0.2)],  # -0.3  (second... actually best)
        },
    )
    body = json.loads(coll.result())
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["dd", "b"]
    assert all(c["logprobs"] is None for c in body["choices"])
    # completion tokens of the returned choices only
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 3,
        "total_tokens": 14,
        **NO_CACHE,
    }


def test_best_of_with_logprobs_keeps_them() -> None:
    valid = chat(1, best_of=2, stream=False, logprobs=True)
    coll = ChatCollector(valid, response_id="chatcmpl-req", model="m", created=CREATED)
    feed_all(coll, {0: [("a", -1.0)], 1: [("b", -0.5)]})
    (c,) = json.loads(coll.result())["choices"]
    assert c["message"]["content"] == "b"
    assert c["logprobs"]["content"][0]["logprob"] == -0.5


def test_best_of_without_engine_logprobs_is_a_400_naming_best_of() -> None:
    """A candidate that finishes with tokens and not one logprob (an engine that accepts
    logprobs and returns none) cannot be ranked; a zero-token candidate needs none."""
    valid = chat(1, best_of=3, stream=False)
    coll = ChatCollector(valid, response_id="chatcmpl-req", model="m", created=CREATED)
    coll.on_delta(0, CandidateDelta("a", 1, [TokenLogprob("a", 1, -1.0)]))
    coll.on_finish(0, CandidateFinish("stop", None, 3, 1))
    coll.on_finish(1, CandidateFinish("stop", None, 3, 0))  # no token: nothing to score
    coll.on_delta(2, CandidateDelta("c", 1, []))
    with pytest.raises(InvalidRequest) as info:
        coll.on_finish(2, CandidateFinish("length", None, 3, 1))
    assert info.value.param == "best_of" and info.value.status == 400
    assert "returns no logprobs" in str(info.value)
    # Without best_of there is nothing to rank: the same candidate is answered.
    plain = ChatCollector(chat(1, stream=False), response_id="x", model="m", created=CREATED)
    plain.on_delta(0, CandidateDelta("c", 1, []))
    plain.on_finish(0, CandidateFinish("length", None, 3, 1))
    assert json.loads(plain.result())["choices"][0]["message"]["content"] == "c"


def test_best_of_a_loser_ended_before_its_output_arrived_needs_no_logprob() -> None:
    """Regression (the fault matrix under load): a candidate named a best_of loser before any
    of its output reached the collector (a finished candidate already scores 0.0, which it can
    only tie, on a higher index) gets the finish its engine sent while the loss was decided,
    its deltas dropped; it counts tokens, but nothing of it was shown or ranked, so it is no
    sign of an engine without logprobs (no 400)."""
    valid = chat(1, best_of=2, stream=False)
    coll = ChatCollector(valid, response_id="x", model="m", created=CREATED)
    coll.on_delta(0, CandidateDelta("a", 1, [TokenLogprob("a", 1, 0.0)]))
    coll.on_finish(0, CandidateFinish("stop", None, 3, 1))
    assert coll.ends == [(1, "best_of")]
    coll.on_finish(1, CandidateFinish("length", None, 3, 7))  # 7 tokens, none shown
    assert json.loads(coll.result())["choices"][0]["message"]["content"] == "a"


def lost(coll: ChatCollector) -> list[int]:
    """The best_of losers the collector announced since the last call (as the relay takes
    them from ``ends``)."""
    out = [j for j, cause in coll.ends if cause == "best_of"]
    coll.ends.clear()
    return out


def test_best_of_losers_and_tie_on_index() -> None:
    valid = chat(1, best_of=3, stream=False)
    coll = ChatCollector(valid, response_id="chatcmpl-req", model="m", created=CREATED)
    coll.on_delta(0, CandidateDelta("a", 1, [TokenLogprob("a", 1, -1.0)]))
    coll.on_delta(1, CandidateDelta("b", 1, [TokenLogprob("b", 1, -0.2)]))
    coll.on_delta(2, CandidateDelta("c", 1, [TokenLogprob("c", 1, -0.5)]))
    assert lost(coll) == []
    coll.on_finish(2, CandidateFinish("stop", None, 3, 1))
    assert lost(coll) == [0]  # -1.0 can never beat a finished -0.5
    assert lost(coll) == [] and coll.losers() == []  # reported once
    coll.on_finish(0, CandidateFinish("abort", None, 3, 1))
    coll.on_delta(1, CandidateDelta("b", 2, [TokenLogprob("b", 2, -0.3)]))
    assert lost(coll) == []  # -0.5 ties the finished -0.5, and index 1 < 2 wins a tie
    coll.on_delta(1, CandidateDelta("b", 3, [TokenLogprob("b", 3, -0.01)]))
    assert lost(coll) == [1]
    coll.on_finish(1, CandidateFinish("abort", None, 3, 2))
    (c,) = json.loads(coll.result())["choices"]
    assert c["message"]["content"] == "c"


@pytest.mark.parametrize("n", [1, 5, 128])
@pytest.mark.parametrize("seed", range(3))
def test_best_of_128_every_candidate_finishing_in_one_step(n: int, seed: int) -> None:
    """best_of at its bound (128), 4-token candidates, driven as the relay drives it: the
    losers are announced after every event; a named loser whose engine finish is already in
    flight gets that finish, the others a local abort finish (the relay's ``_settle``) after
    whatever of theirs was already queued. Every candidate's last token and finish arrive in
    the same step, in a random order. The body returns the top ``n``, never a named loser."""
    rng = random.Random(seed)
    valid = chat(n, best_of=128, stream=False)
    coll = ChatCollector(valid, response_id="x", model="m", created=CREATED)
    score = [-((k * 37) % 128) / 64 for k in range(128)]  # per token; distinct per candidate
    queue: list[tuple[int, CandidateDelta | CandidateFinish]] = []
    for t in range(3):  # the first three tokens, interleaved
        step = [
            (k, CandidateDelta(f"c{k}t{t}", t + 1, [TokenLogprob("x", 1, score[k])]))
            for k in range(128)
        ]
        rng.shuffle(step)
        queue += step
    last: list[tuple[int, CandidateDelta | CandidateFinish]] = []
    for k in rng.sample(range(128), 128):  # the last token and the finish: one step
        last.append((k, CandidateDelta(f"c{k}t3", 4, [TokenLogprob("x", 1, score[k])])))
        last.append((k, CandidateFinish("length", None, 3, 4)))
    queue += last
    named: set[int] = set()
    while queue:
        k, ev = queue.pop(0)
        if isinstance(ev, CandidateFinish):
            coll.on_finish(k, ev)
        else:
            coll.on_delta(k, ev)
        for j in lost(coll):
            assert j not in named and not coll.finished(j)
            named.add(j)
            # Its task is cancelled: what it queued already still arrives; if the engine's
            # finish was among it, nothing more, else a local finish after it.
            if not any(i == j and isinstance(e, CandidateFinish) for i, e in queue):
                queue = [(i, e) for i, e in queue if i != j]
                queue.append((j, CandidateFinish("abort", None, 3, 4)))
    body = json.loads(coll.result())
    # best_of = n keeps the candidates' order (nothing to choose)
    top = sorted(range(128), key=lambda k: (-score[k], k))[:n] if n < 128 else list(range(128))
    assert not named & set(top)
    assert [c["index"] for c in body["choices"]] == list(range(n))
    assert [c["message"]["content"] for c in body["choices"]] == [
        "".join(f"c{k}t{t}" for t in range(4)) for k in top
    ]
    assert len(named) <= 128 - n


def test_best_of_equal_n_keeps_order() -> None:
    valid = chat(2, best_of=2, stream=False)
    coll = ChatCollector(valid, response_id="x", model="m", created=CREATED)
    feed_all(coll, {0: [("a", -5.0)], 1: [("b", -0.5)]})
    assert [c["message"]["content"] for c in json.loads(coll.result())["choices"]] == ["a", "b"]
    assert lost(coll) == []


# ---------------------------------------------------------------- legacy completions


def test_completion_stream() -> None:
    s = CompletionStream(
        completion(stop=["\n\n"]), response_id="cmpl-req", model="m", created=CREATED
    )
    out = bytearray(s.start())
    out += s.on_delta(0, CandidateDelta("Hello\n", 2))
    out += s.on_delta(0, CandidateDelta(" there", 3))
    out += s.on_delta(0, CandidateDelta("\n", 4))
    out += s.on_finish(0, CandidateFinish("length", None, 5, 4))
    out += s.end()
    events = decode(bytes(out))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    for c in chunks:
        assert c["id"] == "cmpl-req" and c["object"] == "text_completion"
        assert "usage" not in c
        (ch,) = c["choices"]
        assert "logprobs" not in ch and ch["index"] == 0
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello\n there\n"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def test_completion_stream_stop() -> None:
    s = CompletionStream(
        completion(stop=["##"]), response_id="cmpl-req", model="m", created=CREATED
    )
    out = bytearray(s.start())
    out += s.on_delta(0, CandidateDelta("ab#", 2))
    out += s.on_delta(0, CandidateDelta("#cd", 3))
    assert s.ends == [(0, "stop")]
    out += s.on_finish(0, CandidateFinish("abort", None, 5, 4))
    out += s.end()
    chunks = decode(bytes(out))[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_stream_random_interleaving() -> None:
    for seed in range(20):
        s = CompletionStream(completion(), response_id="cmpl-req", model="m", created=CREATED)
        frames, _ = run_stream(s, ["some text \u2028 here"], seed)
        chunks = decode(frames)[:-1]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "some text \u2028 here"


def test_completion_collector() -> None:
    c = CompletionCollector(
        completion(stream=False), response_id="cmpl-req", model="m", created=CREATED
    )
    c.on_delta(0, CandidateDelta("Hi", 1))
    c.on_finish(0, CandidateFinish("stop", "</s>", 5, 1))
    assert json.loads(c.result()) == {
        "id": "cmpl-req",
        "object": "text_completion",
        "created": CREATED,
        "model": "m",
        "choices": [{"index": 0, "text": "Hi", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, **NO_CACHE},
    }


def test_tool_call_without_id_gets_one() -> None:
    class NoIdTools(FakeTools):
        def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
            content, deltas = super().feed(text)
            for d in deltas:
                d.id = None
            return content, deltas

    coll = ChatCollector(
        chat(1, stream=False), response_id="x", model="m", created=CREATED, tool_parser=NoIdTools
    )
    coll.on_delta(0, CandidateDelta("{a}", 3))
    coll.on_finish(0, CandidateFinish("stop", None, 1, 3))
    (c,) = json.loads(coll.result())["choices"]
    assert c["message"]["tool_calls"][0]["id"] == "call_0_0"


_CHARS = [0x22, 0x5C, 0x0A, 0x00, 0x41, 0xE9, 0x6F22, 0x1F642, 0x2028]
_RNG = random.Random(6)
_TEXTS = ["", "a", " tok", '"', "\\", "\n\t\r", "\x00\x1f\x7f", "é", "漢字", "🙂", '"},{'] + [
    "".join(chr(_RNG.choice(_CHARS)) for _ in range(_RNG.randint(1, 8))) for _ in range(40)
]


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_token_of_text_is_framed_as_its_choice_struct_would_be(include_usage: bool) -> None:
    """The pre-encoded chunk of one token of text (``_text_chunk``) is, byte for byte, the
    chunk of its choice Struct, for every choice index, in chat and legacy completion streams,
    and ``on_delta`` sends it for a plain delta."""
    streams = [
        ChatStream(chat(4, include_usage=include_usage), response_id="r", model="m", created=1),
        CompletionStream(completion(), response_id='r"', model="m\u00e9", created=CREATED),
    ]
    for s in streams:
        s.start()
        indices = range(len(s.choices))
        for text in _TEXTS:
            for i in indices:
                expected = bytearray()
                s._chunk(expected, s._text_choice(i, text))
                assert s._text_chunk(i, text) == bytes(expected)
                if text:
                    assert s.on_delta(i, CandidateDelta(text, 1)) == bytes(expected)
        for i in indices:  # the frames decode to the documented chunk
            (frame,) = decode(s.on_delta(i, CandidateDelta('x"\n', 2)))
            choice = frame["choices"][0]
            assert choice["index"] == i
            assert choice.get("text", choice.get("delta", {}).get("content")) == 'x"\n'


def test_the_events_of_a_token_are_not_tracked_by_the_cycle_collector() -> None:
    """Every relayed token creates events; they are plain data (no cycle can run through
    them), so the collector does not track them (``gc=False``) — and a delta's lists, which
    it does track, still hold what was put in them."""
    lp = TokenLogprob("a", 1, -0.5, [TopLogprob("a", 1, -0.5)])
    events = [
        CandidateDelta("a", 1, [lp]),
        CandidateFinish("stop"),
        ChoiceDelta("a", tool_calls=[ToolCallDelta(0, "id", "fn", "{}")], logprobs=[lp]),
        lp,
        lp.top[0],
    ]
    assert [gc.is_tracked(e) for e in events] == [False] * len(events)
    assert events[2].logprobs[0].top[0].logprob == -0.5


def test_cached_tokens_in_usage_counted_once() -> None:
    """The engine's cached_tokens reach usage.prompt_tokens_details: with n > 1 the prompt is
    counted once, and so are its cached tokens (the least any returned candidate found)."""
    stream = ChatStream(
        chat(2, include_usage=True), response_id="chatcmpl-req", model="m", created=CREATED
    )
    out = bytearray(stream.start())
    out += stream.on_delta(0, CandidateDelta("a", 1))
    out += stream.on_delta(1, CandidateDelta("b", 1))
    out += stream.on_finish(0, CandidateFinish("length", None, 40, 1, cached_tokens=32))
    out += stream.on_finish(1, CandidateFinish("length", None, 40, 1, cached_tokens=16))
    out += stream.end()
    usage = decode(bytes(out))[-2]["usage"]
    assert usage["prompt_tokens"] == 40 and usage["prompt_tokens_details"] == {"cached_tokens": 16}
    c = CompletionCollector(
        completion(stream=False), response_id="cmpl-req", model="m", created=CREATED
    )
    c.on_delta(0, CandidateDelta("Hi", 1))
    c.on_finish(0, CandidateFinish("stop", None, 20, 1, cached_tokens=16))
    body = json.loads(c.result())
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


def test_continuous_usage_puts_the_running_usage_on_every_chunk() -> None:
    valid = chat(2, include_usage=True)
    valid.continuous_usage = True
    stream = ChatStream(valid, response_id="chatcmpl-1", model="m", created=CREATED)
    out = bytearray(stream.start())
    out += stream.on_delta(0, CandidateDelta("ab", 2, prompt_tokens=5))
    out += stream.on_delta(1, CandidateDelta("c", 1, prompt_tokens=5))
    out += stream.on_finish(0, CandidateFinish("stop", prompt_tokens=5, completion_tokens=2))
    out += stream.on_delta(1, CandidateDelta("d", 3, prompt_tokens=5))
    out += stream.on_finish(1, CandidateFinish("length", prompt_tokens=5, completion_tokens=3))
    out += stream.end()
    events = decode(bytes(out))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" in c and c["usage"] is not None for c in chunks)
    running = [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks]
    # Role chunks (nothing yet), then 2, 2+1, closure 0, 2+3, closure 1, the final usage.
    assert running == [(0, 0), (0, 0), (5, 2), (5, 3), (5, 3), (5, 5), (5, 5), (5, 5)]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[2:4]] == ["ab", "c"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 10


def test_continuous_usage_on_completions_and_no_usage_chunk_without_include_usage() -> None:
    req = CompletionRequest(model="m", prompt="p")
    valid = ValidCompletion(
        req=req, model="m", prompt="p", max_tokens=16, stream=True, stop=[],
        continuous_usage=True,
    )  # fmt: skip
    stream = CompletionStream(valid, response_id="cmpl-1", model="m", created=CREATED)
    out = bytearray(stream.start())
    out += stream.on_delta(0, CandidateDelta("x", 1, prompt_tokens=3))
    out += stream.on_finish(0, CandidateFinish("length", prompt_tokens=3, completion_tokens=1))
    out += stream.end()
    events = decode(bytes(out))
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 1]
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", ""]
    assert events[-1] == "[DONE]"


def test_completions_usage_chunk_with_include_usage() -> None:
    req = CompletionRequest(model="m", prompt="p")
    valid = ValidCompletion(
        req=req, model="m", prompt="p", max_tokens=16, stream=True, stop=[], include_usage=True
    )
    stream = CompletionStream(valid, response_id="cmpl-1", model="m", created=CREATED)
    out = bytearray(stream.start())
    out += stream.on_delta(0, CandidateDelta("x", 1, prompt_tokens=3))
    out += stream.on_finish(0, CandidateFinish("length", prompt_tokens=3, completion_tokens=1))
    out += stream.end()
    events = decode(bytes(out))
    assert events[0]["usage"] is None and events[-2]["choices"] == []
    assert events[-2]["usage"]["total_tokens"] == 4
