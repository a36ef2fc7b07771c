"""Work for a request stops when its client goes away: one place that watches for that, instead of every route.

`until_disconnected` awaits a request's work (its sentences in the model's queue, say) while checking every
DISCONNECT_POLL_S whether the client is still there; if it has gone, the work is cancelled (queued sentences
leave the queue, those in flight leave before the next window) and the request ends with ClientGone (499).
`off_loop` runs CPU work (Moses, composing and encoding a large answer) on a thread of a pool the same way: the
work gets a stop event that is set when the client goes, and ends at its next check by raising Abandoned."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import Request

from service.errors import ClientGone

DISCONNECT_POLL_S = 0.05
T = TypeVar("T")


class Abandoned(Exception):
    """The client has gone: the work for its answer stopped where it was."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client goes away first, `work` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


async def off_loop(request: Request, pool: ThreadPoolExecutor, work: Callable[[threading.Event], T]) -> T:
    """`work(stop)` on a thread of `pool`, while the event loop serves others. If the client goes away meanwhile,
    or the request is cancelled, `stop` is set, so that the work ends at its next check (Abandoned), and the
    request ends 499; work still waiting for a thread never starts."""
    stop = threading.Event()
    future = asyncio.get_running_loop().run_in_executor(pool, work, stop)
    try:
        return await until_disconnected(request, future)
    finally:
        if not future.done():
            stop.set()
