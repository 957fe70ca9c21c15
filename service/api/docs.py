"""Documentation pages that work with no internet: Swagger UI 5 (OpenAPI 3.1 needs
version 5) and ReDoc, from the files the `fastapi-offline` package ships (Swagger UI
5.x and ReDoc standalone), served under /static/docs; and the problem type pages."""

from __future__ import annotations

import importlib.resources

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from service.api.problems import PROBLEM_TYPES, ProblemError, type_uri

ASSETS = "/static/docs"


def install(app: FastAPI) -> None:
    static = importlib.resources.files("fastapi_offline") / "static"
    app.mount(ASSETS, StaticFiles(directory=str(static)), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/", include_in_schema=False)
    async def front(request: Request) -> Response:
        """A browser is led to the docs; a program gets where things are."""
        if "text/html" in request.headers.get("accept", ""):
            return RedirectResponse("/docs", status_code=307)
        return JSONResponse(
            {
                "service": app.title,
                "docs": "/docs",
                "redoc": "/redoc",
                "openapi": openapi_url,
                "health": "/healthz",
                "ops": "/v1/ops",
            }
        )

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None, "defaultModelsExpandDepth": 0},
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS}/favicon.png",
            with_google_fonts=False,
        )

    @app.get("/problems/{slug}", include_in_schema=False)
    async def problem_type(slug: str) -> Response:
        known = PROBLEM_TYPES.get(slug)
        if known is None:
            raise ProblemError("not-found", f"no problem type {slug!r}")
        return Response(
            f"{type_uri(slug)}: {known.title} ({known.status})\n\n{known.description}\n",
            media_type="text/plain",
        )
