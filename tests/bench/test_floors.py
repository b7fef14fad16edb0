"""The floor relays of the bench (``trio-pipe``, ``trio-pipe-streams``, ``hypercorn-relay``):
each must relay the engine's chat stream unchanged, several requests on one keep-alive
connection, and a client that leaves must end its generation at the engine — otherwise the
figures they add to a run would not measure a relay.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from bench.targets import FLOORS, Target, start_floor
from tests.bench.test_native_harness import Raw, _data, _post, _stats, engine, exe

__all__ = ["engine", "exe"]  # fixtures, used by name

_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
         "max_tokens": 6}


@pytest.fixture(params=sorted(FLOORS), scope="module")
def floor(request: pytest.FixtureRequest, engine: int) -> Iterator[Target]:
    t = start_floor(request.param, engine, None)
    try:
        yield t
    finally:
        t.stop()


def _stream(c: Raw) -> list[bytes]:
    c.send(_post("/v1/chat/completions", _CHAT))
    status, hdrs = c.head()
    assert status == 200
    assert hdrs.get("transfer-encoding") == "chunked"
    return c.events()


def _shape(ev: bytes) -> object:
    if ev == b"data: [DONE]":
        return ev
    (c,) = _data(ev)["choices"]
    return c["index"], c["finish_reason"], {k: len(v) for k, v in c["delta"].items()}


def test_relays_the_stream_unchanged(floor: Target, engine: int) -> None:
    direct = Raw(engine)
    via = Raw(floor.port)
    try:
        want = _stream(direct)
        got = [_stream(via) for _ in range(3)]  # one keep-alive connection
    finally:
        direct.close()
        via.close()
    assert want[-1] == b"data: [DONE]" and len(want) == 9  # role, 6 tokens, finish, [DONE]
    for evs in got:  # the text differs per request (the engine seeds it with the response id)
        assert [_shape(e) for e in evs] == [_shape(e) for e in want]


def test_a_client_that_leaves_ends_the_generation(floor: Target, engine: int) -> None:
    before = _stats(engine)
    c = Raw(floor.port)
    c.send(_post("/v1/chat/completions", {**_CHAT, "max_tokens": 100_000}))
    c.head()
    c.events(limit=2)
    c.close()
    deadline = time.monotonic() + 10
    while (st := _stats(engine))["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the engine never saw the client leave"
        time.sleep(0.02)
    assert st["running"] == before["running"]
