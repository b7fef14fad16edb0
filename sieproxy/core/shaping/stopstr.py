"""Incremental stop-string matching, independent of how the text is split into chunks.

Semantics (character-level, so any split gives the same result): the text is cut at the first
stop string to *complete* as the text grows; if several complete at the same character, the
longest (earliest-starting) one wins. Everything from the start of that occurrence on is dropped.

Why holding back the longest suffix that is a proper prefix of a stop string is enough: an
occurrence that completes later must start inside the current buffer at a position ``p`` where
``buffer[p:]`` is a proper prefix of a stop string, so ``p`` lies in the held tail; the emitted
text therefore precedes every future cut. An occurrence found in the buffer completes before any
future one, so the earliest-ending occurrence in the buffer is the global answer.
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    """Feed text, get back the part that is safe to show; see the module docstring."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(safe_text, matched)``; after a match every call returns ``("", True)``."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text if self._held else text
        best_end = -1
        best_start = 0
        best: str | None = None
        for s in self.stops:
            pos = buf.find(s)
            if pos < 0:
                continue
            end = pos + len(s)
            if best is None or end < best_end or (end == best_end and pos < best_start):
                best, best_end, best_start = s, end, pos
        if best is not None:
            self.matched = best
            self._held = ""
            return buf[:best_start], True
        # The longest tail of ``buf`` that is a proper prefix of some stop string: per stop
        # string, only positions holding its first character within its reach are tried, with
        # no per-stop prefix table (that costs O(len²) memory).
        hold = 0
        n = len(buf)
        for s in self.stops:
            first = s[0]
            p = buf.find(first, max(0, n - len(s) + 1))
            while p != -1 and n - p > hold:
                if s.startswith(buf[p:]):
                    hold = n - p
                    break
                p = buf.find(first, p + 1)
        if hold:
            self._held = buf[-hold:]
            return buf[:-hold], False
        self._held = ""
        return buf, False

    def flush(self) -> str:
        """End of text: release what was held back (nothing after a match)."""
        held, self._held = self._held, ""
        return held

    @property
    def held(self) -> str:
        """Text currently held back because it may start a stop string."""
        return self._held
