"""What a surface hands the shell: a validated, planned generation (:class:`Prepared`).

A surface (``sieproxy/surfaces/``) turns request bytes into a :class:`Prepared`: one engine body
per candidate (``core/planning/plan.py``) and the response shaper that turns candidate events
into the surface's bytes. The relay, the pool and the fallbacks know a request only through
this value; a shaper that collects a whole answer is adapted to the streaming interface by
:class:`Collected`, so the relay drives every surface the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..errors import GatewayError, NotFound
from ..request.aliases import resolve_alias
from ..request.profile import ModelProfile
from ..request.refusal import RequestFields
from ..shaping.choice import ChoiceState
from ..shaping.events import CandidateDelta, CandidateFinish

__all__ = ["Collected", "Collector", "Prepared", "Shaper", "find_profile"]


class Shaper(Protocol):
    """The sans-IO response builder the relay drives (a surface's stream, or a
    :class:`Collected`)."""

    def start(self) -> bytes: ...

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes: ...

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes: ...

    def on_error(self, err: GatewayError) -> bytes: ...

    def end(self) -> bytes: ...

    @property
    def choices(self) -> Sequence[ChoiceState]:
        """One state per choice: the tokens the engines reported (``Prepared.usage``)."""
        ...

    #: The core's decisions to end candidates, as they are made: ``(index, cause)``, the
    #: cause ``"stop"`` (a stop string matched) or ``"best_of"`` (it can no longer be
    #: returned). The merger acts on them and empties the list.
    ends: list[tuple[int, str]]


class Collector(Protocol):
    """A shaper that builds one whole body (``ChatCollector``, ``CompletionCollector``, ...)."""

    choices: Any
    ends: list[tuple[int, str]]

    def on_delta(self, index: int, delta: CandidateDelta) -> None: ...

    def on_finish(self, index: int, finish: CandidateFinish) -> None: ...

    def result(self) -> bytes: ...


class Collected:
    """Adapts a collector to the stream interface the shell drives (one body at the end)."""

    __slots__ = ("choices", "collector", "ends")

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.choices = collector.choices
        self.ends = collector.ends

    def start(self) -> bytes:
        return b""

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes:
        self.collector.on_delta(index, delta)
        return b""

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes:
        self.collector.on_finish(index, finish)
        return b""

    def on_error(self, err: GatewayError) -> bytes:  # never after a non-streaming start
        raise err

    def end(self) -> bytes:
        return self.collector.result()


@dataclass(slots=True)
class Prepared:
    """A validated, planned request: engine bodies and the response shaper."""

    model: str
    n: int
    stream: bool
    bodies: list[dict[str, Any]]
    shaper: Shaper  # a surface's stream shaper, or a :class:`Collected`
    affinity_key: str | None
    #: The prompt's prefix-affinity key, used when ``affinity_key`` is None (model routing
    #: ``prefix``).
    prefix_key: str | None = None
    #: The request's names for what an engine may refuse (``core.request.refusal.explain``).
    fields: RequestFields = field(default_factory=RequestFields)
    #: The engine-side generation: a chat (messages, rendered or passed through) or a raw
    #: prompt completion. Protocols build the upstream request from it, never from the surface.
    kind: Literal["chat", "completion"] = "chat"

    def usage(self) -> tuple[int, int]:
        """(prompt tokens once, completion tokens summed) over what the engines reported."""
        choices = self.shaper.choices
        prompt = max((c.prompt_tokens for c in choices), default=0)
        return prompt, sum(c.completion_tokens for c in choices)


def find_profile(profiles: Mapping[str, ModelProfile], model: str) -> ModelProfile:
    """The served model ``model`` (or the one it is an alias of: ``core/request/aliases.py``),
    or 404 ``model_not_found`` naming ``param: "model"``."""
    profile = profiles.get(model) or resolve_alias(profiles, model)
    if profile is None:
        raise NotFound(
            f"The model {model!r} does not exist; GET /v1/models lists the served models.",
            param="model",
            code="model_not_found",
        )
    return profile
