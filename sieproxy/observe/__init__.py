"""Observability: metrics, the access log, and what one request records."""

__all__: list[str] = []
