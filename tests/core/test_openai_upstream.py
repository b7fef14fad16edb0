"""The OpenAI-compatible protocol (``core.upstream.openai``): the request it makes of a planned
body, and its reader of ``text_completion`` streams."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sieproxy.core.errors import (
    EngineMalformed,
    EngineStreamError,
    EngineTruncated,
    InvalidRequest,
)
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.core.upstream.openai import OPENAI
from sieproxy.core.upstream.protocol import protocol_for


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(text: str, finish: str | None = None, **choice: Any) -> bytes:
    one = {"index": 0, "text": text, "finish_reason": finish, **choice}
    return sse({"object": "text_completion", "choices": [one]})


USAGE = sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                       "prompt_tokens_details": {"cached_tokens": 4}}})  # fmt: skip


def test_registered_with_its_probes_and_no_abort_request() -> None:
    assert protocol_for("openai") is OPENAI
    assert OPENAI.health_paths == ("/health", "/v1/models") and not OPENAI.server_info
    assert OPENAI.abort({"rid": "r-0"}) is None


def test_request_translates_the_planned_body() -> None:
    body = {
        "text": "<prompt>", "rid": "r-1", "stream": True,
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1,
        "return_text_in_logprobs": True,
        "sampling_params": {
            "max_new_tokens": 9, "min_new_tokens": 1, "stop": ["\\n"], "temperature": 0.5,
            "top_p": 0.9, "top_k": 5, "frequency_penalty": 0.1, "presence_penalty": 0.2,
            "repetition_penalty": 1.1, "logit_bias": {"5": 1.0}, "sampling_seed": 43,
            "json_schema": '{"type": "object"}', "skip_special_tokens": False,
        },
    }  # fmt: skip
    path, out = OPENAI.request(body, "chat", "m")
    assert path == "/v1/completions"
    assert out == {
        "model": "m", "prompt": "<prompt>", "n": 1, "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 9, "min_tokens": 1, "stop": ["\\n"], "temperature": 0.5, "top_p": 0.9,
        "top_k": 5, "frequency_penalty": 0.1, "presence_penalty": 0.2,
        "repetition_penalty": 1.1, "logit_bias": {"5": 1.0}, "seed": 43,
        "skip_special_tokens": False, "logprobs": 2,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "response", "schema": {"type": "object"}}},
    }  # fmt: skip
    lora = {"text": "p", "lora_path": "my-adapter", "sampling_params": {"max_new_tokens": 1}}
    assert OPENAI.request(lora, "completion", "m")[1]["model"] == "my-adapter"
    with pytest.raises(InvalidRequest) as info:
        OPENAI.request({**lora, "image_data": ["data:image/png;base64,AA=="]}, "chat", "m")
    assert info.value.param == "messages"


def test_reader_emits_deltas_and_the_finish_with_the_usage() -> None:
    r = OPENAI.reader(incremental=False, max_line=1 << 16)
    raw = chunk("Hel") + chunk("lo") + chunk("!", "stop", stop_reason="END") + USAGE
    events, err = r.feed(raw[:7])
    assert events == [] and err is None
    events, err = r.feed(raw[7:])
    assert err is None
    deltas = [e for e in events if isinstance(e, CandidateDelta)]
    assert [d.text for d in deltas] == ["Hel", "lo", "!"]
    assert [d.completion_tokens for d in deltas] == [1, 2, 3]
    assert events[-1] == CandidateFinish(
        reason="stop", matched="END", prompt_tokens=7, completion_tokens=3, cached_tokens=4
    )
    assert r.finished and not r.done
    assert r.feed(sse(b"[DONE]")) == ([], None) and r.done
    r.eof()


def test_reader_without_usage_finishes_at_done() -> None:
    r = OPENAI.reader(incremental=False, max_line=1 << 16)
    events, _ = r.feed(chunk("a", "length") + sse(b"[DONE]"))
    assert isinstance(events[-1], CandidateFinish) and events[-1].reason == "length"
    assert events[-1].completion_tokens == 1


def test_done_before_the_finish_is_a_truncated_stream() -> None:
    """Regression (llama.cpp's server cuts a stream when another request arrives, unless told
    not to): ``[DONE]`` with no ``finish_reason`` read is a truncated stream, not an end."""
    r = OPENAI.reader(incremental=False, max_line=1 << 16)
    events, err = r.feed(chunk("a", None) + sse(b"[DONE]"))
    assert [e.text for e in events if isinstance(e, CandidateDelta)] == ["a"]
    assert isinstance(err, EngineTruncated) and r.done


def test_reader_logprobs() -> None:
    r = OPENAI.reader(incremental=False, max_line=1 << 16)
    lp = {"tokens": ["a", "b"], "token_logprobs": [-0.5, None],
          "top_logprobs": [{"a": -0.5, "c": -1.0}, {"b": None}]}  # fmt: skip
    events, _ = r.feed(chunk("ab", logprobs=lp))
    (delta,) = events
    assert isinstance(delta, CandidateDelta) and delta.completion_tokens == 2
    assert [(t.token, t.logprob) for t in delta.logprobs] == [("a", -0.5), ("b", -9999.0)]
    assert [(t.token, t.logprob) for t in delta.logprobs[0].top] == [("a", -0.5), ("c", -1.0)]


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (sse({"error": {"message": "secret", "code": 400}}), EngineStreamError),
        (sse({"error": {"message": "secret", "code": 500}}), EngineStreamError),
        (sse(b"{not json"), EngineMalformed),
        (sse({"choices": [{"text": "a"}, {"text": "b"}]}), EngineMalformed),
    ],
)
def test_reader_errors_keep_the_events_before_them(raw: bytes, error: type) -> None:
    r = OPENAI.reader(incremental=False, max_line=1 << 16)
    events, err = r.feed(chunk("ok") + raw)
    assert [e.text for e in events if isinstance(e, CandidateDelta)] == ["ok"]
    assert isinstance(err, error)
    if isinstance(err, EngineStreamError):
        assert "secret" not in err.message
        assert err.status == (400 if b"400" in raw else 500)


def test_reader_truncation_and_local_finish() -> None:
    r = OPENAI.reader(incremental=False, max_line=1 << 16)
    r.feed(chunk("a") + chunk("b"))
    assert r.local_finish("stop") == CandidateFinish(reason="stop", completion_tokens=2)
    with pytest.raises(EngineTruncated):
        r.eof()
    assert r.express(object()) is None


def test_ignore_eos_reaches_an_openai_engine_under_its_name() -> None:
    body = {"text": "p", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    path, out = OPENAI.request(body, "completion", "m")
    assert path == "/v1/completions" and out["ignore_eos"] is True
