"""The request-validation contract table (tests/contract_cases.py) through the real HTTP app.

The unit suite (tests/core/test_validate.py) checks the decoder and validators directly; here
every case is POSTed to a running gateway (Hypercorn + Quart-Trio) in front of a fake engine, so
the routing, body reading, error rendering and response writing are all in the loop. Then the
dict-bodied cases go through the official ``openai`` SDK, as a client would send them.

One gateway serves a whole table (starting one costs ~0.3 s); every mismatch is collected and
reported at once, by case id, instead of stopping at the first.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import openai
import trio

from engine.fake import DefaultScript, FakeEngine
from sieproxy.settings.load import ModelSettings, Settings
from tests.contract_cases import CASES, CHAT_CASES, COMPLETIONS_CASES, Case, body_bytes

from .harness import TEMPLATE, Gateway, running_gateway, sse_events

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ENVELOPE_KEYS = {"message", "type", "param", "code"}
# Words that would mean an exception leaked into a client-visible message.
LEAKS = re.compile(r"Traceback|Exception|[A-Z][a-z]+Error\b|msgspec|File \"[^\"]+\", line \d+")


def _add_text_model(settings: Settings) -> None:
    """Serve ``text-model`` (text only, no adapters) from the same engine(s) as test-model."""
    settings.models["text-model"] = ModelSettings(
        engines=list(settings.models["test-model"].engines), chat_template=TEMPLATE
    )


def _engine() -> FakeEngine:
    # A few tokens per candidate whatever max_new_tokens says: the table has n=128 and
    # default-max-tokens cases, and the table is about validation, not generation length.
    return FakeEngine(DefaultScript(tokens=3))


def _check_refusal(case: Case, status: int, body: Any) -> list[str]:
    problems: list[str] = []
    if status != case.status:
        problems.append(f"status {status} != {case.status}")
    if not isinstance(body, dict) or set(body) != {"error"}:
        return [*problems, f"not an error envelope: {body!r:.200}"]
    err = body["error"]
    if not isinstance(err, dict) or set(err) != ENVELOPE_KEYS:
        return [*problems, f"error keys {sorted(err) if isinstance(err, dict) else err!r}"]
    if err["type"] != "invalid_request_error":
        problems.append(f"type {err['type']!r} != 'invalid_request_error'")
    if err["code"] != case.code:
        problems.append(f"code {err['code']!r} != {case.code!r}")
    if err["param"] != case.param:
        problems.append(f"param {err['param']!r} != {case.param!r}")
    msg = err["message"]
    if not isinstance(msg, str) or not msg.strip():
        problems.append(f"message {msg!r} is not a sentence")
    elif LEAKS.search(msg):
        problems.append(f"message leaks internals: {msg!r}")
    return problems


def _check_accepted(case: Case, resp: httpx.Response) -> list[str]:
    if resp.status_code != 200:
        return [f"status {resp.status_code} != 200: {resp.text[:300]}"]
    body = case.body
    assert isinstance(body, dict)
    chat = case.endpoint == "chat"
    rid = resp.headers.get("x-request-id", "")
    want_id = ("chatcmpl-" if chat else "cmpl-") + rid
    problems: list[str] = []
    if body.get("stream"):
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            problems.append(f"stream content-type {resp.headers.get('content-type')!r}")
        try:
            events = sse_events(resp.text)
        except (AssertionError, ValueError) as exc:
            return [f"undecodable SSE ({exc!r:.100}): {resp.text[:300]!r}"]
        if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
            problems.append(f"SSE does not end with one [DONE]: {resp.text[-300:]!r}")
        chunks = [e for e in events if isinstance(e, dict)]
        if any("error" in e for e in chunks):
            problems.append(f"error event in a 200 stream: {resp.text[-300:]!r}")
        want_obj = "chat.completion.chunk" if chat else "text_completion"
        if any(e.get("object") != want_obj or e.get("id") != want_id for e in chunks):
            problems.append(f"chunk object/id not {want_obj}/{want_id}")
        n = body.get("n") or 1
        closed = sorted(
            c["index"] for e in chunks for c in e.get("choices", []) if c.get("finish_reason")
        )
        if closed != list(range(n)):
            problems.append(f"closure chunks for indexes {closed}, want 0..{n - 1}")
    else:
        data = resp.json()
        want_obj = "chat.completion" if chat else "text_completion"
        if data.get("object") != want_obj or data.get("id") != want_id:
            problems.append(f"object/id {data.get('object')}/{data.get('id')}")
        n = body.get("n") or 1  # best_of candidates beyond n are never returned
        choices = data.get("choices", [])
        if [c.get("index") for c in choices] != list(range(n)):
            problems.append(f"choice indexes {[c.get('index') for c in choices]} != 0..{n - 1}")
        if any(not c.get("finish_reason") for c in choices):
            problems.append("a choice without finish_reason")
        usage = data.get("usage") or {}
        if usage.get("total_tokens") != usage.get("prompt_tokens", 0) + usage.get(
            "completion_tokens", 0
        ):
            problems.append(f"usage does not add up: {usage}")
    return problems


async def _post_case(gw: Gateway, case: Case) -> tuple[int, Any, httpx.Response]:
    resp = await gw.client.post(
        PATHS[case.endpoint],
        content=body_bytes(case),
        headers={"Content-Type": "application/json"},
    )
    try:
        parsed = (
            resp.json()
            if not resp.headers.get("content-type", "").startswith("text/event-stream")
            else None
        )
    except ValueError:
        parsed = None
    return resp.status_code, parsed, resp


async def _run_table(cases: list[Case]) -> tuple[list[str], int]:
    failures: list[str] = []
    async with running_gateway(_engine(), settings_hook=_add_text_model) as gw:
        with trio.fail_after(90):
            for case in cases:
                status, parsed, resp = await _post_case(gw, case)
                if case.status == 200:
                    problems = _check_accepted(case, resp)
                else:
                    problems = _check_refusal(case, status, parsed)
                failures += [f"{case.id}: {p}" for p in problems]
                if resp.status_code >= 400 and "x-request-id" not in resp.headers:
                    failures.append(f"{case.id}: error answer without X-Request-Id")
        # Every refusal was decided before any engine work: only accepted cases reached it.
        engine = gw.engines[0]
        generated = [b for path, b in engine.requests if path == "/generate"]
        accepted = [c for c in cases if c.status == 200]
        want = sum(_candidates(c) for c in accepted)
        if len(generated) != want:
            failures.append(f"engine saw {len(generated)} /generate requests, expected {want}")
    return failures, len(cases)


def _candidates(case: Case) -> int:
    assert isinstance(case.body, dict)
    return case.body.get("best_of") or case.body.get("n") or 1


async def test_chat_table_over_http() -> None:
    failures, ran = await _run_table(CHAT_CASES)
    print(f"{ran} chat cases over HTTP")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


async def test_completions_table_over_http() -> None:
    failures, ran = await _run_table(COMPLETIONS_CASES)
    print(f"{ran} completions cases over HTTP")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


def test_table_covers_both_endpoints() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    assert {c.endpoint for c in CASES} == {"chat", "completions"}
    assert all(c.status in (200, 400) for c in CASES)


# ---- the same table through the official SDK ---------------------------------------------------

_CHAT_ARGS = {"messages", "model"}
_COMPLETION_ARGS = {"model", "prompt"}
_SDK_ONLY_TRANSPORT = {"extra_headers", "extra_query", "extra_body", "timeout"}


def _known_params(method: Callable[..., Any]) -> set[str]:
    names = set(inspect.signature(method).parameters) - {"self"}
    return names - _SDK_ONLY_TRANSPORT


def _sdk_call(client: openai.OpenAI, case: Case) -> tuple[Callable[..., Any], dict[str, Any]]:
    assert isinstance(case.body, dict)
    if case.endpoint == "chat":
        method: Callable[..., Any] = client.chat.completions.create
        required = _CHAT_ARGS
    else:
        method = client.completions.create
        required = _COMPLETION_ARGS
    known = _known_params(method)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in case.body.items():
        (kwargs if key in known else extra)[key] = value
    for key in required:
        # A body that lacks a required argument: the SDK's "not given" sentinel drops it.
        kwargs.setdefault(key, openai.NOT_GIVEN)
    if extra:
        kwargs["extra_body"] = extra
    return method, kwargs


def _run_sdk_table(url: str, cases: list[Case]) -> tuple[list[str], int, int]:
    """Runs in a worker thread (the SDK is synchronous); returns (failures, ran, skipped)."""
    sent: list[bytes] = []

    def record(request: httpx.Request) -> None:
        sent.append(request.read())

    http = httpx.Client(event_hooks={"request": [record]}, timeout=30)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http)
    failures: list[str] = []
    ran = skipped = 0
    try:
        for case in cases:
            if isinstance(case.body, bytes):
                skipped += 1  # raw bytes test the decoder; the SDK always sends valid JSON
                continue
            method, kwargs = _sdk_call(client, case)
            sent.clear()
            outcome: Any
            try:
                result = method(**kwargs)
                if case.body.get("stream"):
                    outcome = list(result)
                else:
                    outcome = result
            except openai.APIStatusError as exc:
                outcome = exc
            except openai.APIError as exc:  # connection problems, undecodable stream events
                failures.append(f"{case.id}: SDK error {type(exc).__name__}: {exc}")
                ran += 1
                continue
            # The SDK must have sent the body as the table wrote it; else it is not this case.
            if not sent or json.loads(sent[0]) != json.loads(body_bytes(case)):
                failures.append(f"{case.id}: the SDK sent {sent[:1]!r:.300}, not the case body")
                ran += 1
                continue
            ran += 1
            failures += [f"{case.id}: {p}" for p in _check_sdk_outcome(case, outcome)]
    finally:
        client.close()
    return failures, ran, skipped


def _check_sdk_outcome(case: Case, outcome: Any) -> list[str]:
    if case.status == 200:
        if isinstance(outcome, openai.APIStatusError):
            return [f"SDK raised {type(outcome).__name__} {outcome.status_code}: {outcome.body}"]
        assert isinstance(case.body, dict)
        n = case.body.get("n") or 1
        if case.body.get("stream"):
            chunks = outcome
            closed = sorted(c.index for ch in chunks for c in ch.choices if c.finish_reason)
            if closed != list(range(n)):
                return [f"SDK stream closed indexes {closed}"]
            return []
        if [c.index for c in outcome.choices] != list(range(n)):
            return [f"SDK choices {[c.index for c in outcome.choices]}"]
        return []
    want: type[openai.APIStatusError] = (
        openai.NotFoundError if case.status == 404 else openai.BadRequestError
    )
    if not isinstance(outcome, want):
        return [f"SDK outcome {type(outcome).__name__}, want {want.__name__}"]
    problems = []
    body = outcome.body if isinstance(outcome.body, dict) else {}
    if outcome.code != case.code:
        problems.append(f"SDK .code {outcome.code!r} != {case.code!r}")
    if outcome.param != case.param or body.get("param") != case.param:
        problems.append(f"SDK .param {outcome.param!r} / body {body.get('param')!r}")
    if outcome.type != "invalid_request_error":
        problems.append(f"SDK .type {outcome.type!r}")
    return problems


async def _sdk_table(cases: list[Case]) -> tuple[list[str], int, int]:
    async with running_gateway(_engine(), settings_hook=_add_text_model) as gw:
        with trio.fail_after(90):
            return await trio.to_thread.run_sync(
                _run_sdk_table, gw.url, cases, abandon_on_cancel=True
            )


async def test_chat_table_through_openai_sdk() -> None:
    failures, ran, skipped = await _sdk_table(CHAT_CASES)
    print(f"openai SDK: {ran} chat cases ran, {skipped} raw-bytes cases skipped")
    assert ran == sum(isinstance(c.body, dict) for c in CHAT_CASES)
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


async def test_completions_table_through_openai_sdk() -> None:
    failures, ran, skipped = await _sdk_table(COMPLETIONS_CASES)
    print(f"openai SDK: {ran} completions cases ran, {skipped} raw-bytes cases skipped")
    assert ran == sum(isinstance(c.body, dict) for c in COMPLETIONS_CASES)
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)
