"""``sieproxy`` command line: ``sieproxy serve [--config FILE] [--host H] [--port P]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from functools import partial

import trio

from .core.reasoning import REASONING_PARSERS
from .core.toolparse import TOOL_PARSERS
from .quickstart import ModelFlags, serve_settings
from .settings import ConfigError, as_dict

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sieproxy", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the gateway (default: the embedded CPU engine)")
    s.add_argument("--config", help="TOML settings file (default: $SIEPROXY_CONFIG or none)")
    s.add_argument("--host", help="listen address (overrides gateway.host)")
    s.add_argument("--port", type=int, help="listen port (overrides gateway.port)")
    # One model, no configuration file (sieproxy.quickstart; refused together with --config).
    m = s.add_mutually_exclusive_group()
    m.add_argument("--model", help="run the embedded CPU engine on PATH (a Hugging Face "
                   "model directory or a .gguf file; default: SmolLM2-135M-Instruct)")  # fmt: skip
    m.add_argument("--engine", metavar="URL",
                   help="front a running SGLang server at URL instead")  # fmt: skip
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: from the directory or file "
                   "name, or the engine's served_model_name)")  # fmt: skip
    family = "(default: from the model family where reliable; none: no parser)"
    s.add_argument("--tool-parser", choices=[*sorted(TOOL_PARSERS), "none"],
                   help=f"tool-call parser {family}")  # fmt: skip
    s.add_argument("--reasoning-parser", choices=[*sorted(REASONING_PARSERS), "none"],
                   help=f"reasoning parser {family}")  # fmt: skip
    c = sub.add_parser("config", help="print the effective settings (tokens redacted)")
    c.add_argument("--config")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    flags = ModelFlags(**{k: getattr(args, k, None) for k in ModelFlags.__dataclass_fields__})
    try:
        settings = serve_settings(args.config, flags)
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
    from .serve import serve, tune_gc

    tune_gc()
    try:
        trio.run(partial(serve, settings, config_path=args.config))
    except ConfigError as exc:
        print(f"sieproxy: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
