"""LoRA adapters in PEFT format, applied per row group inside a mixed batch.

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) and ``adapter_model.safetensors`` (``…layers.N.<proj>.lora_A.weight`` ``[r, in]``
and ``lora_B.weight`` ``[out, r]``). For a step whose token rows use different adapters (or
none), the base matmul runs once for all rows and each adapter adds
``(x[rows] @ A^T) @ (scale·B^T)`` to its own rows only (:class:`LoraBatch`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

__all__ = ["LoraAdapter", "LoraBatch", "LoraError", "load_adapter"]

SUPPORTED_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoraError(ValueError):
    """The adapter directory cannot be loaded."""


class LoraAdapter:
    """Low-rank factors per (layer, module): ``A^T [in, r]`` and ``scale·B^T [r, out]``."""

    def __init__(self, name: str, path: Path, rank: int, scale: float) -> None:
        self.name = name
        self.path = path
        self.rank = rank
        self.scale = scale
        self.layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def load_adapter(name: str, path: Path, num_layers: int) -> LoraAdapter:
    """Load a PEFT LoRA adapter directory."""
    from safetensors.torch import load_file

    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise LoraError(f"{path}: adapter_config.json not found")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / (rank**0.5) if config.get("use_rslora") else alpha / rank
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoraError(f"{path}: adapter_model.safetensors not found")
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        m = _KEY.search(key)
        if m is None:
            continue
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES:
            raise LoraError(f"{path}: LoRA on {module!r} is not supported")
        if layer >= num_layers:
            raise LoraError(f"{path}: layer {layer} out of range")
        factors.setdefault((layer, module), {})[which] = tensor.float()
    adapter = LoraAdapter(name, path, rank, scale)
    for (layer, module), ab in factors.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{path}: layer {layer} {module} lacks lora_A or lora_B")
        a_t = ab["A"].t().contiguous()
        b_t = (ab["B"].t() * scale).contiguous()
        adapter.layers[(layer, module)] = (a_t, b_t)
    if not adapter.layers:
        raise LoraError(f"{path}: no LoRA weights found")
    return adapter


class LoraBatch:
    """The adapters used by one forward step and the token rows each applies to."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]]) -> None:
        self.groups = groups

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += lora(x[rows])`` for every adapter having ``module`` at ``layer``."""
        for adapter, rows in self.groups:
            ab = adapter.layers.get((layer, module))
            if ab is not None:
                y.index_add_(0, rows, (x[rows] @ ab[0]) @ ab[1])

    def apply_qkv(
        self, layer: int, x: torch.Tensor, qkv: torch.Tensor, q_dim: int, kv_dim: int
    ) -> None:
        """Add q/k/v deltas into the column blocks of the fused QKV output."""
        self.apply(layer, "q_proj", x, qkv[:, :q_dim])
        self.apply(layer, "k_proj", x, qkv[:, q_dim : q_dim + kv_dim])
        self.apply(layer, "v_proj", x, qkv[:, q_dim + kv_dim :])

    def apply_gate_up(self, layer: int, x: torch.Tensor, gu: torch.Tensor, inter: int) -> None:
        """Add gate/up deltas into the column blocks of the fused gate-up output."""
        self.apply(layer, "gate_proj", x, gu[:, :inter])
        self.apply(layer, "up_proj", x, gu[:, inter:])
