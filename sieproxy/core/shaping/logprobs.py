"""OpenAI chat ``logprobs.content[]`` entries, as msgspec Structs (encoded in key order).

``bytes`` is the UTF-8 encoding of the token text the engine reported. (Byte-level BPE tokens
that are not valid UTF-8 on their own arrive from the engine already detokenized to text, so
their exact bytes are not recoverable here; this matches what the client can reassemble.)
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from .events import TokenLogprob

__all__ = ["LogprobContent", "TopLogprobContent", "content_entries", "content_entry"]


class TopLogprobContent(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class LogprobContent(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobContent]


def content_entry(tlp: TokenLogprob) -> LogprobContent:
    """One ``logprobs.content[]`` entry for one generated token."""
    return LogprobContent(
        tlp.token,
        tlp.logprob,
        list(tlp.token.encode("utf-8")),
        [TopLogprobContent(t.token, t.logprob, list(t.token.encode("utf-8"))) for t in tlp.top],
    )


def content_entries(tlps: Iterable[TokenLogprob]) -> list[LogprobContent]:
    """``logprobs.content`` for a run of tokens."""
    return [content_entry(t) for t in tlps]
