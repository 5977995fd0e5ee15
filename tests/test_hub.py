"""The hub: one change stream, many in-process subscribers (sync and asyncio twins)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient, monitoring

import changestream
import changestream.aio
from changestream._match import compile_match


class Aggregates(monitoring.CommandListener):
    """The change-stream commands the server receives from one client."""

    def __init__(self) -> None:
        self.aggregates = 0
        self.cursors: set[int] = set()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "aggregate" and any(
            "$changeStream" in stage for stage in event.command.get("pipeline", [])
        ):
            self.aggregates += 1
        if event.command_name == "getMore":
            self.cursors.add(int(event.command["getMore"]))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def ev(**fields: Any) -> dict[str, Any]:
    return {"operationType": "insert", "ns": {"db": "shop", "coll": "orders"}, **fields}


# -- the client-side $match -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("match", "event", "expected"),
    [
        ({"operationType": "insert"}, ev(), True),
        ({"operationType": {"$in": ["update", "delete"]}}, ev(), False),
        ({"ns.coll": "orders", "fullDocument.total": {"$gt": 100}},
         ev(fullDocument={"total": 150}), True),
        ({"fullDocument.total": {"$gte": 100, "$lt": 200}}, ev(fullDocument={"total": 200}), False),
        ({"fullDocument.total": {"$gt": 100}}, ev(fullDocument={"total": "150"}), False),
        ({"fullDocument.tags": "red"}, ev(fullDocument={"tags": ["blue", "red"]}), True),
        ({"fullDocument.flag": 1}, ev(fullDocument={"flag": True}), False),
        ({"fullDocument": {"$exists": False}}, ev(), True),
        ({"updateDescription.removedFields": {"$exists": True}}, ev(), False),
        ({"$or": [{"operationType": "delete"}, {"ns.coll": "orders"}]}, ev(), True),
        ({"$nor": [{"operationType": "insert"}]}, ev(), False),
        ({"operationType": {"$not": {"$eq": "insert"}}}, ev(), False),
        ({"operationType": {"$ne": "delete"}, "$and": [{"ns.db": "shop"}]}, ev(), True),
        ({"fullDocument.total": None}, ev(), True),
    ],
)
def test_match_evaluates_the_documented_operators_client_side(
    match: dict[str, Any], event: dict[str, Any], expected: bool
) -> None:
    assert compile_match(match)(event) is expected


@pytest.mark.parametrize(
    ("match", "message"),
    [
        ({"fullDocument.name": {"$regex": "^a"}}, r"the operator '\$regex' is not supported"),
        ({"$expr": {"$eq": ["$a", 1]}}, r"the top-level operator '\$expr' is not supported"),
        ({"a": {"$in": 3}}, r"\$in needs a list"),
        ({"a": {"$gt": 1, "b": 2}}, "mixes operators and fields"),
        ({"$or": []}, "needs a non-empty list"),
    ],
)
def test_match_refuses_what_it_does_not_support_with_one_clear_error(
    match: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compile_match(match)


# -- the sync hub ------------------------------------------------------------------------------
@pytest.fixture
def setup(simulator: Any) -> Iterator[tuple[Any, Aggregates]]:
    listener = Aggregates()
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri, event_listeners=[listener])
    client.shop.orders.insert_one({"setup": True})
    yield client.shop.orders, listener
    client.close()


def run_until(hub: Any, changes: int) -> None:
    deadline = time.monotonic() + 30
    while hub.changes < changes and time.monotonic() < deadline:
        time.sleep(0.02)
    hub.stop()
    hub.join(10)


def test_one_cursor_feeds_every_subscriber_its_own_filter_in_order(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, listener = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        subscribers = [hub.subscribe(match={"fullDocument.shard": n % 10}) for n in range(40)]
        evens = hub.subscribe(lambda c: c["fullDocument"]["i"] % 2 == 0)
        both = hub.subscribe(lambda c: c["fullDocument"]["i"] < 50,
                             match={"operationType": "insert"})
        hub.start()
        orders.insert_many([{"i": i, "shard": i % 10} for i in range(200)])
        run_until(hub, 200)
    for n, subscription in enumerate(subscribers):
        got = [c["fullDocument"]["i"] for c in subscription]
        assert got == [i for i in range(200) if i % 10 == n % 10]
    assert [c["fullDocument"]["i"] for c in evens] == list(range(0, 200, 2))
    assert [c["fullDocument"]["i"] for c in both] == list(range(50))
    # The server saw one change stream for 42 subscribers: one aggregate, one cursor.
    assert listener.aggregates == 1
    assert len(listener.cursors) == 1


def test_a_slow_subscriber_gets_a_gap_marker_when_dropping_never_silent_loss(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        slow = hub.subscribe(max_queue=5, on_full="drop")
        fast = hub.subscribe()
        hub.start()
        orders.insert_many([{"i": i} for i in range(50)])
        run_until(hub, 50)
    items = list(slow)
    changes = [x for x in items if not isinstance(x, changestream.Gap)]
    gaps = [x for x in items if isinstance(x, changestream.Gap)]
    assert [c["fullDocument"]["i"] for c in changes] == [0, 1, 2, 3, 4]
    assert len(gaps) == 1 and gaps[0].dropped == 45 == slow.dropped
    assert gaps[0].after_token == changes[-1]["_id"]
    assert len(list(fast)) == 50


def test_a_disconnect_subscriber_raises_after_its_queued_changes(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        slow = hub.subscribe(max_queue=5, on_full="disconnect")
        other = hub.subscribe()
        hub.start()
        orders.insert_many([{"i": i} for i in range(20)])
        run_until(hub, 20)
    received = []
    with pytest.raises(changestream.SubscriberDisconnected, match="fell 5 changes behind"):
        for change in slow:
            received.append(change["fullDocument"]["i"])
    assert received == [0, 1, 2, 3, 4]
    assert len(list(other)) == 20


def test_a_blocking_subscriber_holds_the_hub_and_loses_nothing(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        slow = hub.subscribe(max_queue=2)  # "block", the default
        hub.start()
        orders.insert_many([{"i": i} for i in range(30)])
        time.sleep(0.5)
        assert hub.changes <= 4  # waiting for the subscriber: 2 queued, 1 being offered
        got = []
        for change in slow:
            got.append(change["fullDocument"]["i"])
            time.sleep(0.005)
            if len(got) == 30:
                hub.stop()
        hub.join(10)
    assert got == list(range(30))


def test_bad_subscription_options_are_one_clear_error(setup: tuple[Any, Aggregates]) -> None:
    orders, _ = setup
    with changestream.watch(orders) as stream:
        hub = changestream.Hub(stream)
        with pytest.raises(ValueError, match="on_full must be one of block, drop, disconnect"):
            hub.subscribe(on_full="spill")
        with pytest.raises(ValueError, match="max_queue must be an integer >= 1"):
            hub.subscribe(max_queue=0)
        with pytest.raises(ValueError, match=r"the operator '\$where'"):
            hub.subscribe(match={"a": {"$where": "x"}})


# -- the asyncio hub ---------------------------------------------------------------------------
def test_the_async_hub_shares_one_cursor_and_marks_gaps(simulator: Any) -> None:
    listener = Aggregates()

    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            simulator.uri, event_listeners=[listener])
        orders = client.shop.orders
        await orders.insert_one({"setup": True})
        async with await changestream.aio.watch(orders, max_await_time_ms=100) as stream:
            hub = changestream.aio.AsyncHub(stream)
            subscribers = [hub.subscribe(match={"fullDocument.i": {"$lt": n}}) for n in range(1, 21)]
            slow = hub.subscribe(max_queue=3, on_full="drop")
            task = asyncio.create_task(hub.run())
            await orders.insert_many([{"i": i} for i in range(60)])
            got = [[] for _ in subscribers]

            async def read(index: int) -> None:
                async for change in subscribers[index]:
                    got[index].append(change["fullDocument"]["i"])
                    if len(got[index]) == index + 1:
                        return

            await asyncio.wait_for(asyncio.gather(*(read(i) for i in range(20))), 30)
            while hub.changes < 60:
                await asyncio.sleep(0.02)
            hub.stop()
            await asyncio.wait_for(task, 10)
        assert got == [list(range(n)) for n in range(1, 21)]
        items = [item async for item in slow]
        gaps = [x for x in items if isinstance(x, changestream.Gap)]
        assert len(items) == 4 and len(gaps) == 1 and gaps[0].dropped == 57
        await client.close()

    asyncio.run(main())
    assert listener.aggregates == 1 and len(listener.cursors) == 1


# -- the edges: a subscriber's failure or absence never stops the others; stop() always ends --
def drained(subscription: Any, seconds: float = 10) -> tuple[list[Any], BaseException | None]:
    """Everything ``subscription`` yields and how it ended, read on a thread; fails the
    test if it has not ended within ``seconds`` (a hung hub never ends its subscribers)."""
    items: list[Any] = []
    ended: list[BaseException | None] = []

    def read() -> None:
        try:
            items.extend(subscription)
        except Exception as exc:
            ended.append(exc)
        else:
            ended.append(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(seconds)
    assert ended, f"the subscription did not end within {seconds} s (after {len(items)} items)"
    return items, ended[0]


def wait_until(condition: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def numbers(items: list[Any]) -> list[int]:
    return [c["fullDocument"]["i"] for c in items if not isinstance(c, changestream.Gap)]


def test_a_drop_subscriber_that_read_a_little_never_blocks_the_end_of_the_others(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        slow = hub.subscribe(max_queue=5, on_full="drop")
        later = hub.subscribe()
        hub.start()
        orders.insert_many([{"i": i} for i in range(10)])
        wait_until(lambda: hub.changes == 10)  # slow: 5 queued, a gap pending
        first = next(slow)  # room for one: the gap and a change go in, over max_queue
        orders.insert_many([{"i": i} for i in range(10, 20)])
        wait_until(lambda: hub.changes == 20)
        hub.stop()
        hub.join(10)
        later_items, later_end = drained(later)
        slow_items, slow_end = drained(slow)
    assert numbers(later_items) == list(range(20)) and later_end is None
    assert numbers([first, *slow_items]) == [0, 1, 2, 3, 4, 10] and slow_end is None
    gaps = [x for x in slow_items if isinstance(x, changestream.Gap)]
    assert [g.dropped for g in gaps] == [5, 9] and slow.dropped == 14


def test_a_where_that_raises_ends_only_its_own_subscription(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup

    def picky(change: Any) -> bool:
        if change["fullDocument"]["i"] == 3:
            raise KeyError("no such field")
        return True

    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        bad = hub.subscribe(picky)
        good = hub.subscribe()
        hub.start()
        orders.insert_many([{"i": i} for i in range(10)])
        wait_until(lambda: hub.changes == 10 and good.delivered == 10)
        assert hub.subscriptions == 1 and bad.closed
        hub.stop()
        hub.join(10)
    bad_items, bad_end = drained(bad)
    good_items, good_end = drained(good)
    assert numbers(bad_items) == [0, 1, 2] and isinstance(bad_end, KeyError)
    assert numbers(good_items) == list(range(10)) and good_end is None
    assert hub.error is None


def test_a_dropped_subscription_releases_a_blocked_hub(setup: tuple[Any, Aggregates]) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        quitter = hub.subscribe(max_queue=2)  # "block", the default
        other = hub.subscribe()
        hub.start()
        orders.insert_many([{"i": i} for i in range(50)])
        for _change in quitter:
            break  # leaves without close(): the hub is blocked on its full queue
        wait_until(lambda: hub.changes >= 4)
        del quitter
        gc.collect()
        wait_until(lambda: hub.changes == 50)
        assert hub.subscriptions == 1
        hub.stop()
        hub.join(10)
        items, end = drained(other)
    assert numbers(items) == list(range(50)) and end is None


def test_a_subscription_is_a_context_manager_that_releases_the_hub(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        other = hub.subscribe()
        hub.start()
        with hub.subscribe(max_queue=2) as quitter:
            orders.insert_many([{"i": i} for i in range(30)])
            assert numbers([next(quitter)]) == [0]
        assert quitter.closed and list(quitter) == []
        wait_until(lambda: hub.changes == 30)
        hub.stop()
        hub.join(10)
        items, _ = drained(other)
    assert numbers(items) == list(range(30))


def test_stop_ends_a_hub_held_by_a_blocking_subscriber_that_stopped_reading(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        stuck = hub.subscribe(max_queue=2)
        hub.start()
        orders.insert_many([{"i": i} for i in range(20)])
        wait_until(lambda: hub.changes == 3)  # 2 queued, the third waits for room
        started = time.monotonic()
        hub.stop()
        hub.join(10)
        stopped_in = time.monotonic() - started
        items, end = drained(stuck)
    assert numbers(items) == [0, 1] and end is None
    assert stopped_in < 5


def test_the_sync_hub_docstring_shows_sync_usage() -> None:
    doc = changestream.Hub.__doc__ or ""
    example = doc.split("::", 1)[1].split("\n\n    ", 2)[1]
    assert "with changestream.watch(orders) as stream:" in example
    assert "asyncio" not in example and "await" not in example, example


def test_async_hub_edges_a_raising_filter_a_dropped_subscription_and_stop(
    simulator: Any,
) -> None:
    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        orders = client.shop.orders
        await orders.insert_one({"setup": True})

        def picky(change: Any) -> bool:
            if change["fullDocument"]["i"] == 3:
                raise KeyError("no such field")
            return True

        async with await changestream.aio.watch(orders, max_await_time_ms=100) as stream:
            hub = changestream.aio.AsyncHub(stream)
            bad = hub.subscribe(picky)
            slow = hub.subscribe(max_queue=5, on_full="drop")
            quitter = hub.subscribe(max_queue=2)
            good = hub.subscribe()
            task = asyncio.create_task(hub.run())
            await orders.insert_many([{"i": i} for i in range(10)])
            async for _change in quitter:
                break  # leaves without close(): the hub waits on its full queue
            while hub.changes < 10 or good.delivered < 10:
                await asyncio.sleep(0.01)  # the dropped subscription...
                if hub.changes >= 4:
                    del quitter  # ...is collected: the hub goes on
                    gc.collect()
                    quitter = None  # type: ignore[assignment]
            assert await anext(slow) is not None  # room for the gap and a change
            await orders.insert_many([{"i": i} for i in range(10, 20)])
            while hub.changes < 20:
                await asyncio.sleep(0.01)
            hub.stop()
            await asyncio.wait_for(task, 5)

            async def drain(subscription: Any) -> tuple[list[Any], BaseException | None]:
                items: list[Any] = []
                try:
                    async for item in subscription:
                        items.append(item)
                except Exception as exc:
                    return items, exc
                return items, None

            bad_items, bad_end = await asyncio.wait_for(drain(bad), 5)
            good_items, good_end = await asyncio.wait_for(drain(good), 5)
            slow_items, _ = await asyncio.wait_for(drain(slow), 5)
        assert numbers(bad_items) == [0, 1, 2] and isinstance(bad_end, KeyError)
        assert numbers(good_items) == list(range(20)) and good_end is None
        assert numbers(slow_items) == [1, 2, 3, 4, 10]
        assert hub.error is None
        await client.close()

    asyncio.run(main())


def test_async_hub_stop_and_cancel_end_a_hub_held_by_a_subscriber(simulator: Any) -> None:
    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        orders = client.shop.orders
        await orders.insert_one({"setup": True})
        async with await changestream.aio.watch(orders, max_await_time_ms=100) as stream:
            for ending in ("stop", "cancel"):
                hub = changestream.aio.AsyncHub(stream)
                stuck = hub.subscribe(max_queue=2)
                async with hub.subscribe(max_queue=2) as leaving:
                    task = asyncio.create_task(hub.run())
                    await orders.insert_many([{"i": i} for i in range(5)])
                    assert "fullDocument" in await anext(leaving)  # then leaves: close()
                while hub.changes < 3:
                    await asyncio.sleep(0.01)
                if ending == "stop":
                    hub.stop()
                    await asyncio.wait_for(task, 5)
                else:
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await asyncio.wait_for(task, 5)
                assert len([c async for c in stuck]) == 2, ending  # then the end
                assert [c async for c in leaving] == []  # closed: ends at once
        await client.close()

    asyncio.run(main())
