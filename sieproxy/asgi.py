"""``hypercorn --worker-class trio 'sieproxy.asgi:app'``: the app built from ``$SIEPROXY_CONFIG``.

Each Hypercorn worker process imports this module and builds its own state (pools, health
checks, client); the gateway keeps no shared state, so workers scale out behind one port.
"""

from .serve import build_app
from .settings import load_settings

__all__ = ["app"]
app = build_app(load_settings())
