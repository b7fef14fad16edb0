"""``bench serve``'s client against tiny in-test servers: Anthropic Messages and OpenAI streams,
errors by kind, authentication headers, and TLS (a trustme CA)."""

from __future__ import annotations

import json
import ssl
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme

from bench.__main__ import build_parser
from bench.serve import cli, client
from bench.serve.metrics import RequestRecord
from tests.bench.sse_server import Reply, Server, chat_stream, messages_stream, sse


def test_endpoint_urls() -> None:
    assert client.endpoint_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"
    assert client.endpoint_url("http://h:1/v1/", "completions") == "http://h:1/v1/completions"
    assert client.endpoint_url("https://h/api/v1", "messages") == "https://h/api/v1/messages"
    assert client.endpoint_url("https://h/proxy", "chat") == "https://h/proxy/v1/chat/completions"
    assert client.metrics_url("https://h:8443/v1") == "https://h:8443/metrics"


def test_request_bodies() -> None:
    hist = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    chat = client.Endpoint("chat", "u", "m", extra_body={"temperature": 0}).body("S", hist, 7)
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "S"}, *hist],
                    "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0}
    comp = client.Endpoint("completions", "u", "m", ignore_eos=True).body(None, hist, 7)
    assert comp["prompt"] == "a\n\nb\n\nc" and comp["ignore_eos"] is True
    msg = client.Endpoint("messages", "u", "m").body("S", hist, 7)
    assert msg == {"model": "m", "max_tokens": 7, "messages": hist, "stream": True,
                   "system": "S"}


async def _one(ep: client.Endpoint, verify: Any = True) -> tuple[RequestRecord, str]:
    rec = RequestRecord(index=0, conversation=0, turn=0, scheduled_s=0.0, start_s=0.0)
    async with httpx.AsyncClient(verify=verify) as c:
        text = await client.send(c, ep, rec, time.perf_counter(), "sys",
                                 [{"role": "user", "content": "hi"}], 5)
    return rec, text


async def test_an_anthropic_messages_stream_is_timed_and_counted() -> None:
    srv = Server(lambda s: messages_stream(["Hel", "lo", ",", " wor", "ld"], itl=0.02))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            port = await n.start(srv.serve)
            ep = client.Endpoint("messages", f"http://127.0.0.1:{port}/v1/messages", "claude",
                                 headers=client.auth_headers("messages", "sk-ant"))
            rec, text = await _one(ep)
            n.cancel_scope.cancel()
    assert rec.ok, rec.error_detail
    assert text == "Hello, world"
    assert rec.chunks == 5 and len(rec.itl_ms) == 4
    assert all(g >= 15.0 for g in rec.itl_ms)  # the server paced its deltas 20 ms apart
    assert rec.ttft_ms is not None and rec.e2e_ms is not None and rec.e2e_ms >= rec.ttft_ms
    assert (rec.input_tokens, rec.output_tokens, rec.tokens_source) == (12, 5, "usage")
    seen = srv.seen[0]
    assert seen.path == "/v1/messages" and seen.body["system"] == "sys"
    assert seen.headers["x-api-key"] == "sk-ant"
    assert seen.headers["anthropic-version"] == client.ANTHROPIC_VERSION


@pytest.mark.parametrize(("reply", "kind", "status"), [
    (Reply(status=429, body=b'{"error": {"message": "slow down"}}'), "http_429", 429),
    (Reply(events=[(0.0, sse({"choices": [{"delta": {"content": "a"}}]})),
                   (0.0, sse({"error": {"message": "engine died"}}))]), "stream_error", 200),
    (chat_stream(["a", "b"], itl=0.0, done=False), "protocol", 200),
    (Reply(events=[(0.0, b"data: {not json\n\n")]), "protocol", 200),
    (Reply(events=[(0.0, b"data: [DONE]\n\n")]), "empty", 200),
])
async def test_failures_are_counted_by_kind(reply: Reply, kind: str, status: int) -> None:
    srv = Server(lambda s: reply)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            port = await n.start(srv.serve)
            rec, text = await _one(client.Endpoint("chat", f"http://127.0.0.1:{port}/v1/chat/"
                                                   "completions", "m"))
            n.cancel_scope.cancel()
    assert (rec.error, rec.status, text) == (kind, status, "")
    assert rec.end_s >= rec.start_s


async def test_messages_error_event_and_refused_connection() -> None:
    srv = Server(lambda s: Reply(events=[(0.0, sse({"type": "error", "error": {
        "type": "overloaded_error", "message": "Overloaded"}}, "error"))]))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            port = await n.start(srv.serve)
            rec, _ = await _one(client.Endpoint("messages", f"http://127.0.0.1:{port}/v1/"
                                                "messages", "m"))
            n.cancel_scope.cancel()
    assert (rec.error, rec.error_detail) == ("stream_error", "Overloaded")
    with trio.fail_after(20):
        rec, _ = await _one(client.Endpoint("chat", f"http://127.0.0.1:{port}/v1/x", "m"))
    assert rec.error == "connection"


async def test_tls_with_a_ca_file_or_insecure(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    srv = Server(lambda s: chat_stream(["x", "y"]), tls=server_ctx)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            port = await n.start(srv.serve)
            ep = client.Endpoint("chat", f"https://127.0.0.1:{port}/v1/chat/completions", "m")
            trusted, _ = await _one(ep, client.tls_verify(False, str(ca_file)))
            untrusted, _ = await _one(ep, client.tls_verify(False, None))
            insecure, _ = await _one(ep, client.tls_verify(True, None))
            n.cancel_scope.cancel()
    assert trusted.ok and insecure.ok, (trusted.error_detail, insecure.error_detail)
    assert trusted.output_tokens == 2
    assert untrusted.error == "tls", untrusted.error_detail


async def test_the_command_uses_the_environment_key_and_headers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``bench serve --endpoint messages`` end to end against a Messages server: the key from
    $ANTHROPIC_API_KEY, a custom header, two-turn conversations resending their history."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-env")
    srv = Server(lambda s: messages_stream(["one ", "two"], itl=0.0))
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            port = await n.start(srv.serve)
            a = build_parser().parse_args([
                "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "claude-x",
                "--endpoint", "messages", "--header", "X-Team: perf", "--workload",
                "multi-turn", "--turns", "2", "--num-requests", "8", "--concurrency", "2",
                "--input-len", "4", "--results-dir", str(tmp_path / "out")])
            rc = await trio.to_thread.run_sync(cli.main, a)
            n.cancel_scope.cancel()
    assert rc == 0
    msgs = [s for s in srv.seen if s.path == "/v1/messages"]
    assert len(msgs) == 8
    assert {s.headers["x-api-key"] for s in msgs} == {"sk-env"}
    assert {s.headers["x-team"] for s in msgs} == {"perf"}
    # each client runs its conversations' two turns in order, the second resending the first
    # and the reply received; the last conversations may be cut by the bound of 8 requests
    firsts = [s.body["messages"] for s in msgs if len(s.body["messages"]) == 1]
    seconds = [s.body["messages"] for s in msgs if len(s.body["messages"]) == 3]
    assert len(firsts) + len(seconds) == 8 and len(firsts) - len(seconds) in (0, 1, 2)
    for m in seconds:
        assert [m[0]] in firsts and m[1] == {"role": "assistant", "content": "one two"}
        assert m[2]["role"] == "user" and m[2] != m[0]
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "sk-env" not in json.dumps(doc) and doc["config"]["api_key_set"] is True
    assert doc["points"][0]["figures"]["completed"] == 8
    assert doc["points"][0]["server_metrics"]["available"] is False  # /metrics: 404 here
