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
from ..surfaces.messages.schema import (
    MESSAGES_KNOWN_REJECTED,
    CountTokensRequest,
    MessagesRequest,
    MTool,
)
from ..surfaces.responses.schema import (
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


#: Anthropic's error envelope, which the two Messages routes answer with.
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _anthropic_responses(ok_desc: str, stream: bool) -> dict[str, Any]:
    """The Messages routes' answers: Anthropic's envelope on every error."""
    out = _responses(ok_desc, "AnthropicError")
    if not stream:
        out["200"]["content"].pop("text/event-stream")
    out["429"] = {"description": "A tenant limit (Retry-After)", **out["400"]}
    return out


def _responses(ok_desc: str, error: str = "Error") -> dict[str, Any]:
    err = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}}
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
    (chat, comp, resp, item, tool, msgs, count, mtool), components = (
        msgspec.json.schema_components(
            [
                ChatCompletionRequest,
                CompletionRequest,
                ResponsesRequest,
                RItem,
                RFunctionTool,
                MessagesRequest,
                CountTokensRequest,
                MTool,
            ],
            ref_template="#/components/schemas/{name}",
        )
    )
    # ``input`` items and ``tools`` are decoded one by one (an item may omit its ``type``; a
    # built-in tool gets its own refusal), so their Struct fields are typed loosely: the
    # document shows what is accepted.
    props = components["ResponsesRequest"]["properties"]
    props["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": item}]}
    props["tools"] = {"anyOf": [{"type": "array", "items": tool}, {"type": "null"}]}
    components["RText"]["properties"].pop("verbosity", None)  # refused with a reason
    # Messages ``tools`` are decoded one by one too (another ``type`` gets its own refusal).
    for name in ("MessagesRequest", "CountTokensRequest"):
        tools = {"anyOf": [{"type": "array", "items": mtool}, {"type": "null"}]}
        components[name]["properties"]["tools"] = tools
    for name, rejected in (
        ("ChatCompletionRequest", CHAT_KNOWN_REJECTED),
        ("CompletionRequest", COMPLETIONS_KNOWN_REJECTED),
        ("ResponsesRequest", RESPONSES_KNOWN_REJECTED),
        ("MessagesRequest", MESSAGES_KNOWN_REJECTED),
        ("CountTokensRequest", MESSAGES_KNOWN_REJECTED),
    ):
        props = components[name]["properties"]
        for field in rejected:
            props.pop(field, None)
        components[name]["additionalProperties"] = False
    components["Error"] = _ERROR
    components["AnthropicError"] = _ANTHROPIC_ERROR
    headers = [
        {"name": h, "in": "header", "required": False, "schema": {"type": "string"}}
        for h in ("X-Request-Id", "X-SIE-Pool", "X-SIE-MACHINE-PROFILE", "X-SIE-SDK-Version")
    ]
    anthropic = [
        *headers,
        *(
            {"name": h, "in": "header", "required": False, "schema": {"type": "string"}}
            for h in ("x-api-key", "anthropic-version", "anthropic-beta")
        ),
        {"name": "beta", "in": "query", "required": False, "schema": {"type": "string"}},
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
            "/v1/messages": {
                "post": {
                    "operationId": "createMessage",
                    "parameters": anthropic,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": msgs}},
                    },
                    "responses": _anthropic_responses(
                        "Message (JSON, or SSE Messages events)", stream=True
                    ),
                }
            },
            "/v1/messages/count_tokens": {
                "post": {
                    "operationId": "countMessageTokens",
                    "parameters": anthropic,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": count}},
                    },
                    "responses": _anthropic_responses("`{\"input_tokens\": N}`", stream=False),
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
