"""asyncio twin of :func:`changestream.consume`: the same policy, awaited.

Every decision (save schedule, dead ends, reopening, retry settings) is
:class:`changestream._consume.Run`'s; only the I/O between them is written
again here, with ``await``.
Stores may be :class:`~changestream.stores.AsyncTokenStore` (awaited) or
plain :class:`~changestream.stores.TokenStore` (run in a worker thread, since
a file store fsyncs).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import pymongo
import tenacity
from pymongo.errors import PyMongoError

from .._consume import (
    DEFAULT_CALL_TIMEOUT,
    HANDLE,
    SAVE,
    ConsumeResult,
    Run,
    call_bound,
    log,
    signals_stop,
    stalled,
)
from .._metrics import StatsCallback, StatsReporter
from ..stores import AsyncTokenStore, TokenStore
from ._snapshot_watch import stream_opener
from ._stream import AsyncChangeStream

__all__ = ["consume"]


async def _call(method: Callable[..., Any], *args: Any) -> Any:
    """Await an async store method; run a sync one in a thread."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)


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


async def consume(
    open_stream: Callable[[Any], Awaitable[AsyncChangeStream[Any]]] | Any,
    handler: Callable[[Any], Any],
    store: TokenStore | AsyncTokenStore,
    *,
    initial_snapshot: bool = False,
    pipeline: list[Mapping[str, Any]] | None = None,
    watch_options: Mapping[str, Any] | None = None,
    save_every: int = 1,
    save_interval: float | None = None,
    retry_for: float | None = 300.0,
    backoff_initial: float = 0.5,
    backoff_max: float = 30.0,
    stop: asyncio.Event | None = None,
    on_stats: StatsCallback | None = None,
    stats_interval: float = 10.0,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    stop_on_signals: bool = False,
) -> ConsumeResult:
    """Handle every change at least once, keeping the resume token in ``store``.

    Same contract as :func:`changestream.consume`, with
    ``open_stream(token)`` a coroutine function (e.g.
    ``lambda token: changestream.aio.watch(coll, resume_after=token)``) and
    ``handler`` a function or coroutine function. Returns when ``stop`` is
    set; cancelling the task stores the last handled token and re-raises.
    ``open_stream`` may also be an ``AsyncCollection`` (with ``pipeline``,
    ``watch_options`` and ``initial_snapshot`` as in the sync ``consume``).
    ``call_timeout`` and ``stop_on_signals`` work as there.
    """
    open_stream = stream_opener(
        open_stream, initial_snapshot=initial_snapshot, pipeline=pipeline,
        watch_options=watch_options,
    )
    run = Run(store, save_every=save_every, save_interval=save_interval, retry_for=retry_for,
              backoff_initial=backoff_initial, backoff_max=backoff_max,
              stats=StatsReporter(on_stats, stats_interval), call_timeout=call_timeout)
    run.loaded(await _call(store.load))
    stop = stop if stop is not None else asyncio.Event()

    async def save() -> None:
        await _call(store.save, run.token)
        run.saved()

    async def session() -> bool:
        """Run one stream; ``True``: it failed transiently after progress, open a new one."""
        if stop.is_set():
            return False
        with pymongo.timeout(run.call_timeout):
            stream = await open_stream(run.opening())
        try:
            async with bounded(stream, run.call_timeout):
                if run.started(stream) is SAVE:
                    await save()
                while not stop.is_set():
                    with call_bound(stream, run.call_timeout):
                        change = await stream.try_next()
                    token = stream.resume_token
                    step = run.polled(change, token, stream.alive, stalled(stream))
                    if step is HANDLE:
                        try:
                            result = handler(change)
                            if inspect.isawaitable(result):
                                await result
                        except Exception as exc:
                            run.handler_error = exc
                            raise
                        step = run.handled(token)
                    if step is SAVE:
                        await save()
        except Exception as exc:
            if run.reopen_after(exc):
                return True
            raise
        return False

    async def sleep(seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)

    loop = asyncio.get_running_loop()
    try:
        with signals_stop(stop_on_signals, lambda: loop.call_soon_threadsafe(stop.set)):
            while await tenacity.AsyncRetrying(sleep=sleep, **run.retrying())(session):
                pass
    except Exception as exc:
        await _flush_quietly(run, save)
        run.finished()
        error = run.final_error(exc)
        if error is exc:
            raise
        raise error from error.__cause__
    except BaseException:
        await _flush_quietly(run, save)
        run.finished()
        raise
    if run.pending:
        await save()
    return run.result()


async def _flush_quietly(run: Run, save: Callable[[], Awaitable[None]]) -> None:
    """Store the last handled token on the way out; the original error matters more."""
    if run.pending:
        try:
            await save()
        except Exception:
            log.exception("could not store the last handled resume token")
