"""Constrained decoding: ``response_format`` and ``tool_choice`` → one SGLang grammar key.

SGLang accepts at most one of ``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag`` per
request, each a *string*. Validation already refuses ``response_format`` together with a forcing
``tool_choice``; when ``response_format`` meets ``tool_choice: "auto"``, the response format wins
and tool calls are generated free (and parsed afterwards).

Decisions
---------
``response_format``
    ``text`` → no constraint; ``json_object`` → ``json_schema = '{"type": "object"}'``;
    ``json_schema`` → ``json_schema = json.dumps(schema)`` (a schema-less ``json_schema`` format
    is treated as ``json_object``). As SGLang's OpenAI layer does.

``tool_choice`` (see :func:`tool_plan`)
    - no tools, or ``"none"``: the template sees no tools, nothing is constrained, no tool parser.
    - ``"auto"`` (the default with tools): the template sees every tool, generation is free and the
      profile's ``tool_parser`` (may be ``None``: then calls are not parsed) reads the output.
      Exception, mirroring SGLang's "strict" handling: if a tool declares ``strict: true`` and the
      profile's parser is ``hermes`` / ``qwen25`` / ``qwen`` (or always, for ``smollm2``: a
      format the gateway teaches a model not trained on it), a trigger-based *legacy* xgrammar
      structural tag (``{"type": "structural_tag", "structures": [...], "triggers":
      ["<tool_call>"]}``, the shape SGLang's own OpenAI layer sends) constrains the arguments of
      any call the model chooses to open, while text outside calls stays free.
    - ``"required"`` or a named function: a **JSON-array** constraint, whatever the profile's
      parser. Output is ``[{"name": <fn>, "parameters": {...}}, ...]`` with ``minItems: 1`` and
      a ``maxItems`` bound, each item an ``anyOf`` branch per allowed function whose
      ``parameters`` is that function's schema. The bound is 1 for a named function (OpenAI
      forces exactly one call) and for ``parallel_tool_calls: false``, else the profile's
      ``max_tool_calls``: a small model otherwise writes call after call until ``max_tokens``
      cuts one mid-JSON. After each complete call the grammar allows ``]`` as well as ``,``, so
      the model can close the list at any point after the first. The response side
      parses it with the ``"json_array"`` parser. Why not a model-native structural tag:
      trigger-based tags do not force a call ("required" would not be guaranteed), the newer
      ``triggered_tags`` ``at_least_one`` form needs a recent xgrammar on the engine, and a JSON
      schema is the one grammar every SGLang backend (xgrammar, llguidance, outlines) and the
      project's CPU engine accept. This is what SGLang does when no tool parser is configured.
      A named choice also shows only that function to the template (SGLang's rule).
    - Tool schemas with local ``$defs`` / ``definitions``: ``#/$defs/X`` references resolve
      against the document root, so each function's definitions are hoisted to the root of the
      array schema; two functions defining the same name differently is a 400 on ``tools``.

Tools in the prompt (:func:`with_tools_in_prompt`)
    A model whose chat template never reads ``tools`` (SmolLM2's) would not see them. For such a
    template (see :func:`sieproxy.core.planning.template.template_renders_tools`) the gateway
    shows the template's tools in a :func:`tools_section`, placed like the response-format section
    below (appended to the first system message, or a new first system message). The section lists
    each function as compact JSON and, when the request's parser has a known format
    (:data:`TOOL_CALL_FORMATS`), one example call of the first tool in that format: the
    JSON-array form when the call is forced, the profile's ``tool_parser`` format under
    ``"auto"``. Always on for such templates (no setting): tools the model cannot see cannot be
    called. Under ``"auto"`` (a call in the profile's format) the section is followed by a
    one-turn example: a user message holding the first tool's description (``Call <name>.``
    without one) and an assistant message holding the example call. Measured on SmolLM2-135M:
    with the section alone the model never opened a call; with the example turn it opened one
    for most tool requests and still answered prose for others.

``schema_in_prompt`` (:func:`with_schema_in_prompt`)
    A ``json_schema`` response format is also shown to the model, unless the request says
    ``schema_in_prompt: false`` (absent → ``profile.schema_in_prompt``) or some message already
    contains the schema as JSON (whitespace-insensitive text match, or a JSON object in a message
    that parses equal to the schema). The section is :func:`response_formats_section`::

        # Response Formats

        ## <name>

        // <description>
        <compact schema>

    (OpenAI's harmony layout: ``<name>`` is ``json_schema.name`` or ``response``, the
    description line only when a description is given, the schema as
    ``json.dumps(schema, separators=(",", ":"), ensure_ascii=False)``). It is appended to the
    first system message, after a blank line (as its own text part for content-part arrays); with
    no system message a new one holding just the section is inserted at the start.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from ..request.profile import ModelProfile
from ..request.schemas import NamedToolChoice, Tool
from ..request.valid import ValidChat

__all__ = [
    "JSON_ARRAY_PARSER",
    "NATIVE_TAG_PARSERS",
    "RESPONSE_FORMATS_HEADER",
    "TOOLS_HEADER",
    "TOOL_CALL_FORMATS",
    "Constraint",
    "ToolPlan",
    "json_array_tool_schema",
    "response_format_constraint",
    "response_formats_section",
    "schema_in_prompt_enabled",
    "tool_constraint",
    "tool_plan",
    "tool_structural_tag",
    "tools_section",
    "with_schema_in_prompt",
    "with_tools_in_prompt",
]

#: ``(sampling_params key, value)``: the one grammar of a request.
Constraint = tuple[str, str]

#: The response-side parser for the JSON-array tool constraint.
JSON_ARRAY_PARSER = "json_array"

#: Profile tool parsers whose ``<tool_call>`` format the legacy structural tag can express.
NATIVE_TAG_PARSERS = frozenset({"hermes", "qwen25", "qwen", "smollm2"})
#: Parsers whose calls are constrained under ``"auto"`` even without a ``strict`` tool.
ALWAYS_TAGGED_PARSERS = frozenset({"smollm2"})

RESPONSE_FORMATS_HEADER = "# Response Formats"
TOOLS_HEADER = "# Tools"

#: Per tool parser, how one example call is written: ``(before, arguments key, after)``.
TOOL_CALL_FORMATS: dict[str, tuple[str, str, str]] = {
    "hermes": ("<tool_call>\n", "arguments", "\n</tool_call>"),
    "qwen25": ("<tool_call>\n", "arguments", "\n</tool_call>"),
    "qwen": ("<tool_call>\n", "arguments", "\n</tool_call>"),
    "llama3": ("", "parameters", ""),
    JSON_ARRAY_PARSER: ("[", "parameters", "]"),
    "smollm2": ("<tool_call>[", "arguments", "]</tool_call>"),
}

_JSON_OBJECT = '{"type": "object"}'
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


# ---------------------------------------------------------------- response_format


def _response_schema(valid: ValidChat) -> dict[str, Any] | None:
    rf = valid.req.response_format
    if rf is None or rf.type != "json_schema" or rf.json_schema is None:
        return None
    return rf.json_schema.schema_


def response_format_constraint(valid: ValidChat) -> Constraint | None:
    """The grammar for ``response_format`` (``None`` for ``text`` or no format)."""
    rf = valid.req.response_format
    if rf is None or rf.type == "text":
        return None
    schema = _response_schema(valid)
    if schema is None:
        return ("json_schema", _JSON_OBJECT)
    return ("json_schema", json.dumps(schema, ensure_ascii=False))


# ---------------------------------------------------------------- tools


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What ``tools`` / ``tool_choice`` mean for one request.

    ``template_tools``: the tools the chat template sees (``None``: none). ``constraint``: the
    grammar (``None``: free generation). ``parser``: the response side's tool-call parser
    (``None``: tool calls are not parsed). ``active``: tools are in play (the engine must then
    keep special tokens, so tool tags survive detokenization).
    """

    template_tools: list[dict[str, Any]] | None
    constraint: Constraint | None
    parser: str | None
    active: bool


def _tool_dict(tool: Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        fn["description"] = tool.function.description
    if tool.function.parameters is not None:
        fn["parameters"] = tool.function.parameters
    return {"type": "function", "function": fn}


def _params(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or dict(_EMPTY_PARAMS)


_DEF_KEYS = ("$defs", "definitions")


def _hoist_defs(tools: list[Tool]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each tool's parameters without local definitions, and the definitions to put at the root."""
    roots: dict[str, dict[str, Any]] = {}
    params: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        p = _params(tool)
        if any(k in p for k in _DEF_KEYS):
            p = dict(p)
            for key in _DEF_KEYS:
                defs = p.pop(key, None)
                if not isinstance(defs, dict):
                    continue
                bucket = roots.setdefault(key, {})
                for name, schema in defs.items():
                    if name in bucket and bucket[name] != schema:
                        raise InvalidRequest(
                            f"Tools define `{key}.{name}` differently; rename one of them.",
                            param=f"tools[{i}].function.parameters",
                        )
                    bucket[name] = schema
        params.append(p)
    return params, roots


def json_array_tool_schema(
    tools: list[Tool], *, parallel: bool = True, max_items: int | None = None
) -> dict[str, Any]:
    """The JSON-array constraint: ``[{"name": fn, "parameters": {...}}, ...]``, at least one.

    ``max_items`` bounds the calls (``maxItems``); ``parallel=False`` makes the bound 1.
    """
    params, defs = _hoist_defs(tools)
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": p,
            },
            "required": ["name", "parameters"],
        }
        for tool, p in zip(tools, params, strict=True)
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if not parallel:
        max_items = 1
    if max_items is not None:
        schema["maxItems"] = max_items
    schema.update(defs)
    return schema


def tool_structural_tag(tools: list[Tool], parser: str) -> str:
    """A legacy xgrammar structural tag for ``<tool_call>`` calls (``hermes`` / ``qwen25``).

    One structure per tool; a ``strict`` tool's arguments follow its parameters, the others only
    have to be a JSON object. Calls are optional (trigger-based); text around them is free.
    """
    nl = "" if parser in ("hermes", "smollm2") else "\n"
    bracket = "[" if parser == "smollm2" else ""
    strict = parser in ALWAYS_TAGGED_PARSERS
    structures = [
        {
            "begin": (
                f"<tool_call>{nl}{bracket}"
                f'{{"name": {json.dumps(t.function.name)}, "arguments": '
            ),
            "schema": _params(t) if strict or t.function.strict else {"type": "object"},
            "end": f"}}{bracket and ']'}{nl}</tool_call>",
        }
        for t in tools
    ]
    return json.dumps(
        {"type": "structural_tag", "structures": structures, "triggers": ["<tool_call>"]},
        ensure_ascii=False,
    )


def _allowed(valid: ValidChat) -> list[Tool]:
    tools = list(valid.req.tools or ())
    choice = valid.req.tool_choice
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise InvalidRequest(
                f"tool_choice names `{choice.function.name}`, which is not in `tools`.",
                param="tool_choice",
            )
        return named[:1]
    return tools


def tool_plan(valid: ValidChat, profile: ModelProfile) -> ToolPlan:
    """Decide template tools, grammar and parser for the request's tools (module docstring)."""
    choice = valid.req.tool_choice
    if not valid.req.tools or choice == "none":
        return ToolPlan(None, None, None, active=False)
    allowed = _allowed(valid)
    template_tools = [_tool_dict(t) for t in allowed]
    if choice == "required" or isinstance(choice, NamedToolChoice):
        named = isinstance(choice, NamedToolChoice)
        parallel = not named and valid.req.parallel_tool_calls is not False
        schema = json_array_tool_schema(
            allowed, parallel=parallel, max_items=profile.max_tool_calls
        )
        value = json.dumps(schema, ensure_ascii=False)
        return ToolPlan(template_tools, ("json_schema", value), JSON_ARRAY_PARSER, active=True)
    parser = profile.tool_parser
    constraint: Constraint | None = None
    strict = parser in ALWAYS_TAGGED_PARSERS or any(t.function.strict for t in allowed)
    if parser in NATIVE_TAG_PARSERS and strict:
        assert parser is not None
        constraint = ("structural_tag", tool_structural_tag(allowed, parser))
    return ToolPlan(template_tools, constraint, parser, active=True)


def tool_constraint(valid: ValidChat, profile: ModelProfile) -> tuple[str, str, str | None] | None:
    """``(sampling_key, value, parser_name)`` for the request's tool grammar, or ``None``.

    ``None`` means free generation (the parser, if any, is :attr:`ToolPlan.parser`).
    """
    plan = tool_plan(valid, profile)
    if plan.constraint is None:
        return None
    return (plan.constraint[0], plan.constraint[1], plan.parser)


# ---------------------------------------------------------------- schema in prompt


def schema_in_prompt_enabled(valid: ValidChat, profile: ModelProfile) -> bool:
    """The request's ``schema_in_prompt``, else the profile's default."""
    flag = valid.req.schema_in_prompt
    return profile.schema_in_prompt if flag is None else flag


def _compact(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def response_formats_section(
    schema: dict[str, Any], *, name: str | None = None, description: str | None = None
) -> str:
    """The exact text shown to the model for a ``json_schema`` response format."""
    lines = [RESPONSE_FORMATS_HEADER, "", f"## {name or 'response'}", ""]
    if description:
        lines.append(f"// {description}")
    lines.append(_compact(schema))
    return "\n".join(lines)


_WS = re.compile(r"\s+")
_MAX_PARSE_ATTEMPTS = 64


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return []


def _contains_schema(text: str, schema: dict[str, Any], squeezed: str) -> bool:
    if squeezed in _WS.sub("", text):
        return True
    decoder = json.JSONDecoder()
    pos, attempts = text.find("{"), 0
    while pos != -1 and attempts < _MAX_PARSE_ATTEMPTS:
        attempts += 1
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            pos = text.find("{", pos + 1)
            continue
        if value == schema:
            return True
        pos = text.find("{", end)
    return False


def _already_shown(messages: list[dict[str, Any]], schema: dict[str, Any]) -> bool:
    squeezed = _WS.sub("", _compact(schema))
    return any(
        _contains_schema(text, schema, squeezed)
        for msg in messages
        for text in _texts(msg.get("content"))
    )


def with_schema_in_prompt(
    messages: list[dict[str, Any]], valid: ValidChat, profile: ModelProfile
) -> list[dict[str, Any]]:
    """``messages`` with the ``# Response Formats`` section added when it applies (a new list)."""
    schema = _response_schema(valid)
    if schema is None or not schema_in_prompt_enabled(valid, profile):
        return messages
    if _already_shown(messages, schema):
        return messages
    rf = valid.req.response_format
    assert rf is not None and rf.json_schema is not None
    section = response_formats_section(
        schema, name=rf.json_schema.name, description=rf.json_schema.description
    )
    return _add_to_system(messages, section)


def _add_to_system(messages: list[dict[str, Any]], section: str) -> list[dict[str, Any]]:
    """``section`` appended to the first system message, or as a new first one (a new list)."""
    out = list(messages)
    for i, msg in enumerate(out):
        if msg.get("role") != "system":
            continue
        content = msg.get("content")
        if isinstance(content, list):
            new_content: Any = [*content, {"type": "text", "text": section}]
        else:
            new_content = f"{content}\n\n{section}" if content else section
        out[i] = {**msg, "content": new_content}
        return out
    return [{"role": "system", "content": section}, *out]


# ---------------------------------------------------------------- tools in prompt


def _placeholder(schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return {"integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}.get(
        kind if isinstance(kind, str) else "", "..."
    )


def _example_call(function: dict[str, Any], parser: str) -> str:
    before, key, after = TOOL_CALL_FORMATS[parser]
    params = function.get("parameters") or {}
    props = params.get("properties") if isinstance(params, dict) else None
    props = props if isinstance(props, dict) else {}
    required = params.get("required") if isinstance(params, dict) else None
    names = [n for n in (required or []) if isinstance(n, str) and n in props] or list(props)[:1]
    args = {n: _placeholder(props[n]) for n in names}
    call = json.dumps({"name": function["name"], key: args}, ensure_ascii=False)
    return before + call + after


def tools_section(tools: list[dict[str, Any]], parser: str | None) -> str:
    """The exact text shown to a model whose template ignores ``tools`` (module docstring).

    ``tools`` are OpenAI ``{"type": "function", "function": {...}}`` dicts (at least one);
    ``parser`` picks the example call's format (none for a parser without a known format).
    """
    functions = [t["function"] for t in tools]
    lines = [TOOLS_HEADER, "", "You can call these tools:", "<tools>"]
    lines.extend(_compact(f) for f in functions)
    lines.append("</tools>")
    if parser is not None and parser in TOOL_CALL_FORMATS:
        lines += ["", "To call a tool, reply with only the call, in this format:"]
        lines.append(_example_call(functions[0], parser))
    return "\n".join(lines)


def with_tools_in_prompt(
    messages: list[dict[str, Any]], plan: ToolPlan, template_renders_tools: bool
) -> list[dict[str, Any]]:
    """``messages`` with the ``# Tools`` section when the template would not show the tools."""
    if template_renders_tools or not plan.template_tools:
        return messages
    parser = plan.parser.strip().lower().replace("-", "_") if plan.parser else None
    out = _add_to_system(messages, tools_section(plan.template_tools, parser))
    if parser is None or parser == JSON_ARRAY_PARSER or parser not in TOOL_CALL_FORMATS:
        return out
    first = plan.template_tools[0]["function"]
    example = [
        {"role": "user", "content": first.get("description") or f"Call {first['name']}."},
        {"role": "assistant", "content": _example_call(first, parser)},
    ]
    at = next(i for i, m in enumerate(out) if m.get("role") == "system") + 1
    return [*out[:at], *example, *out[at:]]
