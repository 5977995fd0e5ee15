"""The one prefetcher of both Spark paths: a change stream read ahead on a background thread.

``foreach_batch`` (its cutter thread) and the data source's driver
(:class:`~changestream.spark_adapter._readahead.ReadAhead`) both let a
:class:`Prefetcher` fetch events with ``try_next`` while they convert, cut or
wait for Spark. It holds at most ``max_rows`` events or ``max_bytes`` of BSON;
the consumer pops from :attr:`Prefetcher.events` directly (a deque: no lock
per event) and learns the rest from three fields written under the condition:

* :attr:`~Prefetcher.mark`: the last empty getMore, as ``(events fetched
  before it, its postBatchResumeToken, when it returned)``; once the consumer
  has taken that many events, the stream is known to be past the token;
* :attr:`~Prefetcher.stopped`: why fetching ended (an ``invalidate``, a stream
  closed by one the pipeline removed, or an error), to act on once every event
  before it is taken.

A transient failure reopens the stream after the last event fetched, with the
core's retry policy (:data:`RETRY`: exponential backoff, logged by its one
retry logger); after ``retry_for`` seconds without progress the consumer gets
:class:`~changestream.errors.RetriesExhaustedError` naming the failure.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity
from pymongo.errors import PyMongoError

from .. import ChangeStream
from .._consumer.retry import RetryPolicy, is_transient
from ..errors import RetriesExhaustedError, describe_error
from ._convert import event_token, is_error_event, is_invalidate
from ._errors import error_event

__all__ = ["POLL", "RETRY", "Prefetcher", "Stopped", "open_retrying"]

POLL = 0.01
"""Seconds between a waiting consumer's checks (fetching takes no lock per event)."""
RETRY = RetryPolicy(retry_for=300.0, backoff_initial=0.5, backoff_max=30.0)
"""How a stream is (re)opened after transient failures (consume's defaults): exponential
backoff, and :class:`~changestream.errors.RetriesExhaustedError` after 300 s without
progress. Each wait is logged by the core's one retry logger (the policy's
``before_sleep``, logger ``changestream.consume``)."""
log = logging.getLogger("changestream.spark")
T = TypeVar("T")


def open_retrying(open_stream: Callable[[], T]) -> T:
    """``open_stream()``, retried after transient failures as the prefetcher's reopens are.

    A network error or a failover during the opening aggregate (which the
    stream retries once itself) backs off and tries again (:data:`RETRY`),
    instead of failing the query or the ``foreach_batch`` run; after
    ``retry_for`` seconds the last error propagates.
    """
    return tenacity.Retrying(**RETRY.arguments())(open_stream)


@dataclasses.dataclass(frozen=True)
class Stopped:
    """Why fetching ended: an invalidate (its token), a closed stream, or an error."""

    token: Any = None
    error: BaseException | None = None


class Prefetcher:
    """Fetches ``stream`` into :attr:`events` on a background thread (module docstring).

    ``keep(event)`` is what is buffered for an event (raw BSON bytes, or a
    mapping); ``reopen(token)`` opens a new stream right after ``token`` when
    the current one failed transiently. Use as a context manager, or call
    :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        stream: ChangeStream[Any],
        reopen: Callable[[Any], ChangeStream[Any]],
        keep: Callable[[Any], Any],
        *,
        max_rows: int,
        max_bytes: int,
    ) -> None:
        self._stream = stream
        self._reopen = reopen
        self._keep = keep
        self._max_rows = max_rows
        self._max_bytes = max_bytes
        self.cond = threading.Condition()
        self.events: collections.deque[Any] = collections.deque()
        self.in_bytes = 0
        """BSON appended (written by the fetch thread only)."""
        self.out_bytes = 0
        """BSON taken (written by the consumer only)."""
        self.fetched = 0
        """Events fetched (fetch thread only)."""
        self.mark: tuple[int, Any, float] | None = None
        self.stopped: Stopped | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="changestream-prefetch",
                                        daemon=True)

    def __enter__(self) -> Prefetcher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, close_stream: bool = False) -> None:
        """Stop fetching (at most one getMore away); ``close_stream``: close the first stream too."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        if close_stream:
            self._stream.close()  # waits for a getMore in flight (at most max_await_time_ms)
        if self._thread.is_alive():
            self._thread.join()

    def full(self) -> bool:
        return (
            len(self.events) >= self._max_rows
            or self.in_bytes - self.out_bytes >= self._max_bytes
        )

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` (checked every :data:`POLL` s and at each mark or stop) or
        ``timeout`` passes; returns ``ready()``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, POLL))
        return True

    def taken(self, size: int) -> None:
        """The consumer took ``size`` bytes of BSON: wake the fetch thread if it waits for room."""
        self.out_bytes += size
        with self.cond:
            self.cond.notify_all()

    # -- the fetch thread ----------------------------------------------------------------------
    def _run(self) -> None:
        """Fetch; after a transient failure reopen after the last fetched event, backing off.

        The stream's own single resume covers a failover; when it fails (or
        resumes bring nothing) the stream is reopened from its token with
        :data:`RETRY`, and after ``retry_for`` seconds without progress
        :class:`RetriesExhaustedError` names the repeated failure. Other errors
        stop fetching at once.
        """
        stop = self._stop
        current: list[ChangeStream[Any] | None] = [self._stream]
        resume_from: list[Any] = [None]

        def session() -> bool:
            """Read until stopped; ``True``: failed transiently after progress (fresh budget)."""
            reading = current[0]
            if reading is None:
                reading = current[0] = self._reopen(resume_from[0])
            progress = [False]
            try:
                self._read(reading, progress)
                if reading is not self._stream:  # a reopened stream is this thread's to close
                    reading.close()
            except Exception as exc:
                current[0] = None
                resume_from[0] = reading.resume_token
                with contextlib.suppress(PyMongoError):
                    reading.close()
                if progress[0] and is_transient(exc) and not stop.is_set():
                    log.warning("change stream failed after progress (%s); reopening",
                                describe_error(exc))
                    return True
                raise
            return False

        def sleep(seconds: float) -> None:
            stop.wait(seconds)

        try:
            while not stop.is_set() and tenacity.Retrying(sleep=sleep, **RETRY.arguments())(
                session
            ):
                pass
        except BaseException as exc:
            if not stop.is_set():
                error: BaseException = exc
                if is_transient(exc):
                    error = RetriesExhaustedError(
                        f"the change stream kept failing for {RETRY.retry_for:g} s, the last "
                        f"time with {describe_error(exc)}; the stored position (the query's "
                        "checkpoint, the token store) is unchanged: run again once the "
                        "deployment is reachable",
                        token=resume_from[0],
                    )
                    error.__cause__ = exc
                with self.cond:
                    self.stopped = Stopped(error=error)
                    self.cond.notify_all()

    def _read(self, stream: ChangeStream[Any], progress: list[bool]) -> None:
        """Fetch until stopped or the stream ends; ``progress[0]``: it moved."""
        cond, events, stop = self.cond, self.events, self._stop
        while not stop.is_set():
            if self.full():  # the consumer is behind: read no further
                with cond:
                    while not stop.is_set() and self.full():
                        cond.wait(0.1)
                continue
            event = stream.try_next()
            if event is None:
                progress[0] = progress[0] or not stream.stalled
                with cond:
                    self.mark = (self.fetched, stream.resume_token, time.monotonic())
                    if not stream.alive:  # closed by an invalidate the pipeline removed
                        self.stopped = self.stopped or Stopped(stream.resume_token)
                    cond.notify_all()
                if self.stopped is not None:
                    return
                continue
            kept = self._keep(event)
            if is_invalidate(kept):
                with cond:
                    self.stopped = self.stopped or Stopped(event_token(kept))
                    cond.notify_all()
                return
            if is_error_event(kept):  # never data: the query stops after what came before
                with cond:
                    self.stopped = self.stopped or Stopped(
                        error=error_event(event_token(kept)))
                    cond.notify_all()
                return
            self.fetched += 1  # before the append: a mark never looks newer than it is
            if kept.__class__ is bytes:
                self.in_bytes += len(kept)
            events.append(kept)
            progress[0] = True
