"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict` (a
broken link, a missing page or anchor, a docstring reference that resolves nowhere fails
it), it is offline (no font, script or style fetched from elsewhere: checked in the
built files, and in headless Chromium, which must make no request off the loopback while
showing its pages), and its references hold what they are built from: every operation
of openapi/openapi.json, the SDK's and the engine's signatures and defaults."""

from __future__ import annotations

import functools
import http.server
import json
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT, run
from tests.ui.browser import CHROMIUM, browser

pytestmark = pytest.mark.deploy

ARTIFACTS = ROOT / "tests" / "ui" / "artifacts"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        timeout=600,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )
    return out


def page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text() if path else (site / "index.html").read_text()


def test_no_resource_is_fetched_from_elsewhere(site: Path) -> None:
    for html in site.rglob("*.html"):
        text = html.read_text()
        for tag in re.findall(r"<(?:script|link|img|iframe|source)\b[^>]*>", text):
            url = re.search(r'(?:src|href)="([^"]+)"', tag)
            if url and tag.startswith("<link") and "stylesheet" not in tag and "icon" not in tag:
                continue  # <link rel="canonical|next|prev">: navigation, not a fetch
            assert not (url and re.match(r"(https?:)?//", url.group(1))), f"{html}: {tag}"
    for css in site.rglob("*.css"):
        text = css.read_text()
        assert not re.search(r"url\(\s*['\"]?(https?:)?//", text), css
        assert "@import" not in text or not re.search(r"@import\s+url\(['\"]?http", text), css
    assert not list(site.rglob("*.woff*")), "no web fonts: the system's own (font: false)"


def test_the_http_reference_holds_every_operation(site: Path) -> None:
    contract = json.loads((ROOT / "openapi" / "openapi.json").read_text())
    text = page(site, "reference/http")
    for path, operations in contract["paths"].items():
        for method, op in operations.items():
            assert f'id="{op["operationId"]}"' in text, f"{method.upper()} {path}"
    for name in contract["components"]["schemas"]:
        assert re.search(rf'id="schema-[^"]*"[^>]*>{re.escape(name)}\b', text), name


def test_the_sdk_reference_shows_signatures_and_defaults(site: Path) -> None:
    text = re.sub(r"<[^>]+>", "", page(site, "reference/sdk"))
    assert re.search(r"influence\(\s*test_inputs.*?damping", text, re.DOTALL)
    assert re.search(r"eigenvalues\(\s*k: int = 1,.*?max_hvps: int \| None = None", text, re.DOTALL)
    assert "ProgressLog" in text and "spectral_density" in text
    # The server's defaults of the options the SDK leaves at None, from the contract.
    assert "influence\nInfluenceRequest\n" in text and "damping=0.001" in text
    assert re.search(r"eigenvalues\nEigenvaluesRequest\n[^\n]*max_hvps=200", text)
    assert re.search(r"trace\nTraceRequest\n[^\n]*max_hvps=256 \(and see its description\)", text)


def test_the_servers_defaults_are_in_the_http_reference(site: Path) -> None:
    """The defaults the SDK leaves to the server (None there): in the schemas' tables."""
    text = re.sub(r"<[^>]+>", "", page(site, "reference/http"))
    contract = json.loads((ROOT / "openapi" / "openapi.json").read_text())
    schemas = contract["components"]["schemas"]
    for schema, field in (("InfluenceRequest", "damping"), ("EigenvaluesRequest", "max_hvps")):
        default = json.dumps(schemas[schema]["properties"][field]["default"])
        section = text[text.index(f"{schema}\n") :]
        row = re.search(rf"\n{field}\n[^\n]*\n[^\n]*\n?{re.escape(default)}", section)
        assert row, (schema, field, default)


def test_the_engine_reference_documents_the_tape(site: Path) -> None:
    text = re.sub(r"<[^>]+>", "", page(site, "reference/engine"))
    assert "GradientTape" in text and "persistent" in text and "batch_jacobian" in text


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)"
)
def test_a_browser_fetches_nothing_off_the_loopback(
    served: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pages = ["", "guides/getting-started/", "guides/pictures/", "reference/http/", "reference/sdk/"]
    with browser(tmp_path_factory.mktemp("site-profile"), height=1100) as b:
        b.send("Network.enable")
        for path in pages:
            b.goto(f"{served}/{path}")
            b.wait_for("document.readyState === 'complete'")
        # The search index loads in a worker on first use: search, and wait for results.
        b.evaluate(
            "document.querySelector('.md-search__input').focus();"
            "document.querySelector('.md-search__input').value = 'eigenvalues';"
            "document.querySelector('.md-search__input')"
            ".dispatchEvent(new Event('input', {bubbles: true})); true"
        )
        b.wait_for("document.querySelectorAll('.md-search-result__item').length > 0")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        b.screenshot(ARTIFACTS / "site-search.png", full_page=False)
        requested = {
            e["params"]["request"]["url"]
            for e in b.events
            if e.get("method") == "Network.requestWillBeSent"
        }
        assert requested, "the browser was not watched"
        elsewhere = sorted(u for u in requested if not u.startswith((served, "data:", "blob:")))
        assert elsewhere == [], elsewhere
        assert b.problems() == []
