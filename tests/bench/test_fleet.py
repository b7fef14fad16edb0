"""``python -m bench fleet``: the simulated fleet must run the real routing and model a prefix
cache, so that the policies' figures differ for the reasons the section says."""

from __future__ import annotations

from bench import fleet as F


def test_lru_hits_the_leading_run_and_evicts_extensions_first() -> None:
    cache = F.LRU(capacity=4 * F.BLOCK)
    chain, a = F._blocks(0, "sys", 2 * F.BLOCK)
    _, b = F._blocks(chain, "q", 2 * F.BLOCK)
    assert cache.hit(a + b) == 0
    cache.insert(a + b)
    assert cache.hit(a + b) == 4 * F.BLOCK
    _, other = F._blocks(chain, "other-question", F.BLOCK)
    cache.insert(a + other)  # over capacity: the least recent extension goes, not the prefix
    assert cache.hit(a) == 2 * F.BLOCK
    assert cache.hit(a + b) == 2 * F.BLOCK + F.BLOCK  # b's last block was evicted


def test_small_fleet_prefix_beats_least_loaded() -> None:
    p = F.Params(replicas=4, conversations=60, sessions=16)
    rows = {r["mode"]: r for r in F.run(p)}
    pre, ll, ko = rows["prefix"], rows["least_loaded"], rows["key_only"]
    assert pre["requests"] == ll["requests"] == ko["requests"] > 60 * p.turns[0] - 1
    assert pre["cache_hit_rate"] > ll["cache_hit_rate"] + 0.1
    assert pre["ttft_p50_ms"] * 2 < ll["ttft_p50_ms"]
    assert ko["served_per_replica"] == ll["served_per_replica"]  # no keys: balanced by load
    assert sum(pre["served_per_replica"]) == pre["requests"]
