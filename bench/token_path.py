"""The gateway's own work per relayed token, without its system calls: one process, no sockets.

``python bench/token_path.py TOKENS`` builds a streamed chat request the way the gateway does
(``core.pipeline.build_chat`` on the bench's model profile), an ``n`` = 1 response body
(``relay.GenerationBody``) reading an engine response, and a client writer, and then relays
``TOKENS`` tokens through ``GenerationBody.ride()`` — the relay pump's step, which carries
nearly every token of a streamed ``n`` = 1 response (sieproxy/pump.py). Each step runs the
real code: the engine's HTTP/1.1 chunk framing (``core.http1``), SSE (``core.sse``), SGLang's
``/generate`` chunk (``core.upstream``), the choice and the chunk shaper (``core.choice``,
``core.merger``), the client's chunk framing (``hypercorn_io.ChunkWriter``). Only the two ends
are stand-ins: the engine connection hands out bytes recorded in SGLang's format (what the
bench's engines send), and the client connection takes every write whole. So what is measured
is exactly the Python the gateway adds to the two system calls of a relayed token.

``python -m bench token-path`` runs it under ``valgrind --tool=callgrind``, which counts the
instructions executed: the same count for the same build whatever else the machine is doing,
so two builds can be compared to a fraction of a percent where a timed run on this machine
cannot resolve 5 % (docs/BENCH-METHOD.md). Two token counts are run per build and the
difference divided by the difference in tokens, so start-up and imports cancel out.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

# The build to measure: this tree, or the one named by SIEPROXY_TREE (a revision unpacked by
# ``bench.targets.source_tree``). The harness itself is always this file.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("SIEPROXY_TREE", str(ROOT)))

import trio  # noqa: E402

from sieproxy.core.http1 import ResponseParser  # noqa: E402
from sieproxy.core.pipeline import build_chat  # noqa: E402
from sieproxy.core.sse import SSEDecoder  # noqa: E402
from sieproxy.core.upstream import GenerateReader  # noqa: E402
from sieproxy.engine_client import UpstreamResponse  # noqa: E402
from sieproxy.hypercorn_io import ChunkWriter  # noqa: E402
from sieproxy.pool import Replica, RouteHints  # noqa: E402
from sieproxy.relay import GenerationBody, RequestStats  # noqa: E402
from sieproxy.serve import build_state  # noqa: E402
from sieproxy.settings import load_settings  # noqa: E402

#: Distinct engine chunks the harness cycles through (their texts and token counts differ).
DISTINCT = 1000
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def engine_chunk(i: int) -> bytes:
    """Token ``i`` of an incremental SGLang ``/generate`` stream, as one HTTP/1.1 chunk."""
    payload = (
        b'{"text":" tok%d","output_ids":[%d],"meta_info":{"id":"rid-0","finish_reason":null,'
        b'"prompt_tokens":8,"completion_tokens":%d,"cached_tokens":0,'
        b'"weight_version":"default"}}' % (i, 1000 + i, i + 1)
    )
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(event), event)


class _Engine:
    """The engine connection's end: each read returns the next of ``DISTINCT`` recorded
    chunks, round and round (built once: how many tokens are relayed does not change the
    harness's own work, which the difference of two runs then cancels)."""

    plain = False

    def __init__(self) -> None:
        self.receive_nowait = itertools.cycle([engine_chunk(i) for i in range(DISTINCT)]).__next__


class _Client:
    """The client connection's end (what ``ChunkWriter`` writes to): takes every write whole."""

    def __init__(self) -> None:
        self.writes = 0
        self.bytes = 0
        self.last = b""

    def write_nowait(self, data: bytes) -> int:
        self.writes += 1
        self.bytes += len(data)
        self.last = data
        return len(data)


class _Stream:
    closed = False


async def relay(tokens: int, config: str) -> dict[str, Any]:
    """Relay ``tokens`` tokens through ``ride()`` (in a Trio run, as the pump does), with the
    gateway configured by the file ``config``; what the client got."""
    state = build_state(load_settings(config))
    raw = json.dumps(
        {"model": "bench-model", "stream": True, "max_tokens": 1 << 20,
         "messages": [{"role": "user", "content": "Tell me a long story #1."}]}
    ).encode()
    plan = build_chat(raw, state.profiles, request_id="r", created=1)
    body = GenerationBody(
        g=state.settings.gateway, client=state.client, pool=state.pools[plan.model],
        replica=Replica(url="http://engine", ready=True, incremental=True), hints=RouteHints(),
        bodies=plan.bodies, shaper=plan.shaper, streaming=True,
        stats=RequestStats(request_id="r", model=plan.model, endpoint="chat", n=1, stream=True),
        pump=state.pump,
    )
    body._now = trio.lowlevel.current_clock().current_time  # as __aenter__ sets it
    body._deadline = math.inf
    body._shaper.start()  # the role chunk: prime()'s work, before the loop
    body.stats.first_token_at = 0.0  # prime() counted the first token
    parser = ResponseParser()
    parser.feed(HEAD)
    client = _Client()
    out = ChunkWriter.__new__(ChunkWriter)
    out._server, out._stream, out._rest = client, _Stream(), b""  # type: ignore[assignment]
    il = body._il
    assert il is not None
    il.resp = UpstreamResponse(_Engine(), parser, b"")  # type: ignore[arg-type]
    il.reader = GenerateReader(incremental=True)
    il.decoder = SSEDecoder(state.settings.gateway.max_sse_line_bytes)
    body.carry(out)  # the response head is out: the pump may relay (as the route does)
    for _ in range(tokens):
        if not body.ride():
            raise SystemExit(f"the relay handed the stream back: {il.stash!r}")
    return {"tokens": tokens, "writes": client.writes, "bytes": client.bytes,
            "last": client.last.decode()}


_COLLECTED = re.compile(rb"== Collected : (\d+)")


def instructions(tokens: int, config: str, tree: Path | None = None) -> int:
    """The instructions ``valgrind --tool=callgrind`` counts for a whole run of this harness
    (``tree``: the build of that unpacked revision instead of this tree's)."""
    env = dict(os.environ, PYTHONHASHSEED="0")  # the same dict and set layouts every run
    if tree is not None:
        env["SIEPROXY_TREE"] = str(tree)
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         str(Path(__file__).resolve()), str(tokens), config],
        capture_output=True, env=env, cwd=tree or ROOT, check=False, timeout=3600,
    )
    got = json.loads(run.stdout.decode().strip().splitlines()[-1]) if run.returncode == 0 else {}
    found = _COLLECTED.search(run.stderr)
    if got.get("writes") != tokens or found is None:
        raise RuntimeError(f"token-path run failed (exit {run.returncode}): "
                           f"{run.stdout.decode()[-300:]} {run.stderr.decode()[-600:]}")
    return int(found.group(1))


if __name__ == "__main__":
    print(json.dumps(trio.run(relay, int(sys.argv[1]), sys.argv[2])))
