"""Incremental detokenization and stop-string handling for one sequence.

:class:`IncrementalDetokenizer` turns token ids into text without re-decoding the whole output
each step: it decodes a short window (``prefix_offset:``) and emits only what lies past the
already-confirmed part. A window whose text ends in U+FFFD is an incomplete UTF-8 character
(a byte-level BPE token split it); it is held back until the next token completes it.

:class:`StopMatcher` finds stop strings (and ``stop_regex``) in the cumulative text and tells
how much of the text may be shown: a tail that is a prefix of some stop string is held back, so
a partial stop string is never streamed and later retracted.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopMatcher"]


class IncrementalDetokenizer:
    """Decode a growing list of token ids into a growing string."""

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        try:
            return str(self._tok.decode(ids, **self._kwargs))
        except TypeError:  # tokenizers without spaces_between_special_tokens
            return str(
                self._tok.decode(ids, skip_special_tokens=self._kwargs["skip_special_tokens"])
            )

    def add(self, token_id: int) -> str:
        """Append a token; return the newly confirmed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Return text still held back (an incomplete character decodes to U+FFFD)."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopMatcher:
    """Stop strings and stop regexes over the cumulative output text."""

    def __init__(self, stops: list[str], regexes: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.regexes = [re.compile(r) for r in regexes]
        self._max = max((len(s) for s in self.stops), default=0)

    @property
    def active(self) -> bool:
        """Whether any stop string or regex is configured."""
        return bool(self.stops or self.regexes)

    def find(self, text: str, new_from: int) -> tuple[int, int, str] | None:
        """Find the earliest stop whose match ends after ``new_from``.

        Return ``(start, end, matched)``: ``matched`` is the stop string (or the regex pattern).
        """
        best: tuple[int, int, str] | None = None
        lo = max(0, new_from - self._max + 1)
        for stop in self.stops:
            i = text.find(stop, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(stop), stop)
        for rx in self.regexes:
            m = rx.search(text)
            if m and (best is None or m.start() < best[0]):
                best = (m.start(), m.end(), rx.pattern)
        return best

    def visible_length(self, text: str) -> int:
        """Length of ``text`` that may be streamed: drop a tail that could start a stop string."""
        if not self.stops:
            return len(text)
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return len(text) - hold
