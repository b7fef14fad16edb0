"""The ``POST /v1/messages`` request contract as a data table (no tests here), and the shape
of Claude Code's own requests.

Same shape as :mod:`tests.contract_cases` (a :class:`~tests.contract_cases.Case` per body, with
``endpoint="messages"``): ``status`` 200 for an accepted request, or 400 with the gateway's
``code`` (checked in the core; Anthropic's envelope has no code) and ``param`` (in the core; over
HTTP it leads the message). ``tests/core/test_messages.py`` drives the table through
``MESSAGES.prepare``; ``tests/shell/test_messages.py`` posts it to a gateway in front of a fake
engine and through the ``anthropic`` SDK. Models: ``test-model`` (image input) and
``text-model``.
"""

from __future__ import annotations

from typing import Any

from tests.contract_cases import INVALID, PNG_B64, UNSUPPORTED, Case

__all__ = ["CLAUDE_CODE_TOOLS", "MESSAGES_CASES", "claude_code_body"]

_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C and sunny"}
_USER = {"role": "user", "content": "What is the weather in Paris?"}
_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
_EPHEMERAL = {"type": "ephemeral"}


def _M(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "test-model",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Hello!"}],
    }
    body.update(fields)
    return body


def _turns(*messages: Any, **fields: Any) -> dict[str, Any]:
    return _M(messages=list(messages), **fields)


def _round_trip(result: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return _turns(
        _USER,
        {"role": "assistant", "content": [_USE]},
        {"role": "user", "content": [result or _RESULT]},
        tools=[_TOOL],
        **fields,
    )


def ok(id: str, body: dict[str, Any] | bytes) -> Case:
    return Case(id, "messages", body, 200, None, None)


def bad(id: str, body: dict[str, Any] | bytes, param: str | None, code: str = INVALID) -> Case:
    return Case(id, "messages", body, 400, code, param)


#: Claude Code's 24 tools (names as it sends them; the schemas are shortened).
CLAUDE_CODE_TOOLS = [
    "Task", "Bash", "Glob", "Grep", "ExitPlanMode", "Read", "Edit", "Write", "NotebookEdit",
    "WebFetch", "TodoWrite", "WebSearch", "BashOutput", "KillShell", "Skill", "SlashCommand",
    "AskUserQuestion", "EnterPlanMode", "LSP", "ListMcpResourcesTool", "ReadMcpResourceTool",
    "TaskOutput", "TaskStop", "MultiEdit",
]  # fmt: skip


def _cc_tool(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"The {name} tool.",
        "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"command": {"type": "string", "description": "What to do."}},
            "required": ["command"],
            "additionalProperties": False,
        },
    }


def claude_code_body(
    model: str = "claude-sonnet-5", *, follow_up: bool = False, adaptive: bool = False
) -> dict[str, Any]:
    """A request shaped as Claude Code 2.1 sends it (``POST /v1/messages?beta=true``): system
    text blocks with ``cache_control``, 24 tools, ``metadata.user_id``, ``max_tokens`` 32000,
    ``thinking``, ``context_management``, ``output_config``, a ``system`` message after the
    first user message; ``follow_up``: the next turn, with the assistant's ``thinking`` and
    ``tool_use`` blocks and a ``tool_result`` carrying ``cache_control``."""
    first_user = {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>\nAs you answer, use the context.\n"
                                     "</system-reminder>"},
            {"type": "text", "text": "say hi", "cache_control": _EPHEMERAL},
        ],
    }  # fmt: skip
    messages: list[dict[str, Any]] = [
        first_user,
        {"role": "system", "content": "The user's working directory is /tmp/project."},
    ]
    if follow_up:
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should look.", "signature": "sig=="},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_01A", "name": "Bash",
                     "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "README.md",
                     "is_error": False, "cache_control": _EPHEMERAL},
                ],
            },
        ]  # fmt: skip
    return {
        "model": model,
        "messages": messages,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; "
                                     "cc_entrypoint=cli;"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": _EPHEMERAL},
            {"type": "text", "text": "You are an interactive CLI tool that helps users with "
                                     "software engineering tasks.", "cache_control": _EPHEMERAL},
        ],
        "tools": [_cc_tool(name) for name in CLAUDE_CODE_TOOLS],
        "metadata": {"user_id": "user_0a1b_account__session_3f2e"},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"} if adaptive else
                    {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }  # fmt: skip


MESSAGES_CASES: list[Case] = [
    # ---- accepted
    ok("msg-minimal", _M()),
    ok("msg-text-model", _M(model="text-model")),
    ok("msg-stream", _M(stream=True)),
    ok("msg-system-string", _M(system="Answer briefly.")),
    ok("msg-system-blocks", _M(system=[{"type": "text", "text": "Be brief.",
                                        "cache_control": _EPHEMERAL}])),
    ok("msg-text-blocks", _turns({"role": "user", "content": [{"type": "text", "text": "Hi"}]})),
    ok("msg-image-base64", _turns({"role": "user", "content": [_IMAGE, {"type": "text",
                                                                       "text": "What?"}]})),
    ok("msg-sampling", _M(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["END"])),
    ok("msg-metadata", _M(metadata={"user_id": "u-1"})),
    ok("msg-tools-auto", _M(tools=[_TOOL], tool_choice={"type": "auto"})),
    ok("msg-tools-any", _M(tools=[_TOOL], tool_choice={"type": "any"})),
    ok("msg-tools-tool", _M(tools=[_TOOL], tool_choice={"type": "tool", "name": "get_weather"})),
    ok("msg-tools-none", _M(tools=[_TOOL], tool_choice={"type": "none"})),
    ok("msg-tools-no-parallel", _M(tools=[_TOOL], tool_choice={
        "type": "auto", "disable_parallel_tool_use": True})),
    ok("msg-tools-custom-type", _M(tools=[{**_TOOL, "type": "custom",
                                           "cache_control": _EPHEMERAL}])),
    ok("msg-tools-empty", _M(tools=[])),
    ok("msg-round-trip", _round_trip()),
    ok("msg-tool-result-blocks", _round_trip({**_RESULT, "content": [
        {"type": "text", "text": "18C"}], "is_error": True, "cache_control": _EPHEMERAL})),
    ok("msg-tool-result-no-content",
       _round_trip({"type": "tool_result", "tool_use_id": "toolu_1"})),
    ok("msg-thinking-enabled", _M(thinking={"type": "enabled", "budget_tokens": 1024})),
    ok("msg-thinking-adaptive", _M(thinking={"type": "adaptive"})),
    ok("msg-thinking-disabled", _M(thinking={"type": "disabled"})),
    ok("msg-thinking-replayed", _turns(
        _USER,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "text", "text": "It is sunny."}]},
        {"role": "user", "content": "Thanks"})),
    ok("msg-system-message-mid", _turns(_USER, {"role": "system", "content": "Be brief."})),
    ok("msg-context-management", _M(context_management={"edits": []})),
    ok("msg-output-effort", _M(output_config={"effort": "low"})),
    ok("msg-output-format", _M(output_config={"format": {"type": "json_schema",
                                                         "schema": {"type": "object"}}})),
    ok("msg-service-tier", _M(service_tier="auto")),
    ok("msg-top-cache-control", _M(cache_control=_EPHEMERAL)),
    ok("msg-speed-standard", _M(speed="standard")),
    ok("msg-max-tokens-huge", _M(max_tokens=64000)),
    ok("msg-claude-code", claude_code_body("test-model")),
    ok("msg-claude-code-follow-up", claude_code_body("test-model", follow_up=True, adaptive=True)),
    # ---- refused: the body and the top level
    bad("msg-not-json", b"{", None),
    bad("msg-no-model", {"max_tokens": 5, "messages": [_USER]}, "model"),
    bad("msg-no-max-tokens", {"model": "test-model", "messages": [_USER]}, "max_tokens"),
    bad("msg-no-messages", {"model": "test-model", "max_tokens": 5}, "messages"),
    bad("msg-unknown-field", _M(frequency_penalty=0.5), "frequency_penalty", UNSUPPORTED),
    bad("msg-empty-model", _M(model=""), "model"),
    bad("msg-max-tokens-zero", _M(max_tokens=0), "max_tokens"),
    bad("msg-max-tokens-string", _M(max_tokens="5"), "max_tokens"),
    bad("msg-temperature-high", _M(temperature=1.5), "temperature"),
    bad("msg-top-p-zero", _M(top_p=0), "top_p"),
    bad("msg-top-k-zero", _M(top_k=0), "top_k"),
    bad("msg-stop-empty-string", _M(stop_sequences=["ok", ""]), "stop_sequences[1]"),
    bad("msg-container", _M(container="c-1"), "container", UNSUPPORTED),
    bad("msg-mcp-servers", _M(mcp_servers=[]), "mcp_servers", UNSUPPORTED),
    bad("msg-diagnostics", _M(diagnostics={"previous_message_id": "msg_1"}), "diagnostics",
        UNSUPPORTED),
    bad("msg-inference-geo", _M(inference_geo="us"), "inference_geo", UNSUPPORTED),
    bad("msg-speed-fast", _M(speed="fast"), "speed", UNSUPPORTED),
    bad("msg-metadata-unknown", _M(metadata={"user": "u"}), "metadata.user"),
    bad("msg-service-tier-bad", _M(service_tier="priority"), "service_tier"),
    bad("msg-thinking-no-budget", _M(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    bad("msg-thinking-low-budget", _M(thinking={"type": "enabled", "budget_tokens": 10}),
        "thinking.budget_tokens"),
    bad("msg-thinking-bad-type", _M(thinking={"type": "on"}), "thinking.type"),
    bad("msg-output-effort-bad", _M(output_config={"effort": "extreme"}), "output_config.effort"),
    # ---- refused: messages and blocks
    bad("msg-empty-messages", _M(messages=[]), "messages"),
    bad("msg-bad-role", _turns({"role": "tool", "content": "x"}), "messages[0].role"),
    bad("msg-prefill", _turns(_USER, {"role": "assistant", "content": "The weather"}),
        "messages[1]", UNSUPPORTED),
    bad("msg-empty-content", _turns({"role": "user", "content": []}), "messages[0].content"),
    bad("msg-unknown-block", _turns({"role": "user", "content": [
        {"type": "document", "source": {}}]}), "messages[0].content[0].type"),
    bad("msg-block-unknown-key", _turns({"role": "user", "content": [
        {"type": "text", "text": "x", "colour": "red"}]}), "messages[0].content[0].colour"),
    bad("msg-image-url", _turns({"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}),
        "messages[0].content[0].source"),
    bad("msg-image-bad-base64", _turns({"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "bm90IGFuIGltYWdl"}}]}),
        "messages[0].content[0].source"),
    bad("msg-image-text-model", _turns({"role": "user", "content": [_IMAGE]}, model="text-model"),
        "messages[0].content[0]", UNSUPPORTED),
    bad("msg-image-in-assistant", _turns(_USER, {"role": "assistant", "content": [_IMAGE]},
                                         {"role": "user", "content": "x"}),
        "messages[1].content[0].type"),
    bad("msg-tool-use-in-user", _turns({"role": "user", "content": [_USE]}),
        "messages[0].content[0].type"),
    bad("msg-thinking-in-user", _turns({"role": "user", "content": [
        {"type": "thinking", "thinking": "x", "signature": "s"}]}),
        "messages[0].content[0].type"),
    bad("msg-tool-result-unknown-id", _round_trip({**_RESULT, "tool_use_id": "toolu_9"}),
        "messages[2].content[0].tool_use_id"),
    bad("msg-tool-result-image", _round_trip({**_RESULT, "content": [_IMAGE]}),
        "messages[2].content[0].content[0]", UNSUPPORTED),
    bad("msg-tool-use-dup-id", _turns(
        _USER, {"role": "assistant", "content": [_USE, _USE]}, {"role": "user", "content": "x"},
        tools=[_TOOL]), "messages[1].content[1].id"),
    bad("msg-tool-use-input-string", _turns(
        _USER, {"role": "assistant", "content": [{**_USE, "input": "{}"}]},
        {"role": "user", "content": "x"}), "messages[1].content[0].input"),
    # ---- refused: tools
    bad("msg-tool-no-schema", _M(tools=[{"name": "f"}]), "tools[0].input_schema"),
    bad("msg-tool-bad-name", _M(tools=[{**_TOOL, "name": "has space"}]), "tools[0].name"),
    bad("msg-tool-dup-name", _M(tools=[_TOOL, _TOOL]), "tools[1].name"),
    bad("msg-tool-server", _M(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "tools[0].type", UNSUPPORTED),
    bad("msg-tool-unknown-key", _M(tools=[{**_TOOL, "colour": 1}]), "tools[0].colour"),
    bad("msg-tool-choice-no-tools", _M(tool_choice={"type": "any"}), "tool_choice"),
    bad("msg-tool-choice-unknown", _M(tools=[_TOOL], tool_choice={"type": "tool", "name": "nope"}),
        "tool_choice.name"),
    bad("msg-tool-choice-no-name", _M(tools=[_TOOL], tool_choice={"type": "tool"}),
        "tool_choice.name"),
    bad("msg-tool-choice-bad-type", _M(tools=[_TOOL], tool_choice={"type": "required"}),
        "tool_choice.type"),
    bad("msg-forced-with-format", _M(tools=[_TOOL], tool_choice={"type": "any"}, output_config={
        "format": {"type": "json_schema", "schema": {"type": "object"}}}),
        "output_config.format"),
]
