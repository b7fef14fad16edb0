"""Cache-aware routing (``routing = "cache_aware"``): the longest cached prefix wins, within a
token budget.

Inputs, per candidate replica (in the order rendezvous hashing on the prompt's prefix key ranks
them, which breaks every tie so that gateway processes agree): the tokens of the prompt its
index says it holds (``cached``: its KV-event index when in sync, else the gateway's own
approximate index, :mod:`sieproxy.core.kvindex`), the uncached prefill tokens this gateway has
in flight there (``pending``: sent, first token not yet seen) and its load (requests).

Rules (:func:`rank`):

1. A match counts as affinity only when it covers at least ``max(min_match_tokens,
   2 × block size)`` tokens: a chat template's header, a one-line default system prompt, or a
   single block shared by chance is no reason to pile requests onto a replica. Shorter matches
   count as 0.
2. No replica holds the prompt's prefix → no ranking (``order`` is None): the pool keeps its
   rendezvous hashing on the prefix key, so every gateway process puts a new prefix on the same
   replica with no shared state (and the next request finds it there).
3. The replica with the most cached tokens (*warm*) comes first, unless it is *spilled* to the
   back: its pending prefill has reached ``threshold`` tokens (the engine's prefill rate × the
   delay a request may wait for a warm cache; cause ``"prefill"``), or its load has reached
   ``batch_share`` of its engine's running batch (``max_running_requests``; cause
   ``"batch"``) — the load is read every ``load_interval`` and other gateways' requests since
   are unseen, so a batch that looks nearly full may already be full, and a request sent there
   would wait for a slot.
4. The others follow by the prefill work a request would queue behind there, in tokens:
   ``pending + prompt tokens − cached``, then by load, then by rendezvous order.

The pool walks the order and takes the first replica within its load bound and running batch
(admission and the load bound stay the pool's), else the least loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "Ranking", "min_match", "predicted_hit", "rank"]


@dataclass(frozen=True, slots=True)
class Candidate:
    cached: int  # prompt tokens the replica's index holds
    pending: int = 0  # uncached prefill tokens in flight there (this gateway's)
    load: int = 0  # requests running and waiting there
    block_size: int = 16  # the block size ``cached`` was counted in
    max_running: int | None = None  # the engine's running batch, when it says


@dataclass(frozen=True, slots=True)
class Ranking:
    #: Candidate positions, best first; None when no replica holds the prefix.
    order: list[int] | None
    warm: int | None = None  # the longest match's position
    spilled: str | None = None  # why the warm replica was passed over: "prefill", "batch"


def min_match(block_size: int, min_tokens: int) -> int:
    """The shortest match that counts as affinity (rule 1)."""
    return max(min_tokens, 2 * block_size)


def predicted_hit(cached: int, prompt_tokens: int, block_size: int) -> int:
    """The cached tokens an engine will report for a prompt whose ``cached`` leading tokens it
    holds: whole blocks, at most ``prompt_tokens - 1`` (the last token is always computed)."""
    if prompt_tokens <= 1 or block_size < 1:
        return 0
    return max(0, min(cached, (prompt_tokens - 1) // block_size * block_size))


def rank(
    cands: Sequence[Candidate],
    prompt_tokens: int,
    *,
    threshold: int,
    min_tokens: int,
    batch_share: float = 1.0,
) -> Ranking:
    """The candidates' order (see the module docstring)."""
    eff = [c.cached if c.cached >= min_match(c.block_size, min_tokens) else 0 for c in cands]
    best = max(eff, default=0)
    if best <= 0:
        return Ranking(None)
    warm = eff.index(best)
    w = cands[warm]
    spilled = None
    if w.pending >= threshold:
        spilled = "prefill"
    elif w.max_running is not None and w.load >= batch_share * w.max_running:
        spilled = "batch"
    rest = sorted(
        (i for i in range(len(cands)) if i != warm),
        key=lambda i: (cands[i].pending + prompt_tokens - eff[i], cands[i].load, i),
    )
    order = [*rest, warm] if spilled else [warm, *rest]
    return Ranking(order, warm, spilled)
