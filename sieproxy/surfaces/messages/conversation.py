"""The Messages conversation (``system`` and ``messages``) as chat messages, each recorded in a
:class:`~.paths.PathMap` with the path it came from.

- ``system`` (a string, or text blocks joined with a newline) → the first system message. A
  text block that starts with ``x-anthropic-billing-header:`` is dropped: Claude Code puts its
  billing attribution there (a value that differs per conversation), which is no instruction
  to a model, and as the prompt's first line it would keep every conversation from sharing the
  engine's prefix cache of the (long, identical) system prompt.
- A ``user`` message → its ``tool_result`` blocks first, each a ``tool`` message in block
  order (Anthropic requires them first too), then one user message with its text and image
  blocks (an image's ``base64`` source becomes a ``data:`` URI; a ``url`` source is refused, as
  remote images are on chat). A ``tool_result`` with ``is_error: true`` reaches the template
  as ``Error: <content>``; images inside a ``tool_result`` are refused with a reason.
- An ``assistant`` message → one assistant message: its text blocks as content, its
  ``tool_use`` blocks as tool calls (``input`` JSON-encoded); replayed ``thinking`` /
  ``redacted_thinking`` blocks are dropped, as chat drops a replayed ``reasoning_content``.
- A ``system`` message inside ``messages`` (Claude Code sends one after the first user message
  for some model names) → a system message at that place: the template decides.
- A final ``assistant`` message (a prefill to continue) is refused: the chat path always opens
  a new assistant turn, so the continuation could not be honoured.
"""

from __future__ import annotations

import msgspec

from ...core.errors import InvalidRequest, UnsupportedField
from ...core.request.schemas import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    ImagePart,
    TextPart,
    ToolCall,
)
from .paths import PathMap
from .schema import (
    CountTokensRequest,
    MBase64Source,
    MBlock,
    MImage,
    MRedactedThinking,
    MText,
    MThinking,
    MToolResult,
    MToolUse,
    MURLSource,
)

__all__ = ["chat_messages"]


#: The start of Claude Code's billing-attribution system block (see the module docstring).
_BILLING = "x-anthropic-billing-header:"


def _text_blocks(blocks: list[MText], path: str, *, skip: str) -> str | None:
    """The system blocks' text (None: only skipped blocks)."""
    if not blocks:
        raise InvalidRequest(
            f"`{path}` must not be an empty array; send a string or at least one text block.",
            param=path,
        )
    kept = [b.text for b in blocks if not b.text.startswith(skip)]
    return "\n".join(kept) if kept else None


def _image(block: MImage, path: str) -> ImagePart:
    src = block.source
    if type(src) is MURLSource:
        raise InvalidRequest(
            "Remote image URLs are not fetched; send the image as a `base64` source.",
            param=f"{path}.source",
        )
    assert type(src) is MBase64Source
    return ImagePart(f"data:{src.media_type};base64,{src.data}")


def _result_text(block: MToolResult, path: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        pieces: list[str] = []
        for j, b in enumerate(content):
            if type(b) is MImage:
                raise UnsupportedField(
                    "Images inside a `tool_result` are not supported (chat templates carry "
                    "images in user turns only); send the image as an `image` block of the "
                    "user message instead.",
                    param=f"{path}.content[{j}]",
                )
            assert type(b) is MText
            pieces.append(b.text)
        text = "\n".join(pieces)
    return f"Error: {text}" if block.is_error else text


class _Mapper:
    """Builds the chat messages and records where each came from."""

    def __init__(self, paths: PathMap) -> None:
        self.paths = paths
        self.out: list[ChatMessage] = []
        self.call_ids: set[str] = set()

    def add(self, msg: ChatMessage, path: str) -> int:
        self.out.append(msg)
        self.paths.messages.append(path)
        return len(self.out) - 1

    def user(self, content: list[MBlock], path: str) -> None:
        parts: list[ContentPart] = []
        origins: list[str] = []
        for j, block in enumerate(content):
            bpath = f"{path}.content[{j}]"
            t = type(block)
            if t is MToolResult:
                assert isinstance(block, MToolResult)
                if not block.tool_use_id:
                    raise InvalidRequest(
                        "A `tool_result` needs the non-empty `tool_use_id` of the call it "
                        "answers.",
                        param=f"{bpath}.tool_use_id",
                    )
                text = _result_text(block, bpath)
                k = self.add(ChatMessage("tool", text, tool_call_id=block.tool_use_id), bpath)
                self.paths.results.add(k)
            elif t is MText:
                assert isinstance(block, MText)
                parts.append(TextPart(block.text))
                origins.append(bpath)
            elif t is MImage:
                assert isinstance(block, MImage)
                parts.append(_image(block, bpath))
                origins.append(bpath)
            else:
                raise InvalidRequest(
                    f"A user message cannot carry a `{_TAGS[t]}` block; only `text`, `image` "
                    "and `tool_result` blocks.",
                    param=f"{bpath}.type",
                )
        if parts:
            k = self.add(ChatMessage("user", parts), path)
            for j, origin in enumerate(origins):
                self.paths.parts[(k, j)] = origin

    def assistant(self, content: list[MBlock], path: str) -> None:
        texts: list[str] = []
        calls: list[ToolCall] = []
        call_paths: list[str] = []
        for j, block in enumerate(content):
            bpath = f"{path}.content[{j}]"
            t = type(block)
            if t is MText:
                assert isinstance(block, MText)
                texts.append(block.text)
            elif t is MToolUse:
                assert isinstance(block, MToolUse)
                if not block.id:
                    raise InvalidRequest(
                        "A `tool_use` block needs a non-empty `id`.", param=f"{bpath}.id"
                    )
                if block.id in self.call_ids:
                    raise InvalidRequest(
                        f"`tool_use` ids must be unique; `{block.id}` appears twice.",
                        param=f"{bpath}.id",
                    )
                self.call_ids.add(block.id)
                args = msgspec.json.encode(block.input).decode()
                calls.append(ToolCall(block.id, "function", FunctionCall(block.name, args)))
                call_paths.append(bpath)
            elif t is MThinking or t is MRedactedThinking:
                continue  # replayed reasoning: dropped (see the module docstring)
            else:
                raise InvalidRequest(
                    f"An assistant message cannot carry a `{_TAGS[t]}` block; only `text`, "
                    "`tool_use`, `thinking` and `redacted_thinking` blocks.",
                    param=f"{bpath}.type",
                )
        text = "".join(texts)
        said = text if text or not calls else None
        msg = ChatMessage("assistant", said, tool_calls=calls or None)
        k = self.add(msg, path)
        for n, cpath in enumerate(call_paths):
            self.paths.calls[(k, n)] = cpath


_TAGS: dict[type, str] = {
    MText: "text",
    MImage: "image",
    MToolUse: "tool_use",
    MToolResult: "tool_result",
    MThinking: "thinking",
    MRedactedThinking: "redacted_thinking",
}


def chat_messages(req: CountTokensRequest, paths: PathMap) -> list[ChatMessage]:
    """The chat messages of ``system`` and ``messages`` (``paths`` records their origin)."""
    mapper = _Mapper(paths)
    system = req.system
    if isinstance(system, list):
        text = _text_blocks(system, "system", skip=_BILLING)
        if text is not None:
            mapper.add(ChatMessage("system", text), "system")
    elif system is not None:
        mapper.add(ChatMessage("system", system), "system")
    if not req.messages:
        raise InvalidRequest("`messages` must contain at least one message.", param="messages")
    last = len(req.messages) - 1
    for i, msg in enumerate(req.messages):
        path = f"messages[{i}]"
        role = msg.role
        if role not in ("user", "assistant", "system"):
            raise InvalidRequest(
                "`role` must be `user` or `assistant` (or `system`).", param=f"{path}.role"
            )
        if role == "assistant" and i == last:
            raise UnsupportedField(
                "A final `assistant` message (a prefill to continue) is not supported: the "
                "answer always starts a new assistant turn. End `messages` with a user message.",
                param=path,
            )
        content = msg.content
        if isinstance(content, list) and not content:
            raise InvalidRequest(
                "`content` must not be an empty array; send a string or at least one block.",
                param=f"{path}.content",
            )
        if role == "system":
            if isinstance(content, str):
                mapper.add(ChatMessage("system", content), path)
            else:
                for j, block in enumerate(content):
                    if type(block) is not MText:
                        raise InvalidRequest(
                            "A system message carries `text` blocks only.",
                            param=f"{path}.content[{j}].type",
                        )
                texts = [b.text for b in content if isinstance(b, MText)]
                mapper.add(ChatMessage("system", "\n".join(texts)), path)
        elif isinstance(content, str):
            mapper.add(ChatMessage(role, content), path)
        elif role == "user":
            mapper.user(content, path)
        else:
            mapper.assistant(content, path)
    return mapper.out
