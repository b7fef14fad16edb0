from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sieproxy.core.errors import EngineMalformed
from sieproxy.core.upstream.sse import DONE_FRAME, SSEDecoder, frame


def decode_split(data: bytes, cuts: tuple[int, ...], max_line: int = 1 << 20) -> list[str]:
    dec = SSEDecoder(max_line)
    out: list[str] = []
    prev = 0
    for c in (*cuts, len(data)):
        out += dec.feed(data[prev:c])
        prev = c
    out += dec.close()
    return out


def all_splits(data: bytes, expected: list[str], max_cuts: int = 2) -> None:
    positions = range(1, len(data))
    for k in range(max_cuts + 1):
        for cuts in itertools.combinations(positions, k):
            assert decode_split(data, cuts) == expected, cuts


STREAM = (
    'data: {"text":"h\u00e9llo \u2028 w\u00f6rld \U0001f600","x":1}\r\n\r\n'
    ": keep-alive comment\n"
    "event: message\nid: 7\nretry: 10\n"
    "data:no-space\r"
    "data:  two spaces\r\r"
    "data: a\ndata: b\n\n"
    "data\n\n"
    "data: [DONE]\n\n"
).encode()
EXPECTED = [
    '{"text":"h\u00e9llo \u2028 w\u00f6rld \U0001f600","x":1}',
    "no-space\n two spaces",
    "a\nb",
    "",
    "[DONE]",
]


def test_every_single_and_double_split() -> None:
    all_splits(STREAM, EXPECTED, max_cuts=2)


def test_byte_at_a_time() -> None:
    dec = SSEDecoder()
    out: list[str] = []
    for b in STREAM:
        out += dec.feed(bytes([b]))
    assert out == EXPECTED


def test_crlf_split_between_feeds_is_one_terminator() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: x\r") == []
    # If the LF were a second terminator this would dispatch "x" right now.
    assert dec.feed(b"\n") == []
    assert dec.feed(b"data: y\r") == []
    assert dec.feed(b"\n\r") == ["x\ny"]


def test_cr_then_empty_feed_then_lf() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: x\r") == []
    assert dec.feed(b"") == []
    assert dec.feed(b"\n") == []
    assert dec.feed(b"\n") == ["x"]


def test_cr_cr_is_blank_line() -> None:
    assert decode_split(b"data: x\r\rdata: y\n\n", ()) == ["x", "y"]


def test_unicode_separators_are_text() -> None:
    payload = "a\u2028b\u2029c\u0085d\x0be\x0cf"
    data = frame(payload.encode())
    all_splits(data, [payload])


def test_multibyte_split_everywhere() -> None:
    payload = '{"t":"\u00e9\u20ac\U0001f600\u2028"}'
    all_splits(frame(payload.encode()) * 2, [payload, payload])


def test_bom_at_start_is_stripped() -> None:
    data = b"\xef\xbb\xbfdata: x\n\n"
    all_splits(data, ["x"])


def test_invalid_utf8_is_malformed() -> None:
    dec = SSEDecoder()
    with pytest.raises(EngineMalformed):
        dec.feed(b"data: \xff\n\n")
    with pytest.raises(EngineMalformed):  # stays broken
        dec.feed(b"data: x\n\n")


def test_reads_of_one_event_after_the_first_line() -> None:
    """An engine's usual read (one event of one data line, after the stream's first line) is
    decoded, bounded and checked as any other read is."""
    dec = SSEDecoder(max_line=20)
    assert dec.feed(b": open\n\n") == []
    assert dec.feed(b"data: x\n\n") == ["x"]
    assert dec.feed(b"data: \xc3\xa9\n\n") == ["\u00e9"]
    assert dec.feed(b"data: a\n") == []
    assert dec.feed(b"data: b\n\n") == ["a\nb"]  # the second line of a pending event
    assert dec.feed(b"data:x\n\n") == ["x"]
    assert dec.feed(b"data: [DONE]\n\n") == ["[DONE]"]
    with pytest.raises(EngineMalformed):
        dec.feed(b"data: " + b"y" * 20 + b"\n\n")
    bad = SSEDecoder()
    assert bad.feed(b": open\n\n") == []
    with pytest.raises(EngineMalformed):
        bad.feed(b"data: \xff\n\n")
    with pytest.raises(EngineMalformed):  # stays broken
        bad.feed(b"data: x\n\n")


def test_line_length_bound_complete_line() -> None:
    dec = SSEDecoder(max_line=16)
    assert dec.feed(b"data: 0123456789\n\n") == ["0123456789"]  # exactly 16 bytes
    with pytest.raises(EngineMalformed):
        dec.feed(b"data: 01234567890\n\n")


def test_line_length_bound_pending_line() -> None:
    dec = SSEDecoder(max_line=16)
    dec.feed(b"data: 0123456789")
    with pytest.raises(EngineMalformed):
        dec.feed(b"x")


def test_line_length_bound_byte_at_a_time() -> None:
    dec = SSEDecoder(max_line=8)
    with pytest.raises(EngineMalformed):
        for b in b"data: 0123456789":
            dec.feed(bytes([b]))


def test_event_size_bound_many_lines() -> None:
    dec = SSEDecoder(max_line=16)
    with pytest.raises(EngineMalformed):
        dec.feed(b"data: 01234\n" * 4)


def test_close_discards_unterminated_event() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: x\n\ndata: y\n") == ["x"]
    assert dec.close() == []
    assert dec.discarded
    dec2 = SSEDecoder()
    dec2.feed(b'data: {"partial')
    assert dec2.close() == []
    assert dec2.discarded
    dec3 = SSEDecoder()
    assert dec3.feed(b"data: x\n\n") == ["x"]
    assert dec3.close() == []
    assert not dec3.discarded


def test_frame_helpers() -> None:
    assert frame(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert DONE_FRAME == b"data: [DONE]\n\n"
    assert decode_split(frame(b"x") + DONE_FRAME, ()) == ["x", "[DONE]"]


def test_many_small_feeds_are_linear() -> None:
    # A long line fed in tiny pieces must not rescan the buffer (would be quadratic).
    dec = SSEDecoder()
    body = b"data: " + b"x" * 200_000
    for i in range(0, len(body), 7):
        assert dec.feed(body[i : i + 7]) == []
    assert dec.feed(b"\n\n") == ["x" * 200_000]


_text = st.text(alphabet=st.sampled_from(list("ab:é\u2028\U0001f600 ")), min_size=0, max_size=12)


@given(
    events=st.lists(st.lists(_text, min_size=1, max_size=3), min_size=1, max_size=5),
    eol=st.sampled_from(["\n", "\r", "\r\n"]),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_roundtrip_property(events: list[list[str]], eol: str, cuts: list[int]) -> None:
    wire = "".join("".join(f"data: {line}{eol}" for line in ev) + eol for ev in events).encode()
    expected = ["\n".join(ev) for ev in events]
    points = tuple(sorted({c for c in cuts if 0 < c < len(wire)}))
    assert decode_split(wire, points) == expected
