"""Tenants: API keys with models, a priority class and limits (``keys``), their admission and
settlement (``limiter``, ``redis_store``, ``gate``), the fair-share admission queue
(``admission``) and the ``sieproxy keys`` / ``sieproxy usage`` commands (``commands``)."""

__all__: list[str] = []
