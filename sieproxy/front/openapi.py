"""The gateway's OpenAPI document, generated from the request Structs (so it cannot drift)."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from .. import __version__
from ..core.request.schemas import (
    CHAT_KNOWN_REJECTED,
    COMPLETIONS_KNOWN_REJECTED,
    ChatCompletionRequest,
    CompletionRequest,
)
from ..surfaces.responses.request import (
    RESPONSES_KNOWN_REJECTED,
    ResponsesRequest,
    RFunctionTool,
    RItem,
)

__all__ = ["openapi_document"]

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _responses(ok_desc: str) -> dict[str, Any]:
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    out: dict[str, Any] = {
        "200": {
            "description": ok_desc,
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        }
    }
    for code, desc in (
        ("400", "Invalid or unsupported request"),
        ("401", "Missing or invalid bearer token"),
        ("404", "Model not found"),
        ("413", "Request body is too large"),
        ("500", "Worker emitted malformed response; auth enabled but no tokens configured"),
        ("503", "No ready engine, at capacity, or model loading (Retry-After)"),
    ):
        out[code] = {"description": desc, **err}
    return out


@functools.cache
def openapi_document() -> dict[str, Any]:
    (chat, comp, resp, item, tool), components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ResponsesRequest, RItem, RFunctionTool],
        ref_template="#/components/schemas/{name}",
    )
    # ``input`` items and ``tools`` are decoded one by one (an item may omit its ``type``; a
    # built-in tool gets its own refusal), so their Struct fields are typed loosely: the
    # document shows what is accepted.
    props = components["ResponsesRequest"]["properties"]
    props["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": item}]}
    props["tools"] = {"anyOf": [{"type": "array", "items": tool}, {"type": "null"}]}
    components["RText"]["properties"].pop("verbosity", None)  # refused with a reason
    for name, rejected in (
        ("ChatCompletionRequest", CHAT_KNOWN_REJECTED),
        ("CompletionRequest", COMPLETIONS_KNOWN_REJECTED),
        ("ResponsesRequest", RESPONSES_KNOWN_REJECTED),
    ):
        props = components[name]["properties"]
        for field in rejected:
            props.pop(field, None)
        components[name]["additionalProperties"] = False
    components["Error"] = _ERROR
    headers = [
        {"name": h, "in": "header", "required": False, "schema": {"type": "string"}}
        for h in ("X-Request-Id", "X-SIE-Pool", "X-SIE-MACHINE-PROFILE", "X-SIE-SDK-Version")
    ]
    return {
        "openapi": "3.1.0",
        "info": {"title": "sieproxy", "version": __version__},
        "paths": {
            "/v1/chat/completions": {
                "post": {
                    "operationId": "createChatCompletion",
                    "parameters": headers,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": chat}},
                    },
                    "responses": _responses("Chat completion (JSON or SSE)"),
                }
            },
            "/v1/completions": {
                "post": {
                    "operationId": "createCompletion",
                    "parameters": headers,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": comp}},
                    },
                    "responses": _responses("Text completion (JSON or SSE)"),
                }
            },
            "/v1/responses": {
                "post": {
                    "operationId": "createResponse",
                    "parameters": headers,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": resp}},
                    },
                    "responses": _responses("Response (JSON or SSE `response.*` events)"),
                }
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "responses": {"200": {"description": "Model list"}},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "operationId": "retrieveModel",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {"description": "Model object"},
                        "404": {"description": "Unknown model (`model_not_found`)"},
                    },
                }
            },
        },
        "components": {"schemas": components},
    }
