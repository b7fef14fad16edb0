"""Request validation: the contract table, then focused behaviour of decode_* / check_*."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest

from sieproxy.core.errors import InvalidRequest, RequestError, UnsupportedField
from sieproxy.core.request import validate
from sieproxy.core.request.images import decode_image_uri
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.schemas import CHAT_KNOWN_REJECTED, COMPLETIONS_KNOWN_REJECTED
from sieproxy.core.request.valid import ValidChat, ValidCompletion
from sieproxy.core.request.validate import (
    check_chat,
    check_completion,
    decode_chat,
    decode_completion,
)
from tests.contract_cases import (
    CASES,
    PNG_B64,
    PNG_DATA_URI,
    PROFILE,
    PROFILES,
    TEXT_ONLY,
    Case,
    body_bytes,
)


def run(case_or_body: Case | dict[str, Any] | bytes, endpoint: str = "chat") -> Any:
    if isinstance(case_or_body, Case):
        endpoint, body = case_or_body.endpoint, body_bytes(case_or_body)
    elif isinstance(case_or_body, bytes):
        body = case_or_body
    else:
        body = json.dumps(case_or_body).encode()
    if endpoint == "chat":
        req = decode_chat(body)
        return check_chat(req, PROFILES[req.model])
    creq = decode_completion(body)
    return check_completion(creq, PROFILES[creq.model])


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return body


def refusal(body: dict[str, Any] | bytes, endpoint: str = "chat") -> RequestError:
    with pytest.raises(RequestError) as info:
        run(body, endpoint)
    return info.value


# ---------------------------------------------------------------- the contract table


def test_table_ids_are_unique_and_well_formed() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    for c in CASES:
        assert c.endpoint in ("chat", "completions")
        assert (c.status, c.code) == (200, None) or (
            c.status == 400 and c.code in ("invalid_request", "unsupported_field")
        ), c.id
        if isinstance(c.body, dict):
            assert c.body.get("model", "test-model") in PROFILES or c.status == 400


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_contract_case(case: Case) -> None:
    if case.status == 200:
        result = run(case)
        assert isinstance(result, ValidChat if case.endpoint == "chat" else ValidCompletion)
        return
    with pytest.raises(RequestError) as info:
        run(case)
    err = info.value
    assert err.status == case.status
    assert err.code == case.code, err
    assert err.param == case.param, err
    assert err.message and err.message.endswith("."), err
    envelope = err.envelope()["error"]
    assert envelope["code"] == case.code and envelope["param"] == case.param
    assert envelope["type"] == "invalid_request_error"


def test_every_rule_has_an_accepted_and_a_refused_case() -> None:
    # Each refused param has at least one accepted case exercising the same field.
    refused_params = {
        (c.endpoint, c.param.split(".")[0].split("[")[0])
        for c in CASES
        if c.status == 400 and c.param
    }
    accepted_fields: set[tuple[str, str]] = set()
    for c in CASES:
        if c.status == 200 and isinstance(c.body, dict):
            accepted_fields |= {(c.endpoint, k) for k in c.body}
    never_accepted = {
        p
        for p in refused_params
        if p not in accepted_fields
        and p[1] not in CHAT_KNOWN_REJECTED
        and p[1] not in COMPLETIONS_KNOWN_REJECTED
        and p[1] not in ("foo", "messages", "top_k", "stream_options")
    }
    assert never_accepted == set()


# ---------------------------------------------------------------- msgspec error translation


@pytest.mark.parametrize(
    ("text", "kind", "param"),
    [
        ("Object contains unknown field `foo`", UnsupportedField, "foo"),
        (
            "Object contains unknown field `x` - at `$.stream_options`",
            UnsupportedField,
            "stream_options.x",
        ),
        (
            "Object contains unknown field `q` - at `$.chat_template_kwargs.guardian_config`",
            UnsupportedField,
            "chat_template_kwargs.guardian_config.q",
        ),
        (
            "Object contains unknown field `x` - at `$.messages[3].content[0]`",
            InvalidRequest,
            "messages[3].content[0].x",
        ),
        ("Expected `int | null`, got `str` - at `$.n`", InvalidRequest, "n"),
        ("Expected `str`, got `int` - at `$.messages[0].role`", InvalidRequest, "messages[0].role"),
        ("Expected `float`, got `str` - at `$.logit_bias[...]`", InvalidRequest, "logit_bias"),
        ("Object missing required field `messages`", InvalidRequest, "messages"),
        (
            "Object missing required field `role` - at `$.messages[2]`",
            InvalidRequest,
            "messages[2].role",
        ),
        ("Expected `object`, got `array`", InvalidRequest, None),
        ("Invalid enum value 'x' - at `$.tool_choice`", InvalidRequest, "tool_choice"),
        ("Number out of range - at `$.temperature`", InvalidRequest, "temperature"),
        ("Something new - at `$.tools[0]`", InvalidRequest, "tools[0]"),
        ("Something new", InvalidRequest, None),
    ],
)
def test_validation_error_translation(
    text: str, kind: type[RequestError], param: str | None
) -> None:
    err = validate._validation_error(text)
    assert type(err) is kind
    assert err.param == param
    assert text not in err.message
    assert "$" not in err.message


def test_messages_never_echo_library_text() -> None:
    for body in (b"{", b"\xff", b"[]", b'{"model": 1}'):
        err = refusal(body)
        assert "msgspec" not in err.message and "byte" not in err.message
        assert "Expected `" not in err.message
    err = refusal(chat(n="x"))
    assert err.message == "`n` must be an integer, not a string."


def test_enum_message_lists_the_allowed_values() -> None:
    err = refusal(chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]))
    assert err.param == "messages[0].content[0].type"
    assert "`image_url`" in err.message and "audio" not in err.message


# ---------------------------------------------------------------- chat behaviour


def test_developer_is_normalized_to_system_in_place() -> None:
    body = chat(
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    req = decode_chat(json.dumps(body).encode())
    assert [m.role for m in req.messages] == ["system", "user"]
    valid = check_chat(req, PROFILE)
    assert valid.req.messages[0].role == "system"


def test_chat_defaults() -> None:
    valid = run(chat())
    assert isinstance(valid, ValidChat)
    assert valid.model == "test-model"
    assert (valid.n, valid.candidates, valid.best_of) == (1, 1, None)
    assert valid.max_tokens == 1024
    assert (valid.stream, valid.include_usage) == (False, False)
    assert (valid.logprobs, valid.top_logprobs, valid.include_reasoning) == (False, 0, False)
    assert valid.stop == [] and valid.images == []


def test_default_max_tokens_comes_from_the_profile() -> None:
    profile = ModelProfile(name="test-model", default_max_tokens=77)
    valid = check_chat(decode_chat(json.dumps(chat()).encode()), profile)
    assert valid.max_tokens == 77
    with pytest.raises(InvalidRequest) as info:
        check_chat(decode_chat(json.dumps(chat(min_tokens=78)).encode()), profile)
    err = info.value
    assert err.param == "min_tokens"


def test_max_completion_tokens_wins() -> None:
    assert run(chat(max_completion_tokens=5, max_tokens=10)).max_tokens == 5
    assert run(chat(max_tokens=10)).max_tokens == 10
    assert run(chat(max_completion_tokens=None, max_tokens=7)).max_tokens == 7


def test_candidates_and_flags() -> None:
    valid = run(chat(n=2, best_of=5, logprobs=True, top_logprobs=3, include_reasoning=True))
    assert (valid.n, valid.candidates, valid.best_of) == (2, 5, 5)
    assert (valid.logprobs, valid.top_logprobs, valid.include_reasoning) == (True, 3, True)
    assert run(chat(n=4)).candidates == 4


def test_include_usage_needs_stream() -> None:
    assert run(chat(stream=True, stream_options={"include_usage": True})).include_usage is True
    assert run(chat(stream=False, stream_options={"include_usage": True})).include_usage is False
    assert run(chat(stream=True, stream_options={"include_usage": False})).include_usage is False
    assert run(chat(stream=True)).include_usage is False


def test_stop_is_always_a_list() -> None:
    assert run(chat(stop="END")).stop == ["END"]
    assert run(chat(stop=["a", "b"])).stop == ["a", "b"]
    assert run(chat(stop=None)).stop == []


def test_absent_and_null_are_the_same() -> None:
    absent = decode_chat(json.dumps(chat()).encode())
    null = decode_chat(json.dumps(chat(temperature=None, n=None, tools=None, stop=None)).encode())
    assert absent == null
    # Known-rejected fields: explicit null is absent too (but any other value is refused).
    decode_chat(json.dumps(chat(functions=None, reasoning_effort=None)).encode())
    err = refusal(chat(reasoning_effort="low"))
    assert isinstance(err, UnsupportedField)
    assert err.message == CHAT_KNOWN_REJECTED["reasoning_effort"]


def test_assistant_content_may_be_null_only_with_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok_body = chat(
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ]
    )
    run(ok_body)
    bad = chat(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": []}]
    )
    assert refusal(bad).param == "messages[1].content"


def test_tool_call_arguments_must_be_a_json_object() -> None:
    for arguments, accepted in (("{}", True), ('{"a": [1]}', True), ("[1]", False), ("", False)):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        body = chat(
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [call]},
            ]
        )
        if accepted:
            run(body)
        else:
            assert refusal(body).param == "messages[1].tool_calls[0].function.arguments"


def test_first_error_in_document_order_of_checks() -> None:
    # Scalar rules run before message rules.
    err = refusal(chat(n=0, messages=[]))
    assert err.param == "n"
    # best_of range before the streaming refusal, which comes before best_of >= n.
    assert isinstance(refusal(chat(best_of=0, stream=True)), InvalidRequest)
    assert isinstance(refusal(chat(best_of=1, n=2, stream=True)), UnsupportedField)


def test_decode_accepts_bytes_like_bodies() -> None:
    body = json.dumps(chat()).encode()
    assert decode_chat(bytearray(body)).model == "test-model"  # type: ignore[arg-type]
    assert decode_chat(memoryview(body)).model == "test-model"  # type: ignore[arg-type]


def test_error_is_chained_but_message_is_ours() -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_chat(b'{"model": "m", "messages": [], "n": "x"}')
    assert isinstance(info.value.__cause__, msgspec.ValidationError)


# ---------------------------------------------------------------- images


def _image_body(url: str, model: str = "test-model", kind: str = "image_url") -> dict[str, Any]:
    return chat(
        model=model,
        messages=[
            {"role": "system", "content": "Describe images."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "?"}, {"type": kind, "image_url": url}],
            },
        ],
    )


def test_image_inputs_are_decoded() -> None:
    valid = run(_image_body(PNG_DATA_URI))
    [image] = valid.images
    assert (image.message_index, image.part_index) == (1, 1)
    assert image.mime == "image/png"
    assert image.data == base64.b64decode(PNG_B64)
    assert image.data_uri == PNG_DATA_URI


def test_image_object_form_and_input_image() -> None:
    body = chat(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": PNG_DATA_URI, "detail": "high"}},
                    {"type": "input_image", "image_url": PNG_DATA_URI},
                ],
            }
        ]
    )
    assert [(i.message_index, i.part_index) for i in run(body).images] == [(0, 0), (0, 1)]


def test_image_mime_variants() -> None:
    jpeg = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\x00" * 16).decode()
    gif = base64.b64encode(b"GIF89a" + b"\x00" * 16).decode()
    webp = base64.b64encode(b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 8).decode()
    for uri, mime in (
        (f"data:image/jpeg;base64,{jpeg}", "image/jpeg"),
        (f"data:image/jpg;base64,{jpeg}", "image/jpeg"),
        (f"DATA:IMAGE/PNG;BASE64,{PNG_B64}", "image/png"),
        (f"data:image/gif;base64,{gif}", "image/gif"),
        (f"data:image/webp;name=a.webp;base64,{webp}", "image/webp"),
    ):
        assert decode_image_uri(uri, max_bytes=1000, param="p")[0] == mime
    with pytest.raises(InvalidRequest):
        decode_image_uri(f"data:image/webp;base64,{gif}", max_bytes=1000, param="p")


def test_image_size_limit() -> None:
    size = len(base64.b64decode(PNG_B64))
    small = ModelProfile(
        name="test-model", inputs=frozenset({"text", "image"}), max_image_bytes=size
    )
    check_chat(decode_chat(json.dumps(_image_body(PNG_DATA_URI)).encode()), small)
    tiny = ModelProfile(
        name="test-model", inputs=frozenset({"text", "image"}), max_image_bytes=size - 1
    )
    with pytest.raises(InvalidRequest) as info:
        check_chat(decode_chat(json.dumps(_image_body(PNG_DATA_URI)).encode()), tiny)
    assert info.value.param == "messages[1].content[1].image_url"
    assert str(size - 1) in info.value.message
    # A huge payload is refused on its length, before decoding.
    huge = "data:image/png;base64," + "A" * 4_000_000
    with pytest.raises(InvalidRequest, match="limit"):
        decode_image_uri(huge, max_bytes=1000, param="p")


def test_encode_only_and_text_only_models_refuse_images() -> None:
    req = decode_chat(json.dumps(_image_body(PNG_DATA_URI)).encode())
    encoder = ModelProfile(name="test-model", inputs=frozenset({"text", "image"}), encode_only=True)
    for profile in (encoder, TEXT_ONLY):
        with pytest.raises(UnsupportedField) as info:
            check_chat(req, profile)
        assert info.value.param == "messages[1].content[1]"
    with pytest.raises(UnsupportedField, match="encode-only"):
        check_chat(req, encoder)


def test_encode_only_model_cannot_generate() -> None:
    """An embedding model named on either generation surface is a 400 naming `model` (an image
    part sent to it keeps the contract's own refusal: see the test above)."""
    encoder = ModelProfile(name="enc", inputs=frozenset({"text", "image"}), encode_only=True)
    errors: list[RequestError] = []
    chat = {"model": "enc", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(RequestError) as info:
        check_chat(decode_chat(json.dumps(chat).encode()), encoder)
    errors.append(info.value)
    completion = decode_completion(json.dumps({"model": "enc", "prompt": "hi"}).encode())
    with pytest.raises(RequestError) as info:
        check_completion(completion, encoder)
    errors.append(info.value)
    for err in errors:
        assert type(err) is InvalidRequest
        assert err.status == 400 and err.code == "invalid_request" and err.param == "model"
        assert "`enc`" in err.message and "cannot generate" in err.message
        assert "embedding (encode-only)" in err.message


def test_remote_urls_are_refused_without_fetching() -> None:
    for url in (
        "https://example.com/a.png",
        "http://127.0.0.1/a.png",
        "file:///etc/passwd",
        "a.png",
    ):
        err = refusal(_image_body(url))
        assert isinstance(err, InvalidRequest)
        assert err.param == "messages[1].content[1].image_url"
        assert url not in err.message


def test_non_ascii_base64_is_refused() -> None:
    err = refusal(_image_body("data:image/png;base64,iVBORw0KGgo\u00e9=="))
    assert err.param == "messages[1].content[1].image_url"


# ---------------------------------------------------------------- completions


def test_completion_defaults() -> None:
    valid = run({"model": "test-model", "prompt": "Hi"}, "completions")
    assert isinstance(valid, ValidCompletion)
    assert (valid.prompt, valid.max_tokens, valid.stream, valid.stop) == ("Hi", 16, False, [])
    valid = run({"model": "test-model", "prompt": "Hi", "max_tokens": None}, "completions")
    assert valid.max_tokens == 16
    valid = run(
        {"model": "test-model", "prompt": "Hi", "max_tokens": 3, "stream": True, "stop": "x"},
        "completions",
    )
    assert (valid.max_tokens, valid.stream, valid.stop) == (3, True, ["x"])


def test_completion_known_rejected_messages() -> None:
    for name, message in COMPLETIONS_KNOWN_REJECTED.items():
        err = refusal({"model": "test-model", "prompt": "x", name: 1}, "completions")
        assert isinstance(err, UnsupportedField)
        assert (err.param, err.message) == (name, message)


# ---------------------------------------------------------------- module surface


def test_public_surface() -> None:
    assert {"decode_chat", "decode_completion", "check_chat", "check_completion"} <= set(
        validate.__all__
    )
    for name in validate.__all__:
        assert hasattr(validate, name)
