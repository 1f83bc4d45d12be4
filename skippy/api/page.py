"""The page at ``GET /``: the chain live, recent throughput and TTFT, and a chat (static files).

Strategy: the page is three files shipped in the package (``skippy/api/static/``: HTML, one
script, one stylesheet, and an icon), read once when the app is made and served from memory under
a fixed table of paths (no file system lookup per request, so no path to traverse).  There is no
build step, no CDN and no inline script or style: every answer of the page carries a strict
Content-Security-Policy (scripts, styles, images and fetches from this origin only; no framing, no
form posts), so a reply that smuggled markup into the page could not run anything.  The script
draws with the DOM's text nodes only, never ``innerHTML``.

The files hold nothing of the chain and are served without a key; everything the page shows comes
from ``GET /chain`` (below) and ``POST /v1/chat/completions``, which need the API key when one is
configured: the page asks for it on the first 401, keeps it for the browser tab
(``sessionStorage``) and sends it as ``Authorization: Bearer``.  CORS, when configured, applies to
``/chain`` as to every API path.

``GET /chain`` is one JSON snapshot, polled by the page every 0.7 s: the model, the chain's
health and each stage's state (:class:`skippy.api.chain_view.ChainView`), the API's own figures
(requests in flight and waiting, lanes, speculation and prefix-cache totals, from its Prometheus
registry) and the recent history (:class:`skippy.api.chain_view.History`).
"""

from __future__ import annotations

import importlib.resources
import time
from typing import TYPE_CHECKING, Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from skippy.api.chain_view import ChainView

if TYPE_CHECKING:
    from skippy.api.app import ChainService

__all__ = ["ASSET_PATHS", "CONTENT_SECURITY_POLICY", "page_routes"]

#: Path -> (file in skippy/api/static, content type).
_ASSETS: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
#: The page's paths: served without a key (they hold nothing of the chain).
ASSET_PATHS: Final = frozenset(_ASSETS)

CONTENT_SECURITY_POLICY: Final = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                  "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_PAGE_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

#: Samples of the API's own registry the snapshot reports (snapshot name -> sample name).
_API_FIGURES: Final = {
    "requests_in_flight": "skippy_requests_in_flight",
    "queue_waiting": "skippy_queue_waiting",
    "lanes_open": "skippy_lanes_open",
    "speculation_proposed": "skippy_speculation_proposed_tokens_total",
    "speculation_accepted": "skippy_speculation_accepted_tokens_total",
    "prefix_cache_lookups": "skippy_prefix_cache_lookups_total",
    "prefix_cache_hits": "skippy_prefix_cache_hits_total",
    "prefix_cache_cached_tokens": "skippy_prefix_cache_cached_tokens_total",
}


def _load_assets() -> dict[str, tuple[bytes, str]]:
    static = importlib.resources.files("skippy.api") / "static"
    return {path: (static.joinpath(name).read_bytes(), media_type) for path, (name, media_type) in _ASSETS.items()}


def page_routes(service: "ChainService") -> list[Route]:
    """The page's routes and ``GET /chain`` for ``service``.

    Raises:
        FileNotFoundError: a page file is missing from the installed package.
    """
    assets = _load_assets()
    view = ChainView(service.pool)

    async def asset(request: Request) -> Response:
        body, media_type = assets[request.url.path]
        service.metrics.request_done("page", 200)
        return Response(body, media_type=media_type, headers=_PAGE_HEADERS)

    async def chain(request: Request) -> Response:
        registry = service.metrics.registry
        api: dict[str, Any] = {name: registry.get_sample_value(sample) for name, sample in _API_FIGURES.items()}
        api["max_lanes"] = service.pool.max_lanes
        snapshot = await view.snapshot()
        shares = service.history.stage_shares()
        stages = [{**stage, "time_per_token": shares.get(stage["index"])} for stage in snapshot["stages"]]
        service.metrics.request_done("chain", 200)
        return JSONResponse({"model": service.model_id, "time": time.time(), **snapshot, "stages": stages,
                             "api": api, "history": service.history.as_dict()},
                            headers={"Cache-Control": "no-store"})

    return [Route(path, asset, methods=["GET"]) for path in _ASSETS] + [Route("/chain", chain, methods=["GET"])]
