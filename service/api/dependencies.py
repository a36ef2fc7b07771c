"""What the routes read from the app, in one place: everything lives on `request.app.state` (made by create_app and
its lifespan), never in globals, so several apps can run in one process (the tests do)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request

from service.admission import Admission, KeyedBudget
from service.errors import NotReady
from service.metrics import Metrics
from service.models import ModelRegistry, ServedModel
from service.settings import Settings
from service.tokenizing import TokenizeTurns


@dataclass(frozen=True)
class Runtime:
    """The app's parts that routes use, made once per app (`request.app.state.runtime`)."""

    settings: Settings
    metrics: Metrics
    admission: Admission
    answers: KeyedBudget
    # CPU pools of their own, so that neither waits behind the other nor behind asyncio's default pool
    tokenizer: TokenizeTurns  # Moses, in turns by client address (service/tokenizing.py)
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


def ready(request: Request) -> None:
    """Every model is loaded and warm (and stays so while draining: a request that got in is still served)."""
    if not request.app.state.ready:
        raise NotReady("not ready (starting or stopped)")
