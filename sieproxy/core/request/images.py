"""Inline images: base64 ``data:`` URIs to bytes, with the checks a client can act on.

The gateway never fetches a URL. An image arrives as ``data:<mime>[;params];base64,<payload>``;
anything else (``http(s):``, ``file:``, a bare path) is refused. The declared MIME type must be one
the engines' image processors read (PNG, JPEG, GIF, WebP) *and* agree with the payload's magic
bytes, so a mislabelled or non-image payload is refused here rather than failing inside an engine.
The size cap is checked on the base64 length before decoding, so an oversized payload is refused
without allocating its decoded copy.
"""

from __future__ import annotations

import binascii

from ..errors import InvalidRequest

__all__ = ["IMAGE_MIME_TYPES", "decode_image_uri"]

#: Accepted MIME types (``image/jpg`` is accepted as an alias of ``image/jpeg``).
IMAGE_MIME_TYPES: frozenset[str] = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})

_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}


def _magic_matches(mime: str, data: bytes) -> bool:
    if mime == "image/png":
        return data.startswith(b"\x89PNG\r\n\x1a\n")
    if mime == "image/jpeg":
        return data.startswith(b"\xff\xd8\xff")
    if mime == "image/gif":
        return data.startswith((b"GIF87a", b"GIF89a"))
    # image/webp: a RIFF container whose form type is WEBP.
    return data.startswith(b"RIFF") and data[8:12] == b"WEBP"


def _too_large(max_bytes: int, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"The image is larger than this model's {max_bytes}-byte limit; send a smaller one.",
        param=param,
    )


def decode_image_uri(uri: str, *, max_bytes: int, param: str) -> tuple[str, bytes]:
    """Return ``(mime, data)`` for a base64 image ``data:`` URI, or raise :class:`InvalidRequest`.

    ``param`` is the JSON path reported with any refusal.
    """
    if uri[:5].lower() != "data:":
        raise InvalidRequest(
            "Remote image URLs are not fetched; send the image inline as a base64 data: URI.",
            param=param,
        )
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise InvalidRequest(
            "The image data: URI is malformed; use data:<mime>;base64,<payload>.", param=param
        )
    parts = header.split(";")
    if len(parts) < 2 or parts[-1].strip().lower() != "base64":
        raise InvalidRequest(
            "The image data: URI must be base64-encoded; use data:<mime>;base64,<payload>.",
            param=param,
        )
    mime = parts[0].strip().lower()
    mime = _ALIASES.get(mime, mime)
    if mime not in IMAGE_MIME_TYPES:
        raise InvalidRequest(
            "Unsupported image type; send image/png, image/jpeg, image/gif or image/webp.",
            param=param,
        )
    size = len(payload)
    estimate = size // 4 * 3 - (payload[-2:].count("=") if size >= 2 else 0)
    if estimate > max_bytes:
        raise _too_large(max_bytes, param)
    try:
        data = binascii.a2b_base64(payload, strict_mode=True)
    except ValueError:  # binascii.Error, or non-ASCII characters in the payload
        raise InvalidRequest(
            "The image payload is not valid base64; encode it with the standard alphabet "
            "and padding, without whitespace.",
            param=param,
        ) from None
    if not data:
        raise InvalidRequest("The image payload is empty; send the image bytes.", param=param)
    if len(data) > max_bytes:
        raise _too_large(max_bytes, param)
    if not _magic_matches(mime, data):
        raise InvalidRequest(
            f"The image bytes are not a valid {mime} file; fix the data or its declared type.",
            param=param,
        )
    return mime, data
