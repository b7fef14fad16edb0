"""CPU engine: numerics against transformers, scheduler semantics, grammar, LoRA.

These tests load the real default model (SmolLM2-135M-Instruct, converted once into the user
cache) and drive the scheduler thread directly, without HTTP.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("xgrammar")

import torch

from engine.cpu.model import KVPool, Segment
from engine.cpu.params import parse_sampling_params
from engine.cpu.runner import CpuEngine, EngineConfig
from engine.cpu.scheduler import QueueFullError, Request, Update

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
]


class Collector:
    """Collects a request's updates; ``wait()`` blocks until it finishes."""

    def __init__(self) -> None:
        self.updates: list[Update] = []
        self.done = threading.Event()

    def __call__(self, _req: Request, update: Update) -> None:
        self.updates.append(update)
        if update.finish is not None:
            self.done.set()

    def wait(self, timeout: float = 120.0) -> Update:
        assert self.done.wait(timeout), "request did not finish"
        return self.updates[-1]


def make_request(
    engine: CpuEngine, prompt: str | list[int], **params: Any
) -> tuple[Request, Collector]:
    ids = prompt if isinstance(prompt, list) else engine.encode(prompt)
    lp = params.pop("return_logprob", False)
    top = params.pop("top_logprobs_num", 0)
    adapter = params.pop("adapter", None)
    sp = parse_sampling_params(params, engine.model.config.vocab_size)  # type: ignore[union-attr]
    constraint = None
    if sp.grammar is not None:
        assert engine.grammars is not None
        constraint = engine.grammars.new_constraint(engine.grammars.compile(*sp.grammar))
    col = Collector()
    req = Request(
        input_ids=ids,
        params=sp,
        on_update=col,
        return_logprob=lp,
        top_logprobs_num=top,
        return_text_in_logprobs=True,
        adapter=adapter,
        constraint=constraint,
    )
    return req, col


def run(engine: CpuEngine, prompt: str | list[int], **params: Any) -> tuple[Request, Update]:
    req, col = make_request(engine, prompt, **params)
    assert engine.scheduler is not None
    engine.scheduler.submit(req)
    return req, col.wait()


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = CpuEngine(EngineConfig(model="default", max_running=8, max_queue=64))
    eng.load()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(engine: CpuEngine) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(engine.model_path)).eval()


def hf_greedy(hf_model: Any, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=2
        )
    return out[0, len(ids) :].tolist()


def test_greedy_equals_transformers_generate(engine: CpuEngine, hf_model: Any) -> None:
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ref = hf_greedy(hf_model, ids, 24)
        req, last = run(engine, ids, temperature=0, max_new_tokens=24, ignore_eos=True)
        assert req.output_ids == ref, prompt
        assert last.finish == {"type": "length", "length": 24}


def test_forward_logits_match_and_chunked_prefill(engine: CpuEngine, hf_model: Any) -> None:
    model = engine.model
    assert model is not None
    ids = engine.encode(PROMPTS[2])
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
    pool = KVPool(model.config, 2)
    slot = pool.allocate()
    half = len(ids) // 2
    model.forward([Segment(slot, 0, ids[:half], want_logits=False)], pool)
    logits = model.forward([Segment(slot, half, ids[half:])], pool)[0]
    assert torch.allclose(logits, ref, atol=1e-3)


def test_batched_greedy_equals_single(engine: CpuEngine) -> None:
    singles = [run(engine, p, temperature=0, max_new_tokens=16)[0].output_ids for p in PROMPTS]
    pairs = [make_request(engine, p, temperature=0, max_new_tokens=16) for p in PROMPTS]
    for req, _ in pairs:
        engine.scheduler.submit(req)  # type: ignore[union-attr]
    for (req, col), single in zip(pairs, singles, strict=True):
        col.wait()
        assert req.output_ids == single


def test_seeded_sampling_same_alone_and_in_busy_batch(engine: CpuEngine) -> None:
    params = {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 1234, "max_new_tokens": 32}
    alone, _ = run(engine, PROMPTS[2], **params)
    again, _ = run(engine, PROMPTS[2], **params)
    assert alone.output_ids == again.output_ids
    noise = [make_request(engine, p, temperature=1.0, max_new_tokens=40) for p in PROMPTS]
    for req, _ in noise[:2]:
        engine.scheduler.submit(req)  # type: ignore[union-attr]
    busy, col = make_request(engine, PROMPTS[2], **params)
    engine.scheduler.submit(busy)  # type: ignore[union-attr]
    for req, _ in noise[2:]:
        engine.scheduler.submit(req)  # type: ignore[union-attr]
    col.wait()
    for _, c in noise:
        c.wait()
    assert busy.output_ids == alone.output_ids
    other, _ = run(engine, PROMPTS[2], **{**params, "sampling_seed": 99})
    assert other.output_ids != alone.output_ids


def test_json_schema_output_always_validates(engine: CpuEngine) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    prompts = [
        "Describe a person as JSON:",
        "A cat",
        "Write a poem about the sea.",
        "{",
        "Return an empty list",
        "1 2 3 4",
    ]
    pairs = []
    for i, prompt in enumerate(prompts):
        for temperature in (0.0, 1.0):
            pairs.append(
                make_request(
                    engine,
                    prompt,
                    json_schema=json.dumps(schema),
                    temperature=temperature,
                    sampling_seed=i,
                    max_new_tokens=200,
                )
            )
    for req, _ in pairs:
        engine.scheduler.submit(req)  # type: ignore[union-attr]
    for _req, col in pairs:
        last = col.wait()
        assert last.finish is not None and last.finish["type"] == "stop", last
        jsonschema.validate(json.loads(last.text), schema)


def test_regex_constrained(engine: CpuEngine) -> None:
    import re

    pattern = r"(yes|no), [0-9]{2,4}"
    for temperature in (0.0, 1.0):
        for seed in range(3):
            _, last = run(
                engine,
                "Answer:",
                regex=pattern,
                temperature=temperature,
                sampling_seed=seed,
                max_new_tokens=20,
            )
            assert re.fullmatch(pattern, last.text), last.text


def test_stop_string_trimmed_and_never_streamed(engine: CpuEngine) -> None:
    ids = engine.encode("Count: 1, 2, 3,")
    free, _ = run(engine, ids, temperature=0, max_new_tokens=12)
    full = engine.tokenizer.decode(free.output_ids)
    assert " 5," in full
    req, col = make_request(engine, ids, temperature=0, max_new_tokens=12, stop=[" 5,", "zz"])
    engine.scheduler.submit(req)  # type: ignore[union-attr]
    last = col.wait()
    assert last.finish == {"type": "stop", "matched": " 5,"}
    assert last.text == full[: full.index(" 5,")]
    for update in col.updates:
        assert " 5" not in update.text
        assert last.text.startswith(update.text)
    _, kept = run(engine, ids, temperature=0, max_new_tokens=12, stop=" 5,", no_stop_trim=True)
    assert kept.text == full[: full.index(" 5,") + 3]


def test_min_new_tokens_and_stop_token_ids(engine: CpuEngine) -> None:
    req, last = run(engine, "Hi", temperature=0, max_new_tokens=40, min_new_tokens=30)
    assert len(req.output_ids) >= 30
    first, _ = run(engine, "Hi", temperature=0, max_new_tokens=10, ignore_eos=True)
    stop_id = first.output_ids[3]
    req, last = run(
        engine, "Hi", temperature=0, max_new_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]
    )
    assert last.finish == {"type": "stop", "matched": stop_id}
    assert req.output_ids[-1] == stop_id


def test_logprobs_shapes(engine: CpuEngine) -> None:
    req, last = run(
        engine, "Hello", temperature=0, max_new_tokens=5, return_logprob=True, top_logprobs_num=3
    )
    assert last.n_logprobs == 5
    for (lp, tid, text), top in zip(
        req.output_token_logprobs, req.output_top_logprobs, strict=True
    ):
        assert top is not None and len(top) == 3
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-6  # greedy picks the top token
        assert isinstance(text, str)


def test_abort_frees_slot(engine: CpuEngine) -> None:
    sched = engine.scheduler
    assert sched is not None
    long = [
        make_request(engine, p, max_new_tokens=2000, ignore_eos=True, temperature=0)
        for p in PROMPTS * 2
    ]  # 8 = max_running
    for req, _ in long:
        sched.submit(req)
    waiting, wcol = make_request(engine, "Hi", max_new_tokens=3, temperature=0)
    sched.submit(waiting)
    assert not wcol.done.wait(1.0)  # all slots busy
    sched.abort(long[0][0].rid)
    last = long[0][1].wait(30)
    assert last.finish == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    wcol.wait(60)  # the freed slot admitted the waiting request
    for req, col in long[1:]:
        sched.abort(req.rid)
        col.wait(30)
    assert sched.pool.free_slots == sched.max_running


def test_abort_waiting_and_queue_full(engine: CpuEngine) -> None:
    sched = engine.scheduler
    assert sched is not None
    saved = sched.max_queue
    blockers = [make_request(engine, p, max_new_tokens=2000, ignore_eos=True) for p in PROMPTS * 2]
    try:
        for req, _ in blockers:
            sched.submit(req)
        sched.max_queue = 1
        queued, qcol = make_request(engine, "Hi", max_new_tokens=3)
        for _ in range(100):  # wait until the blockers are admitted
            if sched.statistics()["num_waiting_reqs"] == 0:
                break
            qcol.done.wait(0.05)
        sched.submit(queued)
        extra, _ = make_request(engine, "Hi", max_new_tokens=3)
        with pytest.raises(QueueFullError):
            sched.submit(extra)
        sched.abort(queued.rid)
        last = qcol.wait(30)
        assert last.finish is not None and last.finish["message"] == "Abort in waiting queue"
    finally:
        sched.max_queue = saved
        for req, col in blockers:
            sched.abort(req.rid)
            col.wait(30)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory, hf_model: Any) -> Path:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        init_lora_weights=False,
        target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    )
    model = peft.get_peft_model(hf_model, config)
    out = tmp_path_factory.mktemp("lora")
    model.save_pretrained(str(out))
    model.unload()  # restore the base modules for other tests
    return out


def test_lora_changes_only_its_requests(engine: CpuEngine, lora_dir: Path, hf_model: Any) -> None:
    from engine.cpu.lora import load_adapter

    peft = pytest.importorskip("peft")
    assert engine.model is not None
    adapter = load_adapter("test", lora_dir, engine.model.config.num_layers)
    ids = engine.encode(PROMPTS[0])
    base, _ = run(engine, ids, temperature=0, max_new_tokens=12, ignore_eos=True)
    pairs = [
        make_request(
            engine,
            ids,
            temperature=0,
            max_new_tokens=12,
            ignore_eos=True,
            adapter=adapter if i % 2 else None,
        )
        for i in range(4)
    ]
    for req, _ in pairs:
        engine.scheduler.submit(req)  # type: ignore[union-attr]
    for _, col in pairs:
        col.wait()
    plain = [r.output_ids for i, (r, _) in enumerate(pairs) if i % 2 == 0]
    adapted = [r.output_ids for i, (r, _) in enumerate(pairs) if i % 2 == 1]
    assert all(p == base.output_ids for p in plain)
    assert all(a == adapted[0] for a in adapted)
    assert adapted[0] != base.output_ids
    # The adapter output equals PEFT's own merged forward.
    peft_model = peft.PeftModel.from_pretrained(hf_model, str(lora_dir)).eval()
    try:
        with torch.inference_mode():
            ref = peft_model.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                min_new_tokens=12,
                pad_token_id=2,
            )
        assert adapted[0] == ref[0, len(ids) :].tolist()
    finally:
        peft_model.unload()


def test_max_new_tokens_zero_and_context_checks(engine: CpuEngine) -> None:
    from engine.cpu.params import ParamError

    req, last = run(engine, "Hello", max_new_tokens=0)
    assert last.finish == {"type": "length", "length": 0} and req.output_ids == []
    ctx = engine.context_length
    big, _ = make_request(engine, [5] * ctx, max_new_tokens=1)
    with pytest.raises(ParamError, match="longer than the model's context length"):
        engine.scheduler.submit(big)  # type: ignore[union-attr]
    over, _ = make_request(engine, [5] * 10, max_new_tokens=ctx)
    with pytest.raises(ParamError, match="exceeds the model's maximum context length"):
        engine.scheduler.submit(over)  # type: ignore[union-attr]
