"""A candidate's state table and its token step (``sieproxy.candidate``), with a scripted
reader: what every driver (candidate task, inline reader, relay pump) relies on."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import trio

from sieproxy.core.errors import EngineTruncated, GatewayError
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.relay.candidate import SHOWN, TRANSITIONS, Candidate, Phase, Step

LIVE = (Phase.NEW, Phase.SENT, Phase.STREAMING)
ENDED = (Phase.FINISHED, Phase.STOPPED, Phase.CANCELLED, Phase.FAILED)


class _Reader:
    """Each read is one scripted ``(events, error)``; ``finish`` marks the terminal event."""

    def __init__(self, reads: list[tuple[list[Any], GatewayError | None]]) -> None:
        self.reads = reads
        self.done = False
        self.finished = False

    def feed(self, raw: bytes) -> tuple[list[Any], GatewayError | None]:
        events, err = self.reads.pop(0)
        if any(isinstance(e, CandidateFinish) for e in events):
            self.finished = self.done = True
        return events, err

    def local_finish(self, reason: str = "abort") -> CandidateFinish:
        return CandidateFinish(reason, None, 0, 0)


def test_every_phase_answers_every_step_and_an_ended_candidate_stays_ended() -> None:
    for phase, step in itertools.product(Phase, Step):
        if phase in ENDED:
            assert TRANSITIONS[phase, step] is phase
        elif step in (Step.STOP, Step.CANCEL, Step.FAIL):
            expected = {Step.STOP: Phase.STOPPED, Step.CANCEL: Phase.CANCELLED}
            assert TRANSITIONS[phase, step] is expected.get(step, Phase.FAILED)
    assert TRANSITIONS[Phase.NEW, Step.SEND] is Phase.SENT
    assert TRANSITIONS[Phase.SENT, Step.HEAD] is Phase.STREAMING
    assert TRANSITIONS[Phase.STREAMING, Step.FINISH] is Phase.FINISHED
    # Out of order is a bug, not a state: the table has no entry for it.
    for bad in [(Phase.NEW, Step.HEAD), (Phase.NEW, Step.FINISH), (Phase.SENT, Step.FINISH)]:
        assert bad not in TRANSITIONS


def test_the_token_step_indexes_events_and_records_the_engines_finish() -> None:
    delta, fin = CandidateDelta(" a", 1), CandidateFinish("stop", None, 3, 2)
    c = Candidate(4, _Reader([([delta], None), ([fin], None)]))  # type: ignore[arg-type]
    c.mark_sent()
    c.to(Step.HEAD)
    assert c.step(b"x") == ([(4, delta)], None) and c.phase is Phase.STREAMING
    assert c.step(b"y") == ([(4, fin)], None)
    assert c.engine_done and c.phase is Phase.FINISHED
    assert c.step(b"past [DONE]") == ([], None)  # read to the end, dropped


def test_the_token_step_passes_the_error_with_the_events_before_it() -> None:
    delta, err = CandidateDelta(" a", 1), EngineTruncated()
    c = Candidate(0, _Reader([([delta], err)]))  # type: ignore[arg-type]
    assert c.step(b"x") == ([(0, delta)], err)


@pytest.mark.parametrize("cause", ["stop", "best_of", "client", "stall", "shutdown", "done"])
def test_the_first_cause_ends_the_candidate_and_cancels_its_task(cause: str) -> None:
    c = Candidate(0, _Reader([]))  # type: ignore[arg-type]
    c.scope = trio.CancelScope()
    c.mark_sent()
    c.end(cause)
    c.end("error")  # a later cause does not replace it
    assert c.cause == cause and c.scope.cancel_called
    assert c.phase is (Phase.STOPPED if cause in SHOWN else Phase.CANCELLED)


def test_a_decision_after_the_engines_finish_keeps_it_finished() -> None:
    fin = CandidateFinish("length", None, 3, 2)
    c = Candidate(0, _Reader([([fin], None)]))  # type: ignore[arg-type]
    c.mark_sent()
    c.to(Step.HEAD)
    c.step(b"x")
    c.end("stop")  # the merger matched a stop string in an earlier delta of the same read
    assert c.phase is Phase.FINISHED and c.cause == "stop" and c.engine_done


def test_a_refused_request_needs_no_abort() -> None:
    c = Candidate(0, _Reader([]))  # type: ignore[arg-type]
    c.mark_sent()
    assert c.sent
    c.refused()
    c.to(Step.FAIL)
    assert not c.sent and c.phase is Phase.FAILED
