"""The cache-aware policy's maths: the longest match wins within a token budget."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sieproxy.core.routing.prefix_route import Candidate, min_match, predicted_hit, rank

KW = {"threshold": 1000, "min_tokens": 64}


def test_no_match_means_no_ranking() -> None:
    assert rank([Candidate(0), Candidate(0)], 500, **KW).order is None
    assert rank([], 500, **KW).order is None


def test_short_matches_are_not_affinity() -> None:
    assert min_match(16, 64) == 64 and min_match(64, 64) == 128 and min_match(1, 0) == 2
    # a chat-template header (one block) or fewer than min_tokens: no affinity
    assert rank([Candidate(16), Candidate(0)], 500, **KW).order is None
    assert rank([Candidate(48), Candidate(0)], 500, **KW).order is None
    assert rank([Candidate(64), Candidate(0)], 500, **KW).order == [0, 1]
    assert rank([Candidate(64, block_size=64)], 500, **KW).order is None


def test_longest_match_wins() -> None:
    r = rank([Candidate(64), Candidate(320), Candidate(128)], 500, **KW)
    assert r.order == [1, 2, 0] and r.warm == 1 and not r.spilled


def test_ties_keep_the_rendezvous_order() -> None:
    assert rank([Candidate(0), Candidate(320), Candidate(320)], 500, **KW).order == [1, 2, 0]


def test_a_warm_replica_with_too_much_pending_prefill_spills() -> None:
    cands = [Candidate(400, pending=999), Candidate(0, pending=0, load=3),
             Candidate(0, pending=0, load=1), Candidate(128, pending=200)]
    r = rank(cands, 500, **KW)
    assert r.order is not None and r.order[0] == 0 and not r.spilled
    cands[0] = Candidate(400, pending=1000)
    r = rank(cands, 500, **KW)
    # the rest by queued prefill tokens (pending + uncached), then load; warm goes last
    assert r.spilled == "prefill" and r.order == [2, 1, 3, 0]
    # a second warm replica with little pending wins the rest
    cands[3] = Candidate(400, pending=0)
    assert rank(cands, 500, **KW).order == [3, 2, 1, 0]


def test_a_warm_replica_near_its_running_batch_spills() -> None:
    cands = [Candidate(400, load=14, max_running=16), Candidate(0, load=3, max_running=16)]
    r = rank(cands, 500, batch_share=0.9, **KW)
    assert r.spilled is None and r.order == [0, 1]
    cands[0] = Candidate(400, load=15, max_running=16)  # 15 >= 0.9 x 16
    r = rank(cands, 500, batch_share=0.9, **KW)
    assert r.spilled == "batch" and r.order == [1, 0]
    # without a known batch, or with the share at 1 (the pool's own check), no batch spill
    assert rank([Candidate(400, load=99), cands[1]], 500, batch_share=0.9, **KW).spilled is None
    assert rank(cands, 500, **KW).spilled is None
    # pending prefill is checked first
    r = rank([Candidate(400, pending=5000, load=15, max_running=16), cands[1]], 500,
             batch_share=0.9, **KW)
    assert r.spilled == "prefill"


def test_predicted_hit_is_whole_blocks_before_the_last_token() -> None:
    assert predicted_hit(512, 512, 16) == 496
    assert predicted_hit(512, 513, 16) == 512
    assert predicted_hit(100, 1000, 16) == 100
    assert predicted_hit(5, 6, 1) == 5
    assert predicted_hit(0, 1, 16) == 0 and predicted_hit(10, 20, 0) == 0


@given(st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 3000), st.integers(0, 20)),
                min_size=1, max_size=8),
       st.integers(1, 5000))
def test_the_order_is_a_permutation_led_by_the_longest_unsaturated_match(
    rows: list[tuple[int, int, int]], prompt: int
) -> None:
    cands = [Candidate(c, p, load) for c, p, load in rows]
    r = rank(cands, prompt, **KW)
    eff = [c.cached if c.cached >= 64 else 0 for c in cands]
    if max(eff) == 0:
        assert r.order is None
        return
    assert r.order is not None and sorted(r.order) == list(range(len(cands)))
    assert r.warm is not None and eff[r.warm] == max(eff)
    assert (r.spilled == "prefill") == (cands[r.warm].pending >= 1000)
    assert (r.order[0] == r.warm) != bool(r.spilled) or len(cands) == 1
