"""Metrics read at scrape time: the replicas' and the models' gauges from the pools (what an
autoscaler reads among them), and the state of the tenants' limiter's Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..fleet.pool import ModelPool
from ..tenancy.limiter import Limiter

__all__ = ["LimiterCollector", "PoolCollector"]


class PoolCollector(Collector):
    def __init__(self, pools: dict[str, ModelPool], inflight: Callable[[], dict[str, int]]) -> None:
        self._pools = pools
        self._inflight = inflight

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        inflight = GaugeMetricFamily(
            "sieproxy_replica_inflight_candidates",
            "Candidates running on each engine replica.",
            labels=["model", "replica"],
        )
        healthy = GaugeMetricFamily(
            "sieproxy_replica_up",
            "1 when the replica is ready and its circuit is closed.",
            labels=["model", "replica"],
        )
        try:
            now = trio.current_time()
        except RuntimeError:
            now = 0.0
        for model, pool in self._pools.items():
            for r in pool.replicas:
                inflight.add_metric([model, r.url], r.inflight)
                healthy.add_metric([model, r.url], 1.0 if r.available(now) else 0.0)
        requests = GaugeMetricFamily(
            "sieproxy_inflight_requests",
            "Generation requests in flight (admitted, not yet fully sent).",
            labels=["model"],
        )
        counts = self._inflight()
        for model in self._pools:
            requests.add_metric([model], counts.get(model, 0))
        yield inflight
        yield healthy
        yield requests
        yield from self._autoscaling(now)

    def _autoscaling(self, now: float) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        """Per model, what an autoscaler reads (docs/DEPLOYMENT.md#autoscaling)."""
        labels = ["model"]
        waiting = GaugeMetricFamily(
            "sieproxy_admission_waiting_requests",
            "Requests waiting for a replica with room (admission_wait).",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "sieproxy_running_candidates",
            "Candidates running on the model's replicas from this process.",
            labels=labels,
        )
        ready = GaugeMetricFamily(
            "sieproxy_ready_replicas", "Replicas ready with a closed circuit.", labels=labels
        )
        configured = GaugeMetricFamily(
            "sieproxy_replicas", "Replicas configured (ready or not).", labels=labels
        )
        unserved = CounterMetricFamily(
            "sieproxy_unserved_requests",
            "Requests answered 503 for want of a replica: no_ready_replica (pending demand of a "
            "model with no replica: scale from zero) or at_capacity.",
            labels=["model", "cause"],
        )
        engine_load = GaugeMetricFamily(
            "sieproxy_replica_engine_load",
            "Requests running and waiting on the replica as its engine last reported (all "
            "gateways'); absent when the engine reports no load.",
            labels=["model", "replica"],
        )
        for model, pool in self._pools.items():
            waiting.add_metric([model], pool.waiting)
            running.add_metric([model], sum(r.inflight for r in pool.replicas))
            up = sum(1 for r in pool.replicas if r.available(now)) if pool.gate_open else 0
            ready.add_metric([model], up)
            configured.add_metric([model], len(pool.replicas))
            for cause, count in pool.unserved.items():
                unserved.add_metric([model, cause], count)
            for r in pool.replicas:
                if r.engine_load is not None:
                    engine_load.add_metric([model, r.url], r.engine_load)
        yield from (waiting, running, ready, configured, unserved, engine_load)


class LimiterCollector(Collector):
    def __init__(self, limiter: Limiter) -> None:
        self._limiter = limiter

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            "sieproxy_tenant_redis_up",
            "1 while the tenants' counters are shared through Redis; 0 while Redis does not "
            "answer and each process counts on its own.",
        )
        up.add_metric([], 1.0 if self._limiter.redis_up else 0.0)
        errors = CounterMetricFamily(
            "sieproxy_tenant_redis_errors", "Redis calls of the limiter that failed or timed out."
        )
        errors.add_metric([], self._limiter.redis_errors)
        pending = GaugeMetricFamily(
            "sieproxy_tenant_usage_pending",
            "Usage counts kept in the process until Redis takes them.",
        )
        pending.add_metric([], len(self._limiter.pending_usage))
        yield from (up, errors, pending)
