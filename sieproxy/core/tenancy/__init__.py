"""Tenants' arithmetic: token quotas and the fair share of the fleet's slots."""

__all__: list[str] = []
