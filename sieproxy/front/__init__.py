"""The server front: intake of a request, the app's routes, and the fenced fast paths."""

__all__: list[str] = []
