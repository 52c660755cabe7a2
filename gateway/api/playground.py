"""GET /playground: one static page (inline JS and CSS, no build step, no CDN) on the public API.

The page holds the API key only in memory and calls /v1/models, /v1/chat/completions (streamed)
and /v1/usage like any client; the Content-Security-Policy keeps it from loading or sending
anything anywhere else.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

PAGE = Path(__file__).with_name("static") / "playground.html"
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


@router.get("/playground", include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(page(), headers=HEADERS)
