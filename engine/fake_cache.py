"""A prefix cache for the fake engine, publishing KV events (shell tests of cache-aware routing).

It does what an engine's radix cache does, in the small: the prompt (``input_ids``, else the
``text`` tokenized with a ``tokenizer.json``, the way the gateway tokenizes) is cut into whole
blocks chained by hash; a request is reported ``cached_tokens`` for its leading blocks present
(at most ``len - 1`` tokens, whole blocks), then all its blocks are stored, least recently used
ones evicted beyond ``capacity_tokens``. Each change is published as SGLang publishes it
(:mod:`engine.kv_events`): new blocks as one ``BlockStored``, evictions as ``BlockRemoved``.
The publisher's own test controls (lose batches, restart, fall silent) script the stream.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from engine.kv_events import KVEventPublisher, parse_kv_events_config

__all__ = ["FakePrefixCache"]


class FakePrefixCache:
    def __init__(
        self,
        tokenizer_path: str | None = None,
        *,
        block_size: int = 16,
        capacity_tokens: int = 4096,
        kv_events_config: str | None = None,
    ) -> None:
        self._tok: Any = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(tokenizer_path)
        self.block_size = block_size
        self.capacity = capacity_tokens // block_size  # blocks
        self._lru: OrderedDict[int, int | None] = OrderedDict()  # block hash → parent hash
        conf = parse_kv_events_config(kv_events_config)
        self.publisher = KVEventPublisher(conf) if conf is not None else None

    def tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self._tok is None:
            return [hash(w) & 0xFFFF for w in prompt.split()]
        ids: list[int] = self._tok.encode(prompt, add_special_tokens=True).ids
        return ids

    def serve(self, prompt: str | list[int]) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of one request, which is then cached."""
        toks = self.tokens(prompt)
        b = self.block_size
        hashes, parent = [], 0
        for i in range(0, len(toks) - b + 1, b):
            parent = hash((parent, tuple(toks[i : i + b])))
            hashes.append(parent)
        hit = 0
        for h in hashes:
            if h not in self._lru:
                break
            hit += 1
        cached = min(hit * b, (len(toks) - 1) // b * b) if toks else 0
        for h in reversed(hashes[:hit]):
            self._lru.move_to_end(h)
        events: list[Any] = []
        new = hashes[hit : hit + self.capacity]
        removed = []
        while new and len(self._lru) + len(new) > self.capacity:
            gone, _ = self._lru.popitem(last=False)
            removed.append(gone)
        if removed:
            events.append(["BlockRemoved", removed])
        for j, h in enumerate(new):
            self._lru[h] = hashes[hit + j - 1] if hit + j else None
        if new:
            first = hit * b
            events.append(["BlockStored", new, hashes[hit - 1] if hit else None,
                           toks[first : first + len(new) * b], b, None])  # fmt: skip
        if self.publisher is not None:
            self.publisher.publish(events)
        return len(toks), cached

    def server_info(self) -> dict[str, Any]:
        """What the engine adds to ``/server_info``."""
        return {
            "kv_events_config": self.publisher.config_json() if self.publisher else None,
            "prefix_cache_max_tokens": self.capacity * self.block_size,
        }

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
