"""Handler calls of :func:`changestream.aio.consume`: awaited in the loop, or as up to N tasks.

The asyncio twin of :mod:`changestream._sync._workers`: the same ``on_error``
policy (:class:`changestream._consumer.handler_errors.HandlerCalls`) and the same decisions
(:class:`changestream._lanes.Lanes`: per-key order, barriers, the low
watermark), with tasks instead of threads. Everything runs on the event
loop's thread, so no lock is needed. A plain-function handler runs on the
loop itself (one at a time); give a coroutine function to overlap its I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable, Coroutine, Hashable
from typing import Any

from .._consumer.handler_errors import HandlerCalls
from .._lanes import Job, Lanes
from ._async_io import call_handler

__all__ = ["AsyncWorkers"]

log = logging.getLogger("changestream.consume")


class AsyncWorkers:
    """Up to ``workers`` tasks calling the handler, per-key order and the low watermark kept by ``lanes``.

    Same surface as the thread version: the consuming coroutine calls
    :meth:`room` (waits while ``max_in_flight`` changes are in flight), :meth:`submit`,
    :meth:`submit_many`, :meth:`mark`, :meth:`progress`, :meth:`settle` and :meth:`restart`; a task
    whose call returns finishes its job and goes on with the next one that
    may start.
    """

    def __init__(
        self,
        handler: Callable[[Any], Any],
        calls: HandlerCalls,
        lanes: Lanes,
        key: Callable[[Any], Hashable],
    ) -> None:
        self._handler = handler
        self._calls = calls
        self._lanes = lanes
        self._key = key
        self._room = asyncio.Event()
        """Set when a job ended (room to admit, a failure, or all done), while :attr:`_waiting`."""
        self._waiting = False
        """:meth:`room` or :meth:`settle` waits for :attr:`_room` (else a job's end sets nothing)."""
        self._coroutine_handler = inspect.iscoroutinefunction(handler)
        """Each call returns a coroutine: await it without asking (runs once per change)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._parked: list[asyncio.Future[Job | None]] = []
        """Tasks with nothing to do wait on these (the last parked first): handing a job to
        one costs a future, where a task per job costs a task and its coroutine."""
        self._create_task: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]] | None = None
        """The running loop's ``create_task`` (looked up once: it runs once per new worker)."""
        self._gave_up = False
        """A :meth:`settle` timed out: calls may still run, nothing more may start."""
        self.failure: BaseException | None = None
        """The first exception a handler call ended with (after the ``on_error`` policy)."""

    # -- the consuming coroutine ------------------------------------------------------------------
    async def room(self, stop: asyncio.Event | None = None) -> bool:
        """Wait while ``max_in_flight`` changes are in flight (until a quarter is free again);
        raises a handler's failure. The caller stores the moved watermark, then submits.

        ``False``: ``stop`` was set meanwhile (nothing is admitted: the caller stops, and
        ``drain_timeout`` bounds what follows).
        """
        lanes = self._lanes
        if lanes.full:
            while not lanes.roomy and self.failure is None:
                if stop is not None and stop.is_set():
                    return False
                self._room.clear()
                self._waiting = True
                try:
                    if stop is None:
                        await self._room.wait()
                    else:
                        await _first_of(self._room.wait(), stop.wait())
                finally:
                    self._waiting = False
        self._raise_failure()
        return True

    def submit(self, change: Any, token: Any) -> None:
        """Hand ``change`` (followed by ``token``) to the tasks (after :meth:`room`).

        Plain (not a coroutine): it never waits, and it runs once per change.
        """
        if self.failure is not None:
            raise self.failure
        lanes = self._lanes
        lanes.admit(change, self._key(change), token)
        if lanes.ready:
            self._start()

    def submit_many(self, batch: list[tuple[Any, Any]]) -> None:
        """:meth:`submit` for each ``(change, token)`` of ``batch`` (at most the
        room :meth:`window` gave), in order: the rest of a buffered batch, admitted and
        started in one call."""
        if self.failure is not None:
            raise self.failure
        lanes, key = self._lanes, self._key
        admit = lanes.admit
        for change, token in batch:
            admit(change, key(change), token)
        if lanes.ready:
            self._start()

    def mark(self, token: Any) -> None:
        """A position without a change (an empty batch's token), in stream order."""
        self._raise_failure()
        self._lanes.mark(token)

    def progress(self) -> tuple[Any, int]:
        """The low watermark (the token that may be stored) and the changes handled so far."""
        return self._lanes.watermark, self._lanes.handled

    def window(self) -> tuple[Any, int, int]:
        """:meth:`progress` and the free room (``max_in_flight`` minus the changes after the
        watermark), read together: once that watermark is stored, admitting at most that
        many keeps what a crash re-delivers within ``max_in_flight``, however many calls
        end while the store writes."""
        lanes = self._lanes
        return lanes.watermark, lanes.handled, lanes.free

    async def settle(self, timeout: float | None) -> bool:
        """Let every admitted change finish, for up to ``timeout`` s; ``True``: all did.

        After a failure only the running calls are waited for. At the timeout
        nothing more starts and the calls still running are cancelled (their
        changes, and those never started, are delivered again after a restart).
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        lanes = self._lanes
        while not lanes.idle:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                self._gave_up = True
                lanes.abandon()
                log.warning("handlers still running after %g s (drain_timeout): %d call(s) "
                            "cancelled, %d change(s) not handled; they are delivered again "
                            "after a restart", timeout, lanes.running, lanes.in_flight)
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return False
            self._room.clear()
            self._waiting = True
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._room.wait(), remaining)
            finally:
                self._waiting = False
        return True

    async def restart(self) -> BaseException | None:
        """After :meth:`settle`: start over from the watermark; returns (and clears) the failure."""
        self._lanes.restart(self._lanes.watermark)
        self._gave_up = False
        failure, self.failure = self.failure, None
        return failure

    async def close(self) -> None:
        """Cancel every call still running."""
        self._lanes.abandon()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _start(self) -> None:
        """Hand each job that may start (up to ``workers`` running) to a parked task, or to a
        new one while fewer than ``workers`` exist; tasks live until :meth:`close`."""
        lanes, parked = self._lanes, self._parked
        while parked:
            waiter = parked.pop()
            if waiter.done():  # its task was cancelled while parked
                continue
            job = lanes.take()
            if job is None:
                parked.append(waiter)
                return
            waiter.set_result(job)
        create_task = self._create_task
        if create_task is None:
            create_task = self._create_task = asyncio.get_running_loop().create_task
        tasks = self._tasks
        while (job := lanes.take()) is not None:
            tasks.add(create_task(self._work(job)))  # the task removes itself when done

    # -- the handler tasks ----------------------------------------------------------------------
    async def _work(self, job: Job | None) -> None:
        lanes, handler, calls, room = self._lanes, self._handler, self._calls, self._room
        parked, loop = self._parked, asyncio.get_running_loop()
        retrying, coroutine_handler = calls.retrying, self._coroutine_handler
        try:
            while job is not None:
                try:
                    if retrying:
                        await call_handler(handler, job.change, calls)
                    elif coroutine_handler:  # call_handler inlined: one coroutine less per change
                        await handler(job.change)
                    else:
                        result = handler(job.change)
                        if inspect.isawaitable(result):
                            await result
                except BaseException as exc:
                    lanes.fail(job)
                    room.set()
                    if not isinstance(exc, Exception):
                        raise
                    if self.failure is None:
                        self.failure = exc
                    return
                lanes.done(job)
                if self._waiting and (lanes.roomy or lanes.idle):
                    room.set()
                job = lanes.take()
                if job is None:  # park until _start hands over a job (or close cancels)
                    waiter = loop.create_future()
                    parked.append(waiter)
                    job = await waiter
                elif lanes.ready:
                    self._start()
        finally:
            self._tasks.discard(asyncio.current_task())


async def _first_of(*waits: Coroutine[Any, Any, Any]) -> None:
    """Wait until one of ``waits`` is done; cancel the others."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
