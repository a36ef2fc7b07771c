"""Work for a request stops when its client goes away: one place that watches for that, instead of every route.

`until_disconnected` awaits a request's work (its sentences in the model's queue, say) beside the request's own
`receive()`, which the server ends with `http.disconnect` when the connection is lost; if that comes first, the
work is cancelled (queued sentences leave the queue, those in flight leave before the next window) and the request
ends with ClientGone (499). No polling: a request costs the event loop nothing while it waits, however long (a poll
every 50 ms cost the loop more the longer requests waited, and with it 256 connections' throughput).
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

T = TypeVar("T")


class Abandoned(Exception):
    """The client has gone: the work for its answer stopped where it was."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client goes away first, `work` is cancelled and ClientGone raised. The body has been
    read: what `receive()` says next is that the client has gone (or that the answer is complete, which cannot
    come before this returns)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for waiting in (task, gone):
            if not waiting.done():
                waiting.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
