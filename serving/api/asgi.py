"""ASGI middleware that needs no replica."""

from __future__ import annotations

from typing import Any


class HeadAsGet:
    """HEAD on a GET route answers as GET would, without the body (Starlette's plain routes do this; FastAPI's do not,
    so HEAD /healthz was a 405)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: dict[str, Any]) -> None:
            if message["type"] != "http.response.body":
                await send(message)
            elif not message.get("more_body", False):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive, headers_only)
