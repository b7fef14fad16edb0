"""Splitting a choice's streamed text into reasoning and content (``<think>…</think>``).

Theory of operation
-------------------
:class:`ThinkParser` is a small state machine over the text of one choice, fed in arbitrary
pieces (a tag may be split at any character). It never rescans what it has already released:
each ``feed`` looks only at the new text plus a short *hold* — text it cannot classify yet,
which is at most a run of whitespace followed by a proper prefix of a tag. ``flush`` releases
the hold at the end. For any split of the same output, the concatenated results are identical.

    OPENING ──<think>──▶ REASONING ──</think>──▶ AFTER_END ──non-ws──▶ CONTENT
       │                    │
       │                    └── interrupt tag (e.g. <tool_call>) ──▶ CONTENT (tag kept)
       └── other text ──▶ REASONING (starts_in_reasoning) or CONTENT (otherwise)

Decisions
---------
* **Where ``<think>`` counts.** Only as the first non-whitespace text of the output, and only
  once. Whitespace before it is dropped. If the output starts with anything else, a parser that
  does not start in reasoning treats the whole output as content, verbatim; a later ``<think>``
  is content too (a model talking *about* the tag is not misparsed).
* **Templates that open the block** (DeepSeek-R1, QwQ, Qwen3-Thinking, Qwen3 with thinking
  on in newer templates): ``starts_in_reasoning=True``. The output is reasoning until
  ``</think>``; an optional leading ``<think>`` (older Qwen3 templates let the model write it,
  DeepSeek-R1-0528 sometimes repeats it) is swallowed.
* **Whitespace at the edges.** Reasoning is stripped of ASCII whitespace at both ends, and the
  whitespace right after ``</think>`` is dropped from content: Qwen3 and DeepSeek-R1 write
  ``<think>\\n…\\n</think>\\n\\n<answer>``, and Qwen's own chat template re-renders history with
  ``content.split('</think>')[-1].lstrip('\\n')`` and the reasoning ``strip('\\n')``-ed, so
  those newlines are framing, not text. Trailing reasoning whitespace is held back until
  non-whitespace reasoning follows (then released) or the end tag comes (then dropped).
* **Interrupt tags** (``interrupts=("<tool_call>",)`` for Qwen3, as SGLang does for Qwen3.5):
  a tool-call opening inside reasoning ends the reasoning without ``</think>``; the tag and
  everything after it is content, for the tool parser downstream.
* **Stream ends inside reasoning** (e.g. ``finish_reason=length``): ``flush`` returns the held
  text as reasoning (a dangling partial tag such as ``"</thi"`` is reasoning text; trailing
  whitespace is dropped). Nothing is turned into content after the fact: what was streamed as
  reasoning stays reasoning.
* Whether reasoning is shown to the client (``include_reasoning``) is not decided here: the
  parser always separates it; the choice pipeline drops or forwards it.

Registry: :func:`make_reasoning_parser` maps a profile's configured parser name and the
request's ``enable_thinking`` to a fresh parser (one per choice), or ``None`` for no parsing.
"""

from __future__ import annotations

from collections.abc import Sequence

from .events import ReasoningParser

__all__ = ["REASONING_PARSERS", "ThinkParser", "make_reasoning_parser"]

_WS = " \t\r\n"

_OPENING = 0
_LEAD = 1  # reasoning has begun; dropping its leading whitespace
_REASONING = 2
_AFTER_END = 3
_CONTENT = 4


def _partial_len(buf: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        i = buf.find(tag[0], max(0, len(buf) - len(tag) + 1))
        while i >= 0 and len(buf) - i > best:
            if tag.startswith(buf[i:]):
                best = len(buf) - i
                break
            i = buf.find(tag[0], i + 1)
    return best


class ThinkParser:
    """Incremental ``<think>…</think>`` splitter implementing :class:`ReasoningParser`.

    ``feed(text)`` and ``flush()`` return ``(reasoning, content)``. One instance per choice.
    """

    __slots__ = ("_end", "_hold", "_start", "_starts_in_reasoning", "_state", "_tags", "_ws")

    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        *,
        starts_in_reasoning: bool = False,
        interrupts: Sequence[str] = (),
    ) -> None:
        if not start or not end or any(not t for t in interrupts):
            raise ValueError("reasoning tags must be non-empty")
        self._start = start
        self._end = end
        self._tags: tuple[str, ...] = (end, *interrupts)
        self._starts_in_reasoning = starts_in_reasoning
        self._state = _OPENING
        self._ws: list[str] = []
        self._hold = ""

    @property
    def in_reasoning(self) -> bool:
        """True while text is (or, at the very start, would be) classified as reasoning."""
        if self._state == _OPENING:
            return self._starts_in_reasoning
        return self._state in (_LEAD, _REASONING)

    def feed(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        return self._run(text, final=False)

    def flush(self) -> tuple[str, str]:
        return self._run("", final=True)

    def _run(self, text: str, *, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        # Held text is ``"".join(self._ws) + self._hold``: a whitespace run (kept as parts, so
        # a long run is never re-copied) followed by a proper prefix of a tag.
        buf = self._hold + text
        self._hold = ""
        while True:
            state = self._state
            if state == _CONTENT:
                if buf:
                    content.append(buf)
                break
            if state == _OPENING:
                stripped = buf.lstrip(_WS)
                if len(stripped) < len(buf):
                    self._ws.append(buf[: len(buf) - len(stripped)])
                if stripped.startswith(self._start):
                    self._ws.clear()
                    self._state = _LEAD
                    buf = stripped[len(self._start) :]
                    continue
                if not final and self._start.startswith(stripped):  # undecided (maybe empty)
                    self._hold = stripped
                    break
                if self._starts_in_reasoning:
                    self._ws.clear()
                    self._state = _REASONING
                    buf = stripped
                else:
                    self._state = _CONTENT
                    buf = self._take_ws() + stripped
                continue
            if state in (_AFTER_END, _LEAD):
                buf = buf.lstrip(_WS)
                if buf:
                    self._state = _CONTENT if state == _AFTER_END else _REASONING
                    continue
                break
            # _REASONING: reasoning text, after the held whitespace run (if any)
            at, tag = -1, ""
            for t in self._tags:
                i = buf.find(t)
                if i >= 0 and (at < 0 or i < at):
                    at, tag = i, t
            if at >= 0:
                kept = buf[:at].rstrip(_WS)
                if kept:
                    reasoning.append(self._take_ws())
                    reasoning.append(kept)
                self._ws.clear()  # whitespace before the end of reasoning is dropped
                if tag == self._end:
                    self._state = _AFTER_END
                    buf = buf[at + len(tag) :]
                else:
                    self._state = _CONTENT
                    buf = buf[at:]
                continue
            cut = len(buf) if final else len(buf) - _partial_len(buf, self._tags)
            kept = buf[:cut].rstrip(_WS)
            if kept:
                reasoning.append(self._take_ws())
                reasoning.append(kept)
            if final:
                self._ws.clear()
            else:
                if len(kept) < cut:
                    self._ws.append(buf[len(kept) : cut])
                self._hold = buf[cut:]
            break
        return "".join(reasoning), "".join(content)

    def _take_ws(self) -> str:
        ws = "".join(self._ws)
        self._ws.clear()
        return ws


def _qwen3(enable_thinking: bool | None) -> ThinkParser:
    # SGLang: thinking is on for Qwen3 unless the request turns it off. With it off the template
    # renders an empty think block into the prompt; a model writing one anyway is still parsed.
    return ThinkParser(
        starts_in_reasoning=enable_thinking is not False, interrupts=("<tool_call>",)
    )


def _qwen3_thinking(enable_thinking: bool | None) -> ThinkParser:
    return ThinkParser(starts_in_reasoning=True, interrupts=("<tool_call>",))


def _deepseek_r1(enable_thinking: bool | None) -> ThinkParser:
    return ThinkParser(starts_in_reasoning=True)


def _deepseek_v3(enable_thinking: bool | None) -> ThinkParser:
    # DeepSeek-V3.1+: hybrid, thinking off unless asked; the template opens the block when on.
    return ThinkParser(starts_in_reasoning=enable_thinking is True)


#: Parser names (normalised: lower case, ``_`` → ``-``) and their factories.
REASONING_PARSERS = {
    "qwen3": _qwen3,
    "qwen3-thinking": _qwen3_thinking,
    "qwq": _qwen3_thinking,
    "deepseek-r1": _deepseek_r1,
    "deepseek-v3": _deepseek_v3,
}


def make_reasoning_parser(
    name: str | None, *, enable_thinking: bool | None
) -> ReasoningParser | None:
    """A fresh reasoning parser for one choice, or ``None`` when ``name`` is ``None``.

    ``enable_thinking`` is the request's ``chat_template_kwargs.enable_thinking`` (``None`` when
    absent). Unknown names raise :class:`ValueError` — call this once at configuration time to
    validate a profile.
    """
    if name is None:
        return None
    factory = REASONING_PARSERS.get(name.strip().lower().replace("_", "-"))
    if factory is None:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})")
    return factory(enable_thinking)
