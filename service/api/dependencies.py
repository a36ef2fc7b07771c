"""What the routes read from the app, in one place: everything lives on `request.app.state` (made by create_app and
its lifespan), never in globals, so several apps can run in one process (the tests do)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request

from service.admission import KeyedBudget
from service.embedder import Embedder
from service.errors import NotReady
from service.metrics import Metrics
from service.models import ModelRegistry, ServedModel
from service.settings import Settings


@dataclass(frozen=True)
class Runtime:
    """The app's parts that routes use, made once per app (`request.app.state.runtime`)."""

    settings: Settings
    metrics: Metrics
    embedder: Embedder  # the pipeline every embedding route runs (service/embedder.py), Moses's threads its own
    answers: KeyedBudget
    # a CPU pool of its own, so that it waits neither behind Moses nor behind asyncio's default pool
    encode_pool: ThreadPoolExecutor
    parse_pool: ThreadPoolExecutor  # large bodies read and validated (service/api/bodies.py)


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def registry(request: Request) -> ModelRegistry:
    """The models served; NotReady before the lifespan has loaded them (uvicorn serves nothing before it starts)."""
    models = request.app.state.models
    if models is None:
        raise NotReady("not ready (starting or stopped)")
    return models


def model_named(request: Request, name: str | None) -> ServedModel:
    """The model a request names (None: the default), or UnknownModel naming those served."""
    return registry(request).get(name)
