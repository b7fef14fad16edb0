"""Shaping: events, per-choice parsers, and the streamed and whole responses."""

__all__: list[str] = []
