"""The CPU engine applies a model's sampling defaults to what a request leaves unset, and its
top-p (which those defaults turn on for every request that sets none) stays cheap and exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.cpu.model_store import DEFAULT_MODEL_NAME
from engine.cpu.params import SamplingParams, parse_sampling_params
from engine.cpu.runner import sampling_defaults
from engine.cpu.sampling import _nucleus, sample_row

DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "repetition_penalty": 1.1}


def test_unset_values_take_the_model_defaults_and_set_values_win() -> None:
    p = parse_sampling_params({"max_new_tokens": 4}, 100, DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    assert isinstance(p.top_k, int)
    # null counts as unset, as SGLang treats it.
    assert parse_sampling_params({"temperature": None}, 100, DEFAULTS).temperature == 0.6
    p = parse_sampling_params({"temperature": 0}, 100, DEFAULTS)
    assert p.greedy and p.top_p == 0.95  # explicit greedy wins (SGLang's normal form: top_k 1)
    p = parse_sampling_params({"temperature": 1.0, "top_k": -1}, 100, DEFAULTS)
    assert (p.temperature, p.top_k, p.top_p) == (1.0, -1, 0.95)
    # No defaults: SGLang's own.
    plain = parse_sampling_params({}, 100)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, -1) == (
        SamplingParams().temperature, SamplingParams().top_p, SamplingParams().top_k
    )


def test_defaults_come_from_generation_config(tmp_path: Path) -> None:
    model = tmp_path / "Some-Model"
    model.mkdir()
    config = {
        "eos_token_id": 2,
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "max_new_tokens": 99,  # not a sampling default
        "repetition_penalty": True,  # not a number
    }
    (model / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults(model) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20.0}
    (model / "generation_config.json").write_text("{not json")
    assert sampling_defaults(model) == {}
    assert sampling_defaults(tmp_path / "missing") == {}


def test_default_model_has_its_model_card_defaults(tmp_path: Path) -> None:
    """SmolLM2's generation_config.json sets no sampling values; its card's are used."""
    model = tmp_path / DEFAULT_MODEL_NAME
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert sampling_defaults(model) == {"temperature": 0.2, "top_p": 0.9}
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    assert sampling_defaults(model) == {"temperature": 0.5}  # the model's own file wins


def _full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p over the whole sorted row, as the definition reads."""
    sorted_p, order = torch.sort(probs, descending=True)
    drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) > top_p
    drop[0] = False
    return torch.zeros_like(probs).scatter_(0, order, sorted_p.masked_fill(drop, 0.0))


@pytest.mark.parametrize("temperature", [0.2, 0.7, 1.0, 4.0])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_nucleus_from_the_top_candidates_is_the_full_sort_nucleus(
    temperature: float, top_p: float
) -> None:
    """Top-p is first looked for among the most likely tokens (cheap: the model's defaults make
    every default request use top-p); flat rows fall back to the sort. Same set either way."""
    g = torch.Generator().manual_seed(int(temperature * 10 + top_p * 1000))
    probs = torch.softmax(torch.randn(49152, generator=g) * 4 / temperature, dim=-1)
    kept, ids = _nucleus(probs, top_p)
    assert ids is not None
    got = torch.zeros_like(probs).scatter_(0, ids, kept)
    assert torch.equal(got, _full_sort_nucleus(probs, top_p))
    # A draw picks a token of the nucleus, with the request's generator.
    params = SamplingParams(temperature=temperature, top_p=top_p)
    gen = torch.Generator().manual_seed(3)
    logits = torch.log(probs) * temperature
    token = sample_row(logits.clone(), params, gen, False, 0).token
    assert got[token] > 0
