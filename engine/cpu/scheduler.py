"""Continuous-batching scheduler: one thread drives the model; requests come and go per step.

Theory of operation
-------------------
Threads. The HTTP side (Trio) never touches torch. It builds a :class:`Request` and calls
:meth:`Scheduler.submit`, which checks the admission bound under a lock (at most
``max_running + max_queue`` unfinished requests, i.e. ``max_queue`` waiting for a slot; beyond
that :class:`QueueFullError`, which the server answers with 503) and puts an
``add`` command on a thread-safe queue. :meth:`Scheduler.abort` puts an ``abort`` command. The
one scheduler thread owns every piece of mutable model state (KV pool, sequences, grammar
matchers, generators) and is the only thread running the model.

The step. Each iteration of the scheduler thread:

1. drains the command queue (blocking only when there is no work at all);
2. applies aborts: a waiting request finishes with "Abort in waiting queue", a running one
   frees its KV slot and finishes with "Aborted";
3. admits waiting requests while KV slots are free (``max_running`` slots), copying the longest
   cached prefix of each prompt into its slot (:mod:`engine.cpu.prefix_cache`); prefill starts
   after it. A request sharing uncached blocks with a prompt still being prefilled waits for
   that prefill to be cached first;
4. plans one forward: one decode token for every running sequence, plus prefill chunks of newly
   admitted sequences (at most ``prefill_chunk`` prompt tokens per step, so a long prompt delays
   the running streams by bounded amounts);
5. runs the forward once — linear layers batched over all rows, attention per slot
   (:mod:`engine.cpu.model`), LoRA deltas per adapter row group;
6. samples each row with its own parameters and generator (:mod:`engine.cpu.sampling`), feeds
   the token to the grammar matcher, the incremental detokenizer and the stop matcher, and
   finishes sequences on stop token / stop string / length / grammar termination;
7. publishes an :class:`Update` for every sequence that produced output. Updates are snapshots
   of cumulative state (visible text, number of ids and logprobs, finish reason); the consumer
   may skip intermediate ones, so the scheduler never blocks on a slow client.

A prompt's KV is offered to the prefix cache as soon as its prefill completes, and a finishing
request's (stop, length or a client's abort) again with the generated tokens. Requests join and
leave between steps, so a finished or aborted request frees its slot for the next waiting one at
once, and a new request's prefill shares the step with running decodes.
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.cpu.detok import IncrementalDetokenizer, StopMatcher
from engine.cpu.grammar import Constraint
from engine.cpu.lora import LoraAdapter, LoraBatch
from engine.cpu.model import KVPool, Segment, TransformerModel
from engine.cpu.params import UNLIMITED, ParamError, SamplingParams
from engine.cpu.prefix_cache import PrefixCache
from engine.cpu.sampling import PenaltyState, SampleResult, process_logits, sample_row

__all__ = ["QueueFullError", "Request", "Scheduler", "Update"]

log = logging.getLogger("engine.cpu.scheduler")

FinishReason = dict[str, Any]


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queue``: answer 503."""


@dataclass(frozen=True)
class Update:
    """A snapshot of a request's cumulative output.

    ``text`` is the visible text; the first ``n_ids`` entries of ``Request.output_ids`` and the
    first ``n_logprobs`` entries of the logprob lists belong to this snapshot.
    """

    text: str
    n_ids: int
    n_logprobs: int
    finish: FinishReason | None


@dataclass(eq=False)
class Request:
    """One generation (one rid). Output lists are written only by the scheduler thread."""

    input_ids: list[int]
    params: SamplingParams
    on_update: Callable[[Request, Update], None]
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    adapter: LoraAdapter | None = None
    constraint: Constraint | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[list[list[Any]] | None] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    #: Prompt tokens whose KV came from the prefix cache (set at admission).
    cached_tokens: int = 0


class _Seq:
    """Scheduler-private state of one admitted request."""

    __slots__ = (
        "detok",
        "emitted_ids",
        "finish",
        "generator",
        "max_new",
        "penalties",
        "prefilled",
        "req",
        "slot",
        "stop_ids",
        "stops",
        "text",
        "visible",
    )

    def __init__(self, req: Request, tokenizer: Any, eos_ids: set[int], max_new: int) -> None:
        p = req.params
        self.req = req
        self.slot = -1
        self.prefilled = 0
        self.max_new = max_new
        self.detok = IncrementalDetokenizer(
            tokenizer, p.skip_special_tokens, p.spaces_between_special_tokens
        )
        self.stops = StopMatcher(p.stop, p.stop_regex)
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
        self.text = ""
        self.visible = ""
        self.emitted_ids = 0
        self.finish: FinishReason | None = None
        self.penalties: PenaltyState | None = None
        gen = torch.Generator()
        seed = p.sampling_seed if p.sampling_seed is not None else random.getrandbits(63)
        gen.manual_seed(seed % (1 << 64))
        self.generator = gen


class Scheduler:
    """Owns the model and its thread; see the module docstring."""

    def __init__(
        self,
        model: TransformerModel,
        tokenizer: Any,
        *,
        eos_token_ids: set[int],
        max_running: int = 16,
        max_queue: int = 128,
        prefill_chunk: int = 256,
        prefix_cache_tokens: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_token_ids)
        self.max_running = max_running
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.context_length = model.config.context_length
        self.pool = KVPool(model.config, max_running)
        self.cache = PrefixCache(model.config, prefix_cache_tokens)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight = 0  # submitted and not finished (guarded by _lock)
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []  # admitted: prefilling or decoding, in admission order
        self._by_rid: dict[str, _Seq] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self.generated_tokens = 0
        self.last_gen_throughput = 0.0

    # -- public, any thread --------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread = threading.Thread(target=self._run, name="cpu-engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the thread and wait for it."""
        self._stopping = True
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def check_lengths(self, req: Request) -> int:
        """Validate prompt/max_new_tokens against the context; return the effective max_new."""
        n = len(req.input_ids)
        ctx = self.context_length
        if n == 0:
            raise ParamError("The input_ids must not be empty.")
        if n >= ctx:
            raise ParamError(
                f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.input_ids):
            raise ParamError(f"input_ids must be in [0, {vocab}).")
        max_new = req.params.max_new_tokens
        if max_new == UNLIMITED:
            return ctx - n - 1
        if n + max_new > ctx:
            raise ParamError(
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {n + max_new} tokens: {n} tokens from the "
                f"input messages and {max_new} tokens for the completion. Please reduce the "
                f"number of tokens in the input messages or the completion to fit within the "
                f"limit."
            )
        return max_new

    def submit(self, req: Request, *, bypass_queue_limit: bool = False) -> None:
        """Queue a request; raise ParamError (400) or QueueFullError (503)."""
        max_new = self.check_lengths(req)
        with self._lock:
            if not bypass_queue_limit and self._inflight >= self.max_running + self.max_queue:
                raise QueueFullError(
                    f"The waiting queue is full ({self.max_queue} requests waiting for "
                    f"{self.max_running} running slots); retry later."
                )
            self._inflight += 1
        self._commands.put(("add", (req, max_new)))

    def abort(self, rid: str) -> None:
        """Abort the request with exactly this rid (no-op if unknown or finished)."""
        self._commands.put(("abort", rid))

    def flush_cache(self, done: Callable[[], None]) -> None:
        """Empty the prefix cache at the next step boundary, then call ``done`` (on the
        scheduler thread)."""
        self._commands.put(("flush", done))

    def statistics(self) -> dict[str, Any]:
        """Counters for /server_info."""
        with self._lock:
            inflight = self._inflight
        running = len(self._running)
        return {
            "num_running_reqs": running,
            "num_waiting_reqs": max(0, inflight - running),
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "last_gen_throughput": round(self.last_gen_throughput, 3),
            **self.cache.statistics(),
        }

    # -- scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            self._drain(block=not (self._running or self._waiting))
            if self._stopping:
                self._abort_all("Server is shutting down", 503)
                return
            if not (self._running or self._waiting):
                continue
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as exc:  # a bug or OOM: fail the batch, keep serving
                log.exception("scheduler step failed")
                self._abort_all(f"Internal error: {exc}", 500)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "add":
                req, max_new = arg
                seq = _Seq(req, self.tokenizer, self.eos_ids, max_new)
                self._waiting.append(seq)
                self._by_rid[req.rid] = seq
            elif kind == "abort":
                self._abort_rid(arg)
            elif kind == "flush":
                self.cache.flush()
                arg()
            elif kind == "stop":
                self._stopping = True
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _abort_rid(self, rid: str) -> None:
        seq = self._by_rid.get(rid)
        if seq is None or seq.finish is not None:
            return
        if seq.slot < 0:
            self._waiting.remove(seq)
            self._finish(seq, _abort("Abort in waiting queue"))
        else:
            self._finish(seq, _abort("Aborted"))

    def _abort_all(self, message: str, status: int) -> None:
        for seq in list(self._waiting):
            self._finish(seq, _abort(message, status))
        self._waiting.clear()
        for seq in list(self._running):
            self._finish(seq, _abort(message, status))

    def _admit(self) -> None:
        deferred: list[_Seq] = []
        while self._waiting and self.pool.free_slots:
            seq = self._waiting.popleft()
            if self._awaits_shared_prefill(seq):
                deferred.append(seq)
                continue
            seq.slot = self.pool.allocate()
            req = seq.req
            cached = self.cache.match(_adapter_key(req), req.input_ids, self.pool, seq.slot)
            seq.prefilled = req.cached_tokens = cached
            p = req.params
            if p.has_penalties:
                seq.penalties = PenaltyState(self.model.config.vocab_size, seq.req.input_ids)
            self._running.append(seq)
        self._waiting.extendleft(reversed(deferred))

    def _awaits_shared_prefill(self, seq: _Seq) -> bool:
        """Whether a running request is still prefilling whole blocks of ``seq``'s prompt that
        the cache does not hold yet (the ``n`` candidates of one prompt, say): ``seq`` then
        waits for that prefill to complete and be cached rather than compute it again. It costs
        ``seq`` nothing: prefill chunks go to running requests in admission order anyway."""
        cache = self.cache
        if not cache.enabled:
            return False
        prompt = seq.req.input_ids
        key = _adapter_key(seq.req)
        block = cache.block_size
        have = -1  # what the cache holds of it, looked up once, if needed
        for other in self._running:
            theirs = other.req.input_ids
            if other.prefilled >= len(theirs) or _adapter_key(other.req) is not key:
                continue
            limit = min(len(prompt) - 1, len(theirs)) // block * block
            if limit <= 0 or prompt[:block] != theirs[:block]:
                continue
            common = limit
            for start in range(block, limit, block):  # whole blocks, compared in C
                if prompt[start : start + block] != theirs[start : start + block]:
                    common = start
                    break
            if have < 0:
                have = cache.cached_length(key, prompt)
            if common > have:
                return True
        return False

    def _step(self) -> None:
        self._admit()
        segments: list[Segment] = []
        sampled: list[_Seq] = []
        prefilled: list[_Seq] = []  # prompts whose prefill this step completes
        budget = self.prefill_chunk
        for seq in self._running:
            prompt = seq.req.input_ids
            if seq.prefilled < len(prompt):
                if budget <= 0:
                    continue
                chunk = prompt[seq.prefilled : seq.prefilled + budget]
                done = seq.prefilled + len(chunk) == len(prompt)
                want = done and seq.max_new > 0
                segments.append(Segment(seq.slot, seq.prefilled, chunk, want))
                seq.prefilled += len(chunk)
                budget -= len(chunk)
                if want:
                    sampled.append(seq)
                if done:
                    prefilled.append(seq)
            else:
                pos = len(prompt) + len(seq.req.output_ids) - 1
                segments.append(Segment(seq.slot, pos, [seq.req.output_ids[-1]], True))
                sampled.append(seq)
        if not segments:
            return
        started = time.monotonic()
        logits = self.model.forward(segments, self.pool, self._lora_batch(segments))
        for i, seq in enumerate(sampled):
            self._sample_and_append(seq, logits[i])
        # Requests admitted from now on share these prompts at once (after the first tokens
        # went out: the copy is not on their time to first token). Finished ones were offered
        # already.
        for seq in prefilled:
            if seq.finish is None:
                prompt = seq.req.input_ids
                self.cache.insert(_adapter_key(seq.req), prompt, len(prompt), self.pool, seq.slot)
        for seq in list(self._running):
            if seq.max_new == 0 and seq.prefilled == len(seq.req.input_ids):
                self._finish(seq, {"type": "length", "length": 0})
        self.steps += 1
        self.generated_tokens += len(sampled)
        elapsed = time.monotonic() - started
        if elapsed > 0:
            self.last_gen_throughput = len(sampled) / elapsed

    def _lora_batch(self, segments: list[Segment]) -> LoraBatch | None:
        by_slot = {s.slot: s for s in self._running}
        groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
        row = 0
        for seg in segments:
            adapter = by_slot[seg.slot].req.adapter
            if adapter is not None:
                rows = groups.setdefault(id(adapter), (adapter, []))[1]
                rows.extend(range(row, row + len(seg.tokens)))
            row += len(seg.tokens)
        if not groups:
            return None
        return LoraBatch([(a, torch.tensor(rows, dtype=torch.long)) for a, rows in groups.values()])

    def _sample_and_append(self, seq: _Seq, row: torch.Tensor) -> None:
        req = seq.req
        p = req.params
        n_out = len(req.output_ids)
        suppress = list(seq.stop_ids) if n_out < p.min_new_tokens and seq.stop_ids else None
        row = process_logits(row, p, seq.penalties, suppress)
        if req.constraint is not None:
            req.constraint.mask(row)
        result = sample_row(
            row,
            p,
            seq.generator,
            req.return_logprob,
            req.top_logprobs_num if req.return_logprob else 0,
        )
        self._append(seq, result)

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def _append(self, seq: _Seq, result: SampleResult) -> None:
        req = seq.req
        p = req.params
        token = result.token
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids.append(token)
        if req.return_logprob:
            text = self._token_text(token) if req.return_text_in_logprobs else None
            req.output_token_logprobs.append([result.logprob, token, text])
            if req.top_logprobs_num:
                req.output_top_logprobs.append(
                    [
                        [lp, tid, self._token_text(tid) if req.return_text_in_logprobs else None]
                        for lp, tid in (result.top or [])
                    ]
                    or None
                )
        if seq.penalties is not None:
            seq.penalties.add(token)
        n_out = len(req.output_ids)
        finish: FinishReason | None = None
        grammar_done = False
        if req.constraint is not None:
            if not req.constraint.accept(token):
                self._finish(seq, _abort("Grammar rejected the sampled token", 500))
                return
            grammar_done = req.constraint.terminated
        can_stop = n_out >= p.min_new_tokens
        if token in seq.stop_ids and can_stop:
            finish = {"type": "stop", "matched": token}
            if p.no_stop_trim:
                seq.text += seq.detok.add(token)
        else:
            old_len = len(seq.text)
            seq.text += seq.detok.add(token)
            if grammar_done:
                seq.text += seq.detok.flush()
                finish = {"type": "stop", "matched": token}
            elif seq.stops.active and can_stop and len(seq.text) > old_len:
                hit = seq.stops.find(seq.text, old_len)
                if hit is not None:
                    start, end, matched = hit
                    seq.text = seq.text[: end if p.no_stop_trim else start]
                    finish = {"type": "stop", "matched": matched}
        total = len(req.input_ids) + n_out
        if finish is None and (n_out >= seq.max_new or total >= self.context_length):
            seq.text += seq.detok.flush()
            finish = {"type": "length", "length": n_out}
        if finish is not None:
            self._finish(seq, finish)
            return
        visible = seq.text[: seq.stops.visible_length(seq.text)]
        interval = p.stream_interval or 1
        if n_out == 1 or n_out - seq.emitted_ids >= interval:
            seq.visible = visible
            seq.emitted_ids = n_out
            self._emit(seq, None)

    def _finish(self, seq: _Seq, finish: FinishReason) -> None:
        if seq.finish is not None:
            return
        seq.finish = finish
        seq.req.finish_time = time.monotonic()
        with self._lock:
            self._inflight -= 1
        if seq.slot >= 0:
            if finish["type"] != "abort" or finish.get("status_code") is None:
                self._cache_kv(seq)
            self.pool.release(seq.slot)
            if seq in self._running:
                self._running.remove(seq)
        self._by_rid.pop(seq.req.rid, None)
        if finish["type"] == "abort":
            seq.visible = seq.visible  # aborted text stays what was already shown
        else:
            seq.visible = seq.text
        self._emit(seq, finish)

    def _cache_kv(self, seq: _Seq) -> None:
        """Offer the KV ``seq``'s slot holds to the prefix cache: the prompt tokens prefilled
        so far and, once decoding, every generated token but the last (never fed back)."""
        req = seq.req
        prompt = req.input_ids
        if seq.prefilled < len(prompt):
            tokens, length = prompt, seq.prefilled
        else:
            tokens = prompt + req.output_ids
            length = len(prompt) + max(len(req.output_ids) - 1, 0)
        self.cache.insert(_adapter_key(req), tokens, length, self.pool, seq.slot)

    def _emit(self, seq: _Seq, finish: FinishReason | None) -> None:
        req = seq.req
        update = Update(
            text=seq.visible,
            n_ids=len(req.output_ids),
            n_logprobs=len(req.output_token_logprobs),
            finish=finish,
        )
        try:
            req.on_update(req, update)
        except Exception:  # the consumer is gone (e.g. event loop closed)
            log.debug("on_update failed for %s", req.rid, exc_info=True)


def _adapter_key(req: Request) -> LoraAdapter | None:
    """Prefix-cache namespace: KV computed under an adapter is shared only under that same
    adapter object (adapters live as long as the engine)."""
    return req.adapter


def _abort(message: str, status_code: int | None = None) -> FinishReason:
    return {
        "type": "abort",
        "message": message,
        "status_code": status_code,
        "err_type": None if status_code is None else "internal_error",
    }
