"""A malformed event in SGLang's cumulative stream is skipped (sieproxy/core/upstream/sglang.py):
the next chunk repeats the whole state, so the client loses nothing; in incremental mode, past
``MAX_SKIPPED``, or where the lost chunk was the finish, it is the stream's error."""

from __future__ import annotations

import json

import pytest

from sieproxy.core.errors import EngineMalformed, EngineTruncated
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.core.upstream import sglang

BAD = b'data: {"text": "oops", "meta_info": {"id": \n\n'


def chunk(text: str, tokens: int, finish: dict[str, object] | None = None) -> bytes:
    meta = {
        "prompt_tokens": 3,
        "completion_tokens": tokens,
        "finish_reason": finish,
        "output_token_logprobs": [[-0.5, 100 + k, f"t{k}"] for k in range(tokens)],
    }
    return b"data: " + json.dumps({"text": text, "meta_info": meta}).encode() + b"\n\n"


def test_a_cumulative_stream_skips_a_malformed_chunk_and_loses_nothing() -> None:
    r = sglang.SGLANG.reader(incremental=False, max_line=1 << 16)
    events, err = r.feed(chunk(" a", 1) + BAD)
    assert err is None and [e.text for e in events if isinstance(e, CandidateDelta)] == [" a"]
    events, err = r.feed(chunk(" a b c", 3) + chunk(" a b c d", 4, {"type": "length"}))
    assert err is None
    deltas = [e for e in events if isinstance(e, CandidateDelta)]
    assert "".join(d.text for d in deltas) == " b c d"
    assert [lp.token_id for d in deltas for lp in d.logprobs] == [101, 102, 103]
    assert isinstance(events[-1], CandidateFinish) and events[-1].completion_tokens == 4
    assert r.feed(b"data: [DONE]\n\n") == ([], None)
    r.eof()


def test_skips_are_bounded() -> None:
    r = sglang.SGLANG.reader(incremental=False, max_line=1 << 16)
    for _ in range(sglang.MAX_SKIPPED):
        assert r.feed(BAD) == ([], None)
    _events, err = r.feed(BAD)
    assert isinstance(err, EngineMalformed)


def test_an_incremental_stream_cannot_skip() -> None:
    r = sglang.SGLANG.reader(incremental=True, max_line=1 << 16)
    _events, err = r.feed(chunk(" a", 1) + BAD)
    assert isinstance(err, EngineMalformed)


@pytest.mark.parametrize("then", [b"data: [DONE]\n\n", b""])
def test_a_lost_finish_is_still_an_error(then: bytes) -> None:
    r = sglang.SGLANG.reader(incremental=False, max_line=1 << 16)
    r.feed(chunk(" a", 1) + BAD)  # the malformed chunk was the terminal one
    if then:
        _events, err = r.feed(then)
        assert isinstance(err, EngineTruncated)
    else:
        with pytest.raises(EngineTruncated):
            r.eof()
