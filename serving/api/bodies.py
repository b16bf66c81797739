"""Request bodies over HTTP: the media types a route takes, the size limit (declared and as read) and the time a body
may take to arrive, the same for every route that reads one."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from .schemas import JSON, HTTPError, Limits

BINARY = "application/octet-stream"


def check_media(content_type: str | None, encoding: str | None, binary: bool = False) -> None:
    """A body must say it is JSON (``binary``: or ``application/octet-stream``, or say nothing, as Triton's clients
    send the Open Inference Protocol's binary tensors), uncompressed: a ``text/plain`` or form POST is what a
    cross-site page may send without a CORS preflight, and a compressed body would only fail later as "not valid
    JSON". Raises HTTPError 415."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    is_json = media == JSON or (media.startswith("application/") and media.endswith("+json"))
    if not is_json and not (binary and media in ("", BINARY)):
        wanted = f"{JSON} or {BINARY} (or no Content-Type)" if binary else JSON
        raise HTTPError(
            415, "unsupported_media_type", f"Content-Type {content_type or '(none)'!r:.100} is not supported; send {wanted}"
        )
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise HTTPError(
            415, "unsupported_media_type", f"Content-Encoding {encoding!r:.100} is not supported; send the body uncompressed"
        )


async def read_body(request: Request, limits: Limits, binary: bool = False) -> bytes:
    """The whole body, checked (``check_media``), within ``limits.max_body_bytes`` (413 ``body_too_large``, from the
    declared length or as it arrives) and ``limits.body_timeout_s`` (408 ``body_timeout``). Raises HTTPError."""
    check_media(request.headers.get("content-type"), request.headers.get("content-encoding"), binary)
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, "body_too_large", f"request body of {declared} bytes; the limit is {limit}")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, "body_too_large", f"request body over {limit} bytes; the limit is {limit}")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise HTTPError(
            408,
            "body_timeout",
            f"the request body did not arrive within {limits.body_timeout_s:g} s (Content-Length {declared})",
        ) from None
