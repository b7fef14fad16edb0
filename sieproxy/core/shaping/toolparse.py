"""Incremental tool-call parsers: model output text → content + OpenAI tool-call deltas.

One parser instance per choice. Each implements
:class:`~sieproxy.core.shaping.events.ToolCallParser`:
``feed(text)`` / ``flush()`` return ``(content, deltas)`` and ``calls`` counts the calls started.

Formats
-------
``hermes``, ``qwen25`` (alias ``qwen``)
    ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, with or without newlines inside
    and around the tags (Qwen2.5/Qwen3 write ``<tool_call>\\n{…}\\n</tool_call>``), any number
    of blocks, text before/between/after them is content.
``llama3``
    Llama-3.1 JSON calls: the output (after whitespace) starts with ``<|python_tag|>`` or
    ``{``, then ``{"name": …, "parameters": {…}}`` objects separated by ``;``. Any other output
    is plain content.
``json_array``
    The output is ``[{"name": …, "parameters": {…}}, …]`` (SGLang's grammar-constrained form
    for ``tool_choice`` ``required``/named without a model-native format).
``smollm2``
    ``<tool_call>[{"name": …, "arguments": {…}}, …]</tool_call>`` (the xLAM/APIGen form of
    SmolLM2's function-calling data, which the gateway teaches in the prompt of a template that
    ignores ``tools``): a JSON array of calls inside the tags; a bare object inside the tags (the
    ``hermes`` form) is read too. Text before/between/after blocks is content;
    ``<tool_call>[]</tool_call>`` ("no call") is dropped.

In every format the call object may name its arguments ``arguments`` or ``parameters``.

Theory of operation
-------------------
A format *driver* is a state machine over the text (states are bound methods taking
``(text, final)`` and returning the unconsumed rest, or ``None`` once the input is used up).
Outside calls it uses ``str.find`` plus a short *hold* (a whitespace run and/or a proper prefix
of a tag), so long content is never rescanned. A call's JSON object is consumed by
:class:`_CallScanner`, a structural JSON scanner that walks each character once (string runs are
skipped by a regex), tracks the object's top-level members and raises three char-positioned
events: the ``name`` value ended, the arguments value started, the object closed.

A call is **committed** — its first delta ``ToolCallDelta(index, id, name, arguments="")`` is
emitted and ``calls`` grows — at the first character where the name is a complete, acceptable
string *and* the arguments value has started (or the object closed without arguments). From
then on the model's own arguments text is forwarded **verbatim** as it streams, so the
concatenated ``arguments`` fragments are exactly the JSON text the model wrote (it parses to
the arguments object whenever the model's JSON is valid). Because every decision is taken at
a character position and never depends on where the feeds were split, any split of an output
yields the same merged content and calls as feeding it whole (only the delta boundaries
differ). :func:`parse_all` is the non-streaming use: feed once, flush, merge.

Decisions
---------
* **Failure before commit → content, nothing lost.** Invalid JSON, an object without a string
  ``name``, a name not in ``tool_names`` (when given), or an unterminated block at ``flush``:
  the block's raw text — including its opening tag and the whitespace before it — is returned
  as content, and parsing resumes at the offending character (so a later valid block is still
  recognised). No exception is ever raised for model output.
* **Failure after commit** cannot be retracted (the call was streamed). The call stands with
  the arguments text received; if the stream stopped inside the arguments (``length``), they
  are truncated JSON, as with OpenAI. After the arguments value, the rest of the object
  (normally ``}``) and stray ``}`` are discarded; a missing ``</tool_call>`` is tolerated.
* **Arguments not written as an object**: a JSON string (some models double-encode) is
  decoded and its text forwarded once complete; ``null`` or no arguments member → ``"{}"``.
* **llama3 / json_array are whole-output formats**: once an object fails (or non-call text
  follows a call), the rest of the output is content and no further call is recognised. The
  array's punctuation (``[``, ``,``, ``]``) and a trailing ``;`` are dropped when calls were
  made; ``[]`` yields neither content nor calls.
* **Whitespace adjacent to a call** (before ``<tool_call>``, between and after blocks, around
  ``;`` and the array punctuation) is dropped; other whitespace in content is kept. Trailing
  whitespace of content is therefore held back until more content (or ``flush``) shows it is
  not followed by a call. Held whitespace is kept as a list of parts, so a degenerate stream
  of newlines costs O(1) per feed.
* **Cost**: content outside calls is scanned once with ``str.find``; a committed call's
  arguments are scanned once and the scanner drops what it has forwarded. Before commit the
  object is buffered (short in practice: the name comes first; an object with a long
  ``arguments`` *before* its ``name`` is buffered whole, then emitted at once).
* **Ids** come from ``id_factory(index)``; the default is deterministic (sans-IO):
  ``"call_" + sha256(seed + ":" + index)[:24]``. Pass a per-choice ``seed`` (request id and
  choice index) so ids differ between responses.
* ``calls`` counts calls *started* (committed). ``truncated`` tells the finish-reason mapping
  that the output ended inside a call: a committed call's object unfinished, or (the array
  formats) an array left open after ``,`` or inside an element. An array element cut before
  commit is **dropped** rather than returned as content: inside an array the text is call
  syntax (grammar-constrained for ``json_array``), never prose, so a ``max_tokens`` cut leaves
  the complete calls and no fragment such as ``, {"name": "f",``.
* Extra keys in a call object are ignored; the first ``name`` and the first ``arguments`` /
  ``parameters`` member win.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Iterable
from typing import Any

from .events import ToolCallDelta, ToolCallParser

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "JsonArrayToolParser",
    "Llama3ToolParser",
    "SmolLM2ToolParser",
    "default_id_factory",
    "make_tool_parser",
    "merge_tool_calls",
    "parse_all",
]

_WS = " \t\r\n"
_ARG_KEYS = ("arguments", "parameters")

_STR_RUN = re.compile(r'[^"\\]*')
_NEST_RUN = re.compile(r"[ \t\r\n,:0-9A-Za-z+.\-]*")
_SCALAR_RUN = re.compile(r"[0-9A-Za-z+.\-]*")
_WS_RUN = re.compile(r"[ \t\r\n]*")
_TAIL_RUN = re.compile(r"[ \t\r\n}]*")
_SCALAR_START = frozenset("-0123456789tfnTFNI")

# _CallScanner states (top level of the call object)
_BEGIN = 0  # leading whitespace, then "{"
_KEY_OR_END = 1  # after "{": a key or "}"
_KEY_START = 2  # after ",": a key
_KEY = 3  # inside a key string
_COLON = 4
_VALUE = 5  # before a member value
_VSTR = 6  # inside a top-level string value
_VNEST = 7  # inside a nested object/array value
_VSCALAR = 8  # inside a number/true/false/null
_COMMA_OR_END = 9


def default_id_factory(seed: str = "") -> Callable[[int], str]:
    """Deterministic OpenAI-style ids: ``call_`` + 24 hex digits from ``seed`` and the index."""

    def make(index: int) -> str:
        return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]

    return make


def _partial_len(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    i = buf.find(tag[0], max(0, len(buf) - len(tag) + 1))
    while i >= 0:
        if tag.startswith(buf[i:]):
            return len(buf) - i
        i = buf.find(tag[0], i + 1)
    return 0


def _decode_string(raw: str) -> str | None:
    try:
        value = json.loads(raw, strict=False)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class _CallScanner:
    """Structural scanner of one JSON call object, fed incrementally.

    ``buf`` holds the object's text from the first character given (leading whitespace
    included); positions are indices into it. Scanning stops at the object's end or at the
    first character that cannot continue it (``done``; ``stop`` is where the following text
    begins). ``failed`` means it stopped without a committed call.
    """

    __slots__ = (
        "args_done",
        "args_end",
        "args_kind",
        "args_sent",
        "args_start",
        "buf",
        "committed",
        "done",
        "failed",
        "key",
        "key_start",
        "name",
        "name_bad",
        "names",
        "pos",
        "stack",
        "state",
        "stop",
        "val_start",
    )

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.buf = ""
        self.pos = 0
        self.state = _BEGIN
        self.stack: list[str] = []
        self.key: str | None = None
        self.key_start = 0
        self.val_start = 0
        self.name: str | None = None
        self.name_bad = False
        self.args_start = 0
        self.args_end = -1
        self.args_kind = ""  # first character of the arguments value; "" until it starts
        self.args_sent = 0
        self.args_done = False
        self.committed = False
        self.done = False
        self.failed = False
        self.stop = 0

    # -- feeding -----------------------------------------------------------------------------

    def feed(self, text: str) -> None:
        if self.committed and self.args_kind in ("{", "[") and self.args_sent > 0:
            self._compact(self.args_sent)
        self.buf += text
        self._scan()

    def _compact(self, k: int) -> None:
        # After commit only positions >= args_sent are ever read again: drop the prefix so a
        # long streamed argument value is not re-copied on every feed.
        self.buf = self.buf[k:]
        self.pos -= k
        self.key_start -= k
        self.val_start -= k
        self.args_start -= k
        self.args_sent = 0
        if self.args_end >= 0:
            self.args_end -= k

    def _fail(self, at: int) -> None:
        self.done = True
        self.stop = at
        self.failed = not self.committed

    def _close(self, at: int) -> None:
        self.done = True
        self.stop = at
        if not self.committed:
            if self.name is not None and not self.name_bad:
                self.committed = True
            else:
                self.failed = True

    def _value_start(self, at: int, char: str) -> None:
        self.val_start = at
        if self.key in _ARG_KEYS and not self.args_kind:
            self.args_start = at
            self.args_sent = at
            self.args_kind = char
            self._maybe_commit()

    def _value_end(self, end: int) -> None:
        if self.key == "name" and self.name is None and not self.name_bad:
            name = None
            if self.state == _VSTR:
                name = _decode_string(self.buf[self.val_start : end])
            if name is None or (self.names and name not in self.names):
                self.name_bad = True
            else:
                self.name = name
                self._maybe_commit()
        elif self.args_kind and self.val_start == self.args_start and self.args_end < 0:
            self.args_end = end
        self.state = _COMMA_OR_END

    def _maybe_commit(self) -> None:
        if self.name is not None and not self.name_bad and self.args_kind:
            self.committed = True

    def _scan(self) -> None:
        buf = self.buf
        n = len(buf)
        i = self.pos
        while i < n and not self.done:
            state = self.state
            c = buf[i]
            if state in (_KEY, _VSTR) or (state == _VNEST and self.stack[-1] == '"'):
                i = _STR_RUN.match(buf, i).end()  # type: ignore[union-attr]
                if i >= n:
                    break
                if buf[i] == "\\":
                    if i + 1 >= n:
                        break  # wait for the escaped character
                    i += 2
                    continue
                # closing quote
                i += 1
                if state == _KEY:
                    self.key = _decode_string(buf[self.key_start - 1 : i])
                    self.state = _COLON
                elif state == _VSTR:
                    self._value_end(i)
                else:
                    self.stack.pop()
                continue
            if state == _VNEST:
                i = _NEST_RUN.match(buf, i).end()  # type: ignore[union-attr]
                if i >= n:
                    break
                c = buf[i]
                if c == '"' or c == "{" or c == "[":
                    self.stack.append(c)
                elif c == "}" or c == "]":
                    if self.stack.pop() != ("{" if c == "}" else "["):
                        self._fail(i)
                        break
                    if not self.stack:
                        self._value_end(i + 1)
                else:
                    self._fail(i)
                    break
                i += 1
                continue
            if state == _VSCALAR:
                i = _SCALAR_RUN.match(buf, i).end()  # type: ignore[union-attr]
                if i >= n:
                    break
                self._value_end(i)
                continue
            if c in _WS:
                i += 1
                continue
            if state == _BEGIN:
                if c != "{":
                    self._fail(i)
                    break
                self.state = _KEY_OR_END
            elif state in (_KEY_OR_END, _KEY_START):
                if c == '"':
                    self.key_start = i + 1
                    self.state = _KEY
                elif c == "}" and state == _KEY_OR_END:
                    self._close(i + 1)
                    i += 1
                    break
                else:
                    self._fail(i)
                    break
            elif state == _COLON:
                if c != ":":
                    self._fail(i)
                    break
                self.state = _VALUE
            elif state == _VALUE:
                if c == '"':
                    self.state = _VSTR
                elif c == "{" or c == "[":
                    self.stack = [c]
                    self.state = _VNEST
                elif c in _SCALAR_START:
                    self.state = _VSCALAR
                else:
                    self._fail(i)
                    break
                self._value_start(i, c)
                if self.state == _VSCALAR:
                    continue  # the scalar run starts at this character
            else:  # _COMMA_OR_END
                if c == ",":
                    self.state = _KEY_START
                elif c == "}":
                    self._close(i + 1)
                    i += 1
                    break
                else:
                    self._fail(i)
                    break
            i += 1
        self.pos = i

    # -- arguments ---------------------------------------------------------------------------

    def take_args(self, final: bool) -> str:
        """Arguments text not handed out yet (only once committed)."""
        if not self.committed or self.args_done:
            return ""
        if not self.args_kind:  # committed at the closing brace: no arguments member
            self.args_done = True
            return "{}"
        if self.args_kind in ("{", "["):
            if self.args_end >= 0:
                upto = self.args_end
                self.args_done = True
            else:
                upto = len(self.buf) if final else self.pos
            out = self.buf[self.args_sent : upto]
            self.args_sent = upto
            return out
        # a string or scalar value: forwarded whole once complete (raw if cut short)
        if self.args_end < 0 and not (self.done or final):
            return ""
        self.args_done = True
        if self.args_end < 0:
            return self.buf[self.args_start :]
        raw = self.buf[self.args_start : self.args_end]
        if self.args_kind == '"':
            decoded = _decode_string(raw)
            return raw if decoded is None else decoded
        return "{}" if raw == "null" else raw


class _Driver:
    """Shared machinery of the format drivers: output buffers, ids, the current call object."""

    def __init__(
        self,
        *,
        tool_names: Collection[str] = (),
        id_factory: Callable[[int], str] | None = None,
        seed: str = "",
    ) -> None:
        self._names = frozenset(tool_names)
        self._ids = id_factory if id_factory is not None else default_id_factory(seed)
        self._calls = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._obj: _CallScanner | None = None
        self._obj_raw = ""  # text before the object that goes back to content if it fails
        self._obj_started = False
        self._truncated = False
        self._array_base = 0  # calls made before the current call array began
        # Held text, in order: ``_raw`` (whitespace runs and punctuation that are dropped if a
        # call follows and are content otherwise; kept as parts so long runs are not re-copied)
        # then ``_hold`` (a proper prefix of a tag).
        self._raw: list[str] = []
        self._hold = ""
        self._state: Callable[[str, bool], str | None] = self._initial

    @property
    def calls(self) -> int:
        """Number of tool calls started so far."""
        return self._calls

    @property
    def truncated(self) -> bool:
        """The output ended inside a call (known after ``flush``; see the module doc)."""
        return self._truncated

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if text:
            self._run(text, final=False)
        return self._take()

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        self._run("", final=True)
        return self._take()

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content = "".join(self._content)
        self._content.clear()
        deltas, self._deltas = self._deltas, []
        return content, deltas

    def _run(self, text: str, *, final: bool) -> None:
        rest: str | None = text
        while rest is not None:
            rest = self._state(rest, final)

    def _initial(self, text: str, final: bool) -> str | None:
        raise NotImplementedError

    def _content_state(self, text: str, final: bool) -> str | None:
        if text:
            self._content.append(text)
        return None

    def _take_raw(self) -> str:
        raw = "".join(self._raw)
        self._raw.clear()
        return raw

    def _skip_ws(self, text: str) -> str:
        """Move the leading whitespace of ``text`` to ``_raw``; return the rest."""
        k = _WS_RUN.match(text).end()  # type: ignore[union-attr]
        if k:
            self._raw.append(text[:k])
        return text[k:]

    # -- the call object ---------------------------------------------------------------------

    def _begin_object(self, raw_prefix: str, state: Callable[[str, bool], str | None]) -> None:
        self._obj = _CallScanner(self._names)
        self._obj_raw = raw_prefix
        self._obj_started = False
        self._state = state

    def _feed_object(
        self, text: str, final: bool, *, drop_cut: bool = False
    ) -> tuple[str | None, bool]:
        """Feed the current object; ``(rest, ok)`` once it is over, ``(None, _)`` meanwhile.

        ``ok`` is False when the object failed before commit (its raw text went to content,
        except an object cut by the end of the output when ``drop_cut``: it is dropped).
        """
        obj = self._obj
        assert obj is not None
        obj.feed(text)
        if obj.committed:
            if not self._obj_started:
                self._obj_started = True
                index = self._calls
                self._calls += 1
                self._deltas.append(
                    ToolCallDelta(index=index, id=self._ids(index), name=obj.name, arguments="")
                )
            args = obj.take_args(final)
            if args:
                self._deltas.append(ToolCallDelta(index=self._calls - 1, arguments=args))
        if obj.done:
            self._obj = None
            if obj.failed:
                self._content.append(self._obj_raw + obj.buf[: obj.stop])
            return obj.buf[obj.stop :], not obj.failed
        if final:
            self._obj = None
            if obj.committed or drop_cut:
                self._truncated = True
            else:
                self._content.append(self._obj_raw + obj.buf)
            return "", obj.committed
        return None, True


    # -- a JSON array of call objects (json_array, smollm2) ---------------------------------

    def _open_array(self) -> None:
        self._raw.append("[")
        self._array_base = self._calls
        self._state = self._before_element

    def _array_closed(self, text: str, final: bool) -> str | None:
        """The state after the array's ``]`` (or where it should have been)."""
        raise NotImplementedError

    def _array_broken(self, text: str, final: bool) -> str | None:
        """The state after an array element that is not a call."""
        raise NotImplementedError

    def _before_element(self, text: str, final: bool) -> str | None:
        # After "[" or ",": whitespace, then "{" (or "]"). _raw has the raw text so far.
        rest = self._skip_ws(text)
        if rest.startswith("{"):
            self._begin_object(self._take_raw(), self._in_element)
            return rest
        if rest.startswith("]"):
            self._raw.clear()
            self._state = self._array_closed
            return rest[1:]
        if rest or final:
            raw = self._take_raw()
            if rest or self._calls == self._array_base:
                self._content.append(raw)
            else:
                self._truncated = True  # cut after ",", before the next element began
            self._state = self._array_broken
            return rest
        return None

    def _in_element(self, text: str, final: bool) -> str | None:
        rest, ok = self._feed_object(text, final, drop_cut=True)
        if rest is None:
            return None
        self._state = self._after_element if ok else self._array_broken
        return rest

    def _after_element(self, text: str, final: bool) -> str | None:
        rest = text[_TAIL_RUN.match(text).end() :]  # type: ignore[union-attr]
        if not rest:
            return None
        if rest[0] == ",":
            self._raw.append(",")
            self._state = self._before_element
            return rest[1:]
        self._state = self._array_closed
        return rest[1:] if rest[0] == "]" else rest


class HermesToolParser(_Driver):
    """``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3); see the module doc."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def _initial(self, text: str, final: bool) -> str | None:
        # Content: look for the opening tag; hold trailing whitespace and a partial tag.
        buf = self._hold + text
        self._hold = ""
        at = buf.find(self.OPEN)
        cut = at if at >= 0 else len(buf) if final else len(buf) - _partial_len(buf, self.OPEN)
        kept = buf[:cut].rstrip(_WS)
        if kept:
            self._content.append(self._take_raw())
            self._content.append(kept)
        if len(kept) < cut:
            self._raw.append(buf[len(kept) : cut])
        if at >= 0:
            self._raw.append(self.OPEN)
            self._state = self._block_start
            return buf[at + len(self.OPEN) :]
        if final:
            self._content.append(self._take_raw())
        else:
            self._hold = buf[cut:]
        return None

    def _block_start(self, text: str, final: bool) -> str | None:
        # After the opening tag (which is in _raw with the whitespace before it).
        self._begin_object(self._take_raw(), self._in_block)
        return text

    def _in_block(self, text: str, final: bool) -> str | None:
        rest, ok = self._feed_object(text, final)
        if rest is None:
            return None
        self._state = self._after_object if ok else self._initial
        return rest

    def _after_object(self, text: str, final: bool) -> str | None:
        # Whitespace and stray "}" are dropped; then "</tool_call>" (optional).
        buf = self._hold + text
        self._hold = ""
        rest = buf[_TAIL_RUN.match(buf).end() :]  # type: ignore[union-attr]
        if rest.startswith(self.CLOSE):
            self._state = self._between
            return rest[len(self.CLOSE) :]
        if self.CLOSE.startswith(rest):  # empty, or a partial closing tag
            if not final:
                self._hold = rest
            return None
        self._state = self._initial
        return rest

    def _between(self, text: str, final: bool) -> str | None:
        rest = text.lstrip(_WS)
        if not rest:
            return None
        self._state = self._initial
        return rest


class Llama3ToolParser(_Driver):
    """Llama-3.1 JSON tool calls (``<|python_tag|>`` optional, ``;``-separated); module doc."""

    PYTHON_TAG = "<|python_tag|>"

    def _initial(self, text: str, final: bool) -> str | None:
        buf = self._hold + text
        self._hold = ""
        if not buf.startswith("<"):
            buf = self._skip_ws(buf)
        if buf.startswith(self.PYTHON_TAG):
            self._raw.append(self.PYTHON_TAG)
            self._state = self._before_object
            return buf[len(self.PYTHON_TAG) :]
        if buf.startswith("{"):
            self._begin_object(self._take_raw(), self._in_object)
            return buf
        if not final and self.PYTHON_TAG.startswith(buf):  # undecided (maybe empty)
            self._hold = buf
            return None
        self._state = self._content_state
        return self._take_raw() + buf

    def _before_object(self, text: str, final: bool) -> str | None:
        # After the python tag or a ";": whitespace, then "{". _raw has the raw text so far.
        rest = self._skip_ws(text)
        if rest.startswith("{"):
            self._begin_object(self._take_raw(), self._in_object)
            return rest
        if rest or final:
            raw = self._take_raw()
            if rest or not self._calls:  # a trailing ";" after calls is dropped
                self._content.append(raw)
            self._state = self._content_state
            return rest
        return None

    def _in_object(self, text: str, final: bool) -> str | None:
        rest, ok = self._feed_object(text, final)
        if rest is None:
            return None
        self._state = self._after_object if ok else self._content_state
        return rest

    def _after_object(self, text: str, final: bool) -> str | None:
        rest = text[_TAIL_RUN.match(text).end() :]  # type: ignore[union-attr]
        if not rest:
            return None
        if rest[0] == ";":
            self._raw.append(";")
            self._state = self._before_object
            return rest[1:]
        self._state = self._content_state
        return rest


class JsonArrayToolParser(_Driver):
    """A JSON array of ``{"name", "parameters"}`` objects (constrained decoding); module doc."""

    def _initial(self, text: str, final: bool) -> str | None:
        rest = self._skip_ws(text)
        if rest.startswith("["):
            self._open_array()
            return rest[1:]
        if rest or final:
            self._state = self._content_state
            return self._take_raw() + rest
        return None

    def _array_closed(self, text: str, final: bool) -> str | None:
        rest = text.lstrip(_WS)
        if not rest:
            return None
        self._state = self._content_state
        return rest

    def _array_broken(self, text: str, final: bool) -> str | None:
        return self._content_state(text, final)


class SmolLM2ToolParser(HermesToolParser):
    """``<tool_call>[{json}, …]</tool_call>`` blocks (a bare object is read too); module doc."""

    def _block_start(self, text: str, final: bool) -> str | None:
        # After the opening tag: "[" (the array form) or "{" (one call, the hermes form).
        rest = self._skip_ws(text)
        if rest.startswith("["):
            self._open_array()
            return rest[1:]
        if rest.startswith("{"):
            self._begin_object(self._take_raw(), self._in_block)
            return rest
        if rest or final:
            self._content.append(self._take_raw())
            self._state = self._initial
            return rest
        return None

    def _array_closed(self, text: str, final: bool) -> str | None:
        return self._after_object(text, final)

    def _array_broken(self, text: str, final: bool) -> str | None:
        return self._initial(text, final)


#: Parser names (normalised: lower case, ``-`` → ``_``) and their classes.
TOOL_PARSERS: dict[str, type[_Driver]] = {
    "hermes": HermesToolParser,
    "qwen25": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3": Llama3ToolParser,
    "json_array": JsonArrayToolParser,
    "smollm2": SmolLM2ToolParser,
}


def make_tool_parser(
    name: str | None,
    *,
    tool_names: Collection[str],
    id_factory: Callable[[int], str] | None = None,
    seed: str = "",
) -> ToolCallParser | None:
    """A fresh tool-call parser for one choice, or ``None`` when ``name`` is ``None``.

    ``tool_names`` are the request's function names; a call naming another function is not a
    call (its text stays content). An empty collection disables the check. Ids come from
    ``id_factory`` or, by default, :func:`default_id_factory` of ``seed``. Unknown names raise
    :class:`ValueError` — call this at configuration time to validate a profile.
    """
    if name is None:
        return None
    cls = TOOL_PARSERS.get(name.strip().lower().replace("-", "_"))
    if cls is None:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})")
    return cls(tool_names=tool_names, id_factory=id_factory, seed=seed)


def merge_tool_calls(deltas: Iterable[ToolCallDelta]) -> list[dict[str, Any]]:
    """Merge streamed deltas into OpenAI ``message.tool_calls`` entries, ordered by index."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            call = calls[delta.index] = {
                "id": delta.id or "",
                "type": "function",
                "function": {"name": delta.name or "", "arguments": ""},
            }
        else:
            if delta.id:
                call["id"] = delta.id
            if delta.name:
                call["function"]["name"] = delta.name
        call["function"]["arguments"] += delta.arguments
    return [calls[i] for i in sorted(calls)]


def parse_all(parser: ToolCallParser, text: str) -> tuple[str, list[dict[str, Any]]]:
    """Non-streaming use: feed ``text`` whole, flush, and return ``(content, tool_calls)``."""
    content, deltas = parser.feed(text)
    tail, more = parser.flush()
    return content + tail, merge_tool_calls([*deltas, *more])
