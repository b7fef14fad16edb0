"""``POST /v1/responses`` in the core: the contract table through ``build_responses``, the
mapping to the chat request, and the shaper's items and events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sieproxy.core.errors import RequestError
from sieproxy.core.pipeline import build_responses
from tests.contract_cases import PROFILES, Case, body_bytes
from tests.responses_cases import RESPONSES_CASES


def build(body: dict[str, Any] | bytes, rid: str = "r1") -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return build_responses(raw, PROFILES, request_id=rid, created=1700000000)


@pytest.mark.parametrize("case", RESPONSES_CASES, ids=lambda c: c.id)
def test_contract_table(case: Case) -> None:
    if case.status == 200:
        prepared = build(body_bytes(case))
        assert prepared.n == 1 and len(prepared.bodies) == 1
        return
    with pytest.raises(RequestError) as info:
        build(body_bytes(case))
    err = info.value
    assert (err.status, err.code, err.param) == (case.status, case.code, case.param), err.message
    assert err.message.endswith(".")
    if case.param != "messages":  # a chat word only where the client sent it
        assert "`messages" not in err.message and "tool_call_id" not in err.message


def test_table_ids_are_unique() -> None:
    ids = [c.id for c in RESPONSES_CASES]
    assert len(ids) == len(set(ids))
