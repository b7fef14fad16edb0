"""SGLang's own JSON contract, for conformance tests (no tests here).

SGLang 0.5.23 ships its HTTP JSON contract as generated code, ``sglang/api/v1/api_types.py``:
frozen msgspec Structs (``GenerateRequest``, ``SamplingParams``, ``GenerateResponse``,
``GenerateMetaInfo``, ``GenerateStreamError``, ``FinishStop`` / ``FinishLength`` /
``FinishAbort``, ``LogprobEntry``, ``GetServerInfoResponse``, ``GetModelInfoResponse``,
``ModelCard``, ``AbortRequest``, …) each with ``from_json_value(parsed_json)``, which raises
``JsonContractError`` (a ``ValueError``) exactly where SGLang's server answers 400. Its only
import outside the standard library is ``msgspec``. The server's gate,
``sglang/srt/entrypoints/api_contract.py:generate_contract_error``, is just
``GenerateRequest.from_json_value(body)``; :func:`generate_contract_error` mirrors it.

The module is never committed. :func:`load_contract` downloads the wheel once with
``pip download --no-deps`` into a cache outside the repository (``$SIEPROXY_TEST_CACHE`` or
``~/.cache/sieproxy-tests``), extracts that one file, and imports it standalone with importlib.
The wheel is platform-specific (cp311, manylinux_2_34, x86_64), so the download names that
platform explicitly and works from any interpreter. If it cannot be had, the calling test is
skipped with a loud reason — or fails, when ``SIEPROXY_REQUIRE_SGLANG_CONTRACT=1``.

The decoders ignore unknown keys in most objects (SGLang tolerates them) but deny unknown keys in
``sampling_params``. One leniency is tightened here: ``decode_FinishReason`` falls back to a
plain dict when a known ``type`` has ill-typed fields; :func:`validate_generate_chunk` treats
that as a violation.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

__all__ = [
    "CONTRACT_MEMBER",
    "SGLANG_VERSION",
    "ContractViolation",
    "cache_dir",
    "generate_contract_error",
    "load_contract",
    "sampling_params_fields",
    "validate_abort_request",
    "validate_generate_chunk",
    "validate_generate_request",
    "validate_generate_response",
    "validate_model_card",
    "validate_model_info",
    "validate_server_info",
    "validate_stream_error",
]

SGLANG_VERSION = "0.5.23"
CONTRACT_MEMBER = "sglang/api/v1/api_types.py"
_WHEEL_TAGS = ("--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
               "--platform", "manylinux_2_34_x86_64", "--only-binary=:all:")  # fmt: skip
_DOWNLOAD_TIMEOUT = 600.0


class ContractViolation(AssertionError):
    """A value that SGLang's JSON contract rejects."""


def cache_dir() -> Path:
    """Where the wheel and the extracted contract live (outside the repository)."""
    base = os.environ.get("SIEPROXY_TEST_CACHE")
    if base:
        root = Path(base)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "sieproxy-tests"
    return root / f"sglang-{SGLANG_VERSION}"


def _fetch() -> Path:
    """The extracted contract file, downloading the wheel if needed; raises RuntimeError."""
    target = cache_dir() / CONTRACT_MEMBER
    if target.is_file():
        return target
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", *_WHEEL_TAGS, f"sglang=={SGLANG_VERSION}",
               "-d", str(cache)]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"`pip download` failed to run: {exc}") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError("`pip download` failed: " + " | ".join(tail))
        wheels = sorted(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if not wheels:
            raise RuntimeError("`pip download` succeeded but left no sglang wheel")
    try:
        with zipfile.ZipFile(wheels[-1]) as zf:
            data = zf.read(CONTRACT_MEMBER)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise RuntimeError(f"cannot read {CONTRACT_MEMBER} from {wheels[-1].name}: {exc}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(data)
    os.replace(tmp.name, target)
    return target


@functools.cache
def _load() -> ModuleType | str:
    try:
        path = _fetch()
        name = f"_sglang_{SGLANG_VERSION.replace('.', '_')}_api_types"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return f"cannot import {path}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # msgspec resolves the Structs' annotations through it
        spec.loader.exec_module(module)
        return module
    except Exception as exc:  # any failure to obtain the contract is reported, not raised
        return f"{type(exc).__name__}: {exc}"


def load_contract() -> ModuleType:
    """SGLang 0.5.23's ``api_types`` module; skips the calling test (loudly) if unavailable."""
    result = _load()
    if isinstance(result, ModuleType):
        return result
    reason = (
        f"!!! SGLang {SGLANG_VERSION} JSON contract unavailable — conformance NOT checked: {result}"
    )
    print(reason, file=sys.stderr)
    if os.environ.get("SIEPROXY_REQUIRE_SGLANG_CONTRACT") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def _decode(type_name: str, value: Any) -> Any:
    contract = load_contract()
    try:
        return getattr(contract, type_name).from_json_value(value)
    except contract.JsonContractError as exc:
        raise ContractViolation(f"{type_name}: {exc}: {value!r}"[:2000]) from exc


def generate_contract_error(body: Any) -> str | None:
    """SGLang's ``generate_contract_error``: the violation in a ``/generate`` body, or None."""
    contract = load_contract()
    try:
        contract.GenerateRequest.from_json_value(body)
    except contract.JsonContractError as exc:
        return str(exc)
    return None


def sampling_params_fields() -> tuple[str, ...]:
    """The ``sampling_params`` keys the contract accepts."""
    return tuple(load_contract()._FIELDS_SamplingParams)


def validate_generate_request(body: Any) -> Any:
    """Decode a ``/generate`` body as SGLang's gate does; returns the ``GenerateRequest``."""
    return _decode("GenerateRequest", body)


def _check_finish(finish: Any) -> None:
    contract = load_contract()
    known = {"stop": contract.FinishStop, "length": contract.FinishLength,
             "abort": contract.FinishAbort}  # fmt: skip
    decoded = contract.decode_FinishReason(finish)
    tag = finish.get("type")
    if tag in known and not isinstance(decoded, known[tag]):
        raise ContractViolation(f"finish_reason of type {tag!r} is ill-typed: {finish!r}")


def validate_stream_error(obj: Any) -> Any:
    """Decode an in-stream ``{"error": {...}}`` event as ``GenerateStreamError``."""
    out = _decode("GenerateStreamError", obj)
    if out.error is None:
        raise ContractViolation(f"stream error without an error body: {obj!r}")
    return out


def validate_generate_chunk(obj: Any) -> Any:
    """Decode one ``/generate`` SSE event object (a chunk, or an error event)."""
    if isinstance(obj, dict) and "error" in obj:
        return validate_stream_error(obj)
    out = _decode("GenerateResponse", obj)
    if out.meta_info is None:
        raise ContractViolation(f"chunk without meta_info: {obj!r}"[:2000])
    if obj["meta_info"].get("finish_reason") is not None:
        _check_finish(obj["meta_info"]["finish_reason"])
    return out


def validate_generate_response(obj: Any) -> Any:
    """Decode a non-streaming ``/generate`` body (one object, or a list for batches)."""
    if isinstance(obj, list):
        return [validate_generate_chunk(item) for item in obj]
    return validate_generate_chunk(obj)


def validate_server_info(obj: Any) -> Any:
    """Decode a ``/server_info`` body as ``GetServerInfoResponse``."""
    return _decode("GetServerInfoResponse", obj)


def validate_model_info(obj: Any) -> Any:
    """Decode a ``/model_info`` body as ``GetModelInfoResponse``."""
    return _decode("GetModelInfoResponse", obj)


def validate_model_card(obj: Any) -> Any:
    """Decode one entry of ``/v1/models`` ``data`` as ``ModelCard``."""
    return _decode("ModelCard", obj)


def validate_abort_request(obj: Any) -> Any:
    """Decode an ``/abort_request`` body as ``AbortRequest``."""
    return _decode("AbortRequest", obj)
