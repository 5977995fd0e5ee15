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

A subscriber's own failure stays its own: a ``where`` that raises ends that
subscription with the error, and the hub feeds the others. A subscription that
is closed, left by its ``with`` block, or dropped (garbage-collected) without
``close()`` releases the hub: the hub holds only the subscription's inbox, never
the subscription, so a finalizer can tell the hub it is gone.

When the hub ends (``stop()``, an invalidate, an error) every subscription ends
after its queued items: iteration stops, or raises the stream's error. Ending
never waits for a subscriber (only the hub fills a queue, so it keeps room for
the end), and ``stop()`` wakes a hub waiting for a ``"block"`` subscriber, so a
stopped hub always ends.

The sync hub uses threads and ``queue.Queue``; ``Hub.start()`` runs it on a
daemon thread.

This asyncio module is the one source of both hubs: ``tools/gen_sync.py``
writes ``changestream/_sync/_hub.py`` from it.
"""

from __future__ import annotations

import asyncio  # sync: import queue
import contextlib  # async-only
import threading
import weakref
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from .._hub_items import _END, DEFAULT_MAX_QUEUE, POLICIES, Gap, SubscriberDisconnected, _Failed
from .._match import compile_match
from ._stream import AsyncChangeStream

__all__ = ["AsyncHub", "AsyncSubscription"]

class _Inbox:
    """What the hub holds for one subscription: its queue, filter, policy and counters.

    Never the :class:`AsyncSubscription` itself, so a subscription the program drops
    is collected, and its finalizer marks the inbox ``done``.

    The queue itself is unbounded and only the hub puts changes into it, so the hub
    keeps it at ``max_queue`` changes (plus a :class:`Gap` and the end, which therefore
    never wait). A ``"block"`` hub waits for ``room``: set by the subscriber when it takes
    a change while the hub waits, by :meth:`AsyncHub.stop`, by :meth:`close` and by the
    finalizer of a dropped subscription.
    """

    def __init__(
        self,
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
        self.where = where
        self.match = None if match is None else compile_match(match)
        self.max_queue = max_queue
        self.on_full = on_full
        self.queue: Any = asyncio.Queue()  # sync: self.queue: Any = queue.Queue()
        self.room = asyncio.Event()  # sync: self.room = threading.Event()
        self.waiting = False
        """The hub waits for ``room`` (a subscriber that takes a change sets it)."""
        self.loop: asyncio.AbstractEventLoop | None = None  # async-only
        self.gap: Gap | None = None
        self.last_token: Any = None
        self.delivered = 0
        self.dropped = 0
        self.done = False
        """The hub feeds this inbox no more (ended, failed, disconnected, closed, dropped)."""
        self.closed = False
        """The subscriber closed it: iteration ends at once."""

    def wants(self, change: Any) -> bool:
        if self.match is not None and not self.match(change):
            return False
        return self.where is None or bool(self.where(change))

    def wake(self) -> None:
        """Wake a hub waiting for room; from any thread (a finalizer, another thread's stop)."""
        # async-only: begin
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self.room.set)
            return
        # async-only: end
        self.room.set()

    async def offer(self, change: Any, token: Any, stopping: Callable[[], bool]) -> None:
        """Queue ``change`` under the policy; a "block" wait ends when ``stopping()`` or done."""
        q = self.queue
        if self.on_full == "block":
            while q.qsize() >= self.max_queue:
                # waiting, cleared, then checked: a set() after the check is not missed
                self.waiting = True
                self.room.clear()
                self.loop = asyncio.get_running_loop()  # async-only
                try:
                    if self.done or stopping():
                        return
                    if q.qsize() >= self.max_queue:
                        await self.room.wait()
                finally:
                    self.waiting = False
            if self.done:
                return
            q.put_nowait(change)
        elif q.qsize() >= self.max_queue:
            if self.on_full == "disconnect":
                self.finish(SubscriberDisconnected(
                    f"the subscriber fell {self.max_queue} changes behind the hub "
                    f"(max_queue, on_full='disconnect'); resume after "
                    f"{self.last_token!r} with a stream of its own, or subscribe again"
                ))
                return
            if self.gap is None:
                self.gap = Gap(0, self.last_token, token)
            self.gap.dropped += 1
            self.gap.until_token = token
            self.dropped += 1
            return
        else:
            if self.gap is not None:
                q.put_nowait(self.gap)
                self.gap = None
            q.put_nowait(change)
        self.delivered += 1
        self.last_token = token

    def finish(self, error: BaseException | None) -> None:
        """End the inbox: the pending gap, then the end (or the error), after what is queued.

        Never waits (the queue is unbounded: nothing but the hub fills it).
        """
        if self.done:
            return
        self.done = True
        q = self.queue
        if self.gap is not None:
            q.put_nowait(self.gap)
            self.gap = None
        q.put_nowait(_END if error is None else _Failed(error))

    def close(self) -> None:
        """The subscriber closed it: drop what is queued, release a waiting hub."""
        self.done = self.closed = True
        q = self.queue
        while not q.empty():
            q.get_nowait()
        q.put_nowait(_END)  # a reader waiting elsewhere ends too
        self.wake()

    def abandon(self) -> None:
        """The subscription was garbage-collected (its finalizer, on any thread)."""
        self.done = True
        if self.waiting:
            self.wake()


class AsyncSubscription:
    """One subscriber's view of the hub: iterate it for the changes its filter accepts.

    Use it as a context manager (``async with hub.subscribe() as changes:``) or call
    :meth:`close`: a subscription left without either still releases the hub once it is
    garbage-collected, but a ``"block"`` subscriber that stops reading and is still
    referenced holds the hub (and every other subscriber) until :meth:`AsyncHub.stop`.
    """

    def __init__(self, inbox: _Inbox, forget: Callable[[_Inbox], None]) -> None:
        self._inbox = inbox
        self._forget = forget
        weakref.finalize(self, inbox.abandon)
        self.max_queue = inbox.max_queue
        self.on_full = inbox.on_full

    @property
    def delivered(self) -> int:
        """Changes queued for this subscriber."""
        return self._inbox.delivered

    @property
    def dropped(self) -> int:
        """Changes dropped (``"drop"``), each reported in a :class:`Gap`."""
        return self._inbox.dropped

    @property
    def closed(self) -> bool:
        """The hub feeds this subscription no more (closed, ended, failed or disconnected)."""
        return self._inbox.done

    def wants(self, change: Any) -> bool:
        """Does this subscriber's filter accept ``change``?"""
        return self._inbox.wants(change)

    def close(self) -> None:
        """Stop receiving: the hub forgets this subscription (and is never blocked by it)."""
        self._inbox.close()
        self._forget(self._inbox)

    async def __aenter__(self) -> AsyncSubscription:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __aiter__(self) -> AsyncSubscription:
        return self

    async def __anext__(self) -> Any:
        """The next change (or :class:`Gap`); ends with the hub, raises its error."""
        inbox = self._inbox
        if inbox.closed:
            raise StopAsyncIteration
        item = await inbox.queue.get()
        if inbox.waiting:  # the hub waits for room: there is some now
            inbox.room.set()
        if item is _END:
            inbox.queue.put_nowait(_END)  # iterating again ends again
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            inbox.queue.put_nowait(item)
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
            # ... each subscriber iterates its subscription elsewhere ...
            await hub.run()  # until stop() or the stream ends

    The sync ``Hub.start()`` runs :meth:`run` on a daemon thread; an asyncio program runs
    it as a task. Subscribe before :meth:`run` to see every change from the stream's start;
    a later subscription sees the changes from then on. The hub never closes the stream
    (its owner does); :meth:`stop` ends :meth:`run` after the current poll (at most the
    stream's ``max_await_time_ms``), whatever any subscriber does.
    """

    def __init__(self, stream: AsyncChangeStream[Any]) -> None:
        self._stream = stream
        self._inboxes: list[_Inbox] = []
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
        inbox = _Inbox(where, match, max_queue, on_full)
        with self._lock:
            self._inboxes.append(inbox)
        return AsyncSubscription(inbox, self._forget)

    @property
    def subscriptions(self) -> int:
        """Subscriptions the hub still feeds."""
        with self._lock:
            return sum(not inbox.done for inbox in self._inboxes)

    def _forget(self, inbox: _Inbox) -> None:
        with self._lock:
            if inbox in self._inboxes:
                self._inboxes.remove(inbox)

    def _stopped(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """End :meth:`run` after the current poll (at most ``max_await_time_ms``), even while
        it waits for a full ``"block"`` subscriber (safe from any thread)."""
        self._stopping = True
        with self._lock:
            inboxes = list(self._inboxes)
        for inbox in inboxes:
            if inbox.waiting:
                inbox.wake()

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
                    inboxes = list(self._inboxes)
                for inbox in inboxes:
                    if inbox.done:
                        self._forget(inbox)
                        continue
                    try:
                        wanted = inbox.wants(change)
                    except Exception as exc:  # this subscriber's filter: its error, not the hub's
                        inbox.finish(exc)
                        self._forget(inbox)
                        continue
                    if wanted:
                        await inbox.offer(change, token, self._stopped)
        except BaseException as exc:
            error = self.error = exc
            raise
        finally:
            with self._lock:
                inboxes, self._inboxes = self._inboxes, []
            for inbox in inboxes:
                inbox.finish(error if isinstance(error, Exception) else None)

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
