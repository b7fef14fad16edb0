"""The fleet: engine replicas, routing and admission, discovery, the upstream client."""

__all__: list[str] = []
