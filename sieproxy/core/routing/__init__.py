"""Routing on the engines' cache: the KV-block index and the ranking on it."""

__all__: list[str] = []
