"""``BodyLimit``: the HTTP request-body limit (``limits.max_body_bytes``) in front of every role's app.

A request whose ``Content-Length`` is over the limit is answered 413 (``KV_TOO_LARGE``) before one byte of its
body is read; a body without a length (chunked) is counted as it arrives and the read that crosses the limit
raises ``KVTooLarge`` (the app's error handler answers 413), so no more than the limit is ever buffered.
The limit is the role's (``max_bytes``, from its ``config.limits``; ``prfaas.security.guards`` installs it).
"""

from __future__ import annotations

import json
from typing import Any

from prfaas.errors import KVTooLarge
from prfaas.limits import DEFAULT


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int = DEFAULT.max_body_bytes) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        top = self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.strip().isdigit() and int(length) > top:
            return await _too_large(send, f"request body of {int(length)} bytes is over the {top}-byte limit")
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message: dict[str, Any] = await receive()
            seen += len(message.get("body", b""))
            if seen > top:
                raise KVTooLarge(f"request body is over the {top}-byte limit")
            return message

        await self.app(scope, counted, send)


async def _too_large(send: Any, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": KVTooLarge.code,
                                 "param": None}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
