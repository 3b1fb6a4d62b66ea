"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) work on a machine without internet (tiny saved model, live server):
every script, stylesheet and icon the pages name is served by the server itself (fastapi-offline's files), and in
headless Chromium with every non-loopback request aborted the pages render the API's operations.

The browser test drives Debian's Chromium (``/usr/bin/chromium``) through Playwright, never a browser build of
Playwright's own (``playwright install`` downloads one). Without Chromium it is skipped; with
``REDRAFT_REQUIRE_BROWSER=1`` (.ci/run) that skip is a failure (conftest.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest
from serverkit import live_server, serve_args

CHROMIUM = Path("/usr/bin/chromium")
LOOPBACK = "127.0.0.1"
# A quiet, throwaway browser: no GPU, no QUIC, none of Chromium's own background traffic (updates, sync, field trials)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ("/docs", "/redoc")
CONTENT_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}


@pytest.fixture(scope="module")
def live(model_dir, loaded):
    with live_server(serve_args(model_dir), loaded) as srv:
        yield srv


def page_urls(html: str) -> list[str]:
    """Every URL a documentation page names: ``src``/``href`` attributes, ReDoc's ``spec-url``, Swagger UI's ``url:``
    option, and any absolute http(s) URL anywhere in the text."""
    named = re.findall(r'(?:src|href|spec-url)="([^"]+)"', html) + re.findall(r"\burl: '([^']+)'", html)
    return named + re.findall(r"https?://[^\s\"'<>)]+", html)


@pytest.mark.parametrize("page", PAGES)
def test_docs_pages_name_only_assets_the_server_serves(live, page):
    r = httpx.get(live.base + page, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    urls = page_urls(r.text)
    assert any(u.endswith(".js") for u in urls), urls
    for url in urls:
        full = urljoin(live.base + page, url)
        assert urlsplit(full).netloc == urlsplit(live.base).netloc, f"{page} names {url}, outside the server"
        got = httpx.get(full, timeout=30)
        assert got.status_code == 200, (url, got.status_code)
        want = CONTENT_TYPES[Path(urlsplit(full).path).suffix]
        assert want in got.headers["content-type"], (url, got.headers["content-type"])


def chromium_page(pw, profile: Path):
    """A page of Debian's Chromium with a fresh profile in ``profile``."""
    context = pw.chromium.launch_persistent_context(str(profile), executable_path=str(CHROMIUM), headless=True,
                                                    args=CHROMIUM_FLAGS)
    return context, context.pages[0] if context.pages else context.new_page()


@pytest.mark.browser
def test_docs_render_in_chromium_with_the_network_cut_off(live, tmp_path):
    """Swagger UI lists every operation of /openapi.json and ReDoc renders, with any request to a host other than
    127.0.0.1 aborted; none is even sent (ReDoc's CDN logo is refused by /redoc's own Content-Security-Policy, in the
    browser, before any request), and neither page raises a script error."""
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the test extras)")
    operations = {(method.upper(), path) for path, item in httpx.get(live.base + "/openapi.json").json()["paths"].items()
                  for method in item}
    aborted: list[str] = []  # requests that reached the network and were cut off
    asked: list[str] = []  # every request a page made for another host, then less those its CSP refused unsent
    errors: list[str] = []

    def only_loopback(route):
        if urlsplit(route.request.url).hostname == LOOPBACK:
            route.continue_()
        else:
            aborted.append(route.request.url)
            route.abort()

    def outside(request) -> bool:
        return urlsplit(request.url).hostname != LOOPBACK and not request.url.startswith(("data:", "blob:"))

    with sync_api.sync_playwright() as pw:
        context, page = chromium_page(pw, tmp_path / "profile")
        try:
            context.route("**/*", only_loopback)
            page.on("request", lambda req: asked.append(req.url) if outside(req) else None)
            page.on("requestfailed", lambda req: asked.remove(req.url) if outside(req) and req.failure == "csp"
                    else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))

            def shows(selector: str) -> None:
                try:
                    page.wait_for_selector(selector, timeout=30_000)
                except sync_api.TimeoutError:
                    pytest.fail(f"{page.url} never showed {selector!r} (requests cut off: {aborted}; script errors: "
                                f"{errors})")

            page.goto(live.base + "/docs")
            shows('.opblock-summary-path[data-path="/v1/chat/completions"]')
            shown = page.eval_on_selector_all(".opblock", """blocks => blocks.map(b => [
                b.querySelector('.opblock-summary-method').textContent.trim(),
                b.querySelector('.opblock-summary-path').getAttribute('data-path')])""")
            assert {tuple(op) for op in shown} == operations

            page.goto(live.base + "/redoc")
            shows("text=Chat completion")
            assert page.locator("redoc h1").first.text_content().startswith("redraft")
        finally:
            context.close()
    assert aborted == [] and asked == [], "requests to hosts other than 127.0.0.1"
    assert errors == []
