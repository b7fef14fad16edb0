"""The fault matrix, resume part: a stream that breaks after output continues elsewhere
(sieproxy/relay/resume.py, sieproxy/core/upstream/resume.py), through both upstream protocols
(SGLang native, the gateway-rendered OpenAI mode, the chat pass-through mode).

The engines' script plays one answer, :data:`ANSWER`, and continues it: a request whose prompt
(or assistant prefill) already ends with the first ``k`` tokens of it gets the rest. So a
resume that repeated or lost text would show in the client's text. Each case states what the
client sees, how many upstream attempts were made and, for the stall, how long it took.
Conventions are test_faults.py's: SGLang rids ``<id>-<index>`` (a resume ``<id>.c<k>-<index>``),
OpenAI-protocol requests named in their prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

from engine.fake import Call, FakeEngine, Fault, Plan
from sieproxy.settings.load import Settings

from .harness import MODEL, running_gateway, sse_events
from .test_fallback import OTHER, two_models
from .test_faults import (
    PROTOCOLS,
    SECRET,
    check_sse_error_tail,
    check_status_error,
    fake,
    generate_rids,
    post,
    settled,
    still_serves,
    timed_post,
)
from .test_health import sample, scrape

ANSWER = [f" a{k}" for k in range(8)]
WHOLE = "".join(ANSWER)
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])


@pytest.fixture(name="protocol", params=PROTOCOLS)
def _protocol(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def said(call: Call) -> str:
    """What the request already carries of the answer's text (its prompt's end; in chat
    pass-through, its assistant prefill)."""
    b = call.body
    if call.path == "/v1/chat/completions":
        return str(b["messages"][-1]["content"]) if b.get("continue_final_message") else ""
    return str(b.get("text") or b.get("prompt") or "")


def resuming(fault: Fault | None, *, only: str = "", times: int = 1) -> Callable[[Call], Plan]:
    """Plays :data:`ANSWER` from where the request's text left it; the first ``times`` fresh
    calls whose rid ends with ``only`` get ``fault``."""
    left = [times]

    def script(call: Call) -> Plan:
        text = said(call)
        k = max(j for j in range(len(ANSWER) + 1) if text.endswith("".join(ANSWER[:j])))
        if k == 0 and fault is not None and left[0] > 0 and call.rid.endswith(only):
            left[0] -= 1
            return Plan(ANSWER, fault=fault)
        return Plan(ANSWER[k:])

    return script


def calls(engines: list[FakeEngine], protocol: str, name: str) -> int:
    """Upstream requests of the request ``name`` (its resumes included)."""
    return sum(
        1
        for e in engines
        for r in generate_rids(e, protocol)
        if r.rsplit("-", 1)[0].split(".")[0] == name
    )


def texts(r: Any, stream: bool) -> tuple[list[str], list[str | None], dict[str, Any]]:
    """Per choice: its text and finish_reason, and the usage (the stream's last chunk)."""
    if not stream:
        body = r.json()
        choices = sorted(body["choices"], key=lambda c: c["index"])
        return (
            [c["message"]["content"] for c in choices],
            [c["finish_reason"] for c in choices],
            body["usage"],
        )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    n = 1 + max(c["index"] for e in events[:-1] for c in e.get("choices", []))
    out = [""] * n
    reasons: list[str | None] = [None] * n
    for e in events[:-1]:
        for c in e.get("choices", []):
            i = c["index"]
            assert reasons[i] is None, "text after the choice's finish"
            out[i] += c["delta"].get("content") or ""
            reasons[i] = c.get("finish_reason")
    return out, reasons, events[-2].get("usage") or {}


def ask(stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"stream": stream, "max_tokens": 32, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


BREAKS: list[tuple[str, Fault, str]] = [
    ("cut", Fault.eof(3, clean=False), "cut"),
    ("reset", Fault.reset(3), "cut"),
    ("error_event", Fault.error_event(3, SECRET, 500), "error_event"),
    ("no_done", Fault.eof(3), "cut"),
]


@pytest.mark.parametrize(("fault", "cause"), [b[1:] for b in BREAKS], ids=[b[0] for b in BREAKS])
@STREAMS
async def test_a_broken_stream_continues_on_the_other_replica(
    protocol: str, fault: Fault, cause: str, stream: bool
) -> None:
    """Three tokens, then the stream breaks: the candidate continues on the other replica with
    the text so far; the client gets the whole answer once, its finish from the attempt that
    finished, usage counting the eight tokens it received; two upstream attempts."""
    script = resuming(fault)
    engines = [fake(protocol, script), fake(protocol, script)]
    async with running_gateway(engines, protocol=protocol, breaker_failures=1000) as gw:
        name = f"rs-{cause}{int(stream)}"
        r = await post(gw, name, **ask(stream))
        assert r.status_code == 200, r.text
        out, reasons, usage = texts(r, stream)
        assert out == [WHOLE] and reasons == ["stop"]
        assert usage["completion_tokens"] == len(ANSWER)
        assert usage["prompt_tokens"] > 0
        assert [calls([e], protocol, name) for e in engines] in ([1, 1],)
        if protocol == "sglang":
            rids = sorted(r for e in engines for r in generate_rids(e, protocol))
            assert rids == [f"{name}-0", f"{name}.c1-0"]
        assert sample(await scrape(gw), "sieproxy_resumes_total", model=MODEL, cause=cause) == 1
        for e in engines:
            await settled(e)
        await still_serves(gw)


@STREAMS
async def test_a_malformed_event_that_cannot_be_skipped_is_resumed(
    protocol: str, stream: bool
) -> None:
    """An event that does not decode after three tokens, then ``[DONE]``: SGLang's cumulative
    text skips it, and the stream ending before its finish is a cut; the OpenAI protocol's
    deltas cannot skip it: a break (``malformed``). Either way the answer is whole."""
    engine = fake(protocol, resuming(Fault.malformed(3)))
    async with running_gateway(engine, protocol=protocol) as gw:
        name = f"rs-bad{int(stream)}"
        r = await post(gw, name, **ask(stream))
        assert r.status_code == 200, r.text
        out, _reasons, _usage = texts(r, stream)
        assert out == [WHOLE]
        assert calls([engine], protocol, name) == 2
        cause = "cut" if protocol == "sglang" else "malformed"
        assert sample(await scrape(gw), "sieproxy_resumes_total", model=MODEL, cause=cause) == 1


async def test_a_stalled_stream_is_resumed_after_the_gap(protocol: str) -> None:
    """The engine stops sending after three tokens: after ``token_gap_timeout`` the candidate
    is aborted once and continued (one replica: on the same one after the backoff)."""
    gap = 0.5
    engine = fake(protocol, resuming(Fault.hang(3)))
    async with running_gateway(engine, protocol=protocol, token_gap_timeout=gap) as gw:
        r, took = await timed_post(gw, "rs-stall", **ask(True))
        assert r.status_code == 200, r.text
        out, reasons, usage = texts(r, True)
        assert out == [WHOLE] and reasons == ["stop"]
        assert usage["completion_tokens"] == len(ANSWER)
        assert gap * 0.9 <= took < gap + 2.0, took
        assert calls([engine], protocol, "rs-stall") == 2
        assert sample(await scrape(gw), "sieproxy_resumes_total", model=MODEL, cause="stall") == 1
        await settled(engine)


@STREAMS
async def test_n2_one_candidate_resumes_and_the_order_holds(protocol: str, stream: bool) -> None:
    """n = 2, candidate 1 cut after three tokens: both choices are whole, each in its own
    index, candidate 0 untouched (one attempt), candidate 1 two."""
    engine = fake(protocol, resuming(Fault.eof(3, clean=False), only="-1"))
    async with running_gateway(engine, protocol=protocol) as gw:
        name = f"rs-n2{int(stream)}"
        r = await post(gw, name, n=2, **ask(stream))
        assert r.status_code == 200, r.text
        out, reasons, usage = texts(r, stream)
        assert out == [WHOLE, WHOLE] and reasons == ["stop", "stop"]
        assert usage["completion_tokens"] == 2 * len(ANSWER)
        assert calls([engine], protocol, name) == 3
        await settled(engine)
        await still_serves(gw)


async def test_resumes_are_bounded_by_max_resumes(protocol: str) -> None:
    """Every attempt breaks: one resume (the default), then the stream's error event after
    the text both attempts produced; ``max_resumes = 2`` allows a second."""
    for limit, want in ((1, 2), (2, 3)):
        engine = fake(protocol, resuming(Fault.eof(2, clean=False), times=0))

        def script(call: Call, inner: Any = engine.script) -> Plan:
            plan: Plan = inner(call)
            return Plan(plan.tokens, fault=Fault.eof(2, clean=False))

        engine.script = script

        def hook(s: Settings, limit: int = limit) -> None:
            s.models[MODEL].max_resumes = limit

        async with running_gateway(engine, protocol=protocol, settings_hook=hook) as gw:
            name = f"rs-max{limit}"
            r = await post(gw, name, stream=True, max_tokens=32)
            err, events = check_sse_error_tail(r.text)
            assert err["code"] == "upstream_truncated"
            text = "".join(
                e["choices"][0]["delta"].get("content") or ""
                for e in events
                if isinstance(e, dict) and e.get("choices")
            )
            assert text == "".join(ANSWER[: 2 * want])
            assert calls([engine], protocol, name) == want
            await settled(engine)


async def test_a_content_filter_400_mid_stream_is_not_resumed(protocol: str) -> None:
    """An engine's 4xx error event after output is the request's own refusal (a content
    filter): no resume, the stream's clean error event then ``[DONE]``."""
    engine = fake(protocol, resuming(Fault.error_event(3, SECRET, 400), times=2))
    async with running_gateway(engine, protocol=protocol) as gw:
        r = await post(gw, "rs-filter", stream=True, max_tokens=32)
        err, _events = check_sse_error_tail(r.text)
        assert err["code"] == "invalid_request"
        assert SECRET not in r.text
        assert calls([engine], protocol, "rs-filter") == 1
        r = await post(gw, "rs-filter2", stream=False, max_tokens=32)
        check_status_error(r, 400)


def with_fallback(**model: Any) -> Callable[[Settings], None]:
    def hook(s: Settings) -> None:
        two_models(s)
        for k, v in model.items():
            setattr(s.models[MODEL], k, v)

    return hook


@STREAMS
async def test_a_cut_stream_continues_on_the_fallback_and_is_counted(
    protocol: str, stream: bool
) -> None:
    """The primary's one replica cuts the stream and its breaker opens: the candidate
    continues on the fallback model. The client's stream keeps its ids and ``model`` (it
    already named the primary); usage counts what it received; the fallback counter has the
    move under ``cause="resume"``, the resume counter under the model asked for."""
    engines = [fake(protocol, resuming(Fault.eof(3, clean=False))), fake(protocol, resuming(None))]
    async with running_gateway(
        engines, protocol=protocol, settings_hook=with_fallback(), breaker_failures=1
    ) as gw:
        name = f"rs-fb{int(stream)}"
        r = await post(gw, name, **ask(stream))
        assert r.status_code == 200, r.text
        out, reasons, usage = texts(r, stream)
        assert out == [WHOLE] and reasons == ["stop"]
        assert usage["completion_tokens"] == len(ANSWER)
        if stream:
            chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
            assert {e["model"] for e in chunks} == {MODEL}
            assert len({e["id"] for e in chunks}) == 1
        else:
            assert r.json()["model"] == MODEL
        assert calls(engines[:1], protocol, name) == 1
        # (two_models gives the fallback the engine-rendered default: count any generation)
        gens = ("/generate", "/v1/completions", "/v1/chat/completions")
        assert len([p for p, _b in engines[1].requests if p in gens]) == 1
        metrics = await scrape(gw)
        assert sample(metrics, "sieproxy_fallbacks_total", model=MODEL, cause="resume") == 1
        assert sample(metrics, "sieproxy_resumes_total", model=MODEL, cause="cut") == 1
        assert (
            sample(metrics, "sieproxy_requests_total", endpoint="chat", model=MODEL, status="200")
            == 1
        )


@STREAMS
async def test_a_cut_stream_whose_fallback_refuses_the_prefill(stream: bool) -> None:
    """Chat pass-through: the fallback's engine refuses an assistant prefill (a 400 to
    ``continue_final_message``). The honest outcome: the text so far, then the stream's clean
    error event and ``[DONE]`` (non-streaming: the error status); nothing is repeated."""
    protocol = "openai-chat"
    refuser = fake(protocol, resuming(None))
    refuser.accepts_prefill = False
    engines = [fake(protocol, resuming(Fault.eof(3, clean=False))), refuser]
    async with running_gateway(
        engines, protocol=protocol, settings_hook=with_fallback(), breaker_failures=1
    ) as gw:
        r = await post(gw, f"rs-nopre{int(stream)}", **ask(stream))
        if stream:
            err, events = check_sse_error_tail(r.text)
            text = "".join(
                e["choices"][0]["delta"].get("content") or ""
                for e in events
                if isinstance(e, dict) and e.get("choices")
            )
            assert text == "".join(ANSWER[:3])
        else:
            err = check_status_error(r, 400)
        assert err["code"] == "invalid_request"
        assert "continue_final_message" not in str(err)  # the engine's text stays upstream
        assert [calls([e], protocol, f"rs-nopre{int(stream)}") for e in engines] == [1, 1]


async def test_max_resumes_is_checked_at_start() -> None:
    from sieproxy.settings.checks import check_settings
    from sieproxy.settings.load import ConfigError

    from .harness import settings_for

    s = settings_for([1])
    s.models[MODEL].max_resumes = -1
    with pytest.raises(ConfigError, match=r"max_resumes`: must be >= 0"):
        check_settings(s, "test")


async def test_a_client_leaving_during_a_resume_aborts_everything(protocol: str) -> None:
    """The stream is cut and its continuation hangs before its first token: the client leaves;
    the continuation is aborted (once) and nothing runs any more."""
    engine = fake(protocol, resuming(Fault.eof(3, clean=False)))
    first = engine.script

    def script(call: Call) -> Plan:
        plan = first(call)
        if said(call).endswith(ANSWER[2]):  # the continuation
            return Plan(plan.tokens, ttft=60.0)
        return plan

    engine.script = script
    async with running_gateway(engine, protocol=protocol) as gw:
        with trio.move_on_after(1.0):
            await post(gw, "rs-left", stream=True, max_tokens=32)
        await settled(engine)
        assert calls([engine], protocol, "rs-left") == 2
        assert OTHER != MODEL


# ---- soak: engines killed and restarted mid-stream -----------------------------------------

LONG = [f" s{k}" for k in range(40)]


def long_answer(call: Call) -> Plan:
    """:data:`LONG` from where the request's text left it, one token per 25 ms."""
    text = said(call)
    k = max(j for j in range(len(LONG) + 1) if text.endswith("".join(LONG[:j])))
    return Plan(LONG[k:], itl=0.025)


@pytest.mark.slow
async def test_soak_streams_while_a_replica_is_killed_and_restarted(protocol: str) -> None:
    """20 concurrent streams (and 4 non-streaming requests) on two replicas; replica 0 is
    killed mid-stream (its connections cut), restarted, killed and restarted again. Every
    answer is the whole text, or a clean error event then ``[DONE]``; nothing is left running
    on either engine (no generation leaked), and the gateway still serves."""
    from .harness import _serving, settings_for

    engines = [fake(protocol, long_answer), fake(protocol, long_answer)]
    results: dict[int, Any] = {}
    whole = "".join(LONG)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            scopes: list[trio.CancelScope] = []

            async def run(e: FakeEngine, port: int, *, task_status: Any) -> None:
                with trio.CancelScope() as scope:
                    scopes.append(scope)
                    await e.serve("127.0.0.1", port, task_status=task_status)

            ports = [await nursery.start(run, e, 0) for e in engines]
            settings = settings_for(ports, protocol, breaker_failures=1000)
            settings.models[MODEL].max_resumes = 2
            async with _serving(settings, engines, True) as gw:

                async def one(k: int) -> None:
                    stream = k % 12 < 10  # 20 streams, 4 whole answers
                    r = await post(gw, f"soak{k}", stream=stream, max_tokens=64)
                    results[k] = (stream, r)

                pool = gw.state.pools[MODEL]
                async with trio.open_nursery() as clients:
                    for wave in range(2):  # each: 12 requests, replica 0 killed and restarted
                        with trio.fail_after(10):
                            while not all(r.ready for r in pool.replicas):
                                await trio.sleep(0.02)
                        for k in range(12 * wave, 12 * wave + 12):
                            clients.start_soon(one, k)
                        with trio.fail_after(10):
                            await engines[0].wait_for(lambda: len(engines[0].running) >= 3)
                        engines[0].close_listener()  # (frees the port at once)
                        scopes.pop(0).cancel()
                        await trio.sleep(0.2)
                        await nursery.start(run, engines[0], ports[0])
                        scopes.insert(0, scopes.pop())
                for k, (stream, r) in sorted(results.items()):
                    assert r.status_code in (200, 502, 503, 504), (k, r.text)
                    if r.status_code != 200:
                        check_status_error(r, r.status_code)
                        continue
                    if not stream:
                        assert r.json()["choices"][0]["message"]["content"] == whole, k
                        continue
                    events = sse_events(r.text)
                    assert events[-1] == "[DONE]", k
                    if any(isinstance(e, dict) and "error" in e for e in events):
                        check_sse_error_tail(r.text)
                    else:
                        out, _reasons, _usage = texts(r, True)
                        assert out == [whole], (k, out)
                for e in engines:
                    await settled(e)
                metrics = await scrape(gw)
                resumed = sample(metrics, "sieproxy_resumes_total", model=MODEL, cause="cut")
                assert resumed is not None and resumed >= 1
                await still_serves(gw)
            nursery.cancel_scope.cancel()
