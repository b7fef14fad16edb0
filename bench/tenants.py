"""``python -m bench tenants``: one tenant's flood against another's interactive requests, on a
real gateway in front of the fake engine (engine/fake.py), both in this process.

Two scenarios, each with two tenants (keys in a keys file, both in the ``interactive`` class):

- **quota**: tenant A has a quota (``a_rpm`` requests per minute; optionally ``a_concurrency``
  at once) and sends ``flood`` times its per-minute quota (open loop, evenly spaced); tenant B
  sends interactive requests one after another (``b_requests``, ``b_think`` seconds apart). B
  runs once alone, then again while A floods, from A's first 429 on (A's bucket starts full:
  its first minute's allowance passes at once, then the steady rate applies). What is shown:
  B's time to first token (p50, p99) in both runs and its ratio, B's statuses (no 5xx), A's
  statuses (mostly 429). A's quota, not the fleet, stops A: the replica never fills.
- **saturated**: both tenants without limits; one replica with ``sat_slots`` slots and a long
  ``admission_wait``; A keeps ``sat_a_clients`` requests outstanding (closed loop), so the
  replica is full and A's requests queue for admission; then B sends ``b_requests``
  interactive requests one after another. What is shown: B's TTFT p50 beside the duration of
  one of A's requests (measured alone on the idle replica before the flood) and beside A's own
  TTFT under saturation (queued). Fair share across tenants (core/tenancy/fairshare.py) admits B's
  request at the next free slot instead of behind A's queue.

The engine is the scripted fake (``ttft`` to the first token, ``itl`` between tokens,
``tokens`` per answer); the clients are httpx streams of ``/v1/chat/completions``; TTFT is the
time to the response's first body bytes (the gateway sends its head with the first token).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from engine.fake import DefaultScript, FakeEngine
from sieproxy.operations.serve import build_app, serve
from sieproxy.settings.load import GatewaySettings, ModelSettings, Settings

MODEL = "bench-model"
KEY_A = "sk-bench-tenant-a"
KEY_B = "sk-bench-tenant-b"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Params:
    ttft: float = 0.05  # the fake engine's time to first token, s
    itl: float = 0.01  # between tokens, s
    tokens: int = 40  # per answer
    b_requests: int = 40
    b_think: float = 0.1  # s between two of B's requests
    # quota
    slots: int = 16  # replica_max_inflight of the one replica
    a_rpm: int = 120
    a_concurrency: int | None = None
    flood: float = 10.0  # A sends this many times its per-minute quota
    # saturated
    sat_slots: int = 4
    sat_a_clients: int = 32


@dataclass
class Sample:
    status: int
    ttft: float  # s, to the first body bytes (nan when refused)
    total: float  # s, to the end of the body


@dataclass
class Runs:
    samples: list[Sample] = field(default_factory=list)

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status == 200]

    def statuses(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.samples:
            out[s.status] = out.get(s.status, 0) + 1
        return dict(sorted(out.items()))

    def ttft(self, q: float) -> float:
        return _quantile([s.ttft for s in self.ok()], q)

    def total(self, q: float) -> float:
        return _quantile([s.total for s in self.ok()], q)


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _key_line(key: str, tenant: str, **limits: Any) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return json.dumps({"id": f"key-{digest[:12]}", "sha256": digest, "tenant": tenant, **limits})


@asynccontextmanager
async def gateway(p: Params, *, slots: int, a_limits: dict[str, Any]) -> AsyncIterator[str]:
    """A gateway (port 0) in front of one fake engine, with tenants ``a`` and ``b``; yields its
    URL. Everything stops when the block ends."""
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.jsonl"
        keys.write_text(_key_line(KEY_A, "a", **a_limits) + "\n" + _key_line(KEY_B, "b") + "\n")
        engine = FakeEngine(DefaultScript(ttft=p.ttft, itl=p.itl, tokens=p.tokens))
        async with trio.open_nursery() as nursery:
            port = await nursery.start(engine.serve)
            g = GatewaySettings(
                host="127.0.0.1", port=0, access_log=False, log_level="warning",
                keys_file=str(keys), replica_max_inflight=slots, admission_wait=120.0,
                health_interval=0.5,
            )  # fmt: skip
            model = ModelSettings(engines=[f"http://127.0.0.1:{port}"], chat_template=TEMPLATE)
            settings = Settings(gateway=g, models={MODEL: model})
            stop = trio.Event()
            binds = await nursery.start(
                partial(serve, settings, shutdown_trigger=stop, app=build_app(settings))
            )
            url = binds[0]
            async with httpx.AsyncClient(base_url=url) as probe:
                with trio.fail_after(20):
                    while (await probe.get("/readyz")).status_code != 200:
                        await trio.sleep(0.05)
            try:
                yield url
            finally:
                stop.set()
                nursery.cancel_scope.cancel()


def _client(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(180.0))


async def one(client: httpx.AsyncClient, key: str, p: Params, into: Runs) -> None:
    """One streamed chat request of ``p.tokens`` tokens; its sample goes into ``into``."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there."}],
            "max_tokens": p.tokens, "stream": True}  # fmt: skip
    start = trio.current_time()
    first = math.nan
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        async for chunk in r.aiter_bytes():
            if chunk and math.isnan(first):
                first = trio.current_time() - start
        status = r.status_code
    into.samples.append(Sample(status, first if status == 200 else math.nan,
                               trio.current_time() - start))  # fmt: skip


async def interactive(url: str, p: Params) -> Runs:
    """Tenant B: ``b_requests`` requests one after another, ``b_think`` s apart."""
    runs = Runs()
    async with _client(url) as client:
        for _ in range(p.b_requests):
            await one(client, KEY_B, p, runs)
            await trio.sleep(p.b_think)
    return runs


async def _flood_open_loop(url: str, p: Params, runs: Runs, stop: trio.Event) -> None:
    """Tenant A at ``flood`` × its per-minute quota, evenly spaced, until ``stop``."""
    gap = 60.0 / (p.a_rpm * p.flood)
    async with _client(url) as client, trio.open_nursery() as nursery:
        at = trio.current_time()
        while not stop.is_set():
            nursery.start_soon(one, client, KEY_A, p, runs)
            at += gap
            await trio.sleep_until(at)


async def run_quota(p: Params) -> dict[str, Any]:
    limits: dict[str, Any] = {"rpm": p.a_rpm}
    if p.a_concurrency is not None:
        limits["concurrency"] = p.a_concurrency
    async with gateway(p, slots=p.slots, a_limits=limits) as url:
        alone = await interactive(url, p)
    async with gateway(p, slots=p.slots, a_limits=limits) as url:
        flood = Runs()
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_flood_open_loop, url, p, flood, stop)
            with trio.fail_after(120):  # A's bucket is spent: its quota holds it from now on
                while not any(s.status == 429 for s in flood.samples):
                    await trio.sleep(0.01)
            spent = len(flood.samples)
            shared = await interactive(url, p)
            stop.set()
    flood.samples = flood.samples[spent:]  # A's answers while B ran
    return {"alone": alone, "shared": shared, "a": flood}


async def _flood_closed_loop(url: str, p: Params, runs: Runs, stop: trio.Event) -> None:
    """Tenant A keeps ``sat_a_clients`` requests outstanding until ``stop``."""

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            await one(client, KEY_A, p, runs)

    async with _client(url) as client, trio.open_nursery() as nursery:
        for _ in range(p.sat_a_clients):
            nursery.start_soon(worker, client)


async def run_saturated(p: Params) -> dict[str, Any]:
    async with gateway(p, slots=p.sat_slots, a_limits={}) as url:
        solo = Runs()
        async with _client(url) as client:
            for _ in range(3):
                await one(client, KEY_A, p, solo)
        a_duration = statistics.median(s.total for s in solo.ok())
        flood = Runs()
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_flood_closed_loop, url, p, flood, stop)
            # the replica is full and A's requests queue once the first of them finished
            with trio.fail_after(60):
                while len(flood.samples) < p.sat_slots:
                    await trio.sleep(0.01)
            shared = await interactive(url, p)
            stop.set()
    return {"a_duration": a_duration, "shared": shared, "a": flood}


def summary(quota: dict[str, Any], sat: dict[str, Any]) -> dict[str, Any]:
    """The figures the section records, and the two verdicts."""
    alone, shared, a = quota["alone"], quota["shared"], quota["a"]
    ratio = shared.ttft(0.5) / alone.ttft(0.5)
    b5xx = sum(n for s, n in shared.statuses().items() if s >= 500)
    sb, sa = sat["shared"], sat["a"]
    return {
        "quota": {
            "b_alone_ttft_p50_ms": alone.ttft(0.5) * 1000,
            "b_alone_ttft_p99_ms": alone.ttft(0.99) * 1000,
            "b_shared_ttft_p50_ms": shared.ttft(0.5) * 1000,
            "b_shared_ttft_p99_ms": shared.ttft(0.99) * 1000,
            "ratio_p50": ratio,
            "b_statuses": shared.statuses(),
            "a_statuses": a.statuses(),
        },
        "saturated": {
            "a_duration_ms": sat["a_duration"] * 1000,
            "b_ttft_p50_ms": sb.ttft(0.5) * 1000,
            "b_ttft_p99_ms": sb.ttft(0.99) * 1000,
            "a_ttft_p50_ms": sa.ttft(0.5) * 1000,
            "b_statuses": sb.statuses(),
            "a_statuses": sa.statuses(),
        },
        "verdicts": [
            {"target": "quota: B's TTFT p50 within 1.2× of B alone, no 5xx for B",
             "met": ratio <= 1.2 and b5xx == 0 and alone.statuses() == {200: len(alone.samples)},
             "figure": f"{ratio:.2f}×, B's statuses {shared.statuses()}"},
            {"target": "saturated: B's TTFT p50 at most the duration of one of A's requests",
             "met": sb.ttft(0.5) <= sat["a_duration"],
             "figure": f"{sb.ttft(0.5) * 1000:.0f} ms vs {sat['a_duration'] * 1000:.0f} ms"},
        ],
    }


async def run(p: Params) -> dict[str, Any]:
    return summary(await run_quota(p), await run_saturated(p))
