"""Prefix cache: the KV of token blocks already computed, reused by later requests.

Structure. A tree of fixed-size *blocks* (``block_size`` tokens each), one tree per adapter: a
block's node is reached from its parent by the tuple of its own tokens, so a path from a root
spells a prompt prefix exactly (no hashing, no collisions) and two prompts sharing a prefix
share its nodes. Each node owns one block of a preallocated store ``[blocks, layers, 2,
kv_heads, block_size, head_dim]`` holding the K and V of its tokens at their absolute positions.
The store is allocated once with ``torch.empty`` at the configured bound, so memory never grows
past it (pages are touched as blocks are first written).

Use. The scheduler (the only thread touching this object) calls:

* :meth:`match` when it admits a request: the longest cached run of whole blocks of the prompt,
  stopping at least one token before the prompt's end (the last token is always computed, for
  its logits); it copies those blocks into the request's KV slot and prefills only the rest;
* :meth:`insert` when a request finishes (stop, length, or a client's abort): the whole blocks
  of what the slot holds (prompt plus generated tokens whose KV was written) are copied from
  the slot into the store, reusing the nodes already there.

Events. With ``on_events`` set (``--kv-events-config``, :mod:`engine.kv_events`), every change
is reported as SGLang reports its radix cache's: the blocks one insert created as one
``BlockStored`` (their hashes, the parent's, their tokens, the block size, the adapter's id or
None), evicted blocks as ``BlockRemoved``, a flush as ``AllBlocksCleared``. A block's hash is
``hash((parent's hash, its tokens))``: this process's own, as an engine's hashes are.

Copies, not shared pages: a running request never references the store, so eviction and
:meth:`flush` are safe at any time, and the decode kernels keep their dense per-slot layout.

LRU. Every node sits in one ordered map by last use. Each match or insert refreshes its whole
path from the deepest node up to the root, so a node is always more recent than all of its
descendants and the least recent node is always a leaf: eviction pops from the front and never
orphans a cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from engine.cpu.model import KVPool, ModelConfig

__all__ = ["PrefixCache"]

DEFAULT_BLOCK_SIZE = 16


class _Node:
    __slots__ = ("block", "children", "hash", "key", "parent")

    def __init__(self, parent: _Node | None, key: tuple[int, ...], block: int) -> None:
        self.parent = parent
        self.key = key
        self.block = block
        self.children: dict[tuple[int, ...], _Node] = {}
        self.hash = hash((parent.hash if parent is not None else 0, key))


class PrefixCache:
    """A bounded block tree of KV; see the module docstring."""

    def __init__(self, config: ModelConfig, max_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.capacity = max(0, max_tokens) // block_size  # blocks
        c = config
        shape = (self.capacity, c.num_layers, 2, c.num_kv_heads, block_size, c.head_dim)
        self._store = torch.empty(shape) if self.capacity else torch.empty(0)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._roots: dict[Hashable, _Node] = {}
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self.hits = 0  # prompt tokens served from the cache, in total
        self.evictions = 0  # blocks evicted, in total
        #: Called with each change's events (a list), from the scheduler thread.
        self.on_events: Callable[[list[Any]], None] | None = None
        self._removed: list[int] = []
        self._lora_ids: dict[Hashable, int | None] = {None: None}

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def cached_blocks(self) -> int:
        """Blocks in use."""
        return len(self._lru)

    @property
    def max_tokens(self) -> int:
        return self.capacity * self.block_size

    def _root(self, adapter: Hashable) -> _Node:
        root = self._roots.get(adapter)
        if root is None:
            root = self._roots[adapter] = _Node(None, (), -1)
            root.hash = 0 if adapter is None else hash((1, id(adapter)))
        return root

    def _touch(self, node: _Node) -> None:
        """Refresh ``node`` and its ancestors, deepest first (ancestors end up most recent)."""
        while node.parent is not None:
            self._lru.move_to_end(node)
            node = node.parent

    def _walk(self, adapter: Hashable, tokens: Sequence[int], limit: int) -> list[_Node]:
        """Nodes of the cached whole blocks of ``tokens[:limit]``, from the root down."""
        path: list[_Node] = []
        root = self._roots.get(adapter)
        if root is None:
            return path
        node, b = root, self.block_size
        for start in range(0, limit - b + 1, b):
            child = node.children.get(tuple(tokens[start : start + b]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def cached_length(self, adapter: Hashable, tokens: Sequence[int]) -> int:
        """How many tokens of ``tokens`` :meth:`match` would copy (no copy, no LRU refresh)."""
        if not self.capacity:
            return 0
        return len(self._walk(adapter, tokens, len(tokens) - 1)) * self.block_size

    @torch.inference_mode()
    def match(self, adapter: Hashable, tokens: Sequence[int], pool: KVPool, slot: int) -> int:
        """Copy the longest cached prefix of ``tokens`` (whole blocks, at most ``len - 1``
        tokens) into ``slot``; return its length in tokens."""
        if not self.capacity:
            return 0
        path = self._walk(adapter, tokens, len(tokens) - 1)
        if not path:
            return 0
        self._touch(path[-1])
        n = len(path) * self.block_size
        pool.ensure(n)
        idx = torch.tensor([node.block for node in path], dtype=torch.long)
        for layer in range(len(pool.k)):
            for which, dst in ((0, pool.k[layer]), (1, pool.v[layer])):
                # [blocks, kvh, B, D] -> the slot's [kvh, blocks * B, D], one layer at a time
                part = dst[slot, :, :n].view(dst.shape[1], len(path), self.block_size, -1)
                part.copy_(self._store[idx, layer, which].transpose(0, 1))
        self.hits += n
        return n

    @torch.inference_mode()
    def insert(
        self, adapter: Hashable, tokens: Sequence[int], length: int, pool: KVPool, slot: int
    ) -> int:
        """Cache the whole blocks of ``tokens[:length]`` whose KV ``slot`` holds; return how
        many blocks were newly written."""
        if not self.capacity:
            return 0
        b = self.block_size
        total = min(length, len(tokens)) // b
        if total == 0:
            return 0
        path = self._walk(adapter, tokens, total * b)
        if path:
            self._touch(path[-1])
        # Never evict the path being extended: keep at most `capacity` blocks on it.
        total = min(total, self.capacity)
        new = total - len(path)
        if new <= 0:
            return 0
        while len(self._free) < new:
            self._evict()
        node = path[-1] if path else self._root(adapter)
        created: list[_Node] = []
        for i in range(len(path), total):
            key = tuple(tokens[i * b : (i + 1) * b])
            child = _Node(node, key, self._free.pop())
            node.children[key] = child
            self._lru[child] = None
            created.append(child)
            node = child
        self._touch(node)
        start, end = len(path) * b, total * b
        self._report(adapter, path[-1] if path else None, created, tokens[start:end])
        idx = torch.tensor([c.block for c in created], dtype=torch.long)
        layers = len(pool.k)
        for layer in range(layers):
            for which, src in ((0, pool.k[layer]), (1, pool.v[layer])):
                # [kvh, n, D] -> [blocks, kvh, B, D]
                part = src[slot, :, start:end].reshape(src.shape[1], new, b, src.shape[3])
                self._store[idx, layer, which] = part.transpose(0, 1)
        return new

    def _evict(self) -> None:
        node, _ = self._lru.popitem(last=False)
        assert not node.children, "LRU order keeps leaves first"
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        self._free.append(node.block)
        self.evictions += 1
        if self.on_events is not None:
            self._removed.append(node.hash)

    def _report(
        self, adapter: Hashable, parent: _Node | None, created: list[_Node], tokens: Sequence[int]
    ) -> None:
        if self.on_events is None:
            return
        events: list[Any] = []
        if self._removed:
            events.append(["BlockRemoved", self._removed])
            self._removed = []
        lora = self._lora_ids.setdefault(adapter, len(self._lora_ids))
        parent_hash = parent.hash if parent is not None else None
        hashes = [c.hash for c in created]
        events.append(["BlockStored", hashes, parent_hash, list(tokens), self.block_size, lora])
        self.on_events(events)

    def flush(self) -> None:
        """Drop every entry."""
        self._roots.clear()
        self._lru.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        if self.on_events is not None:
            self._removed = []
            self.on_events([["AllBlocksCleared"]])

    def statistics(self) -> dict[str, int]:
        """Counters for /server_info."""
        return {
            "prefix_cache_max_tokens": self.max_tokens,
            "prefix_cache_tokens": len(self._lru) * self.block_size,
            "prefix_cache_hit_tokens": self.hits,
            "prefix_cache_evicted_blocks": self.evictions,
        }
