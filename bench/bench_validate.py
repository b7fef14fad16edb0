"""Time request validation: decode_chat + check_chat on a realistic ~2 KB chat request.

Run ``python bench/bench_validate.py``. Prints µs/request for the gateway's decode+validate and,
from the same run, for ``json.loads`` of the same body (the baseline), and their ratio.
"""

from __future__ import annotations

import json
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.validate import check_chat, decode_chat

PROFILE = ModelProfile(name="test-model", lora_names=frozenset({"my-adapter"}))

_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city, in metric units.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
_SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the internal documentation and return the top passages.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query"],
        },
    },
}

BODY = {
    "model": "test-model",
    "messages": [
        {
            "role": "system",
            "content": (
                "You are a concise assistant for a travel company. Answer in at most three "
                "sentences, cite the tool results you used, and never invent prices. If the "
                "user asks about the weather, call get_weather; if they ask about policies, "
                "call search_docs first and quote the passage."
            ),
        },
        {"role": "user", "content": "What's the weather like in Paris this afternoon?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_abc123",
            "content": '{"temp_c": 18, "conditions": "sunny", "wind_kph": 9}',
        },
        {
            "role": "assistant",
            "content": "It's 18°C and sunny in Paris, with a light breeze of 9 km/h.",
        },
        {
            "role": "user",
            "content": (
                "Great. And what's our refund policy if a customer cancels a Paris tour less "
                "than 24 hours before it starts? Please keep it short."
            ),
        },
    ],
    "tools": [_WEATHER, _SEARCH],
    "tool_choice": "auto",
    "temperature": 0.7,
    "top_p": 0.95,
    "max_completion_tokens": 512,
    "stream": True,
    "stream_options": {"include_usage": True},
    "stop": ["</answer>"],
    "seed": 1234,
    "user": "user-42",
}


def main() -> None:
    body = json.dumps(BODY).encode()
    check_chat(decode_chat(body), PROFILE)  # warm up and prove it is valid

    def ours() -> None:
        check_chat(decode_chat(body), PROFILE)

    def baseline() -> None:
        json.loads(body)

    # Interleave the two timings so a noisy machine slows both alike; keep each one's best.
    number, rounds = 5_000, 15
    ours_runs, base_runs = [], []
    for _ in range(rounds):
        ours_runs.append(timeit.timeit(ours, number=number))
        base_runs.append(timeit.timeit(baseline, number=number))
    best_ours = min(ours_runs) / number * 1e6
    best_base = min(base_runs) / number * 1e6
    print(f"body: {len(body)} bytes")
    print(f"decode_chat + check_chat: {best_ours:7.2f} µs/request")
    print(f"json.loads (baseline):    {best_base:7.2f} µs/request")
    print(f"ratio:                    {best_ours / best_base:7.2f}x")


if __name__ == "__main__":
    main()
