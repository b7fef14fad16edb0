"""Prefix affinity: the routing key of a request that names none.

A replica's prefix cache helps a request only when an earlier request with the same leading
tokens ran *there*, so requests that share a prefix should meet on one replica. The key is a
hash of the rendered prompt's leading block, computed here (sans-IO) and carried to the pool in
``RouteHints``; the pool ranks replicas by rendezvous hashing on it, with the bounded load of
the explicit keys (``routing_key`` / ``prompt_cache_key``).

Where the leading block ends
----------------------------
- Chat: at the end of the first user message as rendered — the conversation's opening (system
  prompt, tools, first question). It stays the same for every later turn of a conversation
  that resends its history, so a growing conversation keeps landing where its history is
  cached; different conversations sharing one system prompt spread over the replicas (each
  caches the shared system prompt once). The messages before it and the first user message
  are located in order in the rendered prompt; a template that rewrites the text beyond
  recognition falls back to the fixed block below.
- Otherwise (``/v1/completions``, a chat opening not found): the first :data:`PREFIX_BLOCK`
  characters of the prompt (the whole prompt when shorter).

The key depends on nothing but the prompt, so every gateway process picks the same replica for
the same prefix with no shared state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["PREFIX_BLOCK", "opening_end", "prefix_key"]

#: Characters of a prompt hashed when no conversation opening is found (~500 tokens).
PREFIX_BLOCK = 2048


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return next((t.strip() for t in reversed(texts) if isinstance(t, str) and t.strip()), "")
    return ""


def opening_end(prompt: str, messages: Sequence[dict[str, Any]]) -> int | None:
    """Where the first user message ends in ``prompt`` (None: not found).

    The texts of the messages up to the first user one are searched for in order, each after
    the previous one, so a first question that also occurs inside the system prompt is found
    where it really is.
    """
    pos = 0
    for m in messages:
        text = _text(m.get("content"))
        if text:
            i = prompt.find(text, pos)
            if i < 0:
                return None
            pos = i + len(text)
        if m.get("role") == "user":
            return pos if text else None
    return None


def prefix_key(prompt: str, end: int | None = None) -> str:
    """The affinity key of ``prompt``: a hash of ``prompt[:end]`` (default: the fixed block)."""
    if end is None:
        end = PREFIX_BLOCK
    digest = hashlib.blake2b(prompt[:end].encode("utf-8", "surrogatepass"), digest_size=16)
    return "prefix:" + digest.hexdigest()
