"""The request: wire schemas, validation, the model profile, refusals."""

__all__: list[str] = []
