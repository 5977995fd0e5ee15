"""One change stream, many in-process subscribers: the hub.

A server cursor per subscriber multiplies the server's work (meteor #14453);
:class:`AsyncHub` reads ONE stream and hands each change to every
subscription whose filter accepts it: a Python predicate (``where=``) and/or
a ``$match`` on event fields evaluated client-side (``match=``, the subset in
:mod:`changestream._match`). Each subscription has its own bounded queue
(``max_queue``) and a policy for when it is full:

* ``"block"``: the hub waits for that subscriber (so does every other one);
* ``"drop"``: the change is not queued; before the next change that fits, the
  subscriber receives a :class:`Gap` saying how many were dropped and between
  which tokens (never silent);
* ``"disconnect"``: the subscriber receives :class:`SubscriberDisconnected`
  after the changes already queued, and the hub forgets it.

When the stream ends (``stop()``, an invalidate, an error) every subscription
ends after its queued items: iteration stops, or raises the stream's error.
The sync hub uses threads and ``queue.Queue``; ``Hub.start()`` runs it on a
daemon thread.

This asyncio module is the one source of both hubs: ``tools/gen_sync.py``
writes ``changestream/_sync/_hub.py`` from it.
"""

from __future__ import annotations

import asyncio  # sync: import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .._hub_items import _END, DEFAULT_MAX_QUEUE, POLICIES, Gap, SubscriberDisconnected, _Failed
from .._match import compile_match
from ._stream import AsyncChangeStream

__all__ = ["AsyncHub", "AsyncSubscription"]

class AsyncSubscription:
    """One subscriber's view of the hub: iterate it for the changes its filter accepts."""

    def __init__(
        self,
        hub: AsyncHub,
        where: Callable[[Any], bool] | None,
        match: Mapping[str, Any] | None,
        max_queue: int,
        on_full: str,
    ) -> None:
        if on_full not in POLICIES:
            raise ValueError(f"on_full must be one of {', '.join(POLICIES)}, not {on_full!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an integer >= 1, not {max_queue!r}")
        if where is not None and not callable(where):
            raise ValueError(f"where must be a function of the change, not {where!r}")
        self._hub = hub
        self._where = where
        self._match = None if match is None else compile_match(match)
        self.max_queue = max_queue
        self.on_full = on_full
        # Two spare slots beyond max_queue: a Gap or the disconnect, then the end.
        spare = 0 if on_full == "block" else 2
        self._queue: Any = asyncio.Queue(max_queue + spare)  # sync: self._queue: Any = queue.Queue(max_queue + spare)
        self._gap: Gap | None = None
        self._last_token: Any = None
        self.delivered = 0
        """Changes queued for this subscriber."""
        self.dropped = 0
        """Changes dropped (``"drop"``), each reported in a :class:`Gap`."""
        self.closed = False

    def wants(self, change: Any) -> bool:
        """Does this subscriber's filter accept ``change``?"""
        if self._match is not None and not self._match(change):
            return False
        return self._where is None or bool(self._where(change))

    async def offer(self, change: Any, token: Any) -> None:
        """Queue ``change`` under the subscription's policy (called by the hub)."""
        q = self._queue
        if self.on_full == "block":
            await q.put(change)
        elif q.qsize() >= self.max_queue:
            if self.on_full == "disconnect":
                self.closed = True
                q.put_nowait(_Failed(SubscriberDisconnected(
                    f"the subscriber fell {self.max_queue} changes behind the hub "
                    f"(max_queue, on_full='disconnect'); resume after "
                    f"{self._last_token!r} with a stream of its own, or subscribe again"
                )))
                return
            if self._gap is None:
                self._gap = Gap(0, self._last_token, token)
            self._gap.dropped += 1
            self._gap.until_token = token
            self.dropped += 1
            return
        else:
            if self._gap is not None:
                q.put_nowait(self._gap)
                self._gap = None
            q.put_nowait(change)
        self.delivered += 1
        self._last_token = token

    async def end(self, error: BaseException | None) -> None:
        """The hub ended: the pending gap, then the end (or the error), after what is queued."""
        if self.closed:
            return
        self.closed = True
        q = self._queue
        if self._gap is not None:
            await q.put(self._gap)
            self._gap = None
        await q.put(_END if error is None else _Failed(error))

    def close(self) -> None:
        """Stop receiving: the hub forgets this subscription (and is never blocked by it)."""
        self.closed = True
        self._hub._forget(self)
        q = self._queue
        while not q.empty():
            q.get_nowait()

    def __aiter__(self) -> AsyncSubscription:
        return self

    async def __anext__(self) -> Any:
        """The next change (or :class:`Gap`); ends with the hub, raises its error."""
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # iterating again ends again
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            self._queue.put_nowait(item)
            raise item.error
        return item


class AsyncHub:
    """Runs one change stream and hands its changes to any number of subscriptions.

    ::

        async with await changestream.aio.watch(orders) as stream:
            hub = changestream.aio.AsyncHub(stream)
            inserts = hub.subscribe(match={"operationType": "insert"})
            big = hub.subscribe(where=lambda c: c["fullDocument"]["total"] > 1000,
                                on_full="drop")
            task = asyncio.create_task(hub.run())
            async for change in inserts: ...

    Subscribe before :meth:`run` to see every change from the stream's start;
    a later subscription sees the changes from then on. The hub never closes the
    stream (its owner does); :meth:`stop` ends :meth:`run` after the current poll.
    """

    def __init__(self, stream: AsyncChangeStream[Any]) -> None:
        self._stream = stream
        self._subscriptions: list[AsyncSubscription] = []
        self._lock = threading.Lock()
        self._stopping = False
        self.changes = 0
        """Changes read from the stream."""
        self.error: BaseException | None = None
        """The stream's error that ended :meth:`run` (every subscriber raises it too)."""
        # sync-only: begin
        # self._thread: threading.Thread | None = None
        # sync-only: end

    def subscribe(
        self,
        where: Callable[[Any], bool] | None = None,
        *,
        match: Mapping[str, Any] | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_full: str = "block",
    ) -> AsyncSubscription:
        """A new subscription (see the module docstring for ``match``, ``max_queue``, ``on_full``)."""
        subscription = AsyncSubscription(self, where, match, max_queue, on_full)
        with self._lock:
            self._subscriptions.append(subscription)
        return subscription

    @property
    def subscriptions(self) -> int:
        """Subscriptions the hub still feeds."""
        return len(self._subscriptions)

    def _forget(self, subscription: AsyncSubscription) -> None:
        with self._lock:
            if subscription in self._subscriptions:
                self._subscriptions.remove(subscription)

    def stop(self) -> None:
        """End :meth:`run` after the current poll (at most ``max_await_time_ms``)."""
        self._stopping = True

    async def run(self) -> None:
        """Read the stream and feed the subscriptions until :meth:`stop` or the stream ends."""
        stream = self._stream
        error: BaseException | None = None
        try:
            while not self._stopping and stream.alive:
                change = await stream.try_next()
                if change is None:
                    continue
                self.changes += 1
                token = stream.resume_token
                with self._lock:
                    subscriptions = list(self._subscriptions)
                for subscription in subscriptions:
                    if subscription.closed:
                        self._forget(subscription)
                    elif subscription.wants(change):
                        await subscription.offer(change, token)
        except BaseException as exc:
            error = self.error = exc
            raise
        finally:
            with self._lock:
                subscriptions, self._subscriptions = self._subscriptions, []
            for subscription in subscriptions:
                await subscription.end(error if isinstance(error, Exception) else None)

    # sync-only: begin
    # def start(self) -> Hub:
    #     """Run the hub on a daemon thread (``stop()`` then ``join()`` to end it)."""
    #     if self._thread is not None:
    #         raise RuntimeError("this hub is already running")
    #     self._thread = threading.Thread(target=self._run_quietly, name="changestream-hub",
    #                                     daemon=True)
    #     self._thread.start()
    #     return self
    #
    # def join(self, timeout: float | None = None) -> None:
    #     """Wait for the hub's thread to end."""
    #     if self._thread is not None:
    #         self._thread.join(timeout)
    #
    # def _run_quietly(self) -> None:
    #     """The thread's body: the stream's error reaches every subscriber (and ``error``)."""
    #     try:
    #         self.run()
    #     except Exception:
    #         return  # kept in self.error and queued for every subscriber
    # sync-only: end
