from __future__ import annotations

import itertools
import random

from hypothesis import given
from hypothesis import strategies as st

from sieproxy.core.shaping.bestof import beats, cannot_win, rank


def test_rank_desc_with_index_ties() -> None:
    assert rank([-1.0, -0.5, -0.5, -3.0, 0.0], 3) == [4, 1, 2]
    assert rank([-1.0, -1.0, -1.0], 2) == [0, 1]
    assert rank([-2.0], 1) == [0]


def test_beats() -> None:
    assert beats((-1.0, 5), (-2.0, 0))
    assert beats((-1.0, 0), (-1.0, 1))
    assert not beats((-1.0, 1), (-1.0, 0))
    assert not beats((-1.0, 1), (-1.0, 1))


def test_cannot_win_needs_n_finished() -> None:
    assert cannot_win({0: -1.0}, {1: -5.0}, 2) == []
    assert cannot_win({0: -1.0, 2: -2.0}, {1: -5.0, 3: -1.5}, 2) == [1]
    assert cannot_win({0: -1.0, 2: -2.0}, {1: -2.0, 3: -2.0}, 2) == [3]  # tie: lower index wins


def test_cannot_win_n1() -> None:
    assert cannot_win({3: -0.5}, {0: -0.5, 1: -0.4, 2: -0.6}, 1) == [2]


@given(
    finals=st.lists(
        st.floats(min_value=-20, max_value=0, allow_nan=False).map(lambda x: round(x, 1)),
        min_size=2,
        max_size=8,
    ),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_eliminated_candidates_never_win(
    finals: list[float], seed: int, data: st.DataObject
) -> None:
    """Simulate candidates finishing in random order with running sums above their finals."""
    k = len(finals)
    n = data.draw(st.integers(1, k))
    rng = random.Random(seed)
    order = list(range(k))
    rng.shuffle(order)
    winners = set(rank(finals, n))
    finished: dict[int, float] = {}
    for step, i in enumerate(order):
        finished[i] = finals[i]
        # running sums: anything between the final score and 0 (an upper bound of the final)
        running = {j: finals[j] * rng.random() for j in order[step + 1 :]}
        for loser in cannot_win(finished, running, n):
            assert loser not in winners


def test_rank_exhaustive_small() -> None:
    for scores in itertools.product([-1.0, -2.0, 0.0], repeat=4):
        for n in range(1, 5):
            top = rank(list(scores), n)
            assert len(top) == n
            rest = [i for i in range(4) if i not in top]
            for a in top:
                for b in rest:
                    assert beats((scores[a], a), (scores[b], b))
