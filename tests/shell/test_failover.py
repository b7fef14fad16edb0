"""The fault matrix, failover part: engine failures the gateway recovers from before the first
byte (the retry table, sieproxy/core/upstream/retry.py; sieproxy/relay/failover.py), through
both upstream protocols.

Each case states what the client sees, how many upstream attempts were made (the fake engine's
records) and how long it took. Helpers and conventions are test_faults.py's: a request names
itself with ``X-Request-Id`` (SGLang rids ``<id>-<index>``; a retry on the same engine
``<id>.r<k>-<index>``) or, through the OpenAI protocol, in its prompt (:func:`openai_name`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import trio

from engine.fake import Call, DefaultScript, FakeEngine, Fault, Plan
from sieproxy.settings.load import Settings

from .harness import MODEL, running_gateway, sse_events
from .test_fallback import OTHER, two_models
from .test_faults import (
    PROTOCOLS,
    SECRET,
    TOKENS,
    aborted_once,
    at_most_one_abort,
    check_sse_error_tail,
    check_status_error,
    fake,
    generate_rids,
    no_resumes,
    post,
    settled,
    still_serves,
    timed_post,
)
from .test_health import sample, scrape

Script = Callable[[Call], Plan]


@pytest.fixture(name="protocol", params=PROTOCOLS)
def _protocol(request: pytest.FixtureRequest) -> str:
    """The upstream protocol of the test's engines."""
    name: str = request.param
    return name


def first_calls(plan: Plan, times: int = 1, prefix: str = "fo") -> Script:
    """Plays ``plan`` for the first ``times`` calls whose rid starts with ``prefix`` (one
    script may serve several engines: the count is shared), the default plan otherwise."""
    left = [times]
    default = DefaultScript()

    def script(call: Call) -> Plan:
        if call.rid.startswith(prefix) and left[0] > 0:
            left[0] -= 1
            return plan
        return default(call)

    return script


def always(plan: Plan, prefix: str = "fo") -> Script:
    return first_calls(plan, times=10**9, prefix=prefix)


def attempts(engines: FakeEngine | list[FakeEngine], protocol: str, prefix: str) -> int:
    """How many upstream requests of the request named ``prefix`` the engines received."""
    if isinstance(engines, FakeEngine):
        engines = [engines]
    return sum(
        1
        for e in engines
        for r in generate_rids(e, protocol)
        if r.rsplit("-", 1)[0].split(".r")[0] == prefix
    )


def text_of(r: Any, stream: bool) -> str:
    if not stream:
        return str(r.json()["choices"][0]["message"]["content"])
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def single(protocol: str, **model: Any) -> Callable[[Settings], None]:
    """A settings hook setting ``MODEL``'s keys."""

    def hook(s: Settings) -> None:
        for k, v in model.items():
            setattr(s.models[MODEL], k, v)

    return hook


STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])


# ---- 429 / 503 and Retry-After ------------------------------------------------------------


@STREAMS
async def test_429_with_retry_after_is_retried_on_the_same_replica_after_it(
    protocol: str, stream: bool
) -> None:
    """One engine answers 429 with ``Retry-After: 1``, then serves: the client gets the whole
    answer, one pause later; two attempts on the one engine."""
    busy = Plan(TOKENS, fault=Fault.http_error(429, SECRET, retry_after="1"))
    engine = fake(protocol, first_calls(busy))
    async with running_gateway(engine, protocol=protocol) as gw:
        r, took = await timed_post(gw, "fo-ra", stream=stream, max_tokens=4)
        assert r.status_code == 200, r.text
        assert len(text_of(r, stream).split()) == 4
        assert attempts(engine, protocol, "fo-ra") == 2
        assert 1.0 <= took < 4.0, took
        if protocol == "sglang":
            assert generate_rids(engine) == ["fo-ra-0", "fo-ra.r1-0"]
        await settled(engine)
        at_most_one_abort(engine, protocol)
        await still_serves(gw)


@STREAMS
async def test_429_without_retry_after_is_retried_once_after_a_short_backoff(
    protocol: str, stream: bool
) -> None:
    busy = Plan(TOKENS, fault=Fault.http_error(429, SECRET))
    engine = fake(protocol, first_calls(busy))
    async with running_gateway(engine, protocol=protocol) as gw:
        r, took = await timed_post(gw, "fo-429", stream=stream, max_tokens=4)
        assert r.status_code == 200, r.text
        assert attempts(engine, protocol, "fo-429") == 2
        assert took < 1.0, took  # the backoff: 50 to 100 ms
        await still_serves(gw)


@pytest.mark.parametrize(
    ("hint", "want", "min_took"),
    [("2", "2", 2.0), ("30", "30", 0.0), (None, None, 0.0)],
    ids=["within-bound", "beyond-bound", "no-hint"],
)
async def test_503_persistently_ends_in_a_503_with_the_engines_retry_after(
    protocol: str, hint: str | None, want: str | None, min_took: float
) -> None:
    """Every attempt is refused 503: the client gets 503 after the table's one retry (on the
    same engine: after the hint when within ``retry_after_max``, else after the backoff), and
    its Retry-After is the engine's (the gateway's own when the engine gave none)."""
    refused = Fault.http_error(503, SECRET, retry_after=hint)
    engine = fake(protocol, always(Plan(TOKENS, fault=refused)))
    async with running_gateway(engine, protocol=protocol) as gw:
        r, took = await timed_post(gw, "fo-503", stream=True)
        err = check_status_error(r, 503)
        assert err["code"] == "engine_unavailable"
        assert r.headers["retry-after"] == (want or r.headers["retry-after"])
        assert attempts(engine, protocol, "fo-503") == 2
        assert min_took <= took < min_took + 2.0, took
        await settled(engine)
        assert engine.aborts == []  # refused before running: nothing to abort
        for e in gw.engines:
            e.script = DefaultScript()
        await still_serves(gw)


async def test_503_persistently_on_two_replicas_asks_each_once(protocol: str) -> None:
    script = always(Plan(TOKENS, fault=Fault.http_error(503, SECRET)))
    engines = [fake(protocol, script), fake(protocol, script)]
    async with running_gateway(engines, protocol=protocol) as gw:
        r, took = await timed_post(gw, "fo-503b", max_tokens=4)
        check_status_error(r, 503)
        assert [attempts(e, protocol, "fo-503b") for e in engines] in ([1, 1],)
        assert took < 1.0, took


# ---- 5xx and broken connections before any output ------------------------------------------

ONE_OFF: list[tuple[str, Plan]] = [
    ("http500", Plan(TOKENS, fault=Fault.http_error(500, SECRET))),
    ("http502", Plan(TOKENS, fault=Fault.http_error(502, SECRET))),
    ("reset_before_headers", Plan(TOKENS, fault=Fault.reset(before_headers=True))),
    ("eof_before_headers", Plan(TOKENS, fault=Fault.eof(0))),
    ("reset_after_head", Plan(TOKENS, fault=Fault.reset(0))),
    ("error_event_500", Plan(TOKENS, fault=Fault.error_event(0, SECRET, 500))),
    ("malformed_first", Plan(TOKENS, fault=Fault.malformed(0))),
]


@pytest.mark.parametrize("plan", [c[1] for c in ONE_OFF], ids=[c[0] for c in ONE_OFF])
@STREAMS
async def test_a_one_off_failure_on_a_single_replica_is_retried_there(
    protocol: str, plan: Plan, stream: bool
) -> None:
    """A model with one engine: a one-off server-side failure before any output is retried
    once on the same engine after a short backoff; the client gets the whole answer."""
    engine = fake(protocol, first_calls(plan))
    async with running_gateway(engine, protocol=protocol) as gw:
        r, took = await timed_post(gw, "fo-once", stream=stream, max_tokens=4)
        assert r.status_code == 200, r.text
        assert len(text_of(r, stream).split()) == 4
        assert attempts(engine, protocol, "fo-once") == 2
        assert took < 2.0, took
        await settled(engine)
        at_most_one_abort(engine, protocol)
        await still_serves(gw)


async def test_a_failure_twice_is_the_clients_error(protocol: str) -> None:
    """The table allows one retry within the model: a second 500 is the answer (502)."""
    engine = fake(protocol, always(Plan(TOKENS, fault=Fault.http_error(500, SECRET))))
    async with running_gateway(engine, protocol=protocol) as gw:
        r = await post(gw, "fo-twice", max_tokens=4)
        check_status_error(r, 502)
        assert attempts(engine, protocol, "fo-twice") == 2


# ---- no answer, a slow first token ---------------------------------------------------------

FTT = 0.5


@pytest.mark.parametrize("n", [1, 2], ids=["inline", "channel"])
@pytest.mark.parametrize(
    "fault",
    [Fault.hang(before_headers=True), Fault.hang(0)],
    ids=["no_answer", "head_only"],
)
@STREAMS
async def test_first_token_timeout_moves_to_another_replica(
    protocol: str, fault: Fault, n: int, stream: bool
) -> None:
    """``first_token_timeout``: an engine that shows nothing within it is aborted (once per
    candidate) and the request runs on the other replica; the client waits one timeout."""
    script = first_calls(Plan(TOKENS, fault=fault), times=n)  # the first attempt's candidates
    engines = [fake(protocol, script), fake(protocol, script)]
    hook = single(protocol, first_token_timeout=FTT)
    async with running_gateway(engines, protocol=protocol, settings_hook=hook) as gw:
        rid = f"fo-ftt{n}{int(stream)}"
        r, took = await timed_post(gw, rid, stream=stream, n=n, max_tokens=4)
        assert r.status_code == 200, r.text
        assert FTT * 0.9 <= took < FTT + 1.5, took
        asked = [e for e in engines if attempts(e, protocol, rid)]
        assert len(asked) == 2, "retried on the other replica"
        # Both settled first: the replica that answered records its finish just after the
        # client has its answer, so until then either engine may look like the hung one.
        for e in engines:
            await settled(e)
        hung = next(e for e in engines if not e.finished)
        await aborted_once(hung, [f"{rid}-{i}" for i in range(n)], protocol=protocol)


async def test_slow_first_token_on_a_model_without_other_options_is_a_504(protocol: str) -> None:
    engine = fake(protocol, always(Plan(TOKENS, ttft=30.0)))
    hook = single(protocol, first_token_timeout=FTT)
    async with running_gateway(engine, protocol=protocol, settings_hook=hook) as gw:
        r, took = await timed_post(gw, "fo-slow", stream=True, max_tokens=4)
        err = check_status_error(r, 504)
        assert err["code"] == "upstream_timeout"
        assert FTT * 0.9 <= took < FTT + 1.5, took
        assert attempts(engine, protocol, "fo-slow") == 1
        await aborted_once(engine, ["fo-slow-0"], protocol=protocol)
        await settled(engine)


async def test_without_first_token_timeout_a_gap_timeout_is_still_final(protocol: str) -> None:
    """The gap keeps its meaning: no ``first_token_timeout``, a silent engine costs the gap,
    and the request is not retried (test_faults.py covers two replicas)."""
    engine = fake(protocol, always(Plan(TOKENS, ttft=30.0)))
    async with running_gateway(engine, protocol=protocol, token_gap_timeout=FTT) as gw:
        r, _took = await timed_post(gw, "fo-gap", stream=True, max_tokens=4)
        check_status_error(r, 504)
        assert attempts(engine, protocol, "fo-gap") == 1


def with_fallback(protocol: str, **model: Any) -> Callable[[Settings], None]:
    def hook(s: Settings) -> None:
        two_models(s)
        for k, v in model.items():
            setattr(s.models[MODEL], k, v)

    return hook


@STREAMS
async def test_slow_first_token_moves_to_the_fallback_which_the_answer_names(
    protocol: str, stream: bool
) -> None:
    """The primary's first token would come after 30 s: after ``first_token_timeout`` the
    fallback model serves; the answer's ``model``, its usage and the metrics name the model
    that served (the accounting of a failed-over request)."""
    engines = [fake(protocol, always(Plan(TOKENS, ttft=30.0))), fake(protocol)]
    hook = with_fallback(protocol, first_token_timeout=FTT)
    async with running_gateway(engines, protocol=protocol, settings_hook=hook) as gw:
        rid = f"fo-fb{int(stream)}"
        body: dict[str, Any] = {"max_tokens": 5}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r, took = await timed_post(gw, rid, stream=stream, **body)
        assert r.status_code == 200, r.text
        assert FTT * 0.9 <= took < FTT + 1.5, took
        if stream:
            events = [e for e in sse_events(r.text) if e != "[DONE]"]
            assert {e["model"] for e in events} == {OTHER}
            usage = events[-1]["usage"]
        else:
            assert r.json()["model"] == OTHER
            usage = r.json()["usage"]
        assert usage["completion_tokens"] == 5
        assert len(text_of(r, stream).split()) == 5
        assert attempts(engines[0], protocol, rid) == 1
        assert attempts(engines[1], protocol, rid) == 1
        await aborted_once(engines[0], [f"{rid}-0"], protocol=protocol)
        metrics = await scrape(gw)
        fb = sample(metrics, "sieproxy_fallbacks_total", model=MODEL, cause="first_token")
        assert fb == 1
        served = sample(
            metrics, "sieproxy_requests_total", endpoint="chat", model=OTHER, status="200"
        )
        assert served == 1


# ---- context_length_exceeded ---------------------------------------------------------------

TOO_LONG = (
    b'{"error": {"message": "The input (9000 tokens) is longer than the model\'s context '
    b'length (4096 tokens)."}}'
)


@STREAMS
async def test_context_length_exceeded_moves_to_a_larger_context_fallback(
    protocol: str, stream: bool
) -> None:
    refusal = Plan(TOKENS, fault=Fault.http_error(400, body=TOO_LONG))
    engines = [fake(protocol, always(refusal)), fake(protocol)]

    def hook(s: Settings) -> None:
        two_models(s)
        s.models[MODEL].fallbacks = []
        s.models[MODEL].context_fallbacks = [OTHER]

    async with running_gateway(engines, protocol=protocol, settings_hook=hook) as gw:
        rid = f"fo-ctx{int(stream)}"
        r = await post(gw, rid, stream=stream, max_tokens=4)
        assert r.status_code == 200, r.text
        assert len(text_of(r, stream).split()) == 4
        assert attempts(engines[0], protocol, rid) == 1
        assert attempts(engines[1], protocol, rid) == 1
        fb = sample(await scrape(gw), "sieproxy_fallbacks_total", model=MODEL, cause="context")
        assert fb == 1


async def test_context_length_exceeded_without_a_fallback_stays_a_400(protocol: str) -> None:
    engine = fake(protocol, always(Plan(TOKENS, fault=Fault.http_error(400, body=TOO_LONG))))
    async with running_gateway(engine, protocol=protocol) as gw:
        r = await post(gw, "fo-ctxno")
        err = check_status_error(r, 400)
        assert err["code"] == "context_length_exceeded"
        assert attempts(engine, protocol, "fo-ctxno") == 1


async def test_the_gateways_own_context_check_moves_to_a_context_fallback() -> None:
    """max_tokens beyond the model's known context: planned on the first context fallback the
    request fits, before any engine is asked."""
    engines = [FakeEngine(), FakeEngine()]

    def hook(s: Settings) -> None:
        two_models(s)
        s.models[MODEL].fallbacks = []
        s.models[MODEL].context_fallbacks = [OTHER]

    async with running_gateway(engines, settings_hook=hook) as gw:
        profiles = gw.state.profiles
        profiles[MODEL] = dataclasses.replace(profiles[MODEL], context_length=32)
        r = await post(gw, "fo-own", max_tokens=64)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == OTHER
        assert attempts(engines[0], "sglang", "fo-own") == 0
        profiles[OTHER] = dataclasses.replace(profiles[OTHER], context_length=48)
        r = await post(gw, "fo-own2", max_tokens=64)
        err = check_status_error(r, 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"


# ---- a stream without [DONE]; a flapping primary -------------------------------------------


@STREAMS
async def test_a_stream_that_finished_but_never_sent_done(protocol: str, stream: bool) -> None:
    """The engine's body ends after its last token's finish, without ``[DONE]``. SGLang's
    finish is its last chunk: the answer is complete. The OpenAI protocol's finish waits for
    the usage chunk that follows it: the cut stream had finished, so it is complete too (the
    resume's first check, sieproxy/relay/resume.py), its usage the tokens counted; one attempt.
    With ``max_resumes = 0`` the OpenAI protocol's answer is the clean error."""
    engine = fake(protocol, always(Plan(TOKENS, fault=Fault.eof(len(TOKENS)))))
    async with running_gateway(engine, protocol=protocol) as gw:
        r = await post(gw, "fo-nodone", stream=stream, max_tokens=len(TOKENS))
        assert attempts(engine, protocol, "fo-nodone") == 1
        assert r.status_code == 200, r.text
        assert text_of(r, stream) == "".join(TOKENS)
        if not stream:
            assert r.json()["usage"]["completion_tokens"] == len(TOKENS)
    if protocol != "openai":  # (the fake's chat stream carries its usage in the finish chunk)
        return
    async with running_gateway(engine, protocol=protocol, settings_hook=no_resumes) as gw:
        r = await post(gw, "fo-nodone2", stream=stream, max_tokens=len(TOKENS))
        if stream:
            err, _events = check_sse_error_tail(r.text)
            assert err["code"] == "upstream_truncated"
        else:
            check_status_error(r, 502)


async def test_a_primary_flapping_under_20_requests(protocol: str) -> None:
    """The primary fails every other request before any output (500, reset, 429 with a hint,
    no first token), the fallback is healthy: all 20 concurrent requests are complete answers,
    each after at most four attempts."""
    faults = [
        Fault.http_error(500, SECRET),
        Fault.reset(before_headers=True),
        Fault.http_error(429, SECRET, retry_after="1"),
        Fault.hang(before_headers=True),
    ]
    calls = [0]
    default = DefaultScript()

    def flapping(call: Call) -> Plan:
        calls[0] += 1
        if calls[0] % 2:
            return Plan(TOKENS, fault=faults[(calls[0] // 2) % len(faults)])
        return default(call)

    engines = [fake(protocol, flapping), fake(protocol)]
    hook = with_fallback(protocol, first_token_timeout=FTT)
    results: dict[int, Any] = {}
    async with running_gateway(
        engines, protocol=protocol, settings_hook=hook, breaker_failures=1000
    ) as gw:

        async def one(k: int) -> None:
            results[k] = await post(gw, f"fo-flap{k}", stream=k % 2 == 0, max_tokens=4)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for k in range(20):
                    nursery.start_soon(one, k)
        for k, r in results.items():
            assert r.status_code == 200, (k, r.text)
            assert len(text_of(r, k % 2 == 0).split()) == 4
            tries = sum(attempts(e, protocol, f"fo-flap{k}") for e in engines)
            assert 1 <= tries <= 4, (k, tries)
        for e in engines:
            await settled(e)
        at_most_one_abort(engines[0], protocol)


# ---- a malformed event mid-stream ----------------------------------------------------------


@STREAMS
async def test_a_malformed_event_mid_stream(protocol: str, stream: bool) -> None:
    """A chunk that does not decode after two tokens, then the stream goes on. SGLang's
    cumulative text repeats the whole state in the next chunk: skipped, the answer is whole.
    The OpenAI protocol's chunks are deltas: with ``max_resumes = 0``, the stream's clean
    error (resumed by default: test_resume.py)."""
    engine = fake(protocol, always(Plan(TOKENS, fault=Fault.malformed(2, goes_on=True))))
    async with running_gateway(engine, protocol=protocol, settings_hook=no_resumes) as gw:
        r = await post(gw, "fo-bad", stream=stream, max_tokens=len(TOKENS))
        assert attempts(engine, protocol, "fo-bad") == 1
        if protocol == "sglang":
            assert r.status_code == 200, r.text
            assert text_of(r, stream) == "".join(TOKENS)
            assert engine.aborts == []
        elif stream:
            err, _events = check_sse_error_tail(r.text)
            assert err["code"] == "malformed_upstream"
        else:
            check_status_error(r, 500)
        await settled(engine)
        at_most_one_abort(engine, protocol)
