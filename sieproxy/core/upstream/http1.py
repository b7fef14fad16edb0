"""HTTP/1.1 client framing, sans-IO: the request head out, the response head and body in.

The gateway's hot path (``/generate`` streams, one per candidate) needs exactly one thing from
HTTP: a POST with a JSON body and a response body decoded from ``Transfer-Encoding: chunked``,
``Content-Length`` or close-delimited framing. A general client (httpx over httpcore over h11)
costs several nested async generators, context managers and event objects per received chunk;
this module does the framing with slicing on the received bytes, and the shell
(``sieproxy.upstream``) does the socket I/O. See docs/DESIGN.md "Upstream client".

``ResponseParser.feed(data)`` returns the body bytes that ``data`` completes (possibly ``b""``);
the head is parsed as soon as it is complete (``status`` is then set). ``eof()`` tells the parser
the peer closed; it raises :class:`FramingError` when the body was not complete. Every limit is
explicit: a head larger than ``max_head`` bytes, a chunk-size line longer than 1 KiB, a body
larger than ``max_body`` bytes all raise :class:`FramingError`.
"""

from __future__ import annotations

__all__ = ["ConnectionClosed", "FramingError", "ResponseParser", "request_head"]

_CRLF = b"\r\n"
_MAX_LINE = 1024  # chunk-size line (with extensions) or one trailer line
_HEX = b"0123456789abcdefABCDEF"
# How far the fast path looks for a size line's CRLF: up to 15 hex digits (longer lines,
# leading zeros or extensions, take the state machine).
_FAST_LINE = 17


class FramingError(ValueError):
    """The peer's bytes are not a valid HTTP/1.1 response (or exceed a limit)."""


class ConnectionClosed(FramingError):
    """The peer closed the connection before the response's end (``head``: before a complete
    response head; ``nothing``: before its first byte)."""

    def __init__(self, message: str, *, head: bool, nothing: bool = False) -> None:
        super().__init__(message)
        self.head = head
        self.nothing = nothing


def request_head(method: str, target: str, host: str, content_length: int) -> bytes:
    """The head of a request with a JSON body (``target`` is the path, ``host`` the authority)."""
    return (
        f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\nAccept: */*\r\n\r\n"
    ).encode("ascii")


# Parser states (the chunked-body states last, so ``state >= _SIZE`` tests for them).
_HEAD, _LENGTH, _CLOSE, _DONE, _SIZE, _DATA, _DATA_CRLF, _TRAILER = range(8)


class ResponseParser:
    """One response's framing (see the module docstring)."""

    __slots__ = (
        "_buf",
        "_remaining",
        "_state",
        "_total",
        "done",
        "headers",
        "keep_alive",
        "max_body",
        "max_head",
        "status",
    )

    def __init__(self, *, max_head: int = 65536, max_body: int | None = None) -> None:
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        #: The connection may carry another request once this response is done.
        self.keep_alive = False
        self.max_head = max_head
        self.max_body = max_body
        #: The whole body has been received (kept with ``_state``, by ``_set``: an attribute,
        #: not a property, as it is read on every read of a streamed body).
        self.done = False
        self._state = _HEAD
        self._buf = b""
        self._remaining = 0
        self._total = 0

    def _set(self, state: int) -> None:
        self._state = state
        self.done = state == _DONE

    # ------------------------------------------------------------------ input
    def feed(self, data: bytes) -> bytes:
        state = self._state
        if state == _SIZE and not self._buf and self.max_body is None:
            # Fast path (nearly every read of a token stream): exactly one whole chunk whose
            # size line is hex digits only; several such chunks (a relay that fell behind
            # reads them in bursts) in one loop. Anything else takes the state machine below.
            # (``partition`` and indexing, not ``find``/``startswith``: on CPython 3.11 those
            # parse their arguments the old way, a third of this path's time. A burst's rest is
            # copied once by ``partition``; its chunks are sliced from ``data``.)
            size_field, crlf, rest = data.partition(_CRLF)
            if crlf and 0 < len(size_field) < _FAST_LINE - 1 and not size_field.strip(_HEX):
                size = int(size_field, 16)
                if size and len(rest) >= size + 2 and rest[size] == 13 and rest[size + 1] == 10:
                    if len(rest) == size + 2:
                        return rest[:size]
                    end = len(size_field) + 4 + size
                    return self._whole_chunks(data, end, [rest[:size]])
        if self._buf:
            data = self._buf + data
            self._buf = b""
        if state == _HEAD:
            data = self._head(data)
            state = self._state
            if state == _HEAD or not data:
                return b""
        if state >= _SIZE:
            out = self._chunked(data)
        elif state == _LENGTH:
            out = data[: self._remaining]
            self._remaining -= len(out)
            if len(out) < len(data):
                self.keep_alive = False  # bytes beyond the body: do not trust the connection
            if self._remaining == 0:
                self._set(_DONE)
        elif state == _CLOSE:
            out = data
        else:  # _DONE: bytes after the end of the response
            self.keep_alive = False
            return b""
        if out and self.max_body is not None:
            self._total += len(out)
            if self._total > self.max_body:
                raise FramingError(f"response body larger than {self.max_body} bytes")
        return out

    def eof(self) -> None:
        """The peer closed the connection."""
        self.keep_alive = False
        if self._state == _CLOSE:
            self._set(_DONE)
        elif self._state == _HEAD:
            raise ConnectionClosed(
                "connection closed before a complete response head",
                head=True,
                nothing=not self._buf,
            )
        elif self._state != _DONE:
            raise ConnectionClosed(
                "connection closed before the end of the response body", head=False
            )

    # ------------------------------------------------------------------ head
    def _head(self, data: bytes) -> bytes:
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > self.max_head:
                    raise FramingError("response head too large")
                self._buf = data
                return b""
            if end > self.max_head:
                raise FramingError("response head too large")
            lines = data[:end].split(_CRLF)
            rest = data[end + 4 :]
            status_line = lines[0]
            parts = status_line.split(b" ", 2)
            if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
                raise FramingError("malformed status line")
            code = parts[1]
            if len(code) != 3 or not code.isdigit():
                raise FramingError("malformed status code")
            status = int(code)
            headers: dict[bytes, bytes] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep or not name or name != name.strip() or b" " in name:
                    raise FramingError("malformed header line")
                key = name.lower()
                value = value.strip(b" \t")
                if key in headers:
                    if key == b"content-length" and headers[key] != value:
                        raise FramingError("conflicting Content-Length headers")
                    headers[key] = headers[key] + b", " + value
                else:
                    headers[key] = value
            if 100 <= status < 200:
                data = rest  # an interim response (100 Continue ...): the real head follows
                continue
            self.status = status
            self.headers = headers
            self._framing(parts[0], status, headers)
            return rest

    def _framing(self, version: bytes, status: int, headers: dict[bytes, bytes]) -> None:
        tokens = {t.strip().lower() for t in headers.get(b"connection", b"").split(b",")}
        self.keep_alive = (
            b"close" not in tokens if version == b"HTTP/1.1" else b"keep-alive" in tokens
        )
        te = headers.get(b"transfer-encoding")
        cl = headers.get(b"content-length")
        if status == 204 or status == 304:
            self._set(_DONE)
        elif te is not None:
            if [t.strip().lower() for t in te.split(b",")] != [b"chunked"]:
                raise FramingError("unsupported Transfer-Encoding")
            self._set(_SIZE)
        elif cl is not None:
            if not cl.isdigit() or len(cl) > 18:
                raise FramingError("malformed Content-Length")
            self._remaining = int(cl)
            if self.max_body is not None and self._remaining > self.max_body:
                raise FramingError(f"response body larger than {self.max_body} bytes")
            self._set(_LENGTH)
            if self._remaining == 0:
                self._set(_DONE)
        else:
            self.keep_alive = False
            self._set(_CLOSE)

    # ------------------------------------------------------------------ chunked body
    def _line_end(self, data: bytes, pos: int, what: str) -> int:
        """Where the CRLF ending the line at ``pos`` is; -1 (the rest buffered) if not here."""
        eol = data.find(_CRLF, pos)
        if eol < 0:
            if len(data) - pos > _MAX_LINE:
                raise FramingError(f"{what} too long")
            self._buf = data[pos:]
        elif eol - pos > _MAX_LINE:
            raise FramingError(f"{what} too long")
        return eol

    def _whole_chunks(self, data: bytes, pos: int, parts: list[bytes]) -> bytes:
        """``feed``'s fast path for a read that starts with two or more whole chunks, after
        the first (``parts``, ending at ``pos``): each chunk with a plain size line is sliced
        out in one loop; the state machine takes the rest from the first thing that is not
        one (the parser is at a chunk's start there)."""
        n = len(data)
        while pos < n:
            eol = data.find(_CRLF, pos, pos + _FAST_LINE)
            if eol <= pos:
                break
            size_field = data[pos:eol]
            if size_field.strip(_HEX):
                break
            end = eol + 2 + int(size_field, 16)
            if end == eol + 2 or end + 2 > n or not data.startswith(_CRLF, end):
                break
            parts.append(data[eol + 2 : end])
            pos = end + 2
        if pos < n:
            parts.append(self._chunked(data[pos:]))
        return b"".join(parts)

    def _chunked(self, data: bytes) -> bytes:
        n = len(data)
        state = self._state
        out: list[bytes] = []
        pos = 0
        while pos < n:
            if state == _DATA:
                take = min(self._remaining, n - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    state = _DATA_CRLF
            elif state == _SIZE:
                eol = self._line_end(data, pos, "chunk-size line")
                if eol < 0:
                    break
                size = _chunk_size(data, pos, eol)
                pos = eol + 2
                if size == 0:
                    state = _TRAILER
                else:
                    self._remaining = size
                    state = _DATA
            elif state == _DATA_CRLF:
                if n - pos < 2:
                    if data[pos:] != b"\r":
                        raise FramingError("chunk not followed by CRLF")
                    self._buf = data[pos:]
                    break
                if data[pos : pos + 2] != _CRLF:
                    raise FramingError("chunk not followed by CRLF")
                pos += 2
                state = _SIZE
            elif state == _TRAILER:
                eol = self._line_end(data, pos, "trailer line")
                if eol < 0:
                    break
                if eol == pos:  # the empty line that ends the message
                    pos += 2
                    state = _DONE
                    if pos < n:
                        self.keep_alive = False
                    break
                pos = eol + 2  # a trailer field: ignored
            else:
                break
        self._set(state)
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)


def _chunk_size(data: bytes, pos: int, eol: int) -> int:
    """The size on the chunk-size line ``data[pos:eol]`` (extensions ignored)."""
    size_field = data[pos:eol]
    if size_field.strip(_HEX):  # not only hex digits (most often it is): an extension, blanks
        size_field = size_field.split(b";", 1)[0].strip(b" \t")
        if size_field.strip(_HEX):
            raise FramingError("malformed chunk size")
    if not size_field or len(size_field) > 16:
        raise FramingError("malformed chunk size")
    return int(size_field, 16)
