"""The sans-IO KV index: lenient event decoding, the token-block chain, sequence tracking."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sieproxy.core.routing.kvindex import (
    APPROX_BLOCK,
    AllBlocksCleared,
    ApproxIndex,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    EventStream,
    KVEventError,
    chain_keys,
    decode_batch,
    matched_blocks,
    root_key,
)

B = 4


def stored(hashes: list[Any], parent: Any, tokens: list[int], *, style: str = "vllm",
           block_size: int = B, lora: int | None = None, medium: str | None = None) -> Any:
    if style == "sglang":
        return ["BlockStored", hashes, parent, tokens, block_size, lora]
    if style == "map":
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": block_size, "lora_id": lora,
                "medium": medium, "lora_name": None}
    return ["BlockStored", hashes, parent, tokens, block_size, lora, medium, None]


def removed(hashes: list[Any], *, style: str = "vllm", medium: str | None = None) -> Any:
    if style == "sglang":
        return ["BlockRemoved", hashes]
    if style == "map":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    return ["BlockRemoved", hashes, medium]


def batch(*events: Any, rank: int | None = None, as_map: bool = False, ts: float = 1.0) -> bytes:
    if as_map:
        return msgspec.msgpack.encode({"ts": ts, "events": list(events),
                                       "data_parallel_rank": rank})
    body: list[Any] = [ts, list(events)]
    if rank is not None:
        body.append(rank)
    return msgspec.msgpack.encode(body)


TOKS = list(range(100, 124))  # six blocks of B
KEYS = chain_keys(TOKS, B)


def chain_events(tokens: list[int], start_hash: int = 1, style: str = "vllm",
                 per_event: int = 1) -> list[Any]:
    """BlockStored events storing ``tokens`` block by block, engine hashes from start_hash."""
    out, parent, h = [], None, start_hash
    blocks = [tokens[i:i + B] for i in range(0, len(tokens) - B + 1, B)]
    for i in range(0, len(blocks), per_event):
        group = blocks[i:i + per_event]
        hashes = list(range(h, h + len(group)))
        out.append(stored(hashes, parent, [t for b in group for t in b], style=style))
        parent, h = hashes[-1], h + len(group)
    return out


# ---------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("style", ["vllm", "sglang", "map"])
@pytest.mark.parametrize("rank", [None, 2])
@pytest.mark.parametrize("as_map", [False, True])
def test_every_encoding_decodes_to_the_same_events(style: str, rank: int | None,
                                                   as_map: bool) -> None:
    b = decode_batch(batch(stored([7], None, [1, 2, 3, 4], style=style),
                           removed([7], style=style), ["AllBlocksCleared"],
                           rank=rank, as_map=as_map, ts=3.5))
    assert b.ts == 3.5 and b.dp_rank == rank and b.skipped == 0
    s, r, c = b.events
    assert s == BlockStored([7], None, [1, 2, 3, 4], B, None, None)
    assert r == BlockRemoved([7], None)
    assert c == AllBlocksCleared()


def test_map_events_and_bytes_hashes_and_extras() -> None:
    b = decode_batch(batch(
        {"type": "AllBlocksCleared"},
        stored([b"\x01" * 32], b"\x00" * 32, [1, 2, 3, 4], lora=3, medium="CPU"),
        ["BlockStored", [5], None, [1, 2, 3, 4], 4, None, "GPU", "adapter", "future-field"],
        ["SomethingNew", 1, 2],
    ))
    assert b.skipped == 1
    assert b.events[1] == BlockStored([b"\x01" * 32], b"\x00" * 32, [1, 2, 3, 4], 4, 3, "CPU")
    assert b.events[2] == BlockStored([5], None, [1, 2, 3, 4], 4, None, "GPU")


@pytest.mark.parametrize("payload", [
    b"\xc1",  # not msgpack
    msgspec.msgpack.encode(5),
    msgspec.msgpack.encode([1.0]),
    msgspec.msgpack.encode(["x", []]),
    msgspec.msgpack.encode([1.0, "no list"]),
    msgspec.msgpack.encode([1.0, [5]]),
    msgspec.msgpack.encode([1.0, [[]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", 1, None, [1], 1]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, ["a"], 1]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [1], 1]]]),
    msgspec.msgpack.encode([1.0, [["BlockRemoved"]]]),
    msgspec.msgpack.encode([1.0, [["BlockRemoved", 3]]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
])
def test_malformed_payloads_are_errors(payload: bytes) -> None:
    with pytest.raises(KVEventError):
        decode_batch(payload)


# ---------------------------------------------------------------------------- keys / index


def test_chain_keys_depend_on_every_earlier_token_and_skip_partial_blocks() -> None:
    assert len(chain_keys([*TOKS, 1, 2], B)) == 6
    other = chain_keys([999, *TOKS[1:]], B)
    assert not set(other) & set(KEYS)  # one token differs at the start: no block matches
    assert chain_keys(TOKS, B)[:3] == chain_keys(TOKS[:12], B)
    assert chain_keys(TOKS, B, root_key(1)) != KEYS
    assert chain_keys([], B) == [] and chain_keys([1, 2], B) == []


@pytest.mark.parametrize("style", ["vllm", "sglang", "map"])
@pytest.mark.parametrize("per_event", [1, 3])
def test_index_matches_the_prompt_chain(style: str, per_event: int) -> None:
    ix = BlockIndex()
    ix.apply(decode_batch(batch(*chain_events(TOKS, style=style, per_event=per_event))))
    assert ix.block_size == B and len(ix) == 6 and ix.tokens == 24
    assert matched_blocks(KEYS, ix) == 6
    assert matched_blocks(chain_keys(TOKS[:10] + [0] * 14, B), ix) == 2
    # removing a middle block cuts the match there
    ix.apply(decode_batch(batch(removed([4], style=style))))
    assert matched_blocks(KEYS, ix) == 3
    ix.apply(decode_batch(batch(["AllBlocksCleared"])))
    assert len(ix) == 0 and matched_blocks(KEYS, ix) == 0


def test_orphans_partial_blocks_media_and_ranks() -> None:
    ix = BlockIndex()
    ix.apply(decode_batch(batch(stored([50], 49, [1, 2, 3, 4]))))  # parent never seen
    assert ix.orphans == 1 and len(ix) == 0
    ix.apply(decode_batch(batch(stored([1, 2], None, TOKS[:6]))))  # second block partial
    assert len(ix) == 1
    # the same block on two media: gone only when both removed it
    ix.apply(decode_batch(batch(stored([1], None, TOKS[:4], medium="CPU"))))
    ix.apply(decode_batch(batch(removed([1], medium="GPU"))))
    assert matched_blocks(KEYS, ix) == 1
    ix.apply(decode_batch(batch(removed([1], medium="CPU"))))
    assert matched_blocks(KEYS, ix) == 0
    # two data-parallel ranks may reuse one engine hash for different blocks
    ix.apply(decode_batch(batch(stored([9], None, TOKS[:4]), rank=0)))
    ix.apply(decode_batch(batch(stored([9], None, [7, 7, 7, 7]), rank=1)))
    ix.apply(decode_batch(batch(stored([10], 9, TOKS[4:8]), rank=0)))
    assert matched_blocks(KEYS, ix) == 2
    ix.apply(decode_batch(batch(removed([9]), rank=1)))
    assert matched_blocks(KEYS, ix) == 2
    ix.apply(decode_batch(batch(removed([404]))))  # unknown: ignored
    # an adapter's blocks never match the base model's chain
    ix2 = BlockIndex()
    ix2.apply(decode_batch(batch(stored([1], None, TOKS[:4], lora=2))))
    assert matched_blocks(KEYS, ix2) == 0
    assert matched_blocks(chain_keys(TOKS, B, root_key(2)), ix2) == 1


def test_duplicate_blocks_count_once() -> None:
    ix = BlockIndex()
    ix.apply(decode_batch(batch(stored([1], None, TOKS[:4]), stored([1], None, TOKS[:4]))))
    ix.apply(decode_batch(batch(stored([2], None, TOKS[:4]), rank=1)))  # same tokens, rank 1
    assert len(ix) == 1 and ix.stored_tokens == 4
    ix.apply(decode_batch(batch(removed([2]), rank=1)))
    assert matched_blocks(KEYS, ix) == 1


def test_approx_index_is_an_lru_in_tokens() -> None:
    ax = ApproxIndex(capacity_tokens=4 * APPROX_BLOCK)
    toks = list(range(3 * APPROX_BLOCK))
    keys = chain_keys(toks, APPROX_BLOCK)
    ax.record(keys)
    assert matched_blocks(keys, ax) == 3 and ax.tokens == 3 * APPROX_BLOCK
    other = chain_keys(toks[:APPROX_BLOCK] + [9] * 2 * APPROX_BLOCK, APPROX_BLOCK)
    ax.record(other)  # 5 distinct blocks > 4: the least recent extension goes, not the prefix
    assert len(ax) == 4
    assert matched_blocks(other, ax) == 3
    assert matched_blocks(keys, ax) == 2
    ax.resize(APPROX_BLOCK)
    assert len(ax) == 1 and matched_blocks(keys, ax) == 1
    ax.clear()
    assert len(ax) == 0
    assert len(ApproxIndex(0)) == 0


# ---------------------------------------------------------------------------- the stream


def feed(st: EventStream, seq: int, *events: Any, now: float = 0.0) -> int | None:
    return st.receive(seq, batch(*events), now)


def test_stream_from_sequence_zero_is_in_sync() -> None:
    st = EventStream(capacity_tokens=1000)
    assert not st.in_sync(0)
    ev = chain_events(TOKS)
    for seq, e in enumerate(ev):
        assert feed(st, seq, e) is None
    assert st.in_sync(0) and matched_blocks(KEYS, st.index) == 6 and st.last_seq == 5


def test_gap_asks_a_replay_which_fills_it() -> None:
    st = EventStream(capacity_tokens=1000)
    ev = chain_events(TOKS)
    feed(st, 0, ev[0])
    feed(st, 1, ev[1])
    assert feed(st, 4, ev[4]) == 2  # 2 and 3 lost
    assert st.gaps == 1 and not st.in_sync(0)
    assert feed(st, 5, ev[5]) is None  # held while the replay is awaited
    for seq in (0, 1, 2, 3):  # the engine's buffer: everything; old ones are skipped
        st.replayed(seq, batch(ev[seq]))
    st.replay_done()
    assert st.in_sync(0) and st.last_seq == 5 and matched_blocks(KEYS, st.index) == 6
    assert st.losses == 0


def test_gap_the_replay_cannot_fill_is_lost_until_the_cache_turned_over() -> None:
    st = EventStream(capacity_tokens=8)  # two blocks of B
    ev = chain_events(TOKS)
    feed(st, 0, ev[0])
    assert feed(st, 3, ev[3]) == 1
    st.replayed(2, batch(ev[2]))  # the buffer starts after what we miss
    st.replay_done()
    assert st.losses == 1 and not st.in_sync(0) and st.last_seq == 3
    assert len(st.index) == 0  # ev[2]'s parent was forgotten: orphans
    feed(st, 4, stored([100], None, TOKS[:4]))
    assert not st.in_sync(0)
    feed(st, 5, stored([101], 100, TOKS[4:8]))  # 8 new tokens = the whole cache: in sync
    assert st.in_sync(0) and matched_blocks(KEYS, st.index) == 2


def test_replay_that_never_answers_loses_the_held_gap() -> None:
    st = EventStream(capacity_tokens=1000)
    feed(st, 0, ["AllBlocksCleared"])
    assert feed(st, 2, stored([1], None, TOKS[:4])) == 1
    st.replay_done()  # no replay socket, or it timed out
    assert st.losses == 1 and not st.in_sync(0) and st.last_seq == 2
    feed(st, 3, ["AllBlocksCleared"])  # an empty cache: in sync from here
    assert st.in_sync(0)


def test_first_contact_mid_stream_replays_from_zero() -> None:
    st = EventStream(capacity_tokens=1000)
    ev = chain_events(TOKS)
    assert feed(st, 3, ev[3]) == 0
    for seq in range(3):
        st.replayed(seq, batch(ev[seq]))
    st.replay_done()
    assert st.in_sync(0) and matched_blocks(KEYS, st.index) == 4


def test_restart_clears_and_resyncs() -> None:
    st = EventStream(capacity_tokens=1000)
    ev = chain_events(TOKS)
    for seq in range(4):
        feed(st, seq, ev[seq])
    assert feed(st, 0, ev[0]) is None  # the sequence went back: a new engine process
    assert st.restarts == 1 and st.in_sync(0) and matched_blocks(KEYS, st.index) == 1
    # a restart seen after its first batch: replay from zero
    assert feed(st, 0 + 0, ev[0]) is None and st.restarts == 2
    feed(st, 1, ev[1])
    assert feed(st, 1, ev[1]) == 0 and st.restarts == 3


def test_restart_while_awaiting_a_replay() -> None:
    st = EventStream(capacity_tokens=1000)
    feed(st, 0, ["AllBlocksCleared"])
    assert feed(st, 5, ["AllBlocksCleared"]) == 1
    assert feed(st, 0, stored([1], None, TOKS[:4])) is None
    assert st.restarts == 1 and st.in_sync(0) and st.replay_from is None


def test_health_failure_suspects_until_the_sequence_continues() -> None:
    st = EventStream(capacity_tokens=1000)
    feed(st, 0, *chain_events(TOKS))
    st.health_failed()
    assert not st.in_sync(0) and matched_blocks(KEYS, st.index) == 6
    feed(st, 1, removed([6]))
    assert st.in_sync(0) and matched_blocks(KEYS, st.index) == 5


def test_silent_stream_goes_stale() -> None:
    st = EventStream(capacity_tokens=1000, stale_after=2.0)
    feed(st, 0, ["AllBlocksCleared"], now=0.0)
    st.sent(10.0)
    st.sent(11.0)  # the earliest unanswered send counts
    assert st.in_sync(12.0) and not st.in_sync(12.5)
    feed(st, 1, stored([1], None, TOKS[:4]), now=13.0)
    assert st.in_sync(100.0)


def test_undecodable_batch_is_a_loss() -> None:
    st = EventStream(capacity_tokens=4)
    feed(st, 0, *chain_events(TOKS))
    st.receive(1, b"\xc1", 0.0)
    assert st.bad_batches == 1 and st.losses == 1 and not st.in_sync(0)
    feed(st, 2, stored([1], None, TOKS[:4]))
    assert st.in_sync(0)


def test_too_many_held_batches_give_up_waiting() -> None:
    from sieproxy.core.routing import kvindex
    st = EventStream(capacity_tokens=10**9)
    feed(st, 0, ["AllBlocksCleared"])
    assert feed(st, 2, ["AllBlocksCleared"]) == 1
    for seq in range(3, 3 + kvindex.MAX_HELD):
        feed(st, seq, removed([1]))
    assert st.replay_from is None and st.losses == 1
    assert st.last_seq == 2 + kvindex.MAX_HELD


def test_live_batches_already_replayed_are_skipped_not_taken_for_a_restart() -> None:
    st = EventStream(capacity_tokens=1000)
    ev = chain_events(TOKS)
    assert feed(st, 2, ev[2]) == 0  # joined late
    for seq in range(5):  # the replay reaches past what arrived live
        st.replayed(seq, batch(ev[seq]))
    st.replay_done()
    assert feed(st, 3, ev[3]) is None and feed(st, 4, ev[4]) is None  # queued while replaying
    assert st.restarts == 0 and st.last_seq == 4
    feed(st, 5, ev[5])
    assert st.in_sync(0) and matched_blocks(KEYS, st.index) == 6


def test_joining_replays_from_the_start_and_holds_live_batches() -> None:
    st = EventStream(capacity_tokens=1000)
    ev = chain_events(TOKS)
    assert not st.joined
    assert st.join() == 0 and st.joins == 1 and not st.suspect
    assert not st.joined  # the replay is still awaited
    assert feed(st, 3, ev[3]) is None  # arrives live while the replay runs: held
    for seq in range(3):
        st.replayed(seq, batch(ev[seq]))
    st.replay_done()
    assert st.joined
    assert st.in_sync(0) and st.last_seq == 3 and matched_blocks(KEYS, st.index) == 4
    assert st.gaps == 0 and st.losses == 0


def test_joining_an_engine_that_published_nothing_is_in_sync_and_empty() -> None:
    st = EventStream(capacity_tokens=1000)
    assert st.join() == 0
    st.replay_done(ended=True)  # the end marker, and nothing before it
    assert st.in_sync(0) and st.last_seq is None and len(st.index) == 0
    assert feed(st, 0, *chain_events(TOKS)) is None  # its first batch, then
    assert st.in_sync(0) and matched_blocks(KEYS, st.index) == 6


def test_a_join_replay_without_an_answer_waits_for_the_first_batch() -> None:
    st = EventStream(capacity_tokens=1000)
    assert st.join() == 0
    st.replay_done()  # no replay socket, or it timed out: nothing is known
    assert not st.in_sync(0) and st.last_seq is None and st.replay_from is None
    assert feed(st, 0, ["AllBlocksCleared"]) is None and st.in_sync(0)
    st.restart()  # a later join's empty replay from 0 after the engine moved: in sync
    assert st.join() == 0
    st.replay_done(ended=True)
    assert st.in_sync(0)
    assert st.join() == 0 and st.suspect  # a reconnection before any batch: suspect ...
    st.replay_done(ended=True)  # ... until the engine says it published nothing
    assert st.in_sync(0)


def test_joining_while_a_replay_is_awaited_asks_no_second_one() -> None:
    st = EventStream(capacity_tokens=1000)
    feed(st, 0, ["AllBlocksCleared"])
    assert feed(st, 3, ["AllBlocksCleared"]) == 1
    assert st.join() is None and st.replay_from == 1


def test_a_reconnection_is_suspect_until_the_sequence_goes_on() -> None:
    st = EventStream(capacity_tokens=1000)
    ev = chain_events(TOKS)
    assert st.join() == 0
    st.replay_done()
    feed(st, 0, ev[0])
    assert st.in_sync(0)
    assert st.join() == 1 and st.joins == 2  # reconnected
    st.replay_done()  # nothing newer: the engine may be a new process
    assert not st.in_sync(0) and st.suspect
    feed(st, 1, ev[1])  # the sequence goes on: the same process
    assert st.in_sync(0) and matched_blocks(KEYS, st.index) == 2
    assert st.join() == 2  # reconnected again, and the replay brings what was missed
    st.replayed(2, batch(ev[2]))
    st.replay_done()
    assert st.in_sync(0) and st.last_seq == 2 and st.restarts == 0


def test_restart_forgets_everything() -> None:
    st = EventStream(capacity_tokens=1000)
    feed(st, 0, *chain_events(TOKS))
    feed(st, 1, ["AllBlocksCleared"])
    st.restart()  # e.g. the engine now publishes on new endpoints
    assert st.restarts == 1 and st.last_seq is None and len(st.index) == 0
    assert not st.in_sync(0)
    assert feed(st, 0, ["AllBlocksCleared"]) is None  # its sequence 0: no second restart
    assert st.restarts == 1 and st.in_sync(0)
    st.restart()
    assert feed(st, 2, ["AllBlocksCleared"]) == 0  # its first batch seen later: replay from 0


@pytest.mark.parametrize("ended", [True, False])
def test_a_first_batch_that_comes_live_during_the_join_replay_starts_in_sync(ended: bool) -> None:
    st = EventStream(capacity_tokens=1000)
    ev = chain_events(TOKS)
    assert st.join() == 0
    assert feed(st, 0, ev[0]) is None and feed(st, 1, ev[1]) is None  # held
    st.replay_done(ended=ended)  # the replay came before them (empty), or never answered
    assert st.in_sync(0) and st.last_seq == 1 and st.losses == 0
    assert matched_blocks(KEYS, st.index) == 2
