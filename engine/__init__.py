"""The engine side of sieproxy: what runs next to the accelerators.

- :mod:`engine.fake` — a scripted fake engine speaking SGLang's native HTTP protocol, for tests
  and benchmarks;
- :mod:`engine.supervisor` — a process supervisor (readiness, restart with backoff, clean stop);
- :mod:`engine.cli` — the ``sieproxy-engine`` command (``launch``, ``fake``, ``serve``);
- :mod:`engine.cpu` — the CPU engine (torch) speaking the same wire subset.

The gateway package ``sieproxy`` is never imported from here: the two share only the wire
protocol described in ``SGLANG-NATIVE-PROTOCOL.md``.
"""

from importlib import metadata

try:
    __version__ = metadata.version("sieproxy")
except metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
