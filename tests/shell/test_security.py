"""Security properties of the gateway: secrets stay out of logs, metrics, error bodies and
engine requests; engine text never reaches clients; no request field redirects the gateway;
token comparison is constant-time; the HTTP parser is a fixed h11.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import inspect
import logging
from typing import Any

import pytest
import trio

import sieproxy.front.auth
from engine.fake import Call, DefaultScript, FakeEngine, Fault, Plan, abort_finish
from sieproxy.core.errors import AuthenticationError
from sieproxy.front.auth import Authenticator
from sieproxy.settings.load import Settings

from .harness import MODEL, host_port, no_resumes, running_gateway, sse_events

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
TOKEN = "sk-CANARY-TOKEN-7f3a9c"
WRONG = "sk-CANARY-WRONG-11b2e4"
PROMPT = "CANARY-PROMPT-5c1d"
USER = "CANARY-USER-9e8f"
SAFETY = "CANARY-SAFETY-2a7b"
CACHE_KEY = "CANARY-CACHEKEY-4d4d"
ROUTING_KEY = "CANARY-ROUTING-8c8c"
SECRET = "SECRET-ENGINE-TEXT"


def access_log_on(s: Settings) -> None:
    s.gateway.access_log = True
    s.gateway.log_level = "debug"


def record_text(rec: logging.LogRecord) -> str:
    """Everything a handler could write for ``rec``: message, args, exception, stack, extras."""
    parts = [rec.getMessage(), repr(rec.args), repr(rec.__dict__)]
    if rec.exc_info:
        parts.append(logging.Formatter().formatException(rec.exc_info))
    if rec.exc_text:
        parts.append(rec.exc_text)
    if rec.stack_info:
        parts.append(rec.stack_info)
    return "\n".join(parts)


def gateway_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    # The fake engine runs in this process too; what it logs is not the gateway's.
    return [r for r in caplog.records if not r.name.startswith("engine")]


def chat_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"say {PROMPT}"}],
        "max_tokens": 3,
    }
    body.update(extra)
    return body


def no_canary(text: str, *canaries: str) -> None:
    for c in canaries:
        assert c not in text, f"{c!r} leaked: ...{text[max(0, text.find(c) - 200) :][:400]}"


# ---- tokens --------------------------------------------------------------------------------


async def test_bearer_token_never_logged_nor_echoed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    engine = FakeEngine()
    async with running_gateway(
        engine,
        settings_hook=access_log_on,
        auth=True,
        tokens=[TOKEN],
        auth_metrics=False,
    ) as gw:
        good = {"Authorization": f"Bearer {TOKEN}"}
        bodies: list[str] = []
        with trio.fail_after(30):
            for headers in (
                good,
                {"Authorization": f"Bearer {WRONG}"},
                {"Authorization": f"Basic {TOKEN}"},
                {"Authorization": f"Bearer  {TOKEN}x"},
                {"Authorization": TOKEN},
                {},
            ):
                for stream in (False, True):
                    r = await gw.client.post(CHAT, json=chat_body(stream=stream), headers=headers)
                    bodies.append(r.text + repr(dict(r.headers)))
                    if headers is good:
                        assert r.status_code == 200
                    else:
                        assert r.status_code == 401, r.text
                        assert r.headers["www-authenticate"].startswith("Bearer")
            # an error answer for an authenticated request
            r = await gw.client.post(CHAT, json=chat_body(n=0), headers=good)
            assert r.status_code == 400
            bodies.append(r.text)
            r = await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {WRONG}"})
            assert r.status_code == 401
            bodies.append(r.text)
            metrics = (await gw.client.get("/metrics")).text
        for text in bodies:
            no_canary(text, TOKEN, WRONG)
        no_canary(metrics, TOKEN, WRONG)
        assert "sieproxy_requests" in metrics
    records = gateway_records(caplog)
    assert any(r.name == "sieproxy.access" for r in records), "the access log was on"
    for rec in records:
        no_canary(record_text(rec), TOKEN, WRONG)
    no_canary(caplog.text, TOKEN, WRONG)


# ---- user data ---------------------------------------------------------------------------------


async def test_user_data_stays_out_of_logs_metrics_errors_and_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    engine = FakeEngine()
    private = {
        "user": USER,
        "safety_identifier": SAFETY,
        "prompt_cache_key": CACHE_KEY,
    }
    async with running_gateway(engine, settings_hook=access_log_on) as gw:
        errors: list[str] = []
        with trio.fail_after(30):
            for stream in (False, True):
                r = await gw.client.post(CHAT, json=chat_body(stream=stream, **private))
                assert r.status_code == 200, r.text
                r = await gw.client.post(
                    CHAT, json=chat_body(stream=stream, routing_key=ROUTING_KEY, user=USER)
                )
                assert r.status_code == 200, r.text
                r = await gw.client.post(
                    CMPL,
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                )
                assert r.status_code == 200, r.text
            # refused requests carrying the canaries: the error bodies do not echo them
            for bad in (
                chat_body(n=0, **private),
                chat_body(temperature=-1, **private),
                chat_body(messages=[{"role": "nope", "content": PROMPT}], **private),
                chat_body(messages=[{"role": "user", "content": PROMPT, "extra": PROMPT}]),
                chat_body(user=[USER]),
                chat_body(safety_identifier={"x": SAFETY}),
                chat_body(stop=[PROMPT] * 40),
            ):
                r = await gw.client.post(CHAT, json=bad)
                assert 400 <= r.status_code < 500, r.text
                errors.append(r.text)
            metrics = (await gw.client.get("/metrics")).text
        for text in errors:
            no_canary(text, PROMPT, USER, SAFETY, CACHE_KEY)
        no_canary(metrics, PROMPT, USER, SAFETY, CACHE_KEY, ROUTING_KEY)
        # The engine got the prompt, and nothing else of the client's identity.
        generate = [b for p, b in engine.requests if p == "/generate"]
        assert generate and any(PROMPT in str(b) for b in generate)
        for b in generate:
            no_canary(repr(b), USER, SAFETY, CACHE_KEY, ROUTING_KEY)
            assert not {"user", "safety_identifier", "prompt_cache_key", "routing_key"} & set(b)
    records = gateway_records(caplog)
    assert any(r.name == "sieproxy.access" for r in records)
    for rec in records:
        text = record_text(rec)
        no_canary(text, PROMPT, SAFETY, CACHE_KEY, ROUTING_KEY)
        if rec.levelno >= logging.INFO:
            no_canary(text, USER)


# ---- engine text -------------------------------------------------------------------------------

ENGINE_FAULTS = {
    "error_event_first": Plan(["a"], fault=Fault.error_event(0, SECRET, 500)),
    "error_event_mid": Plan(["a", "b", "c"], fault=Fault.error_event(2, SECRET, 400)),
    "http_500_sglang_body": Plan(["a"], fault=Fault.http_error(500, SECRET)),
    "http_400_sglang_body": Plan(["a"], fault=Fault.http_error(400, SECRET)),
    "http_502_raw_body": Plan(["a"], fault=Fault.http_error(502, body=SECRET.encode() * 100)),
    "http_503_json_body": Plan(
        ["a"], fault=Fault.http_error(503, body=b'{"detail":"' + SECRET.encode() + b'"}')
    ),
    "abort_with_message": Plan(["a", "b"], finish=abort_finish(SECRET, 500, SECRET)),
    "abort_400_with_message": Plan([], finish=abort_finish(SECRET, 400, SECRET)),
}


@pytest.mark.parametrize("plan", list(ENGINE_FAULTS.values()), ids=list(ENGINE_FAULTS))
async def test_engine_error_text_never_reaches_client(
    plan: Plan, caplog: pytest.LogCaptureFixture
) -> None:
    def script(call: Call) -> Plan:
        return plan if call.rid.startswith("bad") else DefaultScript()(call)

    # Resumes off: the engine's error is what the client is told about (a resumed answer would
    # hide the path under test).
    async with running_gateway(FakeEngine(script=script), settings_hook=no_resumes) as gw:
        with trio.fail_after(30):
            for i, stream in enumerate((False, True)):
                r = await gw.client.post(
                    CHAT, json=chat_body(stream=stream), headers={"X-Request-Id": f"bad{i}"}
                )
                assert r.status_code != 200 or stream, r.text
                no_canary(r.text + repr(dict(r.headers)), SECRET)
                if r.status_code == 200:
                    events = sse_events(r.text)
                    assert events[-1] == "[DONE]" and "error" in events[-2]
                else:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            r = await gw.client.post(CMPL, json={"model": MODEL, "prompt": "x"}, headers={
                "X-Request-Id": "bad-cmpl"
            })  # fmt: skip
            no_canary(r.text, SECRET)
            no_canary((await gw.client.get("/metrics")).text, SECRET)


# ---- no redirection ----------------------------------------------------------------------------


class Listener:
    """A TCP listener that records whether anything connected to it."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = 0

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)

        async def handle(stream: trio.SocketStream) -> None:
            self.connections += 1
            await stream.aclose()

        await trio.serve_listeners(handle, listeners)


async def test_no_request_field_redirects_the_gateway() -> None:
    engine = FakeEngine()
    trap = Listener()
    async with trio.open_nursery() as nursery:
        await nursery.start(trap.serve)
        evil = f"http://127.0.0.1:{trap.port}"
        async with running_gateway(engine) as gw:
            with trio.fail_after(30):
                image = {"type": "image_url", "image_url": {"url": f"{evil}/cat.png"}}
                for content in (
                    [{"type": "text", "text": "look"}, image],
                    [{"type": "input_image", "image_url": f"{evil}/cat.png"}],
                    [{"type": "image_url", "image_url": {"url": f"//127.0.0.1:{trap.port}/x"}}],
                    [{"type": "image_url", "image_url": {"url": f"file:///etc/passwd#{evil}"}}],
                ):
                    r = await gw.client.post(
                        CHAT,
                        json=chat_body(messages=[{"role": "user", "content": content}]),
                    )
                    assert r.status_code == 400, r.text
                    assert r.json()["error"]["param"].startswith("messages[0].content"), r.text
                r = await gw.client.post(CHAT, json=chat_body(model=evil))
                assert r.status_code == 404, r.text
                assert r.json()["error"]["param"] == "model"
                r = await gw.client.post(CHAT, json=chat_body(lora_adapter=evil))
                assert r.status_code == 400, r.text
                for header in ("X-SIE-Pool", "X-SIE-MACHINE-PROFILE"):
                    r = await gw.client.post(CHAT, json=chat_body(), headers={header: evil})
                    assert r.status_code == 400, r.text
                r = await gw.client.post(
                    CHAT,
                    json=chat_body(),
                    headers={"Host": f"127.0.0.1:{trap.port}", "X-Forwarded-Host": evil},
                )
                assert r.status_code == 200, r.text
                # an absolute-form request target is served locally (or refused), never proxied
                host, port = host_port(gw)
                stream = await trio.open_tcp_stream(host, int(port))
                async with stream:
                    await stream.send_all(
                        f"GET {evil}/v1/models HTTP/1.1\r\nHost: 127.0.0.1:{trap.port}\r\n"
                        "Connection: close\r\n\r\n".encode()
                    )
                    got = b""
                    # (QuartTrio on Hypercorn does not close after `Connection: close`; read
                    # what arrives instead of waiting for the close)
                    with trio.move_on_after(1):
                        while chunk := await stream.receive_some(65536):
                            got += chunk
                    assert got.startswith(b"HTTP/1.1 "), got[:200]
                await trio.sleep(0.2)
            assert trap.connections == 0, "the gateway connected to a client-chosen address"
            paths = {p for p, _ in engine.requests}
            assert paths <= {"/generate", "/abort_request", "/health", "/server_info"}, paths
        nursery.cancel_scope.cancel()


# ---- auth implementation -----------------------------------------------------------------------


def test_auth_compares_digests_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    src = inspect.getsource(sieproxy.front.auth)
    assert "hmac.compare_digest" in src
    assert "==" not in inspect.getsource(Authenticator.check).split('"""', 2)[-1].replace(
        "!=", ""
    ), "no plain equality on secrets"
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(sieproxy.front.auth.hmac, "compare_digest", spy)
    tokens = [b"tok-one", b"tok-two", b"tok-three"]
    auth = Authenticator(True, tokens)
    digests = [hashlib.sha256(t).digest() for t in tokens]
    for presented, ok in ((b"tok-two", True), (b"tok-one", True), (b"nope", False)):
        calls.clear()
        if ok:
            auth.check(b"Bearer " + presented)
        else:
            with pytest.raises(AuthenticationError):
                auth.check(b"Bearer " + presented)
        # every configured digest is compared (no early exit), as 32-byte digests
        assert len(calls) == len(tokens), calls
        assert [b for _, b in calls] == digests
        assert all(a == hashlib.sha256(presented).digest() for a, _ in calls)
    # non-ASCII and odd headers are a 401, never a crash
    for raw in (b"Bearer \xff\xfe", b"bearer", b"Bearer ", b"\x00" * 10, "Bearer é".encode()):
        with pytest.raises(AuthenticationError):
            auth.check(raw)


async def test_non_ascii_authorization_header_is_401() -> None:
    async with running_gateway(FakeEngine(), auth=True, tokens=[TOKEN]) as gw:
        with trio.fail_after(10):
            r = await gw.client.post(
                CHAT,
                json=chat_body(),
                headers=[(b"Authorization", b"Bearer \xff\xfe" + TOKEN.encode())],
            )
        assert r.status_code == 401, r.text


def test_h11_is_fixed_version() -> None:
    version = importlib.metadata.version("h11")
    major, minor = (int(x) for x in version.split(".")[:2])
    assert (major, minor) >= (0, 16), f"h11 {version} is vulnerable to CVE-2025-43859"
