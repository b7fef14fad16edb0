"""The ``/v1/messages/count_tokens`` answer: the shaper that reports the prompt's token count."""

from __future__ import annotations

import msgspec

from ...core.errors import GatewayError, InternalError
from ...core.shaping.choice import ChoiceState
from ...core.shaping.events import CandidateDelta, CandidateFinish

__all__ = ["CountShaper"]

_enc = msgspec.json.Encoder()


class CountShaper:
    """``/v1/messages/count_tokens``: the engine prefills the rendered prompt (no output
    token), and the answer is the prompt's token count it reported, ``{"input_tokens": N}``."""

    def __init__(self) -> None:
        self.ends: list[tuple[int, str]] = []
        self.choices = [ChoiceState(0, collect=False, ends=self.ends)]

    def start(self) -> bytes:
        return b""

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes:
        self.choices[index].feed(delta)
        return b""

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes:
        self.choices[index].finish(finish)
        return b""

    def on_error(self, err: GatewayError) -> bytes:  # never streamed: the status line has it
        raise err

    def end(self) -> bytes:
        choice = self.choices[0]
        if not choice.finished:
            raise InternalError("Internal error: the count ended before the engine finished.")
        return _enc.encode({"input_tokens": choice.prompt_tokens})
