"""API surfaces: each one a strict schema, a mapping onto a generation, shapers."""

__all__: list[str] = []
