"""The surface seam: a new API surface is one module, and intake, admission, the relay and the
pool serve it unchanged.

The toy surface here (``POST /v1/shout``) is written the way a new surface is written — a
strict schema, a mapping onto the internal generation, a shaper for its whole output and its
own error envelope — and handed to ``build_app``; nothing else of the gateway knows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import trio

from sieproxy.core.errors import GatewayError, UnsupportedField
from sieproxy.core.planning.plan import plan_completion
from sieproxy.core.planning.prepared import Collected, Prepared, find_profile
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.schemas import CompletionRequest
from sieproxy.core.request.validate import check_completion
from sieproxy.core.shaping.merger import CompletionCollector
from sieproxy.surfaces import SURFACES, ErrorAnswer, Surface

from .harness import MODEL, running_gateway


class ShoutRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    text: str
    max_tokens: int = 4


class _Shouted(CompletionCollector):
    """The whole answer, upper-cased, in the toy's own shape."""

    def result(self) -> bytes:
        self._check_done()
        c = self.choices[0]
        return msgspec.json.encode(
            {"shout": c.content.upper(), "tokens": c.completion_tokens, "why": c.finish_reason}
        )


class ShoutSurface(Surface):
    name = "shout"
    path = "/v1/shout"

    def prepare(
        self,
        raw: bytes,
        profiles: Mapping[str, ModelProfile],
        *,
        request_id: str,
        created: int,
        model: str | None = None,
    ) -> Prepared:
        try:
            req = msgspec.json.decode(raw, type=ShoutRequest)
        except msgspec.ValidationError as exc:
            raise UnsupportedField(f"Not a shout: {exc}.") from exc
        profile = find_profile(profiles, model or req.model)
        completion = CompletionRequest(
            model=profile.name, prompt=req.text, max_tokens=req.max_tokens
        )
        valid = check_completion(completion, profile)
        body = plan_completion(valid, profile, request_id=request_id)
        shaper = _Shouted(valid, response_id=request_id, model=profile.name, created=created)
        return Prepared(
            model=profile.name,
            n=1,
            stream=False,
            bodies=[body],
            shaper=Collected(shaper),
            affinity_key=None,
            kind="completion",
        )

    def error(self, err: GatewayError) -> ErrorAnswer:
        body = msgspec.json.encode({"toy_error": err.message, "status": err.status})
        return err.status, err.headers, body


SHOUT = ShoutSurface()


async def test_a_new_surface_is_served_through_the_seam_alone() -> None:
    async with running_gateway(surfaces=(*SURFACES, SHOUT)) as gw:
        with trio.fail_after(30):
            r = await gw.client.post("/v1/shout", json={"model": MODEL, "text": "hi"})
            assert r.status_code == 200, r.text
            got: dict[str, Any] = r.json()
            assert got["tokens"] == 4 and got["why"] == "length"
            assert got["shout"] and got["shout"] == got["shout"].upper()
            assert r.headers["x-request-id"]
            # its own envelope for its refusals, the gateway's statuses
            r = await gw.client.post("/v1/shout", json={"model": MODEL, "text": "hi", "x": 1})
            assert r.status_code == 400 and "toy_error" in r.json(), r.text
            r = await gw.client.post("/v1/shout", json={"model": "nope", "text": "hi"})
            assert r.status_code == 404 and r.json()["status"] == 404, r.text
            r = await gw.client.get("/v1/shout")
            assert r.status_code == 405
            # the metrics name it like any other endpoint
            metrics = (await gw.client.get("/metrics")).text
            assert 'endpoint="shout"' in metrics
            # the built-in surfaces are unaffected
            r = await gw.chat(max_tokens=2)
            assert r.status_code == 200, r.text


async def test_a_surface_not_listed_is_not_served() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(30):
            r = await gw.client.post("/v1/shout", json={"model": MODEL, "text": "hi"})
            assert r.status_code == 404, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
