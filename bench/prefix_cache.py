"""The CPU engine's prefix cache on a multi-turn conversation, and its memory bound.

Used by ``python -m bench prefix-cache``. One process loads the model once and drives two
schedulers over the same weights, one after the other, never at once: one with the prefix
cache (``--prefix-cache-tokens``), one without (0). The conversation:

* a system message carrying a reference document (about 600 tokens with SmolLM2's template),
* then per turn a user message of about 100 tokens and the model's greedy reply (at most
  ``reply_tokens``); the prompt of turn *k* is the whole history through the chat template,
  so it grows to about 2,000 tokens by turn 8.

Each turn is sent to the scheduler without the cache first, then to the one with it (whose
cache holds the earlier turns' prompts and replies); the reply of the cached run is appended
to the history (both replies are compared: greedy output must be the same). Time to first
token is the scheduler's: first token time minus submission, in-process, no HTTP.

Memory: afterwards a third scheduler with a small bound (``soak_cache_tokens``) prefills
``soak_prompts`` distinct prompts one after another; the process's RSS is read after a quarter
of them (the bound is then reached) and at the end, with the tokens the cache holds.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from typing import Any

from engine.cpu.params import parse_sampling_params
from engine.cpu.runner import CpuEngine, EngineConfig
from engine.cpu.scheduler import Request, Scheduler, Update

__all__ = ["conversation_run", "soak_run"]

_SENTENCES = [
    "The harbour at Vellmar freezes for eleven weeks each winter",
    "ships then unload at the deep-water quay of Ostrand, forty kilometres south",
    "the rail line between the two towns was doubled in 1962",
    "its bridges were rebuilt in steel after the flood of 1974",
    "the town council publishes tide tables every March",
    "fishing quotas are set by the regional board and reviewed each autumn",
    "the lighthouse on Skarv island has been automated since 1991",
    "the ferry to the outer islands runs twice daily in summer and once in winter",
    "the old customs house now holds the maritime museum",
    "the museum's archive keeps the harbour master's logs from 1820 onwards",
    "a new breakwater was finished in 2008 after six years of work",
    "the population of Vellmar peaked at 14,200 in 1958 and is now about 9,800",
]

_QUESTIONS = [
    "How long does the harbour stay frozen, and where do ships go meanwhile?",
    "When was the rail line doubled, and what happened to its bridges later?",
    "Who sets the fishing quotas and how often are they reviewed?",
    "Is the lighthouse on Skarv island still staffed?",
    "How often does the ferry to the outer islands run in winter?",
    "What does the old customs house hold today?",
    "When was the breakwater finished and how long did it take?",
    "How has the population of Vellmar changed since its peak?",
]


def _paragraph(seed: int, sentences: int) -> str:
    out = []
    for i in range(sentences):
        s = _SENTENCES[(seed * 5 + i * 7) % len(_SENTENCES)]
        out.append(s[0].upper() + s[1:] + ".")
    return " ".join(out)


def _document() -> str:
    return "\n\n".join(f"Section {i + 1}. {_paragraph(i, 6)}" for i in range(6))


def _user_message(turn: int) -> str:
    return (
        f"Here are my notes for question {turn + 1}: {_paragraph(turn + 11, 4)} "
        f"Using the reference document, answer briefly: {_QUESTIONS[turn % len(_QUESTIONS)]}"
    )


def _chat_ids(engine: CpuEngine, messages: list[dict[str, str]]) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _generate(
    engine: CpuEngine, sched: Scheduler, ids: list[int], max_new: int
) -> tuple[Request, float]:
    """Run one greedy request alone; return it and its time to first token (s)."""
    assert engine.model is not None
    done = threading.Event()

    def on_update(_req: Request, update: Update) -> None:
        if update.finish is not None:
            done.set()

    params = parse_sampling_params(
        {"temperature": 0, "max_new_tokens": max_new}, engine.model.config.vocab_size
    )
    req = Request(input_ids=ids, params=params, on_update=on_update)
    sched.submit(req)
    if not done.wait(600):
        raise RuntimeError("generation did not finish")
    assert req.first_token_time is not None
    return req, req.first_token_time - req.created


def _scheduler(engine: CpuEngine, cache_tokens: int) -> Scheduler:
    assert engine.model is not None
    sched = Scheduler(
        engine.model,
        engine.tokenizer,
        eos_token_ids=engine.eos_token_ids,
        max_running=4,
        max_queue=8,
        prefill_chunk=engine.config.prefill_chunk,
        prefix_cache_tokens=cache_tokens,
    )
    sched.start()
    return sched


def load_engine(model: str, threads: int) -> CpuEngine:
    """Load the model once (its own scheduler is stopped: the bench makes its own)."""
    engine = CpuEngine(EngineConfig(model=model, threads=threads, prefix_cache_tokens=0))
    engine.load()
    assert engine.scheduler is not None
    engine.scheduler.stop()
    return engine


def conversation_run(
    engine: CpuEngine, turns: int, reply_tokens: int, cache_tokens: int
) -> list[dict[str, Any]]:
    """One row per turn: prompt tokens, TTFT off/on, cached tokens, whether replies agree."""
    off = _scheduler(engine, 0)
    on = _scheduler(engine, cache_tokens)
    try:
        # Warm-up (kernels, allocator, rotary tables) on both, outside the conversation.
        warm = _chat_ids(engine, [{"role": "user", "content": "Hello there."}])
        _generate(engine, off, warm, 4)
        _generate(engine, on, warm, 4)
        messages = [{"role": "system", "content": "Reference document:\n\n" + _document()}]
        rows = []
        for turn in range(turns):
            messages.append({"role": "user", "content": _user_message(turn)})
            ids = _chat_ids(engine, messages)
            req_off, ttft_off = _generate(engine, off, ids, reply_tokens)
            req_on, ttft_on = _generate(engine, on, ids, reply_tokens)
            reply = engine.tokenizer.decode(req_on.output_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            rows.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": len(ids),
                    "cached_tokens": req_on.cached_tokens,
                    "ttft_off_s": ttft_off,
                    "ttft_on_s": ttft_on,
                    "speedup": ttft_off / ttft_on if ttft_on > 0 else float("inf"),
                    "same_output": req_off.output_ids == req_on.output_ids,
                    "reply_tokens": len(req_on.output_ids),
                }
            )
        return rows
    finally:
        off.stop()
        on.stop()


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def soak_run(engine: CpuEngine, prompts: int, cache_tokens: int) -> dict[str, Any]:
    """Distinct prompts through a small cache: RSS after warm-up and at the end."""
    sched = _scheduler(engine, cache_tokens)
    try:
        samples = []
        warm_at = max(1, prompts // 4)
        rss_warm = 0
        started = time.monotonic()
        for i in range(prompts):
            text = f"Request {i}: {_paragraph(i, 3)} {_paragraph(i * 3 + 1, 2)}"
            ids = _chat_ids(engine, [{"role": "user", "content": text}])
            _generate(engine, sched, ids, 1)
            stats = sched.statistics()
            samples.append(stats["prefix_cache_tokens"])
            if i + 1 == warm_at:
                gc.collect()
                rss_warm = _rss_kib()
        gc.collect()
        rss_end = _rss_kib()
        stats = sched.statistics()
        return {
            "prompts": prompts,
            "cache_max_tokens": stats["prefix_cache_max_tokens"],
            "cache_tokens_max_seen": max(samples),
            "evicted_blocks": stats["prefix_cache_evicted_blocks"],
            "rss_after_warmup_kib": rss_warm,
            "rss_end_kib": rss_end,
            "rss_growth": (rss_end - rss_warm) / rss_warm if rss_warm else 0.0,
            "seconds": time.monotonic() - started,
            "median_cache_tokens": statistics.median(samples),
        }
    finally:
        sched.stop()
