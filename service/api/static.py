"""The answers that never change: the OpenAPI document, and the files /docs and /redoc load (Swagger UI's and
ReDoc's, under /static-offline-docs). Each is made once, held once, and sent from there in parts of PART_BYTES,
each part written only once the reader has taken what came before (the server waits for its writes to drain), so a
reader that never reads costs its connection and a task, not a copy of the answer: no file opened, read and
buffered per request, no JSON encoded again per request.

Starlette's StaticFiles opened the file and read it in 64 KB chunks on a worker thread for each request; 4,000
connections that asked for the 1.5 MB Swagger UI bundle and never read took a server from 160 to 1,064 MB (about
226 KB each), and 16 pipelined /openapi.json per connection, each encoded anew, held the event loop for seconds.
Range requests are not served (the whole answer comes, 200), as RFC 9110 allows."""

from __future__ import annotations

import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

import orjson
from fastapi import FastAPI
from starlette.routing import Mount

from service.api.paths import app_path

PART_BYTES = 16 << 10
STATIC_URL = "/static-offline-docs"  # where FastAPIOffline mounts the files of /docs and /redoc


@dataclass(frozen=True)
class Answer:
    body: bytes
    media_type: str
    etag: bytes

    @classmethod
    def of(cls, body: bytes, media_type: str) -> Answer:
        return cls(body, media_type, b'"%s"' % hashlib.sha256(body).hexdigest()[:32].encode())


@dataclass(frozen=True)
class _Route:
    path: str  # the route's template, for the request metrics (service/api/middleware.py: RequestMetrics)


class StaticAnswers:
    """ASGI middleware: GET and HEAD of the OpenAPI document and of the docs' files, answered from memory (see the
    module's docstring); every other request passes on. Inside the API keys' middleware: with keys configured,
    these need one too."""

    def __init__(self, app, fastapi: FastAPI):
        self.app, self.fastapi = app, fastapi
        self.files = _files(fastapi)
        self.openapi: dict[str, Answer] = {}  # by root path: made at the first request (the routes are all in)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        path, root = app_path(scope), scope.get("root_path", "")
        if path == self.fastapi.openapi_url:
            answer, route = self._openapi(root), path
        elif path.startswith(STATIC_URL + "/") and path[len(STATIC_URL) + 1 :] in self.files:
            answer, route = self.files[path[len(STATIC_URL) + 1 :]], STATIC_URL
        else:
            return await self.app(scope, receive, send)
        scope["route"] = _Route(route)
        await _send(answer, scope, send)

    def _openapi(self, root: str) -> Answer:
        root = root.rstrip("/")
        if root not in self.openapi:
            # as FastAPI's own route writes it: its servers name the root path
            document = self.fastapi.openapi()
            servers = document.get("servers", [])
            if root and self.fastapi.root_path_in_servers and root not in {s.get("url") for s in servers}:
                document = {**document, "servers": [{"url": root}, *servers]}
            self.openapi[root] = Answer.of(orjson.dumps(document), "application/json")
        return self.openapi[root]


def _files(app: FastAPI) -> dict[str, Answer]:
    """The docs' files, read once: those of the folder FastAPIOffline mounts at STATIC_URL."""
    mount = next((r for r in app.routes if isinstance(r, Mount) and r.path == STATIC_URL), None)
    directory = getattr(getattr(mount, "app", None), "directory", None)
    if directory is None:
        return {}
    files = {}
    for file in sorted(Path(directory).iterdir()):
        if file.is_file():
            media = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
            if media.startswith("text/") or media == "application/javascript":
                media += "; charset=utf-8"
            files[file.name] = Answer.of(file.read_bytes(), media)
    return files


async def _send(answer: Answer, scope, send) -> None:
    headers = [(b"content-type", answer.media_type.encode()), (b"etag", answer.etag)]
    matches = [value for name, value in scope["headers"] if name == b"if-none-match"]
    tags = b",".join(matches).replace(b" ", b"").replace(b"\t", b"").split(b",") if matches else []
    # If-None-Match compares weakly (RFC 9110, 13.1.2): W/"x" matches "x"; and "*" matches any answer there is.
    if any(tag == b"*" or tag.removeprefix(b"W/") == answer.etag for tag in tags):
        await send({"type": "http.response.start", "status": 304, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
        return
    headers.append((b"content-length", b"%d" % len(answer.body)))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if scope["method"] == "HEAD" or not answer.body:
        await send({"type": "http.response.body", "body": b""})
        return
    whole = memoryview(answer.body)  # parts of the one copy: uvicorn writes them as they are
    for start in range(0, len(whole), PART_BYTES):
        end = start + PART_BYTES
        await send({"type": "http.response.body", "body": whole[start:end], "more_body": end < len(whole)})
