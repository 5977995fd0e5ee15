"""The consume loop: the I/O between :class:`changestream._consume_run.Run`'s decisions.

Every decision (save schedule, dead ends, reopening, retry settings) is
:class:`~changestream._consume_run.Run`'s; this loop only opens streams,
polls them, calls the handler and the store, and sleeps between retries.
The asyncio module (``changestream/aio/_consume.py``) is the source;
``tools/gen_sync.py`` writes the sync one from it. The async loop also takes
async stores (awaited) and runs a plain store's methods in a worker thread (a
file store fsyncs); the sync loop calls its store directly.
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

from .._consume_run import (
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
from ..stores import AsyncTokenStore, TokenStore  # sync: from ..stores import TokenStore
from ._async_io import bounded, call_handler, call_store, stop_setter, wait_for_stop
from ._snapshot_watch import stream_opener
from ._stream import AsyncChangeStream

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
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    stop_on_signals: bool = False,
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
    ``call_timeout`` and ``stop_on_signals`` work as there.
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
    # the exporters in :mod:`changestream.exporters` are such callbacks.
    #
    # ``open_stream`` may also be a collection: then ``consume`` opens the
    # stream itself (``pipeline`` and ``watch_options`` are ``watch()``'s), and
    # with ``initial_snapshot=True`` first hands every document of the
    # collection to the handler as a snapshot record (see
    # :func:`changestream.snapshot_then_watch`; ``watch_options`` may also hold
    # its ``copy_batch_size``); the store then keeps the copy's progress, so a
    # restart continues the copy where it stopped.
    # """
    # sync-only: end
    open_stream = stream_opener(
        open_stream, initial_snapshot=initial_snapshot, pipeline=pipeline,
        watch_options=watch_options,
    )
    run = Run(store, save_every=save_every, save_interval=save_interval, retry_for=retry_for,
              backoff_initial=backoff_initial, backoff_max=backoff_max,
              stats=StatsReporter(on_stats, stats_interval), call_timeout=call_timeout)
    run.loaded(await call_store(store.load))
    stop = stop if stop is not None else asyncio.Event()  # sync: stop = stop if stop is not None else threading.Event()

    async def save() -> None:
        await call_store(store.save, run.token)
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
                            await call_handler(handler, change)
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
        await wait_for_stop(stop, seconds)

    try:
        with signals_stop(stop_on_signals, stop_setter(stop)):
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


async def _flush_quietly(run: Run, save: Callable[[], Awaitable[None]]) -> None:  # sync: def _flush_quietly(run: Run, save: Callable[[], None]) -> None:
    """Store the last handled token on the way out; the original error matters more."""
    if run.pending:
        try:
            await save()
        except Exception:
            log.exception("could not store the last handled resume token")
