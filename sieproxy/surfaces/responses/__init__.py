"""``POST /v1/responses``: the request mapping and the shaper."""

__all__: list[str] = []
