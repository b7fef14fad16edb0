"""best_of ranking: keep the ``n`` candidates with the highest cumulative logprob.

Order: cumulative logprob descending, ties broken by the lower candidate index.

Early elimination: a logprob is never positive, so an unfinished candidate's running sum is an
upper bound on its final score. Once ``n`` finished candidates each beat that bound (strictly,
or equal with a lower index), the candidate cannot be returned and may be aborted. Its final
(partial) score is then no higher than the bound, so ranking it later gives the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["beats", "cannot_win", "rank"]


def beats(a: tuple[float, int], b: tuple[float, int]) -> bool:
    """True when candidate ``a`` = (score, index) ranks above ``b``."""
    return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])


def rank(scores: Sequence[float], n: int) -> list[int]:
    """Indexes of the top ``n`` candidates, best first; position in the list is the new index."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order[:n]


def cannot_win(finished: Mapping[int, float], running: Mapping[int, float], n: int) -> list[int]:
    """Unfinished candidates (``running``: index → running sum) that can no longer be in the top n.

    ``finished`` maps index → final score. Returned in index order.
    """
    if len(finished) < n:
        return []
    # Only the n-th best finished score matters: beating it means beating n finished ones.
    nth = sorted(((s, i) for i, s in finished.items()), key=lambda t: (-t[0], t[1]))[n - 1]
    return sorted(i for i, s in running.items() if beats(nth, (s, i)))
