"""Routing over several engine replicas: key affinity, least outstanding, pool headers,
admission limits and the retry before the first byte (real gateway, fake engines, loopback).

Which replica served a request is read from the engines' records: every candidate's rid is
``<X-Request-Id>-<index>``.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import httpx
import pytest
import trio

from engine.fake import Call, DefaultScript, FakeEngine, Fault, Plan
from sieproxy.settings.load import Settings

from .harness import (
    MODEL,
    Gateway,
    another_gateway,
    least_loaded,
    no_resumes,
    running_gateway,
    sse_events,
)
from .test_health import (
    KillableEngine,
    Switch,
    chat,
    find_key,
    gen_rids,
    sample,
    scrape,
    served_by,
    up,
    wait_until,
)

SLOW = DefaultScript(itl=0.05)  # max_tokens=10 → about half a second per stream


async def _stream_all(gw: Gateway, out: list[httpx.Response], **kw: Any) -> None:
    out.append(await chat(gw, stream=True, **kw))


async def concurrently(gw: Gateway, count: int, **kw: Any) -> list[httpx.Response]:
    out: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(lambda: _stream_all(gw, out, **kw))
    return out


# ---------------------------------------------------------------------------- affinity


async def test_routing_key_sticks_to_one_replica() -> None:
    with trio.fail_after(20):
        async with running_gateway([FakeEngine() for _ in range(4)]) as gw:
            homes = set()
            for _ in range(20):
                r = await chat(gw, routing_key="session-1234")
                assert r.status_code == 200, r.text
                homes.add(tuple(served_by(gw, r.headers["x-request-id"])))
            assert len(homes) == 1
            (home,) = homes
            assert len(home) == 1


async def test_different_keys_spread() -> None:
    with trio.fail_after(20):
        async with running_gateway([FakeEngine() for _ in range(4)]) as gw:
            used: Counter[int] = Counter()
            for i in range(32):
                r = await chat(gw, routing_key=f"tenant-{i}")
                assert r.status_code == 200
                (where,) = served_by(gw, r.headers["x-request-id"])
                used[where] += 1
            assert len(used) >= 3, used
            assert max(used.values()) <= 20, used


async def test_prompt_cache_key_used_without_routing_key() -> None:
    with trio.fail_after(20):
        async with running_gateway([FakeEngine() for _ in range(3)]) as gw:
            k0 = await find_key(gw, 0)
            k1 = await find_key(gw, 1)
            for _ in range(10):
                r = await chat(gw, prompt_cache_key=k1)
                assert r.status_code == 200
                assert served_by(gw, r.headers["x-request-id"]) == [1]
            # routing_key wins over prompt_cache_key
            for _ in range(5):
                r = await chat(gw, routing_key=k0, prompt_cache_key=k1)
                assert served_by(gw, r.headers["x-request-id"]) == [0]


async def test_key_moves_when_replica_unhealthy_and_returns() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine() for _ in range(3)]
        async with running_gateway(engines) as gw:
            key = await find_key(gw, 1)
            engines[1].healthy = False
            await wait_until(lambda: not up(gw, 1))
            moved = set()
            for _ in range(6):
                r = await chat(gw, routing_key=key)
                assert r.status_code == 200
                moved.add(tuple(served_by(gw, r.headers["x-request-id"])))
            assert len(moved) == 1, "the fallback replica is stable too"
            assert moved != {(1,)}
            engines[1].healthy = True
            await wait_until(lambda: up(gw, 1))
            for _ in range(3):
                r = await chat(gw, routing_key=key)
                assert served_by(gw, r.headers["x-request-id"]) == [1]


async def test_key_moves_when_replica_killed_and_returns() -> None:
    with trio.fail_after(20):
        engines = [KillableEngine() for _ in range(3)]
        async with running_gateway(engines) as gw:
            key = await find_key(gw, 2)
            engines[2].kill()
            await wait_until(lambda: not up(gw, 2))
            r = await chat(gw, routing_key=key)
            assert r.status_code == 200
            assert served_by(gw, r.headers["x-request-id"]) in ([0], [1])
            engines[2].revive()
            await wait_until(lambda: up(gw, 2))
            r = await chat(gw, routing_key=key)
            assert served_by(gw, r.headers["x-request-id"]) == [2]


async def test_hot_key_spills_under_concurrency() -> None:
    with trio.fail_after(20):
        async with running_gateway([FakeEngine(script=SLOW) for _ in range(3)]) as gw:
            home_key = "hot-prefix"
            r = await chat(gw, routing_key=home_key)
            (home,) = served_by(gw, r.headers["x-request-id"])
            resps = await concurrently(gw, 12, routing_key=home_key, max_tokens=10)
            assert all(x.status_code == 200 for x in resps)
            counts: Counter[int] = Counter()
            for x in resps:
                (where,) = served_by(gw, x.headers["x-request-id"])
                counts[where] += 1
            assert len(counts) >= 2, f"a hot key piled onto one replica: {counts}"
            assert counts[home] == max(counts.values()), counts
            assert max(counts.values()) <= math.ceil(1.25 * (12 / 3 + 1)), counts


# ---------------------------------------------------------------------------- prefix affinity

SYSTEM = {"role": "system", "content": "You are the support assistant of a router maker."}


def conversation(cid: int, turns: int) -> list[dict[str, str]]:
    """A conversation's history as its turn ``turns`` resends it (no routing key)."""
    msgs = [SYSTEM, {"role": "user", "content": f"Conversation {cid}: my router blinks."}]
    for t in range(turns):
        msgs += [
            {"role": "assistant", "content": f"Answer {t}."},
            {"role": "user", "content": f"Follow-up {t} of {cid}."},
        ]
    return msgs


async def test_a_conversation_sticks_to_one_replica_across_two_gateways() -> None:
    """No key sent: the prompt's prefix picks the replica, the same from two gateways sharing
    nothing; it moves when that replica is out and comes back when it returns."""
    with trio.fail_after(30):
        engines = [FakeEngine() for _ in range(4)]
        async with running_gateway(engines) as gw, another_gateway(gw) as gw2:
            homes = {}
            for cid in range(8):
                where = set()
                for t in range(4):
                    g = (gw, gw2)[t % 2]
                    r = await chat(g, messages=conversation(cid, t))
                    assert r.status_code == 200, r.text
                    where.update(served_by(gw, r.headers["x-request-id"]))
                assert len(where) == 1, f"conversation {cid} was split over {where}"
                homes[cid] = where.pop()
            assert len(set(homes.values())) >= 2, homes  # conversations spread

            home = homes[0]
            engines[home].healthy = False
            await wait_until(lambda: not up(gw, home) and not up(gw2, home))
            moved = set()
            for t in range(4, 8):
                r = await chat((gw, gw2)[t % 2], messages=conversation(0, t))
                moved.update(served_by(gw, r.headers["x-request-id"]))
            assert len(moved) == 1 and home not in moved  # one new home, the same for both
            engines[home].healthy = True
            await wait_until(lambda: up(gw, home) and up(gw2, home))
            for g in (gw, gw2):
                r = await chat(g, messages=conversation(0, 9))
                assert served_by(gw, r.headers["x-request-id"]) == [home]


async def test_a_replica_reporting_a_long_queue_gets_less_new_work() -> None:
    """The engines' own load (/v1/loads) counts: another gateway's queue on a replica shows."""
    with trio.fail_after(30):
        engines = [FakeEngine() for _ in range(3)]
        engines[0].load = (16, 40)  # busy with other gateways' work
        async with running_gateway(engines) as gw:
            pool = gw.state.pools[MODEL]
            await wait_until(lambda: pool.replicas[0].engine_load == 56)
            counts: Counter[int] = Counter()
            for cid in range(12):  # distinct prefixes: affinity would spread them over all 3
                r = await chat(gw, messages=conversation(100 + cid, 0))
                counts.update(served_by(gw, r.headers["x-request-id"]))
            assert counts[0] == 0 and sum(counts.values()) == 12, counts
            engines[0].load = None  # the queue drained: its real (idle) count again
            await wait_until(lambda: pool.replicas[0].engine_load == 0)
            for cid in range(24):  # new prefixes: about a third rank replica 0 first
                r = await chat(gw, messages=conversation(200 + cid, 0))
                counts.update(served_by(gw, r.headers["x-request-id"]))
            assert counts[0] > 0, counts


# ---------------------------------------------------------------------------- least outstanding


async def test_least_outstanding_spreads_concurrent_streams() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine(script=SLOW) for _ in range(3)]
        async with running_gateway(engines, settings_hook=least_loaded) as gw:
            resps = await concurrently(gw, 9, max_tokens=10)
            assert all(x.status_code == 200 for x in resps)
            assert all(sse_events(x.text)[-1] == "[DONE]" for x in resps)
            assert [len(gen_rids(e)) for e in engines] == [3, 3, 3]


async def test_all_candidates_of_a_request_on_one_replica() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine(script=SLOW) for _ in range(3)]
        async with running_gateway(engines) as gw:
            # load two replicas a little so "least outstanding" per candidate would split
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: chat(gw, stream=True, max_tokens=10))
                await wait_until(lambda: sum(len(e.running) for e in engines) == 1)
                r = await chat(gw, n=8, stream=True, max_tokens=4, request_id="fan8")
            assert r.status_code == 200
            assert sse_events(r.text)[-1] == "[DONE]"
            where = served_by(gw, "fan8")
            assert len(where) == 1
            rids = [x for x in gen_rids(engines[where[0]]) if x.startswith("fan8-")]
            assert sorted(rids) == [f"fan8-{i}" for i in range(8)]

            r = await chat(gw, n=2, best_of=4, max_tokens=3, request_id="bo4")
            assert r.status_code == 200, r.text
            where = served_by(gw, "bo4")
            assert len(where) == 1
            assert len([x for x in gen_rids(engines[where[0]]) if x.startswith("bo4-")]) == 4


# ---------------------------------------------------------------------------- pool headers


async def test_pool_and_machine_profile_headers() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine() for _ in range(4)]  # pools 0,1,0,1; profiles 0..3
        async with running_gateway(engines) as gw:
            used: set[int] = set()
            for i in range(8):
                r = await chat(gw, headers={"X-SIE-Pool": "pool-1"})
                assert r.status_code == 200
                used.update(served_by(gw, r.headers["x-request-id"]))
                r = await chat(gw, headers={"X-SIE-Pool": "pool-1"}, routing_key=f"k{i}")
                used.update(served_by(gw, r.headers["x-request-id"]))
            assert used == {1, 3}

            for _ in range(4):
                r = await chat(gw, headers={"X-SIE-MACHINE-PROFILE": "profile-2"})
                assert r.status_code == 200
                assert served_by(gw, r.headers["x-request-id"]) == [2]

            r = await chat(
                gw, headers={"X-SIE-Pool": "pool-0", "X-SIE-MACHINE-PROFILE": "profile-0"}
            )
            assert served_by(gw, r.headers["x-request-id"]) == [0]

            r = await chat(gw, headers={"X-SIE-Pool": "pool-9"})
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "X-SIE-Pool"
            r = await chat(gw, headers={"X-SIE-MACHINE-PROFILE": "gpu-x"})
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "X-SIE-MACHINE-PROFILE"


async def test_pool_and_profile_never_on_one_replica_is_400() -> None:
    """Each header value exists, never on the same replica: 400 naming both, not 503 loading.
    The same pair served by a replica that is down is a 503: a retry may succeed."""
    with trio.fail_after(20):
        engines = [FakeEngine(), FakeEngine()]  # (pool-0, profile-0), (pool-1, profile-1)
        async with running_gateway(engines) as gw:
            apart = {"X-SIE-Pool": "pool-1", "X-SIE-MACHINE-PROFILE": "profile-0"}
            r = await chat(gw, headers=apart)
            assert r.status_code == 400, r.text
            assert "retry-after" not in r.headers
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error", err
            assert (err["code"], err["param"]) == ("invalid_request", "X-SIE-Pool")
            assert "X-SIE-Pool" in err["message"] and "X-SIE-MACHINE-PROFILE" in err["message"]
            assert all(gen_rids(e) == [] for e in engines)

            engines[0].healthy = False
            await wait_until(lambda: not up(gw, 0))
            together = {"X-SIE-Pool": "pool-0", "X-SIE-MACHINE-PROFILE": "profile-0"}
            r = await chat(gw, headers=together)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "model_loading"
            assert "retry-after" in r.headers


async def test_pool_header_never_falls_back_to_other_pools() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine(), FakeEngine()]
        async with running_gateway(engines) as gw:
            engines[1].healthy = False
            await wait_until(lambda: not up(gw, 1))
            r = await chat(gw, headers={"X-SIE-Pool": "pool-1"})
            assert r.status_code == 503
            assert "retry-after" in r.headers
            assert gen_rids(engines[0]) == []


# ---------------------------------------------------------------------------- admission


async def test_inflight_limit_then_503_with_retry_after() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine(script=DefaultScript(itl=0.1)) for _ in range(2)]
        async with running_gateway(
            engines, replica_max_inflight=2, admission_wait=0.2, retry_after=4
        ) as gw:
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(lambda: chat(gw, stream=True, max_tokens=10))
                await wait_until(lambda: sum(len(e.running) for e in engines) == 4)
                t0 = trio.current_time()
                r = await chat(gw)
                waited = trio.current_time() - t0
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "4"
                assert r.json()["error"]["code"] != "model_loading"
                assert 0.15 <= waited < 2.0
                assert [len(e.running) for e in engines] == [2, 2]
            r = await chat(gw)
            assert r.status_code == 200


async def test_inflight_limit_waits_for_room() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine(script=DefaultScript(itl=0.05)) for _ in range(2)]
        peak = [0, 0]

        async def monitor() -> None:
            while True:
                for i, e in enumerate(engines):
                    peak[i] = max(peak[i], len(e.running))
                await trio.sleep(0.002)

        async with running_gateway(engines, replica_max_inflight=1, admission_wait=5) as gw:
            resps: list[httpx.Response] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(monitor)
                async with trio.open_nursery() as reqs:
                    for _ in range(5):
                        reqs.start_soon(lambda: _stream_all(gw, resps, max_tokens=8))
                nursery.cancel_scope.cancel()
            assert [x.status_code for x in resps] == [200] * 5
            assert peak == [1, 1]


async def test_inflight_limit_counts_every_candidate() -> None:
    """replica_max_inflight bounds *candidates*: an n=4 request does not fit beside 3 others."""
    with trio.fail_after(20):
        engine = FakeEngine(script=DefaultScript(itl=0.1))
        peak = [0]

        async def monitor() -> None:
            while True:
                peak[0] = max(peak[0], len(engine.running))
                await trio.sleep(0.002)

        async with running_gateway(engine, replica_max_inflight=4, admission_wait=0.3) as gw:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(monitor)
                async with trio.open_nursery() as reqs:
                    for _ in range(3):
                        reqs.start_soon(lambda: chat(gw, stream=True, max_tokens=10))
                    await wait_until(lambda: len(engine.running) == 3)
                    r = await chat(gw, n=4, stream=True, max_tokens=2)
                    assert r.status_code in (200, 503)
                nursery.cancel_scope.cancel()
            assert peak[0] <= 4, f"{peak[0]} candidates ran on a replica limited to 4"


# ---------------------------------------------------------------------------- retry


def _long_checks(s: Settings) -> None:
    s.gateway.health_interval = 30.0  # the gateway keeps believing the dead replica is ready


@pytest.mark.parametrize("failure", ["refused", "http_503", "http_500", "reset_before_headers"])
async def test_retry_before_first_byte(failure: str) -> None:
    with trio.fail_after(20):
        script = Switch()
        engines = [KillableEngine(script=script), KillableEngine()]
        hook = _long_checks if failure == "refused" else None
        async with running_gateway(engines, settings_hook=hook) as gw:
            key = await find_key(gw, 0)
            if failure == "refused":
                engines[0].kill()
                await trio.sleep(0.1)
            elif failure == "http_503":
                script.fault = Fault.http_error(503)
            elif failure == "http_500":
                script.fault = Fault.http_error(500)
            else:
                script.fault = Fault.reset(before_headers=True)
            for stream in (False, True):
                r = await chat(gw, routing_key=key, stream=stream)
                assert r.status_code == 200, r.text
                rid = r.headers["x-request-id"]
                if failure == "refused":
                    assert served_by(gw, rid) == [1]
                else:
                    assert served_by(gw, rid) == [0, 1], "seen by the failing and the retry replica"
                if stream:
                    assert sse_events(r.text)[-1] == "[DONE]"
            m = await scrape(gw)
            assert sample(m, "sieproxy_retries_total", model="test-model") == 2.0


async def test_retry_happens_at_most_once() -> None:
    with trio.fail_after(20):
        scripts = [Switch() for _ in range(3)]
        engines = [FakeEngine(script=s) for s in scripts]
        async with running_gateway(engines) as gw:
            for s in scripts:
                s.fault = Fault.http_error(503)
            r = await chat(gw, request_id="twice")
            assert r.status_code == 503
            assert "retry-after" in r.headers
            assert sum(1 for e in engines for x in gen_rids(e) if x.startswith("twice-")) == 2


async def test_client_error_is_not_retried() -> None:
    with trio.fail_after(20):
        script = Switch()
        engines = [FakeEngine(script=script), FakeEngine()]
        async with running_gateway(engines) as gw:
            key = await find_key(gw, 0)
            script.fault = Fault.http_error(400)
            r = await chat(gw, routing_key=key, request_id="bad400")
            assert r.status_code == 400
            assert served_by(gw, "bad400") == [0]


@pytest.mark.parametrize("fault", ["reset", "error_event"])
async def test_no_retry_after_first_byte(fault: str) -> None:
    """With resumes off, a stream that breaks after output ends with its error and is not
    retried (resumes, the default, continue it: test_resume.py)."""
    def base(call: Call) -> Plan:
        return Plan(tokens=["Hel", "lo", " wor", "ld"], itl=0.01)

    with trio.fail_after(20):
        script = Switch(base)
        engines = [FakeEngine(script=script), FakeEngine()]
        async with running_gateway(engines, settings_hook=no_resumes) as gw:
            key = await find_key(gw, 0)
            script.fault = (
                Fault.reset(at=2) if fault == "reset" else Fault.error_event(at=2, code=500)
            )
            r = await chat(gw, routing_key=key, stream=True, request_id="late-fail")
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert "error" in events[-2], events[-2]
            text = "".join(
                e["choices"][0]["delta"].get("content") or ""
                for e in events[:-2]
                if e.get("choices")
            )
            assert text.startswith("Hello")
            assert served_by(gw, "late-fail") == [0], "never retried after the first byte"
            m = await scrape(gw)
            assert sample(m, "sieproxy_retries_total", model="test-model") is None


async def test_retry_keeps_all_candidates_together() -> None:
    with trio.fail_after(20):
        script = Switch()
        engines = [FakeEngine(script=script), FakeEngine(), FakeEngine()]
        async with running_gateway(engines) as gw:
            key = await find_key(gw, 0)
            script.fault = Fault.http_error(503)
            r = await chat(gw, routing_key=key, n=3, stream=True, request_id="fan3")
            assert r.status_code == 200
            assert sse_events(r.text)[-1] == "[DONE]"
            where = served_by(gw, "fan3")
            assert where[0] == 0 and len(where) == 2
            rids = [x for x in gen_rids(engines[where[1]]) if x.startswith("fan3-")]
            assert sorted(rids) == ["fan3-0", "fan3-1", "fan3-2"]
