"""Anthropic's ``ping`` keep-alive on a streamed ``/v1/messages``
(``gateway.messages_ping_interval``).

The fake engine is held before its first token (or mid-stream) by a ``trio.Event`` the test
sets once it has seen the pings it waits for: nothing here sleeps hoping for a timing. Run with
the fast paths on (the relay pump carries the stream once the head is out) and off, and, for
the wait before the first token, without the wait-timer task (the reader's own cancel scope).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
import trio

from engine.fake import FakeEngine, Fault, Plan
from sieproxy.relay.timers import WaitTimer
from sieproxy.settings.load import Settings

from .harness import MODEL, running_gateway
from .test_faults import aborted_once, faulty, settled, still_serves
from .test_messages import USER, check_sequence

PATH = "/v1/messages"
LIMIT = 30
INTERVAL = 0.05  # seconds: short, so that a test sees several pings quickly


def _pinging(s: Settings) -> None:
    s.gateway.messages_ping_interval = INTERVAL


def _without_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """As where no wait-timer task runs: the reader's wait keeps its own cancel scope."""

    async def no_timer(self: WaitTimer) -> None:
        return None

    monkeypatch.setattr(WaitTimer, "run", no_timer)


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 20, "messages": USER, "stream": True, **extra}


class _Events:
    """A Messages SSE body read as it arrives: its events, in order."""

    def __init__(self) -> None:
        self.buf = ""
        self.events: list[dict[str, Any]] = []

    def feed(self, text: str) -> None:
        self.buf += text
        while "\n\n" in self.buf:
            block, self.buf = self.buf.split("\n\n", 1)
            head, _, data = block.partition("\n")
            event = json.loads(data.removeprefix("data: "))
            assert head == f"event: {event['type']}", block
            self.events.append(event)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


@pytest.mark.parametrize("with_timer", [True, False], ids=["timer-task", "cancel-scope"])
async def test_a_slow_first_token_gets_message_start_and_pings_then_the_answer(
    with_timer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not with_timer:
        _without_timer(monkeypatch)
    go = trio.Event()
    engine = FakeEngine(faulty(Plan([" a", " b", " c"], fault=Fault.hang(0, until=go))))
    async with running_gateway(engine, settings_hook=_pinging) as gw:
        assert gw.state.timer.running is with_timer
        with trio.fail_after(LIMIT):
            seen = _Events()
            async with gw.client.stream(
                "POST", PATH, json=_body(), headers={"X-Request-Id": "fault-slow"}
            ) as r:
                assert r.status_code == 200  # committed by the first keep-alive
                async for text in r.aiter_text():
                    seen.feed(text)
                    if not go.is_set() and seen.types().count("ping") >= 3:
                        assert seen.types() == ["message_start", "ping", "ping", "ping"]
                        assert engine.running == {"fault-slow-0"}  # no token yet
                        go.set()
            events = seen.events
            assert not check_sequence(events), check_sequence(events)
            start = events[0]["message"]
            assert start["usage"]["input_tokens"] == 0  # not known before the engine's output
            text = "".join(
                e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
            )
            assert text == " a b c"
            delta = events[-2]
            assert delta["usage"]["input_tokens"] > 0 and delta["usage"]["output_tokens"] == 3
            assert delta["delta"]["stop_reason"] == "end_turn"
        await settled(engine)


async def test_pings_while_the_model_is_quiet_mid_stream() -> None:
    go = trio.Event()
    plan = Plan([" a", " b", " c", " d"], fault=Fault.hang(2, until=go))
    engine = FakeEngine(faulty(plan))
    async with running_gateway(engine, settings_hook=_pinging) as gw:
        with trio.fail_after(LIMIT):
            seen = _Events()
            async with gw.client.stream(
                "POST", PATH, json=_body(), headers={"X-Request-Id": "fault-mid"}
            ) as r:
                async for text in r.aiter_text():
                    seen.feed(text)
                    if not go.is_set() and _pings_after_two_tokens(seen.types()) >= 2:
                        go.set()
            types = seen.types()
            assert types[:2] == ["message_start", "ping"]  # the one Anthropic sends
            # the keep-alives came while the engine held after its second token
            assert _pings_after_two_tokens(types) >= 2, types
            assert not check_sequence(seen.events), check_sequence(seen.events)
            text = "".join(
                e["delta"]["text"] for e in seen.events if e["type"] == "content_block_delta"
            )
            assert text == " a b c d"


def _pings_after_two_tokens(types: list[str]) -> int:
    """The pings between the second and the third token's delta (or the end)."""
    deltas = [k for k, t in enumerate(types) if t == "content_block_delta"]
    if len(deltas) < 2:
        return 0
    end = deltas[2] if len(deltas) > 2 else len(types)
    return types[deltas[1] : end].count("ping")


async def test_a_client_leaving_while_pinged_aborts_its_generation() -> None:
    engine = FakeEngine(faulty(Plan([" a"], fault=Fault.hang(0))))  # never a token
    async with running_gateway(engine, settings_hook=_pinging) as gw:
        with trio.fail_after(LIMIT):
            seen = _Events()
            async with gw.client.stream(
                "POST", PATH, json=_body(), headers={"X-Request-Id": "fault-left"}
            ) as r:
                async for text in r.aiter_text():
                    seen.feed(text)
                    if seen.types().count("ping") >= 2:
                        break
        await aborted_once(engine, ["fault-left-0"])
        await settled(engine)
        assert "fault-left-0" not in engine.finished
        await still_serves(gw)


async def test_the_sdk_takes_an_early_message_start_and_accumulates_the_answer() -> None:
    go = trio.Event()
    engine = FakeEngine(faulty(Plan(["Hel", "lo."], fault=Fault.hang(0, until=go))))
    async with running_gateway(engine, settings_hook=_pinging) as gw:
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=20)

        def stream() -> tuple[str, Any]:
            with client.messages.stream(
                model=MODEL, max_tokens=20, messages=USER,
                extra_headers={"X-Request-Id": "fault-sdk"},
            ) as s:  # fmt: skip
                events = iter(s)
                first = next(events).type  # sent before any token: the engine is held
                trio.from_thread.run_sync(go.set)
                for _ in events:
                    pass
                return first, s.get_final_message()

        with trio.fail_after(LIMIT):
            first, final = await trio.to_thread.run_sync(stream, abandon_on_cancel=True)
        assert first == "message_start"
        assert final.content[0].text == "Hello." and final.stop_reason == "end_turn"
        assert final.usage.input_tokens > 0 and final.usage.output_tokens == 2


@pytest.mark.parametrize("with_timer", [True, False], ids=["timer-task", "cancel-scope"])
async def test_a_failure_after_an_early_ping_is_an_error_event(
    with_timer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first ping committed the 200: the engine's silence past ``token_gap_timeout`` then
    ends the stream with Anthropic's ``error`` event, not a status."""
    if not with_timer:
        _without_timer(monkeypatch)

    def hook(s: Settings) -> None:
        _pinging(s)
        s.gateway.token_gap_timeout = 0.5

    engine = FakeEngine(faulty(Plan([" a"], fault=Fault.hang(0))))  # never a token
    async with running_gateway(engine, settings_hook=hook) as gw:
        with trio.fail_after(LIMIT):
            r = await gw.client.post(PATH, json=_body(), headers={"X-Request-Id": "fault-gap"})
            assert r.status_code == 200
            seen = _Events()
            seen.feed(r.text)
            types = seen.types()
            assert types[:2] == ["message_start", "ping"] and types[-1] == "error", types
            assert set(types[2:-1]) == {"ping"}
            assert seen.events[-1]["error"]["type"] == "timeout_error"
        await aborted_once(engine, ["fault-gap-0"])
