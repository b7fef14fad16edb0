"""Property tests (hypothesis) for the sans-IO core: decoders, parsers, the merger, validation.

Every test is bounded (``max_examples``, no deadline surprises) and seeded: the seed is printed
and can be changed with ``SIEPROXY_FUZZ_SEED``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from sieproxy.core.errors import EngineMalformed, GatewayError, RequestError
from sieproxy.core.request.validate import decode_chat, decode_completion
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.core.shaping.merger import ChatStream
from sieproxy.core.shaping.reasoning import make_reasoning_parser
from sieproxy.core.shaping.toolparse import make_tool_parser, merge_tool_calls
from sieproxy.core.upstream.sglang import GenerateReader
from sieproxy.core.upstream.sse import SSEDecoder
from tests.core.test_merger import CREATED, chat, check_order_contract, decode

_WS = " \t\r\n"
SEED = int(os.environ.get("SIEPROXY_FUZZ_SEED", "1729"))
FUZZ = settings(
    max_examples=int(os.environ.get("SIEPROXY_FUZZ_EXAMPLES", "300")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True, scope="module")
def _print_seed() -> None:
    print(f"\nhypothesis seed for {__name__}: {SEED} (set SIEPROXY_FUZZ_SEED to change)")


def splits(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at the (sorted, clamped) positions ``cuts``."""
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(text)]:
        out.append(text[prev:p])
        prev = p
    return out


# ---- SSE decoder ---------------------------------------------------------------------------

sse_bytes = st.one_of(
    st.binary(max_size=300),
    st.lists(
        st.sampled_from(
            [b"data: ", b"data:", b"\r", b"\n", b"\r\n", b":c", b"event: x", b"{}", b"[DONE]",
             b"\xe2\x80\xa8", b"\xff", b"\xef\xbb\xbf", b"id: 1", b"x" * 40, b"\xc3", b"\xa9"]
        ),
        max_size=60,
    ).map(b"".join),
)  # fmt: skip


@seed(SEED)
@FUZZ
@given(data=sse_bytes, cuts=st.lists(st.integers(0, 400), max_size=8), max_line=st.integers(1, 64))
def test_sse_decoder_only_raises_malformed_and_never_invents_data(
    data: bytes, cuts: list[int], max_line: int
) -> None:
    dec = SSEDecoder(max_line)
    bounds = [0, *sorted(cuts), len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    fed = 0
    out: list[str] = []
    try:
        for piece in pieces:
            fed += len(piece)
            out += dec.feed(piece)
            produced = sum(len(p.encode("utf-8", "surrogatepass")) for p in out)
            assert produced <= fed
        assert dec.close() == []
    except EngineMalformed:
        return
    for p in out:
        assert "\r" not in p
        assert len(p.encode("utf-8", "surrogatepass")) <= max_line


@seed(SEED)
@FUZZ
@given(
    payloads=st.lists(st.text(alphabet=st.characters(blacklist_characters="\r\n"), max_size=40)),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
    eol=st.sampled_from(["\n", "\r", "\r\n"]),
)
def test_sse_decoder_round_trips_any_split(payloads: list[str], cuts: list[int], eol: str) -> None:
    wire = "".join(f"data: {p}{eol}{eol}" for p in payloads).encode("utf-8", "surrogatepass")
    dec = SSEDecoder(1 << 20)
    out: list[str] = []
    prev = 0
    for c in [*sorted(min(c, len(wire)) for c in cuts), len(wire)]:
        out += dec.feed(wire[prev:c])
        prev = c
    dec.close()
    assert out == payloads


# ---- GenerateReader ------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
)
json_values = st.recursive(
    json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)
meta_keys = st.sampled_from(
    ["prompt_tokens", "completion_tokens", "finish_reason", "cached_tokens", "reasoning_tokens",
     "output_token_logprobs", "output_top_logprobs", "output_token_logprobs_length", "id"]
)  # fmt: skip
finish_values = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["stop", "length", "abort", 3, None])},
        optional={
            "matched": st.one_of(st.none(), st.integers(), st.text(max_size=3), json_values),
            "status_code": st.one_of(st.none(), st.integers(-5, 700), st.booleans(), st.text()),
            "message": st.text(max_size=5),
        },
    ),
    json_values,
)
meta = st.dictionaries(
    meta_keys,
    st.one_of(st.integers(-3, 50), finish_values, json_values),
    max_size=6,
)
chunk = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {},
        optional={
            "text": st.one_of(st.text(max_size=10), json_values),
            "meta_info": st.one_of(meta, json_values),
            "error": json_values,
            "object": st.sampled_from(["error", "x", None]),
            "code": json_values,
        },
    ),
)


def _payload(value: Any, rnd: random.Random) -> str:
    try:
        text = json.dumps(value, allow_nan=True)
    except (ValueError, OverflowError):
        text = "{}"
    if rnd.random() < 0.1:
        text = text[: rnd.randrange(len(text) + 1)]
    if rnd.random() < 0.05:
        text = "[DONE]"
    return text


@seed(SEED)
@FUZZ
@given(
    chunks=st.lists(chunk, max_size=8),
    incremental=st.booleans(),
    rseed=st.integers(0, 2**32),
)
def test_generate_reader_raises_only_gateway_errors(
    chunks: list[Any], incremental: bool, rseed: int
) -> None:
    rnd = random.Random(rseed)
    reader = GenerateReader(incremental=incremental)
    try:
        for c in chunks:
            delta, finish = reader.feed(_payload(c, rnd))
            assert delta is None or isinstance(delta, CandidateDelta)
            assert finish is None or isinstance(finish, CandidateFinish)
            if delta is not None:
                assert isinstance(delta.text, str)
        reader.eof()
    except GatewayError:
        pass


# ---- tool-call parsers ---------------------------------------------------------------------

TOOL_WORDS = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", "[", "]", ",", ";", ":", '"',
    '"name"', '"arguments"', '"parameters"', '"get_weather"', '"f"', " ", "\n", "\\", "null",
    "true", "1", "-", "hello", "é", "\U0001f600", '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
]  # fmt: skip
tool_text = st.one_of(
    st.text(max_size=80),
    st.lists(st.sampled_from(TOOL_WORDS), max_size=25).map("".join),
)


def _run_tool_parser(name: str, text: str, cuts: list[int], names: list[str]) -> tuple[str, Any]:
    parser = make_tool_parser(name, tool_names=names, seed="s")
    assert parser is not None
    content, deltas = [], []
    for piece in splits(text, cuts):
        c, d = parser.feed(piece)
        content.append(c)
        deltas += d
    c, d = parser.flush()
    content.append(c)
    deltas += d
    return "".join(content), merge_tool_calls(deltas)


@pytest.mark.parametrize("name", ["hermes", "llama3", "json_array"])
@seed(SEED)
@FUZZ
@given(
    text=tool_text,
    cuts=st.lists(st.integers(0, 200), max_size=6),
    restrict=st.booleans(),
)
def test_tool_parsers_never_raise_and_are_split_invariant(
    name: str, text: str, cuts: list[int], restrict: bool
) -> None:
    names = ["f", "get_weather"] if restrict else []
    whole = _run_tool_parser(name, text, [], names)
    split = _run_tool_parser(name, text, cuts, names)
    assert split == whole, "the merged result does not depend on how the text was split"
    content, calls = whole
    # Nothing recognised as a call: nothing was lost either (json_array's bare `[]` is
    # documented to yield neither content nor calls).
    if not calls and not (name == "json_array" and text.strip(_WS) == "[]"):
        assert content == text
    for call in calls:
        if restrict:
            assert call["function"]["name"] in names
        assert call["id"].startswith("call_")


def _no_ws(s: str) -> str:
    return "".join(ch for ch in s if ch not in _WS)


@seed(SEED)
@FUZZ
@given(
    before=st.text(max_size=20).filter(lambda t: "<tool_call>" not in t and "<" not in t),
    args=st.dictionaries(st.text(max_size=5), json_leaf.filter(lambda v: v == v), max_size=3),
    after=st.text(max_size=20).filter(lambda t: "<" not in t),
    key=st.sampled_from(["arguments", "parameters"]),
    cuts=st.lists(st.integers(0, 300), max_size=8),
)
def test_hermes_round_trip(
    before: str, args: dict[str, Any], after: str, key: str, cuts: list[int]
) -> None:
    block = json.dumps({"name": "f", key: args})
    text = f"{before}<tool_call>\n{block}\n</tool_call>{after}"
    content, calls = _run_tool_parser("hermes", text, cuts, ["f"])
    assert len(calls) == 1
    assert calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == args
    # whitespace adjacent to the call is documented to be dropped; all other text is kept
    assert _no_ws(content) == _no_ws(before + after)
    assert content.startswith(before.rstrip(_WS))


# ---- reasoning parser --------------------------------------------------------------------------

REASONING_WORDS = ["<think>", "</think>", "<tool_call>", "<", "/", "think", ">", " ", "\n",
                   "a", "é", "\t", "</thi", "<thin"]  # fmt: skip
reasoning_text = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(REASONING_WORDS), max_size=25).map("".join),
)


def _qwen3_reference(text: str, starts_in_reasoning: bool) -> tuple[str, str]:
    """The documented split (reasoning.py "Decisions"), computed on the whole text at once."""
    rest = text.lstrip(_WS)
    if rest.startswith("<think>"):
        rest = rest[len("<think>") :]
    elif not starts_in_reasoning:
        return "", text
    found = [(i, t) for t in ("</think>", "<tool_call>") if (i := rest.find(t)) >= 0]
    if not found:
        return rest.strip(_WS), ""
    at, tag = min(found)
    reasoning = rest[:at].strip(_WS)
    if tag == "</think>":
        return reasoning, rest[at + len(tag) :].lstrip(_WS)
    return reasoning, rest[at:]


@pytest.mark.parametrize("enable_thinking", [None, False])
@seed(SEED)
@FUZZ
@given(text=reasoning_text, cuts=st.lists(st.integers(0, 100), max_size=6))
def test_qwen3_reasoning_parser_loses_no_text(
    enable_thinking: bool | None, text: str, cuts: list[int]
) -> None:
    parser = make_reasoning_parser("qwen3", enable_thinking=enable_thinking)
    assert parser is not None
    reasoning, content = [], []
    for piece in splits(text, cuts):
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.flush()
    reasoning.append(r)
    content.append(c)
    got = ("".join(reasoning), "".join(content))
    assert got == _qwen3_reference(text, starts_in_reasoning=enable_thinking is not False)


# ---- ChatStream order contract -------------------------------------------------------------------


@seed(SEED)
@settings(FUZZ, max_examples=150)
@given(
    texts=st.integers(1, 8).flatmap(
        lambda n: st.lists(st.text(max_size=12), min_size=n, max_size=n)
    ),
    include_usage=st.booleans(),
    order=st.randoms(use_true_random=False),
    pieces=st.integers(1, 4),
)
def test_chat_stream_random_interleavings_keep_order_contract(
    texts: list[str], include_usage: bool, order: random.Random, pieces: int
) -> None:
    n = len(texts)
    stream = ChatStream(
        chat(n, include_usage=include_usage), response_id="chatcmpl-req", model="m",
        created=CREATED,
    )  # fmt: skip
    queues: list[list[Any]] = []
    for t in texts:
        cuts = sorted(order.randrange(len(t) + 1) for _ in range(pieces))
        parts = [p for p in splits(t, cuts) if p]
        q: list[Any] = []
        total = 0
        for p in parts:
            total += len(p)
            q.append(CandidateDelta(p, total))
        q.append(CandidateFinish("length", prompt_tokens=3, completion_tokens=total))
        queues.append(q)
    out = bytearray(stream.start())
    live = list(range(n))
    while live:
        i = order.choice(live)
        ev = queues[i].pop(0)
        out += stream.on_delta(i, ev) if isinstance(ev, CandidateDelta) else stream.on_finish(i, ev)
        if not queues[i]:
            live.remove(i)
    out += stream.end()
    events = decode(bytes(out))
    per = check_order_contract(events, n, include_usage)
    for i in range(n):
        assert "".join(ch["delta"].get("content", "") for ch in per[i]) == texts[i]
        assert per[i][-1]["finish_reason"] == "length"


# ---- request validation --------------------------------------------------------------------------

CHAT_KEYS = [
    "model", "messages", "n", "stream", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "stop", "seed", "tools", "tool_choice", "response_format", "logprobs",
    "top_logprobs", "logit_bias", "user", "stream_options", "chat_template_kwargs", "best_of",
    "include_reasoning", "lora_adapter", "functions", "metadata", "role", "content", "type",
    "image_url", "url", "function", "name", "arguments", "parameters", "json_schema", "schema",
]  # fmt: skip
keyed_values = st.recursive(
    json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(CHAT_KEYS), st.text(max_size=5)), children,
                        max_size=5),
    ),
    max_leaves=30,
)  # fmt: skip
chat_like = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just("m"), json_leaf),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
                    optional={"content": keyed_values, "tool_calls": keyed_values,
                              "tool_call_id": keyed_values, "name": keyed_values},
                ),
                max_size=4,
            ),
            keyed_values,
        ),
    },
    optional={k: keyed_values for k in CHAT_KEYS[2:24]},
)  # fmt: skip


def _encode(value: Any) -> bytes:
    try:
        return json.dumps(value, allow_nan=True).encode()
    except (ValueError, OverflowError):
        return b"{}"


@seed(SEED)
@FUZZ
@given(value=st.one_of(keyed_values, chat_like))
def test_decode_chat_raises_only_request_errors(value: Any) -> None:
    body = _encode(value)
    with contextlib.suppress(RequestError):
        decode_chat(body)
    with contextlib.suppress(RequestError):
        decode_completion(body)


@seed(SEED)
@FUZZ
@given(body=st.binary(max_size=200))
def test_decode_chat_on_arbitrary_bytes(body: bytes) -> None:
    with contextlib.suppress(RequestError):
        decode_chat(body)


@pytest.mark.parametrize("depth", [100, 5_000, 100_000])
@pytest.mark.parametrize("shape", ["top", "metadata", "messages"])
def test_decode_chat_deeply_nested_is_a_request_error(depth: int, shape: str) -> None:
    nest = "[" * depth + "]" * depth
    body = {
        "top": nest,
        "metadata": '{"model":"m","messages":[{"role":"user","content":"x"}],"metadata":'
        + nest
        + "}",
        "messages": '{"model":"m","messages":' + nest + "}",
    }[shape].encode()
    with pytest.raises(RequestError):
        decode_chat(body)


def test_decode_chat_huge_logit_bias_key_is_a_request_error() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"logit_bias":{"'
    body += b"9" * 5000 + b'":1}}'
    with pytest.raises(RequestError):
        decode_chat(body)
