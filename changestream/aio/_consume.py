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
    GAP,
    HANDLE,
    MARK,
    SAVE,
    ConsumeResult,
    Run,
    call_bound,
    log,
    signals_stop,
    stalled,
)
from .._lanes import KeyFunction
from .._metrics import StatsCallback, StatsReporter
from .._policies import (
    DEFAULT_DRAIN_TIMEOUT,
    HistoryGap,
    HistoryLost,
    OnError,
    Setup,
    resnapshotting,
)
from ..stores import AsyncTokenStore, TokenStore
from ._snapshot_watch import stream_opener
from ._stream import AsyncChangeStream
from ._workers import Workers, call_handler

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
    workers: int = 1,
    key: KeyFunction | None = None,
    max_in_flight: int | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    on_error: OnError | None = None,
    on_history_lost: HistoryLost = "raise",
    gap: Callable[[HistoryGap], Any] | None = None,
) -> ConsumeResult:
    """Handle every change at least once, keeping the resume token in ``store``.

    Same contract as :func:`changestream.consume`, with
    ``open_stream(token)`` a coroutine function (e.g.
    ``lambda token: changestream.aio.watch(coll, resume_after=token)``) and
    ``handler`` a function or coroutine function. Returns when ``stop`` is
    set; cancelling the task stores the last handled token and re-raises.
    ``open_stream`` may also be an ``AsyncCollection`` (with ``pipeline``,
    ``watch_options`` and ``initial_snapshot`` as in the sync ``consume``).
    ``call_timeout`` and ``stop_on_signals`` work as there. ``workers=N`` runs up
    to N handler calls as tasks (a coroutine-function handler overlaps them;
    a plain function runs on the loop, one at a time); ``key``,
    ``max_in_flight``, ``drain_timeout``, ``on_error`` (``dead_letter`` may be a
    coroutine function), ``on_history_lost`` and ``gap`` (may be a coroutine
    function) work as in the sync ``consume``.
    """
    source = open_stream
    open_stream = stream_opener(
        source, initial_snapshot=initial_snapshot, pipeline=pipeline,
        watch_options=watch_options,
    )
    setup = Setup(source, open_stream, workers=workers, key=key, max_in_flight=max_in_flight,
                  drain_timeout=drain_timeout, on_error=on_error,
                  on_history_lost=on_history_lost, gap=gap)
    if setup.resnapshot:
        open_stream = resnapshotting(open_stream, stream_opener(
            source, initial_snapshot=True, pipeline=pipeline, watch_options=watch_options))
    run = Run(store, save_every=save_every, save_interval=save_interval, retry_for=retry_for,
              backoff_initial=backoff_initial, backoff_max=backoff_max,
              stats=StatsReporter(on_stats, stats_interval), call_timeout=call_timeout,
              history=setup.history, calls=setup.calls, parallel=setup.lanes is not None)
    run.loaded(await _call(store.load))
    stop = stop if stop is not None else asyncio.Event()
    pool = None if setup.lanes is None else Workers(handler, run.calls, setup.lanes, setup.key)

    async def save() -> None:
        await _call(store.save, run.token)
        run.saved()

    async def session() -> bool:
        """Run one stream; ``True``: it failed transiently after progress, open a new one."""
        if stop.is_set():
            return False
        try:
            with pymongo.timeout(run.call_timeout):
                stream = await open_stream(run.opening())
        except Exception as exc:
            if run.history_lost(exc):
                return True
            raise
        try:
            async with bounded(stream, run.call_timeout):
                step = run.started(stream)
                if step is GAP:
                    await report_gap(setup, run.gap)
                    step = run.gap_reported()
                if step is SAVE:
                    await save()
                while not stop.is_set():
                    with call_bound(stream, run.call_timeout):
                        change = await stream.try_next()
                    token = stream.resume_token
                    step = run.polled(change, token, stream.alive, stalled(stream))
                    if step is HANDLE:
                        try:
                            if pool is None:
                                await call_handler(handler, change, run.calls)
                            else:
                                await pool.submit(change, token)
                        except Exception as exc:
                            run.handler_error = exc
                            raise
                        step = run.handled(token) if pool is None else run.advanced_to(
                            *pool.progress())
                    elif step is MARK and pool is not None:
                        try:
                            await pool.mark(token)
                        except Exception as exc:
                            run.handler_error = exc
                            raise
                        step = run.advanced_to(*pool.progress())
                    if step is SAVE:
                        await save()
        except Exception as exc:
            if pool is not None:  # a reopen starts from the low watermark, nothing running
                settled = await pool.settle(setup.drain_timeout)
                run.advanced_to(*pool.progress())
                if not settled:
                    raise
                await pool.restart()
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
        await _settle_quietly(pool, run, setup.drain_timeout)
        await _flush_quietly(run, save)
        run.finished()
        error = run.final_error(exc)
        if error is exc:
            raise
        raise error from error.__cause__
    except BaseException:
        await _settle_quietly(pool, run, setup.drain_timeout)
        await _flush_quietly(run, save)
        run.finished()
        raise
    await _settle_quietly(pool, run, setup.drain_timeout)
    if run.pending:
        await save()
    return run.result()


async def report_gap(setup: Setup, gap: HistoryGap | None) -> None:
    """Call the ``gap`` function (a coroutine function is awaited)."""
    result = setup.report_gap(gap)
    if inspect.isawaitable(result):
        await result


async def _settle_quietly(pool: Workers | None, run: Run, drain_timeout: float) -> None:
    """Let admitted changes finish (up to ``drain_timeout``) and take their watermark."""
    if pool is None:
        return
    try:
        await pool.settle(drain_timeout)
    except BaseException:  # cancelled again: stop waiting, keep what is done
        log.warning("stopped waiting for the handlers; their changes are delivered again")
    finally:
        run.advanced_to(*pool.progress())
        await pool.close()


async def _flush_quietly(run: Run, save: Callable[[], Awaitable[None]]) -> None:
    """Store the last handled token on the way out; the original error matters more."""
    if run.pending:
        try:
            await save()
        except Exception:
            log.exception("could not store the last handled resume token")
