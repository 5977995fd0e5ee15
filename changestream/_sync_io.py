"""The few steps the sync twins do differently from the async ones, under the same names.

The sync modules are written by ``tools/gen_sync.py`` from the
``changestream/aio`` sources, which call these steps through
:mod:`changestream.aio._async_io`; the generated code calls this module.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pymongo
import tenacity
from pymongo.errors import PyMongoError

from ._consumer.handler_errors import HandlerCalls
from ._consumer.history import HistoryGap
from ._consumer.options import ConsumeOptions
from ._stream import ChangeStream

__all__ = ["bounded", "call_handler", "call_store", "report_gap", "stop_setter", "wait_for_stop"]


def call_store(method: Callable[..., Any], *args: Any) -> Any:
    """Call a store method."""
    return method(*args)


def call_handler(handler: Callable[[Any], object], change: Any, calls: HandlerCalls) -> None:
    """Call the handler under the ``on_error`` policy (retried with backoff, then raised or
    dead-lettered)."""
    if not calls.retrying:
        handler(change)
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


def report_gap(options: ConsumeOptions, gap: HistoryGap | None) -> None:
    """Call the ``gap`` function."""
    options.report_gap(gap)


def wait_for_stop(stop: threading.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    stop.wait(seconds)


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
