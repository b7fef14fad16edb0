"""``hypercorn --worker-class trio 'sieproxy.asgi:app'``: the app built from ``$SIEPROXY_CONFIG``.

Each Hypercorn worker process imports this module and builds its own state (pools, health
checks, client); the gateway keeps no shared state, so workers scale out behind one port.
"""

import logging
from collections.abc import Callable

from .front.hypercorn_io import install as install_hypercorn_io
from .operations.serve import build_app, tune_gc
from .settings.load import load_settings

__all__ = ["app"]

_settings = load_settings()
logging.basicConfig(
    level=_settings.gateway.log_level.upper(),
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
)
logging.getLogger("httpx").setLevel(logging.WARNING)
app = build_app(_settings)
tune_gc()
_uninstall: list[Callable[[], None]] = []


@app.before_serving
async def _install_front() -> None:
    """At the app's start, not at import: Hypercorn's worker picks its connection class after
    the app has started and before it accepts the first connection."""
    _uninstall.append(install_hypercorn_io(fast=_settings.gateway.fast_paths))


@app.after_serving
async def _uninstall_front() -> None:
    while _uninstall:
        _uninstall.pop()()
