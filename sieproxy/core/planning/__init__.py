"""Planning: templates, grammars, the affinity key, engine bodies."""

__all__: list[str] = []
