"""API surfaces: each one a strict schema, a mapping onto a generation, and shapers.

``SURFACES`` lists the surfaces the gateway serves; intake routes ``POST`` on each one's path
to it (``sieproxy/front/intake.py``). The seam is :class:`~.base.Surface`.
"""

from .base import ErrorAnswer, Surface
from .chat import CHAT
from .completions import COMPLETIONS
from .messages import COUNT_TOKENS, MESSAGES
from .responses import RESPONSES

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "MESSAGES",
    "RESPONSES",
    "SURFACES",
    "ErrorAnswer",
    "Surface",
]

#: The surfaces served by default, in the order the OpenAPI document lists them.
SURFACES: tuple[Surface, ...] = (CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS)
