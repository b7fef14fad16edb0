"""The Responses API's output items while they are built (:class:`Item`), their wire form, and
the bytes of a ``response.output_text.delta`` frame around its text (the shaper's hot path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = ["TEXT_DELTA_HEAD", "TEXT_DELTA_TAIL", "Item", "content_part", "delta_affixes"]

_enc = msgspec.json.Encoder()


@dataclass(slots=True)
class Item:
    """One output item while it is built (``kind``: message, reasoning or function_call)."""

    kind: str
    id: str
    index: int  # output_index
    parts: list[str] = field(default_factory=list)  # text, or the call's arguments
    call_index: int = -1
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def wire(self, *, full: bool = True) -> dict[str, Any]:
        """The item as the API shows it (``full=False``: as first announced, with no text)."""
        text = self.text if full else ""
        if self.kind == "message":
            content = [content_part("message", text)] if full else []
            return {
                "id": self.id,
                "type": "message",
                "status": self.status,
                "role": "assistant",
                "content": content,
            }
        if self.kind == "reasoning":
            return {
                "id": self.id,
                "type": "reasoning",
                "summary": [],
                "content": [content_part("reasoning", text)] if full else [],
                "status": self.status,
            }
        return {
            "id": self.id,
            "type": "function_call",
            "status": self.status,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": text,
        }


#: A ``response.output_text.delta`` frame is these bytes around its sequence number, the item's
#: own bytes (``delta_affixes``) and the text: byte for byte what ``ResponsesShaper._event`` writes,
#: for one string encoding per token instead of a dict and its encoding.
TEXT_DELTA_HEAD = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"sequence_number":'
)
TEXT_DELTA_TAIL = b',"logprobs":[]}\n\n'


def delta_affixes(item: Item) -> tuple[Item, bytes]:
    """The bytes of a text delta frame of ``item`` between its sequence number and its text."""
    ids = b',"item_id":%s,"output_index":%d' % (_enc.encode(item.id), item.index)
    return item, ids + b',"content_index":0,"delta":'


def content_part(kind: str, text: str) -> dict[str, Any]:
    """The one content part of a message or reasoning item, as the API shows it."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}
