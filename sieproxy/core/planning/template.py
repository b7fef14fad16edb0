"""Chat templating: a validated chat request → the prompt text the engine completes.

Theory of operation
-------------------
The gateway renders the model's Jinja chat template itself (it sends ``text`` to ``/generate``),
so the rendering must equal what ``transformers``' ``tokenizer.apply_chat_template(messages,
tools=..., add_generation_prompt=True, tokenize=False, **kwargs)`` produces. The environment is
built the way transformers builds it: an ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` with the ``loopcontrols`` extension and a no-op ``{% generation %}`` block,
the ``tojson`` filter with transformers' semantics (``ensure_ascii=False``, ``indent``,
``separators`` and ``sort_keys`` options, no HTML escaping), the globals ``raise_exception``,
``strftime_now``, ``dict`` and an underscore-refusing ``namespace``. The render variables are the
profile's ``template_vars`` (``bos_token``, ``eos_token``, ...), overridden by the request's
``chat_template_kwargs`` (``enable_thinking``, ``guardian_config``), then ``messages``, ``tools``,
``documents=None`` and ``add_generation_prompt``. Each template source is compiled once (LRU cache
keyed by source).

Message conversion decisions (:func:`messages_for_template`):

- Roles are as validated (``developer`` already became ``system``). Keys whose value would be
  ``None`` are left out, as transformers does, so ``is defined`` tests behave.
- ``content`` that is a string stays a string; missing/``null`` content (an assistant turn that
  only carries ``tool_calls``) becomes ``""`` so templates that concatenate ``message['content']``
  (SmolLM2's does) do not fail on a legitimate replay.
- A content-part array becomes a list of ``{"type": "text", "text": ...}`` and ``{"type":
  "image"}`` dicts. At render time the list is kept when the template iterates over message
  content (detected from the template's AST, as SGLang and vLLM do: the "openai" content format)
  and flattened to a string otherwise: text parts joined with a single space in order (SGLang's
  rule), each image part replaced by the profile's ``template_vars["image_token"]`` (default
  ``<image>``) so a multimodal engine still finds one placeholder per ``image_data`` entry.
- Assistant ``tool_calls`` are OpenAI dicts ``{"id", "type": "function", "function": {"name",
  "arguments"}}`` with ``arguments`` parsed from its JSON string back to a value, as SGLang does:
  Qwen2.5 and Llama 3.1 templates apply ``| tojson`` to it and would otherwise double-encode it
  (Qwen3-style templates accept either). Arguments that are not valid JSON are passed as the
  original string.
- Tool messages carry ``tool_call_id`` (and ``name`` if the client sent one); ``refusal`` and
  ``reasoning_content`` of replayed assistant turns are dropped.

Failures: a template that calls ``raise_exception`` or fails in any other way while rendering is a
client error (400 ``invalid_request``, ``param`` ``messages`` or ``messages[i]``), never a 500. The
offending message is located by binary search over message prefixes (a bounded ``log2(n)`` extra
renders, only on the error path). The text a template passes to ``raise_exception`` is the
template author's message to users and is echoed (truncated); any other exception text is not.
A template source that does not compile is the operator's error: configuration loading calls
:func:`check_template` to refuse it at startup (should one reach a render anyway, it is a 500
``InternalError``).

Which tools the template sees (``tools``) is decided by
:func:`sieproxy.core.planning.grammar.tool_plan`
(OpenAI ``{"type": "function", "function": {...}}`` dicts, or ``None``). A template that never
reads the ``tools`` variable (:func:`template_renders_tools` is false: SmolLM2's) gets them shown
in a system-message section instead (:func:`sieproxy.core.planning.grammar.with_tools_in_prompt`).

No template configured → :func:`render_fallback`, a plain role-prefixed format (a seam for models
without a template; see its docstring).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InternalError, InvalidRequest
from ..request.profile import ModelProfile
from ..request.schemas import ChatMessage, ImagePart, InputImagePart, InputTextPart, TextPart
from ..request.valid import ValidChat

__all__ = [
    "DEFAULT_IMAGE_PLACEHOLDER",
    "check_template",
    "messages_for_template",
    "render_chat",
    "render_fallback",
    "template_renders_tools",
    "template_takes_content_parts",
]

#: Placeholder for an image part when the template takes string content only.
DEFAULT_IMAGE_PLACEHOLDER = "<image>"

# The longest `raise_exception` text echoed to a client.
_MAX_ECHO = 300


# ---------------------------------------------------------------- the jinja environment


class TemplateRaised(jinja2.TemplateError):
    """What the template's ``raise_exception(message)`` raises (its text may be shown to users)."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: no HTML escaping, non-ASCII kept, options exposed.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates without attribute access to the real type (as transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_ns_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError("underscore-prefixed namespace attribute")


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore-prefixed attributes (as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _check_ns_name(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_ns_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` renders its body (assistant-mask tracking is a
    training-time feature transformers offers; the gateway only needs the text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_env()


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    try:
        template = _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InternalError(
            "The model's chat template is invalid; check its configuration."
        ) from exc
    # Jinja copies a template's globals into every render's context; they are a ChainMap over
    # the environment's, copied key by key in Python (a quarter of a short render). The
    # environment's globals are set once, above, so a plain dict of them is the same mapping.
    template.globals = dict(template.globals)
    return template


def check_template(source: str) -> None:
    """Compile ``source`` (and cache it); raise :class:`ValueError` saying what is wrong and on
    which line if it is not valid Jinja (for the operator: configuration time only)."""
    try:
        _compile(source)
    except InternalError as exc:
        cause = exc.__cause__
        where = f" (line {cause.lineno})" if isinstance(cause, jinja2.TemplateSyntaxError) else ""
        raise ValueError(f"the chat template is not valid Jinja: {cause}{where}") from None
    template_takes_content_parts(source)


# ---------------------------------------------------------------- content format detection


def _is_content_access(node: jinja2.nodes.Node, names: set[str]) -> bool:
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return isinstance(arg, jinja2.nodes.Const) and arg.value == "content"
    if isinstance(node, jinja2.nodes.Name):
        return node.name in names
    return False


@lru_cache(maxsize=64)
def template_takes_content_parts(source: str) -> bool:
    """True when the template loops over a message's ``content`` (OpenAI content-part format).

    Like SGLang's and vLLM's detection: a ``{% for ... in X %}`` whose ``X`` is ``….content`` /
    ``…['content']`` (possibly through filters) or a variable ``{% set %}`` from one.
    """
    try:
        tree = _ENV.parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    names: set[str] = set()
    for assign in tree.find_all(jinja2.nodes.Assign):
        target = assign.target
        if isinstance(target, jinja2.nodes.Name) and _is_content_access(assign.node, set()):
            names.add(target.name)
    return any(_is_content_access(loop.iter, names) for loop in tree.find_all(jinja2.nodes.For))


@lru_cache(maxsize=64)
def template_renders_tools(source: str | None) -> bool:
    """True when the template reads the ``tools`` variable (``None``: the fallback, which does).

    A template that never names ``tools`` cannot show them to the model, whatever it is given.
    """
    if source is None:
        return True
    try:
        tree = _ENV.parse(source)
    except jinja2.TemplateSyntaxError:
        return True
    return "tools" in jinja2.meta.find_undeclared_variables(tree)


# ---------------------------------------------------------------- message conversion


def _content_parts(parts: Sequence[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, TextPart | InputTextPart):
            out.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart | InputImagePart):
            out.append({"type": "image"})
    return out


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _message(msg: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": msg.role}
    content = msg.content
    if isinstance(content, str):
        out["content"] = content
    elif isinstance(content, list):
        out["content"] = _content_parts(content)
    else:
        out["content"] = ""
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in msg.tool_calls
        ]
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    return out


def messages_for_template(valid: ValidChat) -> list[dict[str, Any]]:
    """The request's messages as the plain dicts a chat template reads (see module docstring)."""
    return [_message(m) for m in valid.req.messages]


def _flatten(parts: list[dict[str, Any]], image_placeholder: str) -> str:
    pieces = [
        p["text"] if p.get("type") == "text" else image_placeholder
        for p in parts
        if p.get("type") in ("text", "image")
    ]
    return " ".join(pieces)


def _adapt_content(
    messages: list[dict[str, Any]], parts_ok: bool, image_placeholder: str
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list) and not parts_ok:
            msg = {**msg, "content": _flatten(content, image_placeholder)}
        out.append(msg)
    return out


# ---------------------------------------------------------------- rendering


def render_fallback(
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt for a model with no chat template: a seam, not a model's real format.

    Format: if there are tools, a ``<|tools|>`` turn listing one compact JSON tool per line; then
    per message ``<|role|>\\ncontent\\n`` (content parts flattened, assistant tool calls as one
    compact JSON ``{"name", "arguments"}`` line each); then ``<|assistant|>\\n`` when
    ``add_generation_prompt``. Configure the model's real template for real use.
    """
    out: list[str] = []
    if tools:
        lines = [json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools]
        out.append("<|tools|>\n" + "\n".join(lines) + "\n")
    for msg in messages:
        content = msg.get("content", "")
        text = (
            _flatten(content, DEFAULT_IMAGE_PLACEHOLDER) if isinstance(content, list) else content
        )
        calls = [
            json.dumps(
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                ensure_ascii=False,
                separators=(",", ":"),
            )
            for c in msg.get("tool_calls", ())
        ]
        body = "\n".join([text, *calls]) if text else "\n".join(calls)
        out.append(f"<|{msg['role']}|>\n{body}\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


def _render(
    template: jinja2.Template,
    variables: dict[str, Any],
    messages: list[dict[str, Any]],
) -> str:
    return template.render({**variables, "messages": messages})


def _error_of(
    template: jinja2.Template, variables: dict[str, Any], msgs: list[dict[str, Any]]
) -> tuple[type[BaseException], str] | None:
    try:
        _render(template, variables, msgs)
    except Exception as exc:
        return (type(exc), str(exc))
    return None


def _locate(
    template: jinja2.Template,
    variables: dict[str, Any],
    messages: list[dict[str, Any]],
    error: tuple[type[BaseException], str],
) -> int | None:
    """The message whose inclusion first raises ``error`` (binary search over prefixes).

    Prefixes that fail *differently* (a template that needs a user turn, say) count as passing.
    ``None`` when even the empty conversation raises ``error``.
    """
    if _error_of(template, variables, []) == error:
        return None
    lo, hi = 1, len(messages)  # invariant: messages[:hi] raises `error`
    while lo < hi:
        mid = (lo + hi) // 2
        if _error_of(template, variables, messages[:mid]) == error:
            hi = mid
        else:
            lo = mid + 1
    return hi - 1


def render_chat(
    profile: ModelProfile,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render ``messages`` with the profile's chat template, as ``apply_chat_template`` would.

    ``template_kwargs`` (the request's ``chat_template_kwargs`` as a dict) override the profile's
    ``template_vars``. Raises :class:`InvalidRequest` (``param`` ``messages[i]`` when the failing
    message can be located) if the template refuses the conversation.
    """
    source = profile.chat_template
    if source is None:
        return render_fallback(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    template = _compile(source)
    placeholder = profile.template_vars.get("image_token", DEFAULT_IMAGE_PLACEHOLDER)
    msgs = _adapt_content(messages, template_takes_content_parts(source), placeholder)
    variables: dict[str, Any] = {
        **profile.template_vars,
        **(template_kwargs or {}),
        "tools": tools,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return _render(template, variables, msgs)
    except Exception as exc:
        index = _locate(template, variables, msgs, (type(exc), str(exc)))
        where = "messages" if index is None else f"messages[{index}]"
        if isinstance(exc, TemplateRaised):
            reason = str(exc).strip()[:_MAX_ECHO]
            message = f"The model's chat template rejected {where}: {reason}"
        else:
            message = (
                f"The model's chat template could not render {where}; "
                "check the roles, order and content of the messages."
            )
        raise InvalidRequest(message, param=where) from exc
