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


def test_cache_aware_fleet_events_and_approx_beat_load_only() -> None:
    """bench/fleet_cache.py runs the real cache-aware policy: fed events it predicts exactly
    what the simulated engines report; without them its own index still keeps the shared
    system prompts where they are cached."""
    from bench import fleet_cache as FC

    p = FC.params_for("shared", conversations=150, sessions=24)
    rows = {r["policy"]: r for r in FC.run(p)}
    ll, ap, ev = rows["least_loaded"], rows["approx"], rows["events"]
    assert ll["requests"] == ap["requests"] == ev["requests"] >= 150
    assert ev["predicted_over_reported"] is not None
    assert abs(ev["predicted_over_reported"] - 1.0) < 0.05
    assert ev["cached_share"] >= ap["cached_share"] > ll["cached_share"] + 0.1
    assert ev["vs_oracle"] > 0.9 and ev["ttft_p50_ms"] * 2 < ll["ttft_p50_ms"]
    assert sum(ev["served_per_replica"]) == ev["requests"]


def test_oracle_cache_is_the_fleets_memory() -> None:
    from bench import fleet_cache as FC

    toks = list(range(64))
    keys = FC.chain_keys(toks, FC.BLOCK)
    p = FC.Params(replicas=1, cache_tokens=64)
    # the same prompt twice: the second time all but its last block's tail is cached
    assert FC.oracle(p, [(keys, keys, 64), (keys, keys, 64)]) == 48
    cache = FC.Cache(32, publish=(events := []).extend)
    cache.insert(toks, keys)  # only 2 of 4 blocks fit
    assert len(cache.lru) == 2 and events[0][0] == "BlockStored"
    cache.insert(list(range(100, 132)), FC.chain_keys(list(range(100, 132)), FC.BLOCK))
    assert events[1][0] == "BlockRemoved" and len(events[1][1]) == 2
