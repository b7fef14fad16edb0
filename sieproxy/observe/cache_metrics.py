"""Metrics of ``cache_aware`` routing (:mod:`sieproxy.cache_route`), read at scrape time.

Per model and replica: the cached prompt tokens routing predicted and the engine reported
(summed over requests, and each request's prediction against the report: ``exact``, ``over``,
``under``), the times the warm replica was passed over (``spills_total``, by cause: ``prefill``
— its pending prefill reached the threshold; ``batch`` — its load neared its running batch;
``load`` — the pool's load bound or running batch passed it over), the blocks in each index,
its pending prefill tokens, the event stream's sync state, lag and troubles (gaps, restarts,
losses, undecodable batches).
"""

from __future__ import annotations

from collections.abc import Iterable

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..fleet.pool import ModelPool

__all__ = ["CacheRouteCollector"]

_RM = ["model", "replica"]


class CacheRouteCollector(Collector):
    def __init__(self, pools: dict[str, ModelPool]) -> None:
        self._pools = pools

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        p = "sieproxy_cache_route_"
        predicted = CounterMetricFamily(
            p + "predicted_cached_tokens", "Cached prompt tokens routing predicted.", labels=_RM
        )
        reported = CounterMetricFamily(
            p + "reported_cached_tokens", "Cached prompt tokens the engine reported.", labels=_RM
        )
        outcome = CounterMetricFamily(
            p + "predictions",
            "Requests by prediction against the engine's report: exact, over, under.",
            labels=[*_RM, "result"],
        )
        spills = CounterMetricFamily(
            p + "spills",
            "Requests routed away from the replica holding their longest prefix, by cause.",
            labels=[*_RM, "cause"],
        )
        blocks = GaugeMetricFamily(
            p + "index_blocks", "Blocks in the replica's index, by source.", labels=[*_RM, "source"]
        )
        pending = GaugeMetricFamily(
            p + "pending_prefill_tokens",
            "Uncached prompt tokens sent to the replica, first token not yet back.",
            labels=_RM,
        )
        in_sync = GaugeMetricFamily(
            p + "events_in_sync", "1 while the replica's KV-event index is in sync.", labels=_RM
        )
        lag = GaugeMetricFamily(
            p + "events_lag_seconds",
            "Age of the last applied KV-event batch when it arrived (engine clock).",
            labels=_RM,
        )
        trouble = CounterMetricFamily(
            p + "events_troubles",
            "KV-event stream troubles: gap, restart, lost, bad_batch.",
            labels=[*_RM, "kind"],
        )
        try:
            now = trio.current_time()
        except RuntimeError:
            now = 0.0
        for model, pool in self._pools.items():
            policy = pool.policy
            if policy is None:
                continue
            for url, rc in list(policy.caches.items()):
                lab = [model, url]
                predicted.add_metric(lab, rc.predicted)
                reported.add_metric(lab, rc.reported)
                for result, k in rc.outcomes.items():
                    outcome.add_metric([*lab, result], k)
                for cause, k in rc.spills.items():
                    spills.add_metric([*lab, cause], k)
                blocks.add_metric([*lab, "approx"], len(rc.approx))
                pending.add_metric(lab, rc.pending)
                s = rc.stream
                if s is None:
                    continue
                blocks.add_metric([*lab, "events"], len(s.index))
                in_sync.add_metric(lab, 1.0 if s.in_sync(now) else 0.0)
                if rc.lag is not None:
                    lag.add_metric(lab, rc.lag)
                for kind, k in (
                    ("gap", s.gaps),
                    ("restart", s.restarts),
                    ("lost", s.losses),
                    ("bad_batch", s.bad_batches),
                ):
                    trouble.add_metric([*lab, kind], k)
        yield from (predicted, reported, outcome, spills, blocks, pending, in_sync, lag, trouble)
