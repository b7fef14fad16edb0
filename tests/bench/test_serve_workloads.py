"""``bench serve``'s workloads: length distributions, synthetic prompts (with and without a
tokenizer), shared prefixes, multi-turn conversations, and the dataset and trace readers."""

from __future__ import annotations

import itertools
import json
import random
import re
import statistics
from pathlib import Path

import pytest

from bench.serve.workloads import (
    WORDS,
    Lengths,
    TextMaker,
    Tokenizer,
    multi_turn,
    read_jsonl,
    read_sharegpt,
    read_trace,
    shared_prefix,
    synthetic,
)


def test_length_distributions() -> None:
    rng = random.Random(1)
    assert Lengths.parse("128") == Lengths.parse("fixed:128") == Lengths("fixed", 128.0)
    assert {Lengths.parse("fixed:7").sample(rng) for _ in range(20)} == {7}
    u = [Lengths.parse("uniform:10,20").sample(rng) for _ in range(5000)]
    assert min(u) == 10 and max(u) == 20
    assert statistics.fmean(u) == pytest.approx(15.0, abs=0.2)
    n = [Lengths.parse("normal:200,20").sample(rng) for _ in range(5000)]
    assert statistics.fmean(n) == pytest.approx(200.0, abs=1.5)
    assert statistics.pstdev(n) == pytest.approx(20.0, rel=0.05)
    assert min(Lengths.parse("normal:2,50").sample(rng) for _ in range(500)) == 1
    assert str(Lengths.parse("uniform:10,20")) == "uniform:10,20"
    for bad in ("", "x", "fixed:0", "uniform:5", "uniform:9,3", "normal:1", "lognormal:1,2"):
        with pytest.raises(ValueError, match="bad length"):
            Lengths.parse(bad)


def test_synthetic_prompts_have_their_length_in_words_and_differ() -> None:
    rng = random.Random(2)
    convs = list(itertools.islice(synthetic(TextMaker(rng), Lengths.parse("uniform:5,9"),
                                            Lengths.parse("33"), rng), 50))
    for c in convs:
        assert len(c.turns) == 1 and c.system is None and c.turns[0].max_tokens == 33
        words = c.turns[0].text.split()
        assert 5 <= len(words) <= 9 and set(words) <= set(WORDS)
    assert len({c.turns[0].text for c in convs}) == 50


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A small BPE tokenizer trained here and saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [" ".join(random.Random(i).choice(WORDS) for _ in range(50)) for i in range(200)]
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                        initial_alphabet=pre_tokenizers
                                                        .ByteLevel.alphabet()))
    from tokenizers import decoders

    raw.decoder = decoders.ByteLevel()
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(str(d))
    return Tokenizer(str(d))


def test_a_tokenizer_makes_prompts_of_exactly_their_length(tokenizer: Tokenizer) -> None:
    text = TextMaker(random.Random(3), tokenizer)
    for n in (1, 17, 64, 200):
        prompt = text.make(n)
        assert abs(tokenizer.count(prompt) - n) <= 1  # a decoded cut may re-merge at its edge


def test_shared_prefix_hands_out_k_system_prompts_in_turn() -> None:
    rng = random.Random(4)
    convs = list(itertools.islice(shared_prefix(TextMaker(rng), 3, Lengths.parse("40"),
                                                Lengths.parse("8"), Lengths.parse("16"), rng),
                                  12))
    systems = [c.system for c in convs]
    assert len(set(systems)) == 3 and systems[:3] * 4 == systems
    assert all(len(s.split()) == 40 for s in systems if s)
    assert len({c.turns[0].text for c in convs}) == 12  # every user asks something else


def test_multi_turn_conversations_have_their_turns() -> None:
    rng = random.Random(5)
    convs = list(itertools.islice(multi_turn(TextMaker(rng), Lengths.parse("uniform:2,4"),
                                             Lengths.parse("8"), Lengths.parse("16"), rng,
                                             Lengths.parse("20")), 40))
    assert {len(c.turns) for c in convs} == {2, 3, 4}
    assert all(c.system and len(c.system.split()) == 20 for c in convs)


def test_sharegpt_reader(tmp_path: Path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is trio?"},
                                      {"from": "gpt", "value": "x" * 400},
                                      {"from": "human", "value": "And anyio?"},
                                      {"from": "gpt", "value": "y" * 40}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the model"},
                                      {"from": "human", "value": "skipped"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "d", "conversation": [{"role": "user", "content": "Role/content shape"},
                                     {"role": "assistant", "content": "z" * 80}]},
        {"id": "e", "conversations": []},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    convs = read_sharegpt(path)
    assert [(c.turns[0].text, c.turns[0].max_tokens) for c in convs] == [
        ("What is trio?", 100), ("Role/content shape", 20)]  # ~4 characters per token
    fixed = read_sharegpt(path, output_len=Lengths.parse("7"))
    assert [c.turns[0].max_tokens for c in fixed] == [7, 7]
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="JSON list"):
        read_sharegpt(path)
    path.write_text(json.dumps([data[1]]))
    with pytest.raises(ValueError, match="no usable"):
        read_sharegpt(path)


def test_sharegpt_whole_conversations_resend_their_turns(tmp_path: Path) -> None:
    def msg(who: str, text: str) -> dict[str, str]:
        return {"from": who, "value": text}

    data = [
        {"conversations": [msg("human", "one"), msg("gpt", "a" * 40), msg("human", "two"),
                           msg("gpt", "b" * 80), msg("human", "three"), msg("gpt", "c" * 12)]},
        # the exchange breaks at two human messages in a row: the turns before it are kept
        {"conversations": [msg("human", "x"), msg("gpt", "d" * 20), msg("human", "y"),
                           msg("human", "z"), msg("gpt", "e" * 20)]},
        # a last human message without a reply is not a turn
        {"conversations": [msg("human", "p"), msg("gpt", "f" * 8), msg("human", "q")]},
        {"conversations": [msg("gpt", "model first"), msg("human", "skipped")]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    convs = read_sharegpt(path, turns="all")
    assert [[(t.text, t.max_tokens) for t in c.turns] for c in convs] == [
        [("one", 10), ("two", 20), ("three", 3)], [("x", 5)], [("p", 2)]]
    assert [c.source for c in convs] == [{"line": 0}, {"line": 1}, {"line": 2}]
    # the default: the first human turn of each
    assert [[t.text for t in c.turns] for c in read_sharegpt(path)] == [["one"], ["x"], ["p"]]
    # an output length given overrides every turn's recorded one
    fixed = read_sharegpt(path, output_len=Lengths.parse("7"), turns="all")
    assert [[t.max_tokens for t in c.turns] for c in fixed] == [[7, 7, 7], [7], [7]]
    with pytest.raises(ValueError, match="turns is one of first, all"):
        read_sharegpt(path, turns="some")


@pytest.mark.parametrize(("entry", "message"), [
    ("not an object", r"entry 1: a conversation is a JSON object, not str"),
    ({"id": "no list"}, r'entry 1: no "conversations" list'),
    ({"conversations": [{"from": "human", "value": "hi"}, "text"]},
     r"entry 1, message 1: expected"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},
     r"entry 1, message 1: expected"),
    ({"conversations": [{"value": "who?"}, {"from": "gpt", "value": "me"}]},
     r"entry 1, message 0: expected"),
])
@pytest.mark.parametrize("turns", ["first", "all"])
def test_a_malformed_sharegpt_entry_is_named(tmp_path: Path, entry: object, message: str,
                                             turns: str) -> None:
    path = tmp_path / "sg.json"
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path.write_text(json.dumps([good, entry]))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        read_sharegpt(path, turns=turns)
    path.write_text("[{")
    with pytest.raises(ValueError, match=r"sg\.json: not JSON \(.*line 1\)"):
        read_sharegpt(path, turns=turns)


def test_sharegpt_reply_lengths_with_a_tokenizer(tmp_path: Path, tokenizer: Tokenizer) -> None:
    reply = " ".join(WORDS[:30])
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                   {"from": "gpt", "value": reply}]}]))
    assert read_sharegpt(path, tokenizer)[0].turns[0].max_tokens == tokenizer.count(reply)


def test_jsonl_reader(tmp_path: Path) -> None:
    lines = [
        {"prompt": "Tell me about sockets.", "max_tokens": 64},
        {"text": "Plain text", "output_len": 8, "system": "Be brief."},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "one"},
                      {"role": "assistant", "content": "reply"},
                      {"role": "user", "content": "two"}], "output_tokens": 5},
        {"input_length": 12, "output_length": 3},
        {"question": "No length?", "answer": "a" * 40},
        {"input": "Default length"},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines[:3]) + "\n\n"
                    + "\n".join(json.dumps(x) for x in lines[3:]) + "\n")
    rng = random.Random(6)
    convs = read_jsonl(path, TextMaker(rng), Lengths.parse("99"), rng)
    assert [[t.text for t in c.turns] for c in convs][:3] == [
        ["Tell me about sockets."], ["Plain text"], ["one", "two"]]
    assert [c.turns[-1].max_tokens for c in convs] == [64, 8, 5, 3, 10, 99]
    assert [c.system for c in convs[:3]] == [None, "Be brief.", "S"]
    assert len(convs[3].turns[0].text.split()) == 12
    assert convs[4].source == {"where": f"{path}:6"}
    path.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: no prompt"):
        read_jsonl(path, TextMaker(rng), Lengths.parse("9"), rng)
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not JSON"):
        read_jsonl(path, TextMaker(rng), Lengths.parse("9"), rng)


def test_trace_reader_schedules_each_record_at_its_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    recs = [{"timestamp": 2000, "input_length": 5, "output_length": 2},
            {"timestamp": 500, "input_length": 6, "output_length": 3},
            {"timestamp": 1250, "prompt": "from text", "max_tokens": 4}]
    path.write_text("\n".join(json.dumps(r) for r in recs))
    rng = random.Random(7)
    convs = read_trace(path, TextMaker(rng), Lengths.parse("9"), rng)
    assert [c.at for c in convs] == pytest.approx([0.0, 0.75, 1.5])  # in time order
    assert [c.turns[0].max_tokens for c in convs] == [3, 4, 2]
    fast = read_trace(path, TextMaker(rng), Lengths.parse("9"), rng, speed=3.0)
    assert [c.at for c in fast] == pytest.approx([0.0, 0.25, 0.5])
    path.write_text('{"timestamp": 1, "prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match="numeric timestamp"):
        read_trace(path, TextMaker(rng), Lengths.parse("9"), rng)
