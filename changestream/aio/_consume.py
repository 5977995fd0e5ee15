"""The consume loop: the I/O between :class:`changestream._consumer.run.Run`'s decisions.

Every decision (save schedule, dead ends, reopening, retry settings) is
:class:`~changestream._consumer.run.Run`'s; this loop only opens streams,
polls them, calls the handler and the store, and sleeps between retries.
The async loop also takes async stores (awaited) and runs a plain store's
methods in a worker thread (a file store fsyncs); the sync loop calls its
store directly.

This asyncio module is the one source of both loops: ``tools/gen_sync.py``
writes ``changestream/_sync/_consume.py`` from it.
"""

from __future__ import annotations

import asyncio  # sync: import threading
from collections.abc import (
    Awaitable,  # async-only
    Callable,
    Mapping,
)
from typing import Any

import pymongo
import tenacity

from .._consumer.bounds import DEFAULT_CALL_TIMEOUT, call_bound, signals_stop
from .._consumer.handler_errors import OnError
from .._consumer.history import HistoryGap, HistoryLost, resnapshotting
from .._consumer.options import DEFAULT_DRAIN_TIMEOUT, ConsumeOptions
from .._consumer.run import GAP, HANDLE, MARK, NOTHING, SAVE, ConsumeResult, Run, log
from .._lanes import KeyFunction
from .._metrics import StatsCallback, StatsReporter
from ..errors import describe_error
from ..stores import (
    AsyncTokenStore,  # async-only
    BackgroundTokenStore,
    TokenStore,
)
from ._async_io import (
    ABANDONED,
    bounded,
    call_handler,
    call_store,
    next_or_stop,
    report_gap,
    stop_closes,
    stop_setter,
    wait_for_stop,
)
from ._snapshot_watch import stream_opener
from ._stats_timer import start_stats_timer, stop_stats_timer
from ._stream import AsyncChangeStream
from ._workers import AsyncWorkers

__all__ = ["consume"]


async def consume(
    open_stream: Callable[[Any], Awaitable[AsyncChangeStream[Any]]] | Any,  # sync: open_stream: Callable[[Any], ChangeStream[Any]] | Any,
    handler: Callable[[Any], Any],  # sync: handler: Callable[[Any], object],
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
    server_probes: bool = True,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    stop_on_signals: bool = False,
    workers: int = 1,
    key: KeyFunction | None = None,
    max_in_flight: int | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    on_error: OnError | None = None,
    on_history_lost: HistoryLost = "raise",
    gap: Callable[[HistoryGap], Any] | None = None,  # sync: gap: Callable[[HistoryGap], object] | None = None,
    oversize: str = "fail",
) -> ConsumeResult:
    # async-only: begin
    """Handle every change at least once, keeping the resume token in ``store``.

    Same contract as :func:`changestream.consume`, with
    ``open_stream(token)`` a coroutine function (e.g.
    ``lambda token: changestream.aio.watch(coll, resume_after=token)``) and
    ``handler`` a function or coroutine function. Returns when ``stop`` is
    set; cancelling the task stores the last handled token and re-raises.
    ``open_stream`` may also be an ``AsyncCollection`` (with ``pipeline``,
    ``watch_options`` and ``initial_snapshot`` as in the sync ``consume``).
    ``call_timeout``, ``stop_on_signals``, ``server_probes`` and ``oversize`` work as there. ``workers=N`` runs up
    to N handler calls as tasks (a coroutine-function handler overlaps them;
    a plain function runs on the loop, one at a time); ``key``,
    ``max_in_flight``, ``drain_timeout``, ``on_error`` (``dead_letter`` may be a
    coroutine function), ``on_history_lost`` and ``gap`` (may be a coroutine
    function) work as in the sync ``consume``.
    """
    # async-only: end
    # sync-only: begin
    # """Handle every change at least once, keeping the resume token in ``store``.
    #
    # ``open_stream(token)`` opens the stream from a stored token (``None``:
    # nothing stored yet), e.g.
    # ``lambda token: changestream.watch(coll, resume_after=token)``.
    # ``handler(change)`` is called for each change, in order; the token is
    # saved after every ``save_every`` handled changes, when ``save_interval``
    # seconds have passed since the last save, after each empty batch (the
    # postBatchResumeToken) and when the loop ends. A failure between handling
    # and saving means the change is handled again after a restart, never lost.
    #
    # Transient failures the stream could not resume from itself reopen the
    # stream from the last handled token with exponential backoff
    # (``backoff_initial`` doubling up to ``backoff_max`` seconds, plus jitter)
    # for up to ``retry_for`` seconds without progress (``None``: forever), then
    # raise :class:`RetriesExhaustedError`. The handler's own exceptions
    # propagate (a transient PyMongo error from it is retried the same way,
    # so the change is handled again). Raises :class:`HistoryLostError`,
    # :class:`NotResumableError` or :class:`StreamInvalidatedError` on dead
    # ends. Returns when ``stop`` is set (checked between polls, so within
    # about ``max_await_time_ms``); with ``stop_on_signals=True`` (main thread
    # only) SIGTERM and SIGINT set it, for a clean stop in containers.
    #
    # Every stream call (opening, each poll, closing) runs under a client-side
    # timeout of ``call_timeout`` seconds (default 60; the stream's own
    # ``timeout_ms`` applies if earlier): a server that stops answering becomes
    # a logged, retried failure, never an endless wait. A server that accepts
    # each resume and then fails again is not retried in a tight loop: the
    # stream gives up after ``MAX_IDLE_RESUMES`` (3) fruitless resumes and the
    # reopen backs off as above.
    #
    # ``on_stats(stats)`` receives a :class:`~changestream.ConsumeStats`
    # (changes handled, events/s, lag, resumes, reopens, time of the last
    # stored token) every ``stats_interval`` seconds and when the loop ends;
    # the exporters in :mod:`changestream.exporters` are such callbacks. With or
    # without it, a timer samples the lag every ``stats_interval`` seconds and
    # every 60 s (``PROBE_EVERY``) reads how full the oplog is and its oldest entry
    # (``$collStats`` and one ``find`` on ``local.oplog.rs``; without ``on_stats``
    # only while the lag grows, with it also ``serverStatus``), and logs a WARNING
    # when the stored position is estimated to fall off the oplog within the hour;
    # ``server_probes=False`` turns these reads (and so the headroom, the estimate
    # and their warnings) off.
    #
    # ``open_stream`` may also be a collection: then ``consume`` opens the
    # stream itself (``pipeline`` and ``watch_options`` are ``watch()``'s), and
    # with ``initial_snapshot=True`` first hands every document of the
    # collection to the handler as a snapshot record (see
    # :func:`changestream.snapshot_then_watch`; ``watch_options`` may also hold
    # its ``copy_batch_size``); the store then keeps the copy's progress, so a
    # restart continues the copy where it stopped.
    #
    # ``oversize`` says what an event over 16 MB does: ``"fail"`` (default)
    # stops with :class:`EventTooLargeError`; ``"split"`` (MongoDB 7.0+ or
    # 6.0.9+, a collection as first argument) opens the stream with
    # ``reassemble_split_events=True`` so the server splits it and the stream
    # joins the fragments.
    #
    # ``workers=N`` (N > 1) calls the handler on N threads: changes with the
    # same ``key(change)`` (default: namespace and ``documentKey._id``) run one
    # at a time in stream order, a change without a key (DDL, ...; ``key``
    # returning ``None``) runs alone after everything before it; the stored
    # token is the low watermark (no unhandled change before it); at most
    # ``max_in_flight`` changes (default ``max(64, 4 * workers)``) wait after it.
    # On stop, Ctrl-C or an error, admitted changes may finish for up to
    # ``drain_timeout`` seconds (default 30). ``on_error=OnError(...)`` retries
    # a failing handler, then stops or dead-letters the change;
    # ``on_history_lost`` (``"raise"``, ``"resnapshot"``, ``"from_now"`` with
    # ``gap``) says what a lost history (286) leads to. See ``docs/consume.md``.
    # """
    # sync-only: end
    source = open_stream
    open_stream = stream_opener(
        source, initial_snapshot=initial_snapshot, pipeline=pipeline,
        watch_options=watch_options, oversize=oversize,
    )
    settings = ConsumeOptions(source, open_stream, workers=workers, key=key,
                              max_in_flight=max_in_flight, drain_timeout=drain_timeout, on_error=on_error,
                              on_history_lost=on_history_lost, gap=gap)
    if settings.resnapshot:
        open_stream = resnapshotting(open_stream, stream_opener(
            source, initial_snapshot=True, pipeline=pipeline, watch_options=watch_options,
            oversize=oversize, marks=True))
    run = Run(store, save_every=save_every, save_interval=save_interval, retry_for=retry_for,
              backoff_initial=backoff_initial, backoff_max=backoff_max,
              stats=StatsReporter(on_stats, stats_interval, probes=server_probes),
              call_timeout=call_timeout,
              history=settings.history, calls=settings.calls, parallel=settings.lanes is not None)
    run.loaded(await call_store(store.load))
    stop = stop if stop is not None else asyncio.Event()  # sync: stop = stop if stop is not None else threading.Event()
    run.calls.stop = stop  # a handler's backoff wakes on it
    pool = None if settings.lanes is None else AsyncWorkers(handler, run.calls, settings.lanes,
                                                            settings.key)

    # a store that commits behind (a Delta sink): the next batch is fetched meanwhile
    behind = store if isinstance(store, BackgroundTokenStore) else None

    async def save() -> None:
        try:
            await call_store(store.save if behind is None else behind.save_behind, run.token)
        except Exception as exc:
            run.store_error = exc
            raise
        run.saved()

    async def flush() -> None:
        """What was saved is durable (a store committing behind), before the run ends."""
        if behind is None:
            return
        try:
            await call_store(behind.flush)
        except Exception as exc:
            run.store_error = exc
            raise

    async def session() -> bool:
        """Run one stream; ``True``: it failed transiently after progress, open a new one."""
        if stop.is_set():
            return False
        try:
            with pymongo.timeout(run.open_timeout()):
                stream = await open_stream(run.opening())
            current.stream = stream  # a stop now interrupts it (the sync twin; see stop_closes)
        except Exception as exc:
            if run.history_lost(exc):
                return True
            raise
        try:
            async with bounded(stream, run.call_timeout):
                step = run.started(stream)
                if step is GAP:
                    await report_gap(settings, run.gap)
                    step = run.gap_reported()
                if step is SAVE:
                    await save()
                current_token = stream.carried_token
                while not stop.is_set():
                    if stream.buffered > 1:  # from the buffer: no I/O, no bound (per change)
                        change = await stream.try_next()
                    else:  # a getMore may wait: a stop abandons it (see stop_closes)
                        with call_bound(run.call_timeout):
                            change = await next_or_stop(stream, stop)
                        if change is ABANDONED:
                            break
                    if change is None and stop.is_set() and not stream.alive:
                        break  # closed by the stop (the sync twin's stop_closes)
                    token = current_token()
                    step = run.polled(change, token, stream.alive, stream.stalled)
                    if step is HANDLE:
                        try:
                            if pool is None:
                                await call_handler(handler, change, run.calls)
                            else:  # the stored token never trails the window: store first
                                if not await pool.room(stop):
                                    break  # stop came while waiting for room: not admitted
                                # room counts from the watermark about to be stored, not from
                                # one that moves on while the store writes
                                watermark, handled, free = pool.window()
                                if run.advanced_to(watermark, handled) is SAVE:
                                    await save()
                                pool.submit(change, token)
                                # the rest of the buffered batch in one call, no I/O
                                batch: list[tuple[Any, Any]] = (
                                    [] if stop.is_set() else stream.take_carried(free - 1))
                                if batch:
                                    admitted = run.polled_buffered(batch)
                                    pool.submit_many(batch[:admitted] if admitted < len(batch)
                                                     else batch)
                                    if admitted < len(batch):  # an invalidate: raises
                                        run.polled(*batch[admitted], stream.alive)
                        except Exception as exc:
                            run.handler_error = exc
                            raise
                        # with workers, what finished meanwhile is stored before the next admission
                        step = run.handled(token) if pool is None else NOTHING
                    elif step is MARK and pool is not None:
                        try:
                            pool.mark(token)
                        except Exception as exc:
                            run.handler_error = exc
                            raise
                        step = run.advanced_to(*pool.progress())
                    if step is SAVE:
                        await save()
        except Exception as exc:
            if pool is not None:  # a reopen starts from the low watermark, nothing running
                settled = await pool.settle(settings.drain_timeout)
                run.advanced_to(*pool.progress())
                if not settled:
                    raise
                await pool.restart()
            if run.reopen_after(exc):
                return True
            raise
        return False

    async def sleep(seconds: float) -> None:
        await wait_for_stop(stop, seconds)

    start_stats_timer(run)  # reports (or samples for the history-loss warning) also while a poll waits
    try:
        try:
            with signals_stop(stop_on_signals, stop_setter(stop)), stop_closes(stop, run.call_timeout) as current:
                while await tenacity.AsyncRetrying(sleep=sleep, **run.retrying())(session):
                    pass
        except Exception as exc:
            await _settle_quietly(pool, run, settings.drain_timeout)
            await _flush_quietly(run, save, flush)
            run.finished()
            error = run.final_error(exc)
            if error is exc:
                raise
            raise error from error.__cause__
        except BaseException:
            await _settle_quietly(pool, run, settings.drain_timeout)
            await _flush_quietly(run, save, flush)
            run.finished()
            raise
        await _settle_quietly(pool, run, settings.drain_timeout)
        if run.pending:
            await save()
        await flush()
        return run.result()
    finally:
        await stop_stats_timer(run)  # after the final report; none outlives the loop


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


async def _flush_quietly(run: Run, save: Callable[[], Awaitable[None]], flush: Callable[[], Awaitable[None]]) -> None:  # sync: def _flush_quietly(run: Run, save: Callable[[], None], flush: Callable[[], None]) -> None:
    """Store the last handled token on the way out; the original error matters more.

    Not after the store itself failed (a full disk, a lost table): trying it again on the
    way out only repeats that failure (delta-rs even panics in its writer threads); the
    run ends with the store's error and the next run resumes from what was stored.
    """
    if run.store_error is None:
        try:
            if run.pending:
                await save()
            await flush()  # a save committing behind: durable, or its failure logged
        except Exception as exc:
            log.warning("could not store the last handled resume token: %s", describe_error(exc))
