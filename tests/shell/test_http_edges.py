"""HTTP edges of the gateway: bodies, sizes, methods, paths, auth, ids, routing headers, 503s.

Every error answer is checked against the OpenAI envelope exactly (four keys, nothing more) and
for leaks (tracebacks, exception class names).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import h11
import httpx
import pytest
import trio

from engine.fake import FakeEngine
from sieproxy.settings.load import Settings

from .harness import (
    MODEL,
    Gateway,
    connection_tasks,
    exchange,
    host_port,
    running_gateway,
    short_keep_alive,
    sse_events,
)

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
CMPL_BODY = {"model": MODEL, "prompt": "Once", "max_tokens": 3}
JSON_CT = {"Content-Type": "application/json"}
LEAKS = re.compile(
    r"Traceback|File \"[^\"]+\", line \d+|\b[A-Z][A-Za-z]*(Error|Exception)\b|msgspec|werkzeug"
    r"|quart|hypercorn|h11\b"
)
_RID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def envelope(
    resp: httpx.Response,
    status: int,
    *,
    code: str | type[Any] | None = Any,
    param: str | type[Any] | None = Any,
    type_: str | type[Any] = Any,
) -> dict[str, Any]:
    """Assert ``resp`` is exactly OpenAI's error envelope with ``status``; return the error."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    assert not LEAKS.search(resp.text), resp.text
    body = resp.json()
    assert isinstance(body, dict) and list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if code is not Any:
        assert err["code"] == code, err
    if param is not Any:
        assert err["param"] == param, err
    if type_ is not Any:
        assert err["type"] == type_, err
    return err


# ---- bodies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, CMPL])
async def test_undecodable_bodies_are_400(path: str) -> None:
    bodies = {
        "malformed": b'{"model": "test-model", "max_tokens": 3',
        "truncated-array": b'{"model": "test-model", "stop": ["a",',
        "array": b"[]",
        "array-of-object": json.dumps([CHAT_BODY]).encode(),
        "string": b'"hello"',
        "number": b"42",
        "true": b"true",
        "null": b"null",
        "empty": b"",
    }
    async with running_gateway() as gw:
        with trio.fail_after(20):
            for name, raw in bodies.items():
                r = await gw.client.post(path, content=raw, headers=JSON_CT)
                err = envelope(r, 400, code="invalid_request", type_="invalid_request_error")
                assert err["param"] is None, (name, err)
            # Without any Content-Type the body is still read as JSON (curl -d sends
            # x-www-form-urlencoded, but a bare client may send none): an empty one is a 400.
            r = await gw.client.post(path, content=b"")
            envelope(r, 400, code="invalid_request")
        assert [p for p, _ in gw.engines[0].requests if p == "/generate"] == []


async def test_malformed_json_wins_over_field_errors() -> None:
    """A body that is not JSON at all is "not valid JSON" (invalid_request, param null), even
    when a field before the point where it breaks would be refused on its own: the client must
    fix the JSON first, and naming a field of a body that does not parse misleads it."""
    bodies = [
        b'{"model": "test-model", "foo": 1, "messages": [',
        b'{"model": "test-model", "messages": [{"role": "user", "content": "x"}], "prompt": "x"',
        b'{"model": "test-model", "n": "two", "prompt": "x", "messages": [',
        b'{"model": "test-model", "stream": 1, "x',
    ]
    wrong: list[str] = []
    async with running_gateway() as gw:
        with trio.fail_after(10):
            for path in (CHAT, CMPL):
                for raw in bodies:
                    r = await gw.client.post(path, content=raw, headers=JSON_CT)
                    err = envelope(r, 400, type_="invalid_request_error")
                    if (err["code"], err["param"]) != ("invalid_request", None):
                        wrong.append(f"{path} {raw!r}: code={err['code']} param={err['param']}")
    assert not wrong, "not reported as malformed JSON:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"]
)
async def test_wrong_content_type_is_400(ctype: str) -> None:
    async with running_gateway() as gw:
        with trio.fail_after(10):
            r = await gw.client.post(
                CHAT, content=json.dumps(CHAT_BODY).encode(), headers={"Content-Type": ctype}
            )
            envelope(r, 400, code="invalid_request", type_="invalid_request_error")
            # The right type with parameters is fine.
            r = await gw.client.post(
                CHAT,
                content=json.dumps(CHAT_BODY).encode(),
                headers={"Content-Type": "application/json; charset=utf-8"},
            )
            assert r.status_code == 200, r.text


async def test_body_over_limit_is_413_declared_and_chunked() -> None:
    limit = 2048
    async with running_gateway(max_body_bytes=limit) as gw:
        with trio.fail_after(20):
            pad = "x" * (limit + 100)
            big = json.dumps({**CHAT_BODY, "messages": [{"role": "user", "content": pad}]})
            async with _fresh(gw) as c:
                r = await c.post(CHAT, content=big.encode(), headers=JSON_CT)
            assert r.request.headers.get("content-length") == str(len(big))
            envelope(r, 413, code="request_too_large")
            async with _fresh(gw) as c:
                r = await c.post(CMPL, json={**CMPL_BODY, "prompt": pad})
            envelope(r, 413, code="request_too_large")

            async with _fresh(gw) as c:
                r = await c.post(CHAT, content=_chunked(limit * 3), headers=JSON_CT)
            assert "content-length" not in r.request.headers
            assert r.request.headers.get("transfer-encoding") == "chunked"
            envelope(r, 413, code="request_too_large")

            # Under the limit, chunked too: accepted.
            async def small() -> AsyncIterator[bytes]:
                raw = json.dumps(CHAT_BODY).encode()
                yield raw[:10]
                yield raw[10:]

            async with _fresh(gw) as c:
                r = await c.post(CHAT, content=small(), headers=JSON_CT)
            assert r.status_code == 200, r.text
            assert "transfer-encoding" in r.request.headers
        gens = [p for p, _ in gw.engines[0].requests if p == "/generate"]
        assert len(gens) == 1


def _fresh(gw: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.url, timeout=10)


async def _chunked(size: int, *, pause: float = 0.002) -> AsyncIterator[bytes]:
    """A chat body of about ``size`` bytes, uploaded slowly in 256-byte chunks."""
    yield b'{"model": "test-model", "messages": [{"role": "user", "content": "'
    for _ in range(size // 256):
        yield b"y" * 256
        await trio.sleep(pause)
    yield b'"}]}'


async def _slowly(parts: list[bytes], pause: float = 0.002) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
        await trio.sleep(pause)


@pytest.mark.parametrize("case", ["413-chunked", "413-content-length", "401-chunked"])
async def test_refused_upload_does_not_wedge_the_connection(case: str) -> None:
    """A refusal sent while the client is still uploading must leave a usable connection.

    The client keeps the connection (no ``Connection: close`` in the answer), so the next
    request on it must be answered, not left hanging.
    """
    limit = 2048

    def hook(settings: Settings) -> None:
        if case.startswith("401"):
            settings.gateway.auth = True
            settings.gateway.tokens = [TOKEN]

    size = limit * 8
    async with running_gateway(max_body_bytes=limit, settings_hook=hook) as gw, _fresh(gw) as c:
        headers = dict(JSON_CT)
        parts = [p async for p in _chunked(size, pause=0)]
        if case == "413-content-length":
            headers["Content-Length"] = str(sum(map(len, parts)))
        with trio.fail_after(10):
            r = await c.post(CHAT, content=_slowly(parts), headers=headers)
        envelope(r, int(case[:3]))
        chunked = "transfer-encoding" in r.request.headers
        assert chunked == (case != "413-content-length"), r.request.headers
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with trio.move_on_after(3) as scope:
            r = await c.post(CHAT, json=CHAT_BODY, headers=auth)
        assert not scope.cancelled_caught, (
            f"after a {case} refusal, the next request on the same keep-alive connection "
            "got no answer within 3 s (the server neither answered nor closed it)"
        )
        assert r.status_code == 200, r.text


# ---- models, methods, paths ----------------------------------------------------------------


async def test_unknown_model_is_404_with_param_model() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(10):
            r = await gw.chat(model="no-such-model")
            err = envelope(r, 404, param="model")
            assert "no-such-model" in err["message"]
            r = await gw.client.post(CMPL, json={**CMPL_BODY, "model": "no-such-model"})
            envelope(r, 404, param="model")


async def test_wrong_method_is_405_with_allow() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(10):
            for path in (CHAT, CMPL):
                for method in ("GET", "PUT", "DELETE"):
                    r = await gw.client.request(method, path)
                    envelope(r, 405)
                    assert "POST" in [m.strip() for m in r.headers["allow"].split(",")], r.headers
            r = await gw.client.post("/v1/models")
            envelope(r, 405)
            assert "GET" in r.headers["allow"]


async def test_unknown_path_is_404_envelope() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(10):
            for path in ("/v1/nope", "/", "/v1/chat/completions/extra", "/v2/chat/completions"):
                r = await gw.client.get(path)
                envelope(r, 404)
            r = await gw.client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
            envelope(r, 404)


# ---- auth --------------------------------------------------------------------------------------

TOKEN = "s3cret-token"


def _auth_on(tokens: list[str]) -> Any:
    def hook(settings: Settings) -> None:
        settings.gateway.auth = True
        settings.gateway.tokens = list(tokens)

    return hook


@pytest.fixture(autouse=True)
def _no_env_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIEPROXY_AUTH_TOKENS", raising=False)


async def test_auth_rejects_bad_credentials_with_401() -> None:
    bad_headers: dict[str, list[tuple[bytes, bytes]]] = {
        "missing": [],
        "basic": [(b"Authorization", b"Basic x")],
        "bearer-empty": [(b"Authorization", b"Bearer")],
        "wrong": [(b"Authorization", b"Bearer nope")],
        "prefix-of-right": [(b"Authorization", b"Bearer " + TOKEN[:-1].encode())],
        "non-ascii": [(b"Authorization", b"Bearer \xff\xfe")],
        "non-ascii-scheme": [(b"Authorization", b"B\xe9arer " + TOKEN.encode())],
        "token-only": [(b"Authorization", TOKEN.encode())],
    }
    async with running_gateway(settings_hook=_auth_on([TOKEN, "other"])) as gw:
        with trio.fail_after(20):
            for name, headers in bad_headers.items():
                for path, body in ((CHAT, CHAT_BODY), (CMPL, CMPL_BODY)):
                    r = await gw.client.post(
                        path, content=json.dumps(body).encode(), headers=[*headers, *_ct()]
                    )
                    assert r.status_code == 401, (name, path, r.text)
                    envelope(r, 401, type_="authentication_error")
                    assert r.headers.get("www-authenticate", "").startswith("Bearer"), name
                    assert TOKEN not in r.text
                r = await gw.client.get("/v1/models", headers=headers)
                envelope(r, 401)
                assert r.headers.get("www-authenticate", "").startswith("Bearer"), name
            # An unauthenticated request is refused before its body is even looked at.
            r = await gw.client.post(CHAT, content=b"not json", headers=_ct())
            envelope(r, 401)
            assert [p for p, _ in gw.engines[0].requests if p == "/generate"] == []

            ok = {"Authorization": f"Bearer {TOKEN}"}
            r = await gw.client.post(CHAT, json=CHAT_BODY, headers=ok)
            assert r.status_code == 200, r.text
            r = await gw.client.post(
                CHAT, json=CHAT_BODY, headers={"Authorization": "bearer other"}
            )
            assert r.status_code == 200, r.text
            r = await gw.client.post(CMPL, json=CMPL_BODY, headers=ok)
            assert r.status_code == 200, r.text
            r = await gw.client.get("/v1/models", headers=ok)
            assert r.status_code == 200, r.text
            # Health endpoints are open by default.
            assert (await gw.client.get("/healthz")).status_code == 200
            assert (await gw.client.get("/readyz")).status_code == 200


def _ct() -> list[tuple[bytes, bytes]]:
    return [(b"Content-Type", b"application/json")]


async def test_auth_health_endpoints_can_require_tokens() -> None:
    def hook(settings: Settings) -> None:
        _auth_on([TOKEN])(settings)
        settings.gateway.auth_health = True

    async with running_gateway(settings_hook=hook, wait_ready=False) as gw:
        with trio.fail_after(10):
            for path in ("/healthz", "/readyz"):
                r = await gw.client.get(path)
                envelope(r, 401)
            ok = {"Authorization": f"Bearer {TOKEN}"}
            assert (await gw.client.get("/healthz", headers=ok)).status_code == 200


async def test_auth_on_without_tokens_fails_closed() -> None:
    async with running_gateway(settings_hook=_auth_on([])) as gw:
        with trio.fail_after(10):
            for headers in ({}, {"Authorization": "Bearer anything"}):
                r = await gw.client.post(CHAT, json=CHAT_BODY, headers=headers)
                envelope(r, 500, type_="server_error")
                r = await gw.client.post(CMPL, json=CMPL_BODY, headers=headers)
                envelope(r, 500)
                r = await gw.client.get("/v1/models", headers=headers)
                envelope(r, 500)
            assert [p for p, _ in gw.engines[0].requests if p == "/generate"] == []


# ---- request ids -----------------------------------------------------------------------------


async def test_request_id_echoed_or_replaced() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(10):
            given = "req-ABC_123.x:y"
            r = await gw.client.post(CHAT, json=CHAT_BODY, headers={"X-Request-Id": given})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == given
            assert r.json()["id"] == f"chatcmpl-{given}"
            r = await gw.client.post(CMPL, json=CMPL_BODY, headers={"X-Request-Id": given + "c"})
            assert r.json()["id"] == f"cmpl-{given}c"
            # The engine saw rids derived from it.
            rids = [b["rid"] for p, b in gw.engines[0].requests if p == "/generate"]
            assert rids == [f"{given}-0", f"{given}c-0"]

            r = await gw.client.post(
                CHAT, json={**CHAT_BODY, "stream": True}, headers={"X-Request-Id": given}
            )
            events = sse_events(r.text)
            assert r.headers["x-request-id"] == given
            assert {e["id"] for e in events if isinstance(e, dict)} == {f"chatcmpl-{given}"}

            seen: set[str] = set()
            for bad in ("has spaces in it", "x" * 500, "semi;colon", 'quote"d', "a/b"):
                r = await gw.client.post(CHAT, json=CHAT_BODY, headers={"X-Request-Id": bad})
                assert r.status_code == 200, r.text
                rid = r.headers["x-request-id"]
                assert rid != bad and _RID_RE.match(rid), rid
                assert r.json()["id"] == f"chatcmpl-{rid}"
                seen.add(rid)
            assert len(seen) == 5  # fresh each time

            # Errors carry the id too.
            r = await gw.client.post(
                CHAT, json={**CHAT_BODY, "n": 0}, headers={"X-Request-Id": given}
            )
            envelope(r, 400, param="n")
            assert r.headers["x-request-id"] == given


# ---- routing headers ----------------------------------------------------------------------


async def test_routing_headers() -> None:
    engines = [FakeEngine(), FakeEngine()]
    async with running_gateway(engines) as gw:
        with trio.fail_after(20):
            for header in ("X-SIE-Pool", "X-SIE-MACHINE-PROFILE"):
                r = await gw.client.post(CHAT, json=CHAT_BODY, headers={header: "nowhere"})
                envelope(r, 400, param=header, code="invalid_request")
                r = await gw.client.post(CMPL, json=CMPL_BODY, headers={header: "nowhere"})
                envelope(r, 400, param=header)
            # A profile of one pool with the other pool: no engine carries both.
            r = await gw.client.post(
                CHAT,
                json=CHAT_BODY,
                headers={"X-SIE-Pool": "pool-1", "X-SIE-MACHINE-PROFILE": "profile-1"},
            )
            assert r.status_code == 200, r.text
            assert [p for p, _ in engines[0].requests if p == "/generate"] == []
            assert len([p for p, _ in engines[1].requests if p == "/generate"]) == 1
            for i in (0, 1):
                for e in engines:
                    e.clear_records()
                r = await gw.client.post(CHAT, json=CHAT_BODY, headers={"X-SIE-Pool": f"pool-{i}"})
                assert r.status_code == 200, r.text
                gens = [[p for p, _ in e.requests if p == "/generate"] for e in engines]
                assert [len(g) for g in gens] == [int(i == 0), int(i == 1)]
                for e in engines:
                    e.clear_records()
                r = await gw.client.post(
                    CMPL, json=CMPL_BODY, headers={"X-SIE-MACHINE-PROFILE": f"profile-{i}"}
                )
                assert r.status_code == 200, r.text
                gens = [[p for p, _ in e.requests if p == "/generate"] for e in engines]
                assert [len(g) for g in gens] == [int(i == 0), int(i == 1)]
            # The SDK version header is accepted and changes nothing.
            r = await gw.client.post(CHAT, json=CHAT_BODY, headers={"X-SIE-SDK-Version": "1.2"})
            assert r.status_code == 200


# ---- 503s ------------------------------------------------------------------------------------


async def test_no_ready_engine_is_503_with_retry_after() -> None:
    async with running_gateway(FakeEngine(healthy=False), wait_ready=False) as gw:
        with trio.fail_after(20):
            await trio.sleep(0.2)  # a few health checks
            r = await gw.client.get("/readyz")
            assert r.status_code == 503 and "retry-after" in r.headers
            for path, body in ((CHAT, CHAT_BODY), (CMPL, CMPL_BODY)):
                for stream in (False, True):
                    r = await gw.client.post(path, json={**body, "stream": stream})
                    envelope(r, 503, type_="server_error")
                    assert int(r.headers["retry-after"]) >= 1
            assert [p for p, _ in gw.engines[0].requests if p == "/generate"] == []


async def test_engine_gone_is_503_with_retry_after() -> None:
    """The only engine stops (listener and open connections gone) after the gateway saw it
    ready: requests get 503 + Retry-After, never a hang or a 500."""
    engine = FakeEngine()
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def run_engine(task_status: trio.TaskStatus[int]) -> None:
            with scope:
                await engine.serve(task_status=task_status)

        port = await nursery.start(run_engine)

        def hook(settings: Settings) -> None:
            settings.models[MODEL].engines = [f"http://127.0.0.1:{port}"]
            # Slow health checks: the requests below find the engine gone themselves.
            settings.gateway.health_interval = 30.0

        # The harness's own (idle) engine is not routed to: the hook replaces the list.
        async with running_gateway(settings_hook=hook) as gw:
            with trio.fail_after(20):
                r = await gw.chat(max_tokens=2)
                assert r.status_code == 200, r.text
                assert len([p for p, _ in engine.requests if p == "/generate"]) == 1
                engine.close_listener()  # refuse new connections
                scope.cancel()  # and drop the open ones
                for stream in (False, True, False):
                    r = await gw.chat(max_tokens=2, stream=stream)
                    envelope(r, 503, type_="server_error")
                    assert int(r.headers["retry-after"]) >= 1
                assert [p for p, _ in gw.engines[0].requests if p == "/generate"] == []


# ---- discovery ------------------------------------------------------------------------------


async def test_models_list_and_openapi() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(10):
            r = await gw.client.get("/v1/models")
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("application/json")
            body = r.json()
            assert body["object"] == "list"
            assert [m["id"] for m in body["data"]] == [MODEL]
            for m in body["data"]:
                assert m["object"] == "model"
                assert isinstance(m["created"], int)
                assert isinstance(m["owned_by"], str) and m["owned_by"]

            r = await gw.client.get("/openapi.json")
            assert r.status_code == 200
            doc = json.loads(r.content)
            assert str(doc.get("openapi", "")).startswith("3.")
            assert {CHAT, CMPL} <= set(doc["paths"])
            assert "post" in doc["paths"][CHAT] and "post" in doc["paths"][CMPL]


async def test_health_endpoints() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(10):
            r = await gw.client.get("/healthz")
            assert r.status_code == 200 and r.json() == {"status": "ok"}
            r = await gw.client.get("/readyz")
            assert r.status_code == 200
            assert r.json()["ready"] is True and r.json()["models"] == {MODEL: True}


async def _gw_errors(gw: Gateway) -> list[httpx.Response]:
    c = gw.client
    return [
        await c.post(CHAT, content=b"{", headers=JSON_CT),
        await c.post(CHAT, json={**CHAT_BODY, "temperature": "hot"}),
        await c.post(CHAT, json={**CHAT_BODY, "seed": 2**70}),
        await c.post(CHAT, content=b'{"model": "test-model", "messages": "\xff"}', headers=JSON_CT),
        await c.post(CHAT, json={**CHAT_BODY, "messages": [{"role": "user", "content": {}}]}),
        await c.post(CMPL, json={**CMPL_BODY, "prompt": {"a": 1}}),
        await c.post(CMPL, json={**CMPL_BODY, "max_tokens": 10**30}),
        await c.delete(CHAT),
        await c.get("/nope"),
    ]


async def test_error_bodies_are_bare_envelopes() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(10):
            for r in await _gw_errors(gw):
                envelope(r, r.status_code)
                assert 400 <= r.status_code < 500, r.text


# ---- the generation routes' own path -------------------------------------------------------


async def test_generation_requests_skip_quarts_request_handling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """POST on the two generation routes is answered from the ASGI scope (front/app.py), errors
    included; every other request still goes through Quart."""
    from sieproxy.front.app import GatewayApp

    seen: list[str] = []
    handle = GatewayApp.handle_request

    async def counting(self: Any, request: Any) -> Any:
        seen.append(f"{request.method} {request.path}")
        return await handle(self, request)

    monkeypatch.setattr(GatewayApp, "handle_request", counting)
    async with running_gateway() as gw:
        with trio.fail_after(20):
            seen.clear()
            r = await gw.chat()
            assert r.status_code == 200, r.text
            r = await gw.chat(stream=True, n=2)
            assert sse_events(r.text)[-1] == "[DONE]"
            r = await gw.client.post(CMPL, json={**CMPL_BODY, "stream": True})
            assert sse_events(r.text)[-1] == "[DONE]"
            envelope(await gw.chat(model="no-such-model"), 404, param="model")
            envelope(await gw.client.post(CHAT, content=b"{nope", headers=JSON_CT), 400)
            assert seen == []
            envelope(await gw.client.get(CHAT), 405)
            assert (await gw.client.get("/v1/models")).status_code == 200
            assert seen == [f"GET {CHAT}", "GET /v1/models"]


async def test_a_mounted_gateway_serves_generation_under_its_root_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under an ASGI ``root_path`` (``hypercorn --root-path``) the generation routes are matched
    as Quart matches its own: below the root path, and 404 outside it."""
    import sieproxy.operations.serve
    from sieproxy.operations.serve import hypercorn_config

    def mounted(settings: Settings) -> Any:
        cfg = hypercorn_config(settings)
        cfg.root_path = "/api"
        return cfg

    monkeypatch.setattr(sieproxy.operations.serve, "hypercorn_config", mounted)
    async with running_gateway(wait_ready=False) as gw:
        with trio.fail_after(20):
            while (await gw.client.get("/api/readyz")).status_code != 200:
                await trio.sleep(0.02)
            r = await gw.client.post("/api" + CHAT, json=CHAT_BODY)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
            r = await gw.client.post("/api" + CMPL, json={**CMPL_BODY, "stream": True})
            assert sse_events(r.text)[-1] == "[DONE]"
            envelope(await gw.client.post(CHAT, json=CHAT_BODY), 404)
            envelope(await gw.client.get("/api" + CHAT), 405)


async def test_an_unexpected_failure_before_the_response_is_a_500_envelope(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sieproxy.surfaces.chat import ChatSurface

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in planning")

    monkeypatch.setattr(ChatSurface, "prepare", broken)
    caplog.set_level("INFO", logger="sieproxy.access")

    def log_on(settings: Settings) -> None:
        settings.gateway.access_log = True

    async with running_gateway(settings_hook=log_on) as gw:
        with trio.fail_after(20):
            r = await gw.chat(stream=True)
            err = envelope(r, 500, type_="server_error")
            assert "a bug" not in err["message"]
            assert _RID_RE.match(r.headers["x-request-id"])
            assert "unhandled error" in caplog.text
            rid = r.headers["x-request-id"]
            r = await gw.client.post(CMPL, json=CMPL_BODY)  # the other route is unaffected
            assert r.status_code == 200, r.text
    # In the access log too, as every request is.
    access = [json.loads(x.getMessage()) for x in caplog.records if x.name == "sieproxy.access"]
    assert [(ln["status"], ln["error_code"]) for ln in access if ln["request_id"] == rid] == [
        (500, "internal_error")
    ]


async def test_a_client_gone_before_its_body_arrived_gets_nothing_and_costs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running_gateway() as gw:
        host, port = host_port(gw)
        with trio.fail_after(20):
            for _ in range(3):
                stream = await trio.open_tcp_stream(host, int(port))
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\""
                )
                await trio.sleep(0.05)
                await stream.aclose()
            await trio.sleep(0.1)
            assert not gw.state.active
            assert [p for p, _ in gw.engines[0].requests if p == "/generate"] == []
            r = await gw.chat()
            assert r.status_code == 200, r.text
        assert "unhandled error" not in caplog.text


async def test_a_body_that_arrives_in_pieces_is_read_whole() -> None:
    """The part of a body already queued is taken without a timer; the rest is waited for
    under the body timeout, and the request is answered as if it had arrived at once."""
    body = json.dumps(CHAT_BODY).encode()
    async with running_gateway() as gw:
        host, port = host_port(gw)
        with trio.fail_after(20):
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body[:10])
            )
            await trio.sleep(0.2)  # the gateway has read the first piece by now
            await stream.send_all(body[10:])
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="POST", target=CHAT, headers=[("Host", "x")]))
            got: list[Any] = []
            while not got or type(got[-1]) is not h11.EndOfMessage:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                else:
                    got.append(event)
            await stream.aclose()
        assert got[0].status_code == 200
        answer = json.loads(b"".join(e.data for e in got if type(e) is h11.Data))
        assert answer["object"] == "chat.completion"


async def test_a_refused_upload_leaves_no_connection_task_behind() -> None:
    """A 401 answered without reading an upload larger than Hypercorn's ASGI queue (the
    generation path reads no body before auth): the client gets the answer, and the
    connection's task ends instead of staying blocked on the full queue."""

    def hook(settings: Settings) -> None:
        settings.gateway.auth = True
        settings.gateway.tokens = [TOKEN]

    async with running_gateway(settings_hook=hook) as gw:
        host, port = host_port(gw)
        with trio.fail_after(20):
            await trio.sleep(0.1)  # the readiness client's connection settles
            before = connection_tasks()
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            got = b""
            # 200 pieces at once: far more than Hypercorn's ASGI queue of 10 messages, parsed
            # before the answer goes out
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all((b"100\r\n" + b"y" * 256 + b"\r\n") * 200)
            with contextlib.suppress(trio.BrokenResourceError):
                while data := await stream.receive_some(65536):
                    got += data
            await stream.aclose()
            assert got.startswith(b"HTTP/1.1 401 "), got[:200]
            while connection_tasks() > before:
                await trio.sleep(0.05)


# ---- keep-alive --------------------------------------------------------------------------------


@pytest.fixture
def keep_alive_1s(monkeypatch: pytest.MonkeyPatch) -> None:
    short_keep_alive(monkeypatch, 1)


async def _answered(
    sock: trio.SocketStream, method: str, path: str, body: dict[str, Any] | None = None
) -> int:
    """One request on a new connection, its whole answer read (h11 checks the framing, and
    that the connection is kept alive): the status."""
    data = b"" if body is None else json.dumps(body).encode()
    headers = [("Host", "x"), ("Content-Length", str(len(data)))]
    if body is not None:
        headers.append(("Content-Type", "application/json"))
    request = h11.Request(method=method, target=path, headers=headers)
    head, _ = await exchange(sock, h11.Connection(h11.CLIENT), request, data)
    return head.status_code


_KEPT_ALIVE = [
    ("POST", CHAT, {**CHAT_BODY, "stream": True}),
    ("POST", CMPL, CMPL_BODY),
    ("GET", "/v1/models", None),
]


@pytest.mark.parametrize(("method", "path", "body"), _KEPT_ALIVE)
async def test_a_connection_left_idle_after_a_response_is_closed_at_the_keep_alive_timeout(
    keep_alive_1s: None, method: str, path: str, body: dict[str, Any] | None
) -> None:
    """Hypercorn restarts its keep-alive timer when a response ends, from the task of the app
    that sent it, which ends in that step: the timer's new task was cancelled with it, so after
    its first answer a connection left open by its client (or by a peer that vanished without
    closing) was never closed. It is closed once the timeout passes (here 1 s)."""
    async with running_gateway() as gw:
        host, port = host_port(gw)
        with trio.fail_after(20):
            sock = await trio.open_tcp_stream(host, port)
            assert await _answered(sock, method, path, body) == 200
            t0 = trio.current_time()
            with trio.fail_after(5):
                assert await sock.receive_some(65536) == b""  # closed by the gateway
            assert trio.current_time() - t0 >= 0.7
            await sock.aclose()


async def test_a_shutdown_closes_connections_left_idle_after_a_response() -> None:
    """A stopping gateway closes kept-alive connections that are idle at once (and the ones a
    response is using when that response ends), whatever they served before."""
    async with running_gateway() as gw:
        host, port = host_port(gw)
        with trio.fail_after(20):
            socks = []
            for method, path, body in _KEPT_ALIVE:
                sock = await trio.open_tcp_stream(host, port)
                assert await _answered(sock, method, path, body) == 200
                socks.append(sock)
            gw.stop.set()
            with trio.fail_after(2):
                for sock in socks:
                    assert await sock.receive_some(65536) == b""
                    await sock.aclose()


# ---- requests HTTP/1.1 itself refuses --------------------------------------------------------

_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
_UNREADABLE = {
    "no Host": (_HEAD + b"Content-Length: 2\r\n\r\n{}", 400, "no `Host` header"),
    "two Hosts": (_HEAD + b"Host: a\r\nHost: b\r\nContent-Length: 2\r\n\r\n{}", 400, "one."),
    "bad Content-Length": (
        _HEAD + b"Host: x\r\nContent-Length: 12abc\r\n\r\n{}",
        400,
        "`Content-Length` header is not a number",
    ),
    "conflicting Content-Length": (
        _HEAD + b"Host: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        400,
        "disagree",
    ),
    "bad chunk size": (
        _HEAD + b"Host: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        400,
        "size in hexadecimal",
    ),
    "chunk longer than its size": (
        _HEAD + b"Host: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX\r\n0\r\n\r\n",
        400,
        "right after its declared size",
    ),
    "unsupported transfer coding": (
        _HEAD + b"Host: x\r\nTransfer-Encoding: gzip\r\n\r\n",
        501,
        "Only `Transfer-Encoding: chunked`",
    ),
    "oversized head": (  # still incomplete past the limit (``sieproxy serve``'s 64 KiB)
        _HEAD + b"Host: x\r\nX-Big: " + b"a" * (70 * 1024),
        431,
        "larger than the gateway's 65536-byte limit",
    ),
    "bad request line": (b"HELLO THERE\r\nHost: x\r\n\r\n", 400, "request line"),
    "bad header line": (_HEAD + b"Host: x\r\nNo Colon Here\r\n\r\n", 400, "`Name: value`"),
}


async def _refused_raw(host: str, port: int, data: bytes) -> tuple[h11.Response, bytes]:
    """Send ``data`` on a new connection; the one response to it, parsed strictly by h11, once
    the gateway has closed the connection."""
    sock = await trio.open_tcp_stream(host, port)
    async with sock:
        with contextlib.suppress(trio.BrokenResourceError):
            await sock.send_all(data)
        got = b""
        while True:
            try:
                more = await sock.receive_some(65536)
            except trio.BrokenResourceError:  # a reset after the answer (unread request bytes)
                break
            if not more:
                break
            got += more
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target=CHAT, headers=[("Host", "x")]))
    conn.receive_data(got)
    conn.receive_data(b"")
    head = conn.next_event()
    assert isinstance(head, h11.Response), got[:300]
    body = b""
    while type(event := conn.next_event()) is h11.Data:
        body += event.data
    assert type(event) is h11.EndOfMessage, event
    return head, body


@pytest.mark.parametrize("case", list(_UNREADABLE))
async def test_a_request_http_cannot_read_gets_the_envelope(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #31 (9): what h11 refuses used to get Hypercorn's empty 400. Now: h11's status,
    the error envelope saying what was wrong, JSON, and the connection closed."""
    caplog.set_level("INFO", logger="sieproxy.http")
    data, status, says = _UNREADABLE[case]
    async with running_gateway() as gw:
        host, port = host_port(gw)
        with trio.fail_after(20):
            head, body = await _refused_raw(host, port, data)
            headers = {k.lower(): v for k, v in head.headers}
            assert head.status_code == status, (head, body)
            assert headers[b"content-type"] == b"application/json"
            assert headers[b"connection"] == b"close"
            assert int(headers[b"content-length"]) == len(body)
            resp = httpx.Response(status, headers=JSON_CT, content=body)
            err = envelope(resp, status, code="invalid_request", param=None)
            assert err["type"] == "invalid_request_error"
            assert says in err["message"], err
            assert err["message"].endswith("."), err
            assert not any(c in err["message"] for c in ("bytearray", "\\r")), err
            r = await gw.chat()  # the gateway still serves
            assert r.status_code == 200, r.text
    assert f"with {status}: {err['message']}" in caplog.text
