"""Where each mapped chat message came from (:class:`PathMap`), and a chat refusal of the mapped
request written back in the Messages paths and words the client sent (:func:`translated`):
``messages[3].tool_call_id`` → ``messages[2].content[0].tool_use_id``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...core.errors import RequestError

__all__ = ["PathMap", "translated"]


@dataclass(slots=True)
class PathMap:
    """Where each mapped chat message came from, to write a chat ``param`` back as the
    Messages path the client sent."""

    #: Per chat message: the path it came from (``system``, ``messages[i]``, or a
    #: ``tool_result`` block's path for a tool message).
    messages: list[str] = field(default_factory=list)
    #: ``(chat message, part index)`` → the path of the block that part came from.
    parts: dict[tuple[int, int], str] = field(default_factory=dict)
    #: ``(chat message, tool call index)`` → the path of its ``tool_use`` block.
    calls: dict[tuple[int, int], str] = field(default_factory=dict)
    #: Chat messages that came from ``tool_result`` blocks.
    results: set[int] = field(default_factory=set)

    def translate(self, param: str | None) -> str | None:
        """The Messages path of a chat ``param``."""
        if param is None:
            return None
        m = _MSG_PARAM.match(param)
        if m is not None:
            i, rest = int(m.group(1)), m.group(2)
            part = _PART_PARAM.match(rest)
            if part is not None and (i, int(part.group(1))) in self.parts:
                tail = part.group(2)
                if tail.startswith(".image_url"):
                    tail = ".source"
                return self.parts[(i, int(part.group(1)))] + tail
            call = _CALL_PARAM.match(rest)
            if call is not None and (i, int(call.group(1))) in self.calls:
                tail = _CALL_FIELDS.get(call.group(2), call.group(2))
                return self.calls[(i, int(call.group(1)))] + tail
            base = self.messages[i] if i < len(self.messages) else "messages"
            if i in self.results:
                if rest == ".tool_call_id":
                    return base + ".tool_use_id"
                if rest.startswith(".content"):
                    return base + ".content"
            return base + rest
        for chat, ours in _TOP_PARAMS:
            if param == chat or param.startswith((chat + ".", chat + "[")):
                return ours + param[len(chat) :]
        tool = _TOOL_PARAM.match(param)
        if tool is not None:
            tail = tool.group(2)
            return f"tools[{tool.group(1)}]" + (
                ".input_schema" if tail.startswith(".parameters") else tail
            )
        return param


_MSG_PARAM = re.compile(r"messages\[(\d+)\](.*)")
_PART_PARAM = re.compile(r"\.content\[(\d+)\](.*)")
_CALL_PARAM = re.compile(r"\.tool_calls\[(\d+)\](.*)")
_CALL_FIELDS = {".function.name": ".name", ".function.arguments": ".input"}
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function(.*)")
_TOP_PARAMS = (
    ("max_completion_tokens", "max_tokens"),
    ("response_format.json_schema", "output_config.format.schema"),
    ("response_format", "output_config.format"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("stop", "stop_sequences"),
    ("chat_template_kwargs", "thinking"),
)
#: Chat words in a refusal's message and the Messages words for them.
_WORDS = (
    ("`max_completion_tokens`", "`max_tokens`"),
    ("`response_format`", "`output_config.format`"),
    ("`tool_call_id`", "`tool_use_id`"),
    ("`stop`", "`stop_sequences`"),
    ("tool_choice: \"required\"", "tool_choice `any`"),
)


def translated(err: RequestError, paths: PathMap) -> RequestError:
    """A chat refusal of the mapped request, its ``param`` and words those of Messages."""
    param = paths.translate(err.param)
    message = err.message
    for chat, ours in _WORDS:
        message = message.replace(chat, ours)
    if param == err.param and message == err.message:
        return err
    return type(err)(message, param=param, code=err.code)

