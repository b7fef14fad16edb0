"""The ``sieproxy-engine`` command (its ``--help`` is ``HELP`` below)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import trio

from engine.supervisor import ChildSpec, Supervisor, SupervisorError, supervise_until_signal

__all__ = ["build_launch_parser", "launch_spec", "main", "sglang_argv"]

_USAGE = "usage: sieproxy-engine {launch,fake,serve,prepare} [args]  (see --help of each)"

HELP = f"""\
{_USAGE}

Engines that speak SGLang's native HTTP protocol, and a supervisor for them.

commands:
  serve [args]     the CPU engine (torch): SmolLM2-135M-Instruct by default, or a Hugging
                   Face model directory or a .gguf file (--model); see serve --help
  prepare [--model M]
                   the CPU engine's one-time work ahead of its first start: convert the model
                   into ~/.cache/sieproxy/models/ and build the decode kernels (cached under
                   ~/.cache/torch_extensions); serve does both when needed, this only moves
                   the wait (about a minute on a fresh machine) out of the first start
  fake [args]      the scripted fake engine, for tests and benchmarks; see fake --help
  check serve|fake [args]
                   check serve's or fake's arguments with their own parser, and that serve's
                   model exists, starting nothing: exit 0, or 2 with the problem on stderr
                   (the gateway checks its embedded engine's settings so)
  launch --sglang [--host H] [--port P] [options] -- SGLANG ARGS
                   run python -m sglang.launch_server supervised: ready when GET /health
                   answers 200, restarted with backoff on a crash, stopped cleanly (SIGTERM to
                   its process group, then SIGKILL) on SIGTERM or SIGINT; see launch --help
  launch --health-url URL [options] -- COMMAND
                   the same for any command

options:
  -h, --help       this text
  --version        the version

examples:
  sieproxy-engine prepare
  sieproxy-engine serve --port 30000
  sieproxy-engine serve --model ./Qwen2.5-0.5B-Instruct --port 30001 --threads 4
  sieproxy-engine fake --port 30000 --itl-ms 20
  sieproxy-engine launch --sglang --port 30000 -- --model-path Qwen/Qwen2.5-7B-Instruct
"""

#: Set by the gateway for its embedded engine: the read end of a pipe whose write end only the
#: gateway holds. End-of-file there means the gateway is gone (however it died).
PARENT_FD_ENV = "SIEPROXY_PARENT_FD"


def watch_parent(environ: dict[str, str] | None = None) -> None:
    """Stop this process (SIGTERM to itself, exit after 10 s) once its gateway is gone."""
    env = os.environ if environ is None else environ
    raw = env.pop(PARENT_FD_ENV, "")
    if not raw.isdigit():
        return
    fd = int(raw)

    def wait() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        with contextlib.suppress(OSError):  # (stderr may be a pipe the gateway read: gone)
            print("[sieproxy-engine] the gateway that started me is gone; stopping",
                  file=sys.stderr)  # fmt: skip
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        os._exit(1)

    threading.Thread(target=wait, name="parent-watch", daemon=True).start()


def sglang_argv(
    host: str,
    port: int,
    args: Sequence[str],
    *,
    python: str | None = None,
    module: str = "sglang.launch_server",
) -> list[str]:
    """The command line that starts an SGLang server on ``host:port`` with extra ``args``."""
    return [python or sys.executable, "-m", module, "--host", host, "--port", str(port), *args]


def _connect_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def build_launch_parser() -> argparse.ArgumentParser:
    """The ``launch`` subcommand's parser (the child's argv comes after ``--``)."""
    p = argparse.ArgumentParser(
        prog="sieproxy-engine launch",
        description="Run an engine process supervised.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: sieproxy-engine launch --sglang --port 30000 -- "
        "--model-path Qwen/Qwen2.5-7B-Instruct --incremental-streaming-output",
    )
    p.add_argument("--sglang", action="store_true", help="run python -m sglang.launch_server")
    p.add_argument("--host", default="127.0.0.1", help="--sglang: the server's host")
    p.add_argument("--port", type=int, default=30000, help="--sglang: the server's port")
    p.add_argument("--python", default=None, help="--sglang: interpreter (None: this one)")
    p.add_argument("--sglang-module", default="sglang.launch_server", help=argparse.SUPPRESS)
    p.add_argument("--health-url", default=None, help="readiness URL (None: with --sglang "
                   "http://HOST:PORT/health, else ready once spawned)")  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds (model load)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between probes")
    p.add_argument("--backoff-initial", type=float, default=1.0, help="first restart delay, s")
    p.add_argument("--backoff-max", type=float, default=60.0, help="longest restart delay, s")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="consecutive failures tolerated (None: unlimited)")  # fmt: skip
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL")  # fmt: skip
    return p


def launch_spec(argv: Sequence[str]) -> ChildSpec:
    """Parse ``launch`` arguments (``[options] -- child args``) into a :class:`ChildSpec`."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        own, child = argv[:cut], argv[cut + 1 :]
    else:
        own, child = argv, []
    parser = build_launch_parser()
    args = parser.parse_args(own)
    health = args.health_url
    if args.sglang:
        child = sglang_argv(
            args.host, args.port, child, python=args.python, module=args.sglang_module
        )
        if health is None:
            health = f"http://{_connect_host(args.host)}:{args.port}/health"
    elif not child:
        parser.error("nothing to run: give --sglang, or a command after --")
    return ChildSpec(
        argv=child,
        health_url=health,
        ready_timeout=args.ready_timeout,
        poll_interval=args.poll_interval,
        backoff_initial=args.backoff_initial,
        backoff_max=args.backoff_max,
        max_restarts=args.max_restarts,
        stop_timeout=args.stop_timeout,
    )


def _launch(argv: Sequence[str]) -> int:
    spec = launch_spec(argv)

    def ready(sup: Supervisor) -> None:
        print(f"sieproxy-engine: ready (pid {sup.pid}, start {sup.starts})", file=sys.stderr)

    try:
        trio.run(lambda: supervise_until_signal(spec, on_ready=ready))
    except SupervisorError as exc:
        print(f"sieproxy-engine: {exc}", file=sys.stderr)
        return 1
    return 0


def _prepare(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="sieproxy-engine prepare",
        description="Convert the model into the cache and build the decode kernels, ahead of "
        "the first start.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: sieproxy-engine prepare --model ./model.gguf",
    )
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct), an HF model dir or a .gguf file",
    )
    args = parser.parse_args(list(argv))
    from engine.cpu.kernels import load_kernels  # type: ignore[import-not-found,unused-ignore]
    from engine.cpu.model_store import resolve_model  # type: ignore[import-not-found,unused-ignore]

    path = resolve_model(args.model)
    print(f"sieproxy-engine: model ready at {path}", file=sys.stderr)
    kernels = load_kernels()
    state = "built" if kernels is not None else "unavailable (torch ops will be used)"
    print(f"sieproxy-engine: decode kernels {state}", file=sys.stderr)
    return 0


def _check(argv: Sequence[str]) -> int:
    """``check serve|fake [args]``: the command's own parser (argparse exits 2 with its
    message) and, for ``serve``, the model's lookup without converting or loading it."""
    if not argv or argv[0] not in ("serve", "fake"):
        print("sieproxy-engine check: give serve or fake, then its arguments", file=sys.stderr)
        return 2
    if argv[0] == "fake":
        from engine.fake import build_parser

        build_parser().parse_args(list(argv[1:]))
        return 0
    from engine.cpu.model_store import ModelNotFoundError, check_model  # type: ignore[import-not-found,unused-ignore]
    from engine.cpu.server import parse_args  # type: ignore[import-not-found,unused-ignore]

    args = parse_args(list(argv[1:]))
    try:
        check_model(args.model)
    except ModelNotFoundError as exc:
        print(f"sieproxy-engine serve: error: argument --model: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sieproxy-engine``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP if argv else _USAGE, file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    if argv[0] == "--version":
        from engine import __version__

        print(f"sieproxy-engine {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    watch_parent()
    if command == "launch":
        return _launch(rest)
    if command == "fake":
        from engine.fake import main as fake_main

        return fake_main(rest)
    if command == "serve":
        from engine.cpu.server import main as serve_main  # type: ignore[import-not-found,unused-ignore]

        return int(serve_main(rest) or 0)
    if command == "prepare":
        return _prepare(rest)
    if command == "check":
        return _check(rest)
    print(f"sieproxy-engine: unknown command {command!r}\n{_USAGE}", file=sys.stderr)
    return 2
