"""The few steps the sync twins do differently from the async ones, under the same names.

The sync modules are written by ``tools/gen_sync.py`` from the
``changestream/aio`` sources, which call these steps through
:mod:`changestream.aio._async_io`; the generated code calls this module.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pymongo
import tenacity
from pymongo.errors import PyMongoError

from .._consumer.handler_errors import HandlerCalls
from .._consumer.history import HistoryGap
from .._consumer.options import ConsumeOptions
from .._stream_view import StreamView
from ._stream import ChangeStream

__all__ = [
    "ABANDONED",
    "STOP_CHECK",
    "bounded",
    "call_handler",
    "call_store",
    "next_or_stop",
    "report_gap",
    "stop_closes",
    "stop_setter",
    "wait_for_stop",
]

log = logging.getLogger("changestream.consume")

ABANDONED: Any = object()
"""What :func:`next_or_stop` returns when ``stop`` is already set (a stop that comes while a
getMore waits interrupts the stream instead: see :func:`stop_closes`)."""


def call_store(method: Callable[..., Any], *args: Any) -> Any:
    """Call a store method."""
    return method(*args)


def call_handler(handler: Callable[[Any], object], change: Any, calls: HandlerCalls) -> None:
    """Call the handler under the ``on_error`` policy (retried with backoff, then raised or
    dead-lettered)."""
    if not calls.retrying:
        handler(change)
        return
    refused = calls.error_event(change)
    if refused is not None:  # an error event: to the dead letter, never to the handler
        refused[0](change, refused[1])
        calls.dead_lettered()
        return
    stop = calls.stop
    sleep = time.sleep if stop is None else stop.wait  # the backoff wakes on a stop
    try:
        tenacity.Retrying(sleep=sleep, **calls.arguments())(handler, change)
    except Exception as exc:
        dead_letter = calls.gave_up(change, exc)
        if dead_letter is None:
            raise
        dead_letter(change, exc)
        calls.dead_lettered()


def report_gap(options: ConsumeOptions, gap: HistoryGap | None) -> None:
    """Call the ``gap`` function."""
    options.report_gap(gap)


def wait_for_stop(stop: threading.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    stop.wait(seconds)


def next_or_stop(stream: ChangeStream[Any], stop: threading.Event) -> Any:
    """``stream.try_next()``; a ``stop`` set while its getMore waits interrupts the stream from
    :func:`stop_closes`'s thread (the stream kills the cursor aside, so the server ends the
    getMore at once) and this returns ``None`` from a stream no longer alive. A ``stop``
    already set returns :data:`ABANDONED` at once (no poll that may wait)."""
    if stop.is_set():
        return ABANDONED
    return stream.try_next()


class CurrentStream:
    """The stream a run polls now (:func:`stop_closes` interrupts it when ``stop`` is set)."""

    def __init__(self) -> None:
        self.stream: StreamView | None = None


STOP_CHECK = 0.05
"""Seconds between looks at ``stop`` (a ``threading.Event`` a user sets: no callback tells
when): the stop watcher's, and the workers' wait for room (:mod:`._workers`)."""


@contextlib.contextmanager
def stop_closes(stop: threading.Event, call_timeout: float) -> Iterator[CurrentStream]:
    """While the block runs, ``stop`` set by another thread interrupts
    :attr:`CurrentStream.stream` (:meth:`~changestream._stream_view.StreamView.interrupt`, the
    one call safe from another thread; bounded by ``call_timeout``): a stop after the last
    change does not wait for the getMore in flight (its await, 1 s by default). Nothing is
    lost: that getMore's changes come after every handled one; the polling thread closes
    the stream itself."""
    current = CurrentStream()
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            if stop.wait(STOP_CHECK):
                stream = current.stream
                if stream is not None and not finished.is_set():
                    try:
                        with pymongo.timeout(call_timeout):
                            stream.interrupt()
                    except Exception as exc:  # the polling thread's close cleans up
                        log.debug("the stop could not interrupt the stream: %r", exc)
                return

    watcher = threading.Thread(target=watch, name="changestream-stop", daemon=True)
    watcher.start()
    try:
        yield current
    finally:
        finished.set()
        watcher.join()


def stop_setter(stop: threading.Event) -> Callable[[], object]:
    """A function that sets ``stop`` from a signal handler."""
    return stop.set


@contextlib.contextmanager
def bounded(stream: ChangeStream[Any], call_timeout: float) -> Iterator[ChangeStream[Any]]:
    """``with stream:`` whose close is bounded by ``call_timeout`` and best effort."""
    try:
        yield stream
    finally:
        with pymongo.timeout(call_timeout), contextlib.suppress(PyMongoError):
            stream.close()  # the server reaps an unkilled cursor itself
