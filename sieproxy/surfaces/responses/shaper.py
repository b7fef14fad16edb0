"""The Responses API output: one choice's events in, ``response.*`` SSE events or a body out.

Theory of operation
-------------------
:class:`ResponsesShaper` is the relay's shaper (``relay.Shaper``) for ``POST /v1/responses``.
It owns the request's one :class:`~.choice.ChoiceState` (stop strings ▸ reasoning ▸ tool calls,
as on chat) and turns what it makes visible into *output items*, in order:

- reasoning text (only with ``include_reasoning``) → a ``reasoning`` item;
- content → a ``message`` item with one ``output_text`` part;
- each tool call → a ``function_call`` item.

Output of another kind closes the open item; so does the end. Whitespace-only content while no
message is open is held back: it opens a message only when more content follows (or at the end
when the answer has no other item), so the whitespace a model writes around its tool calls does
not become an empty-looking message. The same item machine runs whether or not the client streams;
streaming only encodes its events, so a streamed response accumulates to exactly the
non-streamed one.

Event order (every event carries ``sequence_number`` 0, 1, 2, …)::

    start()     response.created, response.in_progress           (status in_progress)
    per item    response.output_item.added
                [message]   response.content_part.added, response.output_text.delta…,
                            response.output_text.done, response.content_part.done
                [reasoning] response.content_part.added, response.reasoning_text.delta…,
                            response.reasoning_text.done, response.content_part.done
                [call]      response.function_call_arguments.delta…,
                            response.function_call_arguments.done
                response.output_item.done
    end()       response.completed   (or response.incomplete on a length cut)
    on_error()  error, then response.failed                        (instead of end())

A length cut (the engine's ``length``) makes the response ``incomplete`` with
``incomplete_details.reason: "max_output_tokens"``, and the item open at the cut
``incomplete``. Non-streaming, ``end()`` returns the response object and an error raises (the
status line carries it). Frames are ``event: <type>`` + ``data: <json>``; there is no
``[DONE]`` (OpenAI sends none on this surface).

Usage: ``input_tokens`` (with ``input_tokens_details.cached_tokens``), ``output_tokens`` (with
``output_tokens_details.reasoning_tokens``; reasoning counts whether shown or not) and
``total_tokens``, as the engine reported them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ...core.errors import GatewayError, InternalError
from ...core.request.valid import ValidChat
from ...core.shaping.choice import ChoiceState, ReasoningFactory, ToolCallFactory
from ...core.shaping.events import CandidateDelta, CandidateFinish, ChoiceDelta, ToolCallDelta
from .items import TEXT_DELTA_HEAD, TEXT_DELTA_TAIL, Item, content_part, delta_affixes
from .schema import ResponsesRequest, RFormatText, RNamedTool

__all__ = ["ResponsesShaper"]

_enc = msgspec.json.Encoder()


class ResponsesShaper:
    """The ``/v1/responses`` shaper (see the module docstring)."""

    def __init__(
        self,
        valid: ValidChat,
        req: ResponsesRequest,
        *,
        request_id: str,
        model: str,
        created: int,
        reasoning_parser: ReasoningFactory | None = None,
        tool_parser: ToolCallFactory | None = None,
    ) -> None:
        self.req = req
        self.stream = valid.stream
        self.request_id = request_id
        self.response_id = f"resp_{request_id}"
        self.model = model
        self.created = created
        #: Candidates the shell must end, as decided: ``(0, "stop")`` once a stop string
        #: matched (the shell empties the list).
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
        self.items: list[Item] = []
        self._open: Item | None = None
        self._calls: dict[int, Item] = {}  # tool-call index → its item
        self._held = ""  # whitespace-only content while no message is open
        self._seq = 0
        self._buf = bytearray()
        self._started = False
        self._closed = False
        self._affixes: tuple[Item, bytes] | None = None  # the open message's delta affixes

    # ------------------------------------------------------------------ the relay's interface

    def start(self) -> bytes:
        if self._started:
            raise InternalError("Internal error: the response was started twice.")
        self._started = True
        if not self.stream:
            return b""
        self._event("response.created", response=self._response("in_progress"))
        self._event("response.in_progress", response=self._response("in_progress"))
        return self._take()

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes:
        self._apply(self._choice(index).feed(delta))
        return self._take()

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes:
        choice = self._choice(index)
        self._apply(choice.finish(finish))
        if self._held and not self.items:  # an answer of only whitespace
            self._open_item("message")
        if self._open is not None:
            self._close("incomplete" if choice.engine_reason == "length" else "completed")
        return self._take()

    def on_error(self, err: GatewayError) -> bytes:
        if not self.stream:
            raise err
        self._closed = True
        choice = self.choices[0]
        if not choice.finished:
            choice.fail()
        if self._open is not None:
            self._open.status = "incomplete"
        self._event("error", code=err.code, message=err.message, param=err.param)
        wire_error = {
            "code": "server_error" if err.status >= 500 else "invalid_prompt",
            "message": err.message,
        }
        self._event("response.failed", response=self._response("failed", error=wire_error))
        return self._take()

    def end(self) -> bytes:
        choice = self.choices[0]
        if not choice.finished or self._closed:
            raise InternalError("Internal error: the response ended before its choice finished.")
        self._closed = True
        incomplete = choice.engine_reason == "length"
        status = "incomplete" if incomplete else "completed"
        details = {"reason": "max_output_tokens"} if incomplete else None
        usage = {
            "input_tokens": choice.prompt_tokens,
            "input_tokens_details": {"cached_tokens": choice.cached_tokens},
            "output_tokens": choice.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens},
            "total_tokens": choice.prompt_tokens + choice.completion_tokens,
        }
        response = self._response(status, usage=usage, incomplete=details)
        if not self.stream:
            return _enc.encode(response)
        self._event(f"response.{status}", response=response)
        return self._take()

    # ------------------------------------------------------------------ items

    def _choice(self, index: int) -> ChoiceState:
        if index != 0 or self._closed:
            raise InternalError(f"Internal error: no open choice {index}.")
        return self.choices[0]

    def _apply(self, cd: ChoiceDelta) -> None:
        if cd.reasoning:
            if self._open is None or self._open.kind != "reasoning":
                self._open_item("reasoning")
            self._text(cd.reasoning)
        if cd.content:
            if self._open is not None and self._open.kind == "message":
                self._text(cd.content)
            elif cd.content.isspace():
                self._held += cd.content
            else:
                self._open_item("message")
                self._text(cd.content)
        for call in cd.tool_calls:
            self._call(call)

    def _open_item(self, kind: str, call: ToolCallDelta | None = None) -> Item:
        if self._open is not None:
            self._close("completed")
        index = len(self.items)
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = Item(kind, f"{prefix}_{self.request_id}_{index}", index)
        if call is not None:
            item.call_index = call.index
            item.call_id = call.id or f"call_{self.request_id}_{call.index}"
            item.name = call.name or ""
            self._calls[call.index] = item
        self.items.append(item)
        self._open = item
        self._event("response.output_item.added", output_index=index, item=item.wire(full=False))
        if kind != "function_call":
            self._event(
                "response.content_part.added",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=content_part(kind, ""),
            )
        if kind == "message":
            held, self._held = self._held, ""
            if held:
                self._text(held)
        return item

    def _text(self, text: str) -> None:
        item = self._open
        assert item is not None
        item.parts.append(text)
        if not self.stream:
            return
        if item.kind == "message":  # most events: one token of text (see ``delta_affixes``)
            affixes = self._affixes
            if affixes is None or affixes[0] is not item:
                affixes = self._affixes = delta_affixes(item)
            buf = self._buf
            buf += TEXT_DELTA_HEAD
            buf += str(self._seq).encode()
            buf += affixes[1]
            _enc.encode_into(text, buf, -1)
            buf += TEXT_DELTA_TAIL
            self._seq += 1
            return
        self._event(
            "response.reasoning_text.delta",
            item_id=item.id,
            output_index=item.index,
            content_index=0,
            delta=text,
        )

    def _call(self, call: ToolCallDelta) -> None:
        if call.id is not None or call.name is not None or call.index not in self._calls:
            self._held = ""  # whitespace before a call is not an answer
            item = self._open_item("function_call", call)
        else:
            item = self._calls[call.index]
        if call.arguments:
            item.parts.append(call.arguments)
            self._event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=item.index,
                delta=call.arguments,
            )

    def _close(self, status: str) -> None:
        item = self._open
        assert item is not None
        self._open = None
        item.status = status
        ids = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            self._event("response.function_call_arguments.done", **ids, arguments=item.text)
        else:
            kind = "output_text" if item.kind == "message" else "reasoning_text"
            extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
            self._event(f"response.{kind}.done", **ids, content_index=0, text=item.text, **extra)
            self._event(
                "response.content_part.done",
                **ids,
                content_index=0,
                part=content_part(item.kind, item.text),
            )
        self._event("response.output_item.done", output_index=item.index, item=item.wire())

    # ------------------------------------------------------------------ wire

    def _event(self, kind: str, **fields: Any) -> None:
        if not self.stream:
            return
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
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

    def _response(
        self,
        status: str,
        *,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        req = self.req
        choice = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": [] if status == "in_progress" else [i.wire() for i in self.items],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": req.temperature,
            "text": {"format": msgspec.to_builtins(fmt if fmt is not None else RFormatText())},
            "tool_choice": (
                {"type": "function", "name": choice.name}
                if isinstance(choice, RNamedTool)
                else choice or "auto"
            ),
            "tools": [
                {
                    "type": "function",
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("parameters"),
                    "strict": t.get("strict"),
                }
                for t in req.tools or []
            ],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
        }
