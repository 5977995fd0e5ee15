"""The few steps the async twins do differently from the sync ones, under the sync side's names.

``tools/gen_sync.py`` writes the sync modules from the ``changestream/aio``
sources; what cannot be written by dropping ``await`` lives here, and
:mod:`changestream._sync_io` defines the same names for the sync side.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import pymongo
from pymongo.errors import PyMongoError

from ._stream import AsyncChangeStream

__all__ = ["bounded", "call_handler", "call_store", "stop_setter", "wait_for_stop"]


async def call_store(method: Callable[..., Any], *args: Any) -> Any:
    """Await an async store method; run a sync one in a worker thread (a file store fsyncs)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)


async def call_handler(handler: Callable[[Any], Any], change: Any) -> None:
    """Call a handler that is a function or a coroutine function."""
    result = handler(change)
    if inspect.isawaitable(result):
        await result


async def wait_for_stop(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def stop_setter(stop: asyncio.Event) -> Callable[[], object]:
    """A function that sets ``stop`` from a signal handler (thread-safely, on this loop)."""
    loop = asyncio.get_running_loop()
    return lambda: loop.call_soon_threadsafe(stop.set)


@contextlib.asynccontextmanager
async def bounded(
    stream: AsyncChangeStream[Any], call_timeout: float
) -> AsyncIterator[AsyncChangeStream[Any]]:
    """``async with stream:`` whose close is bounded by ``call_timeout`` and best effort."""
    try:
        yield stream
    finally:
        with pymongo.timeout(call_timeout), contextlib.suppress(PyMongoError):
            await stream.close()  # the server reaps an unkilled cursor itself
