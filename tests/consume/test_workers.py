"""Handler calls on threads and tasks (``_sync._workers``, ``aio._workers``) and the ``on_error`` policy
(``_sync._sync_io.call_handler``, ``aio._async_io.call_handler``).

Real threads and tasks with random handler delays: per-key order holds, the
watermark never passes an unfinished change, the first failure stops every
start and reaches the fetching side, ``settle`` waits for running calls only.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Hashable
from typing import Any

import pytest

from changestream._consumer.handler_errors import HandlerCalls, OnError
from changestream._lanes import BARRIER, Lanes
from changestream._sync import _sync_io, _workers
from changestream.aio import _async_io
from changestream.aio import _workers as aio_workers


def keyed(change: tuple[Hashable, int]) -> Hashable:
    return change[0]


def changes(count: int, keys: int, seed: int) -> list[tuple[Hashable, int]]:
    rng = random.Random(seed)
    return [(BARRIER if rng.random() < 0.02 else f"k{rng.randrange(keys)}", i)
            for i in range(count)]


class Checker:
    """Records handler calls and checks order and exclusivity while they run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[Hashable, int] = {}
        self.order: list[tuple[Hashable, int]] = []
        self.problems: list[str] = []
        self.barrier_running = False

    def enter(self, change: tuple[Hashable, int]) -> None:
        key, position = change
        with self.lock:
            if self.barrier_running:
                self.problems.append(f"{position} ran beside a barrier")
            if key is BARRIER:
                if self.running:
                    self.problems.append(f"barrier {position} ran beside {self.running}")
                self.barrier_running = True
            elif key in self.running:
                self.problems.append(f"{key} ran twice at once")
            self.running[key] = position
            self.order.append(change)

    def leave(self, change: tuple[Hashable, int]) -> None:
        with self.lock:
            del self.running[change[0]]
            if change[0] is BARRIER:
                self.barrier_running = False

    def check(self, stream: list[tuple[Hashable, int]]) -> None:
        assert not self.problems, self.problems[:5]
        assert sorted(p for _, p in self.order) == [p for _, p in stream]
        for key in {k for k, _ in stream}:
            seen = [p for k, p in self.order if k == key]
            assert seen == sorted(seen), f"{key} out of order"


def test_threads_keep_per_key_order_and_barriers_under_random_delays() -> None:
    stream = changes(600, keys=12, seed=1)
    checker = Checker()
    rng = random.Random(2)
    delays = [rng.choice((0, 0, 0.0005, 0.002)) for _ in stream]

    def handle(change: tuple[Hashable, int]) -> None:
        checker.enter(change)
        time.sleep(delays[change[1]])
        checker.leave(change)

    lanes = Lanes(workers=8, max_in_flight=32)
    workers = _workers.ThreadWorkers(handle, HandlerCalls(None), lanes, keyed)
    watermarks = []
    for change in stream:
        workers.room()
        workers.submit(change, change[1])
        watermark, _ = workers.progress()
        if watermark is not None:
            with checker.lock:  # every change up to the watermark has finished
                finished = {p for _, p in checker.order} - {p for p in checker.running.values()}
            assert set(range(watermark + 1)) <= finished
            watermarks.append(watermark)
        assert lanes.in_flight <= 32
    assert workers.settle(None)
    workers.close()
    checker.check(stream)
    assert workers.progress() == (599, 600)
    assert watermarks == sorted(watermarks)


def test_tasks_keep_per_key_order_and_barriers_under_random_delays() -> None:
    stream = changes(600, keys=12, seed=3)
    checker = Checker()
    rng = random.Random(4)
    delays = [rng.choice((0, 0, 0.0005, 0.002)) for _ in stream]

    async def handle(change: tuple[Hashable, int]) -> None:
        checker.enter(change)
        await asyncio.sleep(delays[change[1]])
        checker.leave(change)

    async def main() -> None:
        lanes = Lanes(workers=50, max_in_flight=100)
        workers = aio_workers.AsyncWorkers(handle, HandlerCalls(None), lanes, keyed)
        for change in stream:
            await workers.room()
            workers.submit(change, change[1])
            assert lanes.in_flight <= 100 and lanes.running <= 50
        assert await workers.settle(None)
        assert workers.progress() == (599, 600)

    asyncio.run(main())
    checker.check(stream)


def test_a_failure_stops_every_start_and_reaches_the_fetching_thread() -> None:
    release = threading.Event()

    def handle(change: tuple[Hashable, int]) -> None:
        if change[1] == 3:
            raise ValueError("poison")
        if change[1] == 1:
            release.wait(10)  # a slow change before the poison one, still running

    lanes = Lanes(workers=4, max_in_flight=100)
    workers = _workers.ThreadWorkers(handle, HandlerCalls(None), lanes, keyed)
    with contextlib.suppress(ValueError):  # the failure may already stop a later submit
        for position in range(5):
            workers.submit((f"k{position}", position), position)
    while workers.failure is None:
        time.sleep(0.001)
    with pytest.raises(ValueError, match="poison"):
        workers.room()
    release.set()
    assert workers.settle(None)
    watermark, _ = workers.progress()
    assert watermark == 2  # never past the failed change 3, whatever finished after it
    failure = workers.restart()
    assert isinstance(failure, ValueError)
    workers.submit(("k3", 30), 3)  # usable again from the watermark (a reopened stream)
    assert workers.settle(None) and workers.progress()[0] == 3
    workers.close()


def test_settle_gives_up_after_the_timeout_and_keeps_the_watermark() -> None:
    hold = threading.Event()
    lanes = Lanes(workers=2, max_in_flight=10)
    workers = _workers.ThreadWorkers(lambda change: hold.wait(10), HandlerCalls(None), lanes, keyed)
    workers.submit(("a", 0), 0)
    workers.submit(("a", 1), 1)  # waits behind 0 in lane "a": dropped by settle
    assert workers.settle(0.05) is False
    assert workers.progress() == (None, 0)
    hold.set()
    workers.close()


def test_async_settle_cancels_calls_still_running_after_the_timeout() -> None:
    async def main() -> None:
        lanes = Lanes(workers=2, max_in_flight=10)
        workers = aio_workers.AsyncWorkers(lambda change: asyncio.sleep(30), HandlerCalls(None),
                                      lanes, keyed)
        workers.submit(("a", 0), 0)
        workers.submit(("b", 1), 1)
        await asyncio.sleep(0)
        assert await workers.settle(0.05) is False
        assert workers.progress() == (None, 0) and lanes.running == 0

    asyncio.run(main())


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self, change: Any) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"failure {self.calls}")


def test_on_error_retries_then_succeeds_and_counts_the_retries() -> None:
    calls = HandlerCalls(OnError(retries=3, backoff_initial=0, backoff_max=0))
    handler = Flaky(2)
    _sync_io.call_handler(handler, "change", calls)
    assert handler.calls == 3 and calls.retries == 2 and calls.dead_letters == 0


def test_on_error_without_dead_letter_raises_the_last_exception() -> None:
    calls = HandlerCalls(OnError(retries=1, backoff_initial=0, backoff_max=0))
    with pytest.raises(RuntimeError, match="failure 2"):
        _sync_io.call_handler(Flaky(5), "change", calls)
    assert calls.retries == 1 and calls.dead_letters == 0


def test_on_error_dead_letters_after_the_retries_sync_and_async() -> None:
    letters: list[tuple[Any, str]] = []
    policy = OnError(retries=2, backoff_initial=0, backoff_max=0,
                     dead_letter=lambda change, exc: letters.append((change, str(exc))))
    calls = HandlerCalls(policy)
    _sync_io.call_handler(Flaky(5), "c1", calls)
    assert letters == [("c1", "failure 3")] and calls.dead_letters == 1 and calls.retries == 2

    async def dead_letter(change: Any, exc: BaseException) -> None:
        letters.append((change, str(exc)))

    async def handler(change: Any) -> None:
        raise KeyError(change)

    async_calls = HandlerCalls(OnError(retries=1, backoff_initial=0, backoff_max=0,
                                       dead_letter=dead_letter))
    asyncio.run(_async_io.call_handler(handler, "c2", async_calls))
    assert letters[-1] == ("c2", "'c2'") and async_calls.dead_letters == 1


@pytest.mark.parametrize(("options", "message"), [
    ({"retries": -1}, "retries must be an integer >= 0"),
    ({"retries": 1.5}, "retries must be an integer >= 0"),
    ({"backoff_initial": float("nan")}, "backoff_initial must be a number"),
    ({"backoff_initial": 5, "backoff_max": 1}, "backoff_initial <= backoff_max"),
    ({"dead_letter": "queue"}, "dead_letter must be a function"),
])
def test_bad_on_error_options_are_one_clear_error(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OnError(**options)


def test_the_sync_stop_watcher_interrupts_the_stream_and_never_closes_it() -> None:
    """``stop`` set while a stream is polled: the watcher thread calls ``interrupt()`` (the one
    call safe from another thread), under a client-side timeout, and leaves ``close()`` to the
    polling thread (a snapshot's close from aside ended the session its copy was using)."""
    from pymongo import _csot

    calls: list[tuple[str, float | None]] = []

    class Stream:
        def interrupt(self) -> None:
            calls.append(("interrupt", _csot.remaining()))

        def close(self) -> None:
            calls.append(("close", None))

    stop = threading.Event()
    with _sync_io.stop_closes(stop, 7.0) as current:
        current.stream = Stream()  # type: ignore[assignment]
        stop.set()
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [name for name, _ in calls] == ["interrupt"]
    remaining = calls[0][1]
    assert remaining is not None and 0 < remaining <= 7.0, "bounded by the call timeout"


def test_next_or_stop_with_stop_already_set_polls_nothing() -> None:
    """A stop already set returns at once on both sides: no poll that may wait for the
    server's await (the asyncio side started a full, unraced ``try_next`` then)."""
    polls: list[str] = []

    class Stream:
        buffered = 0

        def try_next(self) -> Any:
            polls.append("sync")

    class AsyncStream:
        buffered = 0

        async def try_next(self) -> Any:
            polls.append("async")

    stop = threading.Event()
    stop.set()
    assert _sync_io.next_or_stop(Stream(), stop) is _sync_io.ABANDONED  # type: ignore[arg-type]

    async def main() -> Any:
        event = asyncio.Event()
        event.set()
        return await _async_io.next_or_stop(AsyncStream(), event)  # type: ignore[arg-type]

    assert asyncio.run(main()) is _async_io.ABANDONED
    assert polls == []


def test_waiting_for_room_without_a_stop_sleeps_until_a_job_finishes() -> None:
    """Without ``stop`` nothing needs looking at: the fetching thread's wait for room woke
    20 times a second for nothing."""
    hold = threading.Event()
    lanes = Lanes(workers=2, max_in_flight=2)
    workers = _workers.ThreadWorkers(lambda change: hold.wait(10), HandlerCalls(None), lanes,
                                     keyed)
    timeouts: list[float | None] = []
    condition = workers._room
    wait = condition.wait

    def counting_wait(timeout: float | None = None) -> bool:
        timeouts.append(timeout)
        return wait(timeout)

    condition.wait = counting_wait  # type: ignore[method-assign]
    workers.submit(("a", 0), 0)
    workers.submit(("b", 1), 1)
    waiter = threading.Thread(target=workers.room)
    waiter.start()
    deadline = time.monotonic() + 10
    while not timeouts and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # long enough for several wake-ups at the old 50 ms
    hold.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert timeouts and set(timeouts) == {None}
    workers.close()
