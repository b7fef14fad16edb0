"""The Anthropic Messages output: one choice's events in, Messages SSE events or a body out.

Theory of operation
-------------------
:class:`MessagesShaper` is the relay's shaper (``relay.Shaper``) for ``POST /v1/messages``. It
owns the request's one :class:`~.choice.ChoiceState` (stop strings ▸ reasoning ▸ tool calls, as
on chat) and turns what it makes visible into *content blocks*, in order:

- reasoning text (shown when ``thinking`` asked for it, see ``request.for_model``) → a
  ``thinking`` block (``signature`` empty: there is nothing to sign);
- content → a ``text`` block;
- each tool call → a ``tool_use`` block (non-streamed: its ``input`` decoded from the
  generated arguments; streamed: the arguments as ``input_json_delta`` pieces as they come).

Output of another kind closes the open block; so does the end. Whitespace-only content while
no text block is open is held back, and opens a text block only when more content follows (or
at the end when the answer has no other block), so the whitespace a model writes around its
tool calls is not a block. The same block machine runs whether or not the client streams.

Event order (each frame is ``event: <type>`` + ``data: <json>``)::

    message_start                      (with the first output: the prompt's token count is
    ping                                known then; or with the first keep-alive, ``ping()``)
    per block  content_block_start, content_block_delta…, content_block_stop
    message_delta                      (stop_reason, stop_sequence, usage)
    message_stop
    on_error(): error                  (instead of what remains; the stream then ends)

``stop_reason``: ``tool_use`` when a call was made, ``stop_sequence`` when one of the request's
``stop_sequences`` ended the answer (``stop_sequence`` names it), ``max_tokens`` on a length
cut, else ``end_turn``. Usage: ``input_tokens`` is the prompt's tokens the engine did *not*
find in its prefix cache, ``cache_read_input_tokens`` those it did (Anthropic's split: their sum
is the prompt), ``cache_creation_input_tokens`` 0, ``output_tokens`` the generated tokens
(reasoning included). ``message_start`` carries the whole prompt as ``input_tokens`` (the cache
split is known only at the end); ``message_delta`` carries the final usage.

Keep-alive: while the stream waits, the shell calls :meth:`MessagesShaper.ping` whenever no
event has gone out for ``gateway.messages_ping_interval`` seconds (``sieproxy.inline``); it
makes a ``ping`` event, preceded by ``message_start`` if that was not sent yet (the engine is
slow to its first output: then ``message_start`` has ``input_tokens`` 0, as the prompt's count
is not known yet, and ``message_delta`` carries the real usage, which the SDKs take as the
final figures). ``pings`` tells the shell whether the shaper makes them (a stream only).

Errors use Anthropic's envelope (``errors.py``); ``count_tokens`` has its own shaper
(``count.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...core.errors import GatewayError, InternalError
from ...core.request.valid import ValidChat
from ...core.shaping.choice import ChoiceState, ReasoningFactory, ToolCallFactory
from ...core.shaping.events import CandidateDelta, CandidateFinish, ChoiceDelta, ToolCallDelta
from .errors import error_body

__all__ = ["PING", "MessagesShaper"]

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()

#: The keep-alive event, as Anthropic sends it.
PING = b'event: ping\ndata: {"type":"ping"}\n\n'


@dataclass(slots=True)
class _Block:
    """One content block while it is built (``kind``: text, thinking or tool_use)."""

    kind: str
    index: int
    parts: list[str] = field(default_factory=list)  # text, thinking, or the call's arguments
    call_index: int = -1
    id: str = ""
    name: str = ""

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def wire(self, *, full: bool = True) -> dict[str, Any]:
        """The block as the API shows it (``full=False``: as ``content_block_start`` has it)."""
        if self.kind == "text":
            return {"type": "text", "text": self.text if full else ""}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": self.text if full else "", "signature": ""}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": self.input()}

    def input(self) -> dict[str, Any]:
        """The call's arguments as an object ({} when cut short or not an object)."""
        text = self.text
        if not text:
            return {}
        try:
            value = _dec.decode(text)
        except msgspec.DecodeError:
            return {}
        return value if isinstance(value, dict) else {}


_DELTA_KEYS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


class MessagesShaper:
    """The ``/v1/messages`` shaper (see the module docstring)."""

    def __init__(
        self,
        valid: ValidChat,
        *,
        request_id: str,
        model: str,
        stop_sequences: list[str] | None = None,
        reasoning_parser: ReasoningFactory | None = None,
        tool_parser: ToolCallFactory | None = None,
    ) -> None:
        self.stream = valid.stream
        #: Whether the shell should ask for keep-alive pings while the stream waits.
        self.pings = valid.stream
        self.request_id = request_id
        self.message_id = f"msg_{request_id}"
        self.model = model
        self.stop_sequences = frozenset(stop_sequences or ())
        #: Candidates the shell must end, as decided (see ``ResponsesShaper.ends``).
        self.ends: list[tuple[int, str]] = []
        self.choices = [
            ChoiceState(
                0,
                stops=valid.stop,
                reasoning=reasoning_parser,
                tools=tool_parser,
                include_reasoning=valid.include_reasoning,
                collect=False,
                ends=self.ends,
            )
        ]
        self.blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, _Block] = {}
        self._held = ""
        self._buf = bytearray()
        self._started = False
        self._announced = False  # message_start sent
        self._closed = False
        self._engine_match: str | None = None

    # ------------------------------------------------------------------ the relay's interface

    def start(self) -> bytes:
        if self._started:
            raise InternalError("Internal error: the message was started twice.")
        self._started = True
        return b""

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes:
        choice = self._choice(index)
        cd = choice.feed(delta)
        self._announce()
        self._apply(cd)
        return self._take()

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes:
        choice = self._choice(index)
        cd = choice.finish(finish)
        if isinstance(finish.matched, str):
            self._engine_match = finish.matched
        self._announce()
        self._apply(cd)
        if self._held and not self.blocks:  # an answer of only whitespace
            self._open_block("text")
        if self._open is not None:
            self._close()
        return self._take()

    def on_error(self, err: GatewayError) -> bytes:
        if not self.stream:
            raise err
        self._closed = True
        choice = self.choices[0]
        if not choice.finished:
            choice.fail()
        self._event("error", error_body(err))
        return self._take()

    def ping(self) -> bytes:
        """A keep-alive ``ping`` (after ``message_start``, sent now if it was not yet); nothing
        once the stream has ended or when not streaming."""
        if self._closed or not self.stream:
            return b""
        if not self._announced:
            self._announce()  # message_start, then its ping
            return self._take()
        return PING

    def end(self) -> bytes:
        choice = self.choices[0]
        if not choice.finished or self._closed:
            raise InternalError("Internal error: the message ended before its choice finished.")
        self._closed = True
        reason, sequence = self._stop_reason(choice)
        usage = self._usage(choice)
        if not self.stream:
            return _enc.encode(self._message([b.wire() for b in self.blocks], reason, sequence,
                                             usage))  # fmt: skip
        self._announce()
        self._event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage,
            },
        )
        self._event("message_stop", {"type": "message_stop"})
        return self._take()

    # ------------------------------------------------------------------ blocks

    def _choice(self, index: int) -> ChoiceState:
        if index != 0 or self._closed:
            raise InternalError(f"Internal error: no open choice {index}.")
        return self.choices[0]

    def _stop_reason(self, choice: ChoiceState) -> tuple[str, str | None]:
        if choice.finish_reason == "tool_calls":
            return "tool_use", None
        matched = choice.stop_string if choice.stop_matched else self._engine_match
        if matched is not None and matched in self.stop_sequences:
            return "stop_sequence", matched
        if choice.engine_reason == "length" and not choice.stop_matched:
            return "max_tokens", None
        return "end_turn", None

    @staticmethod
    def _usage(choice: ChoiceState) -> dict[str, int]:
        cached = min(choice.cached_tokens, choice.prompt_tokens)
        return {
            "input_tokens": choice.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": choice.completion_tokens,
        }

    def _message(
        self,
        content: list[dict[str, Any]],
        reason: str | None,
        sequence: str | None,
        usage: dict[str, int],
    ) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def _announce(self) -> None:
        """``message_start`` and a ``ping``, once, before any other event."""
        if self._announced or not self.stream:
            return
        self._announced = True
        prompt = self.choices[0].prompt_tokens
        usage = {
            "input_tokens": prompt,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 0,
        }
        message = self._message([], None, None, usage)
        self._event("message_start", {"type": "message_start", "message": message})
        self._buf += PING

    def _apply(self, cd: ChoiceDelta) -> None:
        if cd.reasoning:
            if self._open is None or self._open.kind != "thinking":
                self._open_block("thinking")
            self._text(cd.reasoning)
        if cd.content:
            if self._open is not None and self._open.kind == "text":
                self._text(cd.content)
            elif cd.content.isspace():
                self._held += cd.content
            else:
                self._open_block("text")
                self._text(cd.content)
        for call in cd.tool_calls:
            self._call(call)

    def _open_block(self, kind: str, call: ToolCallDelta | None = None) -> _Block:
        if self._open is not None:
            self._close()
        block = _Block(kind, len(self.blocks))
        if call is not None:
            block.call_index = call.index
            # Anthropic names its call ids toolu_…; the parser's own id keeps its uniqueness.
            own = call.id or f"{self.request_id}_{call.index}"
            block.id = "toolu_" + own.removeprefix("call_")
            block.name = call.name or ""
            self._calls[call.index] = block
        self.blocks.append(block)
        self._open = block
        start = block.wire(full=False)
        if kind == "tool_use":
            start["input"] = {}
        self._event(
            "content_block_start",
            {"type": "content_block_start", "index": block.index, "content_block": start},
        )
        if kind == "text":
            held, self._held = self._held, ""
            if held:
                self._text(held)
        return block

    def _text(self, text: str) -> None:
        block = self._open
        assert block is not None
        block.parts.append(text)
        kind, key = _DELTA_KEYS[block.kind]
        self._delta(block, {"type": kind, key: text})

    def _delta(self, block: _Block, delta: dict[str, Any]) -> None:
        self._event(
            "content_block_delta",
            {"type": "content_block_delta", "index": block.index, "delta": delta},
        )

    def _call(self, call: ToolCallDelta) -> None:
        if call.id is not None or call.name is not None or call.index not in self._calls:
            self._held = ""  # whitespace before a call is not an answer
            block = self._open_block("tool_use", call)
        else:
            block = self._calls[call.index]
        if call.arguments:
            block.parts.append(call.arguments)
            self._delta(block, {"type": "input_json_delta", "partial_json": call.arguments})

    def _close(self) -> None:
        block = self._open
        assert block is not None
        self._open = None
        self._event("content_block_stop", {"type": "content_block_stop", "index": block.index})

    # ------------------------------------------------------------------ wire

    def _event(self, kind: str, body: dict[str, Any]) -> None:
        if not self.stream:
            return
        buf = self._buf
        buf += b"event: "
        buf += kind.encode()
        buf += b"\ndata: "
        _enc.encode_into(body, buf, -1)
        buf += b"\n\n"

    def _take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out
