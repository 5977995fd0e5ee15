"""At-least-once processing: run a handler for every change and keep the resume token durable.

:func:`consume` polls a stream with ``try_next``, calls the handler, and saves
the token of the last *handled* change (and of empty batches, the
postBatchResumeToken) in a token store. After a crash, a restart resumes from
the stored token, so every change is handled at least once. When the
stream's own single resume fails for a transient reason (server unreachable,
network errors, a failover longer than server selection) the stream is
reopened from the last handled token with exponential backoff (tenacity).
What no retry can fix stops with a :class:`ConsumeError` saying how to
recover; a dead token never loops. With ``workers`` > 1 the handler calls run
on threads (sync) or tasks (asyncio), each loop's ``_workers`` module.

Every decision is :class:`changestream._run.Run`'s and the option checks are
:class:`changestream._policies.Setup`'s; this module is only the I/O between
them. It is the one source of both loops: ``tools/gen_sync.py`` writes
``changestream/_consume.py`` from it. Stores may be async (awaited) or plain
(run in a worker thread by the asyncio loop, since a file store fsyncs).
"""

from __future__ import annotations

import asyncio  # sync: import threading
import collections.abc
import contextlib
import inspect  # async-only
from collections.abc import Callable, Mapping
from typing import Any

import pymongo
import tenacity
from pymongo.errors import PyMongoError

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
from .._run import (
    DEFAULT_CALL_TIMEOUT,
    GAP,
    HANDLE,
    MARK,
    SAVE,
    # sync-only: begin
    # ConsumeError,
    # sync-only: end
    ConsumeResult,
    # sync-only: begin
    # HistoryLostError,
    # NotResumableError,
    # RetriesExhaustedError,
    # RetryPolicy,
    # sync-only: end
    Run,
    # sync-only: begin
    # StreamInvalidatedError,
    # sync-only: end
    call_bound,
    # sync-only: begin
    # is_transient,
    # sync-only: end
    log,
    signals_stop,
    stalled,
    # sync-only: begin
    # unrecoverable,
    # sync-only: end
)
from ..stores import AsyncTokenStore, TokenStore  # sync: from .stores import TokenStore
from ._snapshot_watch import stream_opener
from ._stream import AsyncChangeStream
from ._workers import AsyncWorkers, call_handler

__all__ = ["consume"]
# sync-only: begin
# __all__ += [  # what the rest of the package (and its users' old imports) take from here
#     "DEFAULT_CALL_TIMEOUT",
#     "ConsumeError",
#     "ConsumeResult",
#     "HistoryLostError",
#     "NotResumableError",
#     "RetriesExhaustedError",
#     "RetryPolicy",
#     "StreamInvalidatedError",
#     "is_transient",
#     "stalled",
#     "unrecoverable",
# ]
# sync-only: end


async def _call(method: Callable[..., Any], *args: Any) -> Any:
    """A store method: awaited if async, in a worker thread if not (a file store fsyncs)."""  # sync: """A store method, called (stores are synchronous here)."""
    # async-only: begin
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    return await asyncio.to_thread(method, *args)
    # async-only: end
    # sync-only: begin
    # return method(*args)
    # sync-only: end


@contextlib.asynccontextmanager
async def bounded(
    stream: AsyncChangeStream[Any], call_timeout: float
) -> collections.abc.AsyncIterator[AsyncChangeStream[Any]]:
    """``with stream:`` whose close is bounded by ``call_timeout`` and best effort."""
    try:
        yield stream
    finally:
        with pymongo.timeout(call_timeout), contextlib.suppress(PyMongoError):
            await stream.close()  # the server reaps an unkilled cursor itself


async def consume(
    open_stream: Callable[[Any], Any] | Any,
    handler: Callable[[Any], Any],
    store: TokenStore | AsyncTokenStore,  # sync: store: TokenStore,
    *,
    initial_snapshot: bool = False,
    pipeline: list[Mapping[str, Any]] | None = None,
    watch_options: Mapping[str, Any] | None = None,
    save_every: int = 1,
    save_interval: float | None = None,
    retry_for: float | None = 300.0,
    backoff_initial: float = 0.5,
    backoff_max: float = 30.0,
    stop: asyncio.Event | None = None,  # sync: stop: threading.Event | None = None,
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

    ``open_stream(token)`` opens the stream from a stored token (``None``:
    nothing stored yet), e.g.
    ``lambda token: changestream.aio.watch(coll, resume_after=token)`` (with
    asyncio a coroutine function). ``handler(change)`` is called for each
    change, in order (with asyncio it may be a coroutine function); the token
    is saved after every ``save_every`` handled changes, when
    ``save_interval`` seconds have passed since the last save, after each
    empty batch (the postBatchResumeToken) and when the loop ends. A failure
    between handling and saving means the change is handled again after a
    restart, never lost. ``store`` is a token store (with asyncio also an
    async one; a plain one then runs in a worker thread).

    Transient failures the stream could not resume from itself reopen the
    stream from the last handled token with exponential backoff
    (``backoff_initial`` doubling up to ``backoff_max`` seconds, plus jitter)
    for up to ``retry_for`` seconds without progress (``None``: forever), then
    raise :class:`RetriesExhaustedError`. The handler's own exceptions
    propagate (a transient PyMongo error from it is retried the same way,
    so the change is handled again). Raises :class:`HistoryLostError`,
    :class:`NotResumableError` or :class:`StreamInvalidatedError` on dead
    ends. Returns when ``stop`` (an event: ``threading.Event``, with asyncio
    ``asyncio.Event``) is set, checked between polls, so within about
    ``max_await_time_ms``; with ``stop_on_signals=True`` (main thread only)
    SIGTERM and SIGINT set it, for a clean stop in containers. Cancelling the
    asyncio task stores the last handled token and re-raises.

    Every stream call (opening, each poll, closing) runs under a client-side
    timeout of ``call_timeout`` seconds (default 60; the stream's own
    ``timeout_ms`` applies if earlier): a server that stops answering becomes
    a logged, retried failure, never an endless wait. A server that accepts
    each resume and then fails again is not retried in a tight loop: the
    stream gives up after ``MAX_IDLE_RESUMES`` (3) fruitless resumes and the
    reopen backs off as above.

    ``on_stats(stats)`` receives a :class:`~changestream.ConsumeStats`
    (changes handled, events/s, lag, resumes, reopens, time of the last
    stored token, retries, dead letters) every ``stats_interval`` seconds and
    when the loop ends; the exporters in :mod:`changestream.exporters` are
    such callbacks.

    ``open_stream`` may also be a collection: then ``consume`` opens the
    stream itself (``pipeline`` and ``watch_options`` are ``watch()``'s), and
    with ``initial_snapshot=True`` first hands every document of the
    collection to the handler as a snapshot record (see
    :func:`changestream.snapshot_then_watch`; ``watch_options`` may also hold
    its ``copy_batch_size``); the store then keeps the copy's progress, so a
    restart continues the copy where it stopped.

    ``workers=N`` (N > 1) runs up to N handler calls at once (threads; with
    asyncio, tasks, which overlap only a coroutine-function handler): changes
    with the same ``key(change)`` (default: namespace and
    ``documentKey._id``) run one at a time in stream order, a change without
    a key (DDL, ...; ``key`` returning ``None``) runs alone after everything
    before it; the stored token is the low watermark (no unhandled change
    before it); at most ``max_in_flight`` changes (default
    ``max(64, 4 * workers)``) wait after it. On stop, Ctrl-C, cancellation or
    an error, admitted changes may finish for up to ``drain_timeout`` seconds
    (default 30). ``on_error=OnError(...)`` retries a failing handler, then
    stops or dead-letters the change; ``on_history_lost`` (``"raise"``,
    ``"resnapshot"``, ``"from_now"`` with ``gap``) says what a lost history
    (286) leads to. ``dead_letter`` and ``gap`` may be coroutine functions
    with asyncio. See ``docs/consume.md``.
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
    stop = stop if stop is not None else asyncio.Event()  # sync: stop = stop if stop is not None else threading.Event()
    pool = None if setup.lanes is None else AsyncWorkers(handler, run.calls, setup.lanes,
                                                         setup.key)

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

    # async-only: begin
    async def sleep(seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)

    loop = asyncio.get_running_loop()
    set_stop = lambda: loop.call_soon_threadsafe(stop.set)  # noqa: E731
    # async-only: end
    # sync-only: begin
    # def sleep(seconds: float) -> None:
    #     stop.wait(seconds)
    # set_stop = stop.set
    # sync-only: end
    try:
        with signals_stop(stop_on_signals, set_stop):
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
    result = setup.report_gap(gap)  # sync: setup.report_gap(gap)
    # async-only: begin
    if inspect.isawaitable(result):
        await result
    # async-only: end


async def _settle_quietly(pool: AsyncWorkers | None, run: Run, drain_timeout: float) -> None:
    """Let admitted changes finish (up to ``drain_timeout``) and take their watermark."""
    if pool is None:
        return
    try:
        await pool.settle(drain_timeout)
    except BaseException:  # interrupted again (Ctrl-C, cancelled): keep what is done
        log.warning("stopped waiting for the handlers; their changes are delivered again")
    finally:
        run.advanced_to(*pool.progress())
        await pool.close()


async def _flush_quietly(run: Run, save: Callable[[], Any]) -> None:
    """Store the last handled token on the way out; the original error matters more."""
    if run.pending:
        try:
            await save()
        except Exception:
            log.exception("could not store the last handled resume token")
