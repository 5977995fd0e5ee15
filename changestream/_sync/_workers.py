"""Handler calls of :func:`changestream.consume`: on the fetching thread, or on N worker threads.

``_sync_io.call_handler`` applies the ``on_error`` policy
(:class:`changestream._consumer.handler_errors.HandlerCalls`) to one call. :class:`ThreadWorkers`
runs those calls on ``workers`` threads; which change may start and which
token may be stored is :class:`changestream._lanes.Lanes`'s decision, made
under one lock. Its async twin is :mod:`changestream.aio._workers`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from .._consumer.handler_errors import HandlerCalls
from .._lanes import Job, Lanes
from ._sync_io import STOP_CHECK, call_handler

__all__ = ["ThreadWorkers"]

log = logging.getLogger("changestream.consume")


class ThreadWorkers:
    """``workers`` threads calling the handler, per-key order and the low watermark kept by ``lanes``.

    The fetching thread calls :meth:`room` (waits while ``max_in_flight``
    changes are in flight), :meth:`submit`, :meth:`mark` and :meth:`progress`; each worker
    thread, when its call returns, finishes the job and takes the next one
    itself, so a key's next change starts without waiting for the fetching
    thread. The first handler failure stops every start and is raised by
    the next call of the fetching thread.
    """

    def __init__(
        self,
        handler: Callable[[Any], object],
        calls: HandlerCalls,
        lanes: Lanes,
        key: Callable[[Any], Hashable],
    ) -> None:
        self._handler = handler
        self._calls = calls
        self._lanes = lanes
        self._key = key
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        """Signalled when a job may start (or the workers must end)."""
        self._room = threading.Condition(self._lock)
        """Signalled when a job finished (room to admit, a failure, or all done)."""
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._gave_up = False
        """A :meth:`settle` timed out: calls may still run, nothing more may start."""
        self.failure: BaseException | None = None
        """The first exception a handler call ended with (after the ``on_error`` policy)."""

    # -- the fetching thread --------------------------------------------------------------------
    def room(self, stop: threading.Event | None = None) -> bool:
        """Wait while ``max_in_flight`` changes are in flight (until a quarter is free again);
        raises a handler's failure. The caller stores the moved watermark, then submits.

        ``False``: ``stop`` was set meanwhile (nothing is admitted: the caller stops, and
        ``drain_timeout`` bounds what follows). A stop or a signal sets an event nobody
        here is notified of, so the wait looks at it every ``STOP_CHECK`` seconds; without
        ``stop`` it sleeps until a job finishes (or fails).
        """
        with self._lock:
            lanes = self._lanes
            if lanes.full:
                while not lanes.roomy and self.failure is None:
                    if stop is not None and stop.is_set():
                        return False
                    self._room.wait(None if stop is None else STOP_CHECK)
            self._raise_failure()
        return True

    def submit(self, change: Any, token: Any) -> None:
        """Hand ``change`` (followed by ``token``) to the workers (after :meth:`room`)."""
        key = self._key(change)
        with self._lock:
            self._raise_failure()
            self._lanes.admit(change, key, token)
            self._start()

    def submit_many(self, batch: list[tuple[Any, Any]]) -> None:
        """:meth:`submit` for each ``(change, token)`` of ``batch`` (at most the
        room :meth:`window` gave), in order, under one lock."""
        keyed = [(change, self._key(change), token) for change, token in batch]
        with self._lock:
            self._raise_failure()
            admit = self._lanes.admit
            for change, key, token in keyed:
                admit(change, key, token)
            self._start()

    def mark(self, token: Any) -> None:
        """A position without a change (an empty batch's token), in stream order."""
        with self._lock:
            self._raise_failure()
            self._lanes.mark(token)

    def progress(self) -> tuple[Any, int]:
        """The low watermark (the token that may be stored) and the changes handled so far."""
        with self._lock:
            return self._lanes.watermark, self._lanes.handled

    def window(self) -> tuple[Any, int, int]:
        """:meth:`progress` and the free room (``max_in_flight`` minus the changes after the
        watermark), read together: once that watermark is stored, admitting at most that
        many keeps what a crash re-delivers within ``max_in_flight``, however many calls
        end while the store writes."""
        with self._lock:
            lanes = self._lanes
            return lanes.watermark, lanes.handled, lanes.free

    def settle(self, timeout: float | None) -> bool:
        """Let every admitted change finish, for up to ``timeout`` s; ``True``: all did.

        After a failure only the running calls are waited for. At the timeout
        nothing more starts (calls still running end in the background; their
        changes, and those never started, are delivered again after a
        restart). Afterwards :meth:`progress` is final for this stream, and
        :meth:`restart` makes the workers usable again from there.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            lanes = self._lanes
            if self._gave_up:
                return lanes.running == 0
            while not lanes.idle:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._gave_up = True
                    lanes.abandon()
                    log.warning("handlers still running after %g s (drain_timeout): %d call(s) "
                                "left running, %d change(s) not handled; they are delivered "
                                "again after a restart", timeout, lanes.running,
                                lanes.in_flight)
                    return False
                self._room.wait(remaining)
            return True

    def restart(self) -> BaseException | None:
        """After :meth:`settle`: start over from the watermark; returns (and clears) the failure."""
        with self._lock:
            self._lanes.restart(self._lanes.watermark)
            self._gave_up = False
            failure, self.failure = self.failure, None
            return failure

    def close(self) -> None:
        """End the worker threads (a call still running ends in the background)."""
        with self._lock:
            self._closing = True
            self._lanes.abandon()
            self._work.notify_all()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _start(self) -> None:
        """Wake a worker per job that may start; start threads up to ``workers`` (lock held)."""
        ready = self._lanes.ready
        if not ready:
            return
        idle = len(self._threads) - self._lanes.running
        if idle < ready and len(self._threads) < self._lanes.workers:
            for _ in range(min(ready - idle, self._lanes.workers - len(self._threads))):
                thread = threading.Thread(target=self._run, daemon=True,
                                          name=f"changestream-worker-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
        self._work.notify(ready)

    # -- the worker threads ---------------------------------------------------------------------
    def _run(self) -> None:
        lock, lanes = self._lock, self._lanes
        job: Job | None = None
        while True:
            with lock:
                while job is None:
                    if self._closing:
                        return
                    job = lanes.take()
                    if job is None:
                        self._work.wait()
            try:
                call_handler(self._handler, job.change, self._calls)
            except BaseException as exc:
                with lock:
                    if self.failure is None:
                        self.failure = exc
                    lanes.fail(job)
                    self._room.notify_all()
                job = None
                if not isinstance(exc, Exception):
                    raise
                continue
            with lock:
                lanes.done(job)
                job = lanes.take()
                if lanes.ready:
                    self._work.notify(lanes.ready)
                if lanes.roomy or lanes.idle:
                    self._room.notify_all()
