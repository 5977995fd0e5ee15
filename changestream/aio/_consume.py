"""asyncio twin of :func:`changestream.consume`: the same policy, awaited.

The classification, save schedule and retry settings come from
:mod:`changestream.consume`; only the loop is written again with ``await``.
Stores may be :class:`~changestream.stores.AsyncTokenStore` (awaited) or
plain :class:`~changestream.stores.TokenStore` (run in a worker thread, since
a file store fsyncs).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import tenacity

from .._consume import (
    ConsumeResult,
    Progress,
    RetryPolicy,
    check_save_options,
    invalidated,
    is_invalidate,
    is_transient,
    log,
)
from .._metrics import StatsCallback, StatsReporter
from ..stores import AsyncTokenStore, StoredToken, TokenStore
from ._stream import AsyncChangeStream

__all__ = ["consume"]


async def _call(method: Callable[..., Any], *args: Any) -> Any:
    """Await an async store method; run a sync one in a thread."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)


async def consume(
    open_stream: Callable[[Any], Awaitable[AsyncChangeStream[Any]]],
    handler: Callable[[Any], Any],
    store: TokenStore | AsyncTokenStore,
    *,
    save_every: int = 1,
    save_interval: float | None = None,
    retry_for: float | None = 300.0,
    backoff_initial: float = 0.5,
    backoff_max: float = 30.0,
    stop: asyncio.Event | None = None,
    on_stats: StatsCallback | None = None,
    stats_interval: float = 10.0,
) -> ConsumeResult:
    """Handle every change at least once, keeping the resume token in ``store``.

    Same contract as :func:`changestream.consume`, with
    ``open_stream(token)`` a coroutine function (e.g.
    ``lambda token: changestream.aio.watch(coll, resume_after=token)``) and
    ``handler`` a function or coroutine function. Returns when ``stop`` is
    set; cancelling the task stores the last handled token and re-raises.
    """
    check_save_options(save_every, save_interval)
    policy = RetryPolicy(retry_for, backoff_initial, backoff_max)
    progress = Progress(save_every, save_interval)
    stats = StatsReporter(on_stats, stats_interval)
    stored: StoredToken | None = await _call(store.load)
    progress.start(stored.token if stored is not None else None)
    stop = stop if stop is not None else asyncio.Event()
    opened = 0
    handler_error: BaseException | None = None

    async def save() -> None:
        await _call(store.save, progress.token)
        progress.saved()
        stats.on_stored(progress.token)

    async def session() -> bool:
        """Run one stream; ``True``: it failed transiently after progress, open a new one."""
        nonlocal opened, handler_error
        if stop.is_set():
            return False
        opened += 1
        stream = await open_stream(progress.token)
        stats.on_stream(stream)
        if opened > 1:
            log.info("reopened the change stream (reopen %d)", opened - 1)
        try:
            async with stream:
                if progress.on_idle(stream.resume_token):
                    await save()
                progress.advanced = False
                while not stop.is_set():
                    change = await stream.try_next()
                    token = stream.resume_token
                    stats.poll(progress.handled, opened - 1)
                    if change is None:
                        if not stream.alive:
                            raise invalidated(None, progress.token, token)
                        if progress.on_idle(token):
                            await save()
                    elif is_invalidate(change):
                        raise invalidated(change, progress.token, token)
                    else:
                        try:
                            result = handler(change)
                            if inspect.isawaitable(result):
                                await result
                        except Exception as exc:
                            handler_error = exc
                            raise
                        if progress.on_change(token):
                            await save()
        except Exception as exc:
            if progress.advanced and is_transient(exc):
                log.warning("change stream failed after progress (%s: %s); reopening",
                            type(exc).__name__, exc)
                return True
            raise
        return False

    async def sleep(seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)

    try:
        while await tenacity.AsyncRetrying(sleep=sleep, **policy.arguments())(session):
            pass
    except Exception as exc:
        await _flush_quietly(progress, save)
        stats.finish(progress.handled, max(opened - 1, 0))
        dead_end = policy.dead_end(exc, progress.token, store, from_handler=exc is handler_error)
        if dead_end is not None:
            raise dead_end from exc
        raise
    except BaseException:
        await _flush_quietly(progress, save)
        stats.finish(progress.handled, max(opened - 1, 0))
        raise
    if progress.pending:
        await save()
    stats.finish(progress.handled, max(opened - 1, 0))
    return ConsumeResult(progress.handled, max(opened - 1, 0), progress.token)


async def _flush_quietly(progress: Progress, save: Callable[[], Awaitable[None]]) -> None:
    """Store the last handled token on the way out; the original error matters more."""
    if progress.pending:
        try:
            await save()
        except Exception:
            log.exception("could not store the last handled resume token")
