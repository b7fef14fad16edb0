"""The upstream protocol seam (``core.protocol``) and SGLang's native protocol behind it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from sieproxy.core.errors import EngineMalformed, EngineTruncated
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.core.shaping.merger import ChatStream
from sieproxy.core.upstream import sglang
from sieproxy.core.upstream.protocol import PROTOCOLS, protocol_for
from sieproxy.core.upstream.sse import SSEDecoder

from .test_merger import chat

CORE = Path(sglang.__file__).parent


def _chunk(text: str, tokens: int, finish: dict[str, object] | None = None) -> bytes:
    meta = {"prompt_tokens": 3, "completion_tokens": tokens, "finish_reason": finish}
    return b"data: " + json.dumps({"text": text, "meta_info": meta}).encode() + b"\n\n"


def test_sglang_is_registered_and_shapes_its_calls() -> None:
    proto = protocol_for("sglang")
    assert PROTOCOLS["sglang"] is proto is sglang.SGLANG
    body = {"rid": "req-1", "text": "hi", "stream": True, "sampling_params": {}}
    assert proto.request(body, "chat", "m") == ("/generate", body)
    assert proto.abort(body) == ("/abort_request", {"rid": "req-1"})
    assert proto.health_paths == ("/health",) and proto.server_info
    with pytest.raises(KeyError):
        protocol_for("nope")


def test_native_reader_takes_bytes_and_gives_events() -> None:
    r = sglang.SGLANG.reader(incremental=False, max_line=1 << 16)
    raw = _chunk("Hel", 1) + _chunk("Hello", 2)
    # Split mid-event: nothing is lost or doubled across reads.
    ev1, err1 = r.feed(raw[:10])
    ev2, err2 = r.feed(raw[10:])
    assert err1 is None and err2 is None and ev1 == []
    assert [e.text for e in ev2 if isinstance(e, CandidateDelta)] == ["Hel", "lo"]
    assert not r.finished and not r.done
    assert r.local_finish("stop") == CandidateFinish(
        reason="stop", prompt_tokens=3, completion_tokens=2
    )
    ev, err = r.feed(_chunk("Hello!", 3, {"type": "length"}) + b"data: [DONE]\n\n")
    assert err is None and r.finished and r.done
    assert isinstance(ev[-1], CandidateFinish) and ev[-1].reason == "length"
    r.eof()  # ended properly


def test_native_reader_reports_errors_after_the_events_before_them() -> None:
    r = sglang.SGLANG.reader(incremental=True, max_line=1 << 16)  # (cumulative: skipped)
    ev, err = r.feed(_chunk("a", 1) + b"data: {not json\n\n")
    assert [type(e) for e in ev] == [CandidateDelta] and isinstance(err, EngineMalformed)
    cut = sglang.SGLANG.reader(incremental=False, max_line=1 << 16)
    cut.feed(_chunk("a", 1) + b"data: {")  # a partial event, then the body ends
    with pytest.raises(EngineTruncated):
        cut.eof()


def test_the_express_lane_belongs_to_the_reader() -> None:
    shaper = ChatStream(chat(), response_id="c", model="m", created=1)
    shaper.start()
    r = sglang.SGLANG.reader(incremental=True, max_line=1 << 16)
    lane = r.express(shaper)
    assert lane is not None
    assert lane.relay(_chunk("x", 1)) is None  # the first line: the decoder must see it
    assert r.feed(_chunk("x", 1))[1] is None
    frame = lane.relay(_chunk("y", 2))
    assert frame is not None and b'"y"' in frame
    assert r.local_finish().completion_tokens == 2  # the lane moved the reader's counts


def test_sse_decoder_at_rest() -> None:
    d = SSEDecoder()
    assert not d.at_rest()  # before the first line
    d.feed(b"data: a\n\n")
    assert d.at_rest()
    d.feed(b"data: b")
    assert not d.at_rest()  # a partial line
    d.feed(b"\n")
    assert not d.at_rest()  # an event waiting for its blank line
    d.feed(b"\n")
    assert d.at_rest()


def _private_reach(path: Path) -> set[str]:
    """``obj._name`` reads and writes in ``path`` where ``obj`` is not ``self``/``cls`` and
    ``_name`` is defined by no class of the same module."""
    tree = ast.parse(path.read_text())
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name):
                    if item.value.id == "self":
                        own.add(item.attr)
                elif isinstance(item, ast.Constant) and isinstance(item.value, str):
                    own.add(item.value)  # __slots__ entries
    found = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            and node.attr not in own
        ):
            found.add(node.attr)
    return found


def test_the_sglang_protocol_reaches_into_no_other_module() -> None:
    """The express lane lives in the reader's module and uses other modules' public names
    only (it used to read ``SSEDecoder``'s buffers and ``GenerateReader``'s counters from a
    module of its own)."""
    for name in ("sglang.py", "protocol.py"):
        assert _private_reach(CORE / name) == set(), name
    source = (CORE / "sglang.py").read_text()
    assert "_StreamBase" not in source
