"""Settings: the configuration's tables and defaults, the checks that name the key, loading."""

__all__: list[str] = []
