"""What each replica's prefix cache holds: KV-cache events decoded, indexed by token blocks.

Engines that publish KV-cache events (SGLang ``--kv-events-config``, vLLM
``--kv-events-config``, the bundled CPU engine) send, over ZMQ PUB, a multipart message per
batch: ``[topic, sequence (8 bytes, big-endian), msgpack payload]``. The payload is a batch
``[ts, events]`` or ``[ts, events, data_parallel_rank]`` (or the same three as a map); each
event is a tagged record, positional (``["BlockStored", ...]``) or a map (``{"type":
"BlockStored", ...}``):

- ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id`` then,
  in newer vLLM only, ``medium`` and ``lora_name`` (SGLang's record stops at ``lora_id``);
- ``BlockRemoved``: ``block_hashes`` then, in vLLM only, ``medium``;
- ``AllBlocksCleared``: nothing.

Decoding is lenient: extra trailing fields and unknown event types are skipped, a missing
optional field is ``None``; a payload that is not such a batch at all is a
:class:`KVEventError` (the stream then counts it as a lost batch).

Keys. An engine's block hashes are its own (seeded, salted, per-process) and cannot be computed
outside it, so the index keys a block by its *token ids chained from its parent*:
``key = hash((parent_key, tokens))`` with the root ``0`` (``hash((-1, lora_id))`` for an
adapter's blocks). A prompt tokenized at the gateway yields the same chain
(:func:`chain_keys`), and its longest run of leading keys present is the cached prefix.
Engine hashes only map each event's blocks to these keys (per data-parallel rank).

Sync. :class:`EventStream` follows one replica's sequence numbers. The index is *in sync*
while every batch since the engine's first (or since its cache was cleared) was applied:

- each connection to the publisher (:meth:`EventStream.join`) asks for a replay from the next
  sequence, since a subscriber misses what was published before its subscription arrived; a
  reconnection also makes the stream suspect (the engine may be a new process);
- first contact at sequence 0, an ``AllBlocksCleared``, or a replay from 0 that the engine
  answers with nothing (it has published nothing): in sync (the cache was empty);
- first contact later, or a gap: a replay is asked for from the first missing sequence
  (:meth:`EventStream.receive` returns it), live batches are held meanwhile; the replay fills
  the gap → in sync; it cannot (the engine's buffer no longer reaches back) → *lost*;
- a sequence going backwards, or the engine publishing on new endpoints
  (:meth:`EventStream.restart`): the engine restarted (its cache is empty): cleared, and in
  sync from its sequence 0 (replayed when the first one seen is later);
- lost: the index is cleared and follows new events; it is in sync again once the blocks
  stored since cover the replica's whole cache (everything older has been evicted by then), or
  at the next ``AllBlocksCleared`` or restart;
- suspect (the health watcher saw the replica fail, or a reconnection): out of sync until the
  next batch shows the sequence continuing (same engine process) or restarting;
- stale: a request was sent there ``stale_after`` seconds ago and no batch came since.

A replica whose stream is not in sync is routed on the approximate index
(:class:`ApproxIndex`: what the gateway itself sent there) until it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "APPROX_BLOCK",
    "AllBlocksCleared",
    "ApproxIndex",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventStream",
    "KVEventError",
    "chain_keys",
    "decode_batch",
    "matched_blocks",
    "root_key",
]

#: Block size (tokens) of the approximate index, and of matching before an engine said its own.
APPROX_BLOCK = 16
#: Live batches held while a replay is awaited; beyond this the stream is declared lost.
MAX_HELD = 1024


class KVEventError(ValueError):
    """A payload that is not a KV-event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[Hashable]
    parent_block_hash: Hashable | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[Hashable]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None
    skipped: int = 0  # events of unknown type


# ---------------------------------------------------------------------------- decoding

_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED = ("block_hashes", "medium")


def _hash(v: Any) -> Hashable:
    if isinstance(v, bool) or not isinstance(v, int | bytes | str):
        raise KVEventError(f"a block hash is an int or bytes, not {type(v).__name__}")
    return v


def _fields(raw: Any, names: tuple[str, ...], required: int) -> list[Any]:
    """``raw``'s fields after the tag, by position or by name; missing optional ones None."""
    if isinstance(raw, dict):
        if any(n not in raw for n in names[:required]):
            raise KVEventError(f"an event lacks one of {names[:required]}")
        return [raw.get(n) for n in names]
    vals = list(raw[1:])
    if len(vals) < required:
        raise KVEventError(f"an event has {len(vals)} fields, needs {required}")
    return (vals + [None] * len(names))[: len(names)]


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    else:
        raise KVEventError("an event is a tagged array or map")
    if tag == "BlockStored":
        hashes, parent, tokens, size, lora, medium = _fields(raw, _STORED, 4)
        if not isinstance(hashes, list) or not isinstance(tokens, list):
            raise KVEventError("BlockStored: block_hashes and token_ids are arrays")
        if not isinstance(size, int) or size < 1:
            raise KVEventError("BlockStored: block_size is a positive integer")
        if not all(isinstance(t, int) for t in tokens):
            raise KVEventError("BlockStored: token_ids are integers")
        return BlockStored(
            [_hash(h) for h in hashes],
            None if parent is None else _hash(parent),
            tokens,
            size,
            lora if isinstance(lora, int) else None,
            medium if isinstance(medium, str) else None,
        )
    if tag == "BlockRemoved":
        hashes, medium = _fields(raw, _REMOVED, 1)
        if not isinstance(hashes, list):
            raise KVEventError("BlockRemoved: block_hashes is an array")
        return BlockRemoved([_hash(h) for h in hashes], medium if isinstance(medium, str) else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """One published payload → its batch (lenient; see the module docstring)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], (raw[2] if len(raw) > 2 else None)
    else:
        raise KVEventError("a batch is [ts, events, (dp_rank)] or a map")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise KVEventError("a batch has a numeric ts and an events array")
    out: list[Event] = []
    skipped = 0
    for e in events:
        ev = _event(e)
        if ev is None:
            skipped += 1
        else:
            out.append(ev)
    return EventBatch(float(ts), out, rank if isinstance(rank, int) else None, skipped)


# ---------------------------------------------------------------------------- keys


def root_key(lora_id: int | None = None) -> int:
    """The chain's root: 0 for the base model, one per adapter id."""
    return 0 if lora_id is None else hash((-1, lora_id))


def chain_keys(tokens: Sequence[int], block_size: int, root: int = 0) -> list[int]:
    """The keys of the whole blocks of ``tokens`` (a trailing partial block has none)."""
    keys: list[int] = []
    parent = root
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[i : i + block_size])))
        keys.append(parent)
    return keys


def matched_blocks(keys: Sequence[int], present: Any) -> int:
    """How many leading ``keys`` are in ``present`` (a container)."""
    n = 0
    for k in keys:
        if k not in present:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------- indexes


class BlockIndex:
    """The blocks one replica holds, from its events (see the module docstring)."""

    def __init__(self) -> None:
        #: (dp rank, engine hash) → (chain key, the media holding it)
        self._by_hash: dict[tuple[int | None, Hashable], tuple[int, set[str]]] = {}
        self._keys: dict[int, int] = {}  # chain key → engine blocks carrying it
        self.block_size: int | None = None  # the engine's, from its last BlockStored
        self.orphans = 0  # stored blocks whose parent was unknown (not indexed)
        self.stored_tokens = 0  # tokens of blocks newly indexed, in total

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def tokens(self) -> int:
        return len(self._keys) * (self.block_size or 0)

    def clear(self) -> None:
        self._by_hash.clear()
        self._keys.clear()

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(batch.dp_rank, ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(batch.dp_rank, ev)
            else:
                self.clear()

    def _stored(self, rank: int | None, ev: BlockStored) -> None:
        if ev.parent_block_hash is None:
            parent = root_key(ev.lora_id)
        else:
            found = self._by_hash.get((rank, ev.parent_block_hash))
            if found is None:
                self.orphans += len(ev.block_hashes)
                return
            parent = found[0]
        b = ev.block_size
        self.block_size = b
        medium = ev.medium or "GPU"
        for i, h in enumerate(ev.block_hashes):
            toks = ev.token_ids[i * b : (i + 1) * b]
            if len(toks) < b:
                break  # a partial block is not reusable
            parent = hash((parent, tuple(toks)))
            entry = self._by_hash.get((rank, h))
            if entry is None:
                self._by_hash[(rank, h)] = (parent, {medium})
                n = self._keys.get(parent, 0)
                self._keys[parent] = n + 1
                if n == 0:
                    self.stored_tokens += b
            else:
                entry[1].add(medium)

    def _removed(self, rank: int | None, ev: BlockRemoved) -> None:
        for h in ev.block_hashes:
            entry = self._by_hash.get((rank, h))
            if entry is None:
                continue
            key, media = entry
            if ev.medium is not None:
                media.discard(ev.medium)
            else:
                media.clear()
            if media:
                continue
            del self._by_hash[(rank, h)]
            n = self._keys[key] - 1
            if n:
                self._keys[key] = n
            else:
                del self._keys[key]


class ApproxIndex:
    """What the gateway sent to one replica, as chain keys of :data:`APPROX_BLOCK` tokens,
    least recently sent first, bounded to the replica's cache size (in tokens): an LRU like the
    engine's, refreshed deepest block first so a shared prefix outlives its extensions."""

    block_size = APPROX_BLOCK

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = max(0, capacity_tokens) // APPROX_BLOCK  # blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def tokens(self) -> int:
        return len(self._lru) * APPROX_BLOCK

    def resize(self, capacity_tokens: int) -> None:
        self.capacity = max(0, capacity_tokens) // APPROX_BLOCK
        self._trim()

    def record(self, keys: Sequence[int]) -> None:
        for k in reversed(keys):
            self._lru[k] = None
            self._lru.move_to_end(k)
        self._trim()

    def clear(self) -> None:
        self._lru.clear()

    def _trim(self) -> None:
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


# ---------------------------------------------------------------------------- the stream


class EventStream:
    """One replica's event stream: sequence numbers, replay, sync state, its index.

    ``capacity_tokens``: the replica's cache size (how many newly stored tokens bring a lost
    index back in sync). Times are the caller's clock (seconds).
    """

    def __init__(self, capacity_tokens: int, stale_after: float = 10.0) -> None:
        self.index = BlockIndex()
        self.capacity = capacity_tokens
        self.stale_after = stale_after
        self.last_seq: int | None = None  # the last batch applied
        self._live_last: int | None = None  # the last batch received live
        self.synced = False  # every batch since an empty cache was applied
        self.suspect = False
        self.replay_from: int | None = None  # a replay is awaited from this sequence
        self._held: list[tuple[int, EventBatch | None]] = []
        self._rebuilt_from = 0  # index.stored_tokens when it was last lost
        self._sent_at: float | None = None  # earliest request sent since the last batch
        self.last_batch_at: float | None = None
        self.last_ts: float | None = None  # the engine's timestamp of the last batch
        # counters (metrics)
        self.joins = 0  # connections to the engine's publisher
        self.gaps = 0
        self.restarts = 0
        self.losses = 0
        self.bad_batches = 0

    # -- state
    @property
    def joined(self) -> bool:
        """Connected to the publisher, with what was published before replayed (or given up)."""
        return self.joins > 0 and self.replay_from is None

    def in_sync(self, now: float) -> bool:
        return (
            self.synced and not self.suspect and self.replay_from is None and not self.stale(now)
        )

    def stale(self, now: float) -> bool:
        return self._sent_at is not None and now - self._sent_at > self.stale_after

    def sent(self, now: float) -> None:
        """A request was sent to the replica (its prefill will store blocks: a batch is due)."""
        if self._sent_at is None:
            self._sent_at = now

    def health_failed(self) -> None:
        """The replica failed a health check: its engine may have restarted."""
        self.suspect = True

    # -- input
    def join(self) -> int | None:
        """The subscription reached the engine (a connection to it completed): returns the
        sequence to replay from, so what was published before the engine heard of the
        subscription is not missed (None: a replay is already awaited)."""
        self.joins += 1
        if self.joins > 1:  # a reconnection: the engine may be a new process
            self.suspect = True
        if self.replay_from is not None:
            return None
        self.replay_from = self.last_seq + 1 if self.last_seq is not None else 0
        return self.replay_from

    def receive(self, seq: int, payload: bytes, now: float) -> int | None:
        """A live batch; returns the sequence to replay from when one is needed now."""
        self.last_batch_at = now
        self._sent_at = None
        if self._live_last is not None and seq <= self._live_last:
            self.restart()  # the live socket is ordered: its sequence went back
        self._live_last = seq
        if self.last_seq is not None and seq <= self.last_seq:
            return None  # already applied from a replay
        batch = self._decode(payload)
        if self.replay_from is not None:
            self._hold(seq, batch)
            return None
        last = self.last_seq
        if last is None:
            if seq == 0:
                self._start_empty()
            else:
                self._hold(seq, batch)
                self.replay_from = 0
                return 0
        elif seq > last + 1:
            self.gaps += 1
            self._hold(seq, batch)
            self.replay_from = last + 1
            return last + 1
        self.suspect = False  # the sequence continues: the same engine process
        self._apply(seq, batch)
        return None

    def replayed(self, seq: int, payload: bytes) -> None:
        """One batch of an awaited replay."""
        if self.replay_from is None:
            return
        start = self.last_seq + 1 if self.last_seq is not None else 0
        if seq < start:
            return
        if seq > start:  # the engine no longer has what we miss: follow on from here
            self._lost()
        elif self.last_seq is None:
            self._start_empty()
        self._apply(seq, self._decode(payload))

    def replay_done(self, *, ended: bool = False) -> None:
        """The replay ended (``ended``: its end marker came; else it failed): apply what was
        held, in order. An engine that answers a replay from 0 with nothing and sent nothing
        live has published nothing since it started: its cache is empty, in sync."""
        start = self.replay_from
        if start is None:
            return
        self.replay_from = None
        held, self._held = self._held, []
        if ended and start == 0 and self.last_seq is None and not held:
            self._start_empty()
            return
        for seq, batch in held:
            if self.last_seq is not None and seq <= self.last_seq:
                continue
            if self.last_seq is None and seq == 0:
                self._start_empty()  # the engine's first batch came live
            elif self.last_seq is None or seq != self.last_seq + 1:
                self._lost()
            self._apply(seq, batch)
        if self.last_seq is not None and self.last_seq >= start:
            self.suspect = False  # the sequence went on: the same engine process

    # -- internals
    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except KVEventError:
            self.bad_batches += 1
            return None

    def _hold(self, seq: int, batch: EventBatch | None) -> None:
        self._held.append((seq, batch))
        if len(self._held) > MAX_HELD:
            self.replay_done()

    def _start_empty(self) -> None:
        self.index.clear()
        self.synced = True
        self.suspect = False

    def restart(self) -> None:
        """The engine is a new process: its cache is empty and its sequence starts over."""
        self.restarts += 1
        self.index.clear()
        self.last_seq = self._live_last = None
        self.synced = False
        self.replay_from = None
        self._held = []

    def _lost(self) -> None:
        self.losses += 1
        self.index.clear()
        self.synced = False
        self._rebuilt_from = self.index.stored_tokens

    def _apply(self, seq: int, batch: EventBatch | None) -> None:
        self.last_seq = seq
        if batch is None:  # undecodable: as good as lost
            self._lost()
            return
        self.last_ts = batch.ts
        self.index.apply(batch)
        cleared = any(isinstance(e, AllBlocksCleared) for e in batch.events)
        turned_over = self.index.stored_tokens - self._rebuilt_from >= self.capacity
        if cleared or turned_over:
            self.synced = True

