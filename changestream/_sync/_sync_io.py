"""The few steps the sync twins do differently from the async ones, under the same names.

The sync modules are written by ``tools/gen_sync.py`` from the
``changestream/aio`` sources, which call these steps through
:mod:`changestream.aio._async_io`; the generated code calls this module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pymongo
import tenacity
from pymongo.errors import PyMongoError

from .._consumer.handler_errors import HandlerCalls
from .._consumer.history import HistoryGap
from .._consumer.options import ConsumeOptions
from ._stream import ChangeStream

__all__ = [
    "ABANDONED",
    "bounded",
    "call_handler",
    "call_store",
    "next_or_stop",
    "report_gap",
    "stop_setter",
    "wait_for_stop",
]

ABANDONED: Any = object()
"""Never returned here (see :func:`next_or_stop`)."""


def call_store(method: Callable[..., Any], *args: Any) -> Any:
    """Call a store method."""
    return method(*args)


def call_handler(handler: Callable[[Any], object], change: Any, calls: HandlerCalls) -> None:
    """Call the handler under the ``on_error`` policy (retried with backoff, then raised or
    dead-lettered)."""
    if not calls.retrying:
        handler(change)
        return
    try:
        tenacity.Retrying(**calls.arguments())(handler, change)
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
    """``stream.try_next()``: a sync getMore in flight cannot be abandoned from another
    thread (the sync stream's ``close()`` lets it finish, at most ``max_await_time_ms``)
    without closing a pooled connection under PyMongo, so a stop waits for it."""
    return stream.try_next()


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
