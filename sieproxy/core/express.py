"""The express lane: the common token of a streamed response, relayed in one step.

Theory of operation
-------------------
Nearly every engine read of a streamed response carries one token: one SSE event of one
``data:`` line holding one SGLang ``/generate`` chunk with new text, no finish reason and no
logprobs. And nearly every streamed choice passes that text through unchanged (no stop string,
no reasoning or tool parser, no logprobs waiting: ``ChoiceState``'s plain case). The general
path handles such a read in four layers, each with its own fast path for it::

    SSEDecoder.feed ─▶ GenerateReader.feed ─▶ ChoiceState.feed ─▶ _StreamBase.on_delta

with a call, a check and an intermediate value at every step (a payload ``str``, a
``CandidateDelta``, an event tuple, a ``ChoiceDelta``). On a gateway relaying hundreds of
streams, every one of those touches memory that the other streams' tokens have pushed out of the
cache since this stream's last token: at 256 interleaved streams the general path's Python was
about three times its cost in a loop over one stream (docs/DESIGN.md, "The express lane").

:meth:`Express.relay` does the same work for a read of exactly that shape in one step: one shape
check of the bytes, one msgspec decode, the reader's and the choice's counters moved as their
own code moves them, and the SSE frame built from the bytes around the text that the shaper
encodes once per choice (``_StreamBase.text_affixes``). For anything else — a read that is not
one whole ``data:`` event, an SSE decoder holding a partial line or event, ``[DONE]``, a
malformed or error payload, a finish, logprobs, a choice that is not plain, a stream or choice
that is not open — it returns ``None`` **having changed nothing**, and the caller hands the same
bytes to the general path. So every read is handled exactly once, by one path or the other, and
what each layer keeps ends the same either way: ``tests/core/test_express.py`` runs random
streams (every shape above, split and joined at random) through both and compares every frame,
every error and the state at the end.

The lane reads and moves state that belongs to those layers (listed in :meth:`Express.relay`),
as their own fast paths do; a change to one of them must keep the lane in step, and the
differential test is what says whether it did.
"""

from __future__ import annotations

import zlib

import msgspec

from .choice import ChoicePhase, ChoiceState
from .merger import StreamPhase, _StreamBase
from .sse import SSEDecoder
from .upstream import GenerateReader, decode_chunk

__all__ = ["Express"]

_enc = msgspec.json.Encoder()
_UNSET = msgspec.UNSET
_OPEN = ChoicePhase.OPEN
_STREAMING = StreamPhase.STREAMING


class Express:
    """The express lane of choice ``index`` of a streamed response (see the module docstring).

    ``Express.of(...)`` is ``None`` where the lane can never apply (the choice has a stop
    string, a parser or logprobs), so the caller need not offer it any read."""

    __slots__ = ("_affixes", "_choice", "_decoder", "_index", "_reader", "_shaper")

    def __init__(
        self, decoder: SSEDecoder, reader: GenerateReader, shaper: _StreamBase, index: int
    ) -> None:
        self._decoder = decoder
        self._reader = reader
        self._shaper = shaper
        self._choice: ChoiceState = shaper.choices[index]
        self._index = index
        self._affixes: tuple[bytes, bytes] | None = None

    @classmethod
    def of(
        cls, decoder: SSEDecoder, reader: GenerateReader, shaper: object, index: int = 0
    ) -> Express | None:
        """The lane for this choice, or ``None`` if its output never takes it (a shaper that
        is not a streaming one, a choice with stop strings, parsers or logprobs)."""
        if not isinstance(shaper, _StreamBase) or not 0 <= index < len(shaper.choices):
            return None
        choice = shaper.choices[index]
        if not choice.plain or choice.want_logprobs:  # (so no logprobs ever wait in it)
            return None
        return cls(decoder, reader, shaper, index)

    def relay(self, data: bytes) -> bytes | None:
        """The client's SSE frames for one engine read (``b""`` if it shows nothing new), or
        ``None`` if the read is not the common case: then nothing was changed, and ``data``
        goes to the general path. A read of several whole events (a relay that fell behind
        reads tokens in bursts) is taken if every one of them is common, else none is.

        State it reads: ``SSEDecoder``'s buffers and flags (as its fast path checks them),
        ``GenerateReader.done`` / ``finished`` / ``incremental``, the stream's and the choice's
        phase. State it moves, as ``GenerateReader.feed`` and ``ChoiceState.feed`` move it:
        the reader's emitted length, CRC and token counts, the choice's token counts
        (``_burst`` puts them back)."""
        d = self._decoder
        reader = self._reader
        choice = self._choice
        n = len(data)
        # A partial line or event, a pending LF, the first line, a failure: the decoder's
        # general path must see these bytes. So must anything but whole events of one data
        # line and its blank line each (SSEDecoder.feed's own fast path checks the same).
        if (
            d._buf
            or d._data
            or d._skip_lf
            or d._first_line
            or d._broken
            or reader.done
            or reader._finished
            or choice.phase is not _OPEN
            or self._shaper.phase is not _STREAMING
            or not n
            or n > d.max_line
            or data[-1] != 0x0A
            or 0x0D in data  # a CR ends a line too
        ):
            return None
        # One line and the blank line (its first LF is the last but one byte), and that line
        # is ``data: `` and the payload. (``partition`` and ``removeprefix``, not ``find`` and
        # ``startswith``, which parse their arguments the old way on CPython 3.11.)
        line, _, tail = data.partition(b"\n")
        payload = line.removeprefix(b"data: ")
        if len(tail) != 1 or len(payload) == len(line):
            return self._burst(data)  # several events, or not the common case
        try:
            # ASCII needs no UTF-8 check; anything else is checked whole, as the SSE decoder
            # does (msgspec does not look inside the fields it skips).
            chunk = decode_chunk(payload if payload.isascii() else payload.decode())
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            return None  # the general path raises its own error for it
        text = chunk.text
        meta = chunk.meta_info
        if (
            text is _UNSET
            or meta is _UNSET
            or (chunk.error is not _UNSET and chunk.error is not None)
            or chunk.object == "error"
            or meta.finish_reason is not None
            or meta.output_token_logprobs
        ):
            return None
        # GenerateReader.feed and _new_text, for a chunk with no finish and no logprobs.
        if reader.incremental:
            if text:
                reader._crc = zlib.crc32(text.encode(), reader._crc)
                reader._emitted += len(text)
        else:
            text = text[reader._emitted :]
            reader._emitted += len(text)
        tokens = meta.completion_tokens
        if text or tokens != reader._tokens:
            # The reader's delta, through ChoiceState.feed's plain case (a read with no delta
            # leaves the choice as it is).
            choice.prompt_tokens = meta.prompt_tokens
            if tokens > choice.completion_tokens:
                choice.completion_tokens = tokens
        reader._tokens = tokens
        reader._prompt_tokens = meta.prompt_tokens
        # Then the shaper's frame of a token of text.
        if not text:
            return b""
        affixes = self._affixes
        if affixes is None:
            affixes = self._affixes = self._shaper.text_affixes(self._index)
        return b"".join((affixes[0], _enc.encode(text), affixes[1]))

    def _burst(self, data: bytes) -> bytes | None:
        """Two or more whole events in one read, each through ``relay``: all of them, or none
        (what ``relay`` moved for the first ones is put back when a later one is declined)."""
        end = data.find(b"\n\n")
        if end < 0 or end + 2 == len(data):  # not a burst (relay declined this one event)
            return None
        reader, choice = self._reader, self._choice
        saved = (reader._emitted, reader._crc, reader._tokens, reader._prompt_tokens,
                 choice.completion_tokens, choice.prompt_tokens)  # fmt: skip
        frames = []
        start = 0
        while end >= 0:
            frame = self.relay(data[start : end + 2])  # (an event of two lines: declined)
            if frame is None:
                break
            frames.append(frame)
            start = end + 2
            if start == len(data):
                return b"".join(frames)
            end = data.find(b"\n\n", start)
        (reader._emitted, reader._crc, reader._tokens, reader._prompt_tokens,
         choice.completion_tokens, choice.prompt_tokens) = saved  # fmt: skip
        return None
