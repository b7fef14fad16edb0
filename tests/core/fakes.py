"""Parser stand-ins shared by the choice and merger tests."""

from __future__ import annotations

from sieproxy.core.shaping.events import ToolCallDelta

# Tiny stand-ins for the chat-semantics parsers (single-character tags, so no hold-back):
# text inside [ ... ] is reasoning; text inside { ... } is one call to `fn`.


class FakeReasoning:
    def __init__(self) -> None:
        self.inside = False
        self.flushed = False

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        for ch in text:
            if ch == "[":
                self.inside = True
            elif ch == "]":
                self.inside = False
            elif self.inside:
                reasoning.append(ch)
            else:
                content.append(ch)
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        self.flushed = True
        return "", ""


class FakeTools:
    def __init__(self) -> None:
        self.inside = False
        self._calls = 0
        self.flushed = False

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def truncated(self) -> bool:
        return self.flushed and self.inside

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        args: list[str] = []
        for ch in text:
            if ch == "{":
                self.inside = True
                deltas.append(ToolCallDelta(self._calls, f"call_{self._calls}", "fn", ""))
            elif ch == "}":
                if args:
                    deltas.append(ToolCallDelta(self._calls, arguments="".join(args)))
                    args = []
                self.inside = False
                self._calls += 1
            elif self.inside:
                args.append(ch)
            else:
                content.append(ch)
        if args:
            deltas.append(ToolCallDelta(self._calls, arguments="".join(args)))
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        self.flushed = True
        return "", []
