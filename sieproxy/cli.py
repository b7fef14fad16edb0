"""``sieproxy`` command line: ``sieproxy serve [--config FILE] [--host H] [--port P]``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from functools import partial

import trio

from . import __version__
from .core.shaping.reasoning import REASONING_PARSERS
from .core.shaping.toolparse import TOOL_PARSERS
from .operations.child import PortInUse
from .operations.engine_check import check_engine_setup
from .operations.quickstart import ModelFlags, serve_settings
from .operations.tenants import add_parsers as add_tenancy_parsers
from .operations.tenants import run_command as run_tenancy_command
from .settings.load import ConfigError, as_dict, load_settings

__all__ = ["main"]

_DESCRIPTION = (
    "OpenAI- and Anthropic-compatible streaming gateway in front of SGLang and "
    "OpenAI-compatible engines."
)
_EPILOG = """\
examples:
  sieproxy serve                         the default model on the embedded CPU engine,
                                         API at http://127.0.0.1:8000/v1
  sieproxy serve --port 8001             a second instance next to the first
  sieproxy serve --engine URL           front one running engine (SGLang, or any
                                         OpenAI-compatible server: vLLM, llama.cpp, ...)
  sieproxy serve --config gateway.toml   the engines and models of a settings file
  sieproxy config --config gateway.toml  check a settings file, print the effective one

Ctrl-C drains the running streams (up to gateway.shutdown_grace); Ctrl-C again stops now.
Documentation: README.md and docs/ in the source tree."""


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="sieproxy", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=fmt
    )
    p.add_argument("--version", action="version", version=f"sieproxy {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{serve,config,keys,usage}")
    s = sub.add_parser(
        "serve",
        help="serve the gateway (default: the embedded CPU engine)",
        description="Serve the gateway. With no settings file: the default model\n"
        "(SmolLM2-135M-Instruct) on the embedded CPU engine.",
        epilog=_EPILOG,
        formatter_class=fmt,
    )
    s.add_argument(
        "--config", metavar="FILE", help="TOML settings file (default: $SIEPROXY_CONFIG, or none)"
    )
    s.add_argument("--host", help="listen address (default: gateway.host, 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default: gateway.port, 8000)")
    # One model, no configuration file (sieproxy.operations.quickstart; refused with --config).
    m = s.add_mutually_exclusive_group()
    m.add_argument("--model", help="run the embedded CPU engine on PATH (a Hugging Face "
                   "model directory or a .gguf file; default: SmolLM2-135M-Instruct)")  # fmt: skip
    m.add_argument("--engine", metavar="URL",
                   help="front a running engine at URL instead: an SGLang server, or any "
                   "OpenAI-compatible one (found by its /v1/models)")  # fmt: skip
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: from the directory or file "
                   "name, or the engine's served_model_name or its one model's id)")  # fmt: skip
    family = "(default: from the model family where reliable; none: no parser)"
    s.add_argument("--tool-parser", choices=[*sorted(TOOL_PARSERS), "none"],
                   help=f"tool-call parser {family}")  # fmt: skip
    s.add_argument("--reasoning-parser", choices=[*sorted(REASONING_PARSERS), "none"],
                   help=f"reasoning parser {family}")  # fmt: skip
    c = sub.add_parser(
        "config",
        help="print the effective settings (tokens redacted)",
        description="Check the settings and print the effective ones (tokens redacted).",
    )
    c.add_argument(
        "--config", metavar="FILE", help="TOML settings file (default: $SIEPROXY_CONFIG, or none)"
    )
    add_tenancy_parsers(sub)  # keys, usage (sieproxy/operations/tenants.py)
    return p


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed start (a bind), also inside Trio's exception groups."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _os_error(exc.exceptions[0])
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd in ("keys", "usage"):
        try:
            return run_tenancy_command(args, load_settings(args.config, keys=False))
        except ConfigError as exc:
            print(f"sieproxy: {exc}", file=sys.stderr)
            return 2
    flags = ModelFlags(**{k: getattr(args, k, None) for k in ModelFlags.__dataclass_fields__})
    try:
        settings = serve_settings(args.config, flags)
        where = args.config or os.environ.get("SIEPROXY_CONFIG") or "(settings)"
        check_engine_setup(settings, where)  # the embedded engine's own parser, nothing started
    except ConfigError as exc:
        print(f"sieproxy: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "config":
        print(json.dumps(as_dict(settings), indent=2))
        return 0
    if args.host:
        settings.gateway.host = args.host
    if args.port is not None:
        settings.gateway.port = args.port
    logging.basicConfig(
        level=settings.gateway.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every upstream request (health checks included) at INFO: too chatty.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    logging.getLogger("httpcore").setLevel(max(logging.WARNING, logging.root.level))
    from .operations.serve import serve, tune_gc

    tune_gc()
    try:
        forced = trio.run(partial(serve, settings, config_path=args.config))
    except ConfigError as exc:
        print(f"sieproxy: configuration error: {exc}", file=sys.stderr)
        return 2
    except PortInUse as exc:
        print(f"sieproxy: cannot start: {exc}", file=sys.stderr)
        return 1
    except (OSError, BaseExceptionGroup) as exc:  # the port taken after claim_ports' check
        err = _os_error(exc)
        if err is None:
            raise
        print(f"sieproxy: cannot start: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        # Stopping: a late signal must not become a traceback or a non-zero status now. A
        # handler, not SIG_IGN: an ignored signal would stay ignored in any process started
        # from this one later (exec keeps SIG_IGN; it resets handlers).
        signal.signal(signal.SIGINT, _late_signal)
        signal.signal(signal.SIGTERM, _late_signal)
    return 130 if forced else 0


def _late_signal(signum: int, frame: object) -> None:
    """Signals after the gateway stopped: it is exiting anyway."""


if __name__ == "__main__":
    sys.exit(main())
