"""Operations: serving, signals and graceful stop, the embedded engine child."""

__all__: list[str] = []
