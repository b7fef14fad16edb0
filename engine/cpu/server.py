"""HTTP server of the CPU engine: SGLang's native protocol over Quart-Trio + Hypercorn.

Usage::

    sieproxy-engine serve --model default --port 30000 [--lora NAME=PATH ...]
    python -m engine.cpu.server --model /path/to/hf_dir --port 30000

The port is bound before the model loads; until it is ready, ``/health*`` and ``/generate``
answer 503. Every status decision for ``/generate`` (400 contract/validation errors, 503 queue
full or loading) is made before the response starts; afterwards failures travel as SSE objects.

Delivery from the scheduler thread: its ``on_update`` callback calls
``TrioToken.run_sync_soon`` (thread-safe, never blocks the scheduler) to store the newest
cumulative snapshot in the request's :class:`_Mux` and wake the response body. Snapshots are
cumulative, so a slow client simply skips intermediate ones. The streaming body is an async
iterator whose ``aclose`` (called by Quart when the client disconnects or the stream ends)
aborts every unfinished rid.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio

from engine.cpu.grammar import GrammarError
from engine.cpu.params import ContractError, ParamError, SamplingParams, parse_sampling_params
from engine.cpu.runner import DEFAULT_PREFIX_CACHE_TOKENS, CpuEngine, EngineConfig
from engine.cpu.scheduler import QueueFullError, Request, Update
from engine.kv_events import parse_kv_events_config

__all__ = ["build_app", "main", "parse_args", "serve"]

VERSION = "0.1.0+sieproxy.cpu"
log = logging.getLogger("engine.cpu.server")
_encoder = msgspec.json.Encoder()
HEALTH_TIMEOUT = 20.0


def _json(data: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> Response:
    """Validation failure after the contract: ``{"error": {"message": ...}}``."""
    return _json({"error": {"message": message}}, status)


def _http_error(message: str, status: int) -> Response:
    """SGLang's HTTPException / pydantic shape."""
    phrase = {400: "Bad Request", 503: "Service Unavailable", 500: "Internal Server Error"}
    return _json(
        {
            "object": "error",
            "message": message,
            "type": phrase.get(status, str(status)),
            "param": None,
            "code": status,
        },
        status,
    )


class _Mux:
    """Newest snapshot per sub-request, plus a wake-up for the response body (Trio side)."""

    def __init__(self, requests: list[Request], batch: bool, started: float) -> None:
        self.requests = requests
        self.batch = batch
        self.started = started
        self.latest: list[Update | None] = [None] * len(requests)
        self.dirty: set[int] = set()
        self.finished = 0
        self.event = trio.Event()
        self._index = {id(r): i for i, r in enumerate(requests)}

    def deliver(self, req: Request, update: Update) -> None:
        """Run in the Trio thread: store ``update`` and wake the consumer."""
        i = self._index[id(req)]
        previous = self.latest[i]
        if previous is not None and previous.finish is not None:
            return
        self.latest[i] = update
        self.dirty.add(i)
        if update.finish is not None:
            self.finished += 1
        self.event.set()

    async def wait(self) -> list[int]:
        """Wait for new snapshots; return the indices that changed."""
        while not self.dirty:
            await self.event.wait()
            self.event = trio.Event()
        dirty = sorted(self.dirty)
        self.dirty.clear()
        return dirty

    @property
    def done(self) -> bool:
        """Every sub-request has finished."""
        return self.finished == len(self.requests)

    def chunk(self, i: int) -> dict[str, Any]:
        """The SGLang chunk object for sub-request ``i`` (cumulative text and ids)."""
        req = self.requests[i]
        update = self.latest[i]
        assert update is not None
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": update.finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": update.n_ids,
            "cached_tokens": req.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": "default",
            "num_retractions": 0,
        }
        if req.return_logprob:
            n = update.n_logprobs
            meta["output_token_logprobs"] = req.output_token_logprobs[:n]
            meta["output_token_logprobs_length"] = n
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = req.output_top_logprobs[:n]
        if update.finish is not None:
            meta["e2e_latency"] = time.monotonic() - self.started
        obj: dict[str, Any] = {
            "text": update.text,
            "output_ids": req.output_ids[: update.n_ids],
            "meta_info": meta,
        }
        if self.batch:
            obj["index"] = i
        return obj


class _SSEBody:
    """Streaming body: ``data: {json}\\n\\n`` per snapshot, then ``data: [DONE]\\n\\n``.

    ``aclose`` aborts unfinished sub-requests; Quart calls it on normal end and on disconnect.
    """

    def __init__(self, engine: CpuEngine, mux: _Mux) -> None:
        self.engine = engine
        self.mux = mux
        self.closed = False

    def __aiter__(self) -> _SSEBody:
        return self

    async def __anext__(self) -> bytes:
        if self.closed:
            raise StopAsyncIteration
        if self.mux.done and not self.mux.dirty:
            self.closed = True
            return b"data: [DONE]\n\n"
        dirty = await self.mux.wait()
        parts = [b"data: " + _encoder.encode(self.mux.chunk(i)) + b"\n\n" for i in dirty]
        return b"".join(parts)

    async def aclose(self) -> None:
        self.closed = True
        _abort_unfinished(self.engine, self.mux)


def _abort_unfinished(engine: CpuEngine, mux: _Mux) -> None:
    if engine.scheduler is None:
        return
    for i, req in enumerate(mux.requests):
        latest = mux.latest[i]
        if latest is None or latest.finish is None:
            engine.scheduler.abort(req.rid)


def _lookup_adapter(engine: CpuEngine, name: Any) -> Any:
    if name is None:
        return None
    if not isinstance(name, str):
        raise ContractError("lora_path: invalid type, expected a string or null")
    if not engine.adapters:
        raise ParamError(
            "The server is not configured to enable LoRA. Start it with --lora NAME=PATH "
            f"to serve adapters (requested {name!r})."
        )
    adapter = engine.adapters.get(name)
    if adapter is None:
        raise ParamError(
            f"The following requested LoRA adapters are not loaded: {name}\n"
            f"Loaded adapters: {', '.join(sorted(engine.adapters))}."
        )
    return adapter


def _per_item(value: Any, count: int, name: str, default: Any) -> list[Any]:
    """Broadcast a scalar or check a per-batch-item list."""
    if isinstance(value, list):
        if len(value) != count:
            raise ParamError(f"The length of {name} ({len(value)}) must match the batch size.")
        return value
    return [default if value is None else value] * count


def _no_update(_req: Request, _update: Update) -> None:
    """Placeholder callback, replaced before submission."""


async def _build_requests(engine: CpuEngine, body: dict[str, Any]) -> tuple[list[Request], bool]:
    """Turn a /generate body into sub-requests (batch × n); raise Contract/Param errors."""
    for key in ("image_data", "video_data", "audio_data", "input_embeds"):
        if body.get(key) not in (None, [], ""):
            kind = key.split("_")[0]
            raise ParamError(
                f"The model {engine.served_model_name} does not support {kind} input "
                f"({key}); it is a text-only model."
            )
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise ParamError("Either text or input_ids should be provided.")
    prompts: list[list[int]]
    batch: bool
    if text is not None:
        if isinstance(text, str):
            batch, texts = False, [text]
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            batch, texts = True, text
        else:
            raise ContractError("text: invalid type, expected a string or a sequence of strings")
        prompts = [engine.encode(t) for t in texts]
    else:
        if (
            isinstance(input_ids, list)
            and input_ids
            and all(isinstance(t, list) for t in input_ids)
        ):
            batch, prompts = True, input_ids
        elif isinstance(input_ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            batch, prompts = False, [input_ids]
        else:
            raise ContractError("input_ids: invalid type, expected a sequence of integers")
        for p in prompts:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ContractError("input_ids: invalid type, expected integers")
    count = len(prompts)
    if count == 0:
        raise ParamError("The batch is empty.")
    vocab = engine.model.config.vocab_size if engine.model is not None else 0
    defaults = engine.sampling_defaults
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != count:
            raise ParamError("The length of sampling_params must match the batch size.")
        params = [parse_sampling_params(p, vocab, defaults) for p in raw_params]
    else:
        one = parse_sampling_params(raw_params, vocab, defaults)
        params = (
            [parse_sampling_params(raw_params, vocab, defaults) for _ in range(count)]
            if count > 1
            else [one]
        )
    n = params[0].n
    if any(p.n != n for p in params):
        raise ParamError(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    return_logprob = _per_item(body.get("return_logprob"), count, "return_logprob", False)
    top_n = _per_item(body.get("top_logprobs_num"), count, "top_logprobs_num", 0)
    if n > 1 and (
        isinstance(body.get("return_logprob"), list)
        or isinstance(body.get("top_logprobs_num"), list)
    ):
        raise ParamError(
            "Cannot use list return_logprob/top_logprobs_num with parallel_sample_num > 1."
        )
    text_in_lp = bool(body.get("return_text_in_logprobs") or False)
    adapters = [
        _lookup_adapter(engine, a)
        for a in _per_item(body.get("lora_path"), count, "lora_path", None)
    ]
    rid = body.get("rid")
    if isinstance(rid, list):
        if len(rid) != count or len(set(rid)) != count or not all(isinstance(r, str) for r in rid):
            raise ParamError("The rid list must have one unique string per batch item.")
        rids = list(rid)
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(count)] if batch else [rid]
    elif rid is None:
        rids = [uuid.uuid4().hex for _ in range(count)]
    else:
        raise ContractError("rid: invalid type, expected a string or a sequence of strings")
    if n > 1:
        batch = True
    # Compile grammars (cached) off the event loop; a bad grammar is a 400 now.
    compiled: list[Any] = []
    for sp in params:
        g = sp.grammar
        if g is None:
            compiled.append(None)
        else:
            assert engine.grammars is not None
            compiled.append(await trio.to_thread.run_sync(engine.grammars.compile, *g))
    requests: list[Request] = []

    for i in range(count):
        for j in range(n):
            sub_params: SamplingParams = (
                params[i]
                if n == 1
                else parse_sampling_params(
                    raw_params[i] if isinstance(raw_params, list) else raw_params, vocab, defaults
                )
            )
            if n > 1 and sub_params.sampling_seed is not None:
                sub_params.sampling_seed += j
            constraint = (
                engine.grammars.new_constraint(compiled[i])
                if compiled[i] is not None and engine.grammars is not None
                else None
            )
            requests.append(
                Request(
                    input_ids=list(prompts[i]),
                    params=sub_params,
                    on_update=_no_update,
                    rid=rids[i] if n == 1 else uuid.uuid4().hex,
                    adapter=adapters[i],
                    constraint=constraint,
                    return_logprob=bool(return_logprob[i]),
                    top_logprobs_num=int(top_n[i] or 0),
                    return_text_in_logprobs=text_in_lp,
                )
            )
    return requests, batch


def build_app(engine: CpuEngine) -> QuartTrio:
    """The Quart-Trio application serving ``engine``."""
    app = QuartTrio("sieproxy-cpu-engine")
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024 * 1024

    def _submit_all(requests: list[Request]) -> None:
        assert engine.scheduler is not None
        submitted: list[Request] = []
        try:
            for req in requests:
                engine.scheduler.submit(req)
                submitted.append(req)
        except BaseException:
            for req in submitted:
                engine.scheduler.abort(req.rid)
            raise

    @app.route("/generate", methods=["POST", "PUT"])
    async def generate() -> Any:
        started = time.monotonic()
        try:
            body = await request.get_json(force=True)
        except Exception as exc:
            return _http_error(f"Invalid JSON body: {exc}", 400)
        if not isinstance(body, dict):
            return _http_error("The request body must be a JSON object.", 400)
        if not engine.ready:
            return _http_error("The engine is loading the model; retry later.", 503)
        try:
            requests, batch = await _build_requests(engine, body)
        except ContractError as exc:
            return _json({"error": str(exc)}, 400)
        except (ParamError, GrammarError) as exc:
            return _error(str(exc), 400)
        mux = _Mux(requests, batch, started)
        token = trio.lowlevel.current_trio_token()

        def deliver_from_thread(req: Request, update: Update) -> None:
            token.run_sync_soon(mux.deliver, req, update)

        for req in requests:
            req.on_update = deliver_from_thread
        try:
            _submit_all(requests)
        except ParamError as exc:
            return _error(str(exc), 400)
        except QueueFullError as exc:
            return _http_error(str(exc), 503)
        if body.get("stream"):
            response = Response(_SSEBody(engine, mux), content_type="text/event-stream")
            response.timeout = None
            response.headers["Cache-Control"] = "no-cache"
            return response
        try:
            while not mux.done:
                await mux.wait()
        finally:
            _abort_unfinished(engine, mux)
        objects = [mux.chunk(i) for i in range(len(requests))]
        for obj in objects:
            obj.pop("index", None)
            finish = obj["meta_info"]["finish_reason"]
            if finish and finish.get("type") == "abort" and finish.get("status_code"):
                status = int(finish["status_code"])
                if status == 400:
                    return _error(finish["message"], 400)
                return _http_error(finish["message"], status)
        return _json(objects if batch else objects[0])

    @app.route("/abort_request", methods=["POST"])
    async def abort_request() -> Any:
        try:
            body = await request.get_json(force=True)
        except Exception:
            body = None
        if isinstance(body, dict) and engine.scheduler is not None:
            rid = body.get("rid")
            if isinstance(rid, str) and rid:
                engine.scheduler.abort(rid)
        return Response(b"", status=200)

    async def flush_cache() -> Any:
        # SGLang's shape: plain text, 200. Safe while requests run: they hold copies.
        if not engine.ready or engine.scheduler is None:
            return _http_error("The model is not loaded yet.", 503)
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        engine.scheduler.flush_cache(lambda: token.run_sync_soon(done.set))
        await done.wait()
        return Response(
            b"Cache flushed.\nPlease check backend logs for more details. (When there are "
            b"running or waiting requests, the operation will not be performed.)\n",
            status=200,
            content_type="text/plain",
        )

    app.add_url_rule("/flush_cache", "flush_cache", flush_cache, methods=["GET", "POST"])

    async def _health() -> Any:
        if not engine.ready or engine.scheduler is None:
            return Response(b"", status=503)
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        params = parse_sampling_params({"max_new_tokens": 1, "temperature": 0}, 1)

        def on_update(_req: Request, update: Update) -> None:
            if update.n_ids or update.finish is not None:
                token.run_sync_soon(done.set)

        req = Request(
            input_ids=[0],
            params=params,
            on_update=on_update,
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        )
        try:
            engine.scheduler.submit(req, bypass_queue_limit=True)
        except (ParamError, QueueFullError):
            return Response(b"", status=503)
        with trio.move_on_after(HEALTH_TIMEOUT):
            await done.wait()
            return Response(b"", status=200)
        engine.scheduler.abort(req.rid)
        return Response(b"", status=503)

    app.add_url_rule("/health", "health", _health, methods=["GET"])
    app.add_url_rule("/health_generate", "health_generate", _health, methods=["GET"])

    def _model_info() -> dict[str, Any]:
        return {
            "model_path": str(engine.model_path or engine.config.model or ""),
            "served_model_name": engine.served_model_name,
            "tokenizer_path": str(engine.model_path or ""),
            "is_generation": True,
            # The model's defaults for unset sampling values (generation_config.json).
            "preferred_sampling_params": engine.sampling_defaults or None,
            "weight_version": "default",
            "load_format": "safetensors",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": engine.model_type(),
            "architectures": [engine.architecture()] if engine.model is not None else [],
            # Not an SGLang key: lets the gateway check logit_bias ids before sending them.
            "vocab_size": engine.model.config.vocab_size if engine.model is not None else None,
        }

    async def model_info() -> Any:
        return _json(_model_info())

    app.add_url_rule("/model_info", "model_info", model_info, methods=["GET"])
    app.add_url_rule("/get_model_info", "get_model_info", model_info, methods=["GET"])

    async def server_info() -> Any:
        cfg = engine.config
        stats = engine.scheduler.statistics() if engine.scheduler is not None else {}
        info = {
            "model_path": str(engine.model_path or cfg.model or ""),
            "tokenizer_path": str(engine.model_path or ""),
            "served_model_name": engine.served_model_name,
            "context_length": engine.context_length,
            "max_running_requests": cfg.max_running,
            "max_queued_requests": cfg.max_queue,
            "chunked_prefill_size": cfg.prefill_chunk,
            "incremental_streaming_output": False,
            "stream_interval": 1,
            "skip_tokenizer_init": False,
            "enable_lora": bool(engine.adapters),
            "lora_paths": {k: str(v.path) for k, v in engine.adapters.items()},
            "tool_call_parser": None,
            "reasoning_parser": None,
            "device": "cpu",
            "dtype": "float32",
            "grammar_backend": "xgrammar",
            "host": app.config.get("ENGINE_HOST"),
            "port": app.config.get("ENGINE_PORT"),
            "launch_command": " ".join(sys.argv),
            "kv_events_config": engine.kv_events.config_json() if engine.kv_events else None,
            "max_total_num_tokens": engine.context_length * cfg.max_running,
            "max_req_input_len": max(engine.context_length - 1, 0),
            "startup_time": engine.load_seconds,
            "internal_states": [stats],
            "ready": engine.ready,
            # Set by a gateway for its embedded engine (it checks that it talks to its child).
            "launch_token": os.environ.get("SIEPROXY_ENGINE_LAUNCH_TOKEN"),
            "version": VERSION,
            "frontend": "python",
        }
        return _json(info)

    app.add_url_rule("/server_info", "server_info", server_info, methods=["GET"])
    app.add_url_rule("/get_server_info", "get_server_info", server_info, methods=["GET"])

    def _load() -> tuple[int, int]:
        if engine.scheduler is None:
            return 0, 0
        stats = engine.scheduler.statistics()
        return int(stats["num_running_reqs"]), int(stats["num_waiting_reqs"])

    @app.route("/v1/loads", methods=["GET"])
    async def loads() -> Any:
        """SGLang's load report (one data-parallel rank): requests running and waiting."""
        running, waiting = _load()
        rank = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting}
        return _json({"loads": [rank]})

    @app.route("/get_load", methods=["GET"])
    async def get_load() -> Any:
        """SGLang's older shape of the same (``num_reqs`` counts running and waiting)."""
        running, waiting = _load()
        return _json([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting}])

    @app.route("/v1/models", methods=["GET"])
    async def models() -> Any:
        created = int(time.time())
        name = engine.served_model_name
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "sglang",
                "root": str(engine.model_path or name),
                "parent": None,
                "max_model_len": engine.context_length or None,
            }
        ]
        for adapter in engine.adapters.values():
            data.append(
                {
                    "id": adapter.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "sglang",
                    "root": str(adapter.path),
                    "parent": name,
                    "max_model_len": None,
                }
            )
        return _json({"object": "list", "data": data})

    return app


def _lora_arg(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora expects NAME=PATH, got {value!r}")
    return name, Path(path).expanduser()


def _kv_events_arg(value: str) -> str:
    try:
        parse_kv_events_config(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``serve`` arguments."""
    parser = argparse.ArgumentParser(
        prog="sieproxy-engine serve",
        description="CPU engine speaking SGLang's native HTTP protocol (continuous batching).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: sieproxy-engine serve --model ./Qwen2.5-0.5B-Instruct --port 30001 "
        "--threads 4",
    )
    parser.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct), an HF model dir or a .gguf file",
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--port", type=int, default=30000, help="listen port; 0 picks a free one")
    parser.add_argument(
        "--lora",
        action="append",
        type=_lora_arg,
        default=[],
        metavar="NAME=PATH",
        help="serve a PEFT LoRA adapter (repeatable)",
    )
    parser.add_argument(
        "--max-running",
        "--max-running-requests",
        dest="max_running",
        type=int,
        default=16,
        help="sequences decoded together (KV slots)",
    )
    parser.add_argument(
        "--max-queue",
        "--max-queued-requests",
        dest="max_queue",
        type=int,
        default=128,
        help="waiting requests before /generate answers 503",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (None: its own)"
    )
    parser.add_argument(
        "--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per scheduler step"
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=DEFAULT_PREFIX_CACHE_TOKENS,
        help="KV tokens kept for reuse by requests sharing a prefix (0: no prefix cache)",
    )
    parser.add_argument(
        "--kv-events-config",
        type=_kv_events_arg,
        default=None,
        help="publish KV-cache events as SGLang does: its JSON, e.g. "
        '\'{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")
    return parser.parse_args(argv)


async def serve(
    args: argparse.Namespace,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind, report the port via ``task_status``, load the model, serve until cancelled."""
    engine = CpuEngine(
        EngineConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            loras=dict(args.lora),
            max_running=args.max_running,
            max_queue=args.max_queue,
            prefill_chunk=args.prefill_chunk,
            prefix_cache_tokens=args.prefix_cache_tokens,
            threads=args.threads,
            kv_events_config=args.kv_events_config,
        )
    )
    app = build_app(engine)
    config = HypercornConfig()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = None
    # Through the root handler, at WARNING: the "listening on" line below says where it is, and
    # a gateway running this engine prints its own "Running on" line.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.errorlog.setLevel(logging.WARNING)
    config.keep_alive_timeout = 75
    app.config["ENGINE_HOST"] = args.host
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(hypercorn_serve, app, config)
            port = int(str(binds[0]).rsplit(":", 1)[1])
            app.config["ENGINE_PORT"] = port
            print(
                f"[sieproxy-engine] listening on http://{args.host}:{port}",
                file=sys.stderr,
                flush=True,
            )
            task_status.started(port)
            try:
                await trio.to_thread.run_sync(engine.load, abandon_on_cancel=True)
            except Exception as exc:
                engine.error = str(exc)
                log.exception("model load failed")
                raise
            print(
                f"[sieproxy-engine] ready: {engine.served_model_name} ({engine.load_seconds:.1f}s)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``sieproxy-engine serve``; returns the exit status."""
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    async def _main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            await serve(args)
            nursery.cancel_scope.cancel()

    try:
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(_main)
    except Exception as exc:  # model load failure and the like: report, exit non-zero
        print(f"[sieproxy-engine] fatal: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


if __name__ == "__main__":
    sys.exit(main())
