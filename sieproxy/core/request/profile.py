"""What the sans-IO core needs to know about a served model (built from settings by the shell)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ModelProfile", "positive_int"]


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A model as the gateway serves it.

    ``chat_template`` is the Jinja source (from the tokenizer directory's ``tokenizer_config.json``
    / ``chat_template.jinja`` or inline in the config); ``template_vars`` carries the
    special-token strings a template refers to (``bos_token``, ``eos_token``, ...). ``stop`` are
    extra stop strings every request of this model gets (e.g. an end-of-turn marker).
    """

    name: str
    inputs: frozenset[str] = frozenset({"text"})
    encode_only: bool = False
    lora_names: frozenset[str] = frozenset()
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    schema_in_prompt: bool = True
    default_max_tokens: int = 1024
    #: The most calls one choice may make under ``tool_choice: "required"`` (grammar bound).
    max_tool_calls: int = 4
    max_image_bytes: int = 20 * 1024 * 1024
    chat_template: str | None = None
    template_vars: dict[str, str] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    pools: frozenset[str] = frozenset()
    machine_profiles: frozenset[str] = frozenset()
    #: Who renders a chat request: ``"gateway"`` (the template here: ``core.plan``) or
    #: ``"engine"`` (an OpenAI-compatible engine's own ``/v1/chat/completions``:
    #: ``core.openai_chat``).
    render: str = "gateway"
    #: Learned from the engine (``/server_info``, ``/model_info``) once it is up; None: unknown.
    context_length: int | None = None
    vocab_size: int | None = None
    #: Other names the model answers to: exact names and glob patterns (``core.aliases``).
    aliases: tuple[str, ...] = ()

    @property
    def accepts_images(self) -> bool:
        return "image" in self.inputs and not self.encode_only


def positive_int(v: object) -> int | None:
    """``v`` when an engine reported a positive integer (a context length, a vocabulary or batch
    size), else None: a bool, a float or a missing value says nothing."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
