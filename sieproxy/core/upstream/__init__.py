"""The engine's side of the wire: protocols, HTTP/1.1 framing, SSE, discovery."""

__all__: list[str] = []
