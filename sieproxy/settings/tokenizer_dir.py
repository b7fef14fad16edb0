"""Read a chat template and its special tokens from a local Hugging Face tokenizer directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TemplateSource", "read_tokenizer_dir"]


class TemplateSource:
    def __init__(self, template: str | None, variables: dict[str, str]) -> None:
        self.template = template
        self.variables = variables


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def read_tokenizer_dir(path: str | Path) -> TemplateSource:
    """The default chat template (``chat_template.jinja`` or ``tokenizer_config.json``) and the
    special-token strings templates refer to. Raises ``ValueError`` naming the file on problems."""
    d = Path(path)
    cfg_path = d / "tokenizer_config.json"
    cfg: dict[str, Any] = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text("utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{cfg_path}: not readable JSON ({exc})") from None
    template: str | None = None
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        try:
            template = jinja.read_text("utf-8")
        except (OSError, ValueError) as exc:
            raise ValueError(f"{jinja}: not readable UTF-8 text ({exc})") from None
    else:
        ct = cfg.get("chat_template")
        if isinstance(ct, str):
            template = ct
        elif isinstance(ct, list):  # [{"name": "default", "template": ...}, ...]
            named = {e.get("name"): e.get("template") for e in ct if isinstance(e, dict)}
            t = named.get("default") or next(iter(named.values()), None)
            template = t if isinstance(t, str) else None
    variables: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        text = _token_text(cfg.get(key))
        if text is not None:
            variables[key] = text
    return TemplateSource(template, variables)
