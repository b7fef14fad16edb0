from __future__ import annotations

import json
from typing import Any

import pytest

from sieproxy.core.errors import (
    EngineAborted,
    EngineMalformed,
    EngineStreamError,
    EngineTruncated,
)
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.core.upstream.sglang import NEG_INF_LOGPROB, GenerateReader, parse_generate_response


def meta(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "rid-0",
        "finish_reason": None,
        "prompt_tokens": 5,
        "completion_tokens": 0,
        "cached_tokens": 2,
        "reasoning_tokens": 0,
        "weight_version": "default",
    }
    base.update(kw)
    return base


def chunk(text: str, **kw: Any) -> str:
    return json.dumps({"text": text, "output_ids": [], "meta_info": meta(**kw)})


def lp(i: int) -> list[Any]:
    return [-0.1 * (i + 1), 100 + i, f"t{i}"]


def top(i: int) -> list[list[Any]]:
    return [[-0.1 * (i + 1), 100 + i, f"t{i}"], [-5.0, 7, "alt"]]


def collect(reader: GenerateReader, payloads: list[str]) -> tuple[str, list[Any], Any]:
    text = ""
    lps: list[Any] = []
    finish = None
    for p in payloads:
        d, f = reader.feed(p)
        if d is not None:
            text += d.text
            lps += d.logprobs
        if f is not None:
            finish = f
    reader.eof()
    return text, lps, finish


def test_cumulative_text_and_logprobs() -> None:
    payloads = [
        chunk(
            "He",
            completion_tokens=1,
            output_token_logprobs=[lp(0)],
            output_top_logprobs=[top(0)],
            output_token_logprobs_length=1,
        ),
        chunk(
            "Hello",
            completion_tokens=3,
            output_token_logprobs=[lp(0), lp(1), lp(2)],
            output_top_logprobs=[top(0), None, top(2)],
            output_token_logprobs_length=3,
        ),
        chunk(
            "Hello wo",
            completion_tokens=4,
            output_token_logprobs=[lp(0), lp(1), lp(2), lp(3)],
            output_top_logprobs=[top(0), None, top(2), top(3)],
        ),  # no length key
        chunk(
            "Hello world",
            completion_tokens=5,
            output_token_logprobs=[lp(i) for i in range(5)],
            output_top_logprobs=[top(i) for i in range(5)],
            output_token_logprobs_length=5,
            finish_reason={"type": "stop", "matched": 2},
        ),
        "[DONE]",
    ]
    r = GenerateReader()
    text, lps, fin = collect(r, payloads)
    assert text == "Hello world"
    assert [t.token_id for t in lps] == [100, 101, 102, 103, 104]
    assert [t.token for t in lps] == ["t0", "t1", "t2", "t3", "t4"]
    assert lps[1].top == []
    assert [x.token for x in lps[2].top] == ["t2", "alt"]
    assert fin == CandidateFinish("stop", 2, 5, 5, 2, 0)
    assert r.done


def test_incremental_text_and_logprobs() -> None:
    payloads = [
        chunk(
            "He", completion_tokens=1, output_token_logprobs=[lp(0)], output_token_logprobs_length=1
        ),
        chunk(
            "llo",
            completion_tokens=3,
            output_token_logprobs=[lp(1), lp(2)],
            output_token_logprobs_length=3,
        ),
        chunk(" wo", completion_tokens=4, output_token_logprobs=[lp(3)]),  # no length key
        chunk(
            "rld",
            completion_tokens=5,
            output_token_logprobs=[lp(4)],
            output_token_logprobs_length=5,
            finish_reason={"type": "length", "length": 5},
        ),
        "[DONE]",
    ]
    text, lps, fin = collect(GenerateReader(incremental=True), payloads)
    assert text == "Hello world"
    assert [t.token_id for t in lps] == [100, 101, 102, 103, 104]
    assert fin.reason == "length" and fin.matched is None and fin.completion_tokens == 5


def test_incremental_abort_chunk_carries_full_text() -> None:
    payloads = [
        chunk(
            "He", completion_tokens=1, output_token_logprobs=[lp(0)], output_token_logprobs_length=1
        ),
        chunk(
            "llo",
            completion_tokens=2,
            output_token_logprobs=[lp(1)],
            output_token_logprobs_length=2,
        ),
        # the abort chunk re-sends everything (text and, here, all logprobs)
        chunk(
            "Hello!",
            completion_tokens=3,
            output_token_logprobs=[lp(0), lp(1), lp(2)],
            output_token_logprobs_length=3,
            finish_reason={"type": "abort", "message": "Aborted", "status_code": None},
        ),
        "[DONE]",
    ]
    text, lps, fin = collect(GenerateReader(incremental=True), payloads)
    assert text == "Hello!"
    assert [t.token_id for t in lps] == [100, 101, 102]
    assert fin.reason == "abort"


def test_incremental_abort_chunk_that_is_a_delta() -> None:
    payloads = [
        chunk("He", completion_tokens=1),
        chunk(
            "y",
            completion_tokens=2,
            finish_reason={"type": "abort", "message": "Aborted", "status_code": None},
        ),
        "[DONE]",
    ]
    text, _, _ = collect(GenerateReader(incremental=True), payloads)
    assert text == "Hey"


def test_cumulative_shorter_text_emits_nothing() -> None:
    r = GenerateReader()
    d, _ = r.feed(chunk("abc", completion_tokens=1))
    assert d is not None and d.text == "abc"
    d, _ = r.feed(chunk("ab", completion_tokens=2))
    assert d == CandidateDelta("", 2, [], prompt_tokens=5)  # (meta()'s prompt)
    d, _ = r.feed(chunk("abcd", completion_tokens=3))
    assert d is not None and d.text == "d"


def test_deltas_carry_the_prompt_tokens() -> None:
    """Every delta says how many prompt tokens the engine reported with it, so a candidate
    that never finishes (its client left) still counts its prompt."""
    r = GenerateReader(incremental=True)
    d, _ = r.feed(chunk("a", completion_tokens=1, prompt_tokens=9))
    assert d is not None and d.prompt_tokens == 9
    d, _ = r.feed(chunk("b", completion_tokens=2, prompt_tokens=9))
    assert d is not None and d.prompt_tokens == 9


def test_no_delta_when_nothing_changed() -> None:
    r = GenerateReader()
    assert r.feed(chunk("a", completion_tokens=1))[0] is not None
    assert r.feed(chunk("a", completion_tokens=1)) == (None, None)


def test_null_logprob_is_minus_9999() -> None:
    r = GenerateReader()
    d, _ = r.feed(
        chunk(
            "a",
            completion_tokens=1,
            output_token_logprobs=[[None, 1, None]],
            output_top_logprobs=[[[None, 1, None]]],
        )
    )
    assert d is not None
    assert d.logprobs[0].logprob == NEG_INF_LOGPROB
    assert d.logprobs[0].token == ""
    assert d.logprobs[0].top[0].logprob == NEG_INF_LOGPROB


def test_unicode_in_text() -> None:
    r = GenerateReader()
    d1, _ = r.feed(chunk("a\u2028", completion_tokens=1))
    d2, _ = r.feed(chunk("a\u2028\U0001f600", completion_tokens=2))
    assert d1 is not None and d2 is not None
    assert d1.text + d2.text == "a\u2028\U0001f600"


@pytest.mark.parametrize("matched", ["</s>", 42, [1, 2], None])
def test_stop_matched_shapes(matched: Any) -> None:
    r = GenerateReader()
    _, f = r.feed(
        chunk("x", completion_tokens=1, finish_reason={"type": "stop", "matched": matched})
    )
    assert f is not None and f.matched == matched


def test_unknown_finish_type_passes_through() -> None:
    r = GenerateReader()
    _, f = r.feed(chunk("x", completion_tokens=1, finish_reason={"type": "novel"}))
    assert f is not None and f.reason == "novel"


# ---------------------------------------------------------------- errors


def test_stream_error_object() -> None:
    r = GenerateReader()
    secret = "internal engine details"
    with pytest.raises(EngineStreamError) as ei:
        r.feed(json.dumps({"error": {"message": secret, "type": "x", "code": 500}}))
    assert secret not in ei.value.message
    assert ei.value.status == 500


def test_stream_error_object_4xx_is_a_400() -> None:
    r = GenerateReader()
    with pytest.raises(EngineStreamError) as ei:
        r.feed(json.dumps({"error": {"message": "too long", "code": 400}}))
    assert ei.value.status == 400
    assert ei.value.code == "invalid_request"
    assert "too long" not in ei.value.message


def test_error_string_body() -> None:
    with pytest.raises(EngineStreamError):
        GenerateReader().feed(json.dumps({"error": "unknown field `foo`"}))


def test_fastapi_error_object() -> None:
    with pytest.raises(EngineStreamError) as ei:
        GenerateReader().feed(
            json.dumps({"object": "error", "message": "m", "type": "t", "code": 413})
        )
    assert ei.value.status == 400


@pytest.mark.parametrize("status,http", [(400, 400), (503, 503), (500, 502), (408, 400)])
def test_abort_with_status(status: int, http: int) -> None:
    r = GenerateReader()
    fr = {"type": "abort", "message": "secret", "status_code": status, "err_type": "x"}
    with pytest.raises(EngineAborted) as ei:
        r.feed(chunk("x", completion_tokens=1, finish_reason=fr))
    assert ei.value.engine_status == status
    assert ei.value.status == http
    assert "secret" not in ei.value.message


def test_abort_without_status_is_a_finish() -> None:
    r = GenerateReader()
    fr = {"type": "abort", "message": "Abort in waiting queue"}
    d, f = r.feed(chunk("", completion_tokens=0, finish_reason=fr))
    assert d is None
    assert f is not None and f.reason == "abort"


@pytest.mark.parametrize(
    "payload",
    [
        "not json",
        "[1, 2]",
        "42",
        '"text"',
        json.dumps({"text": "x"}),  # no meta_info
        json.dumps({"meta_info": meta()}),  # no text
        json.dumps({"text": 1, "meta_info": meta()}),
        json.dumps({"text": "x", "meta_info": meta(completion_tokens="3")}),
        json.dumps({"text": "x", "meta_info": {"completion_tokens": 1}}),  # no prompt_tokens
        json.dumps({"text": "x", "meta_info": meta(finish_reason="stop")}),
        json.dumps({"text": "x", "meta_info": meta(finish_reason={"matched": 1})}),
        json.dumps({"text": "x", "meta_info": meta(finish_reason={"type": 3})}),
        json.dumps(
            {"text": "x", "meta_info": meta(finish_reason={"type": "stop", "matched": 1.5})}
        ),
        json.dumps(
            {"text": "x", "meta_info": meta(finish_reason={"type": "stop", "matched": [True]})}
        ),
        json.dumps(
            {"text": "x", "meta_info": meta(finish_reason={"type": "abort", "status_code": "500"})}
        ),
        json.dumps(
            {"text": "x", "meta_info": meta(finish_reason={"type": "abort", "status_code": True})}
        ),
        json.dumps({"text": "x", "meta_info": meta(output_token_logprobs=[[0.1, 2]])}),
        json.dumps({"text": "x", "meta_info": meta(output_token_logprobs=[["a", 2, None]])}),
        json.dumps(
            {
                "text": "x",
                "meta_info": meta(
                    output_top_logprobs=[[]],
                ),
            }
            | {"z": 1}
        )
        + "}",
        json.dumps(
            {
                "text": "x",
                "meta_info": meta(
                    output_token_logprobs=[[-1.0, 2, "a"]], output_token_logprobs_length=0
                ),
            }
        ),
    ],
)
def test_malformed(payload: str) -> None:
    # (incremental: a cumulative reader skips a chunk that does not decode, tests/core/test_skip.py)
    with pytest.raises(EngineMalformed):
        GenerateReader(incremental=True).feed(payload)


def test_eof_without_done_is_truncated() -> None:
    r = GenerateReader()
    r.feed(chunk("x", completion_tokens=1))
    with pytest.raises(EngineTruncated):
        r.eof()
    with pytest.raises(EngineTruncated):
        GenerateReader().eof()


def test_eof_after_finish_without_done_is_complete() -> None:
    r = GenerateReader()
    r.feed(chunk("x", completion_tokens=1, finish_reason={"type": "length", "length": 1}))
    assert r.finished and not r.done
    r.eof()


def test_anything_after_finish_or_done_is_malformed() -> None:
    r = GenerateReader()
    r.feed(chunk("x", completion_tokens=1, finish_reason={"type": "length", "length": 1}))
    with pytest.raises(EngineMalformed):
        r.feed(chunk("xy", completion_tokens=2))
    r2 = GenerateReader()
    r2.feed(chunk("x", completion_tokens=1, finish_reason={"type": "length", "length": 1}))
    r2.feed("[DONE]")
    with pytest.raises(EngineMalformed):
        r2.feed("[DONE]")


def test_done_before_the_finish_is_a_truncated_stream() -> None:
    """Regression (an OpenAI-compatible server that cut a stream, found through llama.cpp's):
    ``[DONE]`` with no finish read ended the candidate with neither a finish nor an error, and
    the response failed at its end. It is a truncated stream, an error the client is told."""
    r = GenerateReader()
    r.feed(chunk("x", completion_tokens=1))
    with pytest.raises(EngineTruncated):
        r.feed("[DONE]")
    assert r.done


def test_unknown_keys_are_tolerated() -> None:
    r = GenerateReader()
    payload = json.dumps(
        {
            "text": "x",
            "output_ids": [1],
            "index": 0,
            "new_key": {"a": 1},
            "meta_info": meta(completion_tokens=1, e2e_latency=0.1, hidden_states=None),
        }
    )
    d, _ = r.feed(payload)
    assert d is not None and d.text == "x"


# ---------------------------------------------------------------- non-streaming


def test_parse_generate_response() -> None:
    body = json.dumps(
        {
            "text": "Hi there",
            "output_ids": [1, 2],
            "meta_info": meta(
                completion_tokens=2,
                output_token_logprobs=[lp(0), lp(1)],
                output_top_logprobs=[top(0), top(1)],
                finish_reason={"type": "stop", "matched": "###"},
            ),
        }
    ).encode()
    d, f = parse_generate_response(body)
    assert d.text == "Hi there" and d.completion_tokens == 2 and d.prompt_tokens == 5
    assert [t.token_id for t in d.logprobs] == [100, 101]
    assert f.reason == "stop" and f.matched == "###" and f.prompt_tokens == 5


def test_parse_generate_response_errors() -> None:
    with pytest.raises(EngineMalformed):
        parse_generate_response(json.dumps({"text": "x", "meta_info": meta()}).encode())
    with pytest.raises(EngineMalformed):
        parse_generate_response(b"[]")
    with pytest.raises(EngineStreamError):
        parse_generate_response(b'{"error": {"message": "boom"}}')
    with pytest.raises(EngineAborted):
        parse_generate_response(
            json.dumps(
                {"text": "", "meta_info": meta(finish_reason={"type": "abort", "status_code": 503})}
            ).encode()
        )
    _, f = parse_generate_response(
        json.dumps(
            {"text": "", "meta_info": meta(finish_reason={"type": "abort", "status_code": None})}
        ).encode()
    )
    assert f.reason == "abort"


def test_incremental_abort_quirk_after_a_long_non_ascii_stream() -> None:
    pieces = [f" é{i}" if i % 7 == 0 else f" 词{i} 🙂" for i in range(3000)]
    payloads = [chunk(p, completion_tokens=i + 1) for i, p in enumerate(pieces)]
    full = "".join(pieces)
    abort = {"type": "abort", "message": "Aborted", "status_code": None}
    # cumulative abort chunk: only the new tail is emitted
    text, _, fin = collect(
        GenerateReader(incremental=True),
        [*payloads, chunk(full + " end", completion_tokens=3001, finish_reason=abort), "[DONE]"],
    )
    assert text == full + " end" and fin.reason == "abort"
    # an abort chunk as long as the text so far but different is a delta, emitted whole
    other = "x" * len(full)
    text, _, _ = collect(
        GenerateReader(incremental=True),
        [*payloads, chunk(other, completion_tokens=3001, finish_reason=abort), "[DONE]"],
    )
    assert text == full + other


def test_reader_memory_grows_by_the_text_only() -> None:
    """An incremental reader keeps no per-token state but the text it emitted (the pieces a
    resume of a broken stream continues after, ``resume``): 20,000 tokens hold what 100
    tokens hold plus those pieces."""
    import sys
    import tracemalloc

    def retained(tokens: int) -> int:
        payloads = [chunk(f" w{i}", completion_tokens=i + 1).encode() for i in range(tokens)]
        tracemalloc.start()
        try:
            reader = GenerateReader(incremental=True)
            before = tracemalloc.get_traced_memory()[0]
            for p in payloads:
                reader.feed(p.decode())
            return tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()

    small, large = retained(100), retained(20_000)
    pieces = sum(sys.getsizeof(f" w{i}") + 8 for i in range(100, 20_000))  # (+ a list slot)
    assert large - small < pieces * 1.2 + 2048, (small, large, pieces)
