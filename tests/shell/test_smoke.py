from __future__ import annotations

from .harness import running_gateway, sse_events


async def test_chat_non_streaming() -> None:
    async with running_gateway() as gw:
        r = await gw.chat(max_tokens=5)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["id"] == "chatcmpl-" + r.headers["x-request-id"]
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 5


async def test_chat_streaming_n4() -> None:
    async with running_gateway() as gw:
        r = await gw.chat(max_tokens=5, n=4, stream=True, stream_options={"include_usage": True})
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        roles = [e["choices"][0]["index"] for e in events[:4]]
        assert roles == [0, 1, 2, 3]
        assert events[-2]["choices"] == []
        assert events[-2]["usage"]["completion_tokens"] == 20
