"""The sans-IO HTTP/1.1 response framing of the upstream client (sieproxy/core/upstream/http1.py).

Every well-formed response is fed split at every byte (and as one piece, and byte by byte), and
must give the same head, the same body bytes and the same keep-alive verdict; every malformed
or oversized one must raise ``FramingError``. A seeded hypothesis run feeds random splits and
random bytes (the seed comes from the fuzz module's ``SIEPROXY_FUZZ_SEED``).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from sieproxy.core.upstream.http1 import FramingError, ResponseParser, request_head
from tests.core.test_fuzz_core import FUZZ, SEED

SSE = b'data: {"text":"a"}\n\ndata: {"text":"ab"}\n\ndata: [DONE]\n\n'


def chunked(*parts: bytes, ext: bytes = b"", trailer: bytes = b"") -> bytes:
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in parts)
    return out + b"0\r\n" + trailer + b"\r\n"


HEAD_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)

# (name, raw response, status, body, keep-alive afterwards, complete before EOF)
GOOD: list[tuple[str, bytes, int, bytes, bool, bool]] = [
    ("chunked", HEAD_CHUNKED + chunked(SSE[:20], SSE[20:]), 200, SSE, True, True),
    ("chunked-one", HEAD_CHUNKED + chunked(SSE), 200, SSE, True, True),
    (
        "chunked-ext-trailer",
        HEAD_CHUNKED + chunked(b"xy", b"z", ext=b";a=b", trailer=b"X-T: 1\r\n"),
        200,
        b"xyz",
        True,
        True,
    ),
    (
        "chunked-size-blanks-ext",
        HEAD_CHUNKED + b"2 \t;a=b\r\nxy\r\n1\t\r\nz\r\n0\r\n\r\n",
        200,
        b"xyz",
        True,
        True,
    ),
    (  # a plain first chunk, an extension on the next (the fast path hands over there)
        "chunked-ext-on-second",
        HEAD_CHUNKED + b"2\r\nxy\r\n1;a=b\r\nz\r\n0\r\n\r\n",
        200,
        b"xyz",
        True,
        True,
    ),
    (
        "chunked-upper-hex",
        HEAD_CHUNKED + b"A\r\n0123456789\r\n0\r\n\r\n",
        200,
        b"0123456789",
        True,
        True,
    ),
    (
        "length",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: application/json\r\n\r\nhello",
        200,
        b"hello",
        True,
        True,
    ),
    ("length-zero", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 200, b"", True, True),
    ("no-content", b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"", True, True),
    (
        "connection-close",
        b"HTTP/1.1 503 Busy\r\nConnection: close\r\nContent-Length: 4\r\n\r\nbusy",
        503,
        b"busy",
        False,
        True,
    ),
    ("close-delimited", b"HTTP/1.1 200 OK\r\n\r\nuntil eof", 200, b"until eof", False, False),
    ("http10", b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, b"ok", False, True),
    (
        "http10-keep-alive",
        b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 2\r\n\r\nok",
        200,
        b"ok",
        True,
        True,
    ),
    (
        "interim-100",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        200,
        b"ok",
        True,
        True,
    ),
    (
        "no-reason",
        b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok",
        200,
        b"ok",
        True,
        True,
    ),
]

BAD: list[tuple[str, bytes]] = [
    ("not-http", b"SSH-2.0-OpenSSH\r\n\r\n"),
    ("bad-version", b"HTTP/2 200 OK\r\n\r\n"),
    ("bad-status", b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n"),
    ("long-status", b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n"),
    ("header-no-colon", b"HTTP/1.1 200 OK\r\nbroken\r\n\r\n"),
    ("header-space-before-colon", b"HTTP/1.1 200 OK\r\nContent-Length : 1\r\n\r\nx"),
    ("obs-fold", b"HTTP/1.1 200 OK\r\n folded: x\r\nContent-Length: 0\r\n\r\n"),
    ("bad-length", b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"),
    ("conflicting-length", b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx"),
    ("gzip-te", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"),
    ("gzip-chunked-te", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"),
    ("bad-chunk-size", HEAD_CHUNKED + b"zz\r\nab\r\n0\r\n\r\n"),
    ("signed-chunk-size", HEAD_CHUNKED + b"+2\r\nab\r\n0\r\n\r\n"),
    ("0x-chunk-size", HEAD_CHUNKED + b"0x2\r\nab\r\n0\r\n\r\n"),
    ("underscore-chunk-size", HEAD_CHUNKED + b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n"),
    ("empty-chunk-size", HEAD_CHUNKED + b"\r\nab\r\n0\r\n\r\n"),
    ("blank-chunk-size", HEAD_CHUNKED + b" \t\r\nab\r\n0\r\n\r\n"),
    ("extension-only-chunk-size", HEAD_CHUNKED + b";a=b\r\nab\r\n0\r\n\r\n"),
    ("bad-chunk-size-with-ext", HEAD_CHUNKED + b"zz;a=b\r\nab\r\n0\r\n\r\n"),
    ("inner-blank-chunk-size", HEAD_CHUNKED + b"1 0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n"),
    ("huge-chunk-size", HEAD_CHUNKED + b"1" * 17 + b"\r\n"),
    ("no-crlf-after-data", HEAD_CHUNKED + b"2\r\nabXY0\r\n\r\n"),
    ("no-crlf-after-second", HEAD_CHUNKED + b"2\r\nab\r\n2\r\ncdXY0\r\n\r\n"),
    ("empty-size-line-after-chunk", HEAD_CHUNKED + b"2\r\nab\r\n\r\n0\r\n\r\n"),
    ("long-size-line", HEAD_CHUNKED + b"2;" + b"x" * 2000 + b"\r\nab\r\n0\r\n\r\n"),
]


def splits(raw: bytes) -> list[list[bytes]]:
    """The raw bytes as one piece, byte by byte, and split in two at every position."""
    out = [[raw], [raw[i : i + 1] for i in range(len(raw))]]
    out += [[raw[:i], raw[i:]] for i in range(1, len(raw))]
    return out


def run(pieces: list[bytes], *, eof: bool = True, **kw: int) -> tuple[ResponseParser, bytes]:
    p = ResponseParser(**kw)
    body = b"".join(p.feed(x) for x in pieces)
    if eof and not p.done:
        p.eof()
    return p, body


@pytest.mark.parametrize(
    ("raw", "status", "body", "keep", "complete"), [g[1:] for g in GOOD], ids=[g[0] for g in GOOD]
)
def test_good_responses_at_every_split(
    raw: bytes, status: int, body: bytes, keep: bool, complete: bool
) -> None:
    for pieces in splits(raw):
        p = ResponseParser()
        got = b"".join(p.feed(x) for x in pieces)
        assert p.status == status
        assert got == body
        assert p.done is complete
        if not complete:
            p.eof()
            assert p.done
        assert p.keep_alive is keep


@pytest.mark.parametrize("raw", [b[1] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_responses_raise_at_every_split(raw: bytes) -> None:
    for pieces in splits(raw):
        with pytest.raises(FramingError):
            run(pieces)


def test_headers_are_lowercased_and_joined() -> None:
    p, _ = run([b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a:  2 \r\nContent-Length: 0\r\n\r\n"])
    assert p.headers[b"x-a"] == b"1, 2"


@pytest.mark.parametrize(
    "raw",
    [
        HEAD_CHUNKED,
        HEAD_CHUNKED + b"5\r\nab",
        HEAD_CHUNKED + b"2\r\nab\r\n",
        HEAD_CHUNKED + b"0\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nContent-Le",
        b"",
    ],
)
def test_eof_before_the_end_is_an_error(raw: bytes) -> None:
    p = ResponseParser()
    p.feed(raw)
    with pytest.raises(FramingError):
        p.eof()
    assert not p.keep_alive


def test_bytes_after_the_response_spoil_keep_alive() -> None:
    for raw in (
        HEAD_CHUNKED + chunked(b"ab") + b"HTTP/1.1 200 OK\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nabEXTRA",
    ):
        p, body = run([raw])
        assert body == b"ab" and p.done and not p.keep_alive
        p2 = ResponseParser()
        for piece in splits(raw)[1]:
            p2.feed(piece)
        assert p2.done and not p2.keep_alive


def test_limits() -> None:
    with pytest.raises(FramingError, match="head too large"):
        ResponseParser(max_head=100).feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 200)
    with pytest.raises(FramingError, match="head too large"):
        ResponseParser(max_head=100).feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 200 + b"\r\n\r\n")
    with pytest.raises(FramingError, match="larger than"):
        run([b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n"], max_body=10)
    with pytest.raises(FramingError, match="larger than"):
        run([HEAD_CHUNKED + chunked(b"a" * 6, b"b" * 6)], max_body=10)
    with pytest.raises(FramingError, match="larger than"):
        run([b"HTTP/1.1 200 OK\r\n\r\n", b"x" * 11], max_body=10)
    with pytest.raises(FramingError, match="trailer line too long"):
        run([HEAD_CHUNKED + b"0\r\n" + b"t" * 2000])


def test_one_chunk_reads_take_the_state_machines_rules() -> None:
    """Reads of exactly one chunk (a token stream's every read, the parser's fast path) follow
    the same rules as any other split: the CRLF after the data, a size line split across
    reads, the body limit."""
    with pytest.raises(FramingError, match="not followed by CRLF"):
        run([HEAD_CHUNKED, b"2\r\nabXY", b"0\r\n\r\n"])
    # "1" | "5\r\nabcde\r\n" looks like a whole chunk of 5 on its own; it is the start of 0x15.
    data = b"abcde\r\n" + b"f" * 14
    _, body = run([HEAD_CHUNKED, b"1", b"5\r\nabcde\r\n", data[7:] + b"\r\n0\r\n\r\n"])
    assert body == data
    with pytest.raises(FramingError, match="larger than"):
        run([HEAD_CHUNKED, b"6\r\naaaaaa\r\n", b"6\r\nbbbbbb\r\n"], max_body=10)


def test_request_head() -> None:
    head = request_head("POST", "/prefix/generate", "engine:30000", 17)
    assert head == (
        b"POST /prefix/generate HTTP/1.1\r\nHost: engine:30000\r\n"
        b"Content-Type: application/json\r\nContent-Length: 17\r\nAccept: */*\r\n\r\n"
    )


@seed(SEED)
@FUZZ
@given(
    parts=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
)
def test_random_chunked_bodies_at_random_splits(parts: list[bytes], cuts: list[int]) -> None:
    raw = HEAD_CHUNKED + chunked(*parts)
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    pieces = [raw[a:b] for a, b in itertools.pairwise(points) if b > a]
    p, body = run(pieces)
    assert body == b"".join(parts) and p.done and p.keep_alive


@seed(SEED)
@FUZZ
@given(st.binary(max_size=400), st.integers(min_value=1, max_value=64))
def test_random_bytes_never_crash(data: bytes, step: int) -> None:
    p = ResponseParser(max_head=256, max_body=1024)
    try:
        for i in range(0, len(data), step):
            p.feed(HEAD_CHUNKED[: i % 40] + data[i : i + step] if i == 0 else data[i : i + step])
        p.eof()
    except FramingError:
        return
    assert p.done
