"""Prefix affinity keys (sieproxy.core.planning.affinity) and their computation in the chat plan."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sieproxy.core.planning.affinity import PREFIX_BLOCK, opening_end, prefix_key
from sieproxy.core.request.profile import ModelProfile
from sieproxy.surfaces import CHAT, COMPLETIONS, RESPONSES

from .test_plan import QWEN_TEMPLATE

MODEL = "m"
SYSTEM = {"role": "system", "content": "You are a terse assistant for ACME support."}
TEMPLATED = {MODEL: ModelProfile(name=MODEL, chat_template=QWEN_TEMPLATE)}
FALLBACK = {MODEL: ModelProfile(name=MODEL)}  # tools rendered first


def _chat_key(messages: list[dict[str, Any]], profiles: Any = None, **extra: Any) -> str | None:
    raw = msgspec.json.encode({"model": MODEL, "messages": messages, **extra})
    return CHAT.prepare(raw, profiles or TEMPLATED, request_id="r", created=0).prefix_key


def profiles_for() -> dict[str, ModelProfile]:
    return TEMPLATED


def turns(first: str, n: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first}]
    for i in range(n):
        msgs += [
            {"role": "assistant", "content": f"answer {i}"},
            {"role": "user", "content": f"follow-up {i}"},
        ]
    return msgs


@pytest.mark.parametrize("profiles", [TEMPLATED, FALLBACK], ids=["template", "fallback"])
def test_a_growing_conversation_keeps_its_key(profiles: Any) -> None:
    keys = {_chat_key(turns("My router blinks red.", n), profiles) for n in range(5)}
    assert len(keys) == 1 and None not in keys


def test_conversations_sharing_a_system_prompt_get_different_keys() -> None:
    keys = {_chat_key(turns(f"Question number {i}?", 2)) for i in range(20)}
    assert len(keys) == 20


def test_the_key_changes_with_the_system_prompt_and_the_tools() -> None:
    base = _chat_key(turns("hello there", 1), FALLBACK)
    other_system = [{"role": "system", "content": "Other."}, *turns("hello there", 1)[1:]]
    assert _chat_key(other_system, FALLBACK) != base
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    assert _chat_key(turns("hello there", 1), FALLBACK, tools=[tool]) != base


def test_the_opening_is_found_after_the_system_prompt() -> None:
    system = "Say hi to everyone. hi"
    prompt = f"<s>{system}</s><u>hi</u><a>"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    end = opening_end(prompt, messages)
    assert end == prompt.index("<u>hi") + len("<u>hi")


def test_content_parts_and_a_missing_opening() -> None:
    parts = [{"type": "text", "text": "look at this"}, {"type": "image_url", "image_url": {}}]
    prompt = "<u>look at this [img]</u>"
    assert opening_end(prompt, [{"role": "user", "content": parts}]) == len("<u>look at this")
    assert opening_end(prompt, [{"role": "user", "content": "not there"}]) is None
    assert opening_end(prompt, [{"role": "system", "content": "x"}]) is None


def test_fixed_block_without_an_opening() -> None:
    long = "x" * PREFIX_BLOCK
    assert prefix_key(long + "tail one") == prefix_key(long + "tail two")
    assert prefix_key("short one") != prefix_key("short two")
    assert prefix_key("abc", 2) == prefix_key("abd", 2)


def test_completions_and_responses_carry_a_prefix_key() -> None:
    profiles = profiles_for()
    a = COMPLETIONS.prepare(
        msgspec.json.encode({"model": MODEL, "prompt": "x" * PREFIX_BLOCK + "a"}),
        profiles, request_id="r", created=0,
    )  # fmt: skip
    b = COMPLETIONS.prepare(
        msgspec.json.encode({"model": MODEL, "prompt": "x" * PREFIX_BLOCK + "b"}),
        profiles, request_id="r", created=0,
    )  # fmt: skip
    assert a.prefix_key is not None and a.prefix_key == b.prefix_key
    resp = RESPONSES.prepare(
        msgspec.json.encode({"model": MODEL, "input": "My router blinks red."}),
        profiles, request_id="r", created=0,
    )  # fmt: skip
    chat = _chat_key([{"role": "user", "content": "My router blinks red."}])
    assert resp.prefix_key == chat
