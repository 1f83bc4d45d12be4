"""Request hygiene before the app: JSON bodies only, and a body-size limit enforced before reading.

Strategy: a plain ASGI middleware (:class:`RequestGuard`) in front of the handlers.  A request
with a body (any method but GET/HEAD/OPTIONS/DELETE) must say ``Content-Type: application/json``
(parameters such as ``charset`` allowed) or is answered 415 without its body being read: a
``text/plain`` POST is a "simple" cross-origin request a web page may send without a CORS
preflight, so refusing it keeps pages from driving the API.  A declared ``Content-Length`` over
``max_body_bytes`` is answered 413 at once, from the headers alone; a body without a length
(chunked) is read here, counting, and refused 413 the moment it passes the limit, so no more
than ``max_body_bytes`` of it is ever held; a body within the limit is replayed to the app as
one message.  Both answers use OpenAI's error body.
"""

from __future__ import annotations

from typing import Any, final

from skippy.api.auth import ASGIApp, Receive, Scope, Send, send_error

#: Default body-size limit: room for a prompt of ~100k tokens as text or as a JSON list of token ids
#: (tokenising 1 MiB of text takes 0.5-1.5 s of one core, off the event loop).
DEFAULT_MAX_BODY_BYTES = 1024 * 1024

_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


def is_json_media_type(value: bytes | None) -> bool:
    """Whether a Content-Type header value is ``application/json`` (parameters allowed)."""
    if value is None:
        return False
    return value.split(b";", 1)[0].strip().lower() == b"application/json"


@final
class RequestGuard:
    """Refuses non-JSON bodies (415) and bodies over ``max_body_bytes`` (413)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive (got {max_body_bytes})")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def _too_large(self, send: Send, declared: int | None, path: str) -> None:
        size = f" ({declared} bytes)" if declared is not None else ""
        await send_error(send, 413, f"The request body{size} is larger than this server's limit of "
                                    f"{self.max_body_bytes} bytes.", code="request_too_large",
                         headers=[(b"connection", b"close")], path=path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _BODILESS:
            await self.app(scope, receive, send)
            return
        content_type = _header(scope, b"content-type")
        if not is_json_media_type(content_type):
            shown = "none" if content_type is None else repr(content_type.decode("latin-1")[:100])
            await send_error(send, 415, f"Request bodies must be JSON with 'Content-Type: application/json' "
                                        f"(got {shown}).", code="unsupported_media_type",
                             headers=[(b"connection", b"close")], path=scope["path"])
            return
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0:
                await send_error(send, 400, "Invalid Content-Length header.", code="invalid_request",
                                 path=scope["path"])
                return
            if declared > self.max_body_bytes:
                await self._too_large(send, declared, scope["path"])
                return
            await self.app(scope, receive, send)  # the server enforces the declared length
            return
        # No length (chunked): read it here under the limit, then replay it whole.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body: bytes = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._too_large(send, None, scope["path"])
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
