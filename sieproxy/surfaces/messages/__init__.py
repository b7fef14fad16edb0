"""``POST /v1/messages``: the request mapping and the shaper."""

__all__: list[str] = []
