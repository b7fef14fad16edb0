"""Tenants at admission: a request's model, quota and lease (``gate``), the counters it is
admitted and settled against, in process or shared through Redis (``limiter``,
``redis_store``), and the fair-share admission queue (``admission``). The keys file is read by
``settings/keys.py``, its reload and Redis tasks run in ``front/tenants.py``, and the
``sieproxy keys`` / ``sieproxy usage`` commands live in ``operations/tenants.py``."""

__all__: list[str] = []
