"""The few steps the async twins do differently from the sync ones, under one name on both sides.

``tools/gen_sync.py`` writes the sync modules under ``changestream/_sync`` from
the ``changestream/aio`` sources; what cannot be written by dropping ``await``
lives here, and :mod:`changestream._sync._sync_io` defines the same names for
the sync side.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pymongo
import tenacity
from pymongo.errors import PyMongoError

from .._consumer.handler_errors import HandlerCalls
from .._consumer.history import HistoryGap
from .._consumer.options import ConsumeOptions
from ._stream import AsyncChangeStream

__all__ = [
    "ABANDONED",
    "bounded",
    "call_handler",
    "call_store",
    "next_or_stop",
    "report_gap",
    "stop_closes",
    "stop_setter",
    "wait_for_stop",
]

ABANDONED: Any = object()
"""What :func:`next_or_stop` returns when ``stop`` came while a getMore waited."""


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
    refused = calls.error_event(change)
    if refused is not None:  # an error event: to the dead letter, never to the handler
        await _once(refused[0], change, refused[1])
        calls.dead_lettered()
        return
    try:
        await tenacity.AsyncRetrying(sleep=_sleeper(calls), **calls.arguments())(
            _once, handler, change)
    except Exception as exc:
        dead_letter = calls.gave_up(change, exc)
        if dead_letter is None:
            raise
        await _once(dead_letter, change, exc)
        calls.dead_lettered()


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


async def next_or_stop(stream: AsyncChangeStream[Any], stop: asyncio.Event) -> Any:
    """``stream.try_next()``, abandoned if ``stop`` is set while its getMore waits.

    A stop must not wait for the server's await (``max_await_time_ms``, 1 s by default)
    once the last change is handled. Cancelling the call is what the stream allows: it
    closes and kills its cursor in the background. Nothing is lost: whatever that getMore
    would have brought is after every handled change, so after the stored token.
    Returns :data:`ABANDONED` then, and at once when ``stop`` is already set. (The loop
    polls a stream's buffer itself: this runs only when a getMore may be needed.)
    """
    if stop.is_set():
        return ABANDONED
    fetch = asyncio.ensure_future(stream.try_next())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((fetch, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not fetch.done():
            fetch.cancel()
            await asyncio.wait((fetch,))  # the stream's own clean-up runs before we go on
    if fetch.cancelled():
        return ABANDONED
    return fetch.result()


class CurrentStream:
    """The stream a run polls now (the sync twin closes it on ``stop``; see
    :func:`stop_closes`)."""

    def __init__(self) -> None:
        self.stream: AsyncChangeStream[Any] | None = None


@contextlib.contextmanager
def stop_closes(stop: asyncio.Event, call_timeout: float) -> Iterator[CurrentStream]:
    """Nothing to watch here: :func:`next_or_stop` races each waiting poll against ``stop``.
    (The sync twin's ``stop`` is a ``threading.Event``: a thread watches it and interrupts
    the current stream, bounded by ``call_timeout``.)"""
    yield CurrentStream()


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
