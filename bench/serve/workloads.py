"""What a serve run sends: conversations of one or more turns, from a synthetic generator, a
dataset file or a timestamped trace.

A :class:`Conversation` is an optional system prompt and its user turns; each turn resends the
whole history (the earlier user turns and the replies actually received). A single request is a
conversation of one turn. Prompt lengths are in tokens: counted with the model's tokenizer when
one is given (:class:`Tokenizer`), else approximated by words that are one token each in the
common BPE vocabularies.

Length distributions (``--input-len``, ``--output-len``, ``--turns``): ``N`` or ``fixed:N``;
``uniform:LO,HI`` (inclusive); ``normal:MEAN,STDDEV`` (rounded, at least 1).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Short, common English words: one token each (with their leading space) in GPT-2-, Llama- and
# Qwen-style vocabularies, so N words make a prompt of about N tokens without a tokenizer.
_WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part over "
    "new sound take only little work know place year live me back give most very after thing "
    "our just name good sentence man think say great where help through much before line "
    "right too mean old any same tell boy follow came want show also around form three small "
    "set put end does another well large must big even such because turn here why ask went "
    "men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn "
    "should world"
)
WORDS: list[str] = _WORDS.split()


class Tokenizer:
    """The model's tokenizer (Hugging Face ``transformers``), to count and cut tokens."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        self.name = name
        self._tok = AutoTokenizer.from_pretrained(name)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))

    def count(self, text: str) -> int:
        return len(self.encode(text))


@dataclass(frozen=True)
class Lengths:
    """A distribution of lengths (tokens or turns), sampled as positive integers."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Lengths:
        kind, sep, rest = spec.partition(":")
        if not sep:
            kind, rest = "fixed", spec
        try:
            nums = [float(x) for x in rest.split(",")]
        except ValueError:
            raise ValueError(f"bad length {spec!r}: expected N, fixed:N, uniform:LO,HI or "
                             "normal:MEAN,STDDEV") from None
        want = {"fixed": 1, "uniform": 2, "normal": 2}.get(kind)
        if want is None or len(nums) != want:
            raise ValueError(f"bad length {spec!r}: expected N, fixed:N, uniform:LO,HI or "
                             "normal:MEAN,STDDEV")
        if kind == "uniform" and not 1 <= nums[0] <= nums[1]:
            raise ValueError(f"bad length {spec!r}: need 1 <= LO <= HI")
        if kind != "uniform" and nums[0] < 1:
            raise ValueError(f"bad length {spec!r}: need at least 1")
        return cls(kind, nums[0], nums[1] if want == 2 else 0.0)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


@dataclass
class Turn:
    """One user message and the number of tokens to ask for in reply."""

    text: str
    max_tokens: int


@dataclass
class Conversation:
    turns: list[Turn]
    system: str | None = None
    at: float | None = None  # a trace's start offset (s); None: the arrival process decides
    source: dict[str, Any] = field(default_factory=dict)


class TextMaker:
    """Random prompts of a given length in tokens (exact with a tokenizer)."""

    def __init__(self, rng: random.Random, tokenizer: Tokenizer | None = None) -> None:
        self.rng = rng
        self.tokenizer = tokenizer

    def make(self, tokens: int) -> str:
        words = " ".join(self.rng.choice(WORDS) for _ in range(tokens + 8 if self.tokenizer
                                                                   else tokens))
        if self.tokenizer is None:
            return words
        return self.tokenizer.decode(self.tokenizer.encode(words)[:tokens])


def synthetic(text: TextMaker, input_len: Lengths, output_len: Lengths,
              rng: random.Random) -> Iterator[Conversation]:
    """Endless single-turn requests with random prompts."""
    while True:
        yield Conversation([Turn(text.make(input_len.sample(rng)), output_len.sample(rng))])


def shared_prefix(text: TextMaker, prefixes: int, prefix_len: Lengths, input_len: Lengths,
                  output_len: Lengths, rng: random.Random) -> Iterator[Conversation]:
    """Endless single-turn requests, each with one of ``prefixes`` system prompts (in turn)
    and its own question: k system prompts shared by many users."""
    systems = [text.make(prefix_len.sample(rng)) for _ in range(prefixes)]
    for k in itertools.count():
        yield Conversation([Turn(text.make(input_len.sample(rng)), output_len.sample(rng))],
                           system=systems[k % prefixes])


def multi_turn(text: TextMaker, turns: Lengths, input_len: Lengths, output_len: Lengths,
               rng: random.Random, system_len: Lengths | None = None) -> Iterator[Conversation]:
    """Endless conversations of ``turns`` turns; each turn resends the history."""
    while True:
        system = text.make(system_len.sample(rng)) if system_len is not None else None
        yield Conversation([Turn(text.make(input_len.sample(rng)), output_len.sample(rng))
                            for _ in range(turns.sample(rng))], system=system)


# ---- files --------------------------------------------------------------------------------------


def _estimate(text: str, tokenizer: Tokenizer | None) -> int:
    """Tokens in ``text``: counted, else about four characters per token."""
    return tokenizer.count(text) if tokenizer else max(1, round(len(text) / 4))


#: ``--dataset-turns``: a ShareGPT conversation's first human turn, or all its human turns.
DATASET_TURNS = ("first", "all")
_HUMAN = ("human", "user")


def _sharegpt_messages(entry: Any, where: str) -> list[tuple[str, str]]:
    """One ShareGPT entry's messages as (speaker, text), or a ValueError naming what is wrong."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: a conversation is a JSON object, not "
                         f"{type(entry).__name__}")
    conv = entry.get("conversations", entry.get("conversation"))
    if not isinstance(conv, list):
        raise ValueError(f'{where}: no "conversations" list')
    msgs = []
    for j, m in enumerate(conv):
        who = m.get("from", m.get("role")) if isinstance(m, dict) else None
        text = m.get("value", m.get("content")) if isinstance(m, dict) else None
        if not isinstance(who, str) or not isinstance(text, str):
            raise ValueError(f'{where}, message {j}: expected {{"from": …, "value": …}} (or '
                             '"role"/"content") with string values')
        msgs.append((who, text))
    return msgs


def read_sharegpt(path: Path, tokenizer: Tokenizer | None = None,
                  output_len: Lengths | None = None, rng: random.Random | None = None,
                  turns: str = "first") -> list[Conversation]:
    """ShareGPT JSON: a list of ``{"conversations": [{"from": "human"|"gpt", "value": …}]}``
    (``role``/``content`` and ``conversation`` are accepted too).

    Each entry gives one conversation. ``turns="first"``: its first human turn alone;
    ``"all"``: its human turns in order, each followed by a reply, up to the first place where
    that alternation breaks (two human messages in a row, a human message without a reply, an
    empty one); the loop sends each turn with the history before it, the recorded replies
    replaced by the replies actually received. Every turn asks for as many tokens as the
    recorded reply that followed it had (or ``output_len``). Entries without a human turn
    followed by a reply are skipped; a malformed entry (not an object, no conversation list, a
    message without a string speaker and text) is an error naming it."""
    if turns not in DATASET_TURNS:
        raise ValueError(f"turns is one of {', '.join(DATASET_TURNS)}, not {turns!r}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    rng = rng or random.Random(0)
    out = []
    for i, entry in enumerate(data):
        msgs = _sharegpt_messages(entry, f"{path}: entry {i}")
        conv = []
        for k in range(0, len(msgs) - 1, 2):
            (who, text), (replier, reply) = msgs[k], msgs[k + 1]
            if who not in _HUMAN or not text or replier in _HUMAN:
                break
            if output_len is not None:
                n = output_len.sample(rng)
            elif reply:
                n = _estimate(reply, tokenizer)
            else:
                break
            conv.append(Turn(text, n))
            if turns == "first":
                break
        if conv:
            out.append(Conversation(conv, source={"line": i}))
    if not out:
        raise ValueError(f"{path}: no usable ShareGPT conversation (human turn then reply)")
    return out


_PROMPT_KEYS = ("prompt", "text", "question", "input")
_OUTPUT_KEYS = ("max_tokens", "output_len", "output_length", "output_tokens")
_REPLY_KEYS = ("completion", "response", "answer", "output")


def jsonl_conversation(obj: dict[str, Any], where: str, text: TextMaker,
                       tokenizer: Tokenizer | None, output_len: Lengths,
                       rng: random.Random) -> Conversation:
    """One JSONL record: a prompt (``prompt``/``text``/``question``/``input``), a ``messages``
    list (``system`` and ``user`` messages; an ``assistant`` message between two user
    messages is replaced by the reply received), or only an ``input_length`` (a synthetic
    prompt of that many tokens); the reply's length from ``max_tokens``/``output_len``/
    ``output_length``/``output_tokens``, else the length of a reference reply
    (``completion``/``response``/``answer``/``output``), else ``output_len``."""
    n = next((int(obj[k]) for k in _OUTPUT_KEYS if isinstance(obj.get(k), int | float)), None)
    if n is None:
        ref = next((obj[k] for k in _REPLY_KEYS if isinstance(obj.get(k), str)), None)
        n = _estimate(ref, tokenizer) if ref else output_len.sample(rng)
    system = obj.get("system") if isinstance(obj.get("system"), str) else None
    prompt = next((obj[k] for k in _PROMPT_KEYS if isinstance(obj.get(k), str)), None)
    if prompt is not None:
        return Conversation([Turn(prompt, n)], system=system, source={"where": where})
    if isinstance(obj.get("messages"), list):
        users: list[str] = []
        for m in obj["messages"]:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: a message needs a string content")
            if m.get("role") == "system":
                system = m["content"]
            elif m.get("role") == "user":
                users.append(m["content"])
        if users:
            return Conversation([Turn(u, n) for u in users], system=system,
                                source={"where": where})
    if isinstance(obj.get("input_length"), int):
        return Conversation([Turn(text.make(max(1, obj["input_length"])), n)],
                            source={"where": where})
    raise ValueError(f"{where}: no prompt (one of {', '.join(_PROMPT_KEYS)}, messages, "
                     "input_length)")


def read_jsonl(path: Path, text: TextMaker, output_len: Lengths, rng: random.Random,
               tokenizer: Tokenizer | None = None) -> list[Conversation]:
    """A JSONL dataset: one record per line (see :func:`jsonl_conversation`); blank lines are
    skipped."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{i}: a record is a JSON object")
        out.append(jsonl_conversation(obj, f"{path}:{i}", text, tokenizer, output_len, rng))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def read_trace(path: Path, text: TextMaker, output_len: Lengths, rng: random.Random,
               tokenizer: Tokenizer | None = None, speed: float = 1.0) -> list[Conversation]:
    """A trace: JSONL records as :func:`read_jsonl` reads them, each with a ``timestamp`` in
    milliseconds (the Mooncake/AIPerf trace shape: ``{"timestamp": 0, "input_length": 512,
    "output_length": 64}``). Returned in time order, each with its start offset ``at``."""
    from bench.serve.arrivals import trace_times

    convs = read_jsonl(path, text, output_len, rng, tokenizer)
    stamps = []
    for c, line in zip(convs, _records(path), strict=True):
        ts = line.get("timestamp")
        if not isinstance(ts, int | float) or isinstance(ts, bool):
            raise ValueError(f"{c.source['where']}: a trace record needs a numeric timestamp "
                             "(milliseconds)")
        stamps.append(float(ts))
    for c, at in zip(convs, trace_times(stamps, speed), strict=True):
        c.at = at
    return sorted(convs, key=lambda c: c.at or 0.0)


def _records(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        if line.strip():
            yield json.loads(line)
