"""``python -m bench serve``: load any OpenAI- or Anthropic-compatible deployment and report
latency, throughput and goodput (the user's guide is the top of docs/BENCH-METHOD.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from bench.serve import output, prom
from bench.serve.arrivals import KINDS
from bench.serve.client import PATHS, Endpoint, auth_headers, endpoint_url, metrics_url, tls_verify
from bench.serve.loop import Load, ProgressBar, run
from bench.serve.metrics import SLO_NAMES, figures, parse_slos
from bench.serve.workloads import (
    DATASET_TURNS,
    Conversation,
    Lengths,
    TextMaker,
    Tokenizer,
    multi_turn,
    read_jsonl,
    read_sharegpt,
    read_trace,
    shared_prefix,
    synthetic,
)

WORKLOADS = ("synthetic", "shared-prefix", "multi-turn", "dataset", "trace")
#: ``--output-len`` when not given (a dataset's or a trace's own lengths come first).
OUTPUT_LEN = Lengths.parse("128")


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas: {s!r}") from None


def _ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas: {s!r}") from None
    if any(x < 1 for x in v):
        raise argparse.ArgumentTypeError(f"concurrencies are at least 1: {s!r}")
    return v


def _lengths(s: str) -> Lengths:
    try:
        return Lengths.parse(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="load any OpenAI/Anthropic-compatible URL: latency, throughput, goodput",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 or "
                   "https://host/v1 (the endpoint's path is appended)")
    g.add_argument("--model", required=True, help="the model name sent in every request")
    g.add_argument("--endpoint", choices=sorted(PATHS), default="chat",
                   help="chat: /v1/chat/completions; completions: /v1/completions; messages: "
                   "Anthropic's /v1/messages")
    g.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY, or "
                   "$ANTHROPIC_API_KEY with --endpoint messages")
    g.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="an extra request header (repeatable)")
    g.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    g.add_argument("--ca-file", default=None, help="trust this CA bundle (PEM) for https")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every body")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM/SGLang) so replies have exactly their length")
    g.add_argument("--request-timeout", type=float, default=600.0, help="s per request")
    g.add_argument("--metrics-url", default=None, help="the server's Prometheus metrics "
                   "(default: the base URL's /metrics; 'none' turns scraping off)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="default: dataset with --dataset, trace with --trace, else synthetic")
    w.add_argument("--input-len", type=_lengths, default=Lengths.parse("256"),
                   help="prompt tokens: N, uniform:LO,HI or normal:MEAN,SD")
    w.add_argument("--output-len", type=_lengths, default=None,
                   help=f"max_tokens of each request, a distribution as --input-len "
                   f"({OUTPUT_LEN.a:g} if not given); a ShareGPT --dataset asks for its "
                   "recorded replies' lengths unless this is given; a JSONL record's own "
                   "length comes first")
    w.add_argument("--prefix-count", type=int, default=4, help="shared-prefix: system prompts")
    w.add_argument("--prefix-len", type=_lengths, default=None,
                   help="shared-prefix (default 1024) and multi-turn (default none): system "
                   "prompt tokens")
    w.add_argument("--turns", type=_lengths, default=Lengths.parse("4"),
                   help="multi-turn: turns per conversation")
    w.add_argument("--think-time", type=float, default=0.0, help="multi-turn: s between turns")
    w.add_argument("--dataset", type=Path, default=None,
                   help="ShareGPT JSON (.json) or JSONL (.jsonl) prompts")
    w.add_argument("--dataset-turns", choices=DATASET_TURNS, default="first",
                   help="a ShareGPT --dataset: send each conversation's first human turn "
                   "alone (first), or all its human turns as one multi-turn conversation "
                   "that resends its history (all)")
    w.add_argument("--trace", type=Path, default=None,
                   help="JSONL with a timestamp (ms) per request, replayed on its schedule")
    w.add_argument("--trace-speed", type=float, default=1.0, help="2: replay twice as fast")
    w.add_argument("--tokenizer", default=None, help="count tokens with this Hugging Face "
                   "tokenizer (name or path); default: the server's usage")
    w.add_argument("--seed", type=int, default=0)
    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=_ints, default=None,
                    help="fixed concurrency (closed loop); a list sweeps: 1,4,16")
    ld.add_argument("--request-rate", type=_floats, default=None,
                    help="requests/s (open loop; inf: all at once); a list sweeps: 1,2,4")
    ld.add_argument("--arrival", choices=KINDS, default="poisson",
                    help="the open loop's arrival process")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma arrivals: shape; the gaps' CV is 1/sqrt(burstiness)")
    ld.add_argument("--max-concurrency", type=int, default=None,
                    help="open loop: at most this many requests in flight")
    ld.add_argument("--num-requests", type=int, default=None,
                    help="requests per load point (default 100 without --duration)")
    ld.add_argument("--duration", type=float, default=None, help="s per load point")
    ld.add_argument("--warmup-requests", type=int, default=0,
                    help="requests sent before each point and not counted")
    o = p.add_argument_group("figures and output")
    o.add_argument("--slo", action="append", default=[], metavar="NAME=MS",
                   help=f"goodput SLO (repeatable); NAME one of {', '.join(SLO_NAMES)}")
    o.add_argument("--results-dir", type=Path, default=None,
                   help="write results.json, requests.jsonl, SVG plots and report.html here "
                   "(nothing is written without it)")
    o.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="the progress bar on stderr (auto: when stderr is a terminal)")
    p.set_defaults(func=main)


def _fail(message: str) -> NoReturn:
    """A bad command line: the reason on stderr, exit status 2 (as argparse's own errors)."""
    print(f"python -m bench serve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check(p: argparse.Namespace) -> None:
    """Reject a contradictory command line."""
    if p.concurrency and p.request_rate:
        _fail("give --concurrency (closed loop) or --request-rate (open loop), not both; "
              "--max-concurrency caps an open loop")
    if p.trace is not None and (p.concurrency or p.request_rate):
        _fail("a --trace sets its own schedule; drop --concurrency and --request-rate")
    if p.dataset_turns != "first" and (p.dataset is None or p.dataset.suffix == ".jsonl"):
        _fail(f"--dataset-turns {p.dataset_turns} replays a ShareGPT --dataset (.json); a JSONL "
              "record's messages are always sent whole")


def _workload(a: argparse.Namespace, tok: Tokenizer | None) -> tuple[str, Iterator[Conversation]]:
    rng = random.Random(a.seed)
    text = TextMaker(rng, tok)
    out = a.output_len or OUTPUT_LEN
    kind = a.workload or ("trace" if a.trace else "dataset" if a.dataset else "synthetic")
    if kind == "trace":
        if a.trace is None:
            raise ValueError("--workload trace needs --trace FILE")
        return kind, iter(read_trace(a.trace, text, out, rng, tok, a.trace_speed))
    if kind == "dataset":
        if a.dataset is None:
            raise ValueError("--workload dataset needs --dataset FILE")
        try:
            if a.dataset.suffix == ".jsonl":
                convs = read_jsonl(a.dataset, text, out, rng, tok)
            else:
                convs = read_sharegpt(a.dataset, tok, a.output_len, rng, a.dataset_turns)
        except ValueError as exc:
            raise ValueError(f"--dataset {exc}") from None
        return kind, itertools.cycle(convs)
    if kind == "shared-prefix":
        return kind, shared_prefix(text, a.prefix_count, a.prefix_len or Lengths.parse("1024"),
                                   a.input_len, out, rng)
    if kind == "multi-turn":
        return kind, multi_turn(text, a.turns, a.input_len, out, rng, a.prefix_len)
    return kind, synthetic(text, a.input_len, out, rng)


def _loads(a: argparse.Namespace) -> tuple[str, list[tuple[float, Load]]]:
    common: dict[str, Any] = {"num_requests": a.num_requests, "duration_s": a.duration,
                              "think_s": a.think_time, "seed": a.seed}
    if common["num_requests"] is None and common["duration_s"] is None and a.trace is None:
        common["num_requests"] = 100
    if a.trace is not None:
        return "trace", [(0.0, Load(trace=True, max_concurrency=a.max_concurrency, **common))]
    if a.request_rate:
        return "request rate (/s)", [
            (r, Load(rate=r, arrival=a.arrival, burstiness=a.burstiness,
                     max_concurrency=a.max_concurrency, **common)) for r in a.request_rate]
    return "concurrency", [(float(c), Load(concurrency=c, **common))
                           for c in (a.concurrency or [1])]


def config(a: argparse.Namespace, ep: Endpoint, workload: str, axis: str,
           mets: str | None) -> dict[str, Any]:
    """The run's full configuration, as the JSON records it (the API key left out)."""
    args = {k: (str(v) if isinstance(v, Path | Lengths) else v) for k, v in vars(a).items()
            if k not in ("func", "api_key", "cmd")}
    args["header"] = [h.split(":", 1)[0] + ": …" for h in a.header]
    return {"command": "python -m bench " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "url": ep.url, "model": ep.model,
            "endpoint": ep.kind, "workload": workload, "sweep_axis": axis,
            "metrics_url": mets, "api_key_set": bool(ep.headers.get("Authorization")
                                                      or ep.headers.get("x-api-key")),
            "args": args}


def main(a: argparse.Namespace) -> int:
    import httpx
    import trio

    _check(a)
    try:
        slos = parse_slos(a.slo)
        extra = json.loads(a.extra_body) if a.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        bad = [h for h in a.header if ":" not in h or not h.split(":", 1)[0].strip()]
        if bad:
            raise ValueError(f"--header {bad[0]!r}: expected 'Name: value'")
        headers = dict(h.split(":", 1) for h in a.header)
    except ValueError as exc:
        _fail(str(exc))
    env = "ANTHROPIC_API_KEY" if a.endpoint == "messages" else "OPENAI_API_KEY"
    key = a.api_key or os.environ.get(env)
    ep = Endpoint(a.endpoint, endpoint_url(a.base_url, a.endpoint), a.model,
                  {**auth_headers(a.endpoint, key),
                   **{k.strip(): v.strip() for k, v in headers.items()}},
                  extra, a.ignore_eos, a.request_timeout)
    mets = None if a.metrics_url == "none" else (a.metrics_url or metrics_url(a.base_url))
    tok = Tokenizer(a.tokenizer) if a.tokenizer else None
    try:
        workload, convs = _workload(a, tok)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    axis, loads = _loads(a)
    bar = {"auto": None, "on": True, "off": False}[a.progress]

    async def go() -> list[output.Point]:
        points = []
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(verify=tls_verify(a.insecure, a.ca_file), limits=limits,
                                     timeout=httpx.Timeout(a.request_timeout)) as client:
            for x, load in loads:
                if a.warmup_requests and not load.trace:  # a trace's requests are its own
                    c = load.concurrency or load.max_concurrency or a.warmup_requests
                    await run(client, ep, convs, Load(concurrency=min(c, a.warmup_requests),
                                                      num_requests=a.warmup_requests), tok,
                              ProgressBar(f"warm-up ({load.label()})", load, bar))
                before = await prom.scrape(client, mets) if mets else None
                recs = await run(client, ep, convs, load, tok,
                                 ProgressBar(load.label(), load, bar))
                after = await prom.scrape(client, mets) if mets else None
                points.append(output.Point(load.label(), x, recs, figures(recs, slos),
                                           prom.report(mets, before, after)))
        return points

    points = trio.run(go)
    sys.stdout.write(output.terminal(points))
    if a.results_dir is not None:
        written = output.write(a.results_dir, config(a, ep, workload, axis, mets), points, axis)
        print(f"(wrote {', '.join(str(p) for p in written)})", file=sys.stderr)
    if all(p.figures["completed"] == 0 for p in points):
        print("bench serve: no request succeeded", file=sys.stderr)
        return 1
    return 0
