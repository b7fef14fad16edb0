"""The gateway's own work per relayed token, without its system calls: one process, no sockets.

``python bench/token_path.py TOKENS`` builds a streamed chat request the way the gateway does
(the chat surface's ``prepare`` on the bench's model profile), an ``n`` = 1 response body
(``relay.GenerationBody``) reading an engine response, and a client writer, and then relays
``TOKENS`` tokens through ``InlineReader.ride()`` — the relay pump's step, which carries
nearly every token of a streamed ``n`` = 1 response (sieproxy/relay/pump.py). Each step runs the
real code: the engine's HTTP/1.1 chunk framing (``core.http1``), SSE (``core.sse``), SGLang's
``/generate`` chunk (``core.sglang``), the choice and the chunk shaper (``core.choice``,
``core.merger``), the client's chunk framing (``hypercorn_io.ChunkWriter``). Only the two ends
are stand-ins: the engine connection hands out bytes recorded in SGLang's format (what the
bench's engines send), and the client connection takes every write whole. So what is measured
is exactly the Python the gateway adds to the two system calls of a relayed token.

``python -m bench token-path`` runs it under ``valgrind --tool=callgrind``, which counts the
instructions executed: the same count for the same build whatever else the machine is doing,
so two builds can be compared to a fraction of a percent where a timed run on this machine
cannot resolve 5 % (docs/BENCH-METHOD.md). Two token counts are run per build and the
difference divided by the difference in tokens, so start-up and imports cancel out.

``python -m bench token-path --streams 1,256,1000`` times the same step instead, with the
tokens dealt in turn to that many streams (``python bench/token_path.py TOKENS CONFIG
STREAMS``, one process per run): the instructions are the same whatever the number of streams,
but each token touches its own stream's objects, which the other streams' tokens have pushed
out of the processor's caches since. Each number of streams is measured against the first in
the same round, as every timed figure of the bench is.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The build to measure: this tree, or the one named by SIEPROXY_TREE (a revision unpacked by
# ``bench.targets.source_tree``). The harness itself is always this file.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("SIEPROXY_TREE", str(ROOT)))

import trio  # noqa: E402

try:  # the layer packages (sieproxy/surfaces, front, relay, fleet, ...)
    from sieproxy.core.upstream.http1 import ResponseParser
    from sieproxy.core.upstream.sglang import NativeReader
    from sieproxy.core.upstream.sse import SSEDecoder
    from sieproxy.fleet.client import UpstreamResponse
    from sieproxy.fleet.pool import Replica, RouteHints
    from sieproxy.front.hypercorn_io import ChunkWriter
    from sieproxy.operations.serve import build_state
    from sieproxy.relay.body import GenerationBody, RequestStats
    from sieproxy.settings.load import load_settings
    from sieproxy.surfaces import CHAT

    build_chat = CHAT.prepare
except ImportError:  # a revision before them: modules side by side
    from sieproxy.core.http1 import ResponseParser  # type: ignore[no-redef]
    from sieproxy.core.pipeline import build_chat  # type: ignore[no-redef]
    from sieproxy.core.sse import SSEDecoder  # type: ignore[no-redef]
    from sieproxy.engine_client import UpstreamResponse  # type: ignore[no-redef]
    from sieproxy.hypercorn_io import ChunkWriter  # type: ignore[no-redef]
    from sieproxy.pool import Replica, RouteHints  # type: ignore[no-redef]
    from sieproxy.serve import build_state  # type: ignore[no-redef]

    from sieproxy.relay import GenerationBody, RequestStats  # type: ignore[no-redef]
    from sieproxy.settings import load_settings  # type: ignore[no-redef]

    try:  # the SGLang protocol's reader (``core.sglang``)
        from sieproxy.core.sglang import NativeReader  # type: ignore[no-redef]
    except ImportError:  # a revision before the protocol seam: reader and decoder apart
        NativeReader = None  # type: ignore[assignment,misc]
        from sieproxy.core.upstream import GenerateReader  # type: ignore[import-not-found]

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


def _stream(state: Any, k: int) -> tuple[Any, _Client]:
    """Stream ``k``: a streamed chat's response body, primed and carried by the pump (as the
    route leaves it), reading ``_Engine``'s chunks and writing to its own ``_Client``; what the
    pump calls ``ride()`` on (the inline reader; in revisions before ``sieproxy/relay/inline.py``,
    the body itself). Written for both shapes, so ``--against`` can count older revisions."""
    raw = json.dumps(
        {"model": "bench-model", "stream": True, "max_tokens": 1 << 20,
         "messages": [{"role": "user", "content": f"Tell me a long story #{k + 1}."}]}
    ).encode()
    rid = "r" if k == 0 else f"r{k}"
    plan = build_chat(raw, state.profiles, request_id=rid, created=1)
    body = GenerationBody(
        g=state.settings.gateway, client=state.client, pool=state.pools[plan.model],
        replica=Replica(url="http://engine", ready=True, incremental=True), hints=RouteHints(),
        bodies=plan.bodies, shaper=plan.shaper, streaming=True,
        stats=RequestStats(request_id=rid, model=plan.model, endpoint="chat", n=1, stream=True),
        pump=state.pump,
    )
    clock = trio.lowlevel.current_clock().current_time  # as __aenter__ sets it
    body._now, body._deadline = clock, math.inf
    # The role chunk: prime()'s work, before the loop (the shaper is the merger's since
    # sieproxy/relay/merge.py, the body's before).
    (body._m.shaper if hasattr(body, "_m") else body._shaper).start()
    body.stats.first_token_at = 0.0  # prime() counted the first token
    parser = ResponseParser()
    parser.feed(HEAD)
    client = _Client()
    out = ChunkWriter.__new__(ChunkWriter)
    out._server, out._stream, out._rest = client, _Stream(), b""  # type: ignore[assignment]
    il = body._il
    assert il is not None
    if hasattr(il, "ride"):  # sieproxy/relay/inline.py: the reader keeps its own clock and deadline
        il.clock, il.deadline = clock, math.inf
    il.resp = UpstreamResponse(_Engine(), parser, b"")  # type: ignore[arg-type]
    max_line = state.settings.gateway.max_sse_line_bytes
    if NativeReader is not None:
        il.reader = NativeReader(incremental=True, max_line=max_line)
    else:
        il.reader = GenerateReader(incremental=True)
        il.decoder = SSEDecoder(max_line)  # type: ignore[attr-defined]
    body.carry(out)  # the response head is out: the pump may relay (as the route does)
    return (il if hasattr(il, "ride") else body), client


async def relay(
    tokens: int, config: str, streams: int = 1, freeze: bool = False
) -> dict[str, Any]:
    """Relay ``tokens`` tokens through ``ride()`` (in a Trio run, as the pump does), with the
    gateway configured by the file ``config``; what the clients got. With ``streams`` > 1 the
    tokens go to that many streams in turn (token ``i`` to stream ``i % streams``), as the
    pump relays interleaved streams. ``freeze``: the objects made before the loop are frozen
    out of the garbage collector's scans (as ``serve.tune_gc`` freezes the app's), so that
    between timed runs only the number of streams differs. ``seconds``: the loop's wall
    time."""
    state = build_state(load_settings(config))
    made = [_stream(state, k) for k in range(streams)]
    if freeze:
        gc.collect()
        gc.freeze()
    riders = [rider for rider, _ in made]
    start = time.perf_counter()
    for rider in itertools.islice(itertools.cycle(riders), tokens):
        if not rider.ride():
            stash = getattr(rider, "stash", None) or rider._il.stash
            raise SystemExit(f"the relay handed the stream back: {stash!r}")
    seconds = time.perf_counter() - start
    clients = [client for _, client in made]
    last = clients[(tokens - 1) % streams].last
    return {"tokens": tokens, "writes": sum(c.writes for c in clients),
            "bytes": sum(c.bytes for c in clients), "last": last.decode(), "seconds": seconds}


_COLLECTED = re.compile(rb"== Collected : (\d+)")


def _run(tokens: int, config: str, extra: list[str], tree: Path | None = None,
         counted: bool = False) -> tuple[dict[str, Any], int]:
    """One run of this harness in a process of its own (``tree``: the build of that unpacked
    revision instead of this tree's; ``counted``: under callgrind): its report, and the
    instructions callgrind counted (0 if not ``counted``). Raises if it did not relay every
    token."""
    env = dict(os.environ, PYTHONHASHSEED="0")  # the same dict and set layouts every run
    if tree is not None:
        env["SIEPROXY_TREE"] = str(tree)
    prefix = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"] if counted else []
    run = subprocess.run(
        [*prefix, sys.executable, str(Path(__file__).resolve()), str(tokens), config, *extra],
        capture_output=True, env=env, cwd=tree or ROOT, check=False, timeout=3600,
    )
    got = json.loads(run.stdout.decode().strip().splitlines()[-1]) if run.returncode == 0 else {}
    found = _COLLECTED.search(run.stderr)
    if got.get("writes") != tokens or (counted and found is None):
        raise RuntimeError(f"token-path run failed (exit {run.returncode}): "
                           f"{run.stdout.decode()[-300:]} {run.stderr.decode()[-600:]}")
    return got, int(found.group(1)) if counted and found is not None else 0


def instructions(tokens: int, config: str, tree: Path | None = None) -> int:
    """The instructions ``valgrind --tool=callgrind`` counts for a whole run of this harness
    (``tree``: the build of that unpacked revision instead of this tree's)."""
    return _run(tokens, config, [], tree, counted=True)[1]


def interleaved(tokens: int, config: str, streams: int) -> float:
    """Microseconds of wall time per token for ``tokens`` tokens relayed over ``streams``
    interleaved streams, in a process of its own (timed, not counted: how the same Python
    costs more as the streams whose objects it touches in turn grow in number)."""
    got, _ = _run(tokens, config, [str(streams)])
    return float(got["seconds"]) / tokens * 1e6


if __name__ == "__main__":
    # TOKENS CONFIG [STREAMS]: with STREAMS, the timed run of ``interleaved``.
    n_streams = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    print(json.dumps(trio.run(relay, int(sys.argv[1]), sys.argv[2], n_streams, len(sys.argv) > 3)))
