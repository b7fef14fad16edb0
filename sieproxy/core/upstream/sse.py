"""Server-sent events: an incremental decoder for engine streams, and the gateway's framing.

The decoder follows the WHATWG event-stream rules with two deliberate choices:

- Lines end at CR, LF or CRLF, and nowhere else. A CR that ends one ``feed`` and an LF that
  starts the next are one terminator. Unicode separators (U+2028, U+2029, NEL) are text: each
  complete line is decoded as UTF-8 only after it has been cut on those three bytes, so a
  multi-byte character split across feeds is reassembled first.
- Memory is bounded: a line (or an event's accumulated data) longer than ``max_line`` bytes
  raises :class:`EngineMalformed` instead of growing the buffer.

At EOF an unterminated event is **discarded**, as the spec says: a stream cut mid-event is a
truncated stream, and reporting it as truncated (no ``[DONE]``) is more accurate than handing a
half-written JSON object to the parser. :meth:`SSEDecoder.close` therefore returns ``[]`` and
records in :attr:`SSEDecoder.discarded` whether anything was thrown away.
"""

from __future__ import annotations

import re

from ..errors import EngineMalformed

__all__ = ["DONE_FRAME", "SSEDecoder", "frame"]

DONE_FRAME = b"data: [DONE]\n\n"

_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = "\ufeff"


def frame(payload: bytes) -> bytes:
    """One SSE event carrying ``payload`` (which must not contain CR or LF)."""
    return b"data: " + payload + b"\n\n"


class SSEDecoder:
    """Incremental, sans-IO SSE decoder: bytes in, event ``data`` payloads out."""

    __slots__ = (
        "_broken",
        "_buf",
        "_data",
        "_data_size",
        "_first_line",
        "_skip_lf",
        "discarded",
        "max_line",
    )

    def __init__(self, max_line: int = 1 << 20) -> None:
        self.max_line = max_line
        self._buf = bytearray()
        self._skip_lf = False  # the previous feed ended in CR: a leading LF is its other half
        self._data: list[str] = []
        self._data_size = 0
        self._first_line = True
        self._broken = False
        self.discarded = False

    def at_rest(self) -> bool:
        """True between whole events: past the first line, no partial line or event held, no
        CR waiting for its LF, not failed. Only then may a reader take a read of whole events
        without this decoder (the express lane, ``core.upstream.sglang``)."""
        return not (
            self._buf or self._data or self._skip_lf or self._first_line or self._broken
        )

    def feed(self, data: bytes) -> list[str]:
        """Consume ``data``; return the payloads of the events it completed, in order."""
        if self._broken:
            raise EngineMalformed()
        if not data:
            return []
        if (
            not self._buf
            and not self._skip_lf
            and not self._first_line
            and data[-1] == 0x0A  # LF
            and 0x0D not in data  # CR; a byte value is searched with memchr, b"\r" is not
        ):
            # Fast path (every chunk of a well-behaved engine): whole LF-terminated lines.
            if (
                not self._data
                and data[:6] == b"data: "
                and data.find(b"\n") == len(data) - 2  # its only LFs are the last two
                and len(data) <= self.max_line
            ):
                # ... and most often one event of one data line (what _line would do).
                try:
                    return [data[6:-2].decode("utf-8")]
                except UnicodeDecodeError:
                    self._fail()
                    raise  # unreachable; keeps type checkers honest
            events: list[str] = []
            lines = data.split(b"\n")
            lines.pop()  # the empty tail after the final LF
            for line in lines:
                self._line(line, 0, len(line), events)
            return events
        start = 0
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                start = 1
        buf = self._buf
        # Only the new bytes can hold a terminator: the buffered tail was already scanned.
        scan_from = len(buf)
        buf += memoryview(data)[start:]
        events = []
        pos = 0
        while True:
            m = _EOL.search(buf, scan_from)
            if m is None:
                break
            end = m.start()
            if m.end() == len(buf) and m.end() - end == 1 and buf[end] == 0x0D:
                self._skip_lf = True
            self._line(buf, pos, end, events)
            pos = scan_from = m.end()
        if pos:
            del buf[:pos]
        if len(buf) > self.max_line:
            self._fail()
        return events

    def close(self) -> list[str]:
        """End of stream. An unterminated event is discarded (see the module docstring)."""
        self.discarded = bool(self._buf or self._data)
        self._buf.clear()
        self._data.clear()
        self._data_size = 0
        return []

    # ------------------------------------------------------------------ internals

    def _fail(self) -> None:
        self._broken = True
        self._buf.clear()
        self._data.clear()
        raise EngineMalformed()

    def _line(self, buf: bytes | bytearray, start: int, end: int, events: list[str]) -> None:
        if end - start > self.max_line:
            self._fail()
        if start == end:  # blank line: dispatch
            if self._data:
                events.append("\n".join(self._data))
                self._data.clear()
                self._data_size = 0
            self._first_line = False
            return
        try:
            line = buf[start:end].decode("utf-8")
        except UnicodeDecodeError:
            self._fail()
            raise  # unreachable; keeps type checkers honest
        if self._first_line:
            self._first_line = False
            if line.startswith(_BOM):
                line = line[1:]
        if line.startswith(":"):
            return
        name, sep, value = line.partition(":")
        if name != "data":
            return  # event:, id:, retry: and unknown fields do not matter to the gateway
        if sep and value.startswith(" "):
            value = value[1:]
        self._data_size += len(value) + 1
        if self._data_size > self.max_line:
            self._fail()
        self._data.append(value)
