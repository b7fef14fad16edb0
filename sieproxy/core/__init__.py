"""The sans-IO core (see docs/DESIGN.md): no I/O, no clock, no framework imports."""

__all__: list[str] = []
