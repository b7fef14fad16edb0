"""KV-cache events published the way SGLang and vLLM publish them (``--kv-events-config``).

Configuration: the JSON of SGLang's ``--kv-events-config`` — ``publisher`` (``"zmq"``, or
``"null"``: off), ``endpoint`` (default ``tcp://*:5557``), ``replay_endpoint`` (none by
default), ``topic`` (``""``), ``buffer_steps`` (batches kept for replay, 10,000), ``hwm`` (the
PUB socket's high-water mark, 100,000). As in SGLang, an endpoint with a wildcard (``*``,
``::``) or an ``ipc://`` one is bound, any other connected to. ``tcp://127.0.0.1:*`` binds a free
port; :attr:`KVEventPublisher.endpoint` then says which (the CPU engine reports both endpoints
in ``/server_info``'s ``kv_events_config``).

Wire: each batch ``[ts, [event, ...]]`` is msgpack-encoded and sent as ``[topic, sequence (8
bytes big-endian, from 0), payload]``; events are SGLang's positional records
``["BlockStored", [hash], parent hash or None, token ids, block size, lora id]``,
``["BlockRemoved", [hash, ...]]``, ``["AllBlocksCleared"]``. The replay socket (ROUTER) answers
``[b"", start]`` with ``[b"", sequence, payload]`` per buffered batch from ``start`` on, then
``[b"", -1, b""]``.

A thread owns both sockets: :meth:`KVEventPublisher.publish` only queues, from any thread.
For tests the publisher can be told to lose batches (:meth:`skip`: sequence numbers that are
never sent; ``replayable`` keeps them for the replay), to restart (:meth:`restart`: sequence
back to 0, replay buffer emptied) and to fall silent (:attr:`silent`).
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import time
from typing import Any

import msgspec
import zmq

__all__ = ["KVEventPublisher", "parse_kv_events_config"]

log = logging.getLogger("engine.kv_events")

_END = (-1).to_bytes(8, "big", signed=True)
_DEFAULTS: dict[str, Any] = {
    "publisher": "null",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "topic": "",
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
}


def parse_kv_events_config(text: str | None) -> dict[str, Any] | None:
    """The ``--kv-events-config`` JSON with its defaults; None when events are off."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config is a JSON object")
    unknown = set(raw) - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown keys {sorted(unknown)}")
    conf = {**_DEFAULTS, **raw}
    if conf["publisher"] not in ("zmq", "null"):
        raise ValueError('--kv-events-config: publisher is "zmq" or "null"')
    return conf if conf["publisher"] == "zmq" else None


def _bind_or_connect(sock: zmq.Socket[bytes], endpoint: str) -> str:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)
    sock.connect(endpoint)
    return endpoint


class KVEventPublisher:
    def __init__(self, conf: dict[str, Any]) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, int(conf["hwm"]))
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind_or_connect(self._pub, conf["endpoint"])
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if conf.get("replay_endpoint"):
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(conf["replay_endpoint"])
            last = self._replay.getsockopt(zmq.LAST_ENDPOINT)
            self.replay_endpoint = last.decode() if isinstance(last, bytes) else str(last)
        self._topic = str(conf["topic"]).encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=int(conf["buffer_steps"])
        )
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(int(conf["max_queue_size"]))
        self._enc = msgspec.msgpack.Encoder()
        self._seq = 0
        self._lose, self._lose_replayable = 0, False
        self.silent = False  # tests: publish nothing (batches are dropped, not numbered)
        self.published = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    def config_json(self) -> str:
        """The effective configuration, with the endpoints as bound (for ``/server_info``)."""
        return json.dumps(
            {
                "publisher": "zmq",
                "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint,
                "topic": self._topic.decode(),
            }
        )

    # -- any thread
    def publish(self, events: list[Any]) -> None:
        """Queue one batch of events (dropped when the queue is full, as a lost batch)."""
        if events and not self.silent:
            try:
                self._queue.put_nowait(("batch", events))
            except queue.Full:
                log.warning("KV-event queue full: a batch is lost")

    def skip(self, n: int = 1, *, replayable: bool = False) -> None:
        """Tests: the next ``n`` batches are numbered but never sent (kept for the replay if
        ``replayable``)."""
        self._queue.put(("skip", (n, replayable)))

    def restart(self) -> None:
        """Tests: behave as a new engine process (sequence from 0, empty replay buffer)."""
        self._queue.put(("restart", None))

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything queued so far was sent."""
        done = threading.Event()
        self._queue.put(("mark", done))
        done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(2.0)
        self._ctx.destroy(linger=0)

    # -- the thread
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            kind, arg = item
            try:
                if kind == "batch":
                    payload = self._enc.encode([time.time(), arg])
                    if self._lose:
                        self._lose -= 1
                        if self._lose_replayable:
                            self._buffer.append((self._seq, payload))
                    else:
                        seq = self._seq.to_bytes(8, "big")
                        self._pub.send_multipart([self._topic, seq, payload])
                        self._buffer.append((self._seq, payload))
                        self.published += 1
                    self._seq += 1
                elif kind == "skip":
                    self._lose, self._lose_replayable = arg
                elif kind == "restart":
                    self._seq = 0
                    self._buffer.clear()
                elif kind == "mark":
                    arg.set()
            except zmq.ZMQError as exc:  # never take the engine down for its events
                log.warning("KV events: %s", exc)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", _END, b""])
