"""GET /metrics (Prometheus text) and the JSON access log agree with the traffic sent, and
never carry user data (prompt, generated text, user, routing key, bearer token)."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from engine.fake import Call, FakeEngine, Fault, Plan, default_tokens
from sieproxy.settings.load import Settings

from .harness import MODEL, Gateway, host_port, running_gateway, sse_events

TOKEN = "CANARY-TOKEN-5f3a"
PROMPT = "CANARY-PROMPT-91c2"
USER = "CANARY-USER-77d1"
KEY = "CANARY-KEY-0b9e"
OUT = "CANARYOUT"
CANARIES = (TOKEN, PROMPT, USER, KEY, OUT)
AUTH = {"Authorization": f"Bearer {TOKEN}"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def script(call: Call) -> Plan:
    prompt = call.prompt if isinstance(call.prompt, str) else ""
    texts, ids = default_tokens(call.seed, 200)
    if "SLOWCLIENT" in prompt:
        return Plan(tokens=texts, token_ids=ids, itl=0.05)
    if "WAITFIRST" in prompt:  # the first token comes late: the client leaves before it
        return Plan(tokens=texts[:3], token_ids=ids[:3], ttft=10.0)
    if "MIDFAIL" in prompt:
        return Plan(tokens=texts[:10], token_ids=ids[:10], itl=0.01, fault=Fault.reset(at=2))
    if "BESTOF" in prompt:
        if call.rid.endswith("-0"):  # finishes first with the best score
            return Plan(tokens=[OUT, " done"], logprobs=[-0.01, -0.01])
        return Plan(tokens=texts, token_ids=ids, itl=0.05, logprobs=[-5.0] * 200)
    return Plan(tokens=[OUT, *texts], token_ids=[999, *ids])


async def scrape(gw: Gateway) -> tuple[Samples, str]:
    r = await gw.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out, r.text


def get(m: Samples, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m: Samples, name: str, **labels: str) -> float:
    """Sum over the samples of ``name`` whose labels include ``labels``."""
    return sum(
        v
        for (n, ls), v in m.items()
        if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
    )


def body(content: str = PROMPT, **kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "user": USER,
        "routing_key": KEY,
        **kw,
    }


async def post(gw: Gateway, path: str, payload: dict[str, Any], **headers: str) -> httpx.Response:
    return await gw.client.post(path, json=payload, headers={**AUTH, **headers})


async def disconnect_after_first_chunk(
    gw: Gateway, payload: dict[str, Any], rid: str, hold: trio.Event | None = None
) -> None:
    """Read the first chunk, wait for ``hold`` (if given), then leave."""
    async with gw.client.stream(
        "POST", "/v1/chat/completions", json=payload, headers={**AUTH, "X-Request-Id": rid}
    ) as r:
        assert r.status_code == 200
        # Keep the iterator referenced while holding: an abandoned async generator is finalized
        # (closing the response, i.e. leaving) whenever the garbage collector gets to it.
        chunks = r.aiter_bytes()
        await chunks.__anext__()
        if hold is not None:
            await hold.wait()
        await chunks.aclose()


async def wait_metric(gw: Gateway, name: str, value: float, **labels: str) -> Samples:
    seen: list[float] = []
    with trio.move_on_after(5):
        while True:
            m, _ = await scrape(gw)
            seen.append(total(m, name, **labels))
            if seen[-1] >= value:
                return m
            await trio.sleep(0.02)
    raise AssertionError(f"{name}{labels} never reached {value}: saw {sorted(set(seen))}")


def assert_no_user_data(text: str) -> None:
    for canary in CANARIES:
        assert canary not in text, f"{canary} leaked"


def usage_of_stream(r: httpx.Response) -> dict[str, int]:
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return events[-2]["usage"]


# ---------------------------------------------------------------------------- metrics


async def test_metrics_agree_with_traffic() -> None:
    with trio.fail_after(30):
        engines = [FakeEngine(script=script), FakeEngine(script=script)]
        async with running_gateway(engines, auth=True, tokens=[TOKEN]) as gw:
            urls = {r.url for r in gw.state.pools[MODEL].replicas}
            usages = []
            for _ in range(2):
                r = await post(
                    gw,
                    "/v1/chat/completions",
                    body(max_tokens=5, stream=True, stream_options={"include_usage": True}),
                )
                assert r.status_code == 200
                usages.append(usage_of_stream(r))
            r = await post(gw, "/v1/chat/completions", body(max_tokens=4))
            assert r.status_code == 200
            usages.append(r.json()["usage"])
            r = await post(
                gw, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
            )
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
            assert [u["completion_tokens"] for u in usages] == [5, 5, 4, 3]

            m, text = await scrape(gw)
            req = "sieproxy_requests_total"
            assert get(m, req, endpoint="chat", model=MODEL, status="200") == 3
            assert get(m, req, endpoint="completions", model=MODEL, status="200") == 1
            assert get(m, "sieproxy_tokens_total", model=MODEL, direction="out") == 17
            assert get(m, "sieproxy_tokens_total", model=MODEL, direction="in") == sum(
                u["prompt_tokens"] for u in usages
            )
            assert get(m, "sieproxy_time_to_first_token_seconds_count", model=MODEL) == 4
            assert get(m, "sieproxy_inter_token_latency_seconds_count", model=MODEL) == 4
            assert get(m, "sieproxy_request_duration_seconds_count", model=MODEL) == 4
            for url in urls:
                assert get(m, "sieproxy_replica_up", model=MODEL, replica=url) == 1
                assert get(m, "sieproxy_replica_inflight_candidates", model=MODEL, replica=url) == 0

            # in flight: an n=2 slow stream holds two candidates on one replica
            async with trio.open_nursery() as nursery:
                seen = trio.Event()  # the client leaves only once the gauge was observed
                nursery.start_soon(
                    disconnect_after_first_chunk,
                    gw,
                    body("SLOWCLIENT " + PROMPT, n=2, max_tokens=100, stream=True),
                    "gone1",
                    seen,
                )
                m = await wait_metric(gw, "sieproxy_replica_inflight_candidates", 2)
                seen.set()
                per = [
                    get(m, "sieproxy_replica_inflight_candidates", model=MODEL, replica=u)
                    for u in urls
                ]
                assert sorted(per) == [0, 2]

            # aborts by cause: client gone, best_of losers, engine error mid-stream
            m = await wait_metric(gw, "sieproxy_upstream_aborts_total", 2, cause="client")
            assert get(m, "sieproxy_upstream_aborts_total", model=MODEL, cause="client") == 2
            with trio.fail_after(3):
                for e in engines:
                    await e.wait_for(lambda e=e: not e.running)

            r = await post(gw, "/v1/chat/completions", body("BESTOF", n=1, best_of=3))
            assert r.status_code == 200, r.text
            m, _ = await scrape(gw)
            assert get(m, "sieproxy_upstream_aborts_total", model=MODEL, cause="best_of") == 2

            r = await post(gw, "/v1/chat/completions", body("MIDFAIL", stream=True))
            assert r.status_code == 200
            assert "error" in sse_events(r.text)[-2]
            m, text = await scrape(gw)
            # The broken stream and its resume (which broke too), each aborted once.
            assert get(m, "sieproxy_upstream_aborts_total", model=MODEL, cause="error") == 2
            assert sum(v for (name, _l), v in m.items() if name == "sieproxy_resumes_total") == 1
            assert get(m, "sieproxy_time_to_first_token_seconds_count", model=MODEL) == 7

            assert_no_user_data(text)
            allowed = {"endpoint", "model", "status", "replica", "direction", "cause", "le"}
            allowed.add("tenant")  # the key's tenant (the old token list: token-<hash prefix>)
            for (_, labels), _v in m.items():
                for k, v in labels:
                    assert k in allowed, k
                    if k == "model":
                        assert v == MODEL
                    if k == "tenant":
                        assert v.startswith("token-") and TOKEN not in v
                    if k == "replica":
                        assert v in urls


async def test_deadline_abort_counted() -> None:
    with trio.fail_after(20):
        async with running_gateway(FakeEngine(script=script), request_deadline=0.3) as gw:
            r = await gw.chat(
                messages=[{"role": "user", "content": "SLOWCLIENT"}], max_tokens=100, stream=True
            )
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert "error" in events[-2]
            m = await wait_metric(gw, "sieproxy_upstream_aborts_total", 1, cause="deadline")
            assert get(m, "sieproxy_upstream_aborts_total", model=MODEL, cause="deadline") == 1
            assert gw.engines[0].aborts, "the deadline aborted the rid upstream"


async def test_inflight_requests_gauge() -> None:
    """Issue: metrics include "in-flight requests and candidates per replica"."""
    with trio.fail_after(20):
        async with running_gateway(FakeEngine(script=script)) as gw, trio.open_nursery() as nursery:

            async def slow() -> None:
                await gw.chat(
                    messages=[{"role": "user", "content": "SLOWCLIENT"}],
                    max_tokens=10,
                    n=3,
                    stream=True,
                )

            nursery.start_soon(slow)
            with trio.fail_after(5):
                await gw.engines[0].wait_for(lambda: len(gw.engines[0].running) == 3)
            r = await gw.client.get("/metrics")
            fams = {f.name: f for f in text_string_to_metric_families(r.text) if f.type == "gauge"}
            requests_gauges = [
                f
                for name, f in fams.items()
                if "request" in name and ("inflight" in name or "in_flight" in name)
            ]
            assert requests_gauges, f"no in-flight requests gauge among {sorted(fams)}"
            assert sum(s.value for s in requests_gauges[0].samples) == 1


async def test_refused_requests_are_counted() -> None:
    """Requests answered before any engine work (400, 503) still count by endpoint/status."""
    with trio.fail_after(20):
        engine = FakeEngine(script=script)
        async with running_gateway(engine) as gw:
            r = await gw.chat(temperature=-1)
            assert r.status_code == 400
            engine.healthy = False
            with trio.fail_after(5):
                while gw.state.pools[MODEL].any_ready():
                    await trio.sleep(0.01)
            r = await gw.chat()
            assert r.status_code == 503
            r = await gw.chat(model="CANARY-MODEL-x")
            assert r.status_code == 404
            m, text = await scrape(gw)
            assert "CANARY-MODEL" not in text, "a client-chosen model name became a label"
            req = "sieproxy_requests_total"
            assert total(m, req, endpoint="chat", status="400") == 1
            assert total(m, req, endpoint="chat", status="503") == 1


# ---------------------------------------------------------------------------- access log


#: The fields of every access-log line, whatever became of the request.
FIELDS = {
    "request_id", "endpoint", "model", "status", "outcome", "n", "stream", "prompt_tokens",
    "completion_tokens", "ttft_ms", "duration_ms", "replica", "abort_causes", "retried", "resumes",
    "error_code", "sdk_version", "tenant", "admission_wait_ms", "cached_tokens",
    "cached_tokens_predicted",
}  # fmt: skip


def log_on(s: Settings) -> None:
    s.gateway.access_log = True  # the harness turns it off


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "sieproxy.access"]


async def test_access_log_one_json_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        engines = [FakeEngine(script=script), FakeEngine(script=script)]
        async with running_gateway(engines, auth=True, tokens=[TOKEN], settings_hook=log_on) as gw:
            urls = {r.url for r in gw.state.pools[MODEL].replicas}
            sdk = {"X-SIE-SDK-Version": "sie-python/1.4.2"}
            r1 = await post(
                gw,
                "/v1/chat/completions",
                body(n=2, max_tokens=5, stream=True, stream_options={"include_usage": True}),
                **sdk,
                **{"X-Request-Id": "log-stream"},
            )
            assert r1.status_code == 200
            r2 = await post(
                gw, "/v1/chat/completions", body(max_tokens=4), **{"X-Request-Id": "log-unary"}
            )
            assert r2.status_code == 200
            r3 = await post(
                gw,
                "/v1/completions",
                {"model": MODEL, "prompt": PROMPT, "max_tokens": 3},
                **{"X-Request-Id": "log-cmpl"},
            )
            assert r3.status_code == 200
            await disconnect_after_first_chunk(
                gw, body("SLOWCLIENT", max_tokens=100, stream=True), "log-gone"
            )
            with trio.fail_after(5):
                while len(access_lines(caplog)) < 4:
                    await trio.sleep(0.02)
            await trio.sleep(0.1)

        lines = access_lines(caplog)
        assert len(lines) == 4, lines
        by_id = {ln["request_id"]: ln for ln in lines}
        assert set(by_id) == {"log-stream", "log-unary", "log-cmpl", "log-gone"}
        for ln in lines:
            assert set(ln) == FIELDS, ln
            assert ln["model"] == MODEL
            assert ln["replica"] in urls
            assert ln["status"] == 200
            assert ln["ttft_ms"] is not None and 0 <= ln["ttft_ms"] <= ln["duration_ms"]

        s = by_id["log-stream"]
        assert s["n"] == 2 and s["stream"] is True
        assert s["sdk_version"] == "sie-python/1.4.2"
        assert s["completion_tokens"] == usage_of_stream(r1)["completion_tokens"] == 10
        assert s["prompt_tokens"] == usage_of_stream(r1)["prompt_tokens"]
        assert not s["abort_causes"]
        assert s["outcome"] == "complete"
        u = by_id["log-unary"]
        assert u["n"] == 1 and u["stream"] is False and u["sdk_version"] is None
        assert u["completion_tokens"] == 4
        assert by_id["log-cmpl"]["completion_tokens"] == 3
        gone = by_id["log-gone"]
        assert gone["abort_causes"] == {"client": 1}
        # It left mid-stream: the status sent (200), and an outcome that says it left.
        assert gone["outcome"] == "client_closed"
        assert {by_id[k]["outcome"] for k in ("log-unary", "log-cmpl")} == {"complete"}
        # It never finished: its tokens are what the engine had reported when the client left.
        assert gone["prompt_tokens"] > 0 and gone["completion_tokens"] >= 1

        everything = "\n".join(
            r.getMessage()
            for r in caplog.records
            if r.name.startswith(("sieproxy", "hypercorn", "quart"))
        )
        assert_no_user_data(everything)


async def test_access_log_covers_refused_requests(caplog: pytest.LogCaptureFixture) -> None:
    """One line per request, including those refused before reaching an engine."""
    caplog.set_level(logging.INFO, logger="sieproxy.access")
    with trio.fail_after(20):
        engine = FakeEngine(script=script)
        async with running_gateway(engine, settings_hook=log_on) as gw:
            r = await gw.client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                      "temperature": -1, "user": USER},
                headers={"X-Request-Id": "refused-400"},
            )  # fmt: skip
            assert r.status_code == 400
            engine.healthy = False
            with trio.fail_after(5):
                while gw.state.pools[MODEL].any_ready():
                    await trio.sleep(0.01)
            r = await gw.client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
                headers={"X-Request-Id": "refused-503"},
            )
            assert r.status_code == 503
            r = await gw.client.post(
                "/v1/completions",
                json={"model": "CANARY-MODEL-x", "prompt": PROMPT},
                headers={"X-Request-Id": "refused-404"},
            )
            assert r.status_code == 404
        lines = access_lines(caplog)
        by_id = {ln["request_id"]: ln for ln in lines}
        assert set(by_id) == {"refused-400", "refused-503", "refused-404"}, lines
        for rid, endpoint, status, code in (
            ("refused-400", "chat", 400, "invalid_request"),
            ("refused-503", "chat", 503, "model_loading"),
            ("refused-404", "completions", 404, "model_not_found"),
        ):
            ln = by_id[rid]
            assert set(ln) == FIELDS, ln
            assert (ln["endpoint"], ln["status"], ln["error_code"]) == (endpoint, status, code)
            assert ln["outcome"] == "complete" and ln["model"] is None and ln["replica"] is None
        assert_no_user_data(json.dumps(lines))
        assert "CANARY-MODEL" not in json.dumps(lines)


async def _raw(gw: Gateway, data: bytes) -> trio.SocketStream:
    host, port = host_port(gw)
    sock = await trio.open_tcp_stream(host, port)
    await sock.send_all(data)
    return sock


def _request(rid: str, content: str, *, stream: bool = False) -> bytes:
    payload = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream}
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: %b\r\nContent-Length: %d\r\n\r\n%b" % (rid.encode(), len(payload), payload)
    )


async def test_access_log_says_what_became_of_a_request_its_client_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue #31 (8): a client that left before the status line was logged with status 200 (or
    not at all). Each request gets one line: 499 (nginx's "client closed request") when
    nothing was answered, wherever the request was (body arriving, waiting for admission,
    waiting for the engine); a body the HTTP layer refused is that refusal (400)."""
    caplog.set_level(logging.INFO, logger="sieproxy.access")

    def hook(s: Settings) -> None:
        log_on(s)
        s.gateway.replica_max_inflight = 1  # the second request waits for admission

    with trio.fail_after(30):
        engine = FakeEngine(script=script)
        async with running_gateway(engine, settings_hook=hook, admission_wait=20.0) as gw:
            # Waiting for the engine's first token (streamed, so admitted and running).
            first = await _raw(gw, _request("gone-engine", "WAITFIRST", stream=True))
            with trio.fail_after(5):
                await engine.wait_for(lambda: len(engine.running) == 1)
            # Waiting for admission behind it.
            second = await _raw(gw, _request("gone-admission", "WAITFIRST"))
            await trio.sleep(0.2)
            assert len(engine.running) == 1
            await second.aclose()
            await trio.sleep(0.1)
            await first.aclose()
            with trio.fail_after(5):
                await engine.wait_for(lambda: not engine.running)
            # While its body was arriving.
            third = await _raw(
                gw,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone-body\r\n"
                b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\"",
            )
            await trio.sleep(0.2)
            await third.aclose()
            # A body the HTTP layer could not read (a bad chunk size after a good chunk).
            fourth = await _raw(
                gw,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: bad-chunk\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"2\r\n{\"\r\nzz\r\n",
            )
            async with fourth:
                answer = b""
                while more := await fourth.receive_some(65536):
                    answer += more
            assert answer.startswith(b"HTTP/1.1 400 "), answer
            with trio.move_on_after(5):  # the lines are checked below
                while len(access_lines(caplog)) < 4:
                    await trio.sleep(0.02)
            await trio.sleep(0.1)
            r = await gw.chat()  # still serving, and a complete request logs as one
            assert r.status_code == 200
        lines = access_lines(caplog)
        by_id = {ln["request_id"]: ln for ln in lines}
        done = r.headers["x-request-id"]
        assert len(lines) == 5, lines
        assert set(by_id) == {"gone-engine", "gone-admission", "gone-body", "bad-chunk", done}
        for ln in lines:
            assert set(ln) == FIELDS, ln
        ran = by_id["gone-engine"]
        assert (ran["status"], ran["outcome"], ran["error_code"]) == (499, "client_closed", None)
        assert ran["model"] == MODEL and ran["abort_causes"] == {"client": 1}
        assert ran["ttft_ms"] is None and ran["stream"] is True
        for rid in ("gone-admission", "gone-body"):
            ln = by_id[rid]
            assert (ln["status"], ln["outcome"], ln["model"]) == (499, "client_closed", None), ln
        bad = by_id["bad-chunk"]
        assert (bad["status"], bad["outcome"], bad["error_code"]) == (
            400,
            "complete",
            "invalid_request",
        )
        assert (by_id[done]["status"], by_id[done]["outcome"]) == (200, "complete")


# ---------------------------------------------------------------------------- autoscaling


async def test_autoscaling_series() -> None:
    """Per model: waiting for admission, running candidates, ready and configured replicas,
    the engines' own load, 503s for want of a replica (pending demand, also with no replica
    at all) and fallbacks; all parse with prometheus_client."""
    with trio.fail_after(30):
        engines = [FakeEngine(script=script), FakeEngine(script=script)]
        async with running_gateway(engines, replica_max_inflight=1, admission_wait=20) as gw:
            async with trio.open_nursery() as nursery:

                async def slow(i: int) -> None:
                    await gw.chat(
                        messages=[{"role": "user", "content": f"SLOWCLIENT {i}"}],
                        max_tokens=200,
                        stream=True,
                    )

                for i in range(3):  # two run (one per replica), one waits for admission
                    nursery.start_soon(slow, i)
                pool = gw.state.pools[MODEL]
                with trio.fail_after(5):
                    while pool.waiting != 1 or not all(r.engine_load == 1 for r in pool.replicas):
                        await trio.sleep(0.01)
                m, _ = await scrape(gw)
                nursery.cancel_scope.cancel()
            assert total(m, "sieproxy_admission_waiting_requests", model=MODEL) == 1
            assert total(m, "sieproxy_running_candidates", model=MODEL) == 2
            assert total(m, "sieproxy_ready_replicas", model=MODEL) == 2
            assert total(m, "sieproxy_replicas", model=MODEL) == 2
            assert total(m, "sieproxy_replica_engine_load", model=MODEL) == 2
            for e in engines:
                e.healthy = False
            with trio.fail_after(5):
                while pool.any_ready():
                    await trio.sleep(0.01)
            assert (await gw.chat()).status_code == 503
            gw.state.observer.fallback(MODEL, "no_ready_replica")
            m, _ = await scrape(gw)
            assert total(m, "sieproxy_ready_replicas", model=MODEL) == 0
            unserved = "sieproxy_unserved_requests_total"
            assert total(m, unserved, model=MODEL, cause="no_ready_replica") == 1
            assert total(m, unserved, model=MODEL, cause="at_capacity") == 0
            assert total(m, "sieproxy_fallbacks_total", model=MODEL, cause="no_ready_replica") == 1
