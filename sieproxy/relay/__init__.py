"""The relay: one request's structured concurrency, candidates, attempts, merge."""

__all__: list[str] = []
