"""Benchmark the CPU engine against transformers' ``generate()`` on the same requests.

    python bench/bench_engine.py [--model default] [--threads 0] [--scale 1.0]

For 1, 4 and 16 concurrent streams, the same deterministic request set (mixed prompt lengths,
mixed output lengths, greedy, ``ignore_eos`` so every request produces exactly its length) is run

* through the engine's continuous-batching scheduler (all requests of the level submitted at
  once; tokens/s = all output tokens / wall time; TTFT = first token − submission, under the
  load of the other requests);
* through ``model.generate()`` — one request at a time for the single-stream level, and as
  **one left-padded batch** for 4 and 16 (``max_new_tokens`` = the longest request; only the
  requested tokens count as useful output; TTFT = a 1-token generate of the padded batch).

Prints a Markdown table with the ratios. Targets: single stream ≥ 1.5× and 16 streams ≥ 2× of
generate()'s aggregate tokens/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine.cpu.params import parse_sampling_params
from engine.cpu.runner import CpuEngine, EngineConfig
from engine.cpu.scheduler import Request, Update

TOPICS = [
    "the history of the printing press",
    "how photosynthesis works",
    "why the sky is blue",
    "a recipe for pancakes",
    "the rules of chess",
    "how a compiler turns source code into machine code",
    "the water cycle",
    "tips for learning a new language",
]
OUTPUT_LENGTHS = [24, 96, 48, 128, 32, 64, 80, 16]


def make_requests(tokenizer: Any, count: int, scale: float) -> list[tuple[list[int], int]]:
    """Deterministic (prompt_ids, max_new_tokens) pairs with mixed lengths."""
    out = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        detail = " Please be thorough and give examples." * (i % 4)
        messages = [{"role": "user", "content": f"Explain {topic}.{detail}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        n_out = max(4, int(OUTPUT_LENGTHS[(i * 3) % len(OUTPUT_LENGTHS)] * scale))
        out.append((list(ids), n_out))
    return out


def run_engine(engine: CpuEngine, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    """Submit all at once; return tokens/s and TTFT statistics."""
    assert engine.scheduler is not None and engine.model is not None
    done = threading.Semaphore(0)

    def on_update(_req: Request, update: Update) -> None:
        if update.finish is not None:
            done.release()

    requests = []
    for ids, n in reqs:
        params = parse_sampling_params(
            {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            engine.model.config.vocab_size,
        )
        requests.append(Request(input_ids=ids, params=params, on_update=on_update))
    started = time.monotonic()
    for req in requests:
        req.created = time.monotonic()
        engine.scheduler.submit(req)
    for _ in requests:
        done.acquire()
    wall = time.monotonic() - started
    tokens = sum(len(r.output_ids) for r in requests)
    ttfts = [(r.first_token_time or r.created) - r.created for r in requests]
    return {
        "tokens": tokens,
        "wall": wall,
        "tps": tokens / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_max": max(ttfts),
    }


def run_hf_single(model: Any, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    """generate() one request at a time."""
    tokens = 0
    wall = 0.0
    ttfts = []
    with torch.inference_mode():
        for ids, n in reqs:
            x = torch.tensor([ids])
            t0 = time.monotonic()
            model.generate(x, max_new_tokens=1, do_sample=False, pad_token_id=2)
            ttfts.append(time.monotonic() - t0)
            t0 = time.monotonic()
            out = model.generate(
                x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2
            )
            wall += time.monotonic() - t0
            tokens += out.shape[1] - len(ids)
    return {
        "tokens": tokens,
        "wall": wall,
        "tps": tokens / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_max": max(ttfts),
    }


def run_hf_batch(model: Any, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    """generate() all requests as one left-padded batch; count only requested tokens."""
    width = max(len(ids) for ids, _ in reqs)
    pad = 2
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in reqs])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in reqs])
    longest = max(n for _, n in reqs)
    with torch.inference_mode():
        t0 = time.monotonic()
        model.generate(
            input_ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=pad
        )
        ttft = time.monotonic() - t0
        t0 = time.monotonic()
        model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad,
        )
        wall = time.monotonic() - t0
    useful = sum(n for _, n in reqs)
    return {
        "tokens": useful,
        "wall": wall,
        "tps": useful / wall,
        "ttft_p50": ttft,
        "ttft_max": ttft,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply output lengths")
    parser.add_argument("--levels", default="1,4,16")
    args = parser.parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)

    engine = CpuEngine(
        EngineConfig(model=args.model, max_running=16, max_queue=64, threads=threads)
    )
    engine.load()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path)).eval()
    levels = [int(x) for x in args.levels.split(",")]
    # Warm up both paths.
    warm = make_requests(engine.tokenizer, 2, 0.1)
    run_engine(engine, warm)
    run_hf_single(hf, warm[:1])

    rows = []
    for level in levels:
        if level == 1:
            reqs = make_requests(engine.tokenizer, 3, args.scale)
            eng = {"tokens": 0.0, "wall": 0.0, "ttfts": []}
            per = [run_engine(engine, [r]) for r in reqs]
            tokens = sum(p["tokens"] for p in per)
            wall = sum(p["wall"] for p in per)
            e = {
                "tps": tokens / wall,
                "ttft_p50": statistics.median(p["ttft_p50"] for p in per),
                "ttft_max": max(p["ttft_max"] for p in per),
            }
            del eng
            h = run_hf_single(hf, reqs)
            baseline = "generate() one request"
        else:
            reqs = make_requests(engine.tokenizer, level, args.scale)
            e = run_engine(engine, reqs)
            h = run_hf_batch(hf, reqs)
            baseline = f"generate() padded batch of {level}"
        rows.append((level, e, h, baseline))
        print(
            f"level {level}: engine {e['tps']:.1f} tok/s, {baseline} {h['tps']:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    engine.shutdown()

    kernels = "on" if engine.model is not None and engine.model.uses_kernels else "off"
    print(
        f"\nCPU engine vs transformers generate() — {engine.served_model_name}, float32, "
        f"{threads} torch threads, greedy, mixed prompt/output lengths, "
        f"engine kernels {kernels}\n"
    )
    print(
        "| streams | engine tok/s | generate() tok/s | ratio | engine TTFT p50 / max (s) "
        "| generate() TTFT (s) | baseline |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    for level, e, h, baseline in rows:
        print(
            f"| {level} | {e['tps']:.1f} | {h['tps']:.1f} | {e['tps'] / h['tps']:.2f}x "
            f"| {e['ttft_p50']:.3f} / {e['ttft_max']:.3f} | {h['ttft_p50']:.3f} | {baseline} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
