"""API keys and tenants: who is calling, and which prefix-cache namespace is theirs.

Strategy: each configured key is one tenant.  Keys are never kept or compared as text: a key's
SHA-256 digest is the dictionary key, so a lookup costs the same whatever the presented value
shares with a real key, and the tenant's id is a short prefix of that digest (safe to log).
:class:`AuthMiddleware` is a plain ASGI middleware (it never reads the body, so it adds nothing
to streaming): with keys configured, every HTTP request but ``GET /health`` must carry
``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) and is otherwise answered
401 with the API's error body (OpenAI's; Anthropic's on the Messages API) and a
``WWW-Authenticate: Bearer`` header; the authenticated :class:`Tenant` goes into
``scope["skippy.tenant"]``.  ``/health`` (and any other path the app names public: the page's
static files, :mod:`skippy.api.page`) is served to anyone, as the anonymous tenant unless a valid
key came with it (``/health`` then says less).  Without keys every caller is the one anonymous tenant.

Prefix-cache namespaces (:meth:`Tenant.cache_namespace`) are derived, never taken from the
client: SHA-256 over the server's salt, the tenant id and the request's own ``prompt_cache_key``
(else ``user``), which only subdivides the tenant's namespace.  Two tenants never share a
namespace whatever they claim, so ``cached_tokens`` and prefill timing only ever reflect the
caller's own earlier prompts; the stages see an opaque hex name, not the key or the user name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, final

from skippy.api.errors import error_shape

#: The ASGI scope key holding the request's :class:`Tenant`.
TENANT_SCOPE_KEY = "skippy.tenant"

#: Paths served without a key (load balancers probe them); the app adds its page's files.
PUBLIC_PATHS = frozenset({"/health"})

#: Environment variables read when the flags are not given.
API_KEY_ENV = "SKIPPY_API_KEY"
CACHE_SALT_ENV = "SKIPPY_CACHE_SALT"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@final
@dataclasses.dataclass(frozen=True, slots=True)
class Tenant:
    """One caller identity: ``id`` is ``anonymous`` or ``key-<12 hex digits of the key's SHA-256>``."""

    id: str
    salt: bytes = b""

    def cache_namespace(self, claimed: str | None = None) -> str:
        """The prefix-cache namespace of this tenant, subdivided by the request's ``claimed`` key."""
        digest = hashlib.sha256()
        for part in (self.salt, self.id.encode()):
            digest.update(len(part).to_bytes(4, "big") + part)
        if claimed is not None:  # None and "" stay distinct
            raw = claimed.encode("utf-8", "surrogatepass")
            digest.update(b"\1" + len(raw).to_bytes(4, "big") + raw)
        return "t-" + digest.hexdigest()[:32]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@final
class ApiKeys:
    """The accepted keys (each its own tenant) and the cache salt.

    Args:
        keys: the accepted keys; empty means no authentication (one anonymous tenant).
        salt: mixed into every cache namespace (keep it secret to make namespaces unguessable
            from a key alone; changing it starts every tenant with an empty cache).

    Raises:
        ValueError: a key is empty or contains whitespace.
    """

    def __init__(self, keys: Iterable[str] = (), *, salt: str = "") -> None:
        self.salt = salt.encode()
        self._tenants: dict[bytes, Tenant] = {}
        for key in keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty and contain no whitespace")
            digest = _digest(key)
            self._tenants[digest] = Tenant("key-" + digest.hex()[:12], self.salt)
        self.anonymous = Tenant("anonymous", self.salt)

    @property
    def required(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    def tenant(self, key: str) -> Tenant | None:
        """The tenant of ``key`` (None: not a configured key)."""
        return self._tenants.get(_digest(key))

    @classmethod
    def from_option(cls, value: str | None, *, salt: str | None = None,
                    environ: Mapping[str, str] = os.environ) -> "ApiKeys":
        """Keys from ``--api-key``: a file of keys (one a line; ``#`` comments and blank lines
        skipped) when ``value`` names an existing file, else ``value`` itself as the one key.
        Without the option, ``$SKIPPY_API_KEY`` (a key or a file, the same way); without either,
        no authentication.  ``salt`` defaults to ``$SKIPPY_CACHE_SALT`` (else none).

        Raises:
            ValueError: the file holds no key, cannot be read, or a key is malformed; ``value``
                looks like a path (has ``/``, starts with ``~`` or ``.``) but names no file.
        """
        value = value if value is not None else environ.get(API_KEY_ENV) or None
        salt = salt if salt is not None else environ.get(CACHE_SALT_ENV, "")
        if value is None:
            return cls((), salt=salt)
        path = Path(value)
        if path.is_file():
            try:
                lines = path.read_text().splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read API keys from {path}: {exc}") from exc
            keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not keys:
                raise ValueError(f"{path} holds no API key (one key a line)")
            return cls(keys, salt=salt)
        if "/" in value or value.startswith(("~", ".")):  # meant as a file: never serve a path as a key
            raise ValueError(f"API key file {value} does not exist (a key with '/' in it goes in a file)")
        return cls([value], salt=salt)


def error_body(message: str, *, type: str = "invalid_request_error", code: str | None = None, path: str = "",
               status: int = 400) -> bytes:
    """The error body as bytes (for middleware that answers without the app): OpenAI's, or
    Anthropic's on the Messages API (``path``)."""
    return json.dumps(error_shape(path, status, message, type, None, code)).encode()


async def send_error(send: Send, status: int, message: str, *, code: str | None,
                     type: str = "invalid_request_error", headers: Iterable[tuple[bytes, bytes]] = (),
                     path: str = "") -> None:
    """Answer an HTTP request with the error body of ``path``'s API (the request body is left unread)."""
    body = error_body(message, type=type, code=code, path=path, status=status)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


@final
class AuthMiddleware:
    """Checks ``Authorization: Bearer`` against ``keys`` and stores the tenant in the scope;
    ``public_paths`` are served without a key (as the anonymous tenant)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, *, public_paths: frozenset[str] = PUBLIC_PATHS,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.keys = keys
        self.public_paths = public_paths
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.keys.required:
            scope[TENANT_SCOPE_KEY] = self.keys.anonymous
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        anthropic = next((value for name, value in scope["headers"] if name == b"x-api-key"), None)
        if header is None and anthropic is not None:  # Anthropic's clients send the key this way
            header = b"Bearer " + anthropic
        tenant: Tenant | None = None
        if header is None:
            message, code = ("You didn't provide an API key. You need to provide your API key in an Authorization "
                             "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", None)
        else:
            scheme, _, token = header.decode("latin-1").partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                message, code = ("The Authorization header must be 'Bearer YOUR_KEY'.", "invalid_api_key")
            else:
                tenant = self.keys.tenant(token)
                message, code = ("Incorrect API key provided.", "invalid_api_key")
        if tenant is None and scope["path"] in self.public_paths:  # served, as nobody in particular
            scope[TENANT_SCOPE_KEY] = self.keys.anonymous
            await self.app(scope, receive, send)
            return
        if tenant is None:
            if self.on_refused is not None:
                self.on_refused(scope["path"])
            await send_error(send, 401, message, code=code, headers=[(b"www-authenticate", b"Bearer")],
                             path=scope["path"])
            return
        scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)


def is_authenticated(scope: Mapping[str, Any]) -> bool:
    """Whether the request presented a configured key."""
    tenant = scope.get(TENANT_SCOPE_KEY)
    return isinstance(tenant, Tenant) and tenant.id != "anonymous"


def scope_tenant(scope: Mapping[str, Any], keys: ApiKeys | None = None) -> Tenant:
    """The request's tenant (the anonymous one when no middleware set it: an app used bare in tests)."""
    tenant = scope.get(TENANT_SCOPE_KEY)
    if isinstance(tenant, Tenant):
        return tenant
    return keys.anonymous if keys is not None else Tenant("anonymous")
