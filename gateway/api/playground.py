"""GET /playground: one static page (inline JS and CSS, no build step, no CDN) on the public API;
GET / leads a browser there.

The page holds the API key only in memory and calls /v1/models, /v1/chat/completions (streamed)
and /v1/usage like any client; the Content-Security-Policy keeps it from loading or sending
anything anywhere else.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

router = APIRouter()

PAGE = Path(__file__).with_name("static") / "playground.html"
PLAYGROUND = "/playground"
HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


@cache
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get(PLAYGROUND, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(page(), headers=HEADERS)


@router.get("/", include_in_schema=False)
async def front_door(request: Request) -> Response:
    """A browser opening the gateway's address is sent on to the playground; any other client (one
    that does not ask for HTML) gets a small JSON answer saying where things are, never a page."""
    vary = {"vary": "accept"}  # one URL, two answers: caches must keep them apart
    if "text/html" in request.headers.get("accept", ""):
        return RedirectResponse(PLAYGROUND, status_code=307, headers=vary)  # temporary: browsers do not cache it
    return JSONResponse({"object": "gateway", "api": "/v1", "playground": PLAYGROUND}, headers=vary)
