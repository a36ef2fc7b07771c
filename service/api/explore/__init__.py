"""The /explore page: a few static files (this folder's HTML, JavaScript modules and CSS, package data) that show
how a word's vectors move between its contexts, layers and mixes (docs/explore.md). Everything after the one
POST /embed is computed in the browser, so the server only hands out these files.

They are read once and sent from memory, as the OpenAPI document and the docs' files are (service/api/static.py),
with `Content-Security-Policy: default-src 'self'`: the page may load and call nothing but this server. The page and
its files need no API key (the middleware sits outside the keys' one): the key a person types is sent with the
page's own calls to the API, which ask for it as they always do."""

from __future__ import annotations

from importlib import resources

from service.api.paths import app_path
from service.api.static import Answer, _Route, _send

PAGE = "/explore"
MEDIA = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# No inline script or style, nothing from elsewhere; no framing by other sites (clickjacking of the key field).
POLICY = b"default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
EXTRA = [(b"content-security-policy", POLICY), (b"x-content-type-options", b"nosniff"), (b"cache-control", b"no-cache")]


def page_files() -> dict[str, Answer]:
    """The page's files by their path under the root: /explore for the HTML, /explore/<name> for the rest."""
    files = {}
    for file in sorted(resources.files(__package__).iterdir(), key=lambda f: f.name):
        suffix = "." + file.name.rpartition(".")[2]
        if file.is_file() and suffix in MEDIA:
            path = PAGE if file.name == "index.html" else f"{PAGE}/{file.name}"
            files[path] = Answer.of(file.read_bytes(), f"{MEDIA[suffix]}; charset=utf-8")
    return files


class ExplorePage:
    """ASGI middleware: GET and HEAD of the page's files, answered from memory; every other request passes on."""

    def __init__(self, app):
        self.app = app
        self.files = page_files()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        answer = self.files.get(app_path(scope))
        if answer is None:
            return await self.app(scope, receive, send)
        scope["route"] = _Route(PAGE)  # one route in the request metrics for the page and its files

        async def with_policy(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], *EXTRA]}
            await send(message)

        await _send(answer, scope, with_policy)
