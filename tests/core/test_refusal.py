"""Engine refusals: the classification table, the gateway's wording, and the gateway's own
checks against limits learned from the engine (``core.refusal``, ``core.validate``)."""

from __future__ import annotations

import json

import pytest

from sieproxy.core.errors import EngineAborted, EngineStreamError, GatewayError
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.refusal import Refusal, RequestFields, classify, engine_message, explain
from sieproxy.core.request.validate import (
    check_chat,
    check_completion,
    decode_chat,
    decode_completion,
)
from sieproxy.core.upstream.sglang import GenerateReader

CHAT = RequestFields()
CMPL = RequestFields(prompt="prompt")

#: The engines' own texts: SGLang's TokenizerManager / scheduler wording, which the CPU engine
#: reuses (engine/cpu/scheduler.py, params.py, grammar.py).
INPUT_TOO_LONG = "The input (9000 tokens) is longer than the model's context length (8192 tokens)."
TOTAL_TOO_LONG = (
    "Requested token count exceeds the model's maximum context length of 8192 tokens. You "
    "requested a total of 9100 tokens: 100 tokens from the input messages and 9000 tokens for "
    "the completion. Please reduce the number of tokens in the input messages or the "
    "completion to fit within the limit."
)
LOGIT_BIAS = "logit_bias must has keys in [0, 49151], got 50000."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (INPUT_TOO_LONG, Refusal("prompt_too_long", prompt_tokens=9000, context_length=8192)),
        (
            TOTAL_TOO_LONG,
            Refusal(
                "context_exceeded", prompt_tokens=100, completion_tokens=9000, context_length=8192
            ),
        ),
        (LOGIT_BIAS, Refusal("logit_bias", token_id=50000, vocab_size=49152)),
        ("logit_bias key 'x' is not a token id", Refusal("logit_bias")),
        ("Invalid grammar request with cache hit: key=('json', '{')", Refusal("grammar")),
        ("invalid json_schema: expected value at line 1", Refusal("grammar")),
        ("Only one of json_schema, regex, ebnf, or structural_tag can be set.", Refusal("grammar")),
        ("max_new_tokens must be at least 0, got -1.", Refusal("max_tokens")),
        ("something else entirely", Refusal("other")),
        (None, Refusal("other")),
    ],
)
def test_classify_table(text: str | None, expected: Refusal) -> None:
    assert classify(text) == expected


@pytest.mark.parametrize(
    "body",
    [
        {"error": INPUT_TOO_LONG},  # the JSON contract check's shape
        {"error": {"message": INPUT_TOO_LONG}},  # validation errors, stream error events
        {"object": "error", "message": INPUT_TOO_LONG, "type": "Bad Request", "code": 400},
    ],
)
def test_engine_message_reads_every_sglang_shape(body: object) -> None:
    assert engine_message(body) == INPUT_TOO_LONG


def _check(err: GatewayError, param: str, code: str, *words: str) -> None:
    env = err.envelope()["error"]
    assert (err.status, env["param"], env["code"]) == (400, param, code), env
    assert env["type"] == "invalid_request_error"
    for w in words:
        assert w in env["message"], (w, env["message"])


def test_explain_prompt_too_long_names_the_prompt_field_with_the_numbers() -> None:
    r = classify(INPUT_TOO_LONG)
    _check(explain(r, CHAT), "messages", "context_length_exceeded", "8192", "9000", "messages")
    _check(explain(r, CMPL), "prompt", "context_length_exceeded", "8192", "9000", "prompt")


def test_explain_total_over_context_names_the_token_cap_the_client_sent() -> None:
    r = classify(TOTAL_TOO_LONG)
    err = explain(r, RequestFields(max_tokens="max_completion_tokens"))
    _check(err, "max_completion_tokens", "context_length_exceeded", "8192", "9100", "100",
           "9000", "at most 8092")  # fmt: skip
    _check(explain(r, CMPL), "max_tokens", "context_length_exceeded", "prompt")


def test_explain_other_kinds() -> None:
    _check(explain(classify(LOGIT_BIAS), CHAT), "logit_bias", "invalid_request", "50000", "49152")
    _check(explain(classify("logit_bias bad"), CHAT), "logit_bias", "invalid_request")
    grammar = classify("Invalid grammar request: x")
    _check(explain(grammar, CHAT), "response_format", "invalid_request", "JSON schema")
    _check(explain(grammar, RequestFields(grammar="tools")), "tools", "invalid_request")
    _check(explain(classify("max_new_tokens too big"), CHAT), "max_tokens", "invalid_request")
    other = explain(classify("whatever the engine said"), CHAT)
    _check(other, None, "invalid_request")  # type: ignore[arg-type]
    assert "whatever" not in other.message  # engine text is never echoed


def test_upstream_reader_classifies_stream_errors_and_aborts() -> None:
    """Both in-stream refusal shapes carry the classified refusal (and no engine text)."""
    reader = GenerateReader()
    with pytest.raises(EngineStreamError) as caught:
        reader.feed(json.dumps({"error": {"message": INPUT_TOO_LONG, "code": 400}}))
    assert caught.value.status == 400
    assert caught.value.refusal == classify(INPUT_TOO_LONG)
    assert "9000" not in caught.value.message

    abort = {"type": "abort", "message": "Invalid grammar request: bad", "status_code": 400}
    chunk = {"text": "", "meta_info": {"prompt_tokens": 3, "completion_tokens": 0,
                                       "finish_reason": abort}}  # fmt: skip
    with pytest.raises(EngineAborted) as aborted:
        GenerateReader().feed(json.dumps(chunk))
    assert aborted.value.refusal == Refusal("grammar")

    oom = dict(abort, status_code=503, message="KV cache full")
    chunk["meta_info"]["finish_reason"] = oom  # type: ignore[index]
    with pytest.raises(EngineAborted) as overloaded:
        GenerateReader().feed(json.dumps(chunk))
    assert overloaded.value.refusal is None  # not a refusal: a 503


# ---- the gateway's own checks, once the engine's limits are known ---------------------------

LIMITED = ModelProfile(name="m", context_length=2048, vocab_size=49152)


def _chat(profile: ModelProfile, **body: object) -> object:
    raw = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return check_chat(decode_chat(json.dumps(raw).encode()), profile)


def test_max_tokens_at_or_over_the_context_is_refused_before_sending() -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(GatewayError) as caught:
            _chat(LIMITED, **{field: 2048})
        _check(caught.value, field, "context_length_exceeded", "2048", "less than 2048")
    assert _chat(LIMITED, max_tokens=2047).max_tokens == 2047  # type: ignore[attr-defined]
    raw = json.dumps({"model": "m", "prompt": "x", "max_tokens": 5000}).encode()
    with pytest.raises(GatewayError) as caught:
        check_completion(decode_completion(raw), LIMITED)
    _check(caught.value, "max_tokens", "context_length_exceeded", "2048")


def test_default_cap_is_lowered_to_fit_a_small_context() -> None:
    small = ModelProfile(name="m", default_max_tokens=1024, context_length=512)
    assert _chat(small).max_tokens == 511  # type: ignore[attr-defined]
    assert _chat(ModelProfile(name="m", default_max_tokens=1024)).max_tokens == 1024  # type: ignore[attr-defined]


def test_logit_bias_id_outside_the_vocabulary_is_refused_before_sending() -> None:
    with pytest.raises(GatewayError) as caught:
        _chat(LIMITED, logit_bias={"10": 1, "49152": -100})
    _check(caught.value, "logit_bias", "invalid_request", "49152", "0 to 49151")
    assert _chat(LIMITED, logit_bias={"49151": 5})
    # Unknown limits: nothing is checked here (the engine's refusal is classified instead).
    assert _chat(ModelProfile(name="m"), logit_bias={"999999": 1}, max_tokens=100000)
