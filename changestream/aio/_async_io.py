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
import tenacity
from pymongo.errors import PyMongoError

from .._consumer.handler_errors import HandlerCalls
from .._consumer.history import HistoryGap
from .._consumer.options import ConsumeOptions
from ._stream import AsyncChangeStream

__all__ = ["bounded", "call_handler", "call_store", "report_gap", "stop_setter", "wait_for_stop"]


async def call_store(method: Callable[..., Any], *args: Any) -> Any:
    """Await an async store method; run a sync one in a worker thread (a file store fsyncs)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)


async def call_handler(handler: Callable[[Any], Any], change: Any, calls: HandlerCalls) -> None:
    """Call a handler that is a function or a coroutine function, under the ``on_error``
    policy (retried with backoff, then raised or dead-lettered; ``dead_letter`` may be a
    coroutine function too)."""
    if not calls.retrying:
        result = handler(change)
        if inspect.isawaitable(result):
            await result
        return
    try:
        await tenacity.AsyncRetrying(sleep=_sleeper(calls), **calls.arguments())(
            _once, handler, change)
    except Exception as exc:
        dead_letter = calls.gave_up(change, exc)
        if dead_letter is None:
            raise
        await _once(dead_letter, change, exc)


def _sleeper(calls: HandlerCalls) -> Callable[[float], Any]:
    """The backoff between handler calls: woken by the run's stop event."""
    stop = calls.stop
    if stop is None:
        return asyncio.sleep
    return lambda seconds: wait_for_stop(stop, seconds)


async def _once(function: Callable[..., Any], *args: Any) -> None:
    result = function(*args)
    if inspect.isawaitable(result):
        await result


async def report_gap(options: ConsumeOptions, gap: HistoryGap | None) -> None:
    """Call the ``gap`` function (a coroutine function is awaited)."""
    result = options.report_gap(gap)
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
