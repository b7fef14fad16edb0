"""``routing = "cache_aware"``: the model's routing policy object (the pool's one seam).

Per request (:meth:`CacheAwarePolicy.prepare`): the prompt the engine will get (the body's
``input_ids``, else its ``text`` tokenized with the model's tokenizer, :mod:`sieproxy.tokens`)
becomes a :class:`Route`. The pool asks :meth:`~CacheAwarePolicy.rank` for the order of its
candidate replicas (:mod:`sieproxy.core.prefix_route`), walks it under its own load bound and
admission, and reports its choice (:meth:`~CacheAwarePolicy.sent`). No tokenizer (none
configured or discoverable), a body without a prompt, or no replica holding the prefix: no
ranking, and the pool's rendezvous hashing on the prefix key decides as under ``prefix``.

Per replica (:class:`ReplicaCache`): the KV-event stream (:mod:`sieproxy.kv_events`) when the
replica has an endpoint, and always the approximate index of what this gateway sent there
(:class:`~sieproxy.core.routing.kvindex.ApproxIndex`, sized to the engine's reported cache:
``max_total_num_tokens`` from SGLang's ``/server_info``, ``prefix_cache_max_tokens`` from the
CPU engine's, else ``cache_tokens``). A replica is matched on its event index while that stream
is in sync, else on the approximate index. Its *pending* prefill is the uncached prompt tokens
this gateway sent there whose first token has not come back yet.

Measured (metrics, :mod:`sieproxy.cache_metrics`; the access log): the predicted cached tokens
of every request against the engine's reported ``cached_tokens``, spills, index sizes, the
event lag and the streams' sync state.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from ..core.request.profile import positive_int
from ..core.routing.kvindex import (
    APPROX_BLOCK,
    ApproxIndex,
    EventStream,
    chain_keys,
    matched_blocks,
)
from ..core.routing.prefix_route import Candidate, predicted_hit, rank
from ..settings.schema import EngineSpec, ModelSettings
from .kv_events import follow
from .tokens import PromptTokenizer, load_tokenizer

if TYPE_CHECKING:
    from .client import EngineClient
    from .pool import ModelPool, Replica

__all__ = ["CacheAwarePolicy", "ReplicaCache", "Route", "advertised_endpoints"]

log = logging.getLogger("sieproxy.cache_route")

#: Prompts longer than this (characters) are tokenized in a worker thread.
_THREAD_CHARS = 8192


@dataclass(eq=False)
class Route:
    """One request's prompt as token blocks, and what routing predicted for it."""

    policy: CacheAwarePolicy
    tokens: Sequence[int]
    _keys: dict[int, list[int]] = field(default_factory=dict)
    #: Per replica URL: (cached tokens, block size, index source) as ranked.
    seen: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    warm: str | None = None
    spilled: str | None = None  # why the policy passed the warm replica over
    replica: str | None = None
    uncached: int = 0  # counted in that replica's pending prefill until the first token
    predicted: int | None = None
    source: str | None = None

    def keys(self, block_size: int) -> list[int]:
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = chain_keys(self.tokens, block_size)
        return keys


class ReplicaCache:
    """What the gateway knows of one replica's prefix cache."""

    def __init__(self, capacity: int, stale_after: float) -> None:
        self.approx = ApproxIndex(capacity)
        self.stream: EventStream | None = None
        self.stale_after = stale_after
        self.capacity = capacity
        self.pending = 0
        self.lag: float | None = None
        self.sized = False  # the engine's own cache size was asked for
        # totals for the metrics
        self.predicted = 0
        self.reported = 0
        self.outcomes = {"exact": 0, "over": 0, "under": 0}
        self.spills = {"prefill": 0, "batch": 0, "load": 0}
        self.scope: trio.CancelScope | None = None  # its event subscription
        #: The endpoints the engine's ``/server_info`` advertises (None: none, or not asked),
        #: and those followed now.
        self.advertised: tuple[str | None, str | None] = (None, None)
        self.following: tuple[str | None, str | None] = (None, None)

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.approx.resize(capacity)
        if self.stream is not None:
            self.stream.capacity = capacity

    def match(self, route: Route, now: float) -> tuple[int, int, str]:
        """(cached tokens, block size, source) of ``route`` here."""
        s = self.stream
        if s is not None and s.in_sync(now) and s.index.block_size:
            b = s.index.block_size
            return matched_blocks(route.keys(b), s.index) * b, b, "events"
        cached = matched_blocks(route.keys(APPROX_BLOCK), self.approx) * APPROX_BLOCK
        return cached, APPROX_BLOCK, "approx"


class CacheAwarePolicy:
    """The ``cache_aware`` policy of one model (see the module docstring)."""

    def __init__(self, model: str, m: ModelSettings) -> None:
        self.model = model
        self.m = m
        self.threshold = int(m.prefill_tokens_per_s * m.spill_delay)
        self.tokenizer: PromptTokenizer | None = None
        if m.tokenizer:
            self.tokenizer = load_tokenizer(m.tokenizer)
        self.caches: dict[str, ReplicaCache] = {}
        self.untokenized = 0  # requests routed without tokens (no tokenizer yet)
        self._tokenizer_tries = 0
        self._endpoints = {
            e.url.rstrip("/"): (e.kv_events, e.kv_events_replay)
            for e in m.engines
            if isinstance(e, EngineSpec)
        }

    # ------------------------------------------------------------------ per request
    def cache(self, url: str) -> ReplicaCache:
        rc = self.caches.get(url)
        if rc is None:
            rc = self.caches[url] = ReplicaCache(self.m.cache_tokens, self.m.kv_events_stale)
        return rc

    async def prepare(self, bodies: Sequence[dict[str, Any]]) -> Route | None:
        """The request's route, or None (routing falls back to the prefix key)."""
        body = bodies[0] if bodies else {}
        ids = body.get("input_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            return Route(self, ids)
        text = body.get("text")
        tok = self.tokenizer
        if not isinstance(text, str) or tok is None:
            self.untokenized += 1
            return None
        if len(text) > _THREAD_CHARS:
            return Route(self, await trio.to_thread.run_sync(tok.encode, text))
        return Route(self, tok.encode(text))

    def rank(self, route: Route, replicas: Sequence[Replica]) -> list[Replica] | None:
        """``replicas`` (in rendezvous order) ranked for ``route``; None: no replica holds
        its prefix."""
        now = trio.current_time()
        cands = []
        for r in replicas:
            rc = self.cache(r.url)
            cached, b, _ = route.seen[r.url] = rc.match(route, now)
            cands.append(Candidate(cached, rc.pending, r.load(), b, r.max_running))
        ranking = rank(
            cands,
            len(route.tokens),
            threshold=self.threshold,
            min_tokens=self.m.min_match_tokens,
            batch_share=self.m.spill_batch_share,
        )
        if ranking.order is None or ranking.warm is None:
            route.warm, route.spilled = None, None
            return None
        route.warm, route.spilled = replicas[ranking.warm].url, ranking.spilled
        return [replicas[i] for i in ranking.order]

    def sent(self, route: Route, r: Replica) -> None:
        """The pool placed ``route`` on ``r`` (again, on a retry: moved from the first)."""
        now = trio.current_time()
        self._unpend(route)
        rc = self.cache(r.url)
        if route.warm is not None and route.warm != r.url:
            self.cache(route.warm).spills[route.spilled or "load"] += 1
        cached, b, src = route.seen.get(r.url) or rc.match(route, now)
        route.replica, route.source = r.url, src
        route.predicted = predicted_hit(cached, len(route.tokens), b)
        route.uncached = len(route.tokens) - route.predicted
        rc.pending += route.uncached
        rc.approx.record(route.keys(APPROX_BLOCK))
        if rc.stream is not None:
            rc.stream.sent(now)

    def first_token(self, route: Route) -> None:
        self._unpend(route)

    def done(self, route: Route, reported: int | None) -> None:
        """The request ended; ``reported``: the engine's ``cached_tokens`` (None: unknown)."""
        self._unpend(route)
        if route.replica is None or route.predicted is None or reported is None:
            return
        rc = self.cache(route.replica)
        rc.predicted += route.predicted
        rc.reported += reported
        diff = route.predicted - reported
        rc.outcomes["exact" if diff == 0 else "over" if diff > 0 else "under"] += 1

    def _unpend(self, route: Route) -> None:
        if route.replica is not None and route.uncached:
            rc = self.cache(route.replica)
            rc.pending = max(0, rc.pending - route.uncached)
            route.uncached = 0

    # ------------------------------------------------------------------ background
    def endpoints(self, url: str) -> tuple[str | None, str | None]:
        """The KV-event and replay endpoints of a replica (None: it has none)."""
        ev, rep = self._endpoints.get(url, (None, None))
        host = urlsplit(url).hostname
        if host and ":" in host:
            host = f"[{host}]"
        if ev is None and self.m.kv_events_port is not None and host:
            ev = f"tcp://{host}:{self.m.kv_events_port}"
        if rep is None and self.m.kv_events_replay_port is not None and host:
            rep = f"tcp://{host}:{self.m.kv_events_replay_port}"
        return ev, rep

    async def run(self, pool: ModelPool, client: EngineClient, *, poll: float = 0.5) -> None:
        """Until cancelled: follow each replica's events, size its index from its engine, load
        the tokenizer from the engine's model directory when none is configured, and mark a
        replica's stream suspect when its health check fails."""
        async with trio.open_nursery() as nursery:
            while True:
                urls = set()
                for r in pool.replicas:
                    urls.add(r.url)
                    rc = self.cache(r.url)
                    if not r.ready:
                        rc.sized = False  # a restarted engine may publish elsewhere: ask again
                        if rc.stream is not None:
                            rc.stream.health_failed()
                    if r.ready and not rc.sized:
                        rc.sized = True
                        nursery.start_soon(self._size, r.url, rc, client)
                    if r.ready and self.tokenizer is None and self.m.tokenizer is None:
                        await self._discover_tokenizer(r.url, client)
                    ev, rep = self.endpoints(r.url)
                    if ev is None:
                        ev, rep = rc.advertised
                    if rc.scope is not None and rc.following != (ev, rep):
                        rc.scope.cancel()  # the engine publishes elsewhere: a new process
                        rc.scope = None
                        if rc.stream is not None:
                            rc.stream.restart()
                    if rc.scope is None and ev is not None:
                        if rc.stream is None:
                            rc.stream = EventStream(rc.capacity, self.m.kv_events_stale)
                        rc.scope, rc.following = trio.CancelScope(), (ev, rep)
                        nursery.start_soon(self._follow, rc, ev, rep)
                for url in set(self.caches) - urls:  # dropped by a reload
                    gone = self.caches.pop(url)
                    if gone.scope is not None:
                        gone.scope.cancel()
                await trio.sleep(poll)

    async def _follow(self, rc: ReplicaCache, ev: str, rep: str | None) -> None:
        assert rc.scope is not None and rc.stream is not None
        stream = rc.stream

        def lag(seconds: float) -> None:
            rc.lag = seconds

        with rc.scope:
            while True:
                try:
                    await follow(stream, ev, rep, self.m.kv_events_topic, on_batch=lag)
                except Exception as exc:  # a socket error: resubscribe after a pause
                    log.warning("KV events of %s at %s failed: %s", self.model, ev, exc)
                    stream.health_failed()
                    await trio.sleep(1.0)

    async def _size(self, url: str, rc: ReplicaCache, client: EngineClient) -> None:
        """The replica's cache size, and the KV-event endpoints its engine says it publishes
        on (``kv_events_config`` in ``/server_info``, as SGLang and the CPU engine report it)."""
        try:
            info = await client.server_info(url)
        except Exception:
            rc.sized = False  # asked again at the next poll
            return
        states = info.get("internal_states")
        state = states[0] if isinstance(states, list) and states else {}
        own = state.get("prefix_cache_max_tokens") if isinstance(state, dict) else None
        own = own or info.get("prefix_cache_max_tokens")
        size = positive_int(own) or positive_int(info.get("max_total_num_tokens"))
        if size is not None:
            rc.resize(size)
        rc.advertised = advertised_endpoints(url, info.get("kv_events_config"))

    async def _discover_tokenizer(self, url: str, client: EngineClient) -> None:
        if self._tokenizer_tries >= 3:
            return
        self._tokenizer_tries += 1
        try:
            info = await client.model_info(url)
        except Exception:
            return
        path = info.get("tokenizer_path") or info.get("model_path")
        if isinstance(path, str) and await trio.Path(path).is_dir():
            self.tokenizer = await trio.to_thread.run_sync(load_tokenizer, path)


def advertised_endpoints(url: str, conf: Any) -> tuple[str | None, str | None]:
    """The (events, replay) endpoints of an engine's ``kv_events_config`` (a JSON string or a
    map), a wildcard host (``*``, ``0.0.0.0``, ``::``) replaced by the replica URL's host."""
    if isinstance(conf, str):
        try:
            conf = json.loads(conf)
        except ValueError:
            return None, None
    if not isinstance(conf, dict) or conf.get("publisher", "zmq") != "zmq":
        return None, None
    host = urlsplit(url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"

    def fix(ep: Any) -> str | None:
        if not isinstance(ep, str) or not ep.startswith(("tcp://", "ipc://")):
            return None
        for wild in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:", "tcp://:::"):
            if ep.startswith(wild):
                return f"tcp://{host}:{ep[len(wild):]}"
        return ep

    ev = fix(conf.get("endpoint", "tcp://*:5557"))
    return ev, fix(conf.get("replay_endpoint")) if ev else None
