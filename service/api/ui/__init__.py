"""The page at /ui: the workers, the caller's tapes, models, datasets and jobs, a running
job's progress live, a finished job's result drawn. Static files shipped in the package
(static/: the page, its script and style, and uPlot vendored under static/vendor, see
VENDOR.md there); nothing is fetched from elsewhere at view time.

The page calls the public API with the key typed into it, in the Authorization header
as every client does (fetch(), never a URL: the key must not reach an access log), and
reads a job's event stream with fetch() too, since EventSource cannot send headers. Its
Content-Security-Policy allows scripts, styles and connections to this origin only, so
nothing but the shipped files runs in it and the key can go nowhere else.
"""

from __future__ import annotations

import importlib.resources

from fastapi import FastAPI
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

PAGE = "/ui"
ASSETS = "/ui/assets"
STATIC = importlib.resources.files(__name__) / "static"

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The page holds an API key while open: never serve it from a cache.
    "Cache-Control": "no-store",
}


def install(app: FastAPI) -> None:
    app.mount(ASSETS, StaticFiles(directory=str(STATIC)), name="ui-assets")

    @app.get(PAGE, include_in_schema=False)
    async def page() -> Response:
        return FileResponse(
            str(STATIC / "index.html"), media_type="text/html", headers=SECURITY_HEADERS
        )

    @app.get(PAGE + "/", include_in_schema=False)
    async def page_slash() -> Response:
        return RedirectResponse(PAGE, status_code=308)
