"""The express lane (``core.upstream.sglang``) against the general path it short-cuts.

The general path of one engine read is what the relay does with it (``relay._events`` and
``_merge``): SSE events → ``GenerateReader.feed`` → the shaper's ``on_delta`` / ``on_finish``, up
to ``[DONE]`` or the first error. The express lane must give, for every read, either ``None``
having changed nothing, or exactly the frame the general path would have written, with every
layer's state moved as the general path moves it. The property test drives random streams
through both and compares every frame, every error and the state at the end.
"""

from __future__ import annotations

import itertools
import json
import zlib
from typing import Any

import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from sieproxy.core.errors import EngineTruncated, GatewayError
from sieproxy.core.shaping.merger import ChatStream, CompletionStream
from sieproxy.core.upstream.sglang import Express, GenerateReader
from sieproxy.core.upstream.sse import SSEDecoder
from tests.core.test_fuzz_core import FUZZ, SEED
from tests.core.test_merger import CREATED, chat, completion, decode


def _shaper(kind: str, **kw: Any) -> ChatStream | CompletionStream:
    if kind == "completion":
        s: ChatStream | CompletionStream = CompletionStream(
            completion(stop=kw.get("stop")), response_id="cmpl-req", model="m", created=CREATED
        )
    else:
        s = ChatStream(chat(**kw), response_id="chatcmpl-req", model="m", created=CREATED)
    s.start()
    return s


class Lane:
    """One choice's layers, fed one read at a time by the general path, or by the express
    lane first when ``express``."""

    def __init__(self, kind: str, incremental: bool, express: bool, **kw: Any) -> None:
        self.decoder = SSEDecoder(max_line=kw.pop("max_line", 1 << 20))
        self.reader = GenerateReader(incremental=incremental)
        self.shaper = _shaper(kind, **kw)
        self.express = Express.of(self.decoder, self.reader, self.shaper) if express else None
        self.taken = 0  # reads the express lane took

    def general(self, raw: bytes) -> tuple[bytes, Any]:
        """What the relay writes for ``raw``, and the error that ends the stream there."""
        events: list[Any] = []
        err: Any = None
        try:
            for payload in self.decoder.feed(raw):
                delta, finish = self.reader.feed(payload)
                if delta is not None:
                    events.append(delta)
                if finish is not None:
                    events.append(finish)
                if self.reader.done:
                    break
        except GatewayError as e:
            err = e
        out = b""
        try:
            for ev in events:
                if hasattr(ev, "text"):
                    out += self.shaper.on_delta(0, ev)
                else:
                    out += self.shaper.on_finish(0, ev)
        except GatewayError as e:  # the shaper refused an order (a finish twice ...)
            err = err or e
        return out, err

    def feed(self, raw: bytes) -> tuple[bytes, Any]:
        if self.express is not None:
            frame = self.express.relay(raw)
            if frame is not None:
                self.taken += 1
                return frame, None
        return self.general(raw)

    def state(self) -> dict[str, Any]:
        c = self.shaper.choices[0]
        return {
            "decoder": {k: (bytes(v) if isinstance(v, bytearray) else v)
                        for k, v in _fields(self.decoder).items()},
            "reader": _fields(self.reader),
            "choice": (c.phase, c.completion_tokens, c.prompt_tokens, c.finish_reason,
                       list(c._pending)),
            "shaper": self.shaper.phase,
        }


def _fields(obj: object) -> dict[str, Any]:
    """Every attribute of a slotted object."""
    return {k: getattr(obj, k) for k in type(obj).__slots__}  # type: ignore[attr-defined]


def _err(e: Any) -> Any:
    return None if e is None else (type(e), str(e), e.status)


# ---- a random engine stream ------------------------------------------------------------------

texts = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(['"', "\\", "\n", "\r", "\u2028", "\x00", "é", "🌍", "<", "/"]),
    ),
    max_size=6,
)

#: One engine SSE event: ("token", text, token increment) or a rarer kind.
events = st.one_of(
    st.tuples(st.just("token"), texts, st.integers(0, 3)),
    st.tuples(st.just("token"), texts, st.integers(0, 3)),
    st.tuples(st.just("token"), texts, st.integers(0, 3)),
    st.tuples(
        st.sampled_from(
            ["finish-stop", "finish-length", "finish-abort", "finish-abort-503", "logprobs",
             "error", "object-error", "done", "garbage", "no-meta", "bad-utf8-skipped",
             "comment", "other-field", "multiline", "crlf", "nospace", "extra-fields",
             "null-error", "empty-logprobs", "cr-in-json", "lf-in-json", "cr-only",
             "error-full", "object-error-full", "multiline-blank-first", "no-text",
             "field-6", "comment-line"]
        ),
        texts,
        st.integers(0, 3),
    ),
)


def _payload(text: str, tokens: int, prompt: int = 7, **meta: Any) -> dict[str, Any]:
    m = {"id": "r", "finish_reason": None, "prompt_tokens": prompt, "completion_tokens": tokens,
         "cached_tokens": 0, **meta}
    return {"text": text, "output_ids": [tokens], "meta_info": m}


def stream_bytes(evs: list[tuple[str, str, int]], incremental: bool, bom: bool) -> list[bytes]:
    """Each event's SSE bytes (SGLang's framing, or the rarer framings of the kind)."""
    out: list[bytes] = []
    tokens = 0
    whole = ""
    for kind, text, inc in evs:
        tokens += inc
        whole += text
        t = text if incremental else whole
        obj: Any = _payload(t, tokens, prompt=7 + inc)
        line = None
        if kind == "finish-stop":
            obj["meta_info"]["finish_reason"] = {"type": "stop", "matched": 2}
        elif kind == "finish-length":
            obj["meta_info"]["finish_reason"] = {"type": "length", "length": tokens}
        elif kind == "finish-abort":
            obj["meta_info"]["finish_reason"] = {"type": "abort", "message": "x",
                                                 "status_code": None}
        elif kind == "finish-abort-503":
            obj["meta_info"]["finish_reason"] = {"type": "abort", "status_code": 503}
        elif kind == "logprobs":
            obj["meta_info"]["output_token_logprobs"] = [[-0.5, 3, "x"]]
        elif kind == "empty-logprobs":
            obj["meta_info"]["output_token_logprobs"] = []
        elif kind == "error":
            obj = {"error": {"message": "boom", "code": 400}}
        elif kind == "error-full":  # an error beside the usual fields
            obj["error"] = {"message": "boom", "code": 500}
        elif kind == "object-error-full":
            obj["object"] = "error"
        elif kind == "null-error":
            obj["error"] = None
        elif kind == "object-error":
            obj = {"object": "error", "code": 503, "message": "x"}
        elif kind == "no-meta":
            del obj["meta_info"]
        elif kind == "no-text":
            del obj["text"]
        elif kind == "extra-fields":
            obj["meta_info"]["weight_version"] = "default"
            obj["index"] = 0
        elif kind == "done":
            line = b"data: [DONE]\n\n"
        elif kind == "garbage":
            line = b"data: {not json\n\n"
        elif kind == "bad-utf8-skipped":  # invalid UTF-8 inside a field nobody reads
            line = b"data: " + json.dumps(obj)[:-1].encode() + b', "x": "\xff"}\n\n'
        elif kind == "field-6":  # another field, as long as "data: ", then the JSON
            line = b"event:" + json.dumps(obj).encode() + b"\n\n"
        elif kind == "comment-line":  # a data line, then a comment that looks like one
            j = json.dumps(obj).encode()
            line = b"data: " + j + b"\n:data: " + j + b"\n\n"
        elif kind == "comment":
            line = b": keep-alive\n\n"
        elif kind == "other-field":
            line = b"event: message\n" + b"data: " + json.dumps(obj).encode() + b"\n\n"
        elif kind == "multiline":  # JSON across two data lines (joined with LF: whitespace)
            s = json.dumps(obj)
            line = b"data: " + s[:1].encode() + b"\ndata: " + s[1:].encode() + b"\n\n"
        elif kind == "crlf":
            line = b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"
        elif kind == "cr-in-json":  # JSON whitespace to msgspec, a line break to SSE
            s = json.dumps(obj, separators=(",", ":"))
            line = b"data: " + s.replace(",", ",\r", 1).encode() + b"\n\n"
        elif kind == "lf-in-json":  # the same with an LF
            s = json.dumps(obj, separators=(",", ":"))
            line = b"data: " + s.replace(",", ",\n", 1).encode() + b"\n\n"
        elif kind == "multiline-blank-first":  # an empty data line, then the JSON
            line = b"data: \ndata: " + json.dumps(obj).encode() + b"\n\n"
        elif kind == "cr-only":  # CR line ends: the read ends in a CR (an LF may follow)
            line = b"data: " + json.dumps(obj).encode() + b"\r\r"
        elif kind == "nospace":
            line = b"data:" + json.dumps(obj).encode() + b"\n\n"
        if line is None:
            # SGLang's compact orjson; non-ASCII as UTF-8 (ensure_ascii off), as orjson does.
            line = b"data: " + json.dumps(obj, ensure_ascii=False,
                                          separators=(",", ":")).encode() + b"\n\n"
        out.append(line)
    if bom and out:
        out[0] = b"\xef\xbb\xbf" + out[0]
    return out


def reads(
    lines: list[bytes], cuts: list[int], joins: list[bool], line_cuts: list[bool]
) -> list[bytes]:
    """The stream's bytes as the engine's reads: mostly one event per read, some joined to the
    next, then cut at the given offsets, and after the first LF of the events ``line_cuts``
    names (a data line whose blank line comes in the next read)."""
    grouped: list[bytes] = []
    for i, line in enumerate(lines):
        if grouped and i - 1 < len(joins) and joins[i - 1]:
            grouped[-1] += line
        else:
            grouped.append(line)
    whole = b"".join(grouped)
    bounds = {0, len(whole)}
    pos = 0
    for g in grouped:
        pos += len(g)
        bounds.add(pos)
    pos = 0
    for i, line in enumerate(lines):
        if i < len(line_cuts) and line_cuts[i] and b"\n" in line:
            bounds.add(pos + line.index(b"\n") + 1)
        pos += len(line)
    bounds.update(c % (len(whole) + 1) for c in cuts)
    pts = sorted(bounds)
    return [whole[a:b] for a, b in itertools.pairwise(pts) if b > a]


@seed(SEED)
@FUZZ
@given(
    evs=st.lists(events, max_size=24),
    incremental=st.booleans(),
    kind=st.sampled_from(["chat", "chat-usage", "completion"]),
    bom=st.booleans(),
    first_line=st.booleans(),
    cuts=st.lists(st.integers(0, 10_000), max_size=3),
    joins=st.lists(st.booleans(), max_size=24),
    line_cuts=st.lists(st.booleans(), max_size=24),
    max_line=st.sampled_from([1 << 20, 1 << 20, 160, 175]),  # near an event's own length
)
def test_the_express_lane_is_the_general_path(
    evs: list[tuple[str, str, int]],
    incremental: bool,
    kind: str,
    bom: bool,
    first_line: bool,
    cuts: list[int],
    joins: list[bool],
    line_cuts: list[bool],
    max_line: int,
) -> None:
    lines = stream_bytes(evs, incremental, bom)
    if first_line:  # the stream's first event goes through the general path, as prime() does
        lines.insert(0, b"data: " + json.dumps(_payload("", 0)).encode() + b"\n\n")
    kw: dict[str, Any] = {"max_line": max_line}
    if kind == "chat-usage":
        kw["include_usage"] = True
    shape = "completion" if kind == "completion" else "chat"
    general = Lane(shape, incremental, express=False, **kw)
    express = Lane(shape, incremental, express=True, **kw)
    assert express.express is not None
    for raw in reads(lines, cuts, joins, line_cuts):
        want, want_err = general.feed(raw)
        got, got_err = express.feed(raw)
        assert got == want
        assert _err(got_err) == _err(want_err)
        assert express.state() == general.state()
        if want_err is not None:
            break


def test_every_common_token_takes_the_express_lane() -> None:
    """Not vacuous: after the first line, every token read of SGLang's framing is taken, and
    the frames decode to the tokens' texts (cumulative and incremental)."""
    for incremental in (True, False):
        for kind in ("chat", "completion"):
            lane = Lane(kind, incremental, express=True)
            texts_ = ["Hel", "lo", "", ' "wörld"', "\u2028🌍\n"]
            evs = [("token", t, 1) for t in texts_]
            lines = stream_bytes(evs, incremental, bom=False)
            first, *rest = lines
            out, err = lane.feed(first)  # the first line of a stream: the general path
            assert lane.taken == 0 and err is None
            for line in rest:
                frame, err = lane.feed(line)
                out += frame
                assert err is None
            assert lane.taken == len(rest)
            key = "text" if kind == "completion" else "content"
            got = [
                (c["choices"][0].get("delta", c["choices"][0])).get(key) for c in decode(out)
            ]
            assert "".join(g for g in got if g) == "".join(texts_)
            assert lane.reader._emitted == len("".join(texts_))
            assert lane.shaper.choices[0].completion_tokens == len(texts_)
            if incremental:
                assert lane.reader._crc == zlib.crc32("".join(texts_).encode())


@pytest.mark.parametrize(
    "kw",
    [{"stop": ["x"]}, {"logprobs": True}],
)
def test_a_choice_that_is_not_plain_has_no_express_lane(kw: dict[str, Any]) -> None:
    lane = Lane("chat", True, express=True, **kw)
    assert lane.express is None
    assert Express.of(SSEDecoder(), GenerateReader(), object()) is None  # not a stream shaper


def test_a_read_it_declines_changes_nothing() -> None:
    """Each rare shape is declined with every layer's state as it was."""
    lane = Lane("chat", True, express=True)
    lane.feed(stream_bytes([("token", "a", 1)], True, bom=False)[0])  # past the first line
    assert lane.express is not None
    before = lane.state()
    for k in ("finish-stop", "logprobs", "error", "object-error", "done", "garbage", "no-meta",
              "bad-utf8-skipped", "comment", "other-field", "multiline", "crlf", "nospace",
              "cr-in-json", "lf-in-json", "cr-only", "error-full", "object-error-full",
              "multiline-blank-first", "no-text", "field-6", "comment-line"):
        raw = stream_bytes([(k, "b", 1)], True, bom=False)[0]
        assert lane.express.relay(raw) is None, k
        assert lane.state() == before, k
    assert lane.express.relay(b"data: " + json.dumps(_payload("a", 2)).encode()) is None  # no LF
    assert lane.express.relay(b"data: {}\n\ndata: {}\n\n") is None  # two events
    assert lane.express.relay(_common()[:-1] + b":") is None  # a next line begins
    assert lane.express.relay(b"") is None and lane.express.relay(b"\n") is None
    assert lane.state() == before


def _common(tokens: int = 2) -> bytes:
    return b"data: " + json.dumps(_payload("z", tokens), separators=(",", ":")).encode() + b"\n\n"


def _broken(lane: Lane) -> None:
    with pytest.raises(GatewayError):
        lane.decoder.feed(b"data: " + b"x" * (lane.decoder.max_line + 1) + b"\n")


def _past_done(lane: Lane) -> None:
    """The reader read ``[DONE]`` (early here: it says the stream was cut, and is done)."""
    with pytest.raises(EngineTruncated):
        lane.reader.feed("[DONE]")
    assert lane.reader.done


def _finished_reader(lane: Lane) -> None:
    fin = _payload("", 2)
    fin["meta_info"]["finish_reason"] = {"type": "length", "length": 2}
    lane.reader.feed(json.dumps(fin))  # the reader only (the shaper is not told)


def test_a_burst_of_common_events_is_taken_whole_or_not_at_all() -> None:
    """Several tokens in one read (a relay that fell behind) are taken together; a burst with
    one event the lane does not take (here the finish) goes to the general path whole."""
    lane, general = Lane("chat", True, express=True), Lane("chat", True, express=False)
    first = _common(1)
    for x in (lane, general):
        x.feed(first)
    burst = _common(2) + _common(3) + _common(4)
    assert lane.feed(burst) == general.feed(burst) and lane.taken == 1
    assert lane.state() == general.state()
    fin = stream_bytes([("token", "a", 5), ("finish-stop", "b", 1)], True, bom=False)
    before = lane.state()
    assert lane.express is not None and lane.express.relay(b"".join(fin)) is None
    assert lane.state() == before
    assert lane.feed(b"".join(fin)) == general.feed(b"".join(fin))
    assert lane.state() == general.state()


def test_it_declines_before_the_stream_started() -> None:
    shaper = ChatStream(chat(), response_id="chatcmpl-req", model="m", created=CREATED)
    decoder = SSEDecoder()
    decoder.feed(b": first line\n")
    express = Express.of(decoder, GenerateReader(incremental=True), shaper)
    assert express is not None and express.relay(_common()) is None


@pytest.mark.parametrize(
    "put",
    [
        pytest.param(lambda lane: lane.decoder.feed(b"data: \n"), id="an event's line waits"),
        pytest.param(lambda lane: lane.decoder.feed(b": c\r"), id="a CR waits for its LF"),
        pytest.param(lambda lane: lane.decoder.feed(b"data: {"), id="a partial line"),
        pytest.param(_broken, id="the decoder failed"),
        pytest.param(_past_done, id="after [DONE]"),
        pytest.param(_finished_reader, id="the reader finished"),
        pytest.param(lambda lane: lane.shaper.choices[0].fail(), id="the choice failed"),
        pytest.param(lambda lane: lane.shaper.on_error(GatewayError("x")), id="stream closed"),
    ],
)
def test_it_declines_while_a_layer_is_not_idle(put: Any) -> None:
    """In each state where the general path would do something else with a common read (or
    refuse it), the lane declines and changes nothing."""
    lane = Lane("chat", True, express=True)
    assert lane.feed(_common(1))[1] is None  # past the first line
    assert lane.express is not None and lane.express.relay(_common(1)) is not None
    put(lane)
    before = lane.state()
    assert lane.express.relay(_common()) is None
    assert lane.state() == before
