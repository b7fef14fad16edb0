"""The CPU engine's prefix cache: the block tree alone (small shapes, no model), then in the
scheduler with the real model (reuse, identical greedy output, aborts, adapters, bound)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("xgrammar")

import torch

from engine.cpu.lora import LoraAdapter
from engine.cpu.model import KVPool, ModelConfig
from engine.cpu.prefix_cache import PrefixCache
from engine.cpu.runner import CpuEngine, EngineConfig
from tests.engine.test_cpu_engine import make_request, run

SMALL = ModelConfig(
    architecture="LlamaForCausalLM",
    model_type="llama",
    hidden_size=8,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=8,
    vocab_size=100,
    rms_norm_eps=1e-6,
    context_length=512,
    tie_word_embeddings=True,
    qkv_bias=False,
)


def _fill(pool: KVPool, slot: int, tokens: list[int]) -> None:
    """KV that is a function of (layer, position, token): what a real forward would write."""
    for layer in range(SMALL.num_layers):
        for pos, tok in enumerate(tokens):
            pool.k[layer][slot, :, pos] = layer * 1000 + tok
            pool.v[layer][slot, :, pos] = -(layer * 1000 + pos)


def _check(pool: KVPool, slot: int, tokens: list[int], n: int) -> None:
    for layer in range(SMALL.num_layers):
        for pos in range(n):
            assert torch.all(pool.k[layer][slot, :, pos] == layer * 1000 + tokens[pos])
            assert torch.all(pool.v[layer][slot, :, pos] == -(layer * 1000 + pos))


def test_match_copies_whole_blocks_and_keeps_the_last_token() -> None:
    pool = KVPool(SMALL, 2)
    cache = PrefixCache(SMALL, max_tokens=64, block_size=4)
    a = list(range(1, 12))  # 11 tokens: two whole blocks
    _fill(pool, 0, a)
    assert cache.insert(None, a, len(a), pool, 0) == 2
    assert cache.cached_blocks == 2
    b = [*a[:8], 50, 51, 52]
    assert cache.cached_length(None, b) == 8
    assert cache.match(None, b, pool, 1) == 8
    _check(pool, 1, a, 8)
    # Exactly the cached length: the last token is left to compute (its logits are needed).
    assert cache.match(None, a[:8], pool, 1) == 4
    assert cache.match(None, [9, *a[1:]], pool, 1) == 0  # first block differs
    assert cache.match("adapter", a, pool, 1) == 0  # another adapter's namespace
    # Extending a cached path reuses its nodes.
    _fill(pool, 1, [*b, 53])
    assert cache.insert(None, [*b, 53], 12, pool, 1) == 1
    assert cache.cached_blocks == 3


def test_lru_eviction_at_the_bound_keeps_recent_and_parents() -> None:
    pool = KVPool(SMALL, 1)
    cache = PrefixCache(SMALL, max_tokens=16, block_size=4)  # 4 blocks
    shared = [7, 7, 7, 7]
    seqs = [[*shared, i, i, i, i] for i in range(10, 13)]
    for s in seqs[:3]:
        _fill(pool, 0, s)
        cache.insert(None, s, 8, pool, 0)
    assert cache.cached_blocks == 4  # shared block + three tails
    assert cache.match(None, seqs[0] + [1], pool, 0) == 8  # seqs[0] is now the most recent
    new = [1, 2, 3, 4, 5, 6, 7, 8]
    _fill(pool, 0, new)
    cache.insert(None, new, 8, pool, 0)
    assert cache.cached_blocks == 4
    assert cache.evictions == 2  # the tails of seqs[1] and seqs[2], least recent leaves
    assert cache.match(None, seqs[0] + [1], pool, 0) == 8
    _check(pool, 0, seqs[0], 8)
    assert cache.match(None, seqs[1] + [1], pool, 0) == 4  # its tail went; the shared stays
    assert cache.match(None, [*new, 1], pool, 0) == 8
    _check(pool, 0, new, 8)


def test_a_path_longer_than_the_bound_is_cut_not_self_evicted() -> None:
    pool = KVPool(SMALL, 1)
    cache = PrefixCache(SMALL, max_tokens=8, block_size=4)
    long = list(range(1, 21))
    _fill(pool, 0, long)
    assert cache.insert(None, long, 20, pool, 0) == 2
    assert cache.match(None, long, pool, 0) == 8
    _check(pool, 0, long, 8)


def test_soak_of_distinct_prompts_stays_within_the_bound() -> None:
    pool = KVPool(SMALL, 1)
    cache = PrefixCache(SMALL, max_tokens=40, block_size=4)
    store = cache._store.data_ptr(), cache._store.numel()
    for i in range(500):
        seq = [(i * 7 + j) % 97 + 1 for j in range(4 + i % 23)]
        _fill(pool, 0, seq)
        cache.insert(None, seq, len(seq), pool, 0)
        assert cache.cached_blocks <= 10
        assert len(cache._free) + cache.cached_blocks == 10
    assert (cache._store.data_ptr(), cache._store.numel()) == store  # never reallocated
    cache.flush()
    assert cache.cached_blocks == 0 and cache.match(None, seq, pool, 0) == 0


def test_disabled_cache_is_inert() -> None:
    pool = KVPool(SMALL, 1)
    cache = PrefixCache(SMALL, max_tokens=0)
    assert not cache.enabled
    assert cache.insert(None, list(range(40)), 40, pool, 0) == 0
    assert cache.match(None, list(range(40)), pool, 0) == 0


# -- with the model ------------------------------------------------------------------------------

pm = pytest.mark.model

SYSTEM = (
    "You are a careful assistant. Answer questions about geography, history and science "
    "with short, exact sentences, and say so when you do not know. "
)


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = CpuEngine(EngineConfig(model="default", max_running=4, prefix_cache_tokens=1024))
    eng.load()
    yield eng
    eng.shutdown()
    gc.collect()


def _flush(engine: CpuEngine) -> None:
    import threading

    done = threading.Event()
    assert engine.scheduler is not None
    engine.scheduler.flush_cache(done.set)
    assert done.wait(30)


def _greedy(engine: CpuEngine, ids: list[int], n: int = 16, **kw: Any) -> tuple[list[int], int]:
    req, last = run(engine, ids, temperature=0, max_new_tokens=n, ignore_eos=True, **kw)
    assert last.finish is not None and last.finish["type"] == "length"
    return req.output_ids, req.cached_tokens


@pm
def test_shared_prefix_reused_with_identical_greedy_output(engine: CpuEngine) -> None:
    first = engine.encode(SYSTEM + "Question: what is the capital of France?")
    second = engine.encode(SYSTEM + "Question: which river flows through Paris?")
    _flush(engine)
    ref_first, cached = _greedy(engine, first)
    assert cached == 0
    _flush(engine)
    ref_second, cached = _greedy(engine, second)
    assert cached == 0
    _flush(engine)
    out, _ = _greedy(engine, first)  # fills the cache with the shared system prompt
    assert out == ref_first
    out, cached = _greedy(engine, second)
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    block = engine.scheduler.cache.block_size  # type: ignore[union-attr]
    assert cached == common // block * block > 0
    assert out == ref_second
    # The next turn: prompt + answer + more. Its prefix (generated tokens included) is cached.
    turn = second + out + engine.encode(" Thanks. And its length?")
    _flush(engine)
    ref_turn, cached = _greedy(engine, turn)
    assert cached == 0
    _flush(engine)
    _greedy(engine, second)
    out, cached = _greedy(engine, turn)
    assert cached >= (len(second) + 15) // block * block
    assert out == ref_turn
    stats = engine.scheduler.statistics()  # type: ignore[union-attr]
    assert 0 < stats["prefix_cache_tokens"] <= stats["prefix_cache_max_tokens"] == 1024


@pm
def test_concurrent_requests_sharing_a_prefix(engine: CpuEngine) -> None:
    prompts = [engine.encode(SYSTEM + f"Question {i}: name a planet.") for i in range(4)]
    _flush(engine)
    refs = []
    for p in prompts:
        refs.append(_greedy(engine, p)[0])
        _flush(engine)
    _greedy(engine, prompts[0])
    pairs = [make_request(engine, p, temperature=0, max_new_tokens=16, ignore_eos=True)
             for p in prompts]  # fmt: skip
    for req, _ in pairs:
        engine.scheduler.submit(req)  # type: ignore[union-attr]
    for (req, col), ref in zip(pairs, refs, strict=True):
        col.wait()
        assert req.cached_tokens > 0
        assert req.output_ids == ref


@pm
def test_aborted_request_leaves_the_cache_consistent(engine: CpuEngine) -> None:
    sched = engine.scheduler
    assert sched is not None
    ids = engine.encode(SYSTEM + "Tell me a long story about a lighthouse keeper.")
    _flush(engine)
    req, col = make_request(engine, ids, temperature=0, max_new_tokens=400, ignore_eos=True)
    sched.submit(req)
    while len(req.output_ids) < 40:
        assert not col.done.wait(0.02)
    sched.abort(req.rid)
    last = col.wait(30)
    assert last.finish is not None and last.finish["message"] == "Aborted"
    produced = req.output_ids[:]
    assert sched.pool.free_slots == sched.max_running
    turn = ids + produced[:32]
    out, cached = _greedy(engine, turn)
    assert cached >= len(ids) // 16 * 16
    _flush(engine)
    ref, cached = _greedy(engine, turn)
    assert cached == 0
    assert out == ref
    # The uncached continuation agrees with what the aborted request had generated.
    assert ref[: len(produced) - 32] == produced[32 : 32 + len(ref)]


def _random_adapter(engine: CpuEngine) -> LoraAdapter:
    c = engine.model.config  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(3)
    adapter = LoraAdapter("kv", Path("."), rank=4, scale=1.0)
    kv_dim = c.num_kv_heads * c.head_dim
    for layer in range(c.num_layers):
        for module in ("k_proj", "v_proj"):
            a = torch.randn(c.hidden_size, 4, generator=gen) * 0.3
            b = torch.randn(4, kv_dim, generator=gen) * 0.3
            adapter.layers[(layer, module)] = (a, b)
    return adapter


@pm
def test_adapters_do_not_share_entries(engine: CpuEngine) -> None:
    adapter = _random_adapter(engine)
    ids = engine.encode(SYSTEM + "Question: how many moons does Mars have?")
    _flush(engine)
    base, cached = _greedy(engine, ids)
    assert cached == 0
    adapted, cached = _greedy(engine, ids, adapter=adapter)
    assert cached == 0  # the base model's KV is not reused under the adapter
    assert adapted != base
    again, cached = _greedy(engine, ids, adapter=adapter)
    assert cached > 0 and again == adapted
    again, cached = _greedy(engine, ids)
    assert cached > 0 and again == base


@pm
def test_a_running_requests_prompt_is_shared_before_it_finishes(engine: CpuEngine) -> None:
    sched = engine.scheduler
    assert sched is not None
    ids = engine.encode(SYSTEM + "Describe the water cycle in detail.")
    other = engine.encode(SYSTEM + "Describe the carbon cycle.")
    _flush(engine)
    ref, _ = _greedy(engine, other)
    _flush(engine)
    long, col = make_request(engine, ids, temperature=0, max_new_tokens=400, ignore_eos=True)
    sched.submit(long)
    while not long.output_ids:
        assert not col.done.wait(0.02)
    out, cached = _greedy(engine, other)
    assert not col.done.is_set()  # the first request is still decoding
    assert cached > 0 and out == ref
    sched.abort(long.rid)
    col.wait(30)


@pm
def test_requests_arriving_together_prefill_a_shared_prompt_once(engine: CpuEngine) -> None:
    ids = engine.encode(SYSTEM * 3 + "Question: name three rivers of Europe.")
    _flush(engine)
    ref, _ = _greedy(engine, ids)
    _flush(engine)
    pairs = [make_request(engine, ids, temperature=0, max_new_tokens=16, ignore_eos=True)
             for _ in range(3)]  # fmt: skip
    for req, _ in pairs:
        engine.scheduler.submit(req)  # type: ignore[union-attr]
    for _, col in pairs:
        col.wait()
    cached = sorted(req.cached_tokens for req, _ in pairs)
    assert cached[0] == 0  # one of them computed the prompt ...
    assert cached[1] == cached[2] == (len(ids) - 1) // 16 * 16  # ... the others reused it
    assert all(req.output_ids == ref for req, _ in pairs)


def test_events_let_an_index_follow_the_cache_exactly() -> None:
    """The KV events the cache reports rebuild, in the gateway's index, exactly what it holds:
    for every prompt, the index's match equals the cache's own (inserts, evictions, flush)."""
    import random

    import msgspec

    from sieproxy.core.routing.kvindex import BlockIndex, chain_keys, decode_batch, matched_blocks

    pool = KVPool(SMALL, 1)
    cache = PrefixCache(SMALL, max_tokens=24, block_size=4)  # 6 blocks: evictions happen
    index = BlockIndex()
    cache.on_events = lambda evs: index.apply(
        decode_batch(msgspec.msgpack.encode([0.0, evs])))
    rnd = random.Random(5)
    prompts = [[rnd.randrange(3) for _ in range(rnd.randrange(4, 20))] for _ in range(40)]
    for p in prompts:
        _fill(pool, 0, p)
        cache.insert(None, p, len(p), pool, 0)
        for q in prompts:
            held = matched_blocks(chain_keys([*q, 0], 4), index) * 4
            assert held == cache.cached_length(None, [*q, 0])
    assert len(index) == cache.cached_blocks
    cache.insert("adapter", prompts[0], len(prompts[0]), pool, 0)  # another namespace
    assert matched_blocks(chain_keys(prompts[0] + [0], 4), index) * 4 == cache.cached_length(
        None, prompts[0] + [0])
    cache.flush()
    assert len(index) == 0
