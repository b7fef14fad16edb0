"""Where each mapped chat message came from (:class:`PathMap`), and a chat refusal of the mapped
request written back as the Responses path the client sent (:func:`translated`):
``messages[2].content`` → ``input[1].content``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...core.errors import RequestError

__all__ = ["PathMap", "translated"]


@dataclass(slots=True)
class PathMap:
    """Where each mapped chat message came from, to write a chat ``param`` back as the
    Responses path the client sent (``messages[i]`` → ``input[k]``, ...)."""

    messages: list[str] = field(default_factory=list)
    #: ``(message index, tool call index)`` → the path of the ``function_call`` item.
    calls: dict[tuple[int, int], str] = field(default_factory=dict)
    #: Message indexes that came from ``function_call_output`` items.
    outputs: set[int] = field(default_factory=set)

    def translate(self, param: str | None) -> str | None:
        """The Responses path of a chat ``param``."""
        if param is None:
            return None
        m = _MSG_PARAM.match(param)
        if m is not None:
            i = int(m.group(1))
            rest = m.group(2)
            call = _CALL_PARAM.match(rest)
            if call is not None and (i, int(call.group(1))) in self.calls:
                tail = _CALL_FIELDS.get(call.group(2), call.group(2))
                return self.calls[(i, int(call.group(1)))] + tail
            base = self.messages[i] if i < len(self.messages) else "input"
            if rest == ".tool_call_id":
                rest = ".call_id"
            elif i in self.outputs and rest.startswith(".content"):
                rest = ".output" + rest[len(".content") :]
            return base + rest
        for chat, resp in _TOP_PARAMS:
            if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
                return resp + param[len(chat) :]
        tool = _TOOL_PARAM.match(param)
        if tool is not None:
            return f"tools[{tool.group(1)}]" + tool.group(2)
        return param


_MSG_PARAM = re.compile(r"messages\[(\d+)\](.*)")
_CALL_PARAM = re.compile(r"\.tool_calls\[(\d+)\](.*)")
_CALL_FIELDS = {
    ".id": ".call_id",
    ".function.name": ".name",
    ".function.arguments": ".arguments",
}
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function(.*)")
_TOP_PARAMS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("messages", "input"),
)


def translated(err: RequestError, paths: PathMap) -> RequestError:
    """A chat refusal of the mapped request, its ``param`` written as the Responses path."""
    param = paths.translate(err.param)
    if param == err.param:
        return err
    message = err.message
    for chat, resp in _TOP_PARAMS[:4]:
        message = message.replace(f"`{chat}`", f"`{resp}`")
    message = message.replace("`tool_call_id`", "`call_id`")
    return type(err)(message, param=param, code=err.code)
