"""sieproxy: an OpenAI-compatible streaming gateway (Trio) in front of SGLang engines."""

__version__ = "0.1.0"
__all__ = ["__version__"]
